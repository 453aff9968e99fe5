"""The cost model: seconds per token from bytes, FLOPs and hops. Pure functions.

Each stage of work is a roofline: it takes max(bytes / effective bandwidth, FLOPs / effective
FLOP/s) and is charged to whichever term is larger; every hop between nodes costs half a
round trip plus its bytes over the link. Decode of one token reads every weight it uses once,
so on small nodes memory bandwidth, and between them latency, decide the figure.

Tensor parallelism splits every matrix over N nodes and must all-reduce the layer's output
twice per layer (after attention and after the FFN); on 1 GbE that costs 2 x layers round
trips plus 2 x (N - 1) activation vectors through the coordinating node's link per
all-reduce, and every all-reduce waits for the slowest node. Pipeline parallelism sends one
activation vector per stage boundary. That difference is why a swarm on Ethernet pipelines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cellswarm.planner.inventory import ModelInventory, UnitGroup
from cellswarm.planner.placement import Placement, Range, Slot, cost_balanced_split


@dataclass(frozen=True)
class CostOptions:
    activation_bytes: float = 4.0  # bytes per activation element on the wire (f32 frames)
    # Coefficient of variation of a node's step time (thermal throttling, OS noise). A step
    # that waits for n nodes waits for the slowest: ~ mean x (1 + cv x sqrt(2 ln n)).
    straggler_cv: float = 0.25
    tp_syncs_per_layer: int = 2
    # What the runtime spends besides kernels and wires: per stage step a token makes (Python
    # around the kernels, the event loop) and per message on its path (framing, syscalls).
    # The roofline alone missed it by 20-46% in the lab (docs/lab.md); `cellswarm plan` takes
    # the measured figures from data/runtime.toml [software]. 0 here: a bare roofline.
    stage_step_s: float = 0.0
    hop_s: float = 0.0
    # per sequence per layer in a pass: norms, RoPE, the cache write, residuals (bench.batch
    # fits it beside the attention rate below: 19 us dense, 52 us with MLA and a router, on
    # a Zen 4 core); 0 here
    sequence_layer_s: float = 0.0
    # the float attention's rate (FLOP/s, fp32 and no fused multiply-add: not the int8
    # products'): a prefill's queries against their keys (a cached prefix makes them many),
    # a decode pass's against each sequence's context (MLA computes far more on it than it
    # reads). bench.batch measures it: ~40 GFLOP/s a Zen 4 core. 0 here: not counted
    attention_flops_per_s: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """Seconds for one step, split by what bounds each part."""

    compute_s: float = 0.0
    memory_s: float = 0.0
    network_s: float = 0.0
    node_busy_s: tuple[float, ...] = field(default=(), repr=False)  # per node, per token
    software_s: float = 0.0  # the runtime's own time per step (CostOptions.stage_step_s, hop_s)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.network_s + self.software_s

    @property
    def bound(self) -> str:
        parts = {"compute": self.compute_s, "memory bandwidth": self.memory_s}
        parts["network"] = self.network_s
        parts["software"] = self.software_s
        return max(sorted(parts), key=lambda k: parts[k])

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(
            self.compute_s + other.compute_s,
            self.memory_s + other.memory_s,
            self.network_s + other.network_s,
            self.node_busy_s + other.node_busy_s,
            self.software_s + other.software_s,
        )

    @property
    def bottleneck_busy_s(self) -> float:
        return max(self.node_busy_s, default=self.total_s)


def roofline(node: Any, nbytes: float, flops: float) -> StepTime:
    mem = nbytes / node.effective_bandwidth_bytes_per_s
    cmp = flops / node.effective_flops
    return StepTime(compute_s=cmp) if cmp > mem else StepTime(memory_s=mem)


def straggler_factor(n: int, cv: float) -> float:
    return 1.0 + cv * math.sqrt(2 * math.log(n)) if n > 1 else 1.0


def hop(node: Any, nbytes: float) -> StepTime:
    return StepTime(network_s=node.link_rtt_s / 2 + nbytes / node.link_bytes_per_s)


# -- what a layer costs -----------------------------------------------------------------------


def head_cost(inv: ModelInventory) -> tuple[int, int]:
    name = "output.weight"
    if not any(t.name == name for t in inv.tensors):
        name = "token_embd.weight"  # tied head
    t = next(t for t in inv.tensors if t.name == name)
    return t.nbytes, t.params


def holders(placement: Placement, layer: int, kind: str) -> dict[int, int]:
    """node -> units of (layer, kind) it holds."""
    return placement.unit_holders.get((layer, kind), {})


def share(group: UnitGroup, held: int) -> float:
    """Chance a token needs a holder of `held` units: 1 for slices, ~k*held/E for experts."""
    return min(1.0, group.used * held / group.n_units)


def answer_rows(group: UnitGroup, held: int) -> float:
    """Activation rows a holder of `held` units sends back per token: one partial sum for
    slices; for routed experts each expert's output apart (~k*held/E of them), since the
    owner adds them in one process's order (swarm/ring/parts.py)."""
    return group.used * held / group.n_units if group.kind == "experts" else share(group, held)


# -- pipeline ---------------------------------------------------------------------------------


KERNEL_BATCH = 16  # sequences one pass of the fused kernels reads the weights for
MAX_BATCH = 32  # sequences a stage steps at once (StageConfig.max_batch)


def kernel_reads(rows: int) -> int:
    """Reads of the weights for a pass of `rows` rows (sequences, or a prompt chunk's
    tokens): the fused kernels take KERNEL_BATCH rows per read."""
    return -(-rows // KERNEL_BATCH)


def pass_flops(node: Any, read_params: float, used_params: float) -> float:
    """What one pass costs in batch-1 matvec FLOPs: the fused kernels unpack each weight they
    read once (`read_params`: a weight once per KERNEL_BATCH sequences; that is the node's
    `unpack_share` of a batch-1 matvec) and multiply it once per sequence that uses it
    (`used_params`). Without an unpack share this is the roofline's 2 x used_params."""
    share = getattr(node, "unpack_share", 0.0)
    return 2 * (read_params * share + used_params * (1 - share))


def batch_size(in_flight: int, stages: int) -> int:
    """Sequences each stage steps per pass when `in_flight` spread over `stages` in a ring
    (continuous batching: every stage holds its share of them)."""
    return max(1, min(-(-max(in_flight, 1) // max(stages, 1)), MAX_BATCH))


def pipeline_decode(
    inv: ModelInventory, placement: Placement, node: Any, opts: CostOptions, batch: int = 1,
    context: int = 0,
) -> StepTime:  # fmt: skip
    """One pass through one replica of `batch` sequences' tokens (one each): the weights are
    read once per KERNEL_BATCH of them, compute and activations are per sequence, and a MoE
    layer reads the experts the batch is expected to touch. batch 1: one sequence in flight.
    `context`: the tokens each sequence's attention reads back from its KV cache, per layer
    (0: not counted; at B = 32 and 160 tokens the demo-sized 0.3B's caches are as many bytes
    as its weights)."""
    act = inv.d_model * opts.activation_bytes * batch
    kv = batch * context * inv.kv_bytes_per_token_layer
    reads = kernel_reads(batch)
    owners = {layer: s for s in placement.slots if s.layers for layer in range(*s.layers)}
    total = StepTime()
    busy: dict[int, float] = {s.node: 0.0 for s in placement.slots}
    prev: Slot | None = None
    for layer in range(inv.n_layers):
        slot = owners[layer]
        if prev is not None and slot.node != prev.node:
            total += hop(node, act)
        nbytes, params = inv.core(layer)
        core = roofline(node, nbytes * reads, pass_flops(node, params * reads, params * batch))
        # attention reads each sequence's cache after the products, not beside them, and
        # computes on it (MLA: in latent space, far more than its few bytes): the slower of
        # the two; the per-sequence work around them (norms, RoPE, the cache write,
        # residuals) is serial
        read_s = kv / node.effective_bandwidth_bytes_per_s
        att_s = attention_s(inv, opts, batch, context)
        core += StepTime(memory_s=read_s if read_s >= att_s else 0.0,
                         compute_s=att_s if att_s > read_s else 0.0,
                         software_s=batch * opts.sequence_layer_s)  # fmt: skip
        total += core
        busy[slot.node] += core.total_s
        for group in inv.groups(layer):
            total += _group_step(placement, node, opts, act, layer, group, slot, busy, batch)
        prev = slot
    total += _head_step(inv, placement, node, act, prev, batch)
    nbytes, params = head_cost(inv)
    for s in placement.slots:  # each head shard is busy with its rows every token, too
        if s.head_rows:
            part = (s.head_rows[1] - s.head_rows[0]) / inv.vocab_size
            head = roofline(node, part * nbytes * reads,
                            pass_flops(node, part * params * reads, part * params * batch))
            busy[s.node] += head.total_s
    total += StepTime(network_s=node.link_rtt_s / 2)  # the sampled token back to the first stage
    stages, hops = serial_path(inv, placement)
    for n in {s.node for s in placement.slots if s.layers}:
        busy[n] += opts.stage_step_s
    software = stages * opts.stage_step_s + hops * opts.hop_s
    return StepTime(total.compute_s, total.memory_s, total.network_s, tuple(busy.values()),
                    total.software_s + software)  # fmt: skip


def _group_step(
    placement: Placement,
    node: Any,
    opts: CostOptions,
    act: float,
    layer: int,
    group: UnitGroup,
    owner: Slot,
    busy: dict[int, float],
    batch: int = 1,
) -> StepTime:
    held = holders(placement, layer, group.kind)
    # units a pass reads (each token picks `used` of n_units: a batch touches the union)
    touched = (group.used if batch == 1
               else group.n_units * (1 - (1 - group.used / group.n_units) ** batch))
    for n, h in held.items():  # each holder's expected share of the work, per pass
        frac = h / group.n_units
        busy[n] += roofline(node, touched * frac * group.unit_bytes,
                            pass_flops(node, touched * frac * group.unit_params,
                                       group.used * batch * frac * group.unit_params)).total_s
    if list(held) == [owner.node]:
        return roofline(node, touched * group.unit_bytes,
                        pass_flops(node, touched * group.unit_params,
                                   group.used * batch * group.unit_params))  # fmt: skip
    # Scatter to the holders, wait for the slowest, gather their weighted outputs.
    frac = max(held.values()) / group.n_units
    per_node = max(touched * frac, 1.0)
    step = roofline(node, per_node * group.unit_bytes,
                    pass_flops(node, per_node * group.unit_params,
                               max(group.used * batch * frac, 1.0) * group.unit_params))
    f = straggler_factor(min(len(held), group.used), opts.straggler_cv)
    wire = act * sum(share(group, h) + answer_rows(group, h)
                     for n, h in held.items() if n != owner.node)  # fmt: skip
    step = StepTime(step.compute_s * f, step.memory_s * f)
    return step + StepTime(network_s=node.link_rtt_s + wire / node.link_bytes_per_s)


def _head_step(
    inv: ModelInventory, placement: Placement, node: Any, act: float, last: Slot | None,
    batch: int = 1,
) -> StepTime:  # fmt: skip
    heads = [s for s in placement.slots if s.head_rows]
    nbytes, params = head_cost(inv)
    rows = max((s.head_rows[1] - s.head_rows[0]) for s in heads if s.head_rows) / inv.vocab_size
    reads = kernel_reads(batch)
    step = roofline(node, rows * nbytes * reads,
                    pass_flops(node, rows * params * reads, rows * params * batch))
    remote = [s for s in heads if last is None or s.node != last.node]
    if remote:  # the hidden state to every head shard, a (max, index) pair back from each
        step += StepTime(network_s=node.link_rtt_s + len(remote) * act / node.link_bytes_per_s)
    return step


def attention_s(inv: ModelInventory, opts: CostOptions, queries: int, keys: float) -> float:
    """One layer's float attention of `queries` against `keys` each (on average), at
    opts.attention_flops_per_s (inv.attention_macs a query and key); 0 without a rate."""
    if opts.attention_flops_per_s <= 0:
        return 0.0
    return 2 * queries * keys * inv.attention_macs / opts.attention_flops_per_s


def pipeline_prefill(
    inv: ModelInventory, placement: Placement, node: Any, opts: CostOptions, prompt: int,
    context: int = 0,
) -> StepTime:  # fmt: skip
    """A prompt of `prompt` tokens through one replica in one chunk, after `context` tokens
    its stages already hold (a prefix cache's blocks): each query attends to those and to
    the prompt's tokens up to its own."""
    attend = StepTime(compute_s=attention_s(inv, opts, prompt, context + (prompt + 1) / 2))
    act = prompt * inv.d_model * opts.activation_bytes
    hops = len({s.node for s in placement.slots if s.layers}) + 1
    total = StepTime(network_s=hops * (node.link_rtt_s / 2 + act / node.link_bytes_per_s))
    reads = kernel_reads(prompt)
    for layer in range(inv.n_layers):
        nbytes, params = inv.core(layer)
        total += roofline(node, nbytes, pass_flops(node, params * reads, params * prompt))
        total += attend
        for group in inv.groups(layer):
            n_holders = max(len(holders(placement, layer, group.kind)), 1)
            units = min(group.n_units, prompt * group.used)
            touched = units * group.unit_bytes / n_holders
            flops = pass_flops(node, units * group.unit_params * reads / n_holders,
                               group.unit_params * prompt * group.used / n_holders)
            total += roofline(node, touched, flops)
    nbytes, params = head_cost(inv)
    stages, n_hops = serial_path(inv, placement)
    software = StepTime(software_s=stages * opts.stage_step_s + n_hops * opts.hop_s)
    return total + roofline(node, nbytes, 2 * params) + software  # logits: last position only


def serial_path(inv: ModelInventory, placement: Placement) -> tuple[int, int]:
    """(stages a token passes through in order, messages on its serial path per token).

    Hops: one per change of layer owner along the model (and embedding -> first layer), a
    round trip (2) per layer whose feed-forward units sit partly on other nodes (scatter,
    then gather; the holders work in parallel), a round trip to remote head shards, and the
    sampled token back to the first stage when the ring has more than one stage."""
    owners = {layer: s.node for s in placement.slots if s.layers for layer in range(*s.layers)}
    path = [s.node for s in placement.slots if s.embed_rows][:1]
    for layer in range(inv.n_layers):
        if path[-1:] != [owners[layer]]:
            path.append(owners[layer])
    hops = len(path) - 1
    for layer in range(inv.n_layers):
        for group in inv.groups(layer):
            if set(holders(placement, layer, group.kind)) - {owners[layer]}:
                hops += 2
    if any(s.head_rows and s.node != path[-1] for s in placement.slots):
        hops += 2
    if len(placement.slots) > 1:
        hops += 1
    return len(path), hops


def emulated_split(model: str, n_stages: int, profile_name: str) -> list[Range]:
    """Contiguous layer ranges for `n_stages` nodes of a profile that even out their
    emulated step times (swarm/ring/emulate.py: Emulation.step_s(1), a roofline of the bytes
    a step reads and the parameters it multiplies; the head's on the last stage) — the
    slowest stage bounds a full pipeline, and an even split by layer count leaves the last
    stage, its layers plus the output head (for a small model with a big vocabulary several
    layers' worth), far slower than the others. cost_balanced_split on that cost."""
    from cellswarm.planner.api import resolve_model  # api imports this module
    from cellswarm.planner.profiles import get_profile

    inv, node = resolve_model(model), get_profile(profile_name)
    if not 1 <= n_stages <= inv.n_layers:
        raise ValueError(f"{n_stages} stages for {inv.n_layers} layers")
    nbytes, params = [0], [0]  # running totals over the layers
    for i in range(inv.n_layers):
        nbytes.append(nbytes[-1] + sum(t.nbytes for t in inv.layer_tensors(i)))
        params.append(params[-1] + sum(t.params for t in inv.layer_tensors(i)))
    head_bytes, head_params = head_cost(inv)

    def step_s(k: int, lo: int, hi: int, last: bool) -> float:
        b = nbytes[hi] - nbytes[lo] + (head_bytes if last else 0)
        n = params[hi] - params[lo] + (head_params if last else 0)
        return roofline(node, b, 2 * n).total_s

    split = cost_balanced_split(inv.n_layers, n_stages, step_s)
    assert split is not None  # no memory limit: some split always exists
    return split


# -- tensor parallel --------------------------------------------------------------------------


def tensor_parallel_decode(inv: ModelInventory, n: int, node: Any, opts: CostOptions) -> StepTime:
    """One token with every matrix split over n nodes (distributed-llama's scheme)."""
    step = roofline(node, inv.decode_bytes_per_token() / n, 2 * inv.active_params / n)
    f = straggler_factor(n, opts.straggler_cv)
    step = StepTime(step.compute_s * f, step.memory_s * f)
    if n == 1:
        return step
    vec = inv.d_model * opts.activation_bytes
    per_sync = node.link_rtt_s + 2 * (n - 1) * vec / node.link_bytes_per_s
    syncs = inv.n_layers * opts.tp_syncs_per_layer
    return step + StepTime(network_s=syncs * per_sync, node_busy_s=(step.total_s,))


def tensor_parallel_prefill(
    inv: ModelInventory, n: int, node: Any, opts: CostOptions, prompt: int
) -> float:
    step = roofline(node, inv.weight_bytes / n, 2 * inv.active_params * prompt / n)
    if n == 1:
        return step.total_s
    vec = prompt * inv.d_model * opts.activation_bytes
    per_sync = node.link_rtt_s + 2 * (n - 1) * vec / node.link_bytes_per_s
    return step.total_s + inv.n_layers * opts.tp_syncs_per_layer * per_sync
