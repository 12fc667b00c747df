"""The cloud-hypervisor backend: its REST API (HTTP/1.1 over the --api-socket unix socket), via httpx.

Lifecycle, in the API's own terms (openapi/cloud-hypervisor.yaml, /api/v1):
  GET vmm.ping -> PUT vm.create (VmConfig) -> PUT vm.boot -> GET vm.info (state) ...
  graceful stop: PUT vm.power-button (ACPI), wait for the VMM to end or the VM to be "Shutdown";
  forced: PUT vm.shutdown, PUT vm.delete, PUT vmm.shutdown, then SIGKILL if it still runs.

cloud-hypervisor needs KVM: it is chosen only when its binary is installed AND the KVM probe says
guests really run (nested KVM that crawls does not count), and refuses to start otherwise.

httpx rather than requests-unixsocket2: this code runs on the daemon's event loop, and httpx's
AsyncHTTPTransport(uds=...) is natively async with per-request timeouts and cancellation, where
requests would pin a worker thread for every call to a VMM that might hang.

NetConfig carries ``ip``/``mask``: cloud-hypervisor sets them on the tap, and its defaults
(192.168.249.1/24) would otherwise land on the host; we pass exactly the tap's own host address.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from auraed.system import processes
from auraed.system.tasks import run_to_end
from auraed.vms import backend as common
from auraed.vms.backend import ExitInfo, LaunchSpec, VmHandle
from auraed.vms.errors import VmError
from auraed.vms.model import RunInfo

log = logging.getLogger(__name__)

API_SOCKET = "api.sock"
API_BASE = "http://localhost/api/v1"
REQUEST_TIMEOUT = 10.0
CLEANUP_WAIT = 5.0


class ChApiError(Exception):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"cloud-hypervisor {method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


def vm_config(spec: LaunchSpec, console_path: Path, kernel_cmdline: str) -> dict[str, Any]:
    """The VmConfig body of vm.create for a LaunchSpec (pure: checked against the API schema in tests)."""
    payload: dict[str, Any] = {"kernel": spec.kernel, "cmdline": kernel_cmdline}
    if spec.initramfs:
        payload["initramfs"] = spec.initramfs
    config: dict[str, Any] = {
        "payload": payload,
        "cpus": {"boot_vcpus": spec.vcpus, "max_vcpus": spec.vcpus},
        "memory": {"size": spec.memory_mib * 1024 * 1024},
        "serial": {"mode": "File", "file": str(console_path)},
        "console": {"mode": "Off"},
        "rng": {"src": "/dev/urandom"},
    }
    if spec.disks:
        config["disks"] = [
            {"path": d.path, "readonly": not d.writable, "id": f"disk{i}", "serial": d.serial}
            for i, d in enumerate(spec.disks)
        ]
    if spec.net is not None:
        config["net"] = [
            {
                "tap": spec.net.tap,
                "ip": spec.net.host_ip,
                "mask": spec.net.netmask,
                "mac": spec.net.mac,
                "id": "net0",
            }
        ]
    return config


class ChClient:
    """The REST API of one cloud-hypervisor process."""

    def __init__(self, socket: Path | str) -> None:
        self.socket = str(socket)
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url=API_BASE,
            timeout=REQUEST_TIMEOUT,
        )

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http.request(method, f"/{path}", json=body)
        except httpx.HTTPError as exc:
            raise ChApiError(method, path, 0, f"{type(exc).__name__}: {exc}") from None
        if response.status_code >= 300:
            raise ChApiError(method, path, response.status_code, response.text)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    async def ping(self) -> dict[str, Any]:
        return dict(await self._call("GET", "vmm.ping"))

    async def create(self, config: dict[str, Any]) -> None:
        await self._call("PUT", "vm.create", config)

    async def boot(self) -> None:
        await self._call("PUT", "vm.boot")

    async def info(self) -> dict[str, Any]:
        return dict(await self._call("GET", "vm.info"))

    async def power_button(self) -> None:
        await self._call("PUT", "vm.power-button")

    async def shutdown(self) -> None:
        await self._call("PUT", "vm.shutdown")

    async def delete(self) -> None:
        await self._call("PUT", "vm.delete")

    async def shutdown_vmm(self) -> None:
        await self._call("PUT", "vmm.shutdown")

    async def close(self) -> None:
        await self._http.aclose()


class CloudHypervisorBackend:
    name = "cloud-hypervisor"

    def __init__(
        self,
        *,
        binary: str = "cloud-hypervisor",
        kvm_usable: Callable[[], bool] = lambda: False,
        kvm_detail: Callable[[], str] = lambda: "",
    ) -> None:
        self.binary = binary
        self._kvm_usable = kvm_usable
        self._kvm_detail = kvm_detail

    def problem(self) -> str | None:
        if shutil.which(self.binary) is None:
            return f"cloud-hypervisor ({self.binary}) is not installed"
        if not self._kvm_usable():
            detail = self._kvm_detail()
            return "cloud-hypervisor needs KVM, and KVM is not usable on this host" + (
                f" ({detail})" if detail else ""
            )
        return None

    def kernel_args(self) -> list[str]:
        return ["console=ttyS0"]

    def template_problem(self) -> str | None:
        return "guest templates are made with QEMU only (cloud-hypervisor's snapshot/restore is not used yet)"

    def grow_problem(self, run: RunInfo) -> str | None:
        # Its vm.resize needs room set at boot (cpus.max_vcpus, memory.hotplug_size), which cannot
        # be tested without KVM here.
        return "growing a cloud-hypervisor VM is not supported yet (QEMU's q35 machine can grow)"

    async def grow(self, handle: VmHandle, *, vcpus: int, memory_mib: int, shared: bool) -> tuple[int, int]:
        raise VmError.precondition(self.grow_problem(handle.run_info()) or "")

    async def save(self, handle: VmHandle, state_path: Path) -> float:
        raise VmError.precondition(self.template_problem() or "")

    def console_log_path(self, run_dir: Path) -> Path:
        return run_dir / common.CONSOLE_LOG

    async def start(self, spec: LaunchSpec) -> VmHandle:
        problem = self.problem()
        if problem:
            raise VmError.precondition(problem)
        run_dir = spec.run_dir
        socket = run_dir / API_SOCKET
        console = self.console_log_path(run_dir)
        common.remove_quietly(socket)
        # cloud-hypervisor appends to a File serial: start each boot on an empty log.
        console.write_bytes(b"")
        argv = [self.binary, "--api-socket", f"path={socket}"]
        # To completion: a VMM spawned by a thread its caller stopped waiting for would run on.
        process = await run_to_end(asyncio.to_thread(common.spawn, argv, run_dir, (), spec.cgroup_procs))
        client = ChClient(socket)
        handle = VmHandle(
            backend=self.name,
            pid=process.pid,
            start_ticks=processes.start_ticks(process.pid),
            control_socket=socket,
            console_path=console,
            accelerator="kvm",
            process=process,
            client=client,
        )
        try:
            await self._wait_api(handle, spec.timeout)
            cmdline = " ".join([*self.kernel_args(), spec.cmdline]).strip()
            await client.create(vm_config(spec, console, cmdline))
            await client.boot()
            state = await self.status(handle)
            if state != "running":
                raise VmError.internal(f"cloud-hypervisor reports the new VM {state!r}, not running")
        except ChApiError as exc:
            await self.kill(handle)
            raise VmError.precondition(f"{exc}; VMM log: {common.vmm_log_tail(run_dir) or 'empty'}") from None
        except BaseException:
            await run_to_end(self.kill(handle))
            raise
        return handle

    async def _wait_api(self, handle: VmHandle, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client: ChClient = handle.client
        while True:
            if handle.process is not None and handle.process.poll() is not None:
                detail = common.vmm_log_tail(handle.control_socket.parent) or "no output"
                raise VmError.precondition(f"cloud-hypervisor ended at start: {detail}")
            if handle.control_socket.exists():
                try:
                    await client.ping()
                    return
                except ChApiError:
                    pass
            if time.monotonic() > deadline:
                raise VmError.deadline(f"cloud-hypervisor's API did not answer within {timeout:g} s")
            await asyncio.sleep(0.02)

    async def status(self, handle: VmHandle) -> str:
        client: ChClient = handle.client
        info = await client.info()
        return str(info.get("state", "unknown")).lower()

    async def _shut_down_or_ended(self, handle: VmHandle, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await common.wait_exit(handle, min(0.2, max(0.0, deadline - time.monotonic()))):
                return True
            try:
                if await self.status(handle) == "shutdown":
                    return True
            except ChApiError:
                pass
        return False

    async def shutdown(self, handle: VmHandle, timeout: float) -> bool:
        client: ChClient = handle.client
        graceful = False
        if timeout > 0:
            try:
                await client.power_button()
                graceful = await self._shut_down_or_ended(handle, timeout)
            except ChApiError as exc:
                log.warning("cloud-hypervisor %s: vm.power-button: %s", handle.control_socket, exc)
        if not graceful:
            await self._quietly(client.shutdown)
        if handle.alive:
            await self._quietly(client.delete)
            await self._quietly(client.shutdown_vmm)
        if not await common.wait_exit(handle, CLEANUP_WAIT):
            await self.kill(handle)
        await client.close()
        return graceful

    @staticmethod
    async def _quietly(call: Callable[[], Any]) -> None:
        try:
            await call()
        except ChApiError as exc:
            log.debug("cloud-hypervisor: %s", exc)

    async def kill(self, handle: VmHandle) -> None:
        await common.kill(handle)
        await self.close(handle)

    async def wait(self, handle: VmHandle) -> ExitInfo:
        await common.wait_exit(handle)
        code, sig = common.exit_of(handle.process)
        if sig is not None:
            return ExitInfo(code, sig, False, f"cloud-hypervisor killed by signal {sig}")
        if code is not None:
            return ExitInfo(code, None, None, f"cloud-hypervisor exited with code {code}")
        return ExitInfo(None, None, None, "cloud-hypervisor ended")

    def reattach(self, run: RunInfo) -> VmHandle | None:
        return common.reattach(self.name, run, ChClient)

    async def close(self, handle: VmHandle) -> None:
        client: ChClient = handle.client
        await client.close()
