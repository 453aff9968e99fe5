"""cellswarm against llama.cpp: the same GGUF files, the same threads, in the same run.

    python -m bench.peers [--only SUBSTRING] [--threads 1,2] [--rounds R] [--quick] [--json]
                          [--check] [--perplexity] [--makers download,llama-quantize,pure]
                          [--baseline OTHER_CHECKOUT]

The first run installs llama.cpp into the cache folder (`$CELLSWARM_CACHE/peers`, by default
~/.cache/cellswarm/peers): pip downloads the llama-cpp-python sdist from PyPI (pinned below;
it vendors llama.cpp's source), and cmake builds its llama-bench, llama-simple and
llama-perplexity for this CPU (GGML_NATIVE, CPU backend only, Release, static). Later runs
reuse it; `build.json` there records the llama.cpp commit and how long the build took.

Then it writes random-weight models with cellswarm's own GGUF writer into `peers/models`
(seeded, so the same bytes every time, and reused): a dense llama of ~0.29B params (Q4_0,
Q4_1, Q8_0, Q4_K, Q6_K), one of ~0.96B (Q4_0, Q8_0, Q4_K), and a DeepSeek-V3-shaped MoE of
~0.84B (MLA with a q LoRA, 64 routed experts top-6 in 8 groups (4 used) with sigmoid gating
and a correction bias, one shared expert, the first layer dense, YaRN; Q4_0, Q8_0, Q4_K) in
llama.cpp's current absorbed-MLA layout (attn_k_b / attn_v_b). Every 2-D and 3-D weight is
in the named format, as `llama-quantize --pure` writes a file, except where llama.cpp keeps
float (norms, the router, its bias) and where a row is not whole 256-blocks (attn_k_b's 64:
Q5_0 for Q4_K, as llama-quantize falls back). Q4_K and Q6_K blocks are packed here by
rounding to nearest (cellswarm's codecs only read K-quants); both engines read the same bits.
The tokenizer is the demo model's (SmolLM2, 49,152 tokens), which llama.cpp requires.

Those are the "pure" files. Users download files that llama.cpp's quantizer made with its
default mixes, so the bench also runs llama-quantize (built with the rest) on each model's
F32 file: the dense 0.3B as Q4_0 and Q4_K_M, the MoE as Q4_0, Q8_0 and Q4_K_M ("llama-quantize"
rows: a Q6_K output head, Q4_K_M's Q6_K attn_v and half the ffn_down, the MoE's own choices
for its experts and the 64-wide attn_k_b), and the demo model as its wheel ships it (made by
llama.cpp's converter, Q4_1: the "download" row). `--makers` picks which.

`--baseline DIR` runs a second cellswarm, another checkout (a `git worktree` of the commit
before a kernel change), on every row beside the two engines and prints its tokens/s and the
ratio now / before: what the change cost per row.

Before measuring, every file is run by both engines: llama-simple and cellswarm each continue
a prompt greedily for 8 tokens, and the line says how many leading tokens agree. Random
weights give flat logits (the "margin" is cellswarm's top-1 minus top-2 logit for the first
token), so rounding (int8 activations, llama.cpp's f16 KV cache) may flip a near tie:
agreement checks that a file means the same thing to both engines, not its quality. The MoE
amplifies rounding: its 64 sigmoid router scores sit ~0.01 apart, a flipped choice replaces
a sixth of a layer's FFN output, and 7 MoE layers compound it, so its tokens part within a
few steps even in float32 (the F32 control file, written for this check only). When this
bench was written, float32 copies of smaller MoEs gave perplexities (below) within 2e-4 of
each other on the two engines, and within 6e-6 (as the dense models) once a large router
bias made the routing decisive: the same model, rounded differently.

The table: decode tokens/s (128 tokens after a short prompt; llama-bench's tg128) and
prefill tokens/s (a 512-token prompt; pp512), for llama.cpp (`llama-bench -r 3`, mean of
the repetitions) and cellswarm (a fresh process per row: `cellswarm.load`, then `Model.step`
as `cellswarm generate` runs it, with `kernels.set_threads` and, above one thread, the CPUs
kept awake (kernels/awake.py), mean of 3), and the ratio
cellswarm / llama.cpp (1.00 = as fast; above 1, cellswarm is faster). The two engines run
one after the other per row (which goes first alternates), so a busy neighbour on the
machine slows both: the load average is printed before and after.

--rounds R (default 1) runs each row's pair R times, alternating which engine goes first:
on a shared virtual machine one engine's figure can move by 20% between two runs a minute
apart, and a ratio made of two runs minutes apart measures the neighbours as much as the
engines. Then each engine's tokens/s is the median of its R runs, and the ratio is the
median of the R ratios of runs made side by side, with their range in brackets.

--perplexity runs llama-perplexity (`-c 128`: chunks of 128 tokens, the second half of each
scored) on tests/data/sample_text.txt with the demo model (a trained model, where the number
means something) and with each Q8_0 file (random: perplexity near the vocabulary size, but
it must be the same for both), next to cellswarm's perplexity computed the same way.
bench/quant_quality.py scores the same text in windows of 256 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI sdist whose vendor/llama.cpp is built
BINARIES = ("llama-bench", "llama-simple", "llama-perplexity", "llama-quantize",
            "llama-batched-bench", "llama-server", "llama-lookup", "llama-speculative",
            "llama-speculative-simple", "llama-imatrix")  # fmt: skip
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip
TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "sample_text.txt"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
CHECK_TOKENS = 8
MAKER_VERSION = 1  # in the file names: bump when the model makers change

# llama_ftype values (general.file_type) for the formats written here; Q4_K as Q4_K_S.
FILE_TYPES = {"f32": 0, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 14, "q6_k": 18}
# llama-quantize's low-bit mixes, the formats that make huge MoEs fit (issue 55), made with
# an importance matrix as their users make them
LOWBIT_MIXES = ("Q2_K", "Q3_K_M", "Q5_K_M", "IQ4_XS", "IQ3_XXS", "IQ2_XS", "IQ2_XXS", "IQ1_M",
                "IQ1_S", "TQ1_0")  # fmt: skip
# llama-quantize's fallback for a row that is not whole 256-blocks.
K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}


def peers_dir() -> Path:
    """The cache folder, beside cellswarm's kernel cache (`CELLSWARM_CACHE` moves both)."""
    root = os.environ.get("CELLSWARM_CACHE") or Path.home() / ".cache" / "cellswarm"
    return Path(root) / "peers"


# ------------------------------------------------------------------------ llama.cpp install


@dataclass(frozen=True)
class LlamaCpp:
    bin: Path
    info: dict[str, Any]

    def exe(self, name: str) -> str:
        return str(self.bin / name)

    @property
    def label(self) -> str:
        i = self.info
        return f"llama.cpp {i['version']} from the llama-cpp-python {i['llama_cpp_python']} sdist"


def install_llama_cpp(log: Any = print) -> LlamaCpp:
    """Download, unpack and build llama.cpp once; later calls find it in the cache."""
    root = peers_dir()
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    llama = src / "vendor" / "llama.cpp"
    build, stamp = llama / "build", root / f"llama.cpp-{LLAMA_CPP_PYTHON}.json"
    bin_dir = build / "bin"
    if stamp.is_file() and all((bin_dir / b).is_file() for b in BINARIES):
        return LlamaCpp(bin_dir, json.loads(stamp.read_text()))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (llama / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist from PyPI ...")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                 ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp],
                check=True,
            )  # fmt: skip
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            subprocess.run(["tar", "xzf", str(sdist), "-C", str(root)], check=True)
    jobs = str(min(os.cpu_count() or 1, 2))
    log(f"building llama.cpp in {build} (cmake, -j{jobs}; minutes on 2 cores) ...")
    with open(root / "build.log", "w") as out:
        subprocess.run(["cmake", "-S", str(llama), "-B", str(build), *CMAKE_FLAGS],
                       check=True, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", *BINARIES],
                       check=True, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    head = src / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    version = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True,
                             text=True).stderr  # fmt: skip
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "commit": head.read_text().strip() if head.is_file() else "unknown",
        "version": " ".join(re.findall(r"version: (.+)", version)) or "unknown",
        "build_seconds": round(time.perf_counter() - t0, 1),
        "cmake_flags": list(CMAKE_FLAGS),
    }
    stamp.write_text(json.dumps(info, indent=1))
    log(f"built {', '.join(BINARIES)} in {info['build_seconds']:.0f} s")
    return LlamaCpp(bin_dir, info)


# ---------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class PeerModel:
    name: str
    config: Any  # LlamaConfig | DeepseekConfig
    quants: tuple[str, ...]
    seed: int
    # Also written, for the agreement check only: the same weights in float, where neither
    # engine rounds activations (a MoE's routing turns rounding noise into other experts).
    control: str | None = None
    # Made by llama-quantize from the F32 file with its default mix (llama_ftype names), as
    # the files users download are: Q6_K output head, Q4_K_M's Q6_K attn_v / ffn_down halves.
    mixes: tuple[str, ...] = ()

    def path(self, quant: str) -> Path:
        return peers_dir() / "models" / f"{self.name}-{quant.upper()}-v{MAKER_VERSION}.gguf"


def peer_models() -> list[PeerModel]:
    from cellswarm.models.deepseek2 import DeepseekConfig
    from cellswarm.models.llama_config import LlamaConfig
    from cellswarm.models.rope import Yarn

    def llama(d: int, heads: int, kv: int, ffn: int) -> LlamaConfig:
        return LlamaConfig(
            arch="llama", n_layers=16, d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=128,
            ffn_dim=ffn, vocab_size=49152, context_length=4096, rms_eps=1e-5,
            rope_theta=500000.0, rope_dim=128, rope_layout="norm",
        )  # fmt: skip

    moe = DeepseekConfig(
        n_layers=8, d_model=1024, n_heads=16, vocab_size=49152, context_length=16384,
        rms_eps=1e-6, q_lora_rank=512, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32,
        v_head_dim=64, ffn_dim=2816, moe_ffn_dim=512, n_experts=64, n_experts_used=6,
        n_shared_experts=1, first_k_dense=1, n_groups=8, topk_groups=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, gating="sigmoid", rope_theta=10000.0,
        yarn=Yarn(factor=4.0, original_context=4096, beta_fast=32.0, beta_slow=1.0,
                  mscale=1.0, mscale_all_dim=1.0),
    )  # fmt: skip
    small = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
    return [
        PeerModel("llama-0.3B", llama(1024, 8, 4, 2816), small, 1,
                  mixes=("Q4_0", "Q4_K_M", *LOWBIT_MIXES)),
        PeerModel("llama-1B", llama(2048, 16, 8, 5632), ("q4_0", "q8_0", "q4_k"), 2),
        PeerModel("deepseek-moe-0.8B", moe, ("q4_0", "q8_0", "q4_k"), 3, control="f32",
                  mixes=("Q4_0", "Q8_0", "Q4_K_M", "Q2_K", "IQ2_XXS", "IQ1_M", "MXFP4_MOE")),
    ]


@dataclass(frozen=True)
class PeerFile:
    """One row's file. maker "pure": cellswarm's writer, every weight in one format (as
    `llama-quantize --pure`); "llama-quantize": llama.cpp's quantizer on the model's F32 file
    with its default mix for `quant`; "download": the demo model as its wheel ships it (made by
    llama.cpp's converter)."""

    model: PeerModel | None  # None: the demo model
    quant: str
    maker: str

    @property
    def label(self) -> str:
        name = self.model.name if self.model else "demo-135M"
        return f"{name} {self.quant.upper()} ({self.maker})"


def peer_files(models: Sequence[PeerModel], makers: Sequence[str], quick: bool) -> list[PeerFile]:
    files: list[PeerFile] = []
    if "download" in makers:
        files.append(PeerFile(None, "q4_1", "download"))
    for m in models:
        if "llama-quantize" in makers:
            files += [PeerFile(m, q, "llama-quantize") for q in m.mixes[: 1 if quick else None]]
        if "pure" in makers:
            files += [PeerFile(m, q, "pure") for q in m.quants[: 1 if quick else None]]
    return files


def imatrix(llama: LlamaCpp, model: PeerModel, log: Any = print) -> Path:
    """llama-imatrix over tests/data/sample_text.txt on the model's F32 file, once."""
    path = peers_dir() / "models" / f"{model.name}-imatrix-v{MAKER_VERSION}.gguf"
    if not path.is_file():
        source = make_model(model, "f32", log)
        tmp = path.with_suffix(".tmp.gguf")
        args = ["-m", str(source), "-f", str(TEXT), "-o", str(tmp), "-c", "256", "-t", "2"]
        subprocess.run([llama.exe("llama-imatrix"), *args], check=True, capture_output=True)
        tmp.replace(path)
        log(f"llama-imatrix wrote {path.name}")
    return path


def llama_quantize(llama: LlamaCpp, model: PeerModel, mix: str, log: Any = print) -> Path:
    """`llama-quantize F32FILE OUT MIX`: llama.cpp's own choice of format per tensor, with an
    importance matrix (llama-imatrix) for the low-bit mixes, as their users make them."""
    path = peers_dir() / "models" / f"{model.name}-{mix.upper()}-lq-v{MAKER_VERSION}.gguf"
    if path.is_file():
        return path
    source = make_model(model, "f32", log)
    tmp = path.with_suffix(".tmp")
    lowbit = mix in LOWBIT_MIXES or mix.startswith("IQ")
    extra = ["--imatrix", str(imatrix(llama, model, log))] if lowbit else []
    out = subprocess.run([llama.exe("llama-quantize"), *extra, str(source), str(tmp), mix],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"llama-quantize {mix} failed: {out.stderr.strip()[-500:]}")
    tmp.replace(path)
    log(f"llama-quantize wrote {path.name}: {path.stat().st_size / 2**20:.0f} MiB")
    return path


def file_path(llama: LlamaCpp, f: PeerFile, log: Any = print) -> Path:
    from cellswarm.demo import demo_model_path

    if f.model is None:
        return demo_model_path()
    if f.maker == "llama-quantize":
        return llama_quantize(llama, f.model, f.quant, log)
    return make_model(f.model, f.quant, log)


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the file, numpy-order shapes, as llama.cpp's converter names them."""
    shapes = dict(config.expected_tensors(range(config.n_layers)))
    if config.arch == "deepseek2":
        c = config
        for i in range(c.n_layers):
            p = f"blk.{i}."
            shapes[p + "attn_k_b.weight"] = (c.n_heads, c.kv_lora_rank, c.qk_nope_dim)
            shapes[p + "attn_v_b.weight"] = (c.n_heads, c.v_head_dim, c.kv_lora_rank)
            if c.is_moe(i):
                shapes[p + "exp_probs_b.bias"] = (c.n_experts,)
    return shapes


def storage_type(name: str, shape: Sequence[int], quant: str) -> str:
    """The format one tensor is written in, for a file of `quant` (llama-quantize's rules)."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
        return "f32"  # norms, biases and the MoE router stay float
    row = shape[-1]
    if quant in K_FALLBACK and row % 256:
        quant = K_FALLBACK[quant]
    return quant if row % 32 == 0 else "f16"


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def pack_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 (n, 256) -> Q4_K blocks (n, 144) by rounding to nearest: per 32-element
    sub-block x ≈ d*sc*q - dmin*m, q in 0..15, 6-bit sc and m, f16 d and dmin."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)  # (n, 8)
    scale = (sub.max(axis=-1) - lo) / 15
    d = _f16_round(scale.max(axis=-1) / 63)  # (n,)
    dmin = _f16_round(-lo.min(axis=-1) / 63)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # (n, 8)
    q = np.rint((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)  # 64-value chunks, 2 nibbles
    out = np.empty((n, 144), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(n, 2)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return out


def pack_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 (n, 256) -> Q6_K blocks (n, 210) by rounding to nearest: per 16-element
    sub-block x ≈ d*sc*q, q in -32..31, int8 sc, f16 d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # (n, 16)
    d = _f16_round(scale.max(axis=-1) / 127)  # (n,)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.rint(sub / np.where(step > 0, step, 1)[..., None])
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # 128-value halves
    lo, hi = u & 15, u >> 4
    out = np.empty((n, 210), np.uint8)
    out[:, 0:128] = (lo[..., :64] | (lo[..., 64:] << 4)).reshape(n, 128)
    out[:, 128:192] = (
        hi[..., 0:32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)
    ).reshape(n, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    return out


K_PACKERS = {"q4_k": pack_q4_k, "q6_k": pack_q6_k}


def pack(w: np.ndarray, fmt_name: str) -> Any:
    """A float32 weight (2-D, or 3-D per head/expert) -> PackedMatrix / PackedExperts."""
    from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name

    fmt = format_by_name(fmt_name)
    cls = PackedMatrix if w.ndim == 2 else PackedExperts
    if fmt_name not in K_PACKERS:
        return cls.from_float(w, fmt)
    rows = w.reshape(-1, w.shape[-1])
    blocks = [K_PACKERS[fmt_name](rows[i : i + 4096].reshape(-1, 256))
              for i in range(0, len(rows), 4096)]  # fmt: skip
    data = np.concatenate(blocks).reshape(*w.shape[:-1], fmt.row_bytes(w.shape[-1]))
    return cls(data, fmt)


def tokenizer_metadata() -> dict[str, Any]:
    """The demo model's tokenizer.* keys (SmolLM2's BPE): llama.cpp will not load without."""
    from cellswarm.demo import demo_model_path
    from cellswarm.io.gguf_file import GGUFFile

    meta = GGUFFile(demo_model_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def random_tensor(model: PeerModel, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded by the model and the tensor's name: the same floats in every quant's file.
    Weights ~ N(0, 0.02²), norms 1, the router bias ~ N(0, 0.01²)."""
    rng = np.random.default_rng([model.seed, zlib.crc32(name.encode())])
    if name.endswith("_norm.weight"):
        return np.ones(shape, np.float32)
    std = 0.01 if name.endswith("exp_probs_b.bias") else 0.02
    return rng.standard_normal(shape, np.float32) * np.float32(std)


def make_model(model: PeerModel, quant: str, log: Any = print) -> Path:
    """Write `model` in `quant` with cellswarm's GGUF writer, unless the file exists."""
    from cellswarm.io.gguf_write import write_gguf

    path = model.path(quant)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tensors: dict[str, Any] = {}
    for name, shape in tensor_shapes(model.config).items():
        w = random_tensor(model, name, shape)
        kind = storage_type(name, shape, quant)
        tensors[name] = w if kind == "f32" else pack(w, kind)
    meta = model.config.to_gguf_metadata() | tokenizer_metadata()
    meta |= {"general.name": f"{model.name} random (cellswarm bench)",
             "general.file_type": FILE_TYPES[quant], "general.quantization_version": 2}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    write_gguf(tmp, meta, tensors)
    tmp.replace(path)
    log(f"wrote {path.name}: {path.stat().st_size / 2**20:.0f} MiB in "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return path


def n_params(config: Any) -> int:
    return sum(int(np.prod(s)) for s in tensor_shapes(config).values())


# ------------------------------------------------------------------- parsing and formatting


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench -o json -> {"prefill": tokens/s, "decode": tokens/s} (avg_ts of the
    pp test, n_gen 0, and of the tg test, n_prompt 0)."""
    out = {}
    for test in json.loads(text):
        if test.get("n_gen", 0) == 0 and test.get("n_prompt", 0) > 0:
            out["prefill"] = float(test["avg_ts"])
        elif test.get("n_prompt", 0) == 0 and test.get("n_gen", 0) > 0:
            out["decode"] = float(test["avg_ts"])
    return out


def parse_perplexity(text: str) -> float | None:
    """llama-perplexity's log -> its final estimate (None when it printed none)."""
    m = re.search(r"Final estimate: PPL = ([0-9.]+|nan|inf)", text)
    return float(m.group(1)) if m else None


def agreeing_tokens(pieces: Sequence[str], text: str) -> int:
    """How many leading tokens of one engine (their decoded prefixes, `pieces[k]` = the text
    of the first k+1 tokens) the other engine's continuation `text` starts with."""
    n = 0
    for prefix in pieces:
        if not text.startswith(prefix):
            break
        n += 1
    return n


def combine_rounds(rounds: Sequence[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict:
    """[(llama.cpp's {"decode", "prefill"}, cellswarm's), ...], one pair per round (a failed run
    lacks its keys) -> the row's medians: {llama_decode, cells_decode, llama_prefill,
    cells_prefill} (None when no round has it), and {decode_ratios, prefill_ratios}: each
    round's ratio cellswarm / llama.cpp, from the two runs made side by side."""
    row: dict[str, Any] = {}
    for key in ("decode", "prefill"):
        theirs = [t[key] for t, _ in rounds if key in t]
        ours = [o[key] for _, o in rounds if key in o]
        row[f"llama_{key}"] = float(np.median(theirs)) if theirs else None
        row[f"cells_{key}"] = float(np.median(ours)) if ours else None
        row[f"{key}_ratios"] = [o[key] / t[key] for t, o in rounds if key in t and key in o]
    return row


COLUMNS = ("file", "threads", "llama.cpp decode", "cellswarm decode", "ratio",
           "llama.cpp prefill", "cellswarm prefill", "ratio")  # fmt: skip
# with --baseline: cellswarm at another checkout, and what this one costs against it
BASELINE_COLUMNS = ("before decode", "now/before", "before prefill", "now/before")


def ratio(ours: float | None, theirs: float | None, rounds: Sequence[float] = ()) -> str:
    """The ratio cell: ours / theirs; with several rounds' ratios, their median [min-max]."""
    if len(rounds) > 1:
        return f"{np.median(rounds):.2f} [{min(rounds):.2f}-{max(rounds):.2f}]"
    return f"{ours / theirs:.2f}" if ours and theirs else "-"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows of {file, threads, llama_decode, cells_decode, llama_prefill, cells_prefill}
    (tokens/s, None when a run failed; with --rounds, the medians and the rounds'
    decode_ratios and prefill_ratios; with --baseline, before_decode and before_prefill) ->
    the printed table."""

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}" if v < 1000 else f"{v:.0f}"

    before = any("before_decode" in r for r in rows)
    columns = COLUMNS + (BASELINE_COLUMNS if before else ())
    body = []
    for r in rows:
        line = [r["file"], str(r["threads"])]
        for key in ("decode", "prefill"):
            ours, theirs = r[f"cells_{key}"], r[f"llama_{key}"]
            line += [num(theirs), num(ours), ratio(ours, theirs, r.get(f"{key}_ratios", ()))]
        for key in ("decode", "prefill") if before else ():
            line += [num(r.get(f"before_{key}")), ratio(r[f"cells_{key}"], r.get(f"before_{key}"))]
        body.append(line)
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) if i < 1 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in [columns, *body]]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ cellswarm

WORKER = """
import cellswarm  # first, as the CLI does: its settings for numpy's threads (cellswarm/__init__)
import json, sys
from bench.peers import cellswarm_speed
print(json.dumps(cellswarm_speed(*json.loads(sys.argv[1]))))
"""


def cellswarm_speed(path: str, threads: int, prompt_len: int, steps: int, reps: int) -> dict:
    """In a process of its own: tokens/s of prefill (a prompt_len prompt, logits of its last
    position, as llama-bench's pp) and of decode (`steps` greedy tokens after an 8-token
    prompt), each the mean over `reps` fresh sequences after one warm-up."""
    from cellswarm import kernels
    from cellswarm.kernels.awake import awake
    from cellswarm.loader import load

    kernels.set_threads(threads)
    model = load(path)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_len + 8)
    wake = threads > 1  # as a generation holds the CPUs awake (kernels/awake.py)

    def prefill() -> float:
        cache = model.new_cache(prompt_len)
        with awake(wake):
            t0 = time.perf_counter()
            model.step(ids[:prompt_len], cache, last_only=True)
            return prompt_len / (time.perf_counter() - t0)

    def decode(n: int) -> float:
        cache = model.new_cache(8 + n)
        with awake(wake):
            token = int(np.argmax(model.step(ids[-8:], cache, last_only=True)[-1]))
            t0 = time.perf_counter()
            for _ in range(n):
                token = int(np.argmax(model.step(np.array([token]), cache, last_only=True)[-1]))
            return n / (time.perf_counter() - t0)

    prefill(), decode(4)  # warm-up: page the file in, prepare the kernels' arguments
    return {
        "prefill": float(np.mean([prefill() for _ in range(reps)])),
        "decode": float(np.mean([decode(steps) for _ in range(reps)])),
    }


def run_cellswarm(path: Path, threads: int, prompt_len: int, steps: int, reps: int,
                  checkout: Path | None = None) -> dict:  # fmt: skip
    """cellswarm_speed in a process of its own, from this checkout or another (--baseline)."""
    args = json.dumps([str(path), threads, prompt_len, steps, reps])
    root = checkout or Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", WORKER, args], capture_output=True, text=True,
                         cwd=root, env=env)  # fmt: skip
    if out.returncode:
        print(f"  cellswarm failed on {path.name}: {out.stderr.strip().splitlines()[-1:]}")
        return {}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_llama_bench(
    llama: LlamaCpp, path: Path, threads: int, prompt_len: int, steps: int, reps: int
) -> dict:
    cmd = [llama.exe("llama-bench"), "-m", str(path), "-t", str(threads), "-p", str(prompt_len),
           "-n", str(steps), "-r", str(reps), "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(f"  llama-bench failed on {path.name}: {out.stderr.strip().splitlines()[-3:]}")
        return {}
    return parse_llama_bench(out.stdout)


# ---------------------------------------------------------------------------------- checks


def check_file(llama: LlamaCpp, path: Path) -> dict[str, Any]:
    """Both engines load `path` and continue PROMPT greedily; how many tokens agree."""
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.loader import load

    res: dict[str, Any] = {"file": path.name}
    out = subprocess.run([llama.exe("llama-simple"), "-m", str(path), "-n", str(CHECK_TOKENS),
                          PROMPT], capture_output=True)  # fmt: skip
    stdout = out.stdout.decode("utf-8", "replace")
    res["llama_loads"] = out.returncode == 0 and stdout.startswith(PROMPT)
    res["llama_text"] = stdout[len(PROMPT) :].rstrip("\n") if res["llama_loads"] else None
    if not res["llama_loads"]:
        res["llama_error"] = out.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
    model = load(path)
    gen = model.generate(PROMPT, GenerateOptions(max_tokens=CHECK_TOKENS))  # greedy
    tok = model.tokenizer
    res["cells_text"] = gen.text
    pieces = [tok.decode(gen.token_ids[: k + 1]) for k in range(len(gen.token_ids))]
    first = np.sort(model.logits(model.encode_prompt(PROMPT))[-1])
    res["margin"] = float(first[-1] - first[-2])
    res["agree"] = agreeing_tokens(pieces, res["llama_text"] or "")
    res["tokens"] = len(gen.token_ids)
    return res


def print_check(res: Mapping[str, Any]) -> None:
    if not res["llama_loads"]:
        print(f"{res['file']:<34} llama.cpp REFUSED it: {res.get('llama_error')}")
        return
    n, of = res["agree"], res["tokens"]
    said = (f"all {of} tokens agree" if n == of else
            f"{n} of {of} tokens agree, then the engines part")  # fmt: skip
    print(f"{res['file']:<34} {said} (first-token margin {res['margin']:.3f})  "
          f"llama.cpp {res['llama_text']!r}  cellswarm {res['cells_text']!r}")  # fmt: skip


# ------------------------------------------------------------------------------ perplexity


def cellswarm_perplexity(path: Path, n_ctx: int) -> float:
    """llama-perplexity's scheme: the text's tokens in chunks of n_ctx, each from an empty
    cache, the logits of positions n_ctx/2 .. n_ctx-2 scored on the next token."""
    from cellswarm.loader import load

    model = load(path)
    ids = model.tokenizer.encode(TEXT.read_text())
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(ids) // n_ctx * n_ctx, n_ctx):
        chunk = ids[start : start + n_ctx]
        logits = model.logits(chunk)[first : n_ctx - 1].astype(np.float64)
        top = logits.max(axis=1)
        logz = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll += float((logz - logits[np.arange(len(logits)), chunk[first + 1 :]]).sum())
        count += len(logits)
    return float(np.exp(nll / count))


def perplexities(llama: LlamaCpp, paths: Sequence[Path], threads: int, n_ctx: int = 128) -> None:
    print(f"\nperplexity on {TEXT.name}, llama-perplexity's scheme (-c {n_ctx}: chunks of "
          f"{n_ctx} tokens, each one's second half scored), {threads} threads")  # fmt: skip
    print(f"{'file':<40} {'llama.cpp':>10} {'cellswarm':>10}")
    for path in paths:
        out = subprocess.run(
            [llama.exe("llama-perplexity"), "-m", str(path), "-f", str(TEXT), "-c", str(n_ctx),
             "-b", str(n_ctx), "-t", str(threads)], capture_output=True, text=True,
        )  # fmt: skip
        theirs = parse_perplexity(out.stdout + out.stderr)
        ours = cellswarm_perplexity(path, n_ctx)
        shown = "-" if theirs is None else f"{theirs:.3f}"
        print(f"{path.name:<40} {shown:>10} {ours:>10.3f}")


# ----------------------------------------------------------------------------------- main


def plan_rows(
    files: Sequence[PeerFile], threads: Sequence[int], only: str | None
) -> Iterator[tuple[PeerFile, int]]:
    for f in files:
        if only and only.lower() not in f.label.lower():
            continue
        for t in threads:
            yield f, t


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="rows whose 'MODEL QUANT' contains this (any case)")
    parser.add_argument("--threads", default="1,2", help="comma-separated (default 1,2)")
    parser.add_argument(
        "--quick", action="store_true", help="first quant of each model, pp128, tg32, 1 rep"
    )
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each row's two engines this many times, side by side "
                             "(default 1); print medians and the ratios' range")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--check", action="store_true", help="install, write, check; no timing")
    parser.add_argument("--perplexity", action="store_true", help="llama-perplexity too")
    parser.add_argument("--baseline", type=Path,
                        help="another cellswarm checkout (e.g. a git worktree of the commit "
                             "before a kernel change): its speed on each row too, and the "
                             "ratio now / before")  # fmt: skip
    parser.add_argument("--makers", default="download,llama-quantize,pure",
                        help="which files: download (the demo model as shipped), "
                             "llama-quantize (its default mixes), pure (cellswarm's writer, "
                             "one format); comma-separated, default all")  # fmt: skip
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    prompt_len, steps, reps = (128, 32, 1) if args.quick else (512, 128, 3)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    llama = install_llama_cpp(log)
    files = peer_files(peer_models(), args.makers.split(","), args.quick)
    rows = list(plan_rows(files, threads, args.only))
    paths = {f: file_path(llama, f, log) for f in dict.fromkeys(f for f, _ in rows)}
    log(f"{llama.label}; cellswarm kernels: {_backend()}")
    models = {f.model.name: f.model for f in paths if f.model}
    log("params: " + ", ".join(f"{n} {n_params(m.config) / 1e9:.2f}B" for n, m in models.items()))
    checks = []
    controls = [make_model(m, m.control, log) for m in models.values() if m.control]
    for path in [*paths.values(), *controls]:
        res = check_file(llama, path)
        checks.append(res)
        if not args.json:
            print_check(res)
    if args.check:
        return
    load_before = os.getloadavg()
    results = []
    turn = 0
    for f, t in rows:
        path = paths[f]
        pairs = []
        for _ in range(max(1, args.rounds)):
            if turn % 2 == 0:  # alternate which engine goes first
                theirs = run_llama_bench(llama, path, t, prompt_len, steps, reps)
                ours = run_cellswarm(path, t, prompt_len, steps, reps)
            else:
                ours = run_cellswarm(path, t, prompt_len, steps, reps)
                theirs = run_llama_bench(llama, path, t, prompt_len, steps, reps)
            turn += 1
            pairs.append((theirs, ours))
        row = {"file": f.label, "threads": t, **combine_rounds(pairs)}
        if args.baseline:
            before = run_cellswarm(path, t, prompt_len, steps, reps, args.baseline)
            row |= {f"before_{k}": v for k, v in before.items()}
        results.append(row)
        log(format_table([row]).splitlines()[-1])
    load_after = os.getloadavg()
    if args.json:
        print(json.dumps({"llama_cpp": llama.info, "prompt": prompt_len, "decode": steps,
                          "reps": reps, "rounds": args.rounds, "load_before": load_before,
                          "load_after": load_after, "checks": checks, "rows": results},
                         indent=1))  # fmt: skip
    else:
        rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
        print(f"\n{llama.label} vs cellswarm; tokens/s, mean of {reps}{rounds}; decode {steps} "
              f"tokens, prefill {prompt_len}; ratio = cellswarm / llama.cpp")  # fmt: skip
        print(format_table(results))
        print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} "
              f"on {os.cpu_count()} cores")  # fmt: skip
    if args.perplexity:
        from cellswarm.demo import demo_model_path

        q8 = [p for f, p in paths.items() if f.quant == "q8_0" and f.maker == "pure"]
        perplexities(llama, [demo_model_path(), *q8], max(threads))


def _backend() -> str:
    from cellswarm import kernels

    return kernels.backend()


if __name__ == "__main__":
    main()
