"""One-time tokens for streaming URLs, as the kubelet's request cache hands them out.

A token names one registered request; it is consumed by the first request that presents it,
valid or not, and is gone after its TTL. At most ``capacity`` tokens wait at once.
"""

from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Callable

from auraed.cri.streaming.backend import StreamingRequest
from auraed.errors import AuraeError, ErrorKind

_TOKEN_BYTES = 24
"""Random bytes per token (32 URL-safe characters): not guessable within any TTL."""


class TokenRegistry:
    def __init__(self, ttl: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._capacity = capacity
        self._clock = clock
        # Insertion order is expiry order: every token lives the same TTL.
        self._entries: collections.OrderedDict[str, tuple[float, StreamingRequest]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def insert(self, request: StreamingRequest) -> str:
        """A new token for ``request``; RESOURCE_EXHAUSTED when ``capacity`` tokens are waiting."""
        self._expire()
        if len(self._entries) >= self._capacity:
            raise AuraeError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{self._capacity} streaming requests are waiting for their client; try again later",
            )
        token = secrets.token_urlsafe(_TOKEN_BYTES)
        self._entries[token] = (self._clock() + self._ttl, request)
        return token

    def consume(self, token: str) -> StreamingRequest | None:
        """The request ``token`` was issued for, once; None if unknown, used or expired."""
        entry = self._entries.pop(token, None)
        if entry is None:
            return None
        expires, request = entry
        return request if self._clock() < expires else None

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            token, (expires, _request) = next(iter(self._entries.items()))
            if now < expires:
                return
            del self._entries[token]
