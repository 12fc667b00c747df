"""The VM subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError, ErrorKind


class VmError(AuraeError):
    """A VM request that cannot be carried out; ``kind`` says why."""

    @classmethod
    def exhausted(cls, message: str) -> VmError:
        return cls(ErrorKind.RESOURCE_EXHAUSTED, message)

    @classmethod
    def deadline(cls, message: str) -> VmError:
        return cls(ErrorKind.DEADLINE_EXCEEDED, message)

    @classmethod
    def internal(cls, message: str) -> VmError:
        return cls(ErrorKind.INTERNAL, message)
