"""The command line: the demo runs end to end and verifies its own reads; config errors are clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cli import main

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def test_demo_runs_and_verifies_every_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_DEMO_PAGES", str(tmp_path / "pages"))
    main(["demo", "--turns", "3", "--clients", "2", "--turn-tokens", "300"])
    out = capsys.readouterr().out
    chat, restart = out.split("restart:")
    rows = [line.split() for line in chat.splitlines() if line.strip().endswith(tuple("0123456789")) and "yes" in line]
    assert len(rows) == 6 and "NO" not in out
    assert "host" in out and "stats:" in out
    # After the restart every conversation comes back whole, from the file tier.
    again = [line.split() for line in restart.splitlines() if "yes" in line]
    assert [(r[1], r[2], r[3]) for r in again] == [("900", "896", "896")] * 2
    assert any((tmp_path / "pages").rglob("*.kv"))


def test_config_command_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", str(CONFIG_DIR / "small.yaml")]) == 0
    assert "page_size: 16" in capsys.readouterr().out


def test_config_command_reports_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies:\n  eviction: random\n")
    assert main(["config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "policies.eviction" in err and "random" in err
