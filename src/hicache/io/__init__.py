"""The data plane: io backends and the transfer engine that drives them."""

from .base import IOBackend
from .direct import DirectIOBackend
from .kernel import KernelIOBackend
from .transfer import TransferEngine

__all__ = ["IOBackend", "DirectIOBackend", "KernelIOBackend", "TransferEngine"]
