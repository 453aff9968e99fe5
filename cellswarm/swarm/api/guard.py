"""The coordinator's listener against strangers who connect and then say nothing.

uvicorn keeps a connection that never completes a request head for as long as the peer
likes (its keep-alive timer starts only after a response, and the first byte of a new
request cancels it), and asyncio gives a TLS handshake 60 s. A stranger's idle or
half-sent-header connections then hold file descriptors and memory until the coordinator
can accept no worker's beat. Here every connection must complete a request head within
HEAD_TIMEOUT_S of connecting or of its last response; at most MAX_PER_ADDRESS are open from
one address and MAX_WAITING wait for a head at once (the oldest waiting is closed for a
newcomer: a member sends its head at once, so it is never the oldest for long); a TLS
handshake has HANDSHAKE_TIMEOUT_S. A head is at most h11's 16 kB.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

log = logging.getLogger("cellswarm.guard")

HEAD_TIMEOUT_S = 10.0  # from connecting (or the last response) to a complete request head
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake (asyncio's default: 60 s)
MAX_PER_ADDRESS = 1024  # connections open from one address (a relay's pool is 64)
MAX_WAITING = 512  # connections waiting for their first head, from everyone


class Guarded(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and caps (the module's docstring)."""

    # one listener per coordinator process: the caps are the process's
    waiting: ClassVar[OrderedDict[Guarded, None]] = OrderedDict()  # no head yet, oldest first
    per_address: ClassVar[dict[str, int]] = {}

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:  # fmt: skip
        super().__init__(config, server_state, app_state, _loop)
        self._head_timer: asyncio.TimerHandle | None = None
        self._address = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        count = self.per_address.get(self._address, 0) + 1
        self.per_address[self._address] = count
        if count > MAX_PER_ADDRESS:
            transport.abort()
            return
        self.waiting[self] = None
        while len(self.waiting) > MAX_WAITING:
            oldest, _ = self.waiting.popitem(last=False)
            oldest.transport.abort()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
        left = self.per_address.get(self._address, 1) - 1
        if left > 0:
            self.per_address[self._address] = left
        else:
            self.per_address.pop(self._address, None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a head arrived: it is a speaking peer now
            self.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next head is due within HEAD_TIMEOUT_S too

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._no_head, self.cycle)

    def _no_head(self, since: RequestResponseCycle | None) -> None:
        """No new request head since the timer was armed, and none in progress: close."""
        idle = since is None or since.response_complete
        if self.cycle is since and idle and not self.transport.is_closing():
            self.transport.abort()  # at once: a TLS close would wait 30 s for its notify


def bound_handshakes(loop: asyncio.AbstractEventLoop) -> None:
    """Give every TLS listener this loop creates HANDSHAKE_TIMEOUT_S (uvicorn passes none)."""
    create = loop.create_server

    async def create_server(*args: Any, **kwargs: Any) -> asyncio.Server:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", HANDSHAKE_TIMEOUT_S)
        return await create(*args, **kwargs)

    loop.create_server = create_server  # type: ignore[method-assign]
