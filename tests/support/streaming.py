"""A StreamingBackend of real processes on the host: exec runs its argv, attach joins a process the
test started, port-forward dials a TCP port on 127.0.0.1. With a tty the process gets a real
pseudo-terminal (resizes set its window size)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import signal

from auraed.cri.streaming.backend import AttachRequest, ExecRequest, TerminalSize
from auraed.errors import AuraeError
from auraed.system.pty import set_window_size


class StreamSink:
    """A ByteSink over an asyncio subprocess pipe."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


class PtyMaster:
    """Both ends of a pty master as ByteSource and ByteSink; EIO (the child side gone) reads as EOF."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)

    async def _ready(self, add: str, remove: str) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        getattr(loop, add)(self.fd, wake)
        try:
            await ready
        finally:
            getattr(loop, remove)(self.fd)

    async def read(self, n: int = -1) -> bytes:
        while True:
            try:
                return os.read(self.fd, n if n > 0 else 65536)
            except BlockingIOError:
                await self._ready("add_reader", "remove_reader")
            except OSError as exc:
                if exc.errno == errno.EIO:
                    return b""
                raise

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                await self._ready("add_writer", "remove_writer")

    async def close(self) -> None:
        await self.write(b"\x04")  # a terminal's end of input is ^D


@dataclasses.dataclass
class ProcessStreams:
    """A ProcessSession over a subprocess. ``owned``: close() kills it (exec); else it detaches."""

    process: asyncio.subprocess.Process
    stdin: StreamSink | PtyMaster | None
    stdout: asyncio.StreamReader | PtyMaster | None
    stderr: asyncio.StreamReader | None
    owned: bool
    pty: PtyMaster | None = None
    closed: bool = False

    async def resize(self, size: TerminalSize) -> None:
        if self.pty is not None:
            set_window_size(self.pty.fd, size.height, size.width)

    async def wait(self) -> int:
        code = await self.process.wait()
        return code if code >= 0 else 128 - code

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.owned and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        if self.owned and self.pty is not None:
            os.close(self.pty.fd)


async def start_process(
    argv: tuple[str, ...], *, tty: bool, stdin: bool, stdout: bool, stderr: bool, owned: bool
) -> ProcessStreams:
    if tty:
        master, slave = os.openpty()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
            )
        finally:
            os.close(slave)
        pty = PtyMaster(master)
        return ProcessStreams(process, pty if stdin else None, pty, None, owned, pty)
    pipe, devnull = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=pipe if stdin else devnull,
        stdout=pipe if stdout else devnull,
        stderr=pipe if stderr else devnull,
        start_new_session=True,
    )
    sink = StreamSink(process.stdin) if process.stdin is not None else None
    return ProcessStreams(process, sink, process.stdout, process.stderr, owned)


class ProcessBackend:
    """Exec runs ``cmd`` on the host; attach joins a "container" registered with ``run_container``."""

    def __init__(self) -> None:
        self.containers: dict[str, ProcessStreams] = {}
        self.sessions: list[ProcessStreams] = []
        self.dialed: list[int] = []

    async def run_container(
        self, container_id: str, argv: tuple[str, ...], *, tty: bool = False
    ) -> ProcessStreams:
        streams = await start_process(argv, tty=tty, stdin=True, stdout=True, stderr=not tty, owned=True)
        self.containers[container_id] = streams
        return streams

    async def exec(self, request: ExecRequest) -> ProcessStreams:
        if request.container_id not in self.containers and request.container_id != "host":
            raise AuraeError.not_found(f"container {request.container_id!r}")
        session = await start_process(
            request.cmd,
            tty=request.tty,
            stdin=request.stdin,
            stdout=request.stdout,
            stderr=request.stderr,
            owned=True,
        )
        self.sessions.append(session)
        return session

    async def attach(self, request: AttachRequest) -> ProcessStreams:
        container = self.containers.get(request.container_id)
        if container is None:
            raise AuraeError.not_found(f"container {request.container_id!r}")
        return ProcessStreams(
            container.process,
            container.stdin if request.stdin else None,
            container.stdout if request.stdout else None,
            container.stderr if request.stderr else None,
            owned=False,
            pty=container.pty,
        )

    async def dial(self, pod_sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.dialed.append(port)
        return await asyncio.open_connection("127.0.0.1", port)

    async def close(self) -> None:
        for streams in [*self.containers.values(), *self.sessions]:
            await streams.close()
