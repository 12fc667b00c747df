"""The Kubernetes CRI log format: records ``<RFC3339Nano> <stream> <F|P> <content>``, one a line,
a line longer than LOG_LINE_MAX split into P (partial) records ending with an F record. A monitor
writes them (CriLogWriter), auraed reads them (parse_cri_log_line). Builtins only: the writer is on
the monitor's path (see auraed.system.monitor).
"""

from __future__ import annotations

import os
import time

from auraed.system.monitor_io import describe, log_error, write_all
from auraed.system.request_files import open_regular

LOG_MODE = 0o640
"""Mode of a log file the monitor creates."""
LOG_LINE_MAX = 16 * 1024
"""Longest CRI log record; longer lines are split into P records followed by an F record."""


class LogStream:
    """One output pipe being logged: its descriptor, its stream name, what it carried since its
    last full line."""

    __slots__ = ("buf", "crlf", "fd", "name")

    def __init__(self, fd: int, name: bytes, crlf: bool = False) -> None:
        self.fd = fd
        self.name = name
        self.buf = b""
        self.crlf = crlf  # a terminal: lines end in \r\n (ONLCR); the \r is not logged


class CriLogWriter:
    """Appends CRI records (``<RFC3339Nano> <stream> <F|P> <content>``), one write(2) per read chunk."""

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
            self._line(head, buf, start, end, records)
            start = newline + 1
        # An unterminated tail longer than one record: emit full-size partial records now.
        while len(buf) - start > LOG_LINE_MAX:
            records.append(head + b"P " + buf[start : start + LOG_LINE_MAX] + b"\n")
            start += LOG_LINE_MAX
        stream.buf = buf[start:]
        self.write(records)

    def finish(self, stream: LogStream) -> None:
        """At EOF the last unterminated data becomes an F record."""
        if stream.buf:
            head = b"%s %s " % (self.timestamp(), stream.name)
            records: list[bytes] = []
            self._line(head, stream.buf, 0, len(stream.buf), records)
            stream.buf = b""
            self.write(records)

    @staticmethod
    def _line(head: bytes, buf: bytes, start: int, end: int, records: list[bytes]) -> None:
        while end - start > LOG_LINE_MAX:
            records.append(head + b"P " + buf[start : start + LOG_LINE_MAX] + b"\n")
            start += LOG_LINE_MAX
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
