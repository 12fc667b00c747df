"""Reading CRI-format log files (written by monitors) as whole lines, with tail and follow."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path

from asyncinotify import Inotify, Mask, Watch

from auraed.system.monitor import parse_cri_log_line

log = logging.getLogger(__name__)

# Seconds between looks at a followed file with no new data: short right after data arrived,
# backing off to the longest while the file stays quiet. With inotify (LogWatch) a change wakes
# the follower at once and the looks only back it up, so they may be rarer.
POLL_SHORTEST, POLL_LONGEST, POLL_LONGEST_WATCHED = 0.01, 0.1, 1.0
CHANGES = Mask.MODIFY | Mask.CREATE | Mask.MOVED_TO | Mask.CLOSE_WRITE | Mask.ONLYDIR


class LogWatch:
    """Wakes log followers when something in their log's directory changes: one inotify instance
    for the whole daemon (the per-user limit on instances is 128), a watch per followed directory,
    shared by its followers. Where a watch cannot be had, followers poll as before."""

    def __init__(self) -> None:
        self._inotify: Inotify | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watches: dict[Path, Watch] = {}
        self._followers: dict[Path, set[asyncio.Event]] = {}
        self._failed = False

    @contextlib.contextmanager
    def watching(self, directory: Path) -> Iterator[asyncio.Event | None]:
        """An event set at every change in ``directory`` while the block runs; None: poll."""
        changed = asyncio.Event()
        if not self._watch(directory):
            yield None
            return
        followers = self._followers.setdefault(directory, set())
        followers.add(changed)
        try:
            yield changed
        finally:
            followers.discard(changed)
            if not followers:
                self._unwatch(directory)

    def watched(self) -> list[Path]:
        """The directories watched now: one per directory with followers, none without."""
        return sorted(self._watches)

    def _watch(self, directory: Path) -> bool:
        if directory in self._watches:
            return True
        if self._failed:
            return False
        try:
            if self._inotify is None:
                self._inotify = Inotify()
                self._reader = asyncio.get_running_loop().create_task(self._dispatch(self._inotify))
            self._watches[directory] = self._inotify.add_watch(directory, CHANGES)
        except OSError as exc:  # gone already, no inotify, out of watches
            log.debug("no inotify watch on %s (%s): polling", directory, exc)
            return False
        return True

    def _unwatch(self, directory: Path) -> None:
        del self._followers[directory]
        watch = self._watches.pop(directory)
        if self._inotify is not None:
            with contextlib.suppress(OSError):  # the directory may be gone, and its watch with it
                self._inotify.rm_watch(watch)

    async def _dispatch(self, inotify: Inotify) -> None:
        try:
            async for event in inotify:
                watch = event.watch
                if watch is not None:
                    for changed in self._followers.get(watch.path, ()):
                        changed.set()
        except OSError as exc:  # followers still poll (POLL_LONGEST_WATCHED at worst)
            log.warning("inotify failed, log followers poll from now on: %s", exc)
            self._failed = True

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._inotify is not None:
            self._inotify.close()
        self._inotify = self._reader = None


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
    watch: LogWatch | None = None,
) -> AsyncGenerator[LogLine, None]:
    """The last ``tail`` lines (all when None), then, with ``follow``, new lines until ``finished()``.

    ``watch`` wakes the follower when the log's directory changes (the log written, the exit
    recorded); without it, or without a watch, it polls.
    """
    lines, offset = await asyncio.to_thread(read_lines, path, streams, since)
    for line in lines if tail is None else lines[len(lines) - tail :] if tail else []:
        yield line
    if not follow:
        return
    with watch.watching(path.parent) if watch is not None else contextlib.nullcontext() as changed:
        longest = POLL_LONGEST if changed is None else POLL_LONGEST_WATCHED
        assembler = _Assembler()
        buffer = b""
        pause = POLL_SHORTEST
        while True:
            if changed is not None:
                changed.clear()  # before reading: a change from here on wakes the wait below
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
            elif await _wait(changed, pause):
                pause = POLL_SHORTEST  # something changed (exit.json, say): the end may be near
            else:
                pause = min(pause * 2, longest)


async def _wait(changed: asyncio.Event | None, timeout: float) -> bool:
    """Sleep ``timeout``, or less when ``changed`` is set; whether it was."""
    if changed is None:
        await asyncio.sleep(timeout)
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), timeout)
    return changed.is_set()


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(1 << 20)
    except FileNotFoundError:
        return b""
