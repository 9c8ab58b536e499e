"""The controller: background workers that move pages between tiers."""

from .controller import CacheController
from .evictor import Evictor
from .jobs import BackupJob, JobTracker, LoadJob

__all__ = ["CacheController", "Evictor", "BackupJob", "LoadJob", "JobTracker"]
