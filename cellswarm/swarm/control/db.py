"""One small seam over the coordinator's database: SQLite by default, PostgreSQL to share.

The store and the job queue write portable SQL (`?` placeholders, `ON CONFLICT`, `RETURNING`)
and run it through a `Database`: `execute` returns rows as dicts, `transaction()` makes a
block atomic (SQLite: `BEGIN IMMEDIATE`, taking the write lock up front so two writers never
deadlock on an upgrade; PostgreSQL: a transaction in which `skip_locked` row locks apply).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeAlias

from cellswarm.errors import DatabaseDamagedError, StorageFullError

# What a column holds, as the drivers return it: TEXT, INTEGER/BIGINT, DOUBLE PRECISION, BLOB
# or NULL. A row is a dict of them by column name; readers narrow each column (text, integer...).
SqlValue: TypeAlias = str | int | float | bytes | None
Row: TypeAlias = dict[str, SqlValue]
Params: TypeAlias = Sequence[object]  # a statement's parameters (the drivers adapt them)


class Database(Protocol):
    dialect: str  # "sqlite" | "postgres"
    skip_locked: str  # appended to a SELECT that picks rows to lease
    for_update: str  # appended to a SELECT whose rows the transaction then changes

    def execute(self, sql: str, params: Params = ()) -> list[Row]: ...

    def execute_count(self, sql: str, params: Params = ()) -> int: ...

    def transaction(self) -> contextlib.AbstractContextManager[None]: ...

    def script(self, sql: str) -> None: ...

    def close(self) -> None: ...


class NestedTransactions:
    """One connection behind a lock; `transaction()` blocks nest (an inner one is part of
    the outer). A backend provides `_outermost()`, the real transaction."""

    _lock: threading.RLock
    _depth: int

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            if self._depth:  # nested: part of the outer transaction
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._depth = 1
            try:
                with self._outermost():
                    yield
            finally:
                self._depth = 0

    def _outermost(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError


class SQLiteDatabase(NestedTransactions):
    """WAL, synchronous=FULL: an acknowledged write survives a crash or a power cut. The file
    is its owner's only (0600: it holds job texts and node sessions); SQLite gives its -wal
    and -shm files the database file's mode."""

    dialect = "sqlite"
    skip_locked = ""  # SQLite has one writer at a time: the transaction is the lock
    for_update = ""

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:" and not path.startswith("file:"):
            _private(path)
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("PRAGMA busy_timeout=10000")
            problems = [r[0] for r in self.conn.execute("PRAGMA quick_check(3)")]
        except sqlite3.DatabaseError as exc:  # not a database at all ("file is not a ...")
            problems = [str(exc)]
        if problems != ["ok"]:  # a damaged ledger must not serve (jobs lost or run twice)
            self.conn.close()
            said = "; ".join(problems).replace("\n", "; ")[:300]
            raise DatabaseDamagedError(f"database {path} is damaged ({said}): restore it from "
                                       f"a backup, or move it aside to start with an empty "
                                       f"queue")  # fmt: skip
        self._lock = threading.RLock()  # one connection, shared by the loop and its threads
        self._depth = 0

    def execute(self, sql: str, params: Params = ()) -> list[Row]:
        with self._lock, self._full():
            return [dict(r) for r in self.conn.execute(sql, tuple(params)).fetchall()]

    def execute_count(self, sql: str, params: Params = ()) -> int:
        with self._lock, self._full():
            return int(self.conn.execute(sql, tuple(params)).rowcount)

    @contextlib.contextmanager
    def _outermost(self) -> Iterator[None]:
        with self._full():
            self.conn.execute("BEGIN IMMEDIATE")  # the write lock up front: no upgrade deadlock
        try:
            yield
            with self._full():
                self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:  # a failed COMMIT (a full disk) leaves it open
                self.conn.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _full(self) -> Iterator[None]:
        """A full disk is an operator's problem with a fix, not a traceback."""
        try:
            yield
        except sqlite3.Error as exc:
            if not disk_full(exc, self.path):
                raise
            raise StorageFullError(
                f"the database {self.path} cannot grow: its disk is full ({exc}); free space "
                "there and it carries on (nothing acknowledged is lost)"
            ) from exc

    def script(self, sql: str) -> None:
        with self._lock:
            self.conn.executescript(sql)

    def integrity_check(self) -> str:
        return str(self.execute("PRAGMA integrity_check")[0]["integrity_check"])

    def close(self) -> None:
        self.conn.close()


def disk_full(exc: sqlite3.Error, path: str) -> bool:
    """SQLITE_FULL, or an I/O error on a file system with no room left."""
    name = str(getattr(exc, "sqlite_errorname", ""))
    if name == "SQLITE_FULL" or "disk is full" in str(exc):
        return True
    if not name.startswith("SQLITE_IOERR") or path == ":memory:":
        return False
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


def _private(path: str) -> None:
    """Create the database file 0600 before SQLite opens it (O_CREAT with the mode: never a
    moment with more); one made by an older version, and its -wal/-shm, become 0600 too."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for p in (path, f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(OSError):  # absent, or not ours to change
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)


def ensure_column(db: Database, table: str, column: str, decl: str) -> None:
    """A schema migration: add a column a database made by an older version lacks (a no-op
    when it is there). PostgreSQL is asked first (an ALTER locks the table even when it has
    nothing to do: not on every coordinator's start), then ALTERs with IF NOT EXISTS (another
    coordinator may be adding it too); SQLite is asked under its write lock."""
    if db.dialect == "postgres":
        present = db.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = ? AND column_name = ?", (table, column),
        )  # fmt: skip
        if not present:
            db.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {decl}")
        return
    with db.transaction():
        if column not in {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def integer(value: SqlValue) -> int:
    """A number column (a COUNT, a SUM) as an int; NULL is a TypeError, as int(None) is."""
    if value is None:
        raise TypeError("a NULL where a number was due")
    return int(value)


def text(row: Row, key: str) -> str:
    """A TEXT NOT NULL column."""
    value = row[key]
    if not isinstance(value, str):
        raise TypeError(f"column {key} is {type(value).__name__}, not text")
    return value


def maybe_text(row: Row, key: str) -> str | None:
    """A TEXT column that may be NULL (a column a row lacks reads as NULL)."""
    return None if row.get(key) is None else text(row, key)


def whole(row: Row, key: str) -> int:
    """An INTEGER NOT NULL column."""
    value = row[key]
    if not isinstance(value, int):
        raise TypeError(f"column {key} is {type(value).__name__}, not an integer")
    return value


def maybe_whole(row: Row, key: str) -> int | None:
    """An INTEGER column that may be NULL."""
    return None if row[key] is None else whole(row, key)


def real(row: Row, key: str) -> float:
    """A DOUBLE PRECISION NOT NULL column (an int that SQLite kept as one is a number too)."""
    value = row[key]
    if not isinstance(value, int | float):
        raise TypeError(f"column {key} is {type(value).__name__}, not a number")
    return value


def maybe_real(row: Row, key: str) -> float | None:
    """A DOUBLE PRECISION column that may be NULL."""
    return None if row[key] is None else real(row, key)


def open_database(url: str) -> Database:
    """`sqlite:///PATH`, a bare path, `:memory:`, or `postgresql://...`."""
    if url.startswith(("postgresql://", "postgres://")):
        from cellswarm.swarm.control.db_postgres import PostgresDatabase

        return PostgresDatabase(url)
    return SQLiteDatabase(url.removeprefix("sqlite:///"))
