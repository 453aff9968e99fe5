"""`cellswarm doctor --model FILE`: the seed's troubleshooting order, on this machine.

The seed says: when something breaks, look at the input first (the file, the tokenizer
matches the model, the format), then the environment (memory, disk, the kernels giving the
right numbers), then a first real request (it loads, a short prompt gives non-empty, whole
text, the same input gives the same output twice) — and only last at the tool. Each check
prints one line, PASS or FAIL, and on a failure the fix; a check whose prerequisite failed
is SKIPped. The exit status is 0 only when every check passed.

`cellswarm doctor --coordinator URL` walks the same order for a running swarm: the
coordinator answers (the symptom: is anything up), the input (the coordinator's tokenizer
against the model), every node brought up in stages through the coordinator (an echo round
trip, a matmul of known inputs in the node's kernels, one forward step of its shard against
the coordinator's own — swarm/control/checkup.py), the environment across nodes (memory and
disk for each, OOM kills, and every version or CPU flag that differs), then a fixed prompt
end to end, twice, and its request and response found in the logs.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cellswarm.errors import CellswarmError, SwarmError
from cellswarm.swarm.policy import MIN_DISK_BYTES
from cellswarm.swarm.protocol.checks import Result

if TYPE_CHECKING:
    from cellswarm.engine.model import Model

PROMPT = "The capital of France is"
class Doctor:
    """The checks in order; later ones use what earlier ones found (the loaded model)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: Model | None = None
        self.results: list[Result] = []

    def run(self) -> list[Result]:
        self._check("input", "model file", self.file)
        self._check("input", "tokenizer", self.tokenizer, needs_model=True)
        self._check("environment", "memory", self.memory, needs_model=True)
        self._check("environment", "disk", self.disk)
        self._check("environment", "kernels", self.kernels)
        self._check("request", "short prompt", self.short_prompt, needs_model=True)
        self._check("request", "same output twice", self.repeatable, needs_model=True)
        return self.results

    def _check(self, step: str, name: str, fn: Callable[[], tuple[bool, str, str]],
               needs_model: bool = False) -> None:  # fmt: skip
        if needs_model and self.model is None:
            self.results.append(Result(step, name, "SKIP", "the model did not load"))
            return
        try:
            ok, detail, fix = fn()
        except CellswarmError as exc:
            ok, detail, fix = False, str(exc), "see the message"
        self.results.append(Result(step, name, "PASS" if ok else "FAIL", detail, fix))

    # -- input ---------------------------------------------------------------------------

    def file(self) -> tuple[bool, str, str]:
        import cellswarm
        from cellswarm.verify import verify

        if not self.path.is_dir():
            done = verify(self.path)
            detail = f"{done.architecture}, {done.tensors} tensors, every block's scales finite"
        else:
            detail = "a Hugging Face folder"
        self.model = cellswarm.load(self.path)
        return True, detail, ""

    def tokenizer(self) -> tuple[bool, str, str]:
        assert self.model is not None
        tok, rows = self.model.tokenizer, int(self.model.config.vocab_size)
        ok = tok.vocab_size <= rows
        detail = f"{tok.vocab_size} tokens for {rows} embedding rows"
        return ok, detail, "" if ok else "use the tokenizer that came with the model"

    # -- environment ---------------------------------------------------------------------

    def memory(self) -> tuple[bool, str, str]:
        from cellswarm.units import format_bytes

        assert self.model is not None
        from cellswarm.engine.memory import available_bytes

        need = self.model.memory(batch=1, context=min(4096, self.model.config.context_length))
        free = available_bytes()
        ok = free is None or need.total_bytes <= free
        detail = (f"needs {format_bytes(need.total_bytes)} (weights, KV for "
                  f"{need.context} tokens, scratch); "
                  f"{'unknown' if free is None else format_bytes(free)} available")  # fmt: skip
        return ok, detail, "" if ok else "free memory, shorten the context or quantize further"

    def disk(self) -> tuple[bool, str, str]:
        from cellswarm.kernels import cache_dir
        from cellswarm.units import format_bytes

        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        ok = free >= MIN_DISK_BYTES
        detail = f"{format_bytes(free)} free at {folder}"
        fix = f"free space there (at least {format_bytes(MIN_DISK_BYTES)})"
        return ok, detail, "" if ok else fix

    def kernels(self) -> tuple[bool, str, str]:
        """A matmul of known inputs in this machine's kernels against the codec path."""
        from cellswarm import kernels
        from cellswarm.quant import PackedMatrix, format_by_name

        if not kernels.enabled():
            return True, "no C compiler: the numpy path (slower, exact)", ""
        rng = np.random.default_rng(7)
        w = rng.standard_normal((64, 256)).astype(np.float32)
        x = rng.standard_normal((1, 256)).astype(np.float32)
        m = PackedMatrix.from_float(w, format_by_name("Q8_0"))
        fast = m.matmul(x)
        exact = x @ m.dequantize().T
        err = float(np.abs(fast - exact).max() / np.abs(exact).max())
        ok = err < 2e-2  # int8 activations: ~1e-3 on random data
        detail = f"Q8_0 matmul within {err:.1e} of the float path ({kernels.backend()})"
        return ok, detail, "" if ok else (
            "the kernels give wrong numbers here: rebuild them (delete the kernel cache) or "
            "run with CELLSWARM_KERNELS=numpy")  # fmt: skip

    # -- a first request -----------------------------------------------------------------

    def short_prompt(self) -> tuple[bool, str, str]:
        assert self.model is not None
        out = self.model.generate(PROMPT, max_tokens=16)
        text = out.text
        whole = "\ufffd" not in text
        ok = bool(text.strip()) and whole
        detail = f"{PROMPT!r} -> {text!r} ({out.stats.decode_tokens_per_s:.1f} tok/s)"
        if ok:
            return True, detail, ""
        if not text.strip():
            return False, detail, "empty output: check the model and its tokenizer"
        return False, detail, "garbled output (broken characters): check the tokenizer"

    def repeatable(self) -> tuple[bool, str, str]:
        assert self.model is not None
        a = self.model.generate(PROMPT, max_tokens=16).token_ids
        b = self.model.generate(PROMPT, max_tokens=16).token_ids
        ok = a == b
        detail = "greedy tokens equal on two runs" if ok else f"{a} then {b}"
        return ok, detail, "" if ok else "nondeterministic kernels: report it with this output"


class SwarmDoctor:
    """The checks of a running swarm, through its coordinator (an operator's credentials:
    an admin's API key or the cluster token)."""

    def __init__(self, url: str, token: bytes | None = None, api_key: str | None = None,
                 tls: str | None = None, wait_s: float = 20.0) -> None:  # fmt: skip
        self.url, self.token, self.api_key, self.tls = url.rstrip("/"), token, api_key, tls
        self.wait_s = wait_s
        self.results: list[Result] = []

    def run(self) -> list[Result]:
        if not self._reachable():
            return self.results
        self.results += self._rounds()
        if any(r.status == "FAIL" and r.step == "input" for r in self.results):
            self.results.append(Result("request", "short prompt", "SKIP", "the input failed"))
            return self.results
        self._requests()
        return self.results

    def _headers(self) -> dict[str, str]:
        from cellswarm.swarm.api import client
        from cellswarm.swarm.auth import OPERATOR, prove

        if self.api_key or self.token is None:
            return {}
        nonce = str(client.call(self.url, "/v1/challenge", {}, tls=self.tls)["nonce"])
        return {"X-Cellswarm-Proof": f"{nonce}:{prove(self.token, nonce, OPERATOR)}"}

    def _reachable(self) -> bool:
        import time

        from cellswarm.swarm.api import client

        t0 = time.perf_counter()
        try:
            status = client.call(self.url, "/v1/status", timeout_s=10, tls=self.tls,
                                 api_key=self.api_key)  # fmt: skip
        except CellswarmError as exc:
            self.results.append(Result("symptom", "coordinator", "FAIL", str(exc),
                                       "start it (`cellswarm up` or `cellswarm coordinator`), "
                                       "or give its URL"))  # fmt: skip
            return False
        ms = (time.perf_counter() - t0) * 1e3
        states = [n["state"] for n in status.get("nodes", [])]
        wired = bool(status.get("wired"))
        detail = (f"answered in {ms:.0f} ms; {len(states)} nodes "
                  f"({', '.join(f'{states.count(s)} {s}' for s in sorted(set(states)))}); "
                  f"{'wired' if wired else 'not wired: ' + str(status.get('problem') or '')}")
        fix = "" if wired else "no ring serves yet: see `cellswarm status` for why"
        self.results.append(Result("symptom", "coordinator", "PASS" if wired else "FAIL",
                                   detail, fix))  # fmt: skip
        return True

    def _rounds(self) -> list[Result]:
        from cellswarm.swarm.api import client

        try:
            answer = client.call(self.url, "/v1/doctor", {"wait_s": self.wait_s},
                                 timeout_s=self.wait_s + 120, tls=self.tls,
                                 headers=self._headers(), api_key=self.api_key)  # fmt: skip
        except CellswarmError as exc:
            return [Result("node", "checks", "FAIL", str(exc),
                           "give --token-file (the cluster's token) or an admin's --api-key")]
        return [Result(**r) for r in answer["results"]]

    def _requests(self) -> None:
        """The seed's first real request: non-empty whole text, the same twice, logged."""
        from cellswarm.swarm.api import client

        body = {"prompt": PROMPT, "max_tokens": 16}
        outs = []
        for _ in range(2):
            try:
                rid = client.submit(self.url, body, tls=self.tls, api_key=self.api_key)
                outs.append((rid, self._wait(rid)))
            except CellswarmError as exc:
                self.results.append(Result("request", "short prompt", "FAIL", str(exc),
                                           "read the request's log (`cellswarm logs ID`)"))
                return
        (rid, first), (_, second) = outs
        text = str(first.get("text", ""))
        ok = first["state"] == "done" and bool(text.strip()) and "\ufffd" not in text
        self.results.append(Result(
            "request", "short prompt", "PASS" if ok else "FAIL",
            f"{PROMPT!r} -> {text!r} ({first['state']}, {first.get('attempts', 1)} lease(s))",
            "" if ok else "empty or garbled text: check the tokenizer, then the nodes above"))
        same = first["tokens"] == second["tokens"]
        self.results.append(Result(
            "request", "same output twice", "PASS" if same else "FAIL",
            "greedy tokens equal on two runs" if same else
            f"{first['tokens']} then {second['tokens']}",
            "" if same else "a node computes wrong or nondeterministic numbers: look at "
            "the nodes' matmul and forward lines"))  # fmt: skip
        self.results.append(self._logged(rid))

    def _wait(self, rid: str, timeout_s: float = 300.0, every_s: float = 10.0) -> Any:
        """The request's end, saying every `every_s` how long it has waited and what the
        swarm is doing; at once a failure when the coordinator says the model cannot be
        placed (the request would wait in the queue for ever)."""
        import sys
        import time

        from cellswarm.swarm.api import client

        t0 = time.monotonic()
        while True:
            try:
                return client.wait(self.url, rid, timeout_s=every_s, tls=self.tls,
                                   api_key=self.api_key)  # fmt: skip
            except SwarmError:
                waited = time.monotonic() - t0
                if waited >= timeout_s:
                    raise
            status = client.call(self.url, "/v1/status", timeout_s=10, tls=self.tls,
                                 api_key=self.api_key)  # fmt: skip
            if status.get("problem"):
                raise SwarmError(f"request {rid} cannot run: the swarm cannot place the "
                                 f"model: {status['problem']}")  # fmt: skip
            ring = "wired" if status.get("wired") else "not wired yet (rewiring)"
            print(f"doctor: request {rid} waiting {waited:.0f} s; the ring is {ring}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _logged(self, rid: str) -> Result:
        import time

        from cellswarm.swarm.api.client import fetch_timeline

        names: set[str] = set()
        for _ in range(50):  # events reach the coordinator's table within a second or two
            try:
                events, _ = fetch_timeline(self.url, rid, token=self.token,
                                           api_key=self.api_key, tls=self.tls)  # fmt: skip
            except CellswarmError as exc:
                return Result("request", "in the logs", "FAIL", str(exc),
                              "give --token-file or an admin's --api-key to read the logs")
            names = {str(e["event"]) for e in events}
            if "submitted" in names and names & {"completed", "done"}:
                return Result("request", "in the logs", "PASS",
                              f"{rid}: {len(events)} events from "
                              f"{len({e['node'] for e in events})} nodes, submitted to done")
            time.sleep(0.2)
        return Result("request", "in the logs", "FAIL", f"{rid}: only {sorted(names)} logged",
                      "a node's log does not reach the coordinator: is its disk full?")


def add_doctor_command(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check a model and this machine, or a running swarm, "
                       "in the seed's order: input, environment, a first request")  # fmt: skip
    p.add_argument("--model", help="the .gguf file or folder (default: the demo model)")
    p.add_argument("--coordinator", metavar="URL", help="check a running swarm and every "
                   "node through its coordinator instead")  # fmt: skip
    p.add_argument("--token-file", help="the cluster's token (an operator's proof)")
    p.add_argument("--api-key-file", help="a file whose first key is an admin's API key (a "
                   "coordinator with --api-key-file); never the key itself, which ps would "
                   "show")  # fmt: skip
    p.add_argument("--tls", help="this operator's certificate folder (`cellswarm certs`)")
    p.add_argument("--wait", type=float, default=20.0,
                   help="seconds the nodes have to answer (default 20)")  # fmt: skip
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from cellswarm.demo import demo_model_path

    if args.coordinator:
        from cellswarm.swarm.auth import load_token

        token = load_token(args.token_file) if args.token_file else None
        from cellswarm.swarm.api.client import api_key

        results = SwarmDoctor(args.coordinator, token, api_key(args), args.tls,
                              args.wait).run()  # fmt: skip
        return report(results)
    path = Path(args.model) if args.model else Path(demo_model_path())
    if not path.exists():
        print(f"FAIL input       model file             {path} does not exist — fix: give a "
              ".gguf file or a model folder")  # fmt: skip
        return 1
    return report(Doctor(path).run())


def report(results: list[Result]) -> int:
    """One line per check, a summary, and the exit status (1 on any failure)."""
    for r in results:
        print(r.line(), flush=True)
    failed = [r for r in results if r.status != "PASS"]
    first = next((r for r in failed if r.status == "FAIL"), failed[0] if failed else None)
    print(f"{len(results) - len(failed)} of {len(results)} checks passed"
          + (f"; start with the first failure ({first.name})" if first else ""))  # fmt: skip
    return 1 if failed else 0

