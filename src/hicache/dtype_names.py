"""The names hicache's spec and namespaces give torch dtypes: one map for every integration."""

from __future__ import annotations

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
