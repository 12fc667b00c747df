"""The Kubernetes CRI log format: records ``<RFC3339Nano> <stream> <F|P> <content>``, one a line:
a line ends with an F record, after the P (partial) records of what of it came earlier (output
that stopped mid-line, or more than LOG_LINE_MAX of it). A monitor writes them (CriLogWriter),
auraed reads them (parse_cri_log_line). Builtins only: the writer is on the monitor's path (see
auraed.system.monitor).
"""

from __future__ import annotations

import os
import time

from auraed.system.monitor_io import describe, log_error, write_all
from auraed.system.request_files import open_regular

LOG_MODE = 0o640
"""Mode of a log file the monitor creates."""
LOG_LINE_MAX = 16 * 1024
"""Longest CRI log record's content; a longer line is split into P records, then its F record."""


class LogStream:
    """One output pipe being logged: its descriptor, its stream name, the few bytes read but not
    logged yet, and whether its last record left a line open (P)."""

    __slots__ = ("buf", "crlf", "fd", "name", "open_line")

    def __init__(self, fd: int, name: bytes, crlf: bool = False) -> None:
        self.fd = fd
        self.name = name
        self.buf = b""  # held back: a character cut in two by a read, a terminal's \r before its \n
        self.crlf = crlf  # a terminal: lines end in \r\n (ONLCR); the \r is not logged
        self.open_line = False  # its last record was P: the next one goes on with that line


class CriLogWriter:
    """Appends CRI records (``<RFC3339Nano> <stream> <F|P> <content>``), one write(2) per read chunk.

    What a read brings is logged at once, a line or not: whole lines as F records, and what
    follows the last newline as a P record that the stream's next records continue (as CRI-O's
    conmon does; containerd writes P only for a line over its size limit, but its attach reads
    the pipe, where ours follows this log). So an attached client sees ``echo -n`` output or a
    shell prompt as it is written; readers that join P records into lines (the kubelet, auraed's
    own) see the same lines. Held back from a P record, until the next read: the bytes of a
    UTF-8 character the read cut in two (each record stays decodable) and, on a terminal, a
    final \r whose \n may come next (the pair ends a line). At EOF a line left open gets an
    empty F record, so that every line in the log ends with an F.
    """

    __slots__ = ("failed", "fd", "path", "prefix", "second")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.failed = False
        self.second = -1
        self.prefix = b""

    def open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # A regular file only: the path is the kubelet's, in a directory others may write (a log
        # collector's hostPath), and a FIFO put there would block this open.
        self.fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE)

    def reopen(self) -> None:
        old = self.fd
        try:
            self.open()
            self.failed = False
        except OSError as exc:
            log_error(f"reopen {self.path}: {describe(exc)}")
            return
        if old >= 0:
            os.close(old)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def timestamp(self) -> bytes:
        now = time.time_ns()
        second, nanos = divmod(now, 1_000_000_000)
        if second != self.second:
            self.second = second
            self.prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)).encode()
        return b"%s.%09dZ" % (self.prefix, nanos)

    def write(self, records: list[bytes]) -> None:
        if not records or self.fd < 0:
            return
        try:
            write_all(self.fd, b"".join(records))
        except OSError as exc:
            if not self.failed:  # say it once; keep draining the pipes so the executable never blocks
                log_error(f"write {self.path}: {describe(exc)}")
            self.failed = True

    def feed(self, stream: LogStream, data: bytes) -> None:
        ts = self.timestamp()
        head = b"%s %s " % (ts, stream.name)
        buf = stream.buf + data if stream.buf else data
        records: list[bytes] = []
        start = 0
        while True:
            newline = buf.find(b"\n", start)
            if newline < 0:
                break
            end = newline - 1 if stream.crlf and newline > start and buf[newline - 1] == 13 else newline
            _line(head, buf, start, end, records)
            start = newline + 1
            stream.open_line = False
        keep = _char_start(buf, start, len(buf))
        if stream.crlf and keep > start and buf[keep - 1] == 13:
            keep -= 1
        if keep > start:
            start = _parts(head, buf, start, keep, records)
            if keep > start:
                records.append(head + b"P " + buf[start:keep] + b"\n")
            stream.open_line = True
        stream.buf = buf[keep:]
        self.write(records)

    def finish(self, stream: LogStream) -> None:
        """At EOF: what was held back, and the end of a line left open, as an F record."""
        if stream.buf or stream.open_line:
            head = b"%s %s " % (self.timestamp(), stream.name)
            records: list[bytes] = []
            _line(head, stream.buf, 0, len(stream.buf), records)
            stream.buf = b""
            stream.open_line = False
            self.write(records)


def _char_start(buf: bytes, start: int, end: int) -> int:
    """``end``, or where the UTF-8 character that ``end`` would cut in two begins (a record then
    ends before it). Bytes that are not UTF-8 are cut where asked."""
    lowest = max(start, end - 3)
    at = end - 1
    while at >= lowest and buf[at] & 0xC0 == 0x80:  # continuation bytes
        at -= 1
    if at < lowest:
        return end
    lead = buf[at]
    length = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 1
    return at if end - at < length else end


def _parts(head: bytes, buf: bytes, start: int, end: int, records: list[bytes]) -> int:
    """P records of ``buf[start:end]`` while more than one record's worth is left; where the
    rest begins."""
    while end - start > LOG_LINE_MAX:
        cut = _char_start(buf, start, start + LOG_LINE_MAX)
        records.append(head + b"P " + buf[start:cut] + b"\n")
        start = cut
    return start


def _line(head: bytes, buf: bytes, start: int, end: int, records: list[bytes]) -> None:
    """``buf[start:end]`` ends a line: P records while it is longer than one, then its F."""
    start = _parts(head, buf, start, end, records)
    records.append(head + b"F " + buf[start:end] + b"\n")


def format_cri_timestamp(ns: int) -> str:
    """RFC 3339 UTC with nanoseconds, fixed width: ``2026-11-30T01:02:03.123456789Z``."""
    second, nanos = divmod(ns, 1_000_000_000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(second))}.{nanos:09d}Z"


def _days_from_civil(year: int, month: int, day: int) -> int:
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def parse_rfc3339_ns(ts: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 timestamp (any fraction length, Z or +hh:mm)."""
    if len(ts) < 20 or ts[4] != "-" or ts[7] != "-" or ts[10] not in "Tt " or ts[13] != ":" or ts[16] != ":":
        raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
    year, month, day = int(ts[0:4]), int(ts[5:7]), int(ts[8:10])
    hour, minute, second = int(ts[11:13]), int(ts[14:16]), int(ts[17:19])
    pos = 19
    nanos = 0
    if ts[pos] == ".":
        end = pos + 1
        while end < len(ts) and ts[end].isdigit():
            end += 1
        digits = ts[pos + 1 : end]
        if not digits:
            raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
        nanos = int(digits[:9].ljust(9, "0"))
        pos = end
    zone = ts[pos:]
    if zone in ("Z", "z"):
        offset = 0
    elif len(zone) == 6 and zone[0] in "+-" and zone[3] == ":":
        offset = (int(zone[1:3]) * 60 + int(zone[4:6])) * 60 * (1 if zone[0] == "+" else -1)
    else:
        raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
    seconds = _days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second - offset
    return seconds * 1_000_000_000 + nanos


def parse_cri_log_line(line: str) -> tuple[float, str, bool, str]:
    """``<ts> <stream> <F|P> <content>`` -> (epoch seconds, stream, partial, content without newline)."""
    if line.endswith("\n"):
        line = line[:-1]
    parts = line.split(" ", 3)
    if len(parts) < 3 or parts[2] not in ("F", "P"):
        raise ValueError(f"not a CRI log line: {line[:80]!r}")
    content = parts[3] if len(parts) == 4 else ""
    return parse_rfc3339_ns(parts[0]) / 1e9, parts[1], parts[2] == "P", content
