"""A small document store on SQLite (stdlib): records are JSON documents keyed by (kind, key).

Each subsystem owns its kinds ("cell", "executable", later "container", "vm", ...). Writes are
transactional; the database uses WAL so a ``kill -9`` loses nothing that was committed. In-memory
views are rebuilt from here and from the kernel when auraed starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from auraed.errors import AuraeError, ErrorKind

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (kind, key)
)
"""


def flat_doc(record: Any) -> dict[str, Any]:
    """A dataclass's fields as a document, not copied: for records whose fields are JSON values
    already. dataclasses.asdict deep-copies (7x slower on a container record), and the store
    serializes the document at once anyway."""
    return {field.name: getattr(record, field.name) for field in dataclasses.fields(record)}


class StoreError(AuraeError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.INTERNAL, message)


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the state store {path}: {exc}") from exc
        path.chmod(0o600)
        # Calls come from the event loop and from worker threads; sqlite3 objects are not
        # safe to share without a lock.
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def put(self, kind: str, key: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO records (kind, key, doc) VALUES (?, ?, ?) "
                "ON CONFLICT (kind, key) DO UPDATE SET doc = excluded.doc",
                (kind, key, json.dumps(doc, sort_keys=True)),
            )

    def get(self, kind: str, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT doc FROM records WHERE kind = ? AND key = ?", (kind, key)
            ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM records WHERE kind = ? AND key = ?", (kind, key))

    def load(self, kind: str, parse: Callable[[dict[str, Any]], T]) -> list[T]:
        """Every record of ``kind`` through ``parse``; records it cannot read (written by another
        version, or damaged) are logged and dropped, so recovery never stops on one."""
        loaded = []
        for key, doc in self.list(kind):
            try:
                loaded.append(parse(doc))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("dropping unreadable %s record %s: %s", kind, key, exc)
                self.delete(kind, key)
        return loaded

    def list(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, doc FROM records WHERE kind = ? ORDER BY key", (kind,)
            ).fetchall()
        return [(key, dict(json.loads(doc))) for key, doc in rows]
