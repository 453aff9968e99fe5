"""`cellswarm lab` where it cannot run: one line saying why, exit status 2, nothing built.
(The lab itself is tests/test_lab.py, which needs root and network namespaces.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from cellswarm.cli import main
from cellswarm.lab import system


def test_without_root_the_lab_refuses_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    assert main(["lab", "up", "--state-dir", str(tmp_path / "lab"), "--detach"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "sudo" in err
    assert not (tmp_path / "lab" / "lab.json").exists()


def test_elsewhere_than_linux_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system.sys, "platform", "darwin")
    assert "Linux network namespaces" in str(system.why_not_supported())


def test_status_of_no_lab_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lab", "status", "--state-dir", str(tmp_path)]) == 2
    assert "cellswarm lab up" in capsys.readouterr().err
