"""When speculative decoding pays on a pipeline: acceptance rate x draft depth. Pure.

One sequence decoding over S stages waits for every stage and every hop per token. With
speculation it drafts k tokens (prompt-lookup n-grams: free) and verifies them as one step
of k + 1 rows through all stages; the last stage keeps the longest agreeing prefix plus one
token of its own. With drafts accepted independently at rate a, a round makes
E(k) = (1 - a^(k+1)) / (1 - a) tokens (k + 1 when a = 1).

A round costs each stage's step for its rows plus the hops. A stage's step is the planner's
roofline (cost.roofline): max(weight bytes / effective bandwidth, FLOPs / effective FLOP/s),
plus the runtime's own time per step. Up to cost.KERNEL_BATCH rows read the weights once, so
on a bandwidth-bound stage k + 1 rows cost about what one does, and on a compute-bound
stage they cost k + 1 times as much: speculation pays where the ring waits on memory and
latency, not on arithmetic. Speed-up = E(k) x round(1 row) / round(k + 1 rows).

Pipelined (as PipeInfer; the ring does it for a lone sequence, swarm/ring/rounds.py): while
a round travels, the first stage sends the next behind it, guessing the last stage's token,
while the chance that all rounds in flight hold, a^(their rows), is at least MIN_CHANCE, up
to MAX_IN_FLIGHT. A round whose drafts and guess all held is followed by the next one a
pipeline interval later (the busiest stage's step, or the round trip over those in flight);
one that broke, a whole round trip later. So even k = 0 (a guess alone in each round) pays
on a deep ring whose rows are dear: the stages that would idle step the guessed tokens.
The swarm's depth is the one-round best (engine/speculative.py AdaptiveK measures the same
trade); `swarm_speedup` is what that ring then makes, and what the simulator uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.planner import cost
from cellswarm.planner.plan import PlanResult

TOKEN_ID_BYTES = 8  # the accepted token ids back to the first stage: a few bytes, not rows
BISECT_TOLERANCE = 1e-4
# rounds of one sequence in flight at once (swarm/ring/rounds.py sends them by these)
MAX_IN_FLIGHT = 4
# a round goes behind others only while the chance that all of those are kept whole
# (acceptance ^ their rows) is at least this: below it, it is mostly wasted work
MIN_CHANCE = 0.35


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification round of k drafts makes: the accepted prefix plus the last
    stage's own token, E = sum_{i=0..k} a^i."""
    _check_acceptance(acceptance)
    _check_k(k)
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class RingTimes:
    """One replica's serial path as the planner costs it, stage by stage.

    A step of r rows (r <= cost.KERNEL_BATCH) at stage i takes
    fixed_s[i] + max(memory_s[i], unpack_s[i] + r * per_row_s[i]): the runtime's own time,
    then the roofline of reading the stage's weights once against its FLOPs (per row, plus
    the once-per-read unpacking a profile's unpack_share names; () means none).

    `hops`: messages on the serial path per round (None: a ring, S for S stages, 0 for one);
    all but the last carry `rows x row_bytes` of activations, the last the token ids back.
    """

    memory_s: tuple[float, ...]
    per_row_s: tuple[float, ...]
    fixed_s: tuple[float, ...]
    hop_s: float  # one hop's latency (half a round trip, plus the runtime's per message)
    row_bytes: int  # one row's activations on the wire
    link_bytes_per_s: float
    unpack_s: tuple[float, ...] = ()
    hops: int | None = None

    def __post_init__(self) -> None:
        n = len(self.memory_s)
        if n == 0:
            raise RequestError("speculative ring: needs at least one stage")
        for name in ("per_row_s", "fixed_s", "unpack_s"):
            values = getattr(self, name)
            if name == "unpack_s" and not values:
                continue
            if len(values) != n:
                raise RequestError(f"speculative ring: {name} has {len(values)} stages, not {n}")
        for name in ("memory_s", "per_row_s", "fixed_s", "unpack_s"):
            if any(not v >= 0 for v in getattr(self, name)):
                raise RequestError(f"speculative ring: {name} {getattr(self, name)} must be >= 0")
        if not self.hop_s >= 0 or self.row_bytes < 0:
            raise RequestError(
                f"speculative ring: hop_s {self.hop_s} and row_bytes {self.row_bytes} must be >= 0"
            )
        if not self.link_bytes_per_s > 0:
            raise RequestError(f"speculative ring: link_bytes_per_s {self.link_bytes_per_s} > 0")
        if self.hops is not None and self.hops < 0:
            raise RequestError(f"speculative ring: hops {self.hops} must be >= 0")

    @property
    def stages(self) -> int:
        return len(self.memory_s)

    @property
    def path_hops(self) -> int:
        """S - 1 forward hops plus the way back to stage 0; none for one stage."""
        if self.hops is not None:
            return self.hops
        return self.stages if self.stages > 1 else 0


def step_s(times: RingTimes, stage: int, rows: int) -> float:
    """One stage's step of `rows` rows: the planner's roofline plus the runtime's own time."""
    unpack = times.unpack_s[stage] if times.unpack_s else 0.0
    compute = unpack + rows * times.per_row_s[stage]
    return times.fixed_s[stage] + max(times.memory_s[stage], compute)


def hops_s(times: RingTimes, rows: int) -> float:
    """The serial path's messages: activations forward, the token ids back."""
    n = times.path_hops
    if n == 0:
        return 0.0
    forward = (n - 1) * (times.hop_s + rows * times.row_bytes / times.link_bytes_per_s)
    return forward + times.hop_s + rows * TOKEN_ID_BYTES / times.link_bytes_per_s


def round_s(times: RingTimes, rows: int) -> float:
    """One round of `rows` rows through every stage and back to the first."""
    if rows < 1:
        raise RequestError(f"speculative ring: rows {rows} must be at least 1")
    stages = sum(step_s(times, i, rows) for i in range(times.stages))
    return stages + hops_s(times, rows)


def speedup(times: RingTimes, acceptance: float, k: int) -> float:
    """Tokens per second with k drafts over tokens per second without (1.0 at k = 0)."""
    return expected_tokens(acceptance, k) * round_s(times, 1) / round_s(times, k + 1)


def best_k(times: RingTimes, acceptance: float, max_k: int = 8) -> int:
    """The draft depth in 0..max_k with the highest speed-up (the smallest of equals);
    0 when no depth beats plain decoding."""
    _check_k(max_k)
    best, best_gain = 0, 1.0
    for k in range(1, max_k + 1):
        gain = speedup(times, acceptance, k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def sends_behind(acceptance: float, rows: int, rounds: int) -> bool:
    """Whether one more round goes behind `rounds` rounds of `rows` rows in all: the chance
    they all hold, acceptance^rows, is at least MIN_CHANCE, and fewer than MAX_IN_FLIGHT
    are out. The rule itself, which the ring's stage 0 follows (swarm/ring/rounds.py)."""
    return rounds < MAX_IN_FLIGHT and acceptance**rows >= MIN_CHANCE


def in_flight(acceptance: float, rows: int, stages: int) -> int:
    """Rounds of `rows` rows a ring of `stages` keeps in flight (sends_behind; 1: one stage)."""
    _check_acceptance(acceptance)
    n = 1
    while stages > 1 and sends_behind(acceptance, rows * n, n):
        n += 1
    return n


def pipelined_speedup(times: RingTimes, acceptance: float, k: int) -> float:
    """speedup() when rounds of k drafts go behind each other (module doc): a round that
    held all (drafts and the next one's guess: a^(k+1)) is followed one interval later, the
    busiest stage's step or the round trip over those in flight; else a round trip later."""
    rows = k + 1
    trip = round_s(times, rows)
    n = in_flight(acceptance, rows, times.stages)
    busiest = max(step_s(times, i, rows) for i in range(times.stages))
    held = acceptance**rows if n > 1 else 0.0
    per_round = held * max(busiest, trip / n) + (1.0 - held) * trip
    return expected_tokens(acceptance, k) * round_s(times, 1) / per_round


@dataclass(frozen=True)
class Speculation:
    """What speculation makes of one stream on a ring: depth, rounds in flight, speed-up."""

    k: int
    in_flight: int
    speedup: float


def swarm_speedup(times: RingTimes, acceptance: float) -> Speculation:
    """The swarm's lone stream at this acceptance: the one-round best depth (what AdaptiveK
    converges to), pipelined."""
    k = best_k(times, acceptance)
    return Speculation(k, in_flight(acceptance, k + 1, times.stages),
                       pipelined_speedup(times, acceptance, k))  # fmt: skip


def break_even_acceptance(times: RingTimes, k: int) -> float:
    """The smallest acceptance at which k drafts beat plain decoding (within 1e-4), by
    bisection (the speed-up grows with acceptance); 1.0 when even full acceptance does not."""
    _check_k(k)
    if k == 0 or speedup(times, 1.0, k) <= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0  # speedup(lo) <= 1 < speedup(hi)
    while hi - lo > BISECT_TOLERANCE:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if speedup(times, mid, k) > 1.0 else (mid, hi)
    return hi


# -- from a plan ------------------------------------------------------------------------------


def ring_times(result: PlanResult) -> RingTimes:
    """A pipeline plan's serial path as RingTimes: one stage per node on the path, each
    with the weight bytes and parameters it reads per step (layer cores, its feed-forward
    units, its head rows), at the profile's effective bandwidth and FLOP/s, and the
    request's runtime costs (CostOptions.stage_step_s, hop_s, sequence_layer_s).

    The planner takes the roofline per layer and adds them; here a stage takes it once over
    its layers together, which is the same when the stage's layers are all bound by the same
    resource (one quantization throughout) and otherwise a little less. Placements whose
    feed-forward units or head rows sit off the path (scatter/gather to parallel holders) are
    not covered: they raise RequestError."""
    if result.tiers is not None or result.request.parallel == "tensor":
        raise RequestError("speculative ring: only pipeline plans have a ring of stages")
    if not result.placement.slots or not result.placement.placeable:
        raise RequestError(f"speculative ring: nothing placed ({result.problem})")
    return placed_ring_times(result.model, result.placement, result.request.node,
                             result.request.cost)  # fmt: skip


def placed_ring_times(inv: Any, p: Any, node: Any, opts: cost.CostOptions) -> RingTimes:
    """ring_times of a placement (the simulator's replica: its model, placement, profile
    and runtime costs)."""
    path = _path(inv, p)
    _check_on_path(inv, p, path)
    nbytes = dict.fromkeys(path, 0.0)
    params = dict.fromkeys(path, 0.0)
    layers = dict.fromkeys(path, 0)
    for slot in p.slots:
        if slot.layers:
            for layer in range(*slot.layers):
                b, n = _layer_cost(inv, layer)
                nbytes[slot.node] += b
                params[slot.node] += n
                layers[slot.node] += 1
        if slot.head_rows:
            part = (slot.head_rows[1] - slot.head_rows[0]) / inv.vocab_size
            b, n = cost.head_cost(inv)
            nbytes[slot.node] += part * b
            params[slot.node] += part * n
    share = getattr(node, "unpack_share", 0.0)
    flops = node.effective_flops
    return RingTimes(
        memory_s=tuple(nbytes[n] / node.effective_bandwidth_bytes_per_s for n in path),
        per_row_s=tuple(2 * params[n] * (1 - share) / flops + layers[n] * opts.sequence_layer_s
                        for n in path),
        fixed_s=tuple(opts.stage_step_s for _ in path),
        unpack_s=tuple(2 * params[n] * share / flops for n in path),
        hop_s=node.link_rtt_s / 2 + opts.hop_s,
        row_bytes=round(inv.d_model * opts.activation_bytes),
        link_bytes_per_s=node.link_bytes_per_s,
        hops=cost.serial_path(inv, p)[1],
    )  # fmt: skip


def _layer_cost(inv: Any, layer: int) -> tuple[float, float]:
    """(bytes, params) one decode step reads and multiplies in a layer: its core and the
    units of its feed-forward groups a token uses."""
    nbytes, params = inv.core(layer)
    for g in inv.groups(layer):
        nbytes += g.used * g.unit_bytes
        params += g.used * g.unit_params
    return float(nbytes), float(params)


def _path(inv: Any, p: Any) -> list[int]:
    """Nodes a token passes through in order (as cost.serial_path walks them)."""
    owners = {layer: s.node for s in p.slots if s.layers for layer in range(*s.layers)}
    path = [s.node for s in p.slots if s.embed_rows][:1]
    for layer in range(inv.n_layers):
        if path[-1:] != [owners[layer]]:
            path.append(owners[layer])
    return path


def _check_on_path(inv: Any, p: Any, path: list[int]) -> None:
    owners = {layer: s.node for s in p.slots if s.layers for layer in range(*s.layers)}
    for layer in range(inv.n_layers):
        for g in inv.groups(layer):
            off = set(cost.holders(p, layer, g.kind)) - {owners[layer]}
            if off:
                raise RequestError(
                    f"speculative ring: layer {layer}'s {g.kind} sit on nodes {sorted(off)} "
                    "besides its owner; only whole-layer stages are modelled"
                )
    heads = {s.node for s in p.slots if s.head_rows}
    if heads - {path[-1]}:
        raise RequestError(
            f"speculative ring: head rows on nodes {sorted(heads)}, not only the last stage; "
            "only whole-layer stages are modelled"
        )


def _check_acceptance(acceptance: float) -> None:
    if not 0.0 <= acceptance <= 1.0:
        raise RequestError(f"acceptance {acceptance} must be within 0..1")


def _check_k(k: int) -> None:
    if k < 0:
        raise RequestError(f"draft depth k {k} must be at least 0")


def lowest_break_even(times: RingTimes, max_k: int = 8) -> tuple[float, int]:
    """(acceptance, k): the lowest acceptance at which some depth in 1..max_k pays, and that
    depth (the smallest of equals); (1.0, 0) when none does."""
    _check_k(max_k)
    found = [(break_even_acceptance(times, k), k) for k in range(1, max_k + 1)]
    best = min(found, default=(1.0, 0))
    return best if best[0] < 1.0 else (1.0, 0)
