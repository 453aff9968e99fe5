"""A model file this user may not read: every command that takes one says so in one line
(the file, and to check its owner and mode) and exits 2 — it was a traceback. Run without
the capability that lets root read anyway (setpriv), as an ordinary user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = [["generate", "--model", "{f}", "hi"], ["plan", "{f}"], ["verify", "{f}"],
            ["coordinator", "--model", "{f}", "--listen", "127.0.0.1:0"],
            ["eval", "{f}", "--quant", "q8_0"], ["doctor", "--model", "{f}"],
            ["up", "--model", "{f}", "--workers", "1", "--state-dir", "{d}"]]  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv (util-linux) to drop DAC override")
def test_an_unreadable_model_file_is_one_line_from_every_command(
    demo_path: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.gguf"
    shutil.copyfile(demo_path, secret)
    secret.chmod(0o600)
    os.chown(secret, 65534, 65534)  # nobody's: root without DAC override may not read it
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search"]  # fmt: skip
    said = {}
    for command in COMMANDS:
        args = [a.format(f=secret, d=tmp_path / "state") for a in command]
        out = subprocess.run([*drop, sys.executable, "-m", "cellswarm.cli", *args],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = out.stderr.strip().splitlines()
        said[command[0]] = (out.returncode, lines[-1] if lines else "", len(lines))
    for name, (code, line, n) in said.items():
        assert code == 2 and n == 1, (name, code, line, n)
        assert str(secret) in line and "owner and mode" in line, (name, line)
