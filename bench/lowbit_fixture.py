"""Make tests/data/llama_quantize_lowbit.gguf: rows of tensors that llama.cpp's own llama-quantize
wrote, in every low-bit type, with an importance matrix from llama-imatrix where the type needs
one, beside the float32 rows they came from. The tests check cellswarm's codecs and kernels on
these bytes (tests/test_quant_iq.py); the file is small enough to ship (tests never run
llama.cpp).

    python -m bench.lowbit_fixture        # builds llama.cpp first if needed (bench/peers.py)

A random llama with 256-wide rows (no tensor falls back to another type) and the demo model's
tokenizer is written as F32, llama-imatrix runs it over tests/data/sample_text.txt, and each
type is made by `llama-quantize --imatrix`, with `--tensor-type` for the types no file type
names (MXFP4, NVFP4 on a dense model).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench import peers

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama_quantize_lowbit.gguf"
ROWS = 8  # rows kept of each tensor
TENSOR = "blk.0.ffn_down.weight"  # 512 columns: two blocks of 256 a row
# file type (llama-quantize's name) -> the GGML type expected on TENSOR; None: --pure
MIXES: dict[str, tuple[str, list[str]]] = {
    "IQ1_S": ("IQ1_S", ["--pure"]), "IQ1_M": ("IQ1_M", ["--pure"]),
    "IQ2_XXS": ("IQ2_XXS", ["--pure"]), "IQ2_XS": ("IQ2_XS", ["--pure"]),
    "IQ2_M": ("IQ2_S", ["--pure"]), "IQ3_XXS": ("IQ3_XXS", ["--pure"]),
    "IQ3_S": ("IQ3_S", ["--pure"]), "IQ4_NL": ("IQ4_NL", ["--pure"]),
    "IQ4_XS": ("IQ4_XS", ["--pure"]), "TQ1_0": ("TQ1_0", ["--pure"]),
    "TQ2_0": ("TQ2_0", ["--pure"]), "Q2_K": ("Q2_K", ["--pure"]), "Q3_K_M": ("Q3_K", ["--pure"]),
    "Q5_K_M": ("Q5_K", ["--pure"]), "Q5_1": ("Q5_1", ["--pure"]),
    "MXFP4": ("MXFP4", ["--tensor-type", "ffn_down=mxfp4"]),
}  # fmt: skip


def f32_model(folder: Path) -> Path:
    from cellswarm.io.gguf_write import write_gguf
    from cellswarm.models.llama_config import LlamaConfig

    config = LlamaConfig(arch="llama", rope_layout="norm", n_layers=2, d_model=256, n_heads=4,
                         n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=49152,
                         context_length=512, rms_eps=1e-5, rope_theta=10000.0,
                         rope_dim=64)  # fmt: skip
    rng = np.random.default_rng(55)
    tensors: dict[str, Any] = {}
    for name, shape in dict(config.expected_tensors(range(config.n_layers))).items():
        norm = name.endswith("norm.weight")
        tensors[name] = (np.ones(shape) if norm else rng.standard_normal(shape) * 0.02).astype(
            np.float32
        )
    path = folder / "f32.gguf"
    write_gguf(path, config.to_gguf_metadata() | peers.tokenizer_metadata(), tensors)
    return path


def main() -> None:
    from cellswarm.io.gguf_file import GGUFFile
    from cellswarm.io.gguf_write import write_gguf
    from cellswarm.quant import PackedMatrix, format_by_name

    llama = peers.install_llama_cpp()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = f32_model(folder)
        imatrix = folder / "imatrix.gguf"
        subprocess.run([llama.exe("llama-imatrix"), "-m", str(source), "-f", str(peers.TEXT),
                        "-o", str(imatrix), "-c", "128", "-t", "2"], check=True,
                       capture_output=True)  # fmt: skip
        src = GGUFFile(source)
        f32 = np.asarray(src.tensor(TENSOR).dequantize())[:ROWS]
        tensors: dict[str, Any] = {"F32": np.ascontiguousarray(f32)}
        for mix, (kind, extra) in MIXES.items():
            out = folder / f"{mix}.gguf"
            args = [llama.exe("llama-quantize"), "--imatrix", str(imatrix), *extra,
                    "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0", str(source),
                    str(out), mix if mix != "MXFP4" else "Q8_0"]  # fmt: skip
            done = subprocess.run(args, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"llama-quantize {mix}: {done.stderr.strip()[-400:]}")
            t = GGUFFile(out).tensor(TENSOR)
            assert isinstance(t, PackedMatrix) and t.fmt.name == kind, (mix, t)
            raw = np.ascontiguousarray(t.data[:ROWS])
            tensors[kind] = PackedMatrix(raw, format_by_name(kind))
            print(f"{mix}: {TENSOR} is {kind}, {raw.shape[1]} bytes a row")
        meta = {"general.architecture": "cellswarm-fixture",
                "general.name": f"rows of {TENSOR} written by {llama.label}"}  # fmt: skip
        write_gguf(OUT, meta, tensors)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
