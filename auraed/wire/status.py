"""What a client is told when a call fails: the one mapping from exceptions to gRPC status.

The server's call wrapper, its authorization and the guest router all answer with these codes and
details; error kinds (auraed.errors) map to status codes here and nowhere else.
"""

from __future__ import annotations

import itertools

import grpc

from auraed.errors import RESOURCE_ERRNOS, AuraeError, ErrorKind

STATUS_FOR_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


# The most of a status's details sent, in bytes on the wire. Details travel in the trailers, which
# grpc limits to 8 KiB with everything else in them (and between 8 and 16 KiB refuses at random):
# a longer message (a runtime's whole stderr, a name echoed back) would reach the client as
# RESOURCE_EXHAUSTED about metadata, its code lost.
MAX_DETAIL_BYTES = 4096
CUT_MARKER = " ... (cut)"  # ends a detail that was longer
# grpc sends the details percent-encoded: printable ASCII but "%" as itself, every other byte as
# three ("%C3").
_PLAIN_BYTES = frozenset(range(0x20, 0x7F)) - {ord("%")}
_ENCODED_BYTE_SIZE = 3


def wire_size(data: bytes) -> int:
    """Bytes ``data`` takes as a percent-encoded grpc-message."""
    return sum(1 if byte in _PLAIN_BYTES else _ENCODED_BYTE_SIZE for byte in data)


def capped(detail: str) -> str:
    """``detail`` as UTF-8 text of at most MAX_DETAIL_BYTES on the wire, cut at a character's edge."""
    data = detail.encode("utf-8", "replace")  # lone surrogates (undecodable names) become "?"
    # No byte takes less than one on the wire: what is past the limit in bytes is past it encoded.
    head = data[: MAX_DETAIL_BYTES + 1]
    if wire_size(head) <= MAX_DETAIL_BYTES:
        return data.decode()
    budget = MAX_DETAIL_BYTES - len(CUT_MARKER)
    # Running totals only grow: the bytes kept are those whose total is still within the budget.
    totals = itertools.accumulate(1 if byte in _PLAIN_BYTES else _ENCODED_BYTE_SIZE for byte in head)
    end = sum(1 for total in totals if total <= budget)
    return head[:end].decode("utf-8", "ignore") + CUT_MARKER


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from exceptions to what the client is told (details capped)."""
    code, detail = _status_for(exc)
    return code, capped(detail)


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, AuraeError):
        return STATUS_FOR_KIND[exc.kind], exc.message
    if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
        where = f": {exc.filename}" if exc.filename else ""
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"on the daemon's machine: {exc.strerror}{where}"
    if getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL":  # sqlite3.Error, not imported here
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "on the daemon's machine: the state store's disk is full"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the auraed log"
