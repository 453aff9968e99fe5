"""`plan(...)`: model + node profile + count in, placement and predictions out. Pure.

Memory per node = runtime overhead (measured from a real idle worker process) + scratch for
one step + weights held + the KV cache of the layers held. Everything else — tokens/s, the
network tiers, watts — follows from the placement through cost.py and network.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.planner import cost, network
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.network import ControlTraffic
from cellswarm.planner.placement import Placement, place
from cellswarm.planner.tiers import TierPlan, plan_tiers

PARALLEL_MODES = ("pipeline", "tensor", "expert")


@dataclass(frozen=True)
class PlanRequest:
    node: Any  # NodeProfile
    count: int
    context: int = 4096
    concurrency: int = 1
    parallel: str = "pipeline"
    prompt_tokens: int = 512
    runtime_overhead_bytes: int = 0
    network: Any = None  # NetworkSpec
    power: Any = None  # PowerSpec
    cost: cost.CostOptions = field(default_factory=cost.CostOptions)
    control: ControlTraffic = field(default_factory=ControlTraffic)  # (`network` is a field)
    dram_bytes: int | None = None  # tiered boxes: DRAM given to weights (None: the tier's size)
    expert_hit_rate: float | None = None  # tiered boxes: None = what fits in DRAM
    stages: int | None = None  # exactly this many pipeline stages (`up --stages`): None, fewest
    # a draft model's weights and KV cache, on the first node of each replica (speculative)
    draft_bytes: int = 0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise RequestError(f"--count {self.count} must be at least 1")
        if self.context < 1 or self.concurrency < 1 or self.prompt_tokens < 1:
            raise RequestError("--context, --concurrency and --prompt must be at least 1")
        if self.parallel not in PARALLEL_MODES:
            raise RequestError(f"--parallel {self.parallel!r}: choose one of {PARALLEL_MODES}")
        if self.stages is not None and self.parallel != "pipeline":
            raise RequestError(f"--stages is for --parallel pipeline, not {self.parallel}")
        if self.draft_bytes and self.parallel != "pipeline":
            raise RequestError(f"--draft is for --parallel pipeline, not {self.parallel}")


@dataclass(frozen=True)
class PlanResult:
    model: ModelInventory = field(repr=False)
    request: PlanRequest = field(repr=False)
    placement: Placement = field(repr=False)
    scratch_bytes: int
    capacity_bytes: int  # per node, for weights + KV, after overhead and scratch
    fits: bool
    problem: str  # why it does not fit ("" when it does)
    min_nodes: int
    replicas: int
    decode: cost.StepTime
    prefill_s: float
    throughput_tokens_per_s: float  # whole swarm, `concurrency` sequences per replica
    tensor_parallel: cost.StepTime | None  # with --parallel tensor/expert: TP over min_nodes
    tier_loads: tuple[network.TierLoad, ...]
    power_w: float
    tiers: TierPlan | None
    bytes_per_token: float = 0.0  # on the wire, one replica, all links together
    pipeline: PlanResult | None = None  # with --parallel tensor: the pipeline plan beside it

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token_layer * self.model.n_layers

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode.total_s if self.decode.total_s > 0 else 0.0

    @property
    def energy_j_per_token(self) -> float:
        tps = self.throughput_tokens_per_s
        return self.power_w / tps if tps > 0 else float("inf")

    @property
    def cost_per_million_tokens(self) -> float:
        return self.energy_j_per_token * 1e6 / 3.6e6 * self.request.power.price_per_kwh

    @property
    def bound(self) -> str:
        saturated = max(self.tier_loads, key=lambda t: t.utilization, default=None)
        if saturated is not None and saturated.utilization >= 1.0:
            return f"network ({saturated.tier} tier)"
        return self.decode.bound

    @property
    def node_power_w(self) -> float:
        """Watts at the nodes, before the facility's overhead (PUE)."""
        pue = self.request.power.pue if self.request.count > 1 else 1.0
        return self.power_w / pue

    @property
    def first_saturated_tier(self) -> str:
        if not self.tier_loads:
            return ""
        return max(self.tier_loads, key=lambda t: t.utilization).tier

    @property
    def nodes_used(self) -> int:
        return min(self.request.count, self.replicas * self.min_nodes) if self.fits else 0


def plan(inv: ModelInventory, req: PlanRequest) -> PlanResult:
    node, kv_tokens = req.node, req.context * req.concurrency
    scratch = inv.scratch_bytes(req.concurrency, req.context, 0)
    capacity = node.memory_bytes - req.runtime_overhead_bytes - scratch
    if req.parallel == "tensor":
        return _plan_tensor(inv, req, scratch, capacity, kv_tokens)
    placement = place(inv, max(capacity, 0), kv_tokens, req.parallel == "expert", req.stages,
                      req.draft_bytes)  # fmt: skip
    tiers = plan_tiers(inv, req, scratch) if node.tiers else None
    problem = placement.problem if tiers is None else tiers.problem
    if capacity <= 0:
        problem = (
            f"a {node.name} node's {node.memory_bytes:,} bytes do not cover the runtime "
            f"({req.runtime_overhead_bytes:,}) and one step's scratch ({scratch:,})"
        )
    min_nodes = 1 if tiers is not None else placement.nodes_per_replica
    fits = not problem and req.count >= min_nodes
    if not problem and not fits:
        short = (min_nodes - req.count) * capacity
        problem = f"needs {min_nodes:,} nodes, {short:,} bytes more than {req.count:,} nodes give"
    replicas = req.count // min_nodes if fits else 0
    if tiers is None and (capacity <= 0 or not placement.placeable):
        return _unplaceable(inv, req, placement, scratch, capacity, problem)
    decode = (
        tiers.decode if tiers is not None else cost.pipeline_decode(inv, placement, node, req.cost)
    )
    if tiers is None:  # each stage steps its share of the sequences in flight together
        stages, _ = cost.serial_path(inv, placement)
        b = cost.batch_size(req.concurrency, stages)
        step = decode if b == 1 else cost.pipeline_decode(inv, placement, node, req.cost, b)
        per_replica = _pipelined_tokens_per_s(step, req.concurrency, b)
    else:
        per_replica = _pipelined_tokens_per_s(decode, req.concurrency)
    if fits and tiers is None:
        per_replica = min(per_replica, _network_cap(inv, placement, replicas, req))
    loads = _loads(inv, placement, replicas, per_replica, req) if fits and tiers is None else ()
    prefill = cost.pipeline_prefill(inv, placement, node, req.cost, req.prompt_tokens).total_s
    return PlanResult(
        model=inv, request=req, placement=placement, scratch_bytes=scratch,
        capacity_bytes=capacity, fits=fits, problem=problem, min_nodes=min_nodes,
        replicas=replicas, decode=decode, prefill_s=prefill,
        throughput_tokens_per_s=per_replica * replicas,
        tensor_parallel=_tp_compare(inv, req, min_nodes) if req.parallel != "pipeline" else None,
        tier_loads=tuple(loads), power_w=_power(req, replicas * min_nodes), tiers=tiers,
        bytes_per_token=_wire_bytes(inv, placement, req) if tiers is None else 0.0,
    )  # fmt: skip


def _unplaceable(
    inv: ModelInventory, req: PlanRequest, p: Placement, scratch: int, capacity: int, why: str
) -> PlanResult:
    return PlanResult(
        model=inv, request=req, placement=p, scratch_bytes=scratch, capacity_bytes=capacity,
        fits=False, problem=why, min_nodes=0, replicas=0, decode=cost.StepTime(),
        prefill_s=0.0, throughput_tokens_per_s=0.0, tensor_parallel=None, tier_loads=(),
        power_w=_power(req, 0), tiers=None,
    )  # fmt: skip


def _wire_bytes(inv: ModelInventory, p: Placement, req: PlanRequest) -> float:
    return sum(f[2] for f in network.replica_flows(inv, p, req.cost.activation_bytes))


def _pipelined_tokens_per_s(step: cost.StepTime, in_flight: int, batch: int = 1) -> float:
    """K sequences in flight keep K stages busy, until the busiest node is always busy; each
    pass of `step` carries `batch` of them (cost.batch_size)."""
    return min(in_flight / step.total_s, batch / step.bottleneck_busy_s)


def _loads(
    inv: ModelInventory, p: Placement, replicas: int, per_replica: float, req: PlanRequest
) -> list[network.TierLoad]:
    flows = network.replica_flows(inv, p, req.cost.activation_bytes)
    return network.tier_loads(flows, p.nodes_per_replica, replicas, per_replica, req.network,
                              req.control)  # fmt: skip


def _network_cap(inv: ModelInventory, p: Placement, replicas: int, req: PlanRequest) -> float:
    flows = network.replica_flows(inv, p, req.cost.activation_bytes)
    return network.network_cap(flows, p.nodes_per_replica, replicas, req.network, req.control)


def _power(req: PlanRequest, busy_nodes: int) -> float:
    node, idle = req.node, max(req.count - busy_nodes, 0)
    watts = busy_nodes * node.power_busy_w + idle * node.power_idle_w
    return watts * (req.power.pue if req.count > 1 else 1.0)


def _tp_compare(inv: ModelInventory, req: PlanRequest, n: int) -> cost.StepTime:
    return cost.tensor_parallel_decode(inv, max(min(n, req.count), 1), req.node, req.cost)


def _plan_tensor(
    inv: ModelInventory, req: PlanRequest, scratch: int, capacity: int, kv_tokens: int
) -> PlanResult:
    """Every matrix split over a group of n nodes; n is the smallest group that fits."""
    need = inv.weight_bytes + inv.kv_bytes_per_token_layer * inv.n_layers * kv_tokens
    n = max(1, -(-need // max(capacity, 1)))
    fits = capacity > 0 and req.count >= n
    problem = "" if fits else f"needs {n:,} nodes in a tensor-parallel group; have {req.count:,}"
    group = req.count  # distributed-llama style: one group over every node given
    decode = cost.tensor_parallel_decode(inv, group, req.node, req.cost)
    replicas = 1 if fits else 0
    tps = min(req.concurrency / decode.total_s, 1 / decode.bottleneck_busy_s) * replicas
    return PlanResult(
        model=inv, request=req, placement=Placement((), capacity), scratch_bytes=scratch,
        capacity_bytes=capacity, fits=fits, problem=problem, min_nodes=n, replicas=replicas,
        decode=decode,
        prefill_s=cost.tensor_parallel_prefill(inv, group, req.node, req.cost, req.prompt_tokens),
        throughput_tokens_per_s=tps, tensor_parallel=decode, tier_loads=(),
        power_w=_power(req, replicas * n), tiers=None,
        bytes_per_token=_tp_wire_bytes(inv, group, req),
        pipeline=plan(inv, dataclasses.replace(req, parallel="pipeline")),
    )  # fmt: skip


def _tp_wire_bytes(inv: ModelInventory, n: int, req: PlanRequest) -> float:
    vec = inv.d_model * req.cost.activation_bytes
    return inv.n_layers * req.cost.tp_syncs_per_layer * 2 * (n - 1) * vec
