"""Reading CRI-format log files (written by monitors) as whole lines, with tail and follow; or
record by record, as the output was written (``parts``: what an attach relays)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from asyncinotify import Inotify, Mask, Watch

from auraed.system.cri_log import parse_cri_log_line
from auraed.system.request_files import open_regular

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
    partial: bool = False  # read by parts: the line goes on in the stream's next one


@dataclasses.dataclass(frozen=True)
class LogSource:
    """A log file and whether its writer has finished: following it then ends at its end."""

    path: Path
    finished: Callable[[], bool]


MAX_LINE_CHARS = 512 << 10
"""The most of one line a reader holds and sends. A process may write any length without a
newline (its monitor splits it into partial records), but a LogItem must stay under grpc's 4 MiB
message limit, or the client refuses it and the whole stream with it; a character is at most 4
bytes in UTF-8. A longer line is cut there and marked with CUT_MARK; the file keeps it whole."""
CUT_MARK = " ... (cut)"


class _LineHead(list[str]):
    """The parts of one line, in order, as far as its first MAX_LINE_CHARS need: a list, so that
    a line's parts compare as the list they are."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0  # characters in the parts kept
        self.cut = False  # whether a part, or some of one, was left out

    def append_part(self, content: str) -> None:
        """The next part: kept as far as there is room."""
        room = MAX_LINE_CHARS - self.size
        if len(content) > room:
            self.cut, content = True, content[:room]
        if content or not self.cut:  # an empty part is kept as written (monitors write none)
            self.append(content)
            self.size += len(content)

    def text(self) -> str:
        return "".join(self) + (CUT_MARK if self.cut else "")


class _Assembler:
    """Joins partial (P) records of a stream into the full line their final (F) record ends;
    records of other than ``streams`` are passed over."""

    def __init__(self, streams: frozenset[str]) -> None:
        self.streams = streams
        self.pending: dict[str, _LineHead] = {}  # stream -> the line so far

    def _record(self, raw: str) -> tuple[float, str, bool, str] | None:
        """The record's fields, None for a record that is not one or of another stream."""
        try:
            record = parse_cri_log_line(raw)
        except ValueError:
            return None
        return record if record[1] in self.streams else None

    def feed(self, raw: str) -> LogLine | None:
        record = self._record(raw)
        if record is None:
            return None
        timestamp, stream, partial, content = record
        head = (
            self.pending.setdefault(stream, _LineHead()) if partial else self.pending.pop(stream, _LineHead())
        )
        head.append_part(content)
        return None if partial else LogLine(timestamp, stream, head.text())

    def part(self, raw: str) -> LogLine | None:
        """A record as it is, a part of a line when partial (its content cut as a line's)."""
        record = self._record(raw)
        if record is None:
            return None
        timestamp, stream, partial, content = record
        head = _LineHead()
        head.append_part(content)
        return LogLine(timestamp, stream, head.text(), partial)


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


HEADER_BYTES = 64
"""Enough of a record to read its time, stream and tag (a CRI timestamp is at most 35 bytes)."""

PENDING_SCAN_BYTES = 4 * MAX_LINE_CHARS
"""How far back past a complete tail the start of another stream's unfinished line is looked for:
a line beginning further back is longer than MAX_LINE_CHARS (at 4 bytes a character at most) and
would be cut anyway."""


def _tail_start(
    file: BinaryIO, streams: frozenset[str], tail: int, since: float | None
) -> tuple[int, int, int]:
    """Where the last ``tail`` complete lines of ``streams`` (logged at or after ``since``) are,
    found from the file's end going back only as far as they need, reading only records'
    headers: a long log, or long lines, cost no more memory than a short one.

    Returns the offset of the earliest record of those lines and of lines still unfinished at
    the end (partial records a line's final one has not followed yet); the offset of the final
    record of the oldest of them (a line ending before it is older than the tail); and the
    offset after the last complete record.
    """
    end = _complete_end(file)
    first_end = end  # tail 0: every line ending before the end is older
    found = 0
    earliest: dict[str, int] = {}  # stream -> its earliest record that is needed, so far
    closed: set[str] = set()  # streams none of whose earlier records are needed
    seen: set[str] = set()  # streams whose newest record is known
    satisfied_at: int | None = None  # where the tail was complete (other streams still unseen)
    position = end
    for raw in _records_backwards(file, end):
        position -= len(raw) + 1
        if satisfied_at is not None and satisfied_at - position > PENDING_SCAN_BYTES:
            break  # an unseen stream's unfinished line, if any, began too far back to keep whole
        try:
            timestamp, stream, partial, _ = parse_cri_log_line(raw[:HEADER_BYTES].decode(errors="replace"))
        except ValueError:
            continue
        if stream not in streams or stream in closed:
            continue
        seen.add(stream)
        if partial:
            earliest[stream] = position  # part of a line of the tail, or of one unfinished
        elif found == tail or (since is not None and timestamp < since):
            closed.add(stream)  # ends a line older than the tail: its stream's needs start after
        else:
            found += 1
            earliest[stream] = position
            if found == tail:
                first_end = position
        if closed >= streams:
            break
        if found == tail and closed >= earliest.keys():
            # The tail is known, but a stream not seen yet may end in an unfinished line whose
            # start lies further back: a follower would give only its end.
            if seen >= streams:
                break
            satisfied_at = position if satisfied_at is None else satisfied_at
    if found < tail:
        first_end = 0  # fewer lines than asked: all of them
    return min(earliest.values(), default=end), first_end, end


class _LineReader:
    """Whole lines of ``streams`` from the records of a log read in order from ``offset``:
    those whose final record is at ``first_end`` or after, logged at or after ``since``. With
    ``parts``, each record alone (at ``first_end`` or after, logged at or after ``since``)."""

    def __init__(
        self,
        streams: frozenset[str],
        offset: int,
        first_end: int = 0,
        since: float | None = None,
        *,
        parts: bool = False,
    ) -> None:
        self.assembler = _Assembler(streams)
        self._record = offset  # where the first record in the buffer starts
        self._buffer = b""
        self._first_end = first_end
        self._since = since
        self._parts = parts

    def restarted(self) -> _LineReader:
        """A reader like this one of another file, from its start (a rotation's new file)."""
        return _LineReader(self.assembler.streams, 0, parts=self._parts)

    def feed(self, chunk: bytes) -> list[LogLine]:
        """The lines the records completed by ``chunk`` (the file's next bytes) end."""
        self._buffer += chunk
        *complete, self._buffer = self._buffer.split(b"\n")
        lines = []
        for raw in complete:
            at, self._record = self._record, self._record + len(raw) + 1
            text = raw.decode(errors="replace")
            line = self.assembler.part(text) if self._parts else self.assembler.feed(text)
            if (
                line is not None
                and at >= self._first_end
                and (self._since is None or line.timestamp >= self._since)
            ):
                lines.append(line)
        return lines


def _open_log(path: Path) -> BinaryIO:
    """The log at ``path`` to read: a regular file only (auraed.system.request_files), since the
    kubelet's log directory may be written by others (a log collector's hostPath): a FIFO put
    there must not block the reader."""
    return os.fdopen(open_regular(path), "rb")


def read_tail(
    path: Path, streams: frozenset[str], tail: int, since: float | None = None
) -> tuple[list[LogLine], int, _Assembler]:
    """The last ``tail`` complete lines of ``streams`` (logged at or after ``since``) as a list,
    the offset after the last complete record, and an assembler holding the parts of lines not
    finished yet there, for following on from it. stream_lines sends a tail as it reads it."""
    try:
        file = _open_log(path)
    except FileNotFoundError:
        return [], 0, _Assembler(streams)
    with file:
        start, first_end, end = _tail_start(file, streams, tail, since)
        reader = _LineReader(streams, start, first_end, since)
        file.seek(start)
        lines = []
        while file.tell() < end:
            lines += reader.feed(file.read(min(READ_CHUNK, end - file.tell())))
    return lines, end, reader.assembler


def end_position(path: Path, streams: frozenset[str]) -> tuple[int, int]:
    """Where a follower that wants only lines to come starts (``stream_line_batches``' ``start``):
    the first record of a line still unfinished there, and the end of the last complete one."""
    offset, first_end, _end = _find_tail(path, streams, 0, None)
    return offset, first_end


def _find_tail(path: Path, streams: frozenset[str], tail: int, since: float | None) -> tuple[int, int, int]:
    try:
        with _open_log(path) as file:
            return _tail_start(file, streams, tail, since)
    except FileNotFoundError:
        return 0, 0, 0  # not written yet: a follower reads it from its start once it is


BATCH_BYTES = 1 << 20
"""The most UTF-8 a batch of lines holds (one line alone may hold more, up to MAX_LINE_CHARS
characters): a gRPC message carrying one stays well under grpc's 4 MiB limit. A line costs its
UTF-8 and LINE_OVERHEAD bytes more (its stream, time and framing in a message)."""
LINE_OVERHEAD = 32


def batches(lines: list[LogLine]) -> Iterator[list[LogLine]]:
    """``lines`` in order, cut into batches of at most BATCH_BYTES; a longer line goes alone."""
    batch: list[LogLine] = []
    size = 0
    for line in lines:
        content = line.content
        cost = (len(content) if content.isascii() else len(content.encode())) + LINE_OVERHEAD
        if batch and size + cost > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(line)
        size += cost
    if batch:
        yield batch


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
    """:func:`stream_line_batches`, a line at a time."""
    batches = stream_line_batches(path, streams, tail, follow, finished, since=since, watch=watch)
    try:
        async for batch in batches:
            for line in batch:
                yield line
    finally:
        await batches.aclose()


async def stream_line_batches(
    path: Path,
    streams: frozenset[str],
    tail: int | None,
    follow: bool,
    finished: Callable[[], bool],
    *,
    since: float | None = None,
    watch: LogWatch | None = None,
    start: tuple[int, int] | None = None,
    parts: bool = False,
) -> AsyncGenerator[list[LogLine], None]:
    """The last ``tail`` lines (all when None), then, with ``follow``, new lines until ``finished()``,
    in batches of at most BATCH_BYTES (see :func:`batches`): the lines each read completed.

    Lines are read in chunks and sent as they come, so a long log never sits in memory whole;
    where a tail starts is found from the end. ``watch`` wakes the follower when the log's
    directory changes (the log written, the exit recorded); without it, or without a watch, it
    polls. ``start`` (from :func:`end_position`, taken before) replaces ``tail``: a follower then
    misses nothing written after that moment, however late it begins to read.

    With ``parts`` a line's records come as they are, each a LogLine (``partial`` on all but a
    line's last), from ``start`` or the file's start: output as it was written, a line or not,
    for an attached client. ``tail`` counts whole lines: callers give none with ``parts``.
    """
    offset, first_end, limit = 0, 0, None
    if start is not None:
        offset, first_end = start
    elif tail is not None:
        offset, first_end, end = await asyncio.to_thread(_find_tail, path, streams, tail, since)
        limit = None if follow else end  # not following, the tail is what was there
    reader = _LineReader(streams, offset, first_end, since, parts=parts)
    watching = watch.watching(path.parent) if watch is not None and follow else contextlib.nullcontext()
    log_file = _FollowedFile(path)
    with watching as changed, contextlib.closing(log_file):
        longest = POLL_LONGEST if changed is None else POLL_LONGEST_WATCHED
        pause = POLL_SHORTEST
        at_end = False
        while True:
            if changed is not None:
                changed.clear()  # before reading: a change from here on wakes the wait below
            # Read before the data, so nothing written before the end is missed; not following,
            # the end is the end of what is there now.
            done = not follow or finished()
            size = FRESH_CHUNK if at_end else READ_CHUNK
            if limit is not None:
                size = min(size, limit - offset)
            if at_end:
                chunk = log_file.read(offset, size)
            else:
                chunk = await asyncio.to_thread(log_file.read, offset, size)
            at_end = len(chunk) < size or offset + len(chunk) == limit
            offset += len(chunk)
            for batch in batches(reader.feed(chunk)):
                yield batch
            if follow and at_end and not chunk and log_file.replaced():
                # Rotated (renamed away, ReopenContainerLog) and the old file read to its end:
                # the new one is followed from its start.
                offset, reader, at_end = 0, reader.restarted(), False
                continue
            if done and at_end:
                return  # everything written before the end (or before now) is read
            if chunk:
                pause = POLL_SHORTEST
            elif await _wait(changed, pause):
                pause = POLL_SHORTEST  # something changed (exit.json, say): the end may be near
            else:
                pause = min(pause * 2, longest)


async def _wait(changed: asyncio.Event | None, timeout: float) -> bool:
    """Sleep ``timeout``, or less when ``changed`` is set; whether it was.

    Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that comes as the event is
    set (it returns the result instead), and a follower cancelled then (an attach's client
    detaching while the container writes) would follow on until the container ends."""
    if changed is None:
        await asyncio.sleep(timeout)
        return False
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await changed.wait()
    return changed.is_set()


class _FollowedFile:
    """The log a follower reads, held open: a rotation (the file renamed away, a new one made at
    the path) leaves what the old one still had readable, and is seen as the path naming another
    file (``replaced``)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: BinaryIO | None = None

    def read(self, offset: int, size: int) -> bytes:
        if self._file is None:
            try:
                self._file = _open_log(self._path)
            except FileNotFoundError:
                return b""  # not written yet
        self._file.seek(offset)
        return self._file.read(size)

    def replaced(self) -> bool:
        """Whether the path names another file than the one read (then that one is read next)."""
        if self._file is None:
            return False
        try:
            now = self._path.stat()
        except FileNotFoundError:
            return False  # renamed away, the new one not made yet: the old may still grow
        held = os.fstat(self._file.fileno())
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return False
        self.close()
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
