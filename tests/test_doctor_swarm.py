"""`cellswarm doctor --coordinator`: a healthy local swarm passes every line, and each fault
planted on purpose is named by the step the seed says — a node whose kernels give wrong
numbers by its matmul, a node running another version by the environment's comparison, a
node whose disk is full by its disk line, a wrong tokenizer by the input step (before any
request is tried)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellswarm import doctor
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.gguf_write import write_gguf
from cellswarm.swarm.auth import load_token
from cellswarm.swarm.local.up import LocalSwarm
from tests.test_disk_full import fill, tmpfs


def by_name(results: list[doctor.Result]) -> dict[str, doctor.Result]:
    return {r.name: r for r in results}


def test_a_healthy_swarm_passes_every_line_and_the_command_exits_0(
    demo_path: Path, tmp_path: Path
) -> None:
    with LocalSwarm(str(demo_path), 3, "200M", tmp_path, stages=2) as swarm:
        swarm.wait_ready()
        out = subprocess.run(
            [sys.executable, "-m", "cellswarm.cli", "doctor", "--coordinator", swarm.url,
             "--token-file", str(swarm.token_file)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(line.startswith("PASS") for line in lines[:-1]), out.stdout
    steps = [line.split()[1] for line in lines[:-1]]
    # the seed's order: the symptom, the input, the nodes in stages, the environment, a request
    order = ["symptom", "input", "node", "environment", "request"]
    assert [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s] == order
    for node in ("worker-0", "worker-1", "worker-2"):
        for check in ("echo", "matmul", "forward", "memory", "disk"):
            assert any(f"{node} {check}" in line for line in lines), (node, check)
    assert "Paris" in out.stdout
    assert lines[-1].startswith(f"{len(lines) - 1} of {len(lines) - 1} checks passed")


def test_doctor_takes_an_admin_key_from_a_file_never_from_the_command_line(
    demo_path: Path, tmp_path: Path
) -> None:
    """`--api-key KEY` put the key where `ps` shows it: doctor now reads the first key of
    --api-key-file (as every other client command), and the old flag is refused."""
    keys = tmp_path / "keys"
    keys.write_text("admin sk-doctor-0123456789abcdef\n")
    keys.chmod(0o600)
    with LocalSwarm(str(demo_path), 2, "256M", tmp_path / "swarm", stages=2,
                    api_key_file=str(keys)) as swarm:  # fmt: skip
        swarm.wait_ready()
        out = subprocess.run(
            [sys.executable, "-m", "cellswarm.cli", "doctor", "--coordinator", swarm.url,
             "--api-key-file", str(keys)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    old = subprocess.run([sys.executable, "-m", "cellswarm.cli", "doctor", "--coordinator",
                          swarm.url, "--api-key", "sk-doctor-0123456789abcdef"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert old.returncode == 2 and "--api-key" in old.stderr


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """worker-0's own log folder on a 4 MiB tmpfs, filled (needs root: mount)."""
    with tmpfs(tmp_path / "logs-0", "4m") as mnt:
        fill(mnt)
        yield mnt


def other_version(tmp_path: Path) -> Path:
    """A copy of this package that says it is 0.0.9: a node installed from another release."""
    root = tmp_path / "other"
    shutil.copytree(Path(doctor.__file__).parent, root / "cellswarm",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    init = root / "cellswarm" / "version.py"
    text = init.read_text()
    init.write_text(text.replace('__version__ = "0.1.0"', '__version__ = "0.0.9"'))
    assert '__version__ = "0.0.9"' in init.read_text()
    return root


def test_each_planted_fault_is_named_by_its_step(
    demo_path: Path, tmp_path: Path, full_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working folder first on sys.path
    with LocalSwarm(str(demo_path), 3, "200M", tmp_path, stages=2, own_log_dirs=True,
                    perturb={1: 1.0},  # worker-1: its arithmetic is wrong
                    worker_env={2: {"PYTHONPATH": str(other_version(tmp_path))}},
                    ) as swarm:  # fmt: skip
        swarm.wait_ready()
        results = doctor.SwarmDoctor(swarm.url, load_token(swarm.token_file)).run()
    got = by_name(results)
    lines = "\n".join(r.line() for r in results)
    # the wrong numbers: worker-1's matmul, and its forward step is not judged after it
    assert got["worker-1 matmul"].status == "FAIL", lines
    assert "wrong numbers" in got["worker-1 matmul"].fix
    assert got["worker-1 forward"].status == "SKIP"
    assert got["worker-0 matmul"].status == got["worker-2 matmul"].status == "PASS", lines
    # the other version: the environment's comparison names worker-2 and both versions
    version = got["same cellswarm"]
    assert version.status == "FAIL" and "worker-2: 0.0.9" in version.detail, lines
    assert "the others: 0.1.0" in version.detail and "install the same" in version.fix
    # the full disk: worker-0's disk line, with where and how much
    disk = got["worker-0 disk"]
    assert disk.status == "FAIL" and str(full_tmpfs) in disk.detail, lines
    assert got["worker-1 disk"].status == got["worker-2 disk"].status == "PASS"
    assert got["tokenizer"].status == "PASS"


def with_more_tokens(src: Path, out: Path, extra: int) -> Path:
    """The model file again, its tokenizer given `extra` tokens the embedding has no rows for
    (a tokenizer taken from another model)."""
    f = GGUFFile(src)
    meta = dict(f.metadata)
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"],
                                     *(f"<extra_{i}>" for i in range(extra))]  # fmt: skip
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *([1] * extra)]
    if "tokenizer.ggml.scores" in meta:
        meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], *([0.0] * extra)]
    write_gguf(out, meta, {name: f.tensor(name) for name in f.tensor_names()})
    assert len(GGUFFile(out).metadata["tokenizer.ggml.tokens"]) == n + extra
    return out


def test_a_wrong_tokenizer_is_found_by_the_input_step(demo_path: Path, tmp_path: Path) -> None:
    model = with_more_tokens(demo_path, tmp_path / "wrong-tokenizer.gguf", 128)
    with LocalSwarm(str(model), 2, "200M", tmp_path, stages=2) as swarm:
        swarm.wait_ready()
        results = doctor.SwarmDoctor(swarm.url, load_token(swarm.token_file)).run()
    got = by_name(results)
    tok = got["tokenizer"]
    assert tok.status == "FAIL" and tok.step == "input", [r.line() for r in results]
    assert "49280 tokens for 49152 embedding rows" in tok.detail
    assert "tokenizer that came with the model" in tok.fix
    assert got["short prompt"].status == "SKIP"  # no request is tried on a wrong input
    assert got["worker-0 matmul"].status == "PASS"  # the nodes are still looked at
