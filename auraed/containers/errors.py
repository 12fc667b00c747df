"""The containers subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError


class ContainerError(AuraeError):
    """A container request that cannot be carried out; ``kind`` says why."""
