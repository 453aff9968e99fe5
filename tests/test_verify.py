"""Corrupt tensor data: a NaN or infinite scale in one block of a real (small, Q8_0) GGUF file.
`cellswarm verify` names the tensor, block and row; a coordinator refuses such a file at start;
a model that loads it anyway stops at the layer where the NaN first shows, naming the layer
and the tensor — one line each, never a traceback. And the header walker's metadata arrays
are checked against the file size before anything is allocated for them."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

import cellswarm
from cellswarm import cli
from cellswarm.errors import ModelFileError, NonFiniteError
from cellswarm.io.gguf_file import SkippedArray, read_header
from cellswarm.io.gguf_write import write_gguf
from cellswarm.io.weights import Selection
from cellswarm.models import llama_config as llama
from cellswarm.quant import PackedMatrix, format_by_name
from cellswarm.verify import verify
from tests.test_bad_files import HF_CONFIGS, hf_state, with_tokenizer

Q8_0 = format_by_name("q8_0")
F16_NAN, F16_INF = b"\x00\x7e", b"\x00\x7c"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bad-files suite's tiny llama, Q8_0 where rows are whole blocks (so one token runs
    the fused C decode), with a 128-token tokenizer in its metadata."""
    cfg = HF_CONFIGS["llama"]
    config = llama.LlamaConfig.from_hf(cfg)
    tensors = llama.hf_tensors_to_gguf(config, hf_state(cfg))
    packed = {n: PackedMatrix.from_float(t, Q8_0) if t.ndim == 2 else t for n, t in tensors.items()}
    meta = config.to_gguf_metadata()
    with_tokenizer(128)(meta)
    path = tmp_path_factory.mktemp("good") / "model.gguf"
    write_gguf(path, meta, packed)  # type: ignore[arg-type]
    return path


def spoiled(good: Path, out: Path, tensor: str, row: int, block: int, value: bytes) -> Path:
    """A copy of `good` whose `tensor` has `value` (f16 bytes) as the scale of `block` of `row`."""
    info = next(t for t in read_header(good).tensors if t.name == tensor)
    per_row = info.shape[-1] // Q8_0.block_size
    at = info.offset + (row * per_row + block) * Q8_0.type_size
    data = bytearray(good.read_bytes())
    data[at : at + 2] = value
    out.write_bytes(bytes(data))
    return out


def test_a_good_file_verifies(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "ok — llama, 21 tensors, every scale of" in out
    result = verify(good)
    assert result.blocks > 0 and result.data_bytes > 0


@pytest.mark.parametrize("value", [F16_NAN, F16_INF], ids=["nan", "inf"])
def test_verify_names_the_block(
    good: Path, tmp_path: Path, value: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = spoiled(good, tmp_path / "model.gguf", "blk.1.ffn_down.weight", 7, 3, value)
    assert cli.main(["verify", str(bad)]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert (
        "is corrupt: tensor blk.1.ffn_down.weight has a NaN or infinite scale in block 59 "
        "(row 7); compare the file's sha256 with its source's" in err
    )  # 8 blocks a row of 256: row 7, block 3 is block 59


def test_a_model_stops_where_the_nan_first_shows(good: Path, tmp_path: Path) -> None:
    bad = spoiled(good, tmp_path / "model.gguf", "blk.1.ffn_down.weight", 7, 3, F16_NAN)
    model = cellswarm.load(bad)  # loading reads no scales: it loads
    message = (
        r"layer 1 made NaN or infinite activations: tensor blk\.1\.ffn_down\.weight holds a "
        r"NaN or an infinity at row 7; the file may be corrupt: check its sha256"
    )
    with pytest.raises(NonFiniteError, match=message):  # a prefill: the numpy path
        model.logits([1, 5, 9, 14])
    with pytest.raises(NonFiniteError, match=message):  # one token: the fused C decode
        model.logits([5])
    shard = cellswarm.load(bad, selection=Selection(layers=(0, 1), head=False))
    cache = shard.new_cache(4)
    assert np.isfinite(shard.forward(shard.arch.embed(np.asarray([1, 2])), cache)).all()


@pytest.mark.parametrize(
    ("tensor", "row", "where"),
    [
        ("output.weight", 100, r"the output head made .* tensor output\.weight .* row 100"),
        ("token_embd.weight", 5, r"layer 0 made .* tensor token_embd\.weight .* row 5"),
        ("blk.0.attn_q.weight", 2, r"layer 0 made .* tensor blk\.0\.attn_q\.weight .* row 2"),
    ],
)
def test_the_head_and_the_embedding_are_named_too(
    good: Path, tmp_path: Path, tensor: str, row: int, where: str
) -> None:
    bad = spoiled(good, tmp_path / "model.gguf", tensor, row, 0, F16_INF)
    with pytest.raises(NonFiniteError, match=where):
        cellswarm.load(bad).logits([5, 7, 100])


def test_generate_prints_one_line(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = spoiled(good, tmp_path / "model.gguf", "blk.0.ffn_up.weight", 3, 1, F16_NAN)
    assert cli.main(["generate", "--model", str(bad), "--ids", "1,5,9"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "layer 0 made NaN" in err
    assert "Traceback" not in err and "Warning" not in err


def test_an_expert_node_names_its_tensor(tmp_path: Path) -> None:
    """A part server checks its answer before sending it: the node that made the NaN says."""
    from cellswarm.swarm.ring.costs import part_specs
    from cellswarm.swarm.ring.parts import PartConfig, PartServer, pack_routes
    from tests.same_bits_models import write_moe

    path = write_moe(tmp_path / "moe.gguf")
    spec = part_specs(str(path), 2, 0, [0, 0])[1]  # odd experts of layers 1 and 2
    bad = tmp_path / "bad.gguf"
    info = next(t for t in read_header(path).tensors if t.name == "blk.2.ffn_up_exps.weight")
    row_bytes = info.shape[-1] // Q8_0.block_size * Q8_0.type_size
    at = info.offset + (5 * info.shape[1] + 4) * row_bytes  # expert 5, row 4, block 0
    data = bytearray(path.read_bytes())
    data[at : at + 2] = F16_NAN
    bad.write_bytes(bytes(data))
    server = PartServer(PartConfig(str(bad), spec), cellswarm.load(bad, selection=spec.selection(),
                                                                   tokenizer=False))  # fmt: skip
    h = np.ones((2, 64), np.float32)
    ids = np.asarray([[5, 7, -1, -1, -1, -1], [3, -1, -1, -1, -1, -1]])
    packed = pack_routes(h, ids, np.ones((2, 6), np.float32))
    assert np.isfinite(server.expert_rows(1, packed, 6)).all()  # layer 1 is clean
    with pytest.raises(NonFiniteError, match=r"layer 2's routed experts made .* "
                       r"blk\.2\.ffn_up_exps\.weight .* expert 5, row 4"):  # fmt: skip
        server.expert_rows(2, packed, 6)


@pytest.mark.parametrize("damage", ["nan-scale", "truncated"])
def test_a_coordinator_refuses_a_bad_model_at_start(
    good: Path, tmp_path: Path, damage: str
) -> None:
    if damage == "nan-scale":
        bad = spoiled(good, tmp_path / "model.gguf", "blk.1.attn_v.weight", 0, 1, F16_NAN)
        expected = "tensor blk.1.attn_v.weight has a NaN or infinite scale in block 1 (row 0)"
    else:
        bad = tmp_path / "model.gguf"
        bad.write_bytes(good.read_bytes()[:-100])
        expected = "is truncated: tensor"
    env = dict(os.environ, CELLSWARM_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(
        [sys.executable, "-m", "cellswarm", "coordinator", "--model", str(bad),
         "--listen", "127.0.0.1:0", "--db", f"sqlite:///{tmp_path / 'c.db'}"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cellswarm: error: ") and expected in lines[0]
    assert "Traceback" not in run.stderr and "READY" not in run.stdout


def test_a_verified_file_is_remembered(good: Path, tmp_path: Path) -> None:
    from cellswarm.verify import verify_cached

    assert verify_cached(good, tmp_path) is not None  # read every scale, once
    assert verify_cached(good, tmp_path) is None  # the header only
    later = tmp_path / "copy.gguf"
    later.write_bytes(good.read_bytes())
    assert verify_cached(later, tmp_path) is not None  # another file: verified again


# -- metadata arrays: bounded by the file before they are allocated -------------------------


def test_skimming_a_header_allocates_none_of_its_arrays(demo_path: Path) -> None:
    """The demo model's tokenizer is 49,152 strings and 48,900 merges: read, they take tens
    of MB of Python objects; skimmed, nothing (each is bounds-checked and stepped over)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    header = read_header(demo_path, skim=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = header.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, SkippedArray) and tokens.n_items == 49152
    assert header.metadata["general.architecture"] == "llama"
    assert peak < 2 << 20, peak
    assert [t.name for t in header.tensors] == [t.name for t in read_header(demo_path).tensors]


def _array_header(item_type: int, count: int, pad: int) -> bytes:
    """A GGUF v3 header with one metadata array of `count` items of `item_type` and no
    tensors, followed by `pad` zero bytes (69 bytes of header before them)."""
    key = b"tokenizer.ggml.tokens"
    head = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)
    head += struct.pack("<Q", len(key)) + key
    head += struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, item_type, count)
    return head + b"\0" * pad


PAD = 10_000_000  # zero bytes after the count: each reads as an empty string's length


@pytest.mark.parametrize("skim", [False, True])
@pytest.mark.parametrize(
    ("item_type", "count", "message"),
    [
        # 1.25M strings need 10,000,008 bytes of lengths: 8 more than the file has left.
        # Read one by one, they would make a list of a million strings before the cut shows.
        (gguf.GGUFValueType.STRING, PAD // 8 + 1, r"is truncated: metadata key "
         r"'tokenizer\.ggml\.tokens' \(1250001 items\) runs to byte 10000077 but the file "
         r"has only 10000069 bytes"),
        (gguf.GGUFValueType.STRING, PAD // 4, r"is truncated: metadata key "
         r"'tokenizer\.ggml\.tokens' \(2500000 items\) runs to byte 20000069"),
        (gguf.GGUFValueType.STRING, PAD + 100, r"is corrupt: it gives metadata key "
         r"'tokenizer\.ggml\.tokens' 10000100 items"),  # more than the file's bytes
        (gguf.GGUFValueType.ARRAY, PAD // 12 + 1, r"is truncated: metadata key"),
        (gguf.GGUFValueType.UINT64, PAD // 8 + 1, r"is truncated: metadata key"),
        (13, 5, r"is corrupt: it gives metadata key 'tokenizer\.ggml\.tokens' array item type "
         r"13, which GGUF does not define"),
    ],
    ids=["strings-cut", "strings-cut-short", "garbage-count", "arrays", "numbers", "unknown-type"],
)  # fmt: skip
def test_an_array_longer_than_the_file_is_refused_before_it_is_read(
    tmp_path: Path, skim: bool, item_type: int, count: int, message: str
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(_array_header(item_type, count, PAD))
    tracemalloc.start()
    tracemalloc.reset_peak()
    with pytest.raises(ModelFileError, match=message):
        read_header(path, skim=skim)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # no list of items made first


def test_verifying_tells_its_progress_in_bytes(good: Path) -> None:
    import io
    import itertools

    from cellswarm.swarm.node.net import Progress

    seen: list[tuple[int, int]] = []
    verify(good, progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert seen[-1][0] == total > 0 and all(a[0] < b[0] for a, b in itertools.pairwise(seen))
    out = io.StringIO()
    show = Progress("model", out, every_s=3600, verb="VERIFYING")
    show(1, 4 << 20)  # the first call prints, the next within the hour does not...
    show(2 << 20, 4 << 20)
    show(4 << 20, 4 << 20)  # ...and the last always does
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("VERIFYING model: 4.0 of 4.0 MiB (100%)")
    assert "ETA" in lines[0]


def test_a_model_skims_a_stray_array_it_does_not_need(tmp_path: Path) -> None:
    """Opening a model (what `generate` does) read every metadata array into Python lists:
    2.5 million float32s under a key no model reads took ~80 MB of objects. Arrays outside
    `tokenizer.` longer than MAX_READ_ITEMS are skimmed as verify and plan skim them; the
    tokenizer's own are read (the model needs them)."""
    from cellswarm.io.gguf_file import MAX_READ_ITEMS, GGUFFile

    count = 2_500_000
    key = b"junk.floats"
    head = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)
    head += struct.pack("<Q", len(key)) + key
    head += struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32, count)
    path = tmp_path / "stray.gguf"
    path.write_bytes(head + b"\0" * (4 * count))
    tracemalloc.start()
    tracemalloc.reset_peak()
    opened = GGUFFile(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert isinstance(opened.metadata["junk.floats"], SkippedArray) and count > MAX_READ_ITEMS
    assert peak < 2 << 20, peak
