"""The error vocabulary every subsystem speaks.

Each subsystem raises its own subclass of :class:`AuraeError` (``CellError``, ``ConfigError``, ...)
carrying an :class:`ErrorKind`; ``auraed.wire.status`` maps kinds to gRPC status codes, in that one
place. Anything else is a bug of ours and is answered with INTERNAL, except the machine running
out of something (:data:`RESOURCE_ERRNOS`, a full state store), which is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import enum
import errno
from typing import Self

RESOURCE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM})
"""OSError numbers that say the daemon's machine ran out of disk, quota, descriptors or memory."""


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    FAILED_PRECONDITION = "failed_precondition"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNIMPLEMENTED = "unimplemented"  # an optional API this runtime does not offer (CRI checkpoints)
    INTERNAL = "internal"


class AuraeError(Exception):
    """An error with a kind a client can act on and a message that names the problem."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @classmethod
    def invalid(cls, field: str, problem: str) -> Self:
        return cls(ErrorKind.INVALID_ARGUMENT, f"{field}: {problem}")

    @classmethod
    def not_found(cls, what: str) -> Self:
        return cls(ErrorKind.NOT_FOUND, f"{what} not found")

    @classmethod
    def already_exists(cls, what: str) -> Self:
        return cls(ErrorKind.ALREADY_EXISTS, f"{what} already exists")

    @classmethod
    def precondition(cls, message: str) -> Self:
        return cls(ErrorKind.FAILED_PRECONDITION, message)


class ConfigError(AuraeError):
    """The daemon's or the client's configuration is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.INVALID_ARGUMENT, message)
