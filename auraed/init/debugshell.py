"""The guest's side of the debug console: a shell on the virtio-serial port DEBUG_PORT.

Only when the host booted the guest with ``auraed.debug_console=1`` (its vm_debug_console). A
thread of PID 1 waits for the port, then, each time the host's end connects (the port's poll stops
reporting POLLHUP), starts busybox ``sh`` on a new pty as a session leader with that pty as its
controlling terminal (busybox ``setsid -c``), and relays between the port (frames: bootargs'
debug_frame) and the pty's master: input and terminal sizes in, output out. When the shell ends
the host is told its status (DEBUG_EXIT) and the next connection gets a new shell; when the host
disconnects the shell's session is hung up (SIGHUP, SIGKILL a second later). Whatever fails here
is logged and retried after a pause: it never reaches PID 1. Stdlib only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time

from auraed.bootargs import (
    DEBUG_EXIT,
    DEBUG_INPUT,
    DEBUG_OPEN,
    DEBUG_OUTPUT,
    DEBUG_PORT,
    DEBUG_SIZE,
    DebugFrames,
    debug_frame,
)

log = logging.getLogger("auraed.pid1")

BUSYBOX = "/usr/bin/busybox"
PORT_WAIT = 30.0  # seconds for the port to appear once its driver is loaded
IDLE_POLL = 0.2  # seconds between looks at a port whose host end is closed
RETRY = 1.0  # seconds after a failure before the port is opened again
HANGUP_GRACE = 1.0
READ_SIZE = 4096
ENVIRONMENT = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "TERM": "xterm",
    "PS1": "debug# ",
}


def start(sys_dir: str = "/sys", dev_dir: str = "/dev", busybox: str = BUSYBOX) -> threading.Thread:
    """Serve the debug port from a daemon thread (it never returns, never raises)."""
    thread = threading.Thread(
        target=_serve_forever, args=(sys_dir, dev_dir, busybox), name="debug console", daemon=True
    )
    thread.start()
    return thread


def _serve_forever(sys_dir: str, dev_dir: str, busybox: str) -> None:
    from auraed.init.identity import find_port

    deadline = time.monotonic() + PORT_WAIT
    while not (path := find_port(DEBUG_PORT, sys_dir, dev_dir)) or not os.path.exists(path):
        if time.monotonic() > deadline:
            log.error("debug console: no virtio-serial port %r within %g s", DEBUG_PORT, PORT_WAIT)
            return
        time.sleep(0.05)
    log.info("debug console: serving a shell on %s (%s)", path, DEBUG_PORT)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            port = DebugPort(fd, busybox)
            try:
                port.serve()
            finally:
                port.hang_up()
                os.close(fd)
        except BaseException as exc:  # never PID 1's problem
            with contextlib.suppress(BaseException):
                log.error("debug console: %s: retrying in %g s", exc, RETRY)
            time.sleep(RETRY)


class DebugPort:
    """The port and the shell of the session open on it, if any."""

    def __init__(self, port: int, busybox: str) -> None:
        self.port = port
        self.busybox = busybox
        self.frames = DebugFrames()
        self.shell: subprocess.Popen[bytes] | None = None
        self.master = -1

    def serve(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self.port, select.POLLIN)
            if self.master >= 0:
                poller.register(self.master, select.POLLIN)
            ready = poller.poll(int(IDLE_POLL * 1000))
            for fd, events in ready:
                if fd == self.port and events & select.POLLHUP:
                    # The host's end is closed: no session. POLLHUP comes at once until it opens.
                    self.frames = DebugFrames()
                    self.hang_up()
                    time.sleep(IDLE_POLL)
                elif fd == self.port:
                    self._from_host()
                elif fd == self.master:
                    self._from_shell()
            if not ready and self.shell is not None and self.shell.poll() is not None:
                self._ended()  # its terminal held open by something it left running

    def _ended(self) -> None:
        status = self.hang_up()
        self._send(debug_frame(DEBUG_EXIT, struct.pack(">i", status)))

    def _from_host(self) -> None:
        try:
            data = os.read(self.port, READ_SIZE)
        except BlockingIOError:
            return
        for kind, payload in self.frames.feed(data):
            if kind == DEBUG_OPEN:
                self.hang_up()
                self._start()
            elif self.master < 0:
                continue  # no session: what a closed one still sent
            elif kind == DEBUG_INPUT:
                _write_all(self.master, payload)
            elif kind == DEBUG_SIZE and len(payload) == 4:
                rows, columns = struct.unpack(">HH", payload)
                fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def _from_shell(self) -> None:
        try:
            data = os.read(self.master, READ_SIZE)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""  # every end of the pty's terminal is closed: the shell ended
        if data:
            if not self._send(debug_frame(DEBUG_OUTPUT, data)):
                self.hang_up()
            return
        self._ended()

    def _start(self) -> None:
        master, slave = os.openpty()
        try:
            self.shell = subprocess.Popen(
                [self.busybox, "setsid", "-c", self.busybox, "sh"],
                stdin=slave, stdout=slave, stderr=slave, env=ENVIRONMENT, cwd="/",
                close_fds=True,
            )  # fmt: skip
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self.master = master
        log.info("debug console: session opened, shell %d started", self.shell.pid)

    def hang_up(self) -> int:
        """End the session: its pty closed, its shell's session hung up if it still runs; the
        shell's status (0 without one)."""
        if self.master >= 0:
            os.close(self.master)
            self.master = -1
        process, self.shell = self.shell, None
        if process is None:
            return 0
        if process.poll() is None:
            for sig, wait in ((signal.SIGHUP, HANGUP_GRACE), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                try:
                    process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        status = process.wait()
        log.info("debug console: shell %d ended (%d)", process.pid, status)
        return status

    def _send(self, data: bytes) -> bool:
        """Write to the host; False once its end has closed."""
        poller = select.poll()
        poller.register(self.port, select.POLLOUT)
        while data:
            try:
                data = data[os.write(self.port, data) :]
            except BlockingIOError:
                events = poller.poll(int(IDLE_POLL * 1000))
                if events and events[0][1] & select.POLLHUP:
                    return False
        return True


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
