"""Reading CRI-format log files (written by monitors) as whole lines, with tail and follow."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

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
        self.pending: dict[str, list[str]] = collections.defaultdict(list)  # stream -> parts so far

    def feed(self, raw: str) -> LogLine | None:
        try:
            timestamp, stream, partial, content = parse_cri_log_line(raw)
        except ValueError:
            return None
        if partial:
            self.pending[stream].append(content)
            return None
        parts = self.pending.pop(stream, [])
        return LogLine(timestamp, stream, "".join([*parts, content]))


TAIL_BLOCK = 64 << 10
"""Bytes read at a time from a log's end, going back, to find its last lines."""
READ_CHUNK = 1 << 20
"""Bytes read at a time going forward; a shorter read reached the end of the file."""
FRESH_CHUNK = 64 << 10
"""Bytes read at a time, on the event loop, by a follower that has reached the end: what it
reads next was just written, so it is in the page cache and takes microseconds to read, against
~0.2 ms for a worker thread's round trip. A full chunk means it has fallen behind: back to the
thread."""


def _blocks_backwards(file: BinaryIO, end: int) -> Iterator[tuple[int, bytes]]:
    """The file before ``end`` in TAIL_BLOCK pieces, last first, each with its offset."""
    position = end
    while position > 0:
        step = min(TAIL_BLOCK, position)
        position -= step
        file.seek(position)
        yield position, file.read(step)


def _records_backwards(file: BinaryIO, end: int) -> Iterator[bytes]:
    """The records (lines without their newline) that end before ``end``, last first; ``end``
    follows a newline, or is 0."""
    carry = None
    for _, data in _blocks_backwards(file, end):
        # carry: the start of the later block up to its first newline, the end of a record
        # that began in this block (None before the first block: it ends with a newline).
        parts = (data[:-1] if carry is None else data + carry).split(b"\n")
        carry = parts[0]
        yield from reversed(parts[1:])
    if carry is not None:
        yield carry  # the file's first record


def _complete_end(file: BinaryIO) -> int:
    """The offset after the file's last newline: what follows is a record still being written."""
    for position, data in _blocks_backwards(file, file.seek(0, io.SEEK_END)):
        newline = data.rfind(b"\n")
        if newline >= 0:
            return position + newline + 1
    return 0


def read_tail(
    path: Path, streams: frozenset[str], tail: int, since: float | None = None
) -> tuple[list[LogLine], int, _Assembler]:
    """The last ``tail`` complete lines of ``streams`` (logged at or after ``since``), read from
    the file's end back only as far as they need: a long log costs no more than its tail. Also
    the offset after the last complete record, and an assembler holding the parts of lines not
    finished yet, for following on from there.

    Going back, a stream's line is complete once the record that ended its previous line (F) is
    reached, or the file's start: a line made of partial records (P) may have begun earlier.
    """
    assembler = _Assembler()
    try:
        file = path.open("rb")
    except FileNotFoundError:
        return [], 0, assembler
    with file:
        end = _complete_end(file)
        complete: list[tuple[int, LogLine]] = []  # (how far back its F was, the line)
        # stream -> (how far back its F was, the F's time, the parts, last first)
        open_lines: dict[str, tuple[int, float, list[str]]] = {}
        unfinished: dict[str, list[str]] = collections.defaultdict(list)  # P after a stream's last F
        older_than_since: set[str] = set()
        back = 0
        for raw in _records_backwards(file, end):
            back += 1
            try:
                timestamp, stream, partial, content = parse_cri_log_line(raw.decode(errors="replace"))
            except ValueError:
                continue
            if stream not in streams or stream in older_than_since:
                continue
            if partial:
                if stream in open_lines:
                    open_lines[stream][2].append(content)
                else:
                    unfinished[stream].append(content)
                continue
            if stream in open_lines:
                complete.append(_joined(stream, *open_lines.pop(stream)))
            if since is not None and timestamp < since:
                older_than_since.add(stream)  # this line and all before it are too old
            else:
                open_lines[stream] = (back, timestamp, [content])
            if _enough(complete, open_lines, tail) or older_than_since >= streams:
                break
        else:  # the file's start: what is open is whole
            complete += [_joined(stream, *line) for stream, line in open_lines.items()]
    for stream, parts in unfinished.items():
        assembler.pending[stream] = parts[::-1]
    newest = sorted(complete, key=lambda item: item[0])[:tail]
    return [line for _, line in reversed(newest)], end, assembler


def _joined(stream: str, back: int, timestamp: float, parts: list[str]) -> tuple[int, LogLine]:
    return back, LogLine(timestamp, stream, "".join(reversed(parts)))


def _enough(
    complete: list[tuple[int, LogLine]], open_lines: dict[str, tuple[int, float, list[str]]], tail: int
) -> bool:
    """Whether the ``tail`` newest lines are known: that many complete lines are newer than every
    line still open (going back, lines only open further back, so nothing newer can come)."""
    if len(complete) < tail:
        return False
    newest_open = min((back for back, _, _ in open_lines.values()), default=None)
    return newest_open is None or sum(1 for back, _ in complete if back < newest_open) >= tail


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

    All lines are read from the start in chunks and sent as they come, so a long log never sits
    in memory whole; a tail is read from the end. ``watch`` wakes the follower when the log's
    directory changes (the log written, the exit recorded); without it, or without a watch, it
    polls.
    """
    if tail is None:
        offset, assembler = 0, _Assembler()
    else:
        lines, offset, assembler = await asyncio.to_thread(read_tail, path, streams, tail, since)
        for line in lines:
            yield line
        if not follow:
            return
    watching = watch.watching(path.parent) if watch is not None and follow else contextlib.nullcontext()
    with watching as changed:
        longest = POLL_LONGEST if changed is None else POLL_LONGEST_WATCHED
        buffer = b""
        pause = POLL_SHORTEST
        at_end = False
        while True:
            if changed is not None:
                changed.clear()  # before reading: a change from here on wakes the wait below
            # Read before the data, so nothing written before the end is missed; not following,
            # the end is the end of what is there now.
            done = not follow or finished()
            if at_end:
                size = FRESH_CHUNK
                chunk = _read_from(path, offset, size)
            else:
                size = READ_CHUNK
                chunk = await asyncio.to_thread(_read_from, path, offset, size)
            at_end = len(chunk) < size
            offset += len(chunk)
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for raw in complete:
                fed = assembler.feed(raw.decode(errors="replace"))
                if fed is not None and fed.stream in streams and (since is None or fed.timestamp >= since):
                    yield fed
            if done and at_end:
                return  # everything written before the end (or before now) is read
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


def _read_from(path: Path, offset: int, size: int = READ_CHUNK) -> bytes:
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(size)
    except FileNotFoundError:
        return b""
