"""What a simulation is asked: the scenario (model, nodes, workload, failures, network) and
the calibration knobs (`SimParams`). Frozen, validated once; bad values are one-line errors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from cellswarm.errors import RequestError
from cellswarm.sim.control import ControlPlane
from cellswarm.swarm import policy
from cellswarm.swarm.policy.jobs import Rules

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*(s|m|h|d|y)?\s*$")
_DURATION_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "y": 365 * 86400.0}


def parse_duration(text: str | float, what: str = "duration") -> float:
    """'90s', '30m', '1h', '2d', '3y' or a number of seconds -> seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION_RE.match(text) if isinstance(text, str) else None
        if not m:
            raise RequestError(f"{what} {text!r} is not a duration; write e.g. 90s, 30m, 1h, 2d")
        value = float(m.group(1)) * _DURATION_UNIT[m.group(2) or ""]
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"{what} {text!r} must be a non-negative duration")
    return value


@dataclass(frozen=True)
class SimParams:
    """Knobs a calibration against a real (emulated) local swarm fits; defaults add nothing.

    hop_overhead_s: software time per message on the token's serial path (framing, syscalls,
        the receiving event loop), added to the planner's per-token time once per hop.
    step_overhead_s: software time per stage step per token (Python around the kernels),
        added to every node's busy time and once per pipeline stage to the token's time.
    replace_overhead_s: seconds from a node's death to its spare starting to load the shard
        (failure detection, re-placement, rewiring), added to shard bytes / link bandwidth.
    """

    hop_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    replace_overhead_s: float = 0.0
    # The emulation floor, for local calibration only: an emulated node cannot be faster
    # than the host running it, so a step takes at least its shard's bytes at this rate
    # (0: no floor — real nodes).
    host_bytes_per_s: float = 0.0
    lease_s: float = policy.LEASE_S  # the real swarm's policy (swarm/policy/__init__.py)
    backoff_s: float = policy.BACKOFF_S
    max_backoff_s: float = policy.MAX_BACKOFF_S
    max_attempts: int = policy.MAX_ATTEMPTS
    offline_after: int = policy.OFFLINE_AFTER  # a node that failed this many times is taken out

    def __post_init__(self) -> None:
        for name in ("hop_overhead_s", "step_overhead_s", "replace_overhead_s", "backoff_s",
                     "host_bytes_per_s"):
            _non_negative(name, getattr(self, name))
        _positive("lease_s", self.lease_s)
        if self.max_attempts < 1 or self.offline_after < 1:
            raise RequestError("max_attempts and offline_after must be at least 1")

    @property
    def rules(self) -> Rules:
        """The policy core's rules (swarm/policy/jobs.py) with these numbers."""
        retry = policy.Retry(self.lease_s, self.backoff_s, self.max_backoff_s)
        return Rules(max_attempts=self.max_attempts, retry=retry)


@dataclass(frozen=True)
class Scenario:
    """One simulation: the planner's inputs, a workload, failure processes, a seed.

    Workload: `rate` jobs/s arriving as a Poisson process, or (rate None) a batch of `jobs`
    all queued at time 0. Failures: per node exponential MTBF/MTTR (None: off); per access
    switch (a rack) its own MTBF/MTTR, taking every node on it down at once; a `slow_fraction`
    of nodes runs at `slow_speed` of the profile's speed for the whole run; a `poison_fraction`
    of jobs fails every attempt (a bad input) and so ends dead-lettered.
    """

    model: str
    node: str = "ps3"
    count: int = 1
    quant: str | None = None
    context: int = 4096
    concurrency: int = 1
    duration_s: float = 3600.0
    rate: float | None = None
    jobs: int = 1000
    prompt_tokens: int = 512
    output_tokens: int = 512
    mtbf_s: float | None = None
    mttr_s: float = 3600.0
    rack_mtbf_s: float | None = None
    rack_mttr_s: float = 3600.0
    slow_fraction: float = 0.0
    slow_speed: float = 0.5
    poison_fraction: float = 0.0
    # what fraction of speculative drafts the workload's text keeps (engine/speculative.py):
    # near 1 for extraction and templated output, near 0 for free writing; 0 models none
    acceptance: float = 0.0
    seed: int = 0
    network: tuple[tuple[str, str | float], ...] = ()  # overrides of [defaults.network] keys
    samples: int = 240  # points of the time series
    params: SimParams = field(default_factory=SimParams)
    control: ControlPlane = field(default_factory=ControlPlane)  # the coordinator's capacity

    def __post_init__(self) -> None:
        if self.count < 1:
            raise RequestError(f"--count {self.count} must be at least 1")
        if self.concurrency < 1 or self.context < 1:
            raise RequestError("--concurrency and --context must be at least 1")
        _positive("--duration", self.duration_s)
        if self.rate is not None:
            _positive("--rate", self.rate)
        if self.jobs < 0:
            raise RequestError(f"--jobs {self.jobs} must be non-negative")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise RequestError("--prompt and --output must be at least 1 token")
        if self.prompt_tokens + self.output_tokens > self.context:
            raise RequestError(
                f"--prompt {self.prompt_tokens} + --output {self.output_tokens} tokens exceed "
                f"--context {self.context}; raise --context or shorten the jobs"
            )
        for name, value in (("--mtbf", self.mtbf_s), ("--rack-mtbf", self.rack_mtbf_s)):
            if value is not None:
                _positive(name, value)
        _positive("--mttr", self.mttr_s)
        _positive("--rack-mttr", self.rack_mttr_s)
        for name, value in (("--slow-fraction", self.slow_fraction),
                            ("--poison-fraction", self.poison_fraction),
                            ("--acceptance", self.acceptance)):  # fmt: skip
            if not 0 <= value <= 1:
                raise RequestError(f"{name} {value} must be within 0..1")
        if not 0 < self.slow_speed <= 1:
            raise RequestError(f"--slow-speed {self.slow_speed} must be within (0, 1]")
        if self.samples < 2:
            raise RequestError("samples must be at least 2")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise RequestError(f"{name} {value!r} must be a positive number")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise RequestError(f"{name} {value!r} must be a non-negative number")
