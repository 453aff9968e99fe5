"""Part servers: a layer's routed experts, or rows of the vocabulary, on nodes of their own.

    stage (attention, router, shared experts) --experts--> expert node(s) --sum--> stage
    first stage --rows(embed)--> vocab node(s)        last stage --logits--> vocab node(s)

A mixture-of-experts layer is mostly experts (DeepSeek-V3: ~11 GB of ~11.2 GB a layer), and
a token uses 8 of 256; so the layer's owner keeps attention, router and shared experts and
sends each token's normed hidden state only to the nodes holding the experts it was routed
to. Each answers every held expert's weighted output for the tokens routed to it, apart;
the owner adds them all, its own too, per token in ascending expert order — the float32
additions one process makes, so a token's bits do not depend on who holds which expert
(summed on the holders, they would: addition is not associative). That costs the answer
one row per (token, expert) pair held there, not one per token: k of them for a token over
all holders, fewer bytes than one sum per holder once a token's k experts sit on k nodes.
A vocabulary too big for one node is split by rows: each vocab node holds rows [a, b) of the
output head (and of the embedding) and answers partial logits, or dequantized rows.

A part server is stateless (no KV cache, no sequences): a replacement needs no replay of its
own, only the stages' replay of the requests in flight.

The stage's forward pass is synchronous numpy, so it talks to part servers over blocking
sockets from inside it: all requests of a step are written first, then the answers read, so
the holders work in parallel with each other and with the stage's own experts — no threads,
and nothing of the stage's asyncio ring has to become re-entrant.

Run as `python -m cellswarm.swarm.ring.parts CONFIG_JSON`; prints `READY <port>` when listening.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from cellswarm import kernels
from cellswarm.engine.memory import peak_rss_bytes, weights_by_kind
from cellswarm.engine.model import Model
from cellswarm.errors import CellswarmError, ProtocolError, RequestError
from cellswarm.io.weights import Selection, non_finite
from cellswarm.models.ops import head_matrix
from cellswarm.swarm.auth import COORDINATOR, RESERVED_IDS, load_token, open_key
from cellswarm.swarm.protocol.dataplane import (
    ExpertsAsk,
    LogitsAsk,
    PartAddress,
    PartReset,
    PartStats,
    ResetDone,
    RowsAsk,
    Stats,
    read,
)
from cellswarm.swarm.protocol.messages import PartHolding
from cellswarm.swarm.ring.frames import (
    Frame,
    accept,
    connect_sync,
    listen_tls,
    no_delay,
    read_frame,
    read_frame_sync,
    write_frame,
    write_frame_sync,
)

if TYPE_CHECKING:
    from cellswarm.models.deepseek2 import Routing

log = logging.getLogger("cellswarm.parts")

MAX_EXACT_ID = 1 << 24  # float32 holds every integer below this exactly
MAX_EXPERTS = 1 << 12  # routed experts per layer a placement may name (Kimi K2: 384)


@dataclass(frozen=True)
class PartSpec:
    """Where a part server listens and what it holds: the placement's view of it.

    experts: layer -> routed expert ids held for that layer.
    vocab_rows: half-open row range of the output head and the embedding, or None.
    """

    node_id: str
    port: int
    host: str = "127.0.0.1"
    experts: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    vocab_rows: tuple[int, int] | None = None
    # the key a stage proves to this part server (a swarm's wiring deals one per stage and
    # part; None: the cluster token, as a local pipeline's links prove); never written out
    key: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        bad = [e for ids in self.experts.values() for e in ids if not 0 <= e < MAX_EXPERTS]
        if bad:
            raise RequestError(f"part {self.node_id}: expert ids {bad[:3]} outside 0..4095")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("key")
        d["experts"] = {str(k): list(v) for k, v in self.experts.items()}  # JSON keys: str
        return d

    def holding(self) -> PartHolding:
        """What it holds, without where it listens: a layout's part shard (Shard.spec)."""
        return PartHolding(experts={str(k): list(v) for k, v in self.experts.items()},
                           vocab_rows=self.vocab_rows)  # fmt: skip

    def to_wire(self) -> PartAddress:
        return self.holding().at(self.node_id, self.host, self.port)

    @classmethod
    def from_wire(cls, p: PartAddress, key: bytes | None = None) -> PartSpec:
        return cls(node_id=p.node_id, port=p.port, host=p.host,
                   experts={int(k): tuple(v) for k, v in p.experts.items()},
                   vocab_rows=p.vocab_rows, key=key)  # fmt: skip

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> PartSpec:
        """From its JSON (to_dict's, or a placement's spec with an address); RequestError
        naming the field that does not read as a PartAddress."""
        try:
            return cls.from_wire(msgspec.convert(raw, PartAddress))
        except msgspec.ValidationError as exc:
            raise RequestError(f"a part's address: {exc}") from None

    def selection(self) -> Selection:
        """Only what this part serves: expert stacks, or the vocabulary rows (embedding and
        output head), never attention, norms or routers."""
        if self.vocab_rows is not None:
            return Selection(layers=(0, 0), vocab_rows=self.vocab_rows, embed=True, head=True,
                             kinds=frozenset({"embedding", "output"}))  # fmt: skip
        lo, hi = (min(self.experts), max(self.experts) + 1) if self.experts else (0, 0)
        experts = {i: tuple(self.experts.get(i, ())) for i in range(lo, hi)}  # gaps: none
        return Selection(layers=(lo, hi), experts=experts, embed=False, head=False,
                         kinds=frozenset({"experts"}))  # fmt: skip


@dataclass(frozen=True)
class PartConfig:
    model: str
    spec: PartSpec
    threads: int | None = None
    token_file: str | None = None  # cluster token: every connection must prove it (auth.py)
    peers: tuple[str, ...] = ()  # who may connect: the stages using it, and the client
    tls_dir: str | None = None  # mutual TLS on its listener (swarm/tls.py)

    def to_json(self) -> str:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> PartConfig:
        raw = json.loads(text)
        raw["spec"] = PartSpec.from_dict(raw["spec"])
        raw["peers"] = tuple(raw.get("peers", ()))
        return cls(**raw)


# -- the wire format of an `experts` request ----------------------------------------------


def pack_routes(h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Rows h (n, d), their expert ids (n, k) and weights (n, k) as one float32 array
    (n, d + 2k) — one frame, one buffer, no pickle. Ids travel as float32, exact below
    2^24 (the largest model routes over 384 experts)."""
    if ids.size and int(ids.max()) >= MAX_EXACT_ID:
        raise ProtocolError(f"expert id {int(ids.max())} cannot travel as float32")
    return np.concatenate(
        [h.astype(np.float32), weights.astype(np.float32), ids.astype(np.float32)], axis=1
    )


def unpack_routes(packed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of pack_routes: h (n, d), ids (n, k) int64, weights (n, k)."""
    d = packed.shape[1] - 2 * k
    if packed.ndim != 2 or d < 1 or k < 1:
        raise ProtocolError(f"experts payload of shape {packed.shape} does not hold k={k}")
    h = np.ascontiguousarray(packed[:, :d])
    weights = np.ascontiguousarray(packed[:, d : d + k])
    return h, packed[:, d + k :].astype(np.int64), weights


# -- the server ----------------------------------------------------------------------------


class PartServer:
    def __init__(self, config: PartConfig, model: Model) -> None:
        self.config, self.model = config, model
        self.token = load_token(config.token_file) if config.token_file else None
        # who may call it and the key each proves (frames.accept): a local pipeline's callers
        # the cluster token; a swarm's the coordinator this node's own key (trust) and each
        # stage of its ring the key the last wiring dealt that link (a PartReset)
        self.keys: dict[str, bytes] = {p: self.token for p in config.peers} if self.token else {}
        self.node_key: bytes | None = None
        self.requests = 0
        self.on_step: Callable[[], None] | None = None  # a request arrived (node/awake.py)
        w = model.weights
        self._head = "output.weight" if "output.weight" in w else "token_embd.weight"
        self._row0 = (config.spec.vocab_rows or (0, 0))[0]

    def trust(self, node_key: bytes) -> None:
        """The key this node shares with the coordinator (swarm/auth.py node_key), set at
        each join: the coordinator proves it, and seals this node's link keys with it."""
        self.node_key = node_key
        self.keys = {**self.keys, COORDINATOR: node_key}

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        no_delay(writer)
        peer: str | None = None
        if self.token is not None or self.node_key is not None:  # a swarm's: always keyed
            peer = await accept(reader, writer, self.keys)
            if peer is None:
                writer.close()
                return
        try:
            while (frame := await read_frame(reader)) is not None:
                await write_frame(writer, self.answer(frame, peer))
        except Exception:  # a bad peer or a bug: log it, drop this connection, keep serving
            log.exception("part %s: connection dropped", self.config.spec.node_id)
        finally:
            writer.close()

    def answer(self, frame: Frame, peer: str | None = None) -> Frame:
        """One request, one answer; the computation blocks the loop, as a stage's does.
        `peer`: who proved a key (None: no token, nobody is asked); only a coordinator (or
        a local pipeline's client) resets, only a stage asks for rows."""
        f, a = frame.fields, frame.array
        if frame.type == Stats.kind:
            return Frame(Stats.kind, dict(msgspec.to_builtins(self.stats())))
        controls = peer is None or peer in (COORDINATOR, "client")
        if frame.type == PartReset.kind:  # nothing per sequence to forget; maybe new callers
            if not controls:
                raise ProtocolError(f"a 'reset' from {peer}, which is not the coordinator")
            self.reset(read(PartReset, f, frame.type), peer)
            return Frame.of(ResetDone())
        if peer == COORDINATOR:
            raise ProtocolError(f"a {frame.type!r} request from the coordinator, which asks none")
        if a is None:
            raise ProtocolError(f"a {frame.type!r} request carries no array")
        self.requests += 1
        if self.on_step is not None:
            self.on_step()
        if frame.type == ExpertsAsk.kind:
            ask = read(ExpertsAsk, f, frame.type)
            return Frame("expert_rows", {}, self.expert_rows(ask.layer, a, ask.k))
        if frame.type == LogitsAsk.kind:  # unrefined: the caller refines the merged top rows
            # computed in the whole head's row blocks, so a logit has the same bits on any
            # split of the rows (PackedMatrix.matmul's rows_of)
            rows = read(LogitsAsk, f, frame.type).rows
            total = int(self.model.config.vocab_size) if rows is None else rows
            head = head_matrix(self.model.weights, self._head)
            logits = head.matmul(a, rows_of=(self._row0, total))
            if not np.isfinite(logits).all():  # one pass, as the stage's own head does
                raise non_finite(f"vocab rows {self.config.spec.vocab_rows}",
                                 self.model.weights, [self._head])  # fmt: skip
            return Frame("logits_out", {}, logits)
        if frame.type == RowsAsk.kind:  # dequantized rows by global id: embedding, or head rows
            tensor = read(RowsAsk, f, frame.type).tensor
            name = "token_embd.weight" if tensor == "embed" else self._head
            local = a.astype(np.int64) - self._row0
            return Frame("rows_out", {}, head_matrix(self.model.weights, name).take_rows(local))
        raise ProtocolError(f"a part server does not answer {frame.type!r} frames")

    def reset(self, reset: PartReset, peer: str | None) -> None:
        """New callers: a coordinator's sealed keys (each stage of the ring and its own), or
        a local pipeline's names, which prove the cluster token."""
        if reset.keys is not None:
            if peer != COORDINATOR or self.node_key is None:
                raise ProtocolError("a 'reset' with link keys from a caller that is not the "
                                    "coordinator")  # fmt: skip
            nk, ep = self.node_key, reset.epoch
            try:
                opened = {name: open_key(nk, f"{ep}|{name}", sealed)
                          for name, sealed in reset.keys.items() if name not in RESERVED_IDS}
            except RequestError as exc:
                raise ProtocolError(str(exc)) from None
            self.keys = {**opened, COORDINATOR: nk}
        elif reset.peers is not None and self.token is not None:
            self.keys = {name: self.token for name in reset.peers}
        if reset.peers is not None:
            self.config = replace(self.config, peers=tuple(reset.peers))

    def expert_rows(self, layer: int, packed: np.ndarray, k: int) -> np.ndarray:
        """The weighted output of each expert asked for, on the tokens routed to it, stacked
        in ascending expert order (tokens in order within each): (pairs, d). The caller knows
        the routes, so it knows where each row goes (`ExpertParts`)."""
        from cellswarm.models.deepseek2 import Routing, held_expert_outputs

        h, ids, weights = unpack_routes(packed, k)
        asked = set(np.unique(ids[ids >= 0]).tolist())
        held = set(self.model.weights.experts(f"blk.{layer}.ffn_up_exps.weight").held)
        if asked - held:
            raise ProtocolError(
                f"asked for experts {sorted(asked - held)[:8]} of layer {layer}, which part "
                f"{self.config.spec.node_id} does not hold"
            )
        outputs = held_expert_outputs(self.model.weights, layer, h, Routing(ids, weights))
        if not outputs:
            return np.zeros((0, h.shape[1]), np.float32)
        rows = np.concatenate([outputs[e] for e in sorted(outputs)])
        if not np.isfinite(rows).all():  # one pass per answer: caught on the node that made it
            names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
            raise non_finite(f"layer {layer}'s routed experts", self.model.weights, names)
        return rows

    def stats(self) -> PartStats:
        return PartStats(
            node=self.config.spec.node_id, requests=self.requests,
            weights_by_kind=weights_by_kind(self.model.weights),
            weight_bytes=self.model.weights.nbytes(), peak_rss_bytes=peak_rss_bytes(),
        )  # fmt: skip


def load_part_model(config: PartConfig) -> Model:
    from cellswarm.loader import load

    kernels.set_threads(config.threads)
    return load(config.model, selection=config.spec.selection(), tokenizer=False)


async def main(config: PartConfig) -> None:
    from cellswarm.swarm.tls import lean_tls_buffers

    lean_tls_buffers()  # a stranger's TLS connection costs 16 KiB until it proves a key
    try:
        model = load_part_model(config)
    except CellswarmError as exc:
        print(f"REFUSED {exc}", flush=True)
        return
    server = PartServer(config, model)
    from cellswarm.swarm.tls import server_context

    tls = server_context(config.tls_dir) if config.tls_dir else None
    listener = await asyncio.start_server(server.serve, "127.0.0.1", config.spec.port,
                                          **listen_tls(tls))  # fmt: skip
    print(f"READY {listener.sockets[0].getsockname()[1]}", flush=True)
    async with listener:
        await listener.serve_forever()


# -- the clients a stage uses --------------------------------------------------------------


class PartLost(ConnectionError):
    """A part server stopped answering (or answered garbage): its fault, not the caller's."""

    def __init__(self, node_id: str, why: str) -> None:
        super().__init__(f"part {node_id}: {why}")
        self.node_id = node_id


class PartClient:
    """One blocking connection to a part server, opened on first use and dropped on any
    error, so the next use reconnects (to a replacement, after a failure)."""

    def __init__(
        self, spec: PartSpec, token: bytes | None, peer: str, tls: ssl.SSLContext | None = None
    ) -> None:
        self.spec, self.peer, self.tls = spec, peer, tls
        self.key = spec.key if spec.key is not None else token  # (a swarm's: its link's own)
        self._sock: socket.socket | None = None

    def send(self, frame: Frame) -> None:
        try:
            if self._sock is None:
                self._sock = connect_sync(self.spec.host, self.spec.port, self.key, self.peer,
                                          tls=self.tls)  # fmt: skip
            write_frame_sync(self._sock, frame)
        except (OSError, ProtocolError) as exc:
            self.close()
            raise PartLost(self.spec.node_id, f"{type(exc).__name__}: {exc}") from exc

    def receive(self, expected: str) -> np.ndarray:
        if self._sock is None:
            raise PartLost(self.spec.node_id, "receive without a request")
        try:
            frame = read_frame_sync(self._sock)
        except (OSError, ProtocolError) as exc:
            self.close()
            raise PartLost(self.spec.node_id, f"{type(exc).__name__}: {exc}") from exc
        if frame.type != expected or frame.array is None:
            self.close()
            raise PartLost(self.spec.node_id, f"answered {frame.type!r}, not {expected}")
        return frame.array

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None


class ExpertParts:
    """RemoteExperts (models/deepseek2.py) over expert part servers."""

    def __init__(
        self, specs: Sequence[PartSpec], token: bytes | None, peer: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.clients = [PartClient(s, token, peer, tls) for s in specs if s.experts]
        # layer -> (expert id -> index of the client holding it, -1: none); the first
        # holder wins if two hold one
        self.holder: dict[int, np.ndarray] = {}
        for i, c in enumerate(self.clients):
            for layer, ids in c.spec.experts.items():
                table = self.holder.setdefault(layer, np.full(MAX_EXPERTS, -1, np.int64))
                for e in ids:
                    table[e] = i if table[e] < 0 else table[e]

    def held(self, layer: int) -> set[int]:
        """Expert ids of `layer` held by some part server."""
        table = self.holder.get(layer)
        return set() if table is None else set(np.nonzero(table >= 0)[0].tolist())

    def scatter(
        self, layer: int, h: np.ndarray, routing: Routing
    ) -> Callable[[], dict[int, np.ndarray]]:
        ids, k = routing.expert_ids, routing.expert_ids.shape[1]  # (T, k)
        table = self.holder.get(layer)
        by_slot = table[ids] if table is not None else np.full_like(ids, -1)  # (T, k): client
        sent: list[tuple[int, list[int], np.ndarray]] = []  # client, experts asked, counts
        for i in sorted(set(by_slot.ravel().tolist()) - {-1}):
            rows = np.nonzero((by_slot == i).any(axis=1))[0]  # tokens routed to client i
            mine = np.where(by_slot[rows] == i, ids[rows], -1)  # other holders' slots: -1
            packed = pack_routes(h[rows], mine, routing.weights[rows])
            self.clients[i].send(Frame.of(ExpertsAsk(layer=layer, k=k), packed))
            experts, counts = np.unique(mine[mine >= 0], return_counts=True)
            sent.append((i, experts.tolist(), counts))

        def gather() -> dict[int, np.ndarray]:
            """Each remote expert's weighted output (n_e, d); the model adds them."""
            outputs: dict[int, np.ndarray] = {}
            for i, experts, counts in sent:
                rows = self.clients[i].receive("expert_rows")
                if rows.shape != (int(counts.sum()), h.shape[1]):
                    self.clients[i].close()
                    raise PartLost(self.clients[i].spec.node_id,
                                   f"answered {rows.shape} expert rows for {int(counts.sum())} "
                                   f"routed tokens of width {h.shape[1]}")  # fmt: skip
                pieces = np.split(rows, np.cumsum(counts)[:-1])
                outputs.update(zip(experts, pieces, strict=True))
            return outputs

        return gather

    def close(self) -> None:
        for c in self.clients:
            c.close()


class VocabParts:
    """The embedding and output head over vocab part servers holding contiguous row ranges;
    `matmul` and `take_rows` answer as the whole PackedMatrix would (ops.Rows)."""

    def __init__(
        self, specs: Sequence[PartSpec], token: bytes | None, peer: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        held = sorted(((s.vocab_rows, s) for s in specs if s.vocab_rows is not None),
                      key=lambda rs: rs[0])  # fmt: skip
        ranges = [r for r, _ in held]
        if not ranges or ranges[0][0] or any(a[1] != b[0] for a, b in itertools.pairwise(ranges)):
            raise ProtocolError(f"vocab parts' rows {ranges} do not tile [0, vocab)")
        self.clients = [PartClient(s, token, peer, tls) for _, s in held]
        self.bounds: np.ndarray = np.asarray([a for a, _ in ranges] + [ranges[-1][1]])

    def matmul(self, x: npt.ArrayLike) -> np.ndarray:
        """(T, d) normed hidden -> (T, vocab) logits, each part's rows, concatenated.
        Each part computes its rows in the whole head's fixed row blocks, each block by one
        BLAS call of the same shape on one thread (or row by row in the fused kernels), so
        the concatenation is bit-identical to one node's head, wherever the rows split."""
        h = np.ascontiguousarray(x, dtype=np.float32)
        for c in self.clients:
            c.send(Frame.of(LogitsAsk(rows=int(self.bounds[-1])), h))
        return np.concatenate([c.receive("logits_out") for c in self.clients], axis=1)

    def take_rows(self, ids: npt.ArrayLike, tensor: str = "head") -> np.ndarray:
        """Rows `ids` (1-D, global ids) dequantized, in the order asked: (n, d)."""
        index = np.asarray(ids, dtype=np.int64).ravel()
        part = np.searchsorted(self.bounds, index, side="right") - 1  # (n,)
        if index.size and (index.min() < 0 or index.max() >= self.bounds[-1]):
            raise ProtocolError(f"token id outside the vocabulary 0..{self.bounds[-1] - 1}")
        asked = [i for i in range(len(self.clients)) if (part == i).any()]
        for i in asked:
            self.clients[i].send(Frame.of(RowsAsk(tensor=tensor), index[part == i]))
        out: np.ndarray | None = None
        for i in asked:
            rows = self.clients[i].receive("rows_out")
            if out is None:
                out = np.empty((len(index), rows.shape[1]), np.float32)
            out[part == i] = rows
        assert out is not None or not index.size
        return out if out is not None else np.zeros((0, 0), np.float32)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.take_rows(token_ids, "embed")  # (T, d)

    def close(self) -> None:
        for c in self.clients:
            c.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    asyncio.run(main(PartConfig.from_json(sys.argv[1])))
