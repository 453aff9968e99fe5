"""What the coordinator sees of each request, as vLLM and llama-server count it: time in the
queue, time to the first token, time end to end (histograms), prompt and generated tokens,
and how jobs end (counters). Observed where the coordinator handles the job — its first
lease, its first checkpointed tokens, its result — in this process's memory: counters that
restart with the coordinator, which Prometheus' rate() takes as a reset. Pure bookkeeping:
times come in (`now`, the job's `created_s`, both wall-clock seconds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cellswarm.swarm.control.jobs import Job

# vLLM's buckets (seconds): a first token within ms on a box, minutes on a loaded swarm
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
MAX_TRACKED = 100_000  # jobs awaiting their first token (a bound, should heads never report)
RECENT = 200  # ended requests kept for the dashboard's list and latency chart


@dataclass(frozen=True)
class Ended:
    """One request that ended here, as the dashboard lists it."""

    job_id: str
    state: str
    ended_s: float  # wall clock
    e2e_s: float | None  # None: not known (a cancelled batch's jobs)
    ttft_s: float | None
    tokens: int
    batch_id: str | None


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    sum_s: float = 0.0
    count: int = 0

    def observe(self, value_s: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        value_s = max(value_s, 0.0)
        i = next((k for k, b in enumerate(self.buckets) if value_s <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum_s += value_s
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus' buckets: (le, observations at most le), +Inf last."""
        counts = self.counts or [0] * (len(self.buckets) + 1)
        out, total = [], 0
        for le, n in zip((*map(str, self.buckets), "+Inf"), counts, strict=True):
            total += n
            out.append((le, float(total)))
        return out


@dataclass
class RequestMetrics:
    queue_s: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # done, dead, cancelled
    waiting_first: dict[str, float] = field(default_factory=dict)  # job id -> created_s
    first_s: dict[str, float] = field(default_factory=dict)  # job id -> its time to first token
    recent: deque[Ended] = field(default_factory=lambda: deque(maxlen=RECENT))

    def leased(self, job: Job, now: float) -> None:
        """A job leased: its first lease ends its wait in the queue."""
        if job.leases <= 1:
            self.queue_s.observe(now - job.created_s)
        if job.kind == "generate" and not job.tokens and len(self.waiting_first) < MAX_TRACKED:
            self.waiting_first[job.job_id] = job.created_s

    def tokens(self, job_id: str, n_tokens: int, now: float) -> None:
        """A head reported a job's tokens so far: the first ones end its time to first token."""
        if n_tokens > 0 and job_id in self.waiting_first:
            ttft = now - self.waiting_first.pop(job_id)
            self.ttft_s.observe(ttft)
            if len(self.first_s) < MAX_TRACKED:
                self.first_s[job_id] = ttft

    def ended(self, state: str, job_id: str, job: Job | None, n_tokens: int,
              now: float) -> None:  # fmt: skip
        """A job reached a terminal state (done, dead, cancelled) here (JobQueue.on_end)."""
        self.tokens(job_id, n_tokens, now)
        self.waiting_first.pop(job_id, None)
        ttft = self.first_s.pop(job_id, None)
        self.outcomes[state] = self.outcomes.get(state, 0) + 1
        if job_id:
            e2e = now - job.created_s if job is not None else None
            self.recent.append(Ended(job_id, state, now, e2e, ttft, n_tokens,
                                     job.batch_id if job is not None else None))  # fmt: skip
        if state != "done" or job is None:
            return
        self.e2e_s.observe(now - job.created_s)
        self.prompt_tokens += len(job.payload.get("prompt") or [])
        self.generation_tokens += n_tokens
