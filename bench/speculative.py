"""Speculative decoding, measured: decode tokens/s with and without, per setup and prompt.

    python -m bench.speculative [--quick] [--lab | --no-lab] [--out docs]

The prompts are bench/speculative_peer.py `demo_prompts()` (raw text, no chat template,
tokenized by the demo model's own tokenizer): "extraction" and "summary" ask for text the
prompt already holds (a ~600-token passage), where prompt lookup can draft; "story" is a
free continuation, where it cannot. Greedy decoding, N tokens (64; --quick: 16), no stop
token, so both runs write exactly N tokens and the speculative run must write the same ones
(checked: the "same" column).

Setups (rows):
  one process            model.generate in this process, the default thread count
  local stages S         LocalPipeline of S stage processes on loopback (one thread each),
                         even split by layers
  emulated rpi4 stages S LocalPipeline stages emulating a Raspberry Pi 4 (compute padded by
                         sleeping, gigabit links), layers by planner/cost.py emulated_split
  lab rpi4 hosts S       `cellswarm lab` hosts in network namespaces, tc-shaped gigabit
                         links, workers --profile rpi4, jobs over the API (needs root: on by
                         default when root, not with --quick; --lab / --no-lab to choose)
  llama.cpp one process  llama-lookup (plain: --spec-draft-n-max 0; lookup) and
                         llama-speculative (draft: the demo file's first DRAFT_LAYERS layers),
                         if bench.peers has built llama.cpp already (this never builds it)

Decode tokens/s leaves prefill out: over stages, from per-token arrival stamps, the first
token (from prefill) excluded, as bench/swarm.py does; in one process, GenerationStats'
decode rate; over the lab, with the prefix cache warm, (N - 1) / (T(N) - T(1)) from two jobs'
wall times; llama.cpp, its own "decoded ... t/s" line. Speculative is `auto` for our rows.
Over stages and the lab, plain and speculative runs take turns, 3 of each (--quick: 1), and
each keeps its best: a drift in the machine's load falls on both sides alike.

Columns: acceptance = accepted / drafted (counters: the engine's stats, stage 0's, the job's);
tokens/step = (N - 1) / (N - 1 - accepted), the mean tokens a decode step made (approximate:
the counters leave out the last round); predicted = planner/speculative.py
swarm_speedup(ring_times, a) (the one-round best k, rounds pipelined as the ring sends them)
for the same number of nodes of the setup's profile, a being the per-draft
acceptance kept / (kept + rounds with a refusal) counted in the one-process run of the same
prompt (the drafts and the tokens are the same text; accepted / drafted is biased low, since a
refusal ends a round and the drafts after it are never judged).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.speculative_peer import demo_prompts

CONTEXT = 1024  # ~620-token prompts + N
DRAFT_LAYERS = 4  # llama.cpp's draft model: the demo file's first layers
LAPTOP = "laptop"  # the planner's profile for rows on this host (it has none for "this host")


@dataclass
class Row:
    setup: str
    stages: int
    prompt: str
    mode: str  # the speculative mode of the "spec" column
    tokens_per_s_off: float | None
    tokens_per_s_spec: float | None
    drafted: int | None = None
    accepted: int | None = None
    per_draft: float | None = None  # kept / (kept + rounds with a refusal), one process
    predicted: float | None = None
    predicted_profile: str | None = None
    same: bool | None = None
    tokens: int = 0  # generated per run
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.tokens_per_s_off and self.tokens_per_s_spec:
            return self.tokens_per_s_spec / self.tokens_per_s_off
        return None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else None

    @property
    def tokens_per_step(self) -> float | None:
        if self.accepted is None or self.tokens < 2:
            return None
        steps = self.tokens - 1 - self.accepted
        return (self.tokens - 1) / steps if steps > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup, "acceptance": self.acceptance,
                "tokens_per_step": self.tokens_per_step}  # fmt: skip


# ------------------------------------------------------------------------------- prediction


def plan_for(path: str, profile: str, stages: int) -> Any:
    """The planner's PlanResult for `stages` nodes of `profile`, each given just enough
    memory that the model needs all of them (bench/swarm.py exact_plan); None when no memory
    makes it exactly `stages`."""
    from bench.swarm import exact_plan

    return exact_plan(path, profile, stages, context=CONTEXT)


def predicted_speedup(path: str, profile: str, stages: int, acceptance: float | None,
                      cache: dict[tuple[str, int], Any]) -> float | None:  # fmt: skip
    from cellswarm.planner.speculative import ring_times, swarm_speedup

    if acceptance is None:
        return None
    key = (profile, stages)
    if key not in cache:
        result = plan_for(path, profile, stages)
        cache[key] = None if result is None else ring_times(result)
    times = cache[key]
    if times is None:
        return None
    return swarm_speedup(times, acceptance).speedup


# ------------------------------------------------------------------------------ one process


@contextlib.contextmanager
def counting_rounds() -> Iterator[list[tuple[int, int]]]:
    """(drafts, kept) of every verified round the engine's AdaptiveK observes in this process."""
    from cellswarm.engine.speculative import AdaptiveK

    seen: list[tuple[int, int]] = []
    original = AdaptiveK.observe

    def observe(self: AdaptiveK, drafts: int, kept: int, counted: bool = True) -> None:
        if counted and drafts:
            seen.append((drafts, kept))
        original(self, drafts, kept, counted)

    setattr(AdaptiveK, "observe", observe)  # noqa: B010 (mypy: no assigning to a method)
    try:
        yield seen
    finally:
        setattr(AdaptiveK, "observe", original)  # noqa: B010


def per_draft_acceptance(rounds: list[tuple[int, int]]) -> float | None:
    kept = sum(k for _, k in rounds)
    refusals = sum(1 for d, k in rounds if k < d)
    return kept / (kept + refusals) if kept + refusals else None


def one_process(path: str, prompts: dict[str, list[int]], n: int, reps: int) -> list[Row]:
    """model.generate in this process, default threads; the best of `reps` runs each way."""
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.loader import load

    model = load(path)

    def run(ids: list[int], mode: str) -> Any:
        opts = GenerateOptions(max_tokens=n, stop_ids=frozenset(), speculative=mode)
        return model.generate(ids, opts)

    run(prompts["story"][:8], "off")  # warm: pages, kernels
    rows = []
    for kind, ids in prompts.items():
        offs = [run(ids, "off") for _ in range(reps)]
        with counting_rounds() as rounds:
            specs = [run(ids, "auto") for _ in range(reps)]
        off, spec = max(offs, key=_rate), max(specs, key=_rate)
        same = all(g.token_ids == offs[0].token_ids for g in [*offs, *specs])
        assert same, f"one process, {kind}: speculative tokens differ from plain decoding"
        rows.append(Row("one process", 1, kind, "auto", _rate(off), _rate(spec),
                        spec.stats.drafted_tokens, spec.stats.accepted_tokens,
                        per_draft_acceptance(rounds),  # over all `reps` runs
                        same=same, tokens=len(spec.token_ids)))  # fmt: skip
    return rows


def _rate(g: Any) -> float:
    return float(g.stats.decode_tokens_per_s)


# ---------------------------------------------------------------------------- stage processes


def stage_rows(path: str, prompts: dict[str, list[int]], n: int, stages: int,
               profile: str | None, reps: int = 1) -> list[Row]:  # fmt: skip
    """One stream over S stage processes on loopback, plain (profile None) or emulated; the
    best of `reps` runs each way (drafted and accepted: their mean)."""
    from cellswarm.planner.cost import emulated_split
    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    split = emulated_split(path, stages, profile) if profile else even_split(30, stages)
    setup = f"emulated {profile} stages" if profile else "local stages"
    rows = []
    with LocalPipeline(path, split, profile=profile, context=CONTEXT) as pipe:
        pipe.generate([{"prompt": prompts["story"][:8], "max_tokens": 2, "speculative": "off"}])

        def counters() -> tuple[int, int]:
            s = pipe.stats()[0]
            return int(str(s.get("drafted_tokens", 0))), int(str(s.get("accepted_tokens", 0)))

        def run(ids: list[int], mode: str) -> tuple[list[int], float]:
            stamps: list[float] = []
            (res,) = pipe.generate([{"prompt": ids, "max_tokens": n, "speculative": mode}],
                                   on_token=lambda _i, _t: stamps.append(time.perf_counter()))
            rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
            return res.tokens, rate  # fmt: skip

        for kind, ids in prompts.items():
            # no separate warm-up of the prompt: the rates leave prefill out, and an emulated
            # stage charges a prompt's full prefill even when its prefix cache holds it
            # off and auto in turns (A B A B): a drift in the machine's load falls on both
            offs, specs, drafted, kept = [], [], 0, 0
            for _ in range(reps):
                offs.append(run(ids, "off"))
                d0, a0 = counters()
                specs.append(run(ids, "auto"))
                d1, a1 = counters()
                drafted, kept = drafted + d1 - d0, kept + a1 - a0
            same = all(t == offs[0][0] for t, _ in [*offs, *specs])
            assert same, f"{setup} {stages}, {kind}: speculative tokens differ from plain"
            rows.append(Row(setup, stages, kind, "auto", max(r for _, r in offs),
                            max(r for _, r in specs), drafted // reps, kept // reps,
                            same=same, tokens=len(specs[0][0])))  # fmt: skip
    return rows


# -------------------------------------------------------------------------------- lab hosts


def lab_rows(path: str, prompts: dict[str, list[int]], n: int, stages: int,
             profile: str = "rpi4", reps: int = 1) -> list[Row]:  # fmt: skip
    """One job at a time on S lab hosts emulating `profile` (needs root; the lab's
    namespaces go with the `with`); off and auto in turns, the best of `reps` each."""
    from cellswarm.lab.lab import Lab
    from cellswarm.lab.topology import LabSpec
    from cellswarm.planner.profiles import get_profile
    from cellswarm.swarm.api import client

    spec = LabSpec(hosts=stages, racks=1, memory_bytes=384 << 20, host_bits_per_s=1e9)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lab = Lab(spec, Path(tmp), prefix="csspec", in_order=True,
                  worker_args=("--profile", profile),
                  coordinator_args=("--stages", str(stages), "--max-sequences", "1",
                                    "--context", str(CONTEXT), "--no-rebalance"))  # fmt: skip
        with lab:
            client.wait_wired(lab.url, 600)
            lab.reshape(get_profile(profile).link_bits_per_s)

            def job(ids: list[int], tokens: int, mode: str) -> tuple[dict[str, Any], float]:
                t0 = time.perf_counter()
                rid = client.submit(lab.url, {"prompt": ids, "max_tokens": tokens,
                                              "stop_ids": [], "speculative": mode})
                done = dict(client.wait(lab.url, rid))
                if done.get("state") != "done":
                    raise RuntimeError(f"lab job {rid} ended {done.get('state')}: {done}")
                return done, time.perf_counter() - t0  # fmt: skip

            for kind, ids in prompts.items():
                job(ids, 1, "off")  # the prefix cache warm
                out: dict[str, tuple[dict[str, Any], float]] = {}
                for _ in range(reps):
                    for mode in ("off", "auto"):
                        _, t1 = job(ids, 1, mode)
                        done, tn = job(ids, n, mode)
                        rate = (n - 1) / (tn - t1) if tn > t1 else 0.0
                        if mode not in out or rate > out[mode][1]:
                            out[mode] = (done, rate)
                (off, r_off), (sp, r_sp) = out["off"], out["auto"]
                same = list(sp["tokens"]) == list(off["tokens"])
                assert same, f"lab {stages}, {kind}: speculative tokens differ from plain"
                rows.append(Row("lab rpi4 hosts", stages, kind, "auto", r_off, r_sp,
                                int(sp.get("drafted_tokens") or 0),
                                int(sp.get("accepted_tokens") or 0),
                                same=same, tokens=len(sp["tokens"])))  # fmt: skip
    return rows


# -------------------------------------------------------------------------------- llama.cpp


def llama_cpp_built() -> bool:
    """bench.peers' install stamp and binaries present (checked here: install_llama_cpp
    would build them when absent)."""
    from bench import peers

    root = peers.peers_dir()
    stamp = root / f"llama.cpp-{peers.LLAMA_CPP_PYTHON}.json"
    src = root / f"llama_cpp_python-{peers.LLAMA_CPP_PYTHON}"
    bin_dir = src / "vendor" / "llama.cpp" / "build" / "bin"
    return stamp.is_file() and all((bin_dir / b).is_file() for b in peers.BINARIES)


def llama_cpp_rows(path: str, texts: dict[str, str], n: int) -> list[Row]:
    from bench import peers
    from bench.speculative_peer import llama_cpp_speculative, truncated_draft

    name = f"{Path(path).stem}-first{DRAFT_LAYERS}.gguf"
    draft = truncated_draft(Path(path), peers.peers_dir() / "speculative" / name, DRAFT_LAYERS)
    got = llama_cpp_speculative(Path(path), draft, texts, n, threads=os.cpu_count() or 1)
    rows = []
    for kind in texts:
        plain = next(r for r in got if r["prompt"] == kind and r["mode"] == "plain")
        for mode in ("lookup", "draft"):
            r = next((r for r in got if r["prompt"] == kind and r["mode"] == mode), None)
            if r is None:
                continue
            note = "; ".join(" / ".join(x["error"]) for x in (plain, r) if x.get("error"))
            rows.append(Row("llama.cpp one process", 1, kind, mode, plain["tokens_per_s"],
                            r["tokens_per_s"], r["drafted"], r["accepted"],
                            same=r["text"] == plain["text"], tokens=int(r["tokens"] or n),
                            note=note))  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------ output


HEADER = ("setup", "S", "prompt", "tok/s off", "tok/s spec", "speed-up", "acceptance",
          "tokens/step", "predicted", "same")  # fmt: skip


def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def cells(r: Row) -> list[str]:
    mode = "" if r.mode == "auto" else f" ({r.mode})"
    pred = _f(r.predicted) + ("" if r.predicted is None or r.predicted_profile is None
                              or r.predicted_profile in r.setup else "ᵃ")  # fmt: skip
    return [r.setup + mode, str(r.stages), r.prompt, _f(r.tokens_per_s_off, ".1f"),
            _f(r.tokens_per_s_spec, ".1f"), _f(r.speedup), _f(r.acceptance),
            _f(r.tokens_per_step), pred,
            "—" if r.same is None else ("yes" if r.same else "NO")]  # fmt: skip


def summary(rows: list[Row]) -> list[str]:
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.speedup is not None:
            mode = "" if r.mode == "auto" else f" ({r.mode})"
            groups.setdefault(f"{r.setup}{mode} {r.stages}", []).append(r.speedup)
    lines = [f"{name}: mean speed-up {statistics.mean(v):.2f} over {len(v)} prompts, "
             f"min {min(v):.2f}" for name, v in groups.items()]  # fmt: skip
    every = [s for v in groups.values() for s in v]
    if every:
        lines.append(f"all rows: min speed-up {min(every):.2f}, max {max(every):.2f}")
    return lines


FOOTNOTES = (
    "acceptance: accepted / drafted (biased low: a refusal ends a round, later drafts are "
    "never judged; over stages a guess sent ahead in a round of its own counts as a draft). "
    "tokens/step: (N - 1) / (N - 1 - accepted), the tokens per round that no kept draft or "
    "guess gave, approximate.",
    "predicted: planner/speculative.py swarm_speedup (best k, rounds pipelined) for the "
    "setup's nodes, with the "
    "per-draft acceptance kept / (kept + rounds with a refusal) counted in the one-process "
    "run of the same prompt (the same text and drafts; stage processes do not report rounds).",
    "ᵃ one process and local stages run on this host, for which the planner has no profile: "
    f"predicted with its {LAPTOP!r} profile (an x86 laptop), a rough stand-in.",
    "one process: the default thread count; local and emulated stages: one thread each. "
    "llama.cpp: threads = cores; plain = llama-lookup with no drafts; draft = llama-"
    f"speculative with the demo file's first {DRAFT_LAYERS} layers as draft model; its "
    "'same' compares texts with its plain run.",
)


def render(rows: list[Row]) -> str:
    table = [list(HEADER), *(cells(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) if i in (1, *range(3, 10)) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in table]  # fmt: skip
    return "\n".join(lines)


def markdown(rows: list[Row], command: str, notes: list[str]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    out += ["", *[f"- {s}" for s in summary(rows)], ""]
    out += [f"{i + 1}. {f}" for i, f in enumerate((*FOOTNOTES, *notes))]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out += ["", f"Measured on {machine()}, {now}: `{command}`", ""]
    return "\n".join(out)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


# -------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="16 tokens, 1 and 2 stages, one run each, no lab")
    parser.add_argument("--lab", action=argparse.BooleanOptionalAction, default=None,
                        help="lab hosts rows (network namespaces, needs root; default: on "
                        "when root, off with --quick)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write speculative-table.md and .json here")
    args = parser.parse_args()
    from cellswarm.demo import demo_model_path
    from cellswarm.loader import load_tokenizer

    t_start = time.perf_counter()
    path = str(demo_model_path())
    n = 16 if args.quick else 64
    stage_counts = (1, 2) if args.quick else (1, 2, 4)
    texts = demo_prompts()
    tok = load_tokenizer(path)
    prompts = {kind: list(tok.encode(text)) for kind, text in texts.items()}
    print(f"demo model {Path(path).name}, {n} tokens, prompts "
          + ", ".join(f"{k} {len(v)} tokens" for k, v in prompts.items()), flush=True)  # fmt: skip
    notes: list[str] = []
    rows = one_process(path, prompts, n, reps=1 if args.quick else 3)
    _progress(rows, t_start)
    for profile in (None, "rpi4"):
        for s in stage_counts:
            got = stage_rows(path, prompts, n, s, profile, reps=1 if args.quick else 3)
            rows += got
            _progress(got, t_start)
    lab = args.lab if args.lab is not None else (not args.quick and os.geteuid() == 0)
    if lab:
        for s in stage_counts:
            try:
                got = lab_rows(path, prompts, n, s, reps=1 if args.quick else 3)
            except Exception as exc:  # reported; the rest of the table stands
                notes.append(f"lab rpi4 hosts {s}: failed ({type(exc).__name__}: {exc})")
                print(notes[-1], flush=True)
                continue
            rows += got
            _progress(got, t_start)
    else:
        notes.append("lab rpi4 hosts: not run (" + ("--no-lab" if args.lab is False else
                     "--quick" if args.quick else "needs root") + ")")  # fmt: skip
    if llama_cpp_built():
        try:
            got = llama_cpp_rows(path, texts, n)
            rows += got
            _progress(got, t_start)
        except Exception as exc:  # reported as a note
            notes.append(f"llama.cpp: failed ({type(exc).__name__}: {exc})")
    else:
        notes.append("llama.cpp: not built (python -m bench.peers builds it)")
    first = {r.prompt: r.per_draft for r in rows if r.setup == "one process"}
    plans: dict[tuple[str, int], Any] = {}
    for r in rows:
        if r.setup.startswith("llama.cpp"):
            continue
        r.per_draft = first.get(r.prompt)
        r.predicted_profile = "rpi4" if "rpi4" in r.setup else LAPTOP
        r.predicted = predicted_speedup(path, r.predicted_profile, r.stages, r.per_draft, plans)
    from cellswarm.planner.speculative import round_s

    costs = [f"{profile} x {stages} {round_s(t, 5) / round_s(t, 1):.2f}"
             for (profile, stages), t in sorted(plans.items()) if t is not None]  # fmt: skip
    if costs:
        notes.append("the planner's cost of a round of 5 rows (4 drafts) over one of 1 row: "
                     + ", ".join(costs) + " (near 1: rows nearly free, speculation pays; near "
                     "5: compute-bound, it cannot)")  # fmt: skip
    command = "python -m bench.speculative " + " ".join(sys.argv[1:])
    print()
    print(render(rows))
    print()
    for line in [*summary(rows), *notes]:
        print(line)
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speculative-table.md").write_text(markdown(rows, command.strip(), notes))
        (args.out / "speculative.json").write_text(json.dumps(
            {"machine": machine(), "command": command.strip(), "tokens": n,
             "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "notes": notes, "rows": [r.as_dict() for r in rows]}, indent=1) + "\n")  # fmt: skip
        print(f"wrote {args.out / 'speculative-table.md'} and {args.out / 'speculative.json'}")


def _progress(rows: list[Row], t0: float) -> None:
    for r in rows:
        print(f"  [{time.perf_counter() - t0:5.0f} s] {r.setup} {r.stages} {r.prompt} ({r.mode}): "
              f"{_f(r.tokens_per_s_off, '.1f')} -> {_f(r.tokens_per_s_spec, '.1f')} tokens/s, "
              f"drafted {r.drafted} accepted {r.accepted}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
