"""The images subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError


class ImageError(AuraeError):
    """An image request that cannot be carried out; ``kind`` says why."""
