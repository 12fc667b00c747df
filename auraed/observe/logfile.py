"""Reading CRI-format log files (written by monitors) as whole lines, with tail and follow."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from auraed.system.monitor import parse_cri_log_line

# Seconds between looks at a followed file with no new data: short right after data arrived (so a
# follower sees a line within ~10 ms), backing off to the longest while the file stays quiet.
POLL_SHORTEST, POLL_LONGEST = 0.01, 0.1


@dataclasses.dataclass(frozen=True)
class LogLine:
    timestamp: float
    stream: str  # "stdout" or "stderr"
    content: str


class _Assembler:
    """Joins partial (P) records of a stream into the full line their final (F) record ends."""

    def __init__(self) -> None:
        self._pending: dict[str, list[str]] = collections.defaultdict(list)

    def feed(self, raw: str) -> LogLine | None:
        try:
            timestamp, stream, partial, content = parse_cri_log_line(raw)
        except ValueError:
            return None
        if partial:
            self._pending[stream].append(content)
            return None
        parts = self._pending.pop(stream, [])
        return LogLine(timestamp, stream, "".join([*parts, content]))


def read_lines(path: Path, streams: frozenset[str], since: float | None = None) -> tuple[list[LogLine], int]:
    """Every complete line so far (logged at or after ``since``), and the byte offset reading stopped at."""
    lines: list[LogLine] = []
    offset = 0
    assembler = _Assembler()
    try:
        with path.open("rb") as file:
            for raw in file:
                if not raw.endswith(b"\n"):
                    break  # the writer is mid-record; the next read picks it up
                offset += len(raw)
                line = assembler.feed(raw.decode(errors="replace").rstrip("\n"))
                if line is not None and line.stream in streams and (since is None or line.timestamp >= since):
                    lines.append(line)
    except FileNotFoundError:
        pass
    return lines, offset


async def stream_lines(
    path: Path,
    streams: frozenset[str],
    tail: int | None,
    follow: bool,
    finished: Callable[[], bool],
    *,
    since: float | None = None,
) -> AsyncIterator[LogLine]:
    """The last ``tail`` lines (all when None), then, with ``follow``, new lines until ``finished()``."""
    lines, offset = await asyncio.to_thread(read_lines, path, streams, since)
    for line in lines if tail is None else lines[len(lines) - tail :] if tail else []:
        yield line
    if not follow:
        return
    assembler = _Assembler()
    buffer = b""
    pause = POLL_SHORTEST
    while True:
        done = finished()  # read before the data, so nothing written before the end is missed
        chunk = await asyncio.to_thread(_read_from, path, offset)
        offset += len(chunk)
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            fed = assembler.feed(raw.decode(errors="replace"))
            if fed is not None and fed.stream in streams:
                yield fed
        if done and not chunk:
            return
        if chunk:
            pause = POLL_SHORTEST
        else:
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_LONGEST)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(1 << 20)
    except FileNotFoundError:
        return b""
