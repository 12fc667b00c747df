"""The one mapping from exceptions to gRPC status codes (auraed.wire.status.status_for)."""

from __future__ import annotations

import errno
import os
import sqlite3

import grpc
import pytest

from auraed.errors import AuraeError, ErrorKind
from auraed.wire.status import status_for


def test_an_aurae_error_keeps_its_kind_and_message() -> None:
    assert status_for(AuraeError(ErrorKind.NOT_FOUND, "cell x not found")) == (
        grpc.StatusCode.NOT_FOUND,
        "cell x not found",
    )


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_the_machine_running_out_is_resource_exhausted(number: int) -> None:
    code, detail = status_for(OSError(number, os.strerror(number), "/var/lib/aurae/x"))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert detail == f"on the daemon's machine: {os.strerror(number)}: /var/lib/aurae/x"


def test_a_full_state_store_is_resource_exhausted() -> None:
    db = sqlite3.connect(":memory:")
    db.execute("PRAGMA max_page_count = 2")  # SQLite answers SQLITE_FULL past it, as on a full disk
    with pytest.raises(sqlite3.OperationalError) as full:
        db.execute("CREATE TABLE t (v BLOB)")
        db.execute("INSERT INTO t VALUES (zeroblob(100000))")
    assert status_for(full.value)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_anything_else_is_internal_and_says_where_to_look() -> None:
    assert status_for(OSError(errno.EIO, "I/O error")) == (
        grpc.StatusCode.INTERNAL,
        "internal error (OSError); see the auraed log",
    )
    assert status_for(KeyError("x"))[0] is grpc.StatusCode.INTERNAL
