"""The vLLM tests run in the vLLM environment (.venv-vllm; `make test` runs them there).

Elsewhere vLLM is not installed and this folder is not collected. The tests never import vLLM
themselves: each engine runs in its own process (``engine_run.py``)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
