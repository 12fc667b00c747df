"""Console helpers: the tail, a follow stream over a growing file, waiting for a marker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from auraed.vms import console


def test_read_tail(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    assert console.read_tail(log, 5) == []
    log.write_bytes(b"one\r\ntwo\r\nthree\npartial")
    assert console.read_tail(log, 2) == ["three", "partial"]
    assert console.read_tail(log, 10) == ["one", "two", "three", "partial"]
    assert console.read_tail(log, 0) == []
    big = b"".join(b"line %d\n" % i for i in range(50000))
    log.write_bytes(big + b"\xff\xfe broken\n")
    assert console.read_tail(log, 3) == ["line 49998", "line 49999", "\ufffd\ufffd broken"]


def test_powered_off() -> None:
    assert console.powered_off(["x", "[    1.83] reboot: Power down"])
    assert console.powered_off(["[    2.0] reboot: Restarting system"])
    assert not console.powered_off(["Kernel panic - not syncing", "end Kernel panic"])


async def collect(lines: object) -> list[str]:
    return [line async for line in lines]  # type: ignore[attr-defined]


async def test_follow_streams_until_the_vmm_ends(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"boot 1\nboot 2\n")
    alive = True

    async def writer() -> None:
        nonlocal alive
        await asyncio.sleep(0.1)
        with log.open("ab") as f:
            f.write(b"later 1\nhalf")
        await asyncio.sleep(0.1)
        with log.open("ab") as f:
            f.write(b" line\nlast without newline")
        await asyncio.sleep(0.1)
        alive = False

    task = asyncio.ensure_future(writer())
    lines = await asyncio.wait_for(
        collect(console.follow(log, tail=1, follow=True, alive=lambda: alive, poll_interval=0.01)), 5
    )
    await task
    assert lines == ["boot 2", "later 1", "half line", "last without newline"]
    everything = await collect(console.follow(log, tail=None, follow=False, alive=lambda: False))
    assert everything[0] == "boot 1" and everything[-1] == "last without newline"


async def test_follow_without_follow_stops_at_the_end(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"a\nb\n")
    lines = await asyncio.wait_for(
        collect(console.follow(log, tail=None, follow=False, alive=lambda: True)), 5
    )
    assert lines == ["a", "b"]
    assert await collect(console.follow(tmp_path / "none", tail=5, follow=False, alive=lambda: True)) == []


async def test_wait_for_marker(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"")

    async def writer() -> None:
        await asyncio.sleep(0.1)
        with log.open("ab") as f:
            f.write(b"noise\nAURAE-BARE-")
        await asyncio.sleep(0.1)
        with log.open("ab") as f:
            f.write(b"BOOT-OK\n")

    task = asyncio.ensure_future(writer())
    elapsed = await console.wait_for_marker(
        log, "AURAE-BARE-BOOT-OK", 5, alive=lambda: True, poll_interval=0.01
    )
    await task
    assert 0.15 <= elapsed < 5
    with pytest.raises(console.MarkerTimeout):
        await console.wait_for_marker(log, "NEVER", 0.2, alive=lambda: True, poll_interval=0.01)
    with pytest.raises(console.VmEnded):
        await console.wait_for_marker(log, "NEVER", 5, alive=lambda: False, poll_interval=0.01)
    # What was written before the VMM ended still counts.
    assert await console.wait_for_marker(log, "BOOT-OK", 5, alive=lambda: False) >= 0


# A line longer than any tail's window; a sparse file, so it costs no disk.
ENDLESS_LINE = 64 * 1024 * 1024
QUICK = 2.0  # seconds: one bounded read takes milliseconds; rereading the line took minutes


def test_a_tail_reads_a_bounded_window_from_the_end_and_cuts_long_lines(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    with log.open("wb") as f:
        f.write(b"before\n")
        f.truncate(ENDLESS_LINE)  # one line of zeros, no newline in it
        f.seek(0, 2)
        f.write(b"\nshort\r\n" + b"x" * (3 * console.MAX_LINE) + b"\nlast")
    started = time.monotonic()
    tail = console.read_tail(log, 20)
    assert time.monotonic() - started < QUICK
    assert tail[-2:] == ["x" * console.MAX_LINE, "last"]
    assert "short" in tail
    assert all(len(line) <= console.MAX_LINE for line in tail)
    # A window shorter than the line before it: a piece of that line, cut like any long one.
    assert console.read_tail(log, 3, max_line=10) == ["x" * 10, "last"]
    # A file that is one endless line: its tail is (the last part of) that line, cut.
    endless = tmp_path / "endless.log"
    endless.write_bytes(b"y" * (2 * console.MAX_TAIL_BYTES))
    started = time.monotonic()
    assert console.read_tail(endless, 20, max_line=100) == ["y" * 100]
    assert time.monotonic() - started < QUICK


def _disk_use(path: Path) -> int:
    return path.stat().st_blocks * 512


async def test_a_trimmed_log_keeps_its_end_and_readers_skip_what_was_cut(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    limit = 256 * 1024
    lines = [b"line %06d" % i for i in range(200_000)]  # ~2.2 MB
    log.write_bytes(b"\n".join(lines) + b"\n")
    size = log.stat().st_size
    writer = log.open("ab")  # a VMM keeps writing to its open file
    try:
        freed = console.trim(log, limit)
        assert freed > size - limit - 2 * log.stat().st_blksize
        assert log.stat().st_size == size  # the apparent size stays: the VMM's offset is valid
        assert _disk_use(log) <= limit + 2 * log.stat().st_blksize
        assert console.trim(log, limit) == 0  # nothing more to cut
        writer.write(b"after the trim\n")
        writer.flush()
    finally:
        writer.close()
    assert console.read_tail(log, 2) == ["line 199999", "after the trim"]
    # A tail reaching back into the cut head starts after it, at the first whole line.
    kept = console.read_tail(log, len(lines))
    assert kept[-1] == "after the trim" and len(kept) < 30_000
    assert all(line.startswith("line ") and len(line) == len("line 000000") for line in kept[:-1])
    # Reading from the start skips the hole: complete lines of the kept end, no zeros.
    everything = await collect(console.follow(log, tail=None, follow=False, alive=lambda: False))
    assert everything[-1] == "after the trim" and len(everything) < 30_000
    assert all(line.startswith("line ") for line in everything[1:-1])
    assert "\0" not in "".join(everything)
    assert await console.wait_for_marker(log, "after the trim", 5, alive=lambda: False) >= 0
