"""The debug console for real: a daemon with vm_debug_console on boots a guest (QEMU, TCG here)
and DebugShell runs commands in busybox sh, which the guest's PID 1 started on the debug port.

One guest boot. Through the daemon's own mTLS socket and its authorization: the shell computes
$((6*7)) and names PID 1; ``exit 7`` ends the session with 7; the next session gets a new shell
while a second one at the same time is refused; an identity not allowed the method gets
PERMISSION_DENIED; the log names each session's caller and VM, never what was typed. A daemon with
the setting off refuses the call naming it. Nothing is left (the fixtures and hack/check-leaks).

One more: with the setting on, the host's ``auto`` template is made with the debug port (its
listing says so) and a clone of it has its own, in its own run dir: the shell runs in the clone
(its hostname, not the template's), computes, and ends with its exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from auraed.api.aurae.vms import v0 as vms
from auraed.client.client import AuraeClient, ClientError, client_config_text
from auraed.pki import PkiPaths
from auraed.vms.backend import DEBUG_SOCKET
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.test_vms import NO_POD_TEMPLATE, guest_host_args

pytestmark = pytest.mark.slow

VMS = "aurae.vms.v0.VmService"
BOOT_TIMEOUT_MS = 300_000
READ_TIMEOUT = 60.0
POLICY = """
vm_debug_console = true
[authorization]
default = []
[authorization.identities]
"aurae-client" = ["*"]
"reader" = ["aurae.vms.v0.VmService/List", "aurae.vms.v0.VmService/GetConsole", "grpc.health.v1.Health/*"]
"""

Request = vms.VmServiceDebugShellRequest


class Shell:
    """One DebugShell call: input queued, output collected as it comes."""

    def __init__(self, client: AuraeClient, name: str) -> None:
        self.queue: asyncio.Queue[Request | None] = asyncio.Queue()
        self.queue.put_nowait(Request(name=name, size=vms.TerminalSize(rows=40, columns=120)))
        self.output = b""
        self.exit_code: int | None = None
        self.replies = client.duplex(VMS, "DebugShell", self._requests(), timeout=None)
        self.task = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[Request]:
        while (request := await self.queue.get()) is not None:
            yield request

    async def _read(self) -> None:
        async for reply in self.replies:
            self.output += reply.output
            if reply.exit_code is not None:
                self.exit_code = reply.exit_code

    def type(self, text: str) -> None:
        self.queue.put_nowait(Request(input=text.encode()))

    async def lines_until(self, pattern: str) -> list[str]:
        deadline = time.monotonic() + READ_TIMEOUT
        while not re.search(pattern, self.output.decode(errors="replace"), re.MULTILINE):
            if self.task.done():
                self.task.result()
                raise AssertionError(f"the session ended before {pattern!r}: {self.output!r}")
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.output!r}"
            await asyncio.sleep(0.05)
        return self.output.decode(errors="replace").replace("\r", "").split("\n")

    async def close(self) -> None:
        self.queue.put_nowait(None)
        async with asyncio.timeout(READ_TIMEOUT):
            with contextlib.suppress(ClientError):
                await self.task


async def refused(client: AuraeClient, name: str) -> ClientError:
    shell = Shell(client, name)
    with pytest.raises(ClientError) as error:
        async with asyncio.timeout(READ_TIMEOUT):
            await shell.task
    return error.value


async def free_every_vm(daemon: DaemonProcess) -> None:
    """Every VM freed, then every template removed."""
    async with daemon.client() as aurae:
        for status in (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms:
            await aurae.call(VMS, "Free", vms.VmServiceFreeRequest(name=status.vm.name, timeout_ms=0))
        listing = await aurae.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())
        for template in listing.templates:
            assert template.template is not None
            request = vms.VmServiceRemoveTemplateRequest(name=template.template.name)
            await aurae.call(VMS, "RemoveTemplate", request, timeout=60)


PROMPT = b"debug# "
"""The guest shell's prompt (its PS1), as it reaches a terminal."""


def on_a_terminal(argv: list[str]) -> int:
    """aer on a pty of ours, as a person would run it: raw mode while it runs (^C a key for the
    guest), the terminal's modes as they were once it ends; its exit status."""
    master, slave = os.openpty()
    try:
        before = termios.tcgetattr(slave)
        process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        output = b""
        deadline = time.monotonic() + READ_TIMEOUT
        # Each key once the shell is ready for it: typed before, a ^C could reach a shell not yet
        # handling SIGINT, and the line after it be flushed with the interrupted input.
        steps: list[tuple[Callable[[], bool], bytes]] = [
            (lambda: output.count(PROMPT) >= 1, b"sleep 30\r"),
            (lambda: b"sleep 30" in output, b"\x03"),
            (lambda: output.count(PROMPT) >= 2, b"echo $((6*7)); exit 5\r"),  # prompted again
        ]
        while process.poll() is None:
            assert time.monotonic() < deadline, output
            if select.select([master], [], [], 0.1)[0]:
                output += os.read(master, 65536)
            raw = not termios.tcgetattr(slave)[3] & termios.ICANON  # aer is up
            if raw and steps and steps[0][0]():
                if steps[0][1] == b"\x03":
                    time.sleep(1.0)  # the sleep has started in the guest
                os.write(master, steps.pop(0)[1])
        # What aer wrote just before it ended is still to be read (it raced the loop's last poll).
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave end closed
                break
            if not chunk:
                break
            output += chunk
        assert b"42" in output, output
        assert termios.tcgetattr(slave) == before
        return process.returncode
    finally:
        os.close(master)
        os.close(slave)


async def check_aer(daemon: DaemonProcess) -> None:
    """aer, its stdin a pipe: sent as typed, its end as ^D; aer ends with the shell's status."""
    crt, key = daemon.pki.clients["aurae-client"]
    config = daemon.root / "aer-config"
    config.write_text(client_config_text(daemon.pki.ca_crt, crt, key, daemon.socket))
    aer = [sys.executable, "-m", "auraed.aer", "--config", str(config), "vm", "console", "g1"]
    shell_run = await asyncio.to_thread(
        subprocess.run, [*aer, "--shell"], input="echo $((6*7)); exit 3\n", capture_output=True,
        text=True, timeout=READ_TIMEOUT,
    )  # fmt: skip
    assert shell_run.returncode == 3, shell_run.stderr
    assert "42" in shell_run.stdout.replace("\r", "").split("\n"), shell_run.stdout
    assert await asyncio.to_thread(on_a_terminal, [*aer, "--shell"]) == 5
    plain = await asyncio.to_thread(
        subprocess.run, [*aer, "--tail", "3"], capture_output=True, text=True, timeout=READ_TIMEOUT
    )
    assert plain.returncode == 0 and plain.stdout.strip(), plain  # unchanged without --shell


def check_log(log: str) -> None:
    """Each session named with its caller and VM, the refusal too; never what was typed."""
    assert "debug shell on VM g1 opened for aurae-client" in log
    closed = r"debug shell on VM g1 closed for aurae-client after .* the shell exited with 7"
    assert re.search(closed, log)
    assert "refused /aurae.vms.v0.VmService/DebugShell for identity reader" in log
    assert "6*7" not in log and "new:$$" not in log


async def test_a_debug_shell_in_a_guest_authorized_logged_and_off_by_default(
    daemon_factory: DaemonFactory, guest_image: Path
) -> None:
    off = daemon_factory(config_text="", name="off")
    async with off.client() as aurae:
        error = await refused(aurae, "g1")
    assert error.code == "FAILED_PRECONDITION" and "vm_debug_console" in error.message
    off.stop()

    daemon = daemon_factory(
        *guest_host_args(guest_image, off.pki.ca_key), *NO_POD_TEMPLATE, config_text=POLICY, name="dbg"
    )
    try:
        async with daemon.client() as aurae:
            vm = vms.VirtualMachine(name="g1", role="guest", memory_mib=512)
            await aurae.call(VMS, "Allocate", vms.VmServiceAllocateRequest(vm=vm))
            error = await refused(aurae, "g1")  # allocated, not running
            assert error.code == "FAILED_PRECONDITION" and "running" in error.message
            started = time.monotonic()
            reply = await aurae.call(
                VMS, "Start", vms.VmServiceStartRequest(name="g1", timeout_ms=BOOT_TIMEOUT_MS),
                timeout=BOOT_TIMEOUT_MS / 1000 + 60,
            )  # fmt: skip
            print(f"\nguest serving {time.monotonic() - started:.1f} s after Start")
            run_dir = Path(reply.status.console_path).parent
            assert (run_dir / DEBUG_SOCKET).exists()

            opened = time.monotonic()
            shell = Shell(aurae, "g1")
            shell.type("echo $((6*7)); cat /proc/1/comm\n")
            lines = await shell.lines_until(r"^python3\r?$")
            print(f"first answer {time.monotonic() - opened:.2f} s after the session opened")
            assert "42" in lines and "python3" in lines, lines
            shell.type("exit 7\n")
            async with asyncio.timeout(READ_TIMEOUT):
                await shell.task
            assert shell.exit_code == 7

            again = Shell(aurae, "g1")
            again.type("echo new:$$; stty size\n")
            await again.lines_until(r"^new:\d+")
            assert "40 120" in await again.lines_until(r"^40 120\r?$")  # the size the session opened with
            again.queue.put_nowait(Request(size=vms.TerminalSize(rows=33, columns=99)))
            again.type("stty size\n")
            await again.lines_until(r"^33 99\r?$")  # a resize reaches the guest's pty
            error = await refused(aurae, "g1")
            assert error.code == "FAILED_PRECONDITION" and "open already" in error.message
            await again.close()  # the call ends; the guest hangs its shell up
            assert again.exit_code is None

        await check_aer(daemon)

        async with daemon.client("reader") as reader:
            assert (await reader.call(VMS, "List", vms.VmServiceListRequest())).vms
            error = await refused(reader, "g1")
            assert error.code == "PERMISSION_DENIED" and "DebugShell" in error.message

        check_log(daemon.log())
        await free_every_vm(daemon)
        assert not run_dir.exists()
    finally:
        with contextlib.suppress(Exception):
            await free_every_vm(daemon)


async def test_a_clone_of_a_template_made_with_the_debug_console_has_its_own_shell(
    daemon_factory: DaemonFactory, guest_image: Path, pki: PkiPaths
) -> None:
    daemon = daemon_factory(
        *guest_host_args(guest_image, pki.ca_key), *NO_POD_TEMPLATE, config_text=POLICY, name="dbt"
    )
    try:
        async with daemon.client() as aurae:
            vm = vms.VirtualMachine(name="c1", role="guest", memory_mib=384, template="auto")
            await aurae.call(VMS, "Allocate", vms.VmServiceAllocateRequest(vm=vm))
            started = time.monotonic()
            request = vms.VmServiceStartRequest(name="c1", timeout_ms=BOOT_TIMEOUT_MS)
            reply = await aurae.call(VMS, "Start", request, timeout=BOOT_TIMEOUT_MS / 1000 + 60)
            print(f"\ntemplate made and clone serving {time.monotonic() - started:.1f} s after Start")
            assert reply.status.template.startswith("auto-"), reply.status
            listing = await aurae.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())
            (template,) = listing.templates
            assert template.debug_console and template.clones == ["c1"], template
            run_dir = Path(reply.status.console_path).parent
            assert (run_dir / DEBUG_SOCKET).exists()  # the clone's own, in its own run dir

            shell = Shell(aurae, "c1")
            shell.type("hostname; echo $((6*7)); exit 4\n")
            async with asyncio.timeout(READ_TIMEOUT):
                await shell.task
            lines = shell.output.decode(errors="replace").replace("\r", "").split("\n")
            assert "c1" in lines and "42" in lines, lines  # the clone's hostname, not the template's
            assert not any(line.startswith("template-") for line in lines), lines
            assert shell.exit_code == 4
        log = daemon.log()
        assert "debug shell on VM c1 opened for aurae-client" in log
        await free_every_vm(daemon)
        assert not run_dir.exists()
    finally:
        with contextlib.suppress(Exception):
            await free_every_vm(daemon)
