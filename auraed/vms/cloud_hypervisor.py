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

Templates and clones (vms/templates.py), in the API's terms:
  template: vm.create + vm.boot as any VM, then (the guest ready) vm.pause and vm.snapshot
    (VmSnapshotConfig ``destination_url`` ``file://<build>/state``: cloud-hypervisor writes its
    config.json, state.json and memory-ranges there); ``<build>/memory`` is a hard link to
    memory-ranges (the template's RAM, as with QEMU). The VMM is left paused and then killed.
  clone: a new process with ``--api-socket`` only (no boot config), vm.restore (RestoreConfig
    ``source_url`` ``file://<template build>/state``, ``memory_restore_mode`` OnDemand), vm.resume,
    then vm.add-net: its own tap, address and MAC.
What the published RestoreConfig allows is source_url, prefault, memory_restore_mode (Copy,
OnDemand, CopyOnWrite), resume and zone_updates: nothing changes a restored VM's devices. So a
template has no NIC (cloud-hypervisor's NIC needs a tap, and one made for it would get the
192.168.249.1/24 default), and each clone's NIC is hotplugged after its resume (NetConfig, as at
vm.create; the guest's identity waits for eth0). The files each VM has for itself (its serial log,
its identity socket) are named relative to the VMM's working directory, its run directory: the
snapshot's config names ``console.log`` and ``identity.sock``, and every clone opens its own.
The identity port is vsock (cloud-hypervisor has no virtio-serial; its virtio-console has one
unnamed port and refuses Socket mode: NoSocketOptionSupportForConsoleDevice): the guest listens on
port IDENTITY_VSOCK_PORT, the host connects to ``identity.sock`` (cloud-hypervisor's hybrid vsock:
``CONNECT <port>``, answered ``OK <port>``): once the template is booted, and once each clone is
resumed (a connection does not survive a snapshot; the guest takes its identity on a new one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from auraed.system import processes
from auraed.system.tasks import run_to_end
from auraed.vms import backend as common
from auraed.vms.backend import ExitInfo, LaunchNet, LaunchSpec, Room, VmHandle
from auraed.vms.errors import VmError
from auraed.vms.model import RunInfo

log = logging.getLogger(__name__)

API_SOCKET = "api.sock"
API_BASE = "http://localhost/api/v1"
REQUEST_TIMEOUT = 10.0
CLEANUP_WAIT = 5.0
SNAPSHOT_TIMEOUT = 60.0  # vm.snapshot writes all of the guest's RAM
MEMORY_RANGES = "memory-ranges"  # the RAM in a snapshot directory
# Pages read from the snapshot as the clone touches them (userfaultfd); CopyOnWrite would map the
# file private, as QEMU's clones do, but is untested without KVM.
MEMORY_RESTORE_MODE = "OnDemand"
# The identity port on cloud-hypervisor: vsock, the guest's CID and the port it listens on.
GUEST_CID = 3
IDENTITY_VSOCK_PORT = 1024
IDENTITY_PORT_ARG = f"auraed.identity_port=vsock:{IDENTITY_VSOCK_PORT}"
IDENTITY_VSOCK_PROBLEM = (
    "guest templates on cloud-hypervisor need the guest to take its identity over vsock (listening "
    f"on port {IDENTITY_VSOCK_PORT}): cloud-hypervisor has no virtio-serial, and the guest image's "
    "auraed looks for a virtio-serial port named org.aurae.identity"
)


class ChApiError(Exception):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"cloud-hypervisor {method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


def vm_config(spec: LaunchSpec, console_path: Path, kernel_cmdline: str) -> dict[str, Any]:
    """The VmConfig body of vm.create for a LaunchSpec (pure: checked against the API schema in tests).

    A template's (``spec.image``) names its serial log and identity socket relative to the VMM's
    working directory (its clones restore this config in theirs) and has no NIC (see the module).
    """
    template = spec.image is not None
    payload: dict[str, Any] = {"kernel": spec.kernel, "cmdline": kernel_cmdline}
    if spec.initramfs:
        payload["initramfs"] = spec.initramfs
    config: dict[str, Any] = {
        "payload": payload,
        "cpus": {"boot_vcpus": spec.vcpus, "max_vcpus": spec.vcpus},
        "memory": {"size": spec.memory_mib * 1024 * 1024},
        "serial": {"mode": "File", "file": console_path.name if template else str(console_path)},
        "console": {"mode": "Off"},
        "rng": {"src": "/dev/urandom"},
    }
    if template:
        config["vsock"] = {"cid": GUEST_CID, "socket": common.IDENTITY_SOCKET}
    if spec.disks:
        config["disks"] = [
            {"path": d.path, "readonly": not d.writable, "id": f"disk{i}", "serial": d.serial}
            for i, d in enumerate(spec.disks)
        ]
    if spec.net is not None and not template:
        config["net"] = [net_config(spec.net)]
    return config


def net_config(net: LaunchNet) -> dict[str, Any]:
    """A NetConfig (vm.create's ``net`` entry, or vm.add-net's body for a clone)."""
    return {"tap": net.tap, "ip": net.host_ip, "mask": net.netmask, "mac": net.mac, "id": "net0"}


def snapshot_config(state_dir: Path) -> dict[str, Any]:
    """vm.snapshot's VmSnapshotConfig: the directory cloud-hypervisor writes the snapshot into."""
    return {"destination_url": f"file://{state_dir}"}


def restore_config(state_dir: Path) -> dict[str, Any]:
    """vm.restore's RestoreConfig for a clone of the snapshot in ``state_dir``; resumed by its own
    vm.resume (``resume`` left out), so that a failed restore is told from a failed resume."""
    return {"source_url": f"file://{state_dir}", "memory_restore_mode": MEMORY_RESTORE_MODE}


class ChClient:
    """The REST API of one cloud-hypervisor process."""

    def __init__(self, socket: Path | str) -> None:
        self.socket = str(socket)
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url=API_BASE,
            timeout=REQUEST_TIMEOUT,
        )

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT
    ) -> Any:
        try:
            response = await self._http.request(method, f"/{path}", json=body, timeout=timeout)
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

    async def pause(self) -> None:
        await self._call("PUT", "vm.pause")

    async def resume(self) -> None:
        await self._call("PUT", "vm.resume")

    async def snapshot(self, config: dict[str, Any]) -> None:
        await self._call("PUT", "vm.snapshot", config, timeout=SNAPSHOT_TIMEOUT)

    async def restore(self, config: dict[str, Any]) -> None:
        await self._call("PUT", "vm.restore", config, timeout=SNAPSHOT_TIMEOUT)

    async def add_net(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Hotplug a NIC: its PciDeviceInfo (200), or None when cold-added (204)."""
        answer = await self._call("PUT", "vm.add-net", config)
        return dict(answer) if answer else None

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
        identity_vsock: bool = False,
    ) -> None:
        self.binary = binary
        self._kvm_usable = kvm_usable
        self._kvm_detail = kvm_detail
        # Whether the guests booted here take their identity over vsock (IDENTITY_PORT_ARG); until
        # the guest image's auraed does, templates are refused (guests then boot cold).
        self.identity_vsock = identity_vsock

    def problem(self) -> str | None:
        if shutil.which(self.binary) is None:
            return f"cloud-hypervisor ({self.binary}) is not installed"
        if not self._kvm_usable():
            detail = self._kvm_detail()
            return "cloud-hypervisor needs KVM, and KVM is not usable on this host" + (
                f" ({detail})" if detail else ""
            )
        return None

    def kernel_args(self, machine: str = "") -> list[str]:
        return ["console=ttyS0"]

    def machine_of(self, requested: str) -> str:
        return ""  # one machine: cloud-hypervisor's own

    def template_room(self, machine: str) -> Room | None:
        return None  # its clones are their template's shape (growing needs room set at boot)

    def template_problem(self) -> str | None:
        problem = self.problem()
        if problem:
            return problem
        if not self.identity_vsock:
            return IDENTITY_VSOCK_PROBLEM
        return None

    @staticmethod
    def launch_problem(spec: LaunchSpec) -> str | None:
        """Why ``spec`` cannot be started here (None: it can)."""
        if spec.image is None:
            return None
        if spec.shared_dir:
            return "a template or a clone cannot have a shared directory on cloud-hypervisor"
        if spec.image.clone and spec.net is not None and spec.net.netns:
            # vm.add-net opens the tap by name in the VMM's namespace (one of that name would be
            # made on the host); handing it the tap's fd is not in the published API.
            return (
                "a clone's tap in a pod's network namespace cannot be given to cloud-hypervisor: "
                "vm.add-net opens a tap by name in the VMM's own namespace"
            )
        return None

    def grow_problem(self, run: RunInfo) -> str | None:
        # Its vm.resize needs room set at boot (cpus.max_vcpus, memory.hotplug_size), which cannot
        # be tested without KVM here.
        return "growing a cloud-hypervisor VM is not supported yet (QEMU's q35 machine can grow)"

    async def grow(self, handle: VmHandle, *, vcpus: int, memory_mib: int, shared: bool) -> tuple[int, int]:
        raise VmError.precondition(self.grow_problem(handle.run_info()) or "")

    async def save(self, handle: VmHandle, state_path: Path) -> float:
        """Pause the template and snapshot it into the directory ``state_path`` (config.json,
        state.json, memory-ranges); ``memory`` beside it becomes a link to its RAM. Left paused."""
        client: ChClient = handle.client
        started = time.monotonic()
        await asyncio.to_thread(state_path.mkdir, mode=0o700, exist_ok=True)
        try:
            await client.pause()
            await client.snapshot(snapshot_config(state_path))
        except ChApiError as exc:
            raise VmError.internal(f"saving the template: {exc}{self._log_of(handle)}") from None
        try:
            await asyncio.to_thread(_link_memory, state_path)
        except OSError as exc:
            raise VmError.internal(f"saving the template: its snapshot has no RAM file: {exc}") from None
        return time.monotonic() - started

    @staticmethod
    def _log_of(handle: VmHandle) -> str:
        tail = common.vmm_log_tail(handle.control_socket.parent)
        return f"; VMM log: {tail}" if tail else ""

    def console_log_path(self, run_dir: Path) -> Path:
        return run_dir / common.CONSOLE_LOG

    async def start(self, spec: LaunchSpec) -> VmHandle:
        problem = self.problem() or self.launch_problem(spec)
        if problem:
            raise VmError.precondition(problem)
        run_dir = spec.run_dir
        socket = run_dir / API_SOCKET
        console = self.console_log_path(run_dir)
        common.remove_quietly(socket)
        if spec.image is not None:
            common.remove_quietly(run_dir / common.IDENTITY_SOCKET)
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
            if spec.image is not None and spec.image.clone:
                handle.restored_in = await self._restore(handle, spec)
            else:
                args = [*self.kernel_args(), *([IDENTITY_PORT_ARG] if spec.image is not None else [])]
                cmdline = " ".join([*args, spec.cmdline]).strip()
                await client.create(vm_config(spec, console, cmdline))
                await client.boot()
                if spec.image is not None:
                    handle.identity = await self._open_identity(handle, spec.timeout)
            state = await self.status(handle)
            if state != "running":
                raise VmError.internal(f"cloud-hypervisor reports the new VM {state!r}, not running")
        except ChApiError as exc:
            await self.kill(handle)
            what = "restoring the clone: " if spec.image is not None and spec.image.clone else ""
            raise VmError.precondition(
                f"{what}{exc}; VMM log: {common.vmm_log_tail(run_dir) or 'empty'}"
            ) from None
        except BaseException:
            await run_to_end(self.kill(handle))
            raise
        return handle

    async def _restore(self, handle: VmHandle, spec: LaunchSpec) -> float:
        """Restore a clone from its template's snapshot (paused, its devices as the template's,
        its serial log and identity socket in its own run directory), resume it, plug its own NIC
        and connect to its identity port; the seconds from vm.restore to resumed."""
        assert spec.image is not None
        client: ChClient = handle.client
        state_dir = Path(spec.image.state_path)
        problem = await asyncio.to_thread(_snapshot_problem, state_dir, spec)
        if problem:
            raise VmError.precondition(f"restoring the clone: {problem}")
        started = time.monotonic()
        await client.restore(restore_config(state_dir))
        await client.resume()
        restored = time.monotonic() - started
        if spec.net is not None:
            await client.add_net(net_config(spec.net))
        handle.identity = await self._open_identity(handle, spec.timeout)
        return restored

    async def _open_identity(self, handle: VmHandle, timeout: float) -> Any:
        """The identity port, connected through cloud-hypervisor's hybrid vsock once the guest
        listens on it (the VMM closes a CONNECT to a port nobody listens on: tried again)."""
        path = handle.control_socket.parent / common.IDENTITY_SOCKET
        deadline = time.monotonic() + timeout
        why = "no answer"
        while True:
            if handle.process is not None and handle.process.poll() is not None:
                raise VmError.precondition(
                    f"cloud-hypervisor ended: {common.vmm_log_tail(path.parent) or 'no output'}"
                )
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except OSError as exc:
                why = str(exc)
            else:
                try:
                    writer.write(f"CONNECT {IDENTITY_VSOCK_PORT}\n".encode())
                    await writer.drain()
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                        answer = await reader.readline()
                except (OSError, TimeoutError) as exc:
                    answer, why = b"", str(exc) or type(exc).__name__
                if answer.startswith(b"OK "):
                    return reader, writer
                writer.close()
                why = (
                    f"the guest does not listen on vsock port {IDENTITY_VSOCK_PORT}"
                    if not answer
                    else repr(answer)
                )
            if time.monotonic() > deadline:
                raise VmError.deadline(f"the identity port {path} did not open within {timeout:g} s: {why}")
            await asyncio.sleep(0.05)

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
        if handle.identity is not None:
            handle.identity[1].close()
            handle.identity = None
        client: ChClient = handle.client
        await client.close()


def _snapshot_problem(state_dir: Path, spec: LaunchSpec) -> str | None:
    """Why the snapshot in ``state_dir`` cannot be ``spec``'s clone (None: it can): its devices
    and machine are restored as saved, so they must be what the clone was asked to be."""
    try:
        config = json.loads((state_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{state_dir} holds no cloud-hypervisor snapshot ({exc})"
    saved = (
        config.get("cpus", {}).get("boot_vcpus"),
        config.get("memory", {}).get("size"),
        [d.get("path") for d in config.get("disks", [])],
    )
    asked = (spec.vcpus, spec.memory_mib * 1024 * 1024, [d.path for d in spec.disks])
    if saved != asked:
        return f"its template was saved with (vCPUs, memory, disks) {saved}, the clone asks for {asked}"
    return None


def _link_memory(state_dir: Path) -> None:
    """``memory`` beside the snapshot: its RAM (memory-ranges) under the name templates use
    (templates.MEMORY_FILE, whose RAM file size is reported as the template's resident memory)."""
    memory = state_dir.parent / "memory"
    common.remove_quietly(memory)
    os.link(state_dir / MEMORY_RANGES, memory)
