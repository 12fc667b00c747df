"""The CRI subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError


class CriError(AuraeError):
    """A CRI request that cannot be carried out; ``kind`` says why."""
