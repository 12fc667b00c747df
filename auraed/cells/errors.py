"""The cells subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError


class CellError(AuraeError):
    """A cell or executable request that cannot be carried out; ``kind`` says why."""
