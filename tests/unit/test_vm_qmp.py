"""The QMP client and QEMU's stop logic against a fake QMP server speaking the real protocol.

The fake's "VMM" is a real process (sleep), so the backend's pidfd waits and kills are the real
ones; what the guest would do on system_powerdown is scripted per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.system import processes
from auraed.vms import backend as common
from auraed.vms.backend import VmHandle
from auraed.vms.qemu import QemuBackend
from auraed.vms.qmp import QmpClient, QmpError

GREETING = {
    "QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": []}
}


class FakeQmp:
    """One QMP server: greets, demands qmp_capabilities first, answers by id, emits events."""

    def __init__(self, path: Path, vmm: subprocess.Popen[bytes] | None = None) -> None:
        self.path = path
        self.vmm = vmm
        self.received: list[dict[str, Any]] = []
        self.powerdown_powers_off = True
        self.status = "running"
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> FakeQmp:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(json.dumps(message).encode() + b"\r\n")
        await writer.drain()

    async def _event(self, writer: asyncio.StreamWriter, name: str, data: dict[str, Any]) -> None:
        now = time.time()
        stamp = {"seconds": int(now), "microseconds": int(now % 1 * 1e6)}
        await self._send(writer, {"event": name, "data": data, "timestamp": stamp})

    async def _end_vmm(self, writer: asyncio.StreamWriter, guest: bool, reason: str) -> None:
        await self._event(writer, "SHUTDOWN", {"guest": guest, "reason": reason})
        writer.close()
        if self.vmm is not None:
            self.vmm.terminate()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        await self._send(writer, GREETING)
        negotiated = False
        while line := await reader.readline():
            message = json.loads(line)
            self.received.append(message)
            command, ident = message.get("execute"), message.get("id")

            async def reply(value: Any, ident: Any = ident) -> None:
                await self._send(writer, {"return": value, "id": ident})

            async def error(cls: str, desc: str, ident: Any = ident) -> None:
                await self._send(writer, {"error": {"class": cls, "desc": desc}, "id": ident})

            if command == "qmp_capabilities":
                negotiated = True
                await reply({})
            elif not negotiated:
                await error("CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'")
            elif command == "query-status":
                await reply({"status": self.status, "singlestep": False, "running": self.status == "running"})
            elif command == "system_powerdown":
                await reply({})
                await self._event(writer, "POWERDOWN", {})
                if self.powerdown_powers_off:
                    await self._end_vmm(writer, True, "guest-shutdown")
                    return
            elif command == "quit":
                await reply({})
                await self._end_vmm(writer, False, "host-qmp-quit")
                return
            else:
                await error("CommandNotFound", f"The command {command} has not been found")


@pytest.fixture
def vmm() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield process
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait()


def handle_for(process: subprocess.Popen[bytes], socket: Path) -> VmHandle:
    return VmHandle(
        backend="qemu",
        pid=process.pid,
        start_ticks=processes.start_ticks(process.pid),
        control_socket=socket,
        console_path=socket.parent / "console.log",
        accelerator="tcg",
        process=process,
        client=QmpClient(socket),
    )


async def test_commands_errors_and_events(tmp_path: Path) -> None:
    path = tmp_path / "qmp.sock"
    async with FakeQmp(path) as fake:
        client = QmpClient(path)
        await client.connect()
        assert client.greeting["version"]["qemu"]["major"] == 7
        assert fake.received[0]["execute"] == "qmp_capabilities"
        assert await client.execute("query-status") == {
            "status": "running",
            "singlestep": False,
            "running": True,
        }
        fake.status = "paused"
        assert (await client.execute("query-status"))["status"] == "paused"
        with pytest.raises(QmpError) as caught:
            await client.execute("no-such-command")
        assert caught.value.error_class == "CommandNotFound"
        ids = [m["id"] for m in fake.received]
        assert len(set(ids)) == len(ids)
        await client.execute("quit")
        await asyncio.wait_for(client.wait_closed(), 5)
        assert client.shutdown_event == {"guest": False, "reason": "host-qmp-quit"}
        assert not client.connected
        with pytest.raises(QmpError, match="not connected"):
            await client.execute("query-status")
        await client.close()


async def test_close_while_another_close_is_cancelled(tmp_path: Path) -> None:
    # As when a VM's watcher is cancelled in the middle of closing its QMP client and the daemon
    # then closes the same client: the second close must not inherit the first one's cancellation.
    path = tmp_path / "qmp.sock"
    async with FakeQmp(path):
        client = QmpClient(path)
        await client.connect()
        first = asyncio.create_task(client.close())
        await asyncio.sleep(0)  # the first close now waits for the connection to be closed
        first.cancel()
        await client.close()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert not client.connected


async def test_connect_failures(tmp_path: Path) -> None:
    with pytest.raises(QmpError, match="cannot connect"):
        await QmpClient(tmp_path / "absent.sock").connect(timeout=1)
    path = tmp_path / "mute.sock"

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'{"hello": 1}\n')
        await writer.drain()

    server = await asyncio.start_unix_server(mute, path=str(path))
    async with server:
        with pytest.raises(QmpError, match="greeting"):
            await QmpClient(path).connect(timeout=1)


async def test_graceful_stop(tmp_path: Path, vmm: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "qmp.sock"
    async with FakeQmp(path, vmm) as fake:
        backend = QemuBackend()
        handle = handle_for(vmm, path)
        assert await backend.status(handle) == "running"
        waiter = asyncio.ensure_future(backend.wait(handle))
        started = time.monotonic()
        assert await backend.shutdown(handle, timeout=10) is True
        assert time.monotonic() - started < 5
        info = await asyncio.wait_for(waiter, 5)
        assert [m["execute"] for m in fake.received] == [
            "qmp_capabilities",
            "query-status",
            "system_powerdown",
        ]
    # A SIGTERMed process: the fake VMM ended by the signal, but the guest's SHUTDOWN came first.
    assert info.guest_initiated is True
    assert info.detail == "the guest powered off"
    assert not handle.alive


async def test_forced_stop_after_timeout(tmp_path: Path, vmm: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "qmp.sock"
    async with FakeQmp(path, vmm) as fake:
        fake.powerdown_powers_off = False  # a guest that ignores the power button
        backend = QemuBackend()
        handle = handle_for(vmm, path)
        started = time.monotonic()
        assert await backend.shutdown(handle, timeout=1.0) is False
        assert 1.0 <= time.monotonic() - started < 8
        assert [m["execute"] for m in fake.received] == ["qmp_capabilities", "system_powerdown", "quit"]
    assert vmm.poll() == -signal.SIGTERM
    assert not handle.alive


async def test_stop_kills_a_vmm_whose_qmp_is_gone(tmp_path: Path, vmm: subprocess.Popen[bytes]) -> None:
    backend = QemuBackend()
    handle = handle_for(vmm, tmp_path / "absent.sock")
    started = time.monotonic()
    assert await backend.shutdown(handle, timeout=0.5) is False
    assert time.monotonic() - started < 10
    assert vmm.poll() == -signal.SIGKILL
    info = await backend.wait(handle)
    assert (info.signal, info.guest_initiated) == (signal.SIGKILL, False)
    assert "signal 9" in info.detail


def test_processes_referencing_a_run_directory(tmp_path: Path) -> None:
    web, web2 = tmp_path / "vms" / "web", tmp_path / "vms" / "web2"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]  # one process, no forks
    started = [
        subprocess.Popen([*sleeper, f"unix:{web}/qmp.sock,server=on"]),
        subprocess.Popen([*sleeper, str(web)]),
        subprocess.Popen([*sleeper, f"{web2}/console.log"]),
    ]
    # Right after exec the kernel may not have set a new process's arguments yet: wait for them.
    deadline = time.monotonic() + 5
    while (
        any(not Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in started) and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    try:
        assert sorted(common.processes_referencing(web)) == sorted(p.pid for p in started[:2])
        assert sorted(common.kill_processes_referencing(web)) == sorted(p.pid for p in started[:2])
        assert all(p.wait(timeout=5) is not None for p in started[:2])
        assert started[2].poll() is None
        assert common.processes_referencing(web2) == [started[2].pid]
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
