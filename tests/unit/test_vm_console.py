"""Console helpers: the tail, a follow stream over a growing file, waiting for a marker."""

from __future__ import annotations

import asyncio
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
