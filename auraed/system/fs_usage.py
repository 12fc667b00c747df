"""What a directory tree uses on its filesystem (bytes and inodes), measured by walking it, and
a cache of that measure: the CRI's image filesystem and containers' writable layers are asked
for every few seconds by a kubelet, and walking a large tree that often costs more than it tells.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FsUsage:
    timestamp_ns: int
    used_bytes: int
    inodes_used: int


def measure(root: Path) -> FsUsage:
    """Bytes and inodes under ``root`` (hard links once), without following symlinks; nothing
    for a tree that is not there."""
    seen: set[tuple[int, int]] = set()
    used = 0
    for directory, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue  # removed while we walked
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            used += st.st_blocks * 512
    return FsUsage(time.time_ns(), used, len(seen))


class FsUsageCache:
    """``root``'s usage, measured at most once every ``ttl`` seconds, in a worker thread."""

    def __init__(self, root: Path, ttl: float) -> None:
        self._root = root
        self._ttl = ttl
        self._last: tuple[float, FsUsage] | None = None
        self._lock = asyncio.Lock()

    @property
    def root(self) -> Path:
        return self._root

    async def usage(self) -> FsUsage:
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self._ttl:
                self._last = (now, await asyncio.to_thread(measure, self._root))
            return self._last[1]
