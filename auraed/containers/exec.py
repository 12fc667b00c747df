"""Exec sessions: one process run in a running container, with its stdio streamed to the caller.

runc 1.1 accepts ``--console-socket`` only with ``--detach``, and a detached process is abandoned
by the runtime, so (like containerd's shim) every exec is ``<runtime> exec --detach --pid-file P
--process F [--tty --console-socket S] ID`` run under our monitor as a child subreaper in
pass-through mode (no log): the monitor adopts the process, reports its pid on the sync pipe and
writes its exit status to ``exit.json``. The monitor is forked by the Supervisor's launcher, like
every other monitor, with stdio we made.

- Without a terminal the monitor's stdin/stdout/stderr are pipes to us; the runtime and then the
  process inherit them; the monitor itself lets go of them right after forking.
- With a terminal we listen on the console socket before starting the monitor, receive the pty
  master (auraed.system.pty.receive_pty_master), read output from it, write stdin to it and
  resize it with TIOCSWINSZ. The monitor's stderr still brings the runtime's error messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal as signals
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

from auraed.containers.runtime import OciRuntime, OciRuntimeError, check_container_id
from auraed.system import processes
from auraed.system.monitor_protocol import MonitorSpec, read_exit_record
from auraed.system.pty import CONSOLE_RECEIVE_TIMEOUT, receive_pty_master, set_window_size
from auraed.system.supervisor import Supervisor, read_report

START_TIMEOUT = 30.0
"""Seconds until the monitor reports the exec'd process (guests run under slow emulation)."""

CLOSE_TIMEOUT = 10.0
"""Seconds close() waits for the monitor after killing the process."""

_READ_SIZE = 64 * 1024
_QUEUE_SIZE = 64  # chunks of output held for a slow reader before the process is made to wait
_EOT = b"\x04"  # VEOF: what "end of input" is on a terminal in canonical mode

_Item = tuple[str, bytes] | str  # (stream, data), or the name of a stream that ended


class _Monitor:
    """An exec's monitor (forked by the launcher: not our child) and our ends of its stdio."""

    def __init__(self, pid: int, ticks: int | None) -> None:
        self.pid, self.ticks = pid, ticks
        self.stdin = -1  # our non-blocking write end of its stdin pipe
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.transports: list[asyncio.BaseTransport] = []

    @property
    def alive(self) -> bool:
        return processes.is_alive(self.pid, self.ticks)

    def kill(self) -> None:
        """SIGKILL, with the runtime command it may be running (its process group)."""
        processes.kill_monitor(self.pid, self.ticks)

    async def wait(self) -> None:
        await processes.wait_for_exit(self.pid, self.ticks)

    def close_stdin(self) -> None:
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def close(self) -> None:
        self.close_stdin()
        for transport in self.transports:
            transport.close()


class ExecSession:
    """A process run in a container by :meth:`start`; use as ``async with`` or call close()."""

    def __init__(self, runtime: OciRuntime, container_id: str, tty: bool, work_dir: Path) -> None:
        self.runtime = runtime
        self.container_id = container_id
        self.tty = tty
        self.work_dir = work_dir
        self.pid = 0
        self.ticks: int | None = None
        self._monitor: _Monitor | None = None
        self._master = -1
        self._pidfd = -1
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_SIZE)
        self._open_streams: set[str] = set()
        self._pumps: list[asyncio.Task[None]] = []
        self._reading_master = False
        self._master_eof = False
        self._exit_code: int | None = None
        self._closed = False

    @property
    def exit_path(self) -> Path:
        return self.work_dir / "exit.json"

    # -- start -------------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        runtime: OciRuntime,
        container_id: str,
        process: dict[str, Any],
        tty: bool,
        *,
        stdin: bool = True,
        size: tuple[int, int] | None = None,
        timeout: float = START_TIMEOUT,
        supervisor: Supervisor,
    ) -> ExecSession:
        """Start ``process`` (an OCI process spec: args, env, cwd, user, ...) in a running container.

        ``terminal`` is set from ``tty``. With a terminal, ``size`` (rows, cols) becomes the
        process's ``consoleSize``: the runtime sizes the terminal before the process runs (a
        resize() after start() races with the process reading its size). Without ``stdin`` its
        stdin is /dev/null. ``supervisor`` forks its monitor. Raises OciRuntimeError when the
        runtime cannot start it ("invalid" for a stopped container, "not_found" for an unknown one).
        """
        check_container_id(container_id)
        if tty and size is not None and size[0] > 0 and size[1] > 0:
            process = {**process, "consoleSize": {"height": size[0], "width": size[1]}}
        scratch = runtime.scratch_dir
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        work_dir = Path(tempfile.mkdtemp(prefix="exec-", dir=scratch))
        session = cls(runtime, container_id, tty, work_dir)
        try:
            await session._start(process, stdin, timeout, supervisor)
        except BaseException:
            await session.close()
            raise
        return session

    async def _start(
        self, process: dict[str, Any], stdin: bool, timeout: float, supervisor: Supervisor
    ) -> None:
        work = self.work_dir
        process_file, pid_file, console_path = work / "process.json", work / "exec.pid", work / "console.sock"
        process_file.write_text(json.dumps({**process, "terminal": self.tty}))
        listener: socket.socket | None = None
        if self.tty:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(console_path))
            console_path.chmod(0o600)
            listener.listen(1)
            listener.setblocking(False)
        try:
            spec = MonitorSpec(
                argv=self.runtime.exec_argv(
                    self.container_id, process_file, pid_file, console_path if self.tty else None
                ),
                log_path="",  # pass-through
                exit_path=str(self.exit_path),
                env=list(self.runtime.env),
                subreaper=True,
                pid_file=str(pid_file),
            )
            sync_r = await self._spawn_monitor(supervisor, spec, stdin)
            try:
                with os.fdopen(sync_r, "rb", buffering=0) as pipe:
                    report = await asyncio.wait_for(read_report(pipe), timeout)
            except TimeoutError:
                raise OciRuntimeError(
                    "failed", f"exec in {self.container_id}: the monitor did not report in {timeout:g}s"
                ) from None
            if "error" in report:
                raise await self._start_error(str(report["error"]))
            self.pid = int(report["pid"])
            self.ticks = report.get("start_ticks")
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)
                if not processes.is_alive(self.pid, self.ticks):  # ended (and reaped) meanwhile
                    os.close(self._pidfd)
                    self._pidfd = -1
            if listener is not None:
                self._master = await self._receive_master(listener)
        finally:
            if listener is not None:
                listener.close()
                with contextlib.suppress(OSError):
                    console_path.unlink()
        self._start_pumps()

    async def _spawn_monitor(self, supervisor: Supervisor, spec: MonitorSpec, stdin: bool) -> int:
        """Fork the monitor with pipes to us as its stdio (/dev/null where none is wanted); the
        sync pipe's read end."""
        monitor = self._monitor = _Monitor(0, None)  # close() releases our ends from here on
        with contextlib.ExitStack() as theirs:  # the monitor's ends: closed here once it has them
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            theirs.callback(os.close, null)
            stdin_fd = stdout_fd = null
            if stdin and not self.tty:
                stdin_fd, monitor.stdin = os.pipe()
                theirs.callback(os.close, stdin_fd)
                os.set_blocking(monitor.stdin, False)
            if not self.tty:  # with a terminal, it carries the output
                monitor.stdout, stdout_fd = await self._pipe_reader(monitor)
                theirs.callback(os.close, stdout_fd)
            monitor.stderr, stderr_fd = await self._pipe_reader(monitor)  # also the runtime's errors
            theirs.callback(os.close, stderr_fd)
            pid, ticks, sync_r = await supervisor.spawn(spec, self.work_dir, (stdin_fd, stdout_fd, stderr_fd))
        monitor.pid, monitor.ticks = pid, ticks
        return sync_r

    @staticmethod
    async def _pipe_reader(monitor: _Monitor) -> tuple[asyncio.StreamReader, int]:
        """A pipe whose read end we read through asyncio; its write end, for the monitor."""
        read_end, write_end = os.pipe()
        reader = asyncio.StreamReader(limit=_READ_SIZE)
        try:
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", buffering=0)
            )
        except BaseException:
            os.close(write_end)
            raise
        monitor.transports.append(transport)
        return reader, write_end

    async def _start_error(self, monitor_error: str) -> OciRuntimeError:
        """The monitor could not start the process: the runtime's stderr says why."""
        monitor = self._monitor
        assert monitor is not None
        stderr = b""
        if monitor.stderr is not None:
            with contextlib.suppress(TimeoutError):
                stderr = await asyncio.wait_for(monitor.stderr.read(), 5.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(monitor.wait(), 5.0)
        detail = stderr if stderr.strip() else monitor_error
        return self.runtime.error(f"exec in {self.container_id}", self.container_id, detail)

    async def _receive_master(self, listener: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        try:
            conn, _ = await asyncio.wait_for(loop.sock_accept(listener), CONSOLE_RECEIVE_TIMEOUT)
        except TimeoutError:
            raise OciRuntimeError(
                "failed", f"exec in {self.container_id}: {self.runtime.name} sent no terminal"
            ) from None
        with conn:
            conn.settimeout(CONSOLE_RECEIVE_TIMEOUT)
            try:
                master = await asyncio.to_thread(receive_pty_master, conn)
            except OSError as exc:
                raise OciRuntimeError(
                    "failed", f"exec in {self.container_id}: no terminal from {self.runtime.name}: {exc}"
                ) from None
        os.set_blocking(master, False)
        return master

    def _start_pumps(self) -> None:
        monitor = self._monitor
        assert monitor is not None
        loop = asyncio.get_running_loop()
        if self.tty:
            self._open_streams = {"stdout"}
            loop.add_reader(self._master, self._read_master)
            self._reading_master = True
        else:
            self._open_streams = {"stdout", "stderr"}
            for name, reader in (("stdout", monitor.stdout), ("stderr", monitor.stderr)):
                assert reader is not None
                self._pumps.append(loop.create_task(self._pump(name, reader), name=f"exec {name}"))

    async def _pump(self, name: str, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(_READ_SIZE):
                await self._queue.put((name, data))
        finally:
            with contextlib.suppress(asyncio.QueueFull):  # only when cancelled by close()
                self._queue.put_nowait(name)

    def _read_master(self) -> None:
        if self._queue.full():  # the reader is slow: stop reading until output() catches up
            self._stop_reading_master()
            return
        try:
            data = os.read(self._master, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError:  # EIO: every slave descriptor closed, the terminal's EOF
            data = b""
        if data:
            self._queue.put_nowait(("stdout", data))
            return
        self._stop_reading_master()
        self._master_eof = True
        self._queue.put_nowait("stdout")

    def _resume_reading_master(self) -> None:
        if self.tty and not self._reading_master and not self._master_eof and self._master >= 0:
            asyncio.get_running_loop().add_reader(self._master, self._read_master)
            self._reading_master = True

    def _stop_reading_master(self) -> None:
        if self._reading_master:
            self._reading_master = False
            asyncio.get_running_loop().remove_reader(self._master)

    # -- the session -------------------------------------------------------------------------

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """("stdout" | "stderr", data) until the process and everything holding its output ended.
        A terminal has only "stdout". Iterate it once."""
        while self._open_streams:
            item = await self._queue.get()
            self._resume_reading_master()
            if isinstance(item, str):
                self._open_streams.discard(item)
            else:
                yield item

    async def write_stdin(self, data: bytes) -> None:
        """Send data to the process's stdin (the terminal's input with a tty). Data for a process
        that no longer reads is dropped."""
        if not data:
            return
        if self.tty:
            await self._write_fd(self._master, data)
            return
        if self._monitor is not None and self._monitor.stdin >= 0:
            with contextlib.suppress(BrokenPipeError):
                await self._write_fd(self._monitor.stdin, data)

    async def close_stdin(self) -> None:
        """End of input: the pipe is closed; on a terminal an EOT (^D) is typed instead."""
        if self.tty:
            await self._write_fd(self._master, _EOT)
            return
        if self._monitor is not None:
            self._monitor.close_stdin()

    async def _write_fd(self, fd: int, data: bytes) -> None:
        await write_fd(fd, data)

    def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size (its foreground process group gets SIGWINCH); no-op without one."""
        if self.tty and self._master >= 0 and rows > 0 and cols > 0:
            with contextlib.suppress(OSError):
                set_window_size(self._master, rows, cols)

    async def wait(self) -> int:
        """The exit code, 128 + signal number when killed by a signal."""
        if self._exit_code is not None:
            return self._exit_code
        monitor = self._monitor
        assert monitor is not None
        await monitor.wait()
        record = read_exit_record(self.exit_path)
        if record is None:
            raise OciRuntimeError(
                "failed", f"exec in {self.container_id}: the monitor ended without recording an exit status"
            )
        self._exit_code = record.cri_exit_code
        return self._exit_code

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        """Signal the exec'd process (SIGKILL by default); nothing when it already ended."""
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signals.pidfd_send_signal(self._pidfd, signal)

    # -- cleanup -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Kill the process if it still runs, reap the monitor, close every fd, remove the files."""
        if self._closed:
            return
        self._closed = True
        monitor = self._monitor
        try:
            if monitor is not None:
                if monitor.alive and self.pid <= 0:  # it never reported the process
                    monitor.kill()
                if monitor.alive:
                    await self.kill()
                    try:
                        await asyncio.wait_for(asyncio.shield(monitor.wait()), CLOSE_TIMEOUT)
                    except TimeoutError:
                        monitor.kill()
                        await asyncio.shield(monitor.wait())
        finally:
            for task in self._pumps:
                task.cancel()
            if self._pumps:
                await asyncio.gather(*self._pumps, return_exceptions=True)
            if monitor is not None:
                monitor.close()
            if self._master >= 0:
                self._stop_reading_master()
                os.close(self._master)
                self._master = -1
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
            await asyncio.to_thread(shutil.rmtree, self.work_dir, True)

    async def __aenter__(self) -> ExecSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def write_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking fd (a terminal master, a pipe), waiting while it
    is full. A terminal whose other end is gone (EIO) takes nothing more: the rest is dropped."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view and fd >= 0:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _resolve, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
            continue
        except OSError as exc:
            if exc.errno == errno.EIO:
                return
            raise
        view = view[written:]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
