"""What a model is made of, in bytes: every tensor's shape, kind and stored size.

Built from a GGUF file (the real stored sizes, read from the header only), a Hugging Face
folder or a preset (shapes derived from config.json, sized at a chosen quantization). Never
reads a weight. For files the engine loads, the numbers equal the engine's own accounting.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from cellswarm.cache_types import check_cache_type, value_bytes
from cellswarm.errors import RequestError
from cellswarm.io.names import layer_of, tensor_kind
from cellswarm.quant import QuantFormat, format_by_name

Shape = tuple[int, ...]
_SPLITTABLE = ("ffn", "shared_experts", "experts")
# Below this many bits a weight a named type is planned as a mix (QuantSpec.parse)
LOW_BIT = 4.0


@dataclass(frozen=True)
class QuantSpec:
    """How matrices are stored.

    A GGUF type ("q4_0"): every 2-D/3-D weight in that type, as the engine re-packs (rows that
    are not whole blocks, and 1-D tensors, stay F32). An average ("1.74"): the bulk — routed
    experts of a MoE, every matrix of a dense model — at that many bits per weight, the rest
    at `rest` (Q6_K, as llama.cpp's low-bit mixes keep attention and embeddings higher), the
    router in F32 as llama.cpp leaves it.
    """

    label: str
    fmt: QuantFormat | None = None
    bulk_bits: float | None = None
    rest: QuantFormat | None = None
    bulk: QuantFormat | None = None  # a named low-bit mix's bulk format (whole blocks)

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """"q4_0": every matrix; "1.74": an average for the bulk; a low-bit type ("iq1_m",
        "q2_k", "tq1_0": under 4 bits a weight) is a mix, as llama-quantize and the dynamic
        mixes of the big MoEs make it: the bulk in that type, the rest Q6_K."""
        try:
            bits = float(text.removesuffix("bpw"))
        except ValueError:
            fmt = format_by_name(text)
            if fmt.block_size > 1 and fmt.bits_per_weight < LOW_BIT:
                return cls(f"{fmt.name.lower()} mix", bulk=fmt, rest=format_by_name("q6_k"))
            return cls(text.lower(), fmt=fmt)
        if not 0.5 <= bits <= 32:
            raise RequestError(f"--quant {text}: bits per weight must be within 0.5..32")
        return cls(f"{bits:g} bpw", bulk_bits=bits, rest=format_by_name("q6_k"))

    def tensor_bytes(self, name: str, shape: Shape, moe: bool) -> int:
        n = math.prod(shape)
        if len(shape) == 1:
            return 4 * n
        kind = tensor_kind(name)
        if self.bulk_bits is not None or self.bulk is not None:
            if kind == "router":
                return 4 * n
            if kind == "experts" or (not moe and kind not in ("embedding", "output")):
                if self.bulk is not None:
                    return _format_bytes(self.bulk, shape)
                assert self.bulk_bits is not None
                return math.ceil(n * self.bulk_bits / 8)
        fmt = self.fmt or self.rest
        assert fmt is not None
        return _format_bytes(fmt, shape)


def _format_bytes(fmt: QuantFormat, shape: Shape) -> int:
    if shape[-1] % fmt.block_size:
        return 4 * math.prod(shape)  # the engine keeps such tensors in F32
    return math.prod(shape[:-1]) * fmt.row_bytes(shape[-1])


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: Shape
    nbytes: int

    @property
    def kind(self) -> str:
        return tensor_kind(self.name)

    @property
    def layer(self) -> int | None:
        return layer_of(self.name)

    @property
    def params(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitGroup:
    """A layer's feed-forward work that can be spread over nodes in equal units: routed
    experts (a token uses `used` of them), or slices of the shared experts or of a dense FFN
    (a token uses all; each slice is some intermediate rows of gate/up and columns of down)."""

    kind: str  # "experts" | "shared_experts" | "ffn"
    n_units: int
    total_bytes: int
    unit_params: int
    used: int

    @property
    def unit_bytes(self) -> int:
        return -(-self.total_bytes // self.n_units)

    def bytes_of(self, start: int, end: int) -> int:
        """Exact bytes of units [start, end): the units' shares add up to the total."""
        return self.total_bytes * end // self.n_units - self.total_bytes * start // self.n_units


FFN_SLICES = 64  # a dense FFN or the shared experts split into this many units at most


@dataclass(frozen=True)
class ModelInventory:
    """A model's tensors and the per-token figures the cost model needs."""

    name: str
    arch: str
    n_layers: int
    d_model: int
    vocab_size: int
    n_experts: int  # routed experts per MoE layer (0: dense)
    n_experts_used: int
    kv_bytes_per_token_layer: int  # as the engine caches: f16 unless with_cache_type
    tensors: tuple[TensorSpec, ...]
    config: Any = field(repr=False)  # engine config (scratch formula) or None
    quant: str = "as stored"
    assumptions: tuple[str, ...] = ()
    cache_type: str = "f16"  # what kv_bytes_per_token_layer counts a cached value as

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def attention_macs(self) -> int:
        """Multiply-adds of one query against one key in one layer, scores and values: every
        head's head_dim twice (llama family); with latent attention (MLA, absorbed as the
        engine runs it) every head's latent for both and its RoPE part for the score. Without
        an engine config: query heads spanning d_model."""
        c = self.config
        if getattr(c, "kv_lora_rank", 0):
            return int(c.n_heads * (2 * c.kv_lora_rank + c.qk_rope_dim))
        if getattr(c, "head_dim", 0) and getattr(c, "n_heads", 0):
            return int(2 * c.n_heads * c.head_dim)
        return 2 * self.d_model

    @property
    def total_params(self) -> int:
        return sum(t.params for t in self.tensors)

    def weights_by_kind(self, names: set[str] | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            if names is None or t.name in names:
                out[t.kind] += t.nbytes
        return dict(out)

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        return self._by_layer.get(layer, [])

    @cached_property
    def _by_layer(self) -> dict[int | None, list[TensorSpec]]:
        out: dict[int | None, list[TensorSpec]] = defaultdict(list)
        for t in self.tensors:
            out[t.layer].append(t)
        return dict(out)

    def global_tensors(self) -> list[TensorSpec]:
        return self._by_layer.get(None, [])

    def expert_bytes(self, layer: int) -> int:
        """Stored bytes of ONE routed expert of `layer` (gate + up + down)."""
        return sum(t.nbytes // t.shape[0] for t in self.layer_tensors(layer) if t.kind == "experts")

    def dense_layer_bytes(self, layer: int) -> int:
        """Everything of `layer` but its routed experts."""
        return sum(t.nbytes for t in self.layer_tensors(layer) if t.kind != "experts")

    def core(self, layer: int) -> tuple[int, int]:
        """(bytes, params) of what cannot be split: attention, norms, router."""
        ts = [t for t in self.layer_tensors(layer) if t.kind not in _SPLITTABLE]
        return sum(t.nbytes for t in ts), sum(t.params for t in ts)

    def groups(self, layer: int) -> list[UnitGroup]:
        """The layer's splittable feed-forward work, in placement order."""
        return self._groups[layer]

    @cached_property
    def _groups(self) -> dict[int, list[UnitGroup]]:
        return {layer: self._layer_groups(layer) for layer in range(self.n_layers)}

    def _layer_groups(self, layer: int) -> list[UnitGroup]:
        out = []
        for kind in ("ffn", "shared_experts", "experts"):
            ts = [t for t in self.layer_tensors(layer) if t.kind == kind]
            if not ts:
                continue
            nbytes, params = sum(t.nbytes for t in ts), sum(t.params for t in ts)
            n = self.n_experts if kind == "experts" else FFN_SLICES
            used = self.n_experts_used if kind == "experts" else n
            out.append(UnitGroup(kind, n, nbytes, params // n, used))
        return out

    def is_moe_layer(self, layer: int) -> bool:
        return self.expert_bytes(layer) > 0

    @property
    def active_params(self) -> int:
        """Parameters one token uses: everything but the routed experts it is not sent to
        (embedding and head counted whole, as model cards count them)."""
        total = 0
        for t in self.tensors:
            per = t.params // t.shape[0] if t.kind == "experts" else t.params
            total += per * self.n_experts_used if t.kind == "experts" else per
        return total

    def head_bytes(self) -> int:
        out = [t for t in self.tensors if t.name == "output.weight"]
        embd = [t for t in self.tensors if t.name == "token_embd.weight"]
        return (out or embd)[0].nbytes

    def embedding_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.name == "token_embd.weight")

    def decode_bytes_per_token(self) -> int:
        """Weight bytes one decode step streams: used experts only, one embedding row."""
        total = 0
        for layer in range(self.n_layers):
            total += self.dense_layer_bytes(layer)
            total += self.expert_bytes(layer) * self.n_experts_used
        glob = sum(t.nbytes for t in self.global_tensors() if t.kind not in ("embedding", "output"))
        return total + glob + self.head_bytes() + self.embedding_bytes() // max(self.vocab_size, 1)

    def scratch_bytes(self, n_tokens: int, context: int, attn_layers: int) -> int:
        if self.config is not None:
            return int(self.config.scratch_bytes(n_tokens, context, attn_layers))
        # Architectures the engine does not run (mixtral, qwen3_moe): the llama formula.
        ffn = max((t.shape[0] for t in self.tensors if t.kind in ("ffn", "experts")), default=0)
        per_token = 4 * (6 * self.d_model + 3 * ffn)
        return n_tokens * per_token + 8 * self.d_model // 64 * n_tokens * context


def from_gguf(path: Path) -> ModelInventory:
    """Stored sizes straight from a GGUF header (the tensor data is never touched)."""
    from cellswarm.io.gguf_file import read_header
    from cellswarm.models import config_from_gguf

    header = read_header(path, skim=True)
    infos = {t.name: t for t in header.tensors}
    _, config = config_from_gguf(path, header.metadata, {n: t.shape for n, t in infos.items()})
    tensors = tuple(TensorSpec(n, t.shape, t.n_bytes) for n, t in infos.items())
    return _engine_inventory(path.name, str(config.arch), config, tensors, "as stored")


def from_hf_config(
    name: str, hf_cfg: Mapping[str, Any], quant: QuantSpec | None, assumptions: tuple[str, ...] = ()
) -> ModelInventory:
    """Shapes from a config.json (a folder's or a preset's), sized at `quant` (default F32)."""
    from cellswarm.planner import shapes

    q = quant or QuantSpec.parse("f32")
    arch, config, shape_map = shapes.tensor_shapes(hf_cfg)
    moe = any(tensor_kind(n) == "experts" for n in shape_map)
    tensors = tuple(TensorSpec(n, s, q.tensor_bytes(n, s, moe)) for n, s in shape_map.items())
    inv = _engine_inventory(name, arch, config, tensors, q.label, assumptions)
    if config is None:
        inv = shapes.non_engine_inventory(inv, hf_cfg)
    return inv


def with_cache_type(inv: ModelInventory, cache_type: str) -> ModelInventory:
    """The inventory with its KV bytes per token for a cache of `cache_type` (f16, q8_0,
    f32: cache_types.py, the bytes the engine allocates)."""
    check_cache_type(cache_type)
    if inv.config is not None and hasattr(inv.config, "kv_bytes_per_token_layer"):
        per_layer = int(inv.config.kv_bytes_per_token_layer(cache_type))
    else:  # known by its total alone (shapes.py: f16)
        per_layer = round(inv.kv_bytes_per_token_layer / 2 * value_bytes(cache_type))
    return dataclasses.replace(inv, kv_bytes_per_token_layer=per_layer, cache_type=cache_type)


def _engine_inventory(
    name: str,
    arch: str,
    config: Any,
    tensors: tuple[TensorSpec, ...],
    quant: str,
    assumptions: tuple[str, ...] = (),
) -> ModelInventory:
    n_experts = int(getattr(config, "n_experts", 0) or 0)
    return ModelInventory(
        name=name,
        arch=arch,
        n_layers=int(config.n_layers) if config is not None else 0,
        d_model=int(config.d_model) if config is not None else 0,
        vocab_size=int(config.vocab_size) if config is not None else 0,
        n_experts=n_experts,
        n_experts_used=int(getattr(config, "n_experts_used", 0) or 0),
        kv_bytes_per_token_layer=config.kv_bytes_per_token_layer() if config is not None else 0,
        tensors=tensors,
        config=config,
        quant=quant,
        assumptions=assumptions,
    )
