"""The command line: the demo runs end to end and verifies its own reads; config errors are clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cli import main

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def test_demo_runs_and_verifies_every_read(capsys: pytest.CaptureFixture[str]) -> None:
    main(["demo", "--turns", "3", "--clients", "2", "--turn-tokens", "300"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().endswith(tuple("0123456789")) and "yes" in line]
    assert len(rows) == 6 and "NO" not in out
    assert "host" in out and "stats:" in out


def test_config_command_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", str(CONFIG_DIR / "small.yaml")]) == 0
    assert "page_size: 16" in capsys.readouterr().out


def test_config_command_reports_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies:\n  eviction: random\n")
    assert main(["config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "policies.eviction" in err and "random" in err
