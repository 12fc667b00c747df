"""Launching monitors and learning when they end: shared by executables and containers.

A monitor (``auraed.system.monitor``) is started detached, reports the supervised process on a
sync pipe, and writes an exit record when it ends. Here: start one and wait for its report,
then wait for its end, also for monitors a previous auraed started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from auraed.system import processes
from auraed.system.monitor import ExitRecord, MonitorSpec, monitor_command, read_exit_record

START_TIMEOUT = 30.0  # seconds; generous because guests run under slow emulation


class MonitorStartError(Exception):
    """The monitor could not start the process; the message says why (from the monitor)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclasses.dataclass
class Supervised:
    """A running monitor and the process it supervises, identified by pid and start time."""

    monitor_pid: int
    monitor_ticks: int | None
    pid: int
    ticks: int | None


class Supervisor:
    """Starts monitors and reaps the ones this process started."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    async def launch(self, spec: MonitorSpec, run_dir: Path, timeout: float = START_TIMEOUT) -> Supervised:
        spec_path = run_dir / "monitor.json"
        spec_path.write_text(spec.to_json())
        read_end, write_end = os.pipe()
        try:
            child = _launch(spec_path, write_end, run_dir / "monitor.log")
        finally:
            os.close(write_end)
        self._children[child.pid] = child
        monitor_ticks = processes.start_ticks(child.pid)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(_read_all, read_end), timeout)
        except TimeoutError:
            child.kill()
            await self._reap_now(child)
            raise MonitorStartError("the monitor did not report in time", timed_out=True) from None
        finally:
            os.close(read_end)
        report = _parse_sync_line(line)
        if "error" in report:
            await self._reap_now(child)
            raise MonitorStartError(str(report["error"]))
        return Supervised(child.pid, monitor_ticks, int(report["pid"]), report.get("start_ticks"))

    async def _reap_now(self, child: subprocess.Popen[bytes]) -> None:
        await asyncio.to_thread(child.wait)
        self._children.pop(child.pid, None)

    async def wait(self, supervised: Supervised, exit_path: Path) -> ExitRecord | None:
        """Wait until the monitor has ended; its exit record, or None when it left none."""
        await processes.wait_for_exit(supervised.monitor_pid, supervised.monitor_ticks)
        child = self._children.pop(supervised.monitor_pid, None)
        if child is not None:
            child.poll()  # reap it: it is our child when this auraed started it
        return read_exit_record(exit_path)

    @staticmethod
    def alive(supervised: Supervised) -> bool:
        return processes.is_alive(supervised.monitor_pid, supervised.monitor_ticks)


def _launch(spec_path: Path, sync_fd: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the monitor in its own session, so signals aimed at auraed's process group miss it."""
    with log_path.open("ab") as monitor_log:
        return subprocess.Popen(
            monitor_command(str(spec_path), sync_fd),
            pass_fds=[sync_fd],
            stdin=subprocess.DEVNULL,
            stdout=monitor_log,
            stderr=monitor_log,
            start_new_session=True,
        )


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_sync_line(line: bytes) -> dict[str, Any]:
    if not line.strip():
        return {"error": "the monitor exited without reporting (see monitor.log in the run directory)"}
    try:
        report = json.loads(line.decode().strip().splitlines()[0])
    except (ValueError, UnicodeDecodeError):
        return {"error": f"the monitor reported garbage: {line[:200]!r}"}
    return dict(report) if isinstance(report, dict) else {"error": f"the monitor reported {report!r}"}
