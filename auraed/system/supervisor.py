"""Launching monitors and learning when they end: shared by executables and containers.

A monitor (``auraed.system.monitor``) is started detached, reports the supervised process on a
sync pipe, and writes an exit record when it ends. Monitors are forked by one long-lived
launcher (``auraed.system.monitor_launcher``) that this class starts and restarts as needed.
Here: start one and wait for its report, then wait for its end, also for monitors a previous
auraed started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import select
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from auraed.system import processes
from auraed.system.monitor_launcher import DESCRIPTORS, REPLY_MAX, launcher_command
from auraed.system.monitor_protocol import ExitRecord, MonitorSpec, parse_report, read_exit_record

START_TIMEOUT = 30.0  # seconds; generous because guests run under slow emulation
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
LAUNCHER_STOP_TIMEOUT = 5.0  # seconds for the launcher to leave after its socket closed
REQUEST_ATTEMPTS = 2
"""Times a request is sent: one lost with a spare that died as it took it goes once more."""
MONITOR_LOG = "monitor.log"
"""A monitor's own stdout and stderr, in its run directory: also how one is found again by a
daemon that was killed before it learned of it (see kill_unreported)."""
ORPHANED = (
    "unsupervised: its monitor ended, so its output is no longer logged and its exit status will not be known"
)


class MonitorStartError(Exception):
    """The monitor could not start the process; the message says why (from the monitor)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _RequestLost(MonitorStartError):
    """The spare that took the request died before it answered: nothing was started."""


@dataclasses.dataclass
class Supervised:
    """A running monitor and the process it supervises, identified by pid and start time."""

    monitor_pid: int
    monitor_ticks: int | None
    pid: int
    ticks: int | None
    input_fd: int = -1
    """The monitor's descriptor for the process's input (stdin pipe or terminal master), -1: none."""


class Supervisor:
    """Starts monitors through the launcher and waits for their end.

    ``runtime_dir`` holds the launcher's log and names the launcher (and so every monitor it
    forks) in its command line.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self._runtime_dir = runtime_dir
        self._launcher: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._lock = asyncio.Lock()  # one request at a time on the launcher's socket

    @property
    def launcher_pid(self) -> int | None:
        """The running launcher's pid, None before the first launch or after close."""
        return self._launcher.pid if self._launcher is not None else None

    def start(self) -> None:
        """Start the launcher now rather than at the first launch (idempotent)."""
        self._ensure_launcher()

    def close(self) -> None:
        """Let the launcher go (it leaves at EOF); monitors it forked keep running."""
        if self._control is not None:
            self._control.close()
            self._control = None
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            try:
                launcher.wait(LAUNCHER_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()

    async def launch(self, spec: MonitorSpec, run_dir: Path, timeout: float = START_TIMEOUT) -> Supervised:
        """Start a monitor whose own output goes to run_dir/monitor.log; wait for its report."""
        with contextlib.ExitStack() as fds:
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            fds.callback(os.close, null)
            log = os.open(run_dir / MONITOR_LOG, _APPEND, 0o644)
            fds.callback(os.close, log)
            monitor_pid, monitor_ticks, read_end = await self.spawn(spec, run_dir, (null, log, log))
        try:
            with os.fdopen(read_end, "rb", buffering=0) as pipe:
                report = await asyncio.wait_for(read_report(pipe), timeout)
        except TimeoutError:
            processes.kill_monitor(monitor_pid, monitor_ticks)
            raise MonitorStartError("the monitor did not report in time", timed_out=True) from None
        if "error" in report:
            await processes.wait_for_exit(monitor_pid, monitor_ticks)
            raise MonitorStartError(str(report["error"]))
        pid, ticks, input_fd = int(report["pid"]), report.get("start_ticks"), int(report.get("input_fd", -1))
        return Supervised(monitor_pid, monitor_ticks, pid, ticks, input_fd)

    async def spawn(
        self, spec: MonitorSpec, run_dir: Path, stdio: tuple[int, int, int]
    ) -> tuple[int, int | None, int]:
        """Write ``spec`` to run_dir/monitor.json and fork its monitor with ``stdio`` as its stdin,
        stdout and stderr (the caller keeps and closes its descriptors).

        Returns the monitor's pid, its start ticks and the read end of its sync pipe, for
        ``read_report``.
        """
        spec_path = run_dir / "monitor.json"
        spec_path.write_text(spec.to_json())
        attempt = 1
        while True:
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            try:
                monitor_pid = await self._fork_monitor(spec_path, [*stdio, write_end], read_end)
            except _RequestLost:
                os.close(read_end)
                if attempt == REQUEST_ATTEMPTS:
                    raise
                attempt += 1
                continue
            except BaseException:
                os.close(read_end)
                raise
            return monitor_pid, processes.start_ticks(monitor_pid), read_end

    async def wait(
        self, supervised: Supervised, exit_path: Path, on_orphaned: Callable[[], None] = lambda: None
    ) -> ExitRecord | None:
        """Wait until the supervised process has ended; its monitor's exit record, or None when
        the monitor left none.

        A monitor that ends without one (killed, say) while the process lives on has left it
        unsupervised: its output is no longer logged and its status will not be known, but it
        still runs and can be signalled. ``on_orphaned`` is called then, and the wait goes on
        until the process itself has ended.
        """
        await processes.wait_for_exit(supervised.monitor_pid, supervised.monitor_ticks)
        exit_record = read_exit_record(exit_path)
        if exit_record is None and processes.is_alive(supervised.pid, supervised.ticks):
            on_orphaned()
            await processes.wait_for_exit(supervised.pid, supervised.ticks)
        return exit_record

    @staticmethod
    def alive(supervised: Supervised) -> bool:
        """The monitor, or the process it supervised (left orphaned), still runs."""
        return processes.is_alive(supervised.monitor_pid, supervised.monitor_ticks) or processes.is_alive(
            supervised.pid, supervised.ticks
        )

    @staticmethod
    def kill_unreported(run_dir: Path) -> list[int]:
        """SIGKILL what a launch into ``run_dir`` brought up without its caller learning of it
        (auraed was killed while it waited for the report): the monitors whose output goes to
        its monitor.log, and what they started; their pids.

        The process a monitor started leads its own process group (an init's group ends its pid
        namespace with it): the groups of the monitor's children go first, while they can still
        be told from other processes by their parent.
        """
        try:
            log_file = os.stat(run_dir / MONITOR_LOG)
        except FileNotFoundError:
            return []  # no launch got as far as opening it: no monitor to find
        table = _process_table()
        monitors = [pid for pid in table if processes.writes_to(pid, log_file)]
        for monitor in monitors:
            for child, (parent, group) in table.items():
                if parent == monitor:
                    processes.send_signal(
                        child, signal.SIGKILL, processes.start_ticks(child), group=child == group
                    )
            processes.kill_monitor(monitor, processes.start_ticks(monitor))
        return monitors

    async def _fork_monitor(self, spec_path: Path, fds: list[int], sync_read: int) -> int:
        """Ask the launcher for a monitor; its pid.

        The last of ``fds`` is the write end of the monitor's sync pipe, whose read end is
        ``sync_read``; it is closed here once sent. Only the request holds it then, so a request
        lost with the spare that took it (killed just then) shows as that pipe hanging up:
        _RequestLost. The exchange is not cut short by a cancellation, which would leave its
        reply to be read as the next request's: it runs on, and the monitor it brings is killed.
        """
        assert len(fds) == DESCRIPTORS
        try:
            await self._lock.acquire()  # held until the reply is read: one request at a time
            own_read_end = -1
            try:
                # The reply's own descriptor: a caller cancelled meanwhile closes sync_read at once.
                own_read_end = os.dup(sync_read)
                control = self._send(spec_path, fds)
            except BaseException:
                if own_read_end >= 0:
                    os.close(own_read_end)
                self._lock.release()
                raise
        finally:
            os.close(fds[-1])  # sent or not: from here on only the request may hold it
        exchange = asyncio.ensure_future(self._reply(control, own_read_end))
        try:
            reply = await asyncio.shield(exchange)
        except asyncio.CancelledError:
            exchange.add_done_callback(_kill_abandoned_monitor)
            raise
        pid = _pid_in(reply)
        if pid is None:
            why = reply.decode(errors="replace").removeprefix("error: ")
            raise MonitorStartError(f"the monitor launcher could not fork: {why}")
        return pid

    def _send(self, spec_path: Path, fds: list[int]) -> socket.socket:
        """Send one request; the socket it went on."""
        control = self._ensure_launcher()
        try:
            # Never blocks: one request at a time, a few hundred bytes in a fresh buffer.
            socket.send_fds(control, [os.fsencode(spec_path)], fds)
        except OSError:  # the launcher is gone (EPIPE): nothing was forked, start another
            self._forget_launcher()
            control = self._ensure_launcher()
            socket.send_fds(control, [os.fsencode(spec_path)], fds)
        return control

    async def _reply(self, control: socket.socket, sync_read: int) -> bytes:
        """The reply to the request just sent (``sync_read`` is closed here); then the next
        request may go."""
        try:
            try:
                reply = await _launcher_reply(control, sync_read)
            finally:
                os.close(sync_read)
            if not reply:  # it died while on our request: a monitor may or may not exist
                self._forget_launcher()
                raise MonitorStartError("the monitor launcher ended without answering")
            return reply
        finally:
            self._lock.release()

    def _ensure_launcher(self) -> socket.socket:
        if self._control is not None and self._launcher is not None and self._launcher.poll() is None:
            return self._control
        self._forget_launcher()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._runtime_dir.mkdir(parents=True, exist_ok=True)
            with (self._runtime_dir / "monitor-launcher.log").open("ab") as log:
                self._launcher = subprocess.Popen(
                    launcher_command(theirs.fileno(), str(self._runtime_dir)),
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # signals aimed at auraed's process group miss it
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._control = ours
        return ours

    def _forget_launcher(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._launcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._launcher.wait(0)  # reap it if it has ended; a live one leaves at EOF
            self._launcher = None


async def _launcher_reply(control: socket.socket, sync_read: int) -> bytes:
    """The launcher's reply on ``control`` (b"" when it is gone); _RequestLost when the sync
    pipe hangs up first. A spare answers before its monitor writes to that pipe, so a reply
    sent is always read before the pipe's hang-up."""
    hung_up = select.poll()
    hung_up.register(sync_read, 0)  # POLLHUP is reported whatever the mask
    while True:
        try:
            return control.recv(REPLY_MAX)
        except BlockingIOError:
            pass
        except OSError:
            return b""
        if hung_up.poll(0):
            raise _RequestLost("the monitor launcher's spare died as it took the request")
        await processes.until_readable(control.fileno(), sync_read)


def _process_table() -> dict[int, tuple[int, int]]:
    """Every process now: pid -> (parent pid, process group)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(b")") + 2 :].split()  # after comm, which may hold anything
        table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def _pid_in(reply: bytes) -> int | None:
    """The monitor's pid in the launcher's reply; None when it says why it could not fork."""
    return int(reply) if reply.isdigit() else None


def _kill_abandoned_monitor(exchange: asyncio.Future[bytes]) -> None:
    """A monitor forked for a launch that was cancelled meanwhile: nobody waits for it."""
    if exchange.cancelled() or exchange.exception() is not None:
        return
    pid = _pid_in(exchange.result())
    if pid is not None:
        processes.kill_monitor(pid, processes.start_ticks(pid))


async def read_report(pipe: BinaryIO) -> dict[str, Any]:
    """A monitor's report: its sync pipe read until EOF through the event loop.

    The caller opens the pipe (``os.fdopen(read_end, "rb", buffering=0)``) in a ``with``, so it
    is closed even when this is cancelled before it ran.
    """
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    try:
        return parse_report(await reader.read())
    finally:
        transport.close()
