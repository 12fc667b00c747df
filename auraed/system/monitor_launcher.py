"""Monitor launcher: one long-lived process that forks a monitor for each supervised process.

Starting each monitor as a fresh interpreter costs its start-up and imports every time: ~8-20 ms
on a host, ~300 ms in a guest under TCG. The launcher pays that once, at daemon start: it imports
``auraed.system.monitor`` (and what the monitor loads on demand), then forks a monitor per request,
ready in about a millisecond. A forked monitor is the same code as before, in its own session.

Protocol, on a SOCK_SEQPACKET socketpair with auraed:

- request: the monitor spec's path (UTF-8), carrying four descriptors (SCM_RIGHTS) that become the
  monitor's stdin, stdout, stderr and sync fd (``auraed.system.monitor``'s protocol from there).
- reply: the monitor's pid in decimal, or ``error: <why>``.

The launcher ends at EOF on its socket: when auraed closes it or dies. The monitors it forked
carry on: they hold no reference to it, and when it ends they are reparented like any orphan,
which is what happened to monitors auraed started itself. The launcher never waits for them:
with SIGCHLD ignored the kernel reaps them, so an exit is seen through a pidfd, as before.

Run as ``launcher_command(...)`` builds it; the cmdline of every forked monitor is the
launcher's, which names this module and the daemon's runtime directory.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

from auraed.system import monitor

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

DESCRIPTORS = 4
"""stdin, stdout, stderr and the sync fd of one monitor, in that order."""

REQUEST_MAX = 4096
"""Longest spec path accepted (PATH_MAX)."""

REPLY_MAX = 1024


def main(argv: list[str]) -> int:
    """``monitor_launcher CONTROL_FD LABEL``: serve until EOF; LABEL only names us in ps."""
    if len(argv) != 2 or not argv[0].isdigit():
        monitor.log_error("usage: monitor_launcher CONTROL_FD LABEL")
        return 2
    # Monitors are reaped by the kernel; interactive signals are not for us (own session anyway).
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    for sig in (_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE):
        _signal.signal(sig, _signal.SIG_IGN)
    monitor.preload()
    # Everything imported so far is shared with every monitor until written to; keep the garbage
    # collector from walking (and so copying) those objects in each child.
    gc.freeze()
    control = socket.socket(fileno=int(argv[0]))
    while True:
        try:
            payload, fds, _flags, _address = socket.recv_fds(control, REQUEST_MAX, DESCRIPTORS)
        except OSError as exc:
            monitor.log_error(f"launcher: receive: {exc}")
            return 1
        if not payload and not fds:
            return 0  # auraed closed its end or died
        try:
            control.send(_launch(control, payload, fds))
        except OSError as exc:
            monitor.log_error(f"launcher: reply: {exc}")
            return 1


def _launch(control: socket.socket, payload: bytes, fds: list[int]) -> bytes:
    """Fork a monitor for one request; the reply for auraed."""
    try:
        if len(fds) != DESCRIPTORS:
            return f"error: expected {DESCRIPTORS} descriptors, got {len(fds)}".encode()
        spec_path = payload.decode()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_monitor(control, spec_path, fds)
        return str(pid).encode()
    except (OSError, UnicodeDecodeError) as exc:
        return f"error: {exc}".encode()
    finally:
        for fd in fds:  # the child never gets here: it ends in os._exit
            os.close(fd)


def _become_monitor(control: socket.socket, spec_path: str, fds: list[int]) -> None:
    """In the forked child: take the request's descriptors as stdio and run the monitor."""
    code = 1
    try:
        control.close()
        *stdio, sync_fd = fds
        # Received descriptors are >= 3: the launcher's own 0-2 are open (set up by auraed).
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in stdio:
            os.close(fd)
        code = monitor.main([spec_path, str(sync_fd)])
    except BaseException as exc:
        monitor.log_error(f"launcher child: {exc!r}")
    finally:
        os._exit(code)


def launcher_command(control_fd: int, label: str, python: str | None = None) -> list[str]:
    """The launcher's command line; pass ``control_fd`` in ``pass_fds``."""
    return monitor.module_command("auraed.system.monitor_launcher", [str(control_fd), label], python)
