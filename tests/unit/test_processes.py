"""Processes by pid and start time: a process stopped by a signal is seen as stopped."""

from __future__ import annotations

import signal
import subprocess
import time

from auraed.system import processes


def test_a_process_stopped_by_sigstop_is_stopped_until_continued() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        ticks = processes.start_ticks(child.pid)
        assert not processes.is_stopped(child.pid, ticks)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not processes.is_stopped(child.pid, ticks):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not processes.is_stopped(child.pid, (ticks or 0) + 1)  # another process of that pid
        child.send_signal(signal.SIGCONT)
        while processes.is_stopped(child.pid, ticks):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert not processes.is_stopped(child.pid, ticks)
