"""What a stage of the ring holds, in bytes, for a model file: the costs placement packs
onto nodes (planner/placement.py) as a swarm stage allocates them — the runtime, the scratch
of a prefill chunk, the KV cache with its keys' padding — and the part servers' specs.
Read by the coordinator (placement), `cellswarm up` (fit) and LocalPipeline; imports no
kernels at the top, so the coordinator's import stays light."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cellswarm.cache_types import DEFAULT_CACHE_TYPE
from cellswarm.engine import PREFILL_CHUNK
from cellswarm.errors import RequestError
from cellswarm.planner.placement import (
    StageCosts,
    balanced_layers,
    expert_parts,
    stage_costs_of,
    vocab_parts,
)

if TYPE_CHECKING:
    from cellswarm.swarm.ring.parts import PartSpec


def prefill_rows(context: int) -> int:
    """The most positions one step computes at once: a prefill chunk, or the whole context."""
    return max(1, min(context, PREFILL_CHUNK))


def stage_costs(
    model: str, context: int = 512, max_sequences: int = 8,
    remote_experts: bool = False, remote_vocab: bool = False,
    cache_type: str = DEFAULT_CACHE_TYPE,
) -> StageCosts:  # fmt: skip
    """A model file's StageCosts as a swarm stage holds it: runtime and scratch on every one."""
    return costs_at(model, remote_experts, remote_vocab, cache_type)(context, max_sequences)


# A first step carries a whole prompt's rows (T, d_model) float32, T up to the context: the
# rows that came in, the rows the layers made, and those rows encoded in the frame that goes
# on (write_next; it waits in the transport while the next stage computes). A stage's reader
# runs one first step at a time, so it holds them once, whatever the sequences in flight.
FIRST_STEP_COPIES = 3


def first_step_bytes(d_model: int, context: int) -> int:
    """What a first step's rows take on a stage, at most (a whole context's prompt)."""
    return FIRST_STEP_COPIES * context * d_model * 4


def draft_costs_at(draft: str | None,
                   cache_type: str = DEFAULT_CACHE_TYPE) -> Callable[[int, int], int]:  # fmt: skip
    """(context tokens, sequences) -> what a draft model takes on a ring's first stage, as
    the worker counts it (stage.py shard_need_bytes): its weights, a draft step's scratch,
    and its own KV cache for every sequence. 0 without one."""
    if draft is None:
        return lambda context, sequences: 0
    from cellswarm.models.kv_cache import sequence_bytes
    from cellswarm.planner.api import resolve_model

    inv = resolve_model(draft, cache_type=cache_type)
    spec = getattr(inv.config, "cache_spec", None)

    def at(context: int, sequences: int) -> int:
        kv = (sequence_bytes({0: spec()}, context, cache_type) * inv.n_layers if spec
              else inv.kv_bytes_per_token_layer * inv.n_layers * context)  # fmt: skip
        return inv.weight_bytes + inv.scratch_bytes(1, context, 0) + kv * sequences

    return at


def costs_at(
    model: str, remote_experts: bool = False, remote_vocab: bool = False,
    cache_type: str = DEFAULT_CACHE_TYPE, draft: str | None = None,
) -> Callable[[int, int], StageCosts]:  # fmt: skip
    """(context tokens, sequences) -> the StageCosts a swarm stage holds with a KV cache of
    `cache_type`, the file's header read once (placement.fit_context asks at many contexts).
    `draft`: the draft model its workers hold, on the first stage (worker --draft)."""
    from cellswarm.models.kv_cache import read_bytes, sequence_bytes
    from cellswarm.planner.api import resolve_model
    from cellswarm.planner.overhead import runtime_overhead_bytes

    inv = resolve_model(model, cache_type=cache_type)
    runtime = runtime_overhead_bytes()
    draft_at = draft_costs_at(draft, cache_type)

    def at(context: int, sequences: int) -> StageCosts:
        fixed = (runtime + inv.scratch_bytes(prefill_rows(context), context, 0)  # as a stage
                 + first_step_bytes(inv.d_model, context))  # fmt: skip
        costs = stage_costs_of(inv, context * sequences, fixed, remote_experts, remote_vocab,
                               first_bytes=draft_at(context, sequences))  # fmt: skip
        # a layer's cache as a stage allocates it, the keys' padding included (the worker
        # checks its budget with the same bytes: kv_sequence_bytes)
        spec = getattr(inv.config, "cache_spec", None)
        if spec is None:
            return costs
        kv = sequence_bytes({0: spec()}, context, cache_type)
        # and a step's float copies of one layer's cache (the worker counts the same:
        # shard_need_bytes, kv_read_bytes)
        copies = read_bytes(spec(), context, cache_type)
        return dataclasses.replace(costs, kv=kv * sequences, fixed=costs.fixed + copies)

    return at


def budget_split(
    model: str, stages: int, memory_bytes: int, context: int = 512, max_sequences: int = 8,
    remote_experts: bool = False, remote_vocab: bool = False,
    cache_type: str = DEFAULT_CACHE_TYPE,
) -> list[tuple[int, int]]:  # fmt: skip
    """The coordinator's placement of a model file over `stages` workers of `memory_bytes`
    (planner/placement.py: balanced_layers); BudgetError if they cannot hold it."""
    costs = stage_costs(model, context, max_sequences, remote_experts, remote_vocab, cache_type)
    return balanced_layers(costs, stages, memory_bytes, Path(model).name)


def part_specs(
    model: str, expert_nodes: int, vocab_nodes: int, ports: Sequence[int]
) -> list[PartSpec]:
    """Part servers for a model (planner/placement.py: expert_parts, vocab_parts)."""
    from cellswarm.loader import read_config
    from cellswarm.swarm.ring.parts import PartSpec

    config = read_config(model)
    n_experts = int(getattr(config, "n_experts", 0))
    if expert_nodes and not n_experts:
        raise RequestError(f"{Path(model).name} has no routed experts to place on expert nodes")
    if not 0 <= expert_nodes <= max(n_experts, 0):
        raise RequestError(f"{expert_nodes} expert nodes for {n_experts} experts per layer")
    moe = [i for i in range(config.n_layers) if n_experts and config.is_moe(i)]
    experts = expert_parts(moe, n_experts, expert_nodes)
    specs = [PartSpec(f"experts-{j}", ports[j], experts=e) for j, e in enumerate(experts)]
    rows = vocab_parts(int(config.vocab_size), vocab_nodes)
    specs += [
        PartSpec(f"vocab-{j}", ports[expert_nodes + j], vocab_rows=r) for j, r in enumerate(rows)
    ]
    return specs
