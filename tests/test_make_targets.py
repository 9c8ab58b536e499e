"""Every `make` target README.md and docs/ name runs as written (with --help, or at the smallest size).

The targets run with this interpreter's environment (``BIN``) and without reinstalling it
(``-o`` on the install stamps), so the test needs no network and no second install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    bin_dir = str(Path(sys.executable).parent)
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "-o", ".venv-vllm/.installed",
           "-o", ".venv-sglang/.installed", "-o", ".venv-dynamo/.installed", f"BIN={bin_dir}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def readme_targets() -> set[str]:
    """The targets README.md and the pages of docs/ name."""
    targets: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        targets |= set(re.findall(r"`make ([a-z][a-z-]*)", text)) | set(re.findall(r"^make ([a-z][a-z-]*)", text, re.M))
    return targets


#: how each target the docs name is run here: make arguments, and what its output must say
RUNS = {
    "run": (["run", "ARGS=multiturn --help"], "hicache bench multiturn"),
    "bench": (["bench", "ARGS=--help"], "transfer.py"),
    "bench-storage": (["bench-storage", "ARGS=--help"], "storage.py"),
    "gpu-check": (["gpu-check", "ARGS=--help"], "gpu_check.py"),
    "test": (["test", "TEST_ARGS=--version", "VLLM_TESTS=", "SGLANG_TESTS="], "-m pytest --version"),
}


def test_the_readme_names_only_targets_this_test_knows() -> None:
    assert readme_targets() <= set(RUNS) | {"bench-vllm", "bench-serve", "venv-vllm", "bench-sglang", "venv-sglang"}, \
        readme_targets()


@pytest.mark.parametrize("target", sorted(RUNS))
def test_each_target_runs_as_documented(target: str) -> None:
    args, expected = RUNS[target]
    proc = make(*args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expected in proc.stdout, proc.stdout[-2000:]


def test_make_run_alone_runs_the_multiturn_benchmark_and_make_bench_takes_no_benchmark_name() -> None:
    dry = make("-n", "run")
    assert dry.returncode == 0 and re.search(r"hicache bench multiturn\s*$", dry.stdout, re.M), dry.stdout
    bench = make("-n", "bench")
    assert bench.returncode == 0 and "multiturn" not in bench.stdout, bench.stdout


def test_the_vllm_targets_parse_and_name_the_second_environment() -> None:
    # vLLM lives in .venv-vllm (several GB): its targets are checked as a dry run, and the command
    # bench-vllm runs is run with this environment's `hicache`, whose CLI parses the same options.
    dry = make("-n", "bench-vllm", "VLLM_ARGS=--help")
    assert dry.returncode == 0 and ".venv-vllm/bin/hicache bench vllm --help" in dry.stdout, dry.stdout + dry.stderr
    assert make("-n", "venv-vllm").returncode == 0
    here = make("bench-vllm", f"VLLM_BIN={Path(sys.executable).parent}", "VLLM_ARGS=--help")
    assert here.returncode == 0 and "hicache bench vllm" in here.stdout, here.stdout[-2000:] + here.stderr[-2000:]
    dry = make("-n", "bench-serve", "VLLM_ARGS=--help")
    assert dry.returncode == 0 and ".venv-vllm/bin/hicache bench serve --help" in dry.stdout, dry.stdout + dry.stderr
    here = make("bench-serve", f"VLLM_BIN={Path(sys.executable).parent}", "VLLM_ARGS=--help")
    assert here.returncode == 0 and "hicache bench serve" in here.stdout, here.stdout[-2000:] + here.stderr[-2000:]


def test_the_sglang_targets_name_the_third_environment() -> None:
    # SGLang lives in .venv-sglang: its targets are checked as a dry run.
    dry = make("-n", "bench-sglang", "ARGS=--help")
    assert dry.returncode == 0 and ".venv-sglang/bin/python benchmarks/sglang_storage.py --help" in dry.stdout, dry.stdout
    assert make("-n", "venv-sglang").returncode == 0
    test = make("-n", "test")
    assert test.returncode == 0 and ".venv-sglang/bin/python -m pytest tests/sglang" in test.stdout, test.stdout


def test_make_test_builds_the_dynamo_environment_the_router_test_uses() -> None:
    # Dynamo's indexer (tests/test_dynamo_indexer.py) runs from .venv-dynamo: `make test` builds it.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-B", "venv-dynamo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert dry.returncode == 0 and "--no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1" in dry.stdout, dry.stdout
    test = make("-n", "test")
    assert test.returncode == 0, test.stderr
    rules = subprocess.run(["make", "--no-print-directory", "-p", "-n", "test"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, check=False).stdout
    assert re.search(r"^test: .*\$\(DYNAMO_STAMP\)|^test: .*\.venv-dynamo/\.installed", rules, re.M), "test does not build it"


def test_the_readme_starts_with_exactly_the_two_set_up_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    assert first_block is not None and text[: first_block.start()].count("\n") <= 2, "the commands come first"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).strip().splitlines()]
    assert commands == ["make run", "make test"], commands
