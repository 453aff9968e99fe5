"""The inner protocol's codec, chosen by measurement (issue 35): 100,000 heartbeats — a
100,000-node swarm's beats of one interval — encoded to JSON and decoded back into typed,
validated values, by msgspec Structs (what swarm/protocol uses) and by pydantic models of the
same fields (what the client edge uses). Prints µs per beat and the ratio.

    python -m bench.protocol [--beats 100000]
"""

from __future__ import annotations

import argparse
import json
import time
import types
import typing
from typing import Any

import msgspec
import pydantic

from cellswarm.swarm.protocol.messages import Heartbeat, NodeStats, StepHistogram, decode


def as_pydantic(cls: type[msgspec.Struct]) -> type[pydantic.BaseModel]:
    """The same message as a strict, frozen pydantic model (the same fields and types)."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {f.name: (_swap(hints[f.name]), ... if f.required else f.default)
                              for f in msgspec.structs.fields(cls)}  # fmt: skip
    config = pydantic.ConfigDict(frozen=True, extra="forbid")
    return pydantic.create_model(cls.__name__, __config__=config, **fields)


def _swap(t: Any) -> Any:
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return as_pydantic(t)
    args = typing.get_args(t)
    if not args:
        return t
    new = tuple(_swap(a) for a in args)
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        return typing.Union[new]  # noqa: UP007
    return typing.get_origin(t)[new]


def beats(n: int) -> list[Heartbeat]:
    return [Heartbeat(node_id=f"ps3-{i:06d}", session="f" * 32, rss_bytes=180_000_000 + i,
                      peak_rss_bytes=200_000_000, data_port=9000, data_host=f"10.{i % 250}.0.1",
                      ready='{"first": true, "last": false, "layers": [0, 4]}',
                      sent_s=1.7e9 + i, clock_offset_s=0.001, clock_error_s=0.0004,
                      max_sequences=8, metrics_port=9100,
                      stats=NodeStats(layers=[0, 4], steps=i, busy_s=0.5, sequences=2,
                                      decode_steps=i, decode_s=0.2, running_s=60.0,
                                      hop_s=dict.fromkeys(("read", "compute", "send"), 1e-4),
                                      step_s=StepHistogram(le=[0.001, 0.01], counts=[i, 1, 0],
                                                           sum_s=0.4)))
            for i in range(n)]  # fmt: skip


def timed(fn: Any, repeat: int = 3) -> float:
    """The best of `repeat` runs (s): the least disturbed by whatever else runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beats", type=int, default=100_000)
    n = ap.parse_args(argv).beats
    values = beats(n)
    enc = msgspec.json.Encoder()
    dec = msgspec.json.Decoder(Heartbeat)
    bodies = [enc.encode(b) for b in values]
    PydanticBeat = as_pydantic(Heartbeat)
    parsed = [json.loads(b) for b in bodies]  # what the routes hold after load_json
    models = [PydanticBeat.model_validate_json(b) for b in bodies]
    rows = {
        "msgspec": (timed(lambda: [enc.encode(b) for b in values]),
                    timed(lambda: [dec.decode(b) for b in bodies])),
        "msgspec*": (0.0, timed(lambda: [decode(Heartbeat, d) for d in parsed])),
        "pydantic": (timed(lambda: [m.model_dump_json() for m in models]),
                     timed(lambda: [PydanticBeat.model_validate_json(b) for b in bodies])),
    }  # fmt: skip
    assert [dec.decode(b) for b in bodies[:3]] == values[:3]
    print(f"{n:,} heartbeats of {len(bodies[0])} bytes; µs per beat")
    print(f"{'codec':<10} {'encode':>8} {'decode+check':>13} {'both':>8}")
    for name, (e, d) in rows.items():
        print(f"{name:<10} {e / n * 1e6:>8.2f} {d / n * 1e6:>13.2f} {(e + d) / n * 1e6:>8.2f}")
    print("msgspec*: decode from parsed JSON, as the coordinator's routes do (after their "
          "bounds check)")
    ms, pd = (sum(rows[k]) for k in ("msgspec", "pydantic"))
    print(f"pydantic / msgspec: {pd / ms:.2f}x; one interval's beats cost msgspec "
          f"{ms:.2f} s of a coordinator core, pydantic {pd:.2f} s")


if __name__ == "__main__":
    main()
