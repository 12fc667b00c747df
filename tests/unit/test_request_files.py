"""Files a request names (auraed.system.request_files) and work a caller can stop waiting for
(auraed.system.tasks.OwnThreads), on real FIFOs, devices, links and threads."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from auraed.system.request_files import (
    FileTooLarge,
    NotRegularFile,
    check_regular,
    open_regular,
    read_regular,
)
from auraed.system.tasks import OwnThreads, StuckThreads


def test_regular_files_are_read_through_links(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"
    target.write_bytes(b"{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert read_regular(link, 2) == b"{}"
    assert check_regular(link) and not check_regular(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 2)


def test_what_is_not_a_regular_file_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    began = time.monotonic()
    cases = {fifo: "a FIFO", Path("/dev/zero"): "a character device", tmp_path: "a directory"}
    for path, kind in cases.items():
        with pytest.raises(NotRegularFile) as refused:
            read_regular(path, 1 << 20)
        assert (
            refused.value.kind == kind and f"{path} is {kind}, not a regular file" == refused.value.strerror
        )
        with pytest.raises(NotRegularFile):
            open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert time.monotonic() - began < 1


def test_a_file_past_the_limit_is_refused_from_its_size(tmp_path: Path) -> None:
    huge = tmp_path / "huge"
    with huge.open("wb") as file:
        file.truncate(1 << 40)  # sparse: reading it would never end here
    with pytest.raises(FileTooLarge) as refused:
        read_regular(huge, 1024)
    assert refused.value.strerror == f"{huge} holds {1 << 40} bytes, more than the 1024 allowed"
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 1024)
    assert read_regular(exact, 1024) == b"x" * 1024


def test_open_regular_creates_and_clears_nonblocking(tmp_path: Path) -> None:
    log = tmp_path / "new.log"
    fd = open_regular(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        assert os.get_blocking(fd) and os.get_inheritable(fd) is False
        assert (os.fstat(fd).st_mode & 0o777) == 0o640
    finally:
        os.close(fd)


async def test_own_threads_give_up_waiting_and_bound_what_is_stuck() -> None:
    threads = OwnThreads(timeout=0.2, max_stuck=1)
    assert await threads.run(lambda: 42, "quick") == 42
    with pytest.raises(ValueError):
        await threads.run(lambda: int("x"), "failing")
    release = threading.Event()
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await threads.run(release.wait, "hung")
    assert time.monotonic() - began < 1 and threads.stuck == 1
    with pytest.raises(StuckThreads):  # the bound reached: refused at once
        await threads.run(lambda: 1, "refused")
    release.set()
    for _ in range(100):
        if threads.stuck == 0:
            break
        await asyncio.sleep(0.01)
    assert threads.stuck == 0 and await threads.run(lambda: 7, "again") == 7
    # Never the loop's default pool: its threads are all busy and the work still runs.
    blocked = threading.Event()
    loop = asyncio.get_running_loop()
    busy = [loop.run_in_executor(None, blocked.wait) for _ in range(64)]
    try:
        assert await threads.run(lambda: "own", "beside a full pool") == "own"
    finally:
        blocked.set()
        await asyncio.gather(*busy)
