"""The `Database` seam on PostgreSQL (psycopg 3), so several coordinators can share state.

Same portable SQL as SQLite: `?` placeholders become `%s` (a literal `%` is escaped, and a
`?` inside a quoted string is left alone), rows come back as dicts, statements autocommit
unless inside `transaction()` (nested blocks are part of the outer one). Lease pickers append
`skip_locked` (`FOR UPDATE SKIP LOCKED`): two coordinators leasing at once lock disjoint
rows, and a row one of them is changing is skipped, not waited for. One connection behind a
lock, as for SQLite: the coordinator's loop and its threads share it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from cellswarm.errors import RequestError, StorageFullError
from cellswarm.swarm.control.db import NestedTransactions, Params, Row

if TYPE_CHECKING:
    from psycopg import Connection, Cursor
    from psycopg.rows import DictRow


def translate(sql: str) -> str:
    """`?` placeholders to psycopg's `%s`; `%` escaped; quoted text and comments untouched
    (except `%`, which psycopg reads everywhere)."""
    out: list[str] = []
    quote = ""
    i = 0
    while i < len(sql):
        ch = sql[i]
        if ch == "%":
            out.append("%%")
        elif quote:
            out.append(ch)
            if ch == quote:
                quote = ""
        elif ch in ("'", '"'):
            quote = ch
            out.append(ch)
        elif ch == "-" and sql.startswith("--", i):  # a comment: to the end of its line
            end = sql.find("\n", i)
            end = len(sql) if end < 0 else end
            out.append(sql[i:end].replace("%", "%%"))
            i = end
            continue
        elif ch == "?":
            out.append("%s")
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def split_script(sql: str) -> list[str]:
    """A schema's statements: split on `;` outside quotes, `--` comments dropped."""
    statements: list[str] = []
    current: list[str] = []
    quote = ""
    i = 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in ("'", '"'):
            quote = ch
        elif ch == "-" and sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end
            continue
        elif ch == ";":
            statements.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(ch)
        i += 1
    statements.append("".join(current).strip())
    return [s for s in statements if s]


class PostgresDatabase(NestedTransactions):
    """`postgresql://user@host:port/dbname`: every acknowledged write is committed (PostgreSQL's
    own durability: WAL, fsync on commit)."""

    dialect = "postgres"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    for_update = " FOR UPDATE"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError as exc:
            raise RequestError(
                f"{url.split('@')[-1]}: PostgreSQL needs psycopg 3 "
                "(pip install 'psycopg[binary]')"
            ) from exc
        self.url = url
        self._psycopg = psycopg
        self._row_factory = dict_row
        self._lock = threading.RLock()
        self._depth = 0
        self.conn = self._connect()

    def _connect(self) -> Connection[DictRow]:
        try:
            return self._psycopg.connect(self.url, autocommit=True, row_factory=self._row_factory)
        except self._psycopg.OperationalError as exc:
            where = self.url.split("@")[-1]
            raise RequestError(f"cannot reach PostgreSQL at {where}: {exc}") from exc

    def _cursor(self, sql: str, params: Params) -> Cursor[DictRow]:
        """Run one statement. A connection that broke (the server restarted, the backend was
        ended) fails the statement it broke under, and is opened again for the next one."""
        if self.conn.broken and not self._depth:
            self.conn = self._connect()
        try:
            return self.conn.execute(translate(sql), tuple(params))
        except self._psycopg.errors.DiskFull as exc:
            raise StorageFullError(
                f"PostgreSQL at {self.url.split('@')[-1]} cannot write: its disk is full "
                f"({str(exc).strip()}); free space there (nothing acknowledged is lost)"
            ) from exc

    def execute(self, sql: str, params: Params = ()) -> list[Row]:
        with self._lock:
            cur = self._cursor(sql, params)
            return [dict(r) for r in cur.fetchall()] if cur.description else []

    def execute_count(self, sql: str, params: Params = ()) -> int:
        with self._lock:
            return int(self._cursor(sql, params).rowcount)

    @contextlib.contextmanager
    def _outermost(self) -> Iterator[None]:
        if self.conn.broken:
            self.conn = self._connect()
        with self.conn.transaction():
            yield

    def script(self, sql: str) -> None:
        """A schema: its statements in one transaction. Concurrent `CREATE ... IF NOT EXISTS`
        of the same table can still collide in the catalog: retried once."""
        for attempt in range(3):
            try:
                with self.transaction():
                    for statement in split_script(sql):
                        self.execute(statement)
                return
            except self._psycopg.errors.UniqueViolation:
                if attempt == 2:
                    raise

    def close(self) -> None:
        with self._lock:
            self.conn.close()
