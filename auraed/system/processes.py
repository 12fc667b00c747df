"""Processes by pid without pid-reuse mistakes: identity by start time, exit by pidfd."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal as signals
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), None when gone.

    A pid plus its start time names one process for the life of the machine, so a pid
    recycled while auraed was down is never mistaken for the process we started.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has already exited
        return None
    return int(fields[19])


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """A process as /proc shows it."""

    pid: int
    ppid: int
    state: str  # the one letter of /proc/<pid>/stat: R, S, D, Z, T, ...
    args: tuple[str, ...]  # its command line; empty for a zombie
    uid: int = 0  # its real uid, as this machine's (the reader's) user namespace sees it


def process_info(pid: int) -> ProcessInfo | None:
    """What /proc says of ``pid``; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after comm, which may hold spaces
    args = tuple(arg.decode(errors="replace") for arg in cmdline.split(b"\0")[:-1])
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), ["0"])
    return ProcessInfo(pid, int(fields[1]), fields[0], args, int(uids[0]))


def is_alive(pid: int, ticks: int | None) -> bool:
    return ticks is not None and start_ticks(pid) == ticks


def is_stopped(pid: int, ticks: int | None) -> bool:
    """Whether the process (identified by ``ticks``) is stopped by a signal (SIGSTOP, a
    debugger): it answers nothing until it is continued."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] in ("T", "t") and ticks is not None and int(fields[19]) == ticks


def send_signal(pid: int, signal: int, ticks: int | None, group: bool = False) -> bool:
    """Signal the process (with ``group``, the process group it leads) if it is still the one
    identified by ``ticks``; False when gone (a group is then left alone: the pid may be reused)."""
    if not is_alive(pid, ticks):
        return False
    try:
        (os.killpg if group else os.kill)(pid, signal)
    except ProcessLookupError:
        return False
    return True


def writes_to(pid: int, file: os.stat_result) -> bool:
    """Whether the process's stdout or stderr is ``file``: the same inode, not the same path
    (the kernel names an open file by its resolved path: /run/aurae for /var/run/aurae)."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            opened = os.stat(f"/proc/{pid}/fd/{fd}")
            if (opened.st_dev, opened.st_ino) == (file.st_dev, file.st_ino):
                return True
    return False


PIDFD_GETFD = 438
"""pidfd_getfd(2)'s number: the same on every architecture (syscalls from 424 on share one table)."""


def borrow_fd(pid: int, ticks: int | None, fd: int) -> int:
    """A copy of descriptor ``fd`` of process ``pid`` (pidfd_getfd(2); close-on-exec), when the
    process is still the one started at ``ticks``. ProcessLookupError when it is gone; other
    OSErrors as the kernel says (EBADF: no such descriptor, EPERM: not allowed to)."""
    import ctypes

    pidfd = os.pidfd_open(pid)
    try:
        if not is_alive(pid, ticks):
            raise ProcessLookupError(f"process {pid} has ended")
        libc = ctypes.CDLL(None, use_errno=True)
        copy = libc.syscall(PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"pidfd_getfd({pid}, {fd}): {os.strerror(code)}")
        return int(copy)
    finally:
        os.close(pidfd)


def kill_monitor(pid: int, ticks: int | None) -> bool:
    """SIGKILL a monitor and its process group (the runtime command it may be running): a
    monitor leads its own session and process group."""
    return send_signal(pid, signals.SIGKILL, ticks, group=True)


def reap(pid: int) -> int | None:
    """Collect a child's exit status if it is our child and has exited; never blocks."""
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return status if waited == pid else None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def until_readable(*fds: int, timeout: float | None = None) -> None:
    """Until one of ``fds`` is readable or hung up (a pidfd: its process has exited), or
    ``timeout`` seconds have passed (None: no limit)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    for fd in fds:
        loop.add_reader(fd, _resolve, ready)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ready, timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)


async def wait_for_exit(pid: int, ticks: int | None) -> None:
    """Return once the process has exited; works for processes that are not our children."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        # The pidfd was opened after the identity check could race a pid reuse: check again.
        if not is_alive(pid, ticks):
            return
        await until_readable(fd)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
