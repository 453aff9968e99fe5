"""The weight store every architecture reads from, and the selection that makes a shard.

Tensors are named with llama.cpp's GGUF names (`blk.3.attn_q.weight`) whatever file they came
from, so an architecture file has one naming scheme. A tensor is one of:
  - `np.ndarray` float32, 1-D: norm weights, biases, router biases;
  - `PackedMatrix`: a 2-D weight (out, in) in its quantized block layout;
  - `PackedExperts`: a stack of expert matrices (n_expert, out, in), same layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from cellswarm.errors import MissingTensorError, NonFiniteError, ShapeMismatchError
from cellswarm.io.names import layer_of, tensor_kind
from cellswarm.quant import PackedExperts, PackedMatrix, first_nonfinite_block

Tensor = np.ndarray | PackedMatrix | PackedExperts

_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Selection:
    """Which part of a model a process holds.

    layers: half-open layer range, or None for all layers.
    vocab_rows: half-open row range of the embedding and output head, or None for all rows.
    experts: layer -> expert ids kept for that layer's routed experts (layers absent keep all).
    embed / head: whether this shard holds the token embedding / the output head and final norm.
    kinds: only tensors of these kinds (`tensor_kind`), or None for every kind. A part server
        holding some routed experts keeps {"experts"}: no attention, norms or router.
    """

    layers: tuple[int, int] | None = None
    vocab_rows: tuple[int, int] | None = None
    experts: Mapping[int, tuple[int, ...]] | None = None
    embed: bool = True
    head: bool = True
    kinds: frozenset[str] | None = None

    def keeps(self, name: str) -> bool:
        if self.kinds is not None and tensor_kind(name) not in self.kinds:
            return False
        layer = layer_of(name)
        if layer is not None:
            return self.layers is None or self.layers[0] <= layer < self.layers[1]
        if name == "token_embd.weight":
            # A tied head reads the embedding matrix, so the head keeps it too.
            return self.embed or self.head
        if name in ("output.weight", "output_norm.weight"):
            return self.head
        return True  # global tensors such as rope_freqs are tiny and needed everywhere

    def narrow(self, name: str, tensor: Tensor) -> Tensor:
        """Cut a kept tensor down to the selected vocabulary rows or experts (views, no copy)."""
        if name in _VOCAB_TENSORS and self.vocab_rows is not None:
            assert isinstance(tensor, PackedMatrix)
            return tensor.rows(*self.vocab_rows)
        layer = layer_of(name)
        kept = self.experts.get(layer) if self.experts and layer is not None else None
        # Only routed-expert stacks are narrowed; other 3-D tensors (attn_k_b) are per head.
        if name.endswith("_exps.weight") and isinstance(tensor, PackedExperts) and kept is not None:
            return tensor.select(kept)
        return tensor


class WeightStore(Mapping[str, Tensor]):
    """Named tensors with typed accessors that fail with a clear message."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self._tensors = dict(tensors)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensorError(
                f"model has no tensor {name!r}; the file is incomplete or was converted for "
                "another architecture"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def matrix(self, name: str, shape: tuple[int, int] | None = None) -> PackedMatrix:
        t = self[name]
        if not isinstance(t, PackedMatrix):
            raise ShapeMismatchError(f"tensor {name} should be a 2-D matrix, got {_describe(t)}")
        if shape is not None and t.shape != shape:
            raise ShapeMismatchError(f"tensor {name} has shape {t.shape}, expected {shape}")
        return t

    def vector(self, name: str, size: int | None = None) -> np.ndarray:
        t = self[name]
        if not isinstance(t, np.ndarray) or t.ndim != 1:
            raise ShapeMismatchError(f"tensor {name} should be a 1-D vector, got {_describe(t)}")
        if size is not None and t.shape[0] != size:
            raise ShapeMismatchError(f"tensor {name} has shape {t.shape}, expected ({size},)")
        return t

    def experts(self, name: str) -> PackedExperts:
        t = self[name]
        if not isinstance(t, PackedExperts):
            raise ShapeMismatchError(f"tensor {name} should be an expert stack, got {_describe(t)}")
        return t

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if name in self._tensors else None

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return sum(tensor_nbytes(self._tensors[n]) for n in (names or self._tensors))


def validate(
    weights: Mapping[str, Tensor | tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    source: str = "model",
) -> None:
    """Refuse, before any forward, weights that lack a tensor in `expected` or hold one in
    another shape. weights: tensors, or just their numpy-order shapes; source: the file, for
    the message."""
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(missing[:3])
        if len(missing) > 3:
            shown += f" and {len(missing) - 3} more"
        raise MissingTensorError(
            f"{source} has no tensor {shown}; the file is incomplete or was converted for another "
            "architecture or size — re-download or re-convert it"
        )
    for name, shape in expected.items():
        t = weights[name]
        actual = t if isinstance(t, tuple) else tuple(t.shape)
        if actual != tuple(shape):
            raise ShapeMismatchError(
                f"{source}: tensor {name} has shape {actual}, but the model's config implies "
                f"{tuple(shape)}; the file's metadata does not match its weights — re-convert it"
            )


def tensor_nbytes(t: Tensor) -> int:
    return int(t.nbytes)


def nonfinite_at(t: Tensor) -> str | None:
    """Where a tensor holds a NaN or an infinity ("row 12", "expert 3, row 5", "element 7"),
    or None. Packed tensors: only their float fields are read (`first_nonfinite_block`); an
    expert stack: only the experts it holds."""
    if isinstance(t, np.ndarray):
        bad = np.flatnonzero(~np.isfinite(t))
        return f"element {int(bad[0])}" if bad.size else None
    per_row = t.data.shape[-1] // t.fmt.type_size
    if isinstance(t, PackedMatrix):
        block = first_nonfinite_block(t.data, t.fmt)
        return None if block is None else f"row {block // per_row}"
    for e in t.held:
        block = first_nonfinite_block(t.data[e], t.fmt)
        if block is not None:
            return f"expert {e}, row {block // per_row}"
    return None


CORRUPT_HINT = "the file may be corrupt: check its sha256 (or run `cellswarm verify FILE`)"


def non_finite(where: str, store: Mapping[str, Tensor], names: Iterable[str]) -> NonFiniteError:
    """The error for NaN or infinite activations that first appeared at `where` (e.g. "layer
    7"): it names the first of `names` (the tensors that ran there) holding a non-finite
    value. Reads their scales: call it once something went wrong, never per step."""
    for name in names:
        if name in store and (at := nonfinite_at(store[name])) is not None:
            return NonFiniteError(
                f"{where} made NaN or infinite activations: tensor {name} holds a NaN or an "
                f"infinity at {at}; {CORRUPT_HINT}"
            )
    return NonFiniteError(
        f"{where} made NaN or infinite activations, though no weight it read here is "
        f"non-finite (activations overflowed, or came so from another node); {CORRUPT_HINT}"
    )


def _describe(t: Tensor) -> str:
    if isinstance(t, np.ndarray):
        return f"an array of shape {t.shape}"
    return f"{type(t).__name__} of shape {t.shape}"
