"""Monitor launcher: one long-lived process that forks a monitor for each supervised process.

Starting each monitor as a fresh interpreter costs its start-up and imports every time: ~8-20 ms
on a host, ~300 ms in a guest under TCG. The launcher pays that once, at daemon start: it imports
``auraed.system.monitor`` (and what the monitor loads on demand), then keeps one forked child, the
spare, waiting for the next request. The spare takes it, tells the launcher (which forks the next
spare while this one works) and becomes the monitor: the fork (~1.1 ms on a host after idle) is
off the request's path. A monitor is the same code as before, in its own session.

Protocol, on a SOCK_SEQPACKET socketpair with auraed:

- request: the monitor spec's path (UTF-8), carrying four descriptors (SCM_RIGHTS) that become the
  monitor's stdin, stdout, stderr and sync fd (``auraed.system.monitor_protocol`` from there).
- reply: the monitor's pid in decimal, or ``error: <why>``.

Requests are read by the spare (the launcher reads one itself only when it cannot fork, to
answer it with the error). The launcher and its spare end at EOF on the socket: when auraed
closes it or dies. The monitors it forked carry on: they hold no reference to it, and when it
ends they are reparented like any orphan, which is what happened to monitors auraed started
itself. The launcher never waits for them:
with SIGCHLD ignored the kernel reaps them, so an exit is seen through a pidfd, as before.

Run as ``launcher_command(...)`` builds it; the cmdline of every forked monitor is the
launcher's, which names this module and the daemon's runtime directory.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time

from auraed.system import monitor, namespaces  # the monitor loads namespaces anyway (preload)
from auraed.system.monitor_io import log_error

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

SPARE_TOOK = b"t"
"""What a spare writes to the launcher once it has a request (then it becomes its monitor)."""

SPARE_SAW_EOF = b"e"
"""What a spare writes when auraed closed the socket (or it cannot be read): the launcher ends
too, and auraed starts another launcher at its next launch."""

SPARE_NAME = "aurae-spare"
MONITOR_NAME = "aurae-monitor"
"""Process names (comm, what ps shows) of a spare and of the monitor it becomes."""

RESPAWN_DELAY = 0.1
"""Seconds before replacing a spare that died without a request (so a broken one cannot spin)."""


def main(argv: list[str]) -> int:
    """``monitor_launcher CONTROL_FD LABEL``: serve until EOF; LABEL only names us in ps."""
    if len(argv) != 2 or not argv[0].isdigit():
        log_error("usage: monitor_launcher CONTROL_FD LABEL")
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
            news = _next_spare(control)
        except OSError as exc:  # no spare (fork failed): answer the next request with why
            news = _refuse_one(control, f"cannot fork a monitor: {exc}")
        if news == SPARE_SAW_EOF:
            return 0  # auraed closed its end or died
        if news != SPARE_TOOK:
            time.sleep(RESPAWN_DELAY)


def _next_spare(control: socket.socket) -> bytes:
    """Fork a spare and wait until it took a request (SPARE_TOOK), saw EOF (SPARE_SAW_EOF) or
    died (b"")."""
    news_r, news_w = os.pipe()
    try:
        sys.stderr.flush()
        pid = os.fork()
    except OSError:
        os.close(news_r)
        os.close(news_w)
        raise
    if pid == 0:
        os.close(news_r)
        _spare(control, news_w)
    os.close(news_w)
    with open(news_r, "rb", buffering=0) as news:
        return news.read(1)


def _receive(control: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request from auraed, or None at EOF (auraed closed its end or died) or when the
    socket cannot be read."""
    try:
        payload, fds, _flags, _address = socket.recv_fds(control, REQUEST_MAX, DESCRIPTORS)
    except OSError as exc:
        log_error(f"launcher: receive: {exc}")
        return None
    return (payload, fds) if payload or fds else None


def _refuse_one(control: socket.socket, why: str) -> bytes:
    """Without a spare: read one request and answer it with ``why``."""
    request = _receive(control)
    if request is None:
        return SPARE_SAW_EOF
    for fd in request[1]:
        os.close(fd)
    try:
        control.send(f"error: {why}".encode())
    except OSError as exc:
        log_error(f"launcher: reply: {exc}")
    return b""


def _spare(control: socket.socket, news_w: int) -> None:
    """In a forked spare: wait for one request, tell the launcher, become its monitor."""
    code = 1
    try:
        try:  # only to go faster and be named in ps: never worth dying (and respawning) over
            namespaces.set_process_name(SPARE_NAME)
            monitor.prepare_ahead()
        except Exception as exc:
            log_error(f"launcher spare: preparing: {exc!r}")
        request = _receive(control)
        if request is None:
            code = 0
            with contextlib.suppress(OSError):  # a launcher killed meanwhile is not to be told
                os.write(news_w, SPARE_SAW_EOF)
            return
        payload, fds = request
        os.write(news_w, SPARE_TOOK)
        os.close(news_w)
        namespaces.set_process_name(MONITOR_NAME)
        problem = _check_request(payload, fds)
        if problem is not None:
            for fd in fds:
                os.close(fd)
            control.send(f"error: {problem}".encode())
            return
        control.send(str(os.getpid()).encode())
        code = _become_monitor(control, payload.decode(), fds)
    except BaseException as exc:
        log_error(f"launcher spare: {exc!r}")
    finally:
        os._exit(code)


def _check_request(payload: bytes, fds: list[int]) -> str | None:
    if len(fds) != DESCRIPTORS:
        return f"expected {DESCRIPTORS} descriptors, got {len(fds)}"
    try:
        payload.decode()
    except UnicodeDecodeError as exc:
        return str(exc)
    return None


def _become_monitor(control: socket.socket, spec_path: str, fds: list[int]) -> int:
    """In the spare: take the request's descriptors as stdio and run the monitor; its exit code."""
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
    except Exception as exc:
        log_error(f"launcher child: {exc!r}")
    return code


def launcher_command(control_fd: int, label: str, python: str | None = None) -> list[str]:
    """The launcher's command line; pass ``control_fd`` in ``pass_fds``."""
    return monitor.module_command("auraed.system.monitor_launcher", [str(control_fd), label], python)
