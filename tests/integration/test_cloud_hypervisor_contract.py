"""Our cloud-hypervisor client against the VMM's published REST API, without the VMM.

cloud-hypervisor cannot boot a guest on these machines (no usable KVM, and it is not packaged), so
this checks the contract instead: a fake VMM serves HTTP/1.1 on a unix socket, checks every
request's method, path and JSON body against the schema subset below and answers like the real
VMM (state machine, status codes, response bodies). Our client and backend are driven through
whole lifecycles against it, once in-process and once with the fake as the VMM process the backend
launches (``--api-socket path=...``), exiting when the real one would.

The schema subset is transcribed from cloud-hypervisor's OpenAPI document
``vmm/src/api/openapi/cloud-hypervisor.yaml`` (info.version 0.3.0, repository
cloud-hypervisor/cloud-hypervisor at commit 00f68228812d8dfeb50369c597b18e06cea42b10): every
property of the schemas we send or read, with its type, so an unknown or mistyped field fails.
Where the VMM validates more than the schema says (max_vcpus >= boot_vcpus, a payload needs a
kernel or firmware, memory in whole pages), that is checked too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import socket as pysocket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.vms import v0 as pb
from auraed.errors import ErrorKind
from auraed.state.store import Store
from auraed.vms import backend as common
from auraed.vms import network
from auraed.vms.backend import Backend, LaunchDisk, LaunchNet, LaunchSpec, MemoryImage, VmHandle
from auraed.vms.cloud_hypervisor import (
    IDENTITY_VSOCK_PORT as CH_IDENTITY_VSOCK_PORT,
)
from auraed.vms.cloud_hypervisor import (
    IDENTITY_VSOCK_PROBLEM,
    ChApiError,
    ChClient,
    CloudHypervisorBackend,
    net_config,
    restore_config,
    snapshot_config,
    vm_config,
)
from auraed.vms.errors import VmError
from auraed.vms.model import State, parse_vm
from auraed.vms.qemu import QemuBackend
from auraed.vms.templates import (
    AUTO_PREFIX,
    TemplateRecord,
    Templates,
    TemplateShape,
    TemplateState,
    auto_name,
    identity_message,
    send_identity,
)
from auraed.vms.templates import KIND as TEMPLATE_KIND
from auraed.vms.vms import KIND, Vms, choose_backend
from tests.support.workers import worker_share

REPO = Path(__file__).resolve().parents[2]
SPEC_SOURCE = (
    "cloud-hypervisor/cloud-hypervisor vmm/src/api/openapi/cloud-hypervisor.yaml, "
    "info.version 0.3.0, commit 00f68228812d8dfeb50369c597b18e06cea42b10"
)
API_PREFIX = "/api/v1/"

# -- the schema subset ----------------------------------------------------------------------------
# Types: "string", "boolean", "integer", "object" (not checked deeper: we never send it),
# "array:<type>", "enum:<Name>", or the name of another schema.

ENUMS: dict[str, tuple[str, ...]] = {
    "ConsoleMode": ("Off", "Pty", "Tty", "File", "Socket", "Null"),
    "VmState": ("Created", "Running", "Shutdown", "Paused", "BreakPoint"),
    "ImageType": ("FlatVmdk", "FixedVhd", "Qcow2", "Raw", "Vhdx", "Unknown"),
    "LockGranularity": ("ByteRange", "Full"),
    "CoreSchedulingMode": ("Vm", "Vcpu", "Off"),
    "MemoryRestoreMode": ("Copy", "OnDemand", "CopyOnWrite"),
}


@dataclass(frozen=True)
class Schema:
    properties: dict[str, str]
    required: tuple[str, ...] = ()
    minimum: dict[str, int] = field(default_factory=dict)


SCHEMAS: dict[str, Schema] = {
    "VmConfig": Schema(
        required=("payload",),
        properties={
            "cpus": "CpusConfig",
            "memory": "MemoryConfig",
            "payload": "PayloadConfig",
            "rate_limit_groups": "array:object",
            "disks": "array:DiskConfig",
            "net": "array:NetConfig",
            "rng": "RngConfig",
            "balloon": "object",
            "fs": "array:object",
            "generic_vhost_user": "array:object",
            "pmem": "array:object",
            "serial": "SerialConfig",
            "console": "ConsoleConfig",
            "debug_console": "object",
            "devices": "array:object",
            "user_devices": "array:object",
            "vdpa": "array:object",
            "vsock": "VsockConfig",
            "numa": "array:object",
            "iommu": "boolean",
            "watchdog": "boolean",
            "rtc": "object",
            "pvpanic": "boolean",
            "pci_segments": "array:object",
            "platform": "object",
            "tpm": "object",
            "landlock_enable": "boolean",
            "landlock_rules": "array:object",
        },
    ),
    "PayloadConfig": Schema(
        properties={
            "firmware": "string",
            "kernel": "string",
            "cmdline": "string",
            "initramfs": "string",
            "igvm": "string",
            "host_data": "string",
        }
    ),
    "CpusConfig": Schema(
        required=("boot_vcpus", "max_vcpus"),
        minimum={"boot_vcpus": 1, "max_vcpus": 1},
        properties={
            "boot_vcpus": "integer",
            "max_vcpus": "integer",
            "topology": "object",
            "kvm_hyperv": "boolean",
            "max_phys_bits": "integer",
            "nested": "boolean",
            "affinity": "array:object",
            "features": "object",
            "core_scheduling": "enum:CoreSchedulingMode",
        },
    ),
    "MemoryConfig": Schema(
        required=("size",),
        properties={
            "size": "integer",
            "hotplug_size": "integer",
            "hotplugged_size": "integer",
            "mergeable": "boolean",
            "hotplug_method": "string",
            "shared": "boolean",
            "hugepages": "boolean",
            "hugepage_size": "integer",
            "prefault": "boolean",
            "reserve": "boolean",
            "thp": "boolean",
            "zones": "array:object",
        },
    ),
    "DiskConfig": Schema(
        properties={
            "path": "string",
            "readonly": "boolean",
            "direct": "boolean",
            "iommu": "boolean",
            "num_queues": "integer",
            "queue_size": "integer",
            "vhost_user": "boolean",
            "vhost_socket": "string",
            "rate_limiter_config": "object",
            "pci_segment": "integer",
            "pci_device_id": "integer",
            "id": "string",
            "serial": "string",
            "rate_limit_group": "string",
            "queue_affinity": "array:object",
            "backing_files": "boolean",
            "sparse": "boolean",
            "image_type": "enum:ImageType",
            "lock_granularity": "enum:LockGranularity",
        }
    ),
    "NetConfig": Schema(
        properties={
            "tap": "string",
            "ip": "string",
            "mask": "string",
            "mac": "string",
            "host_mac": "string",
            "mtu": "integer",
            "iommu": "boolean",
            "num_queues": "integer",
            "queue_size": "integer",
            "vhost_user": "boolean",
            "vhost_socket": "string",
            "vhost_mode": "string",
            "id": "string",
            "pci_segment": "integer",
            "pci_device_id": "integer",
            "rate_limiter_config": "object",
            "offload_tso": "boolean",
            "offload_ufo": "boolean",
            "offload_csum": "boolean",
        }
    ),
    "RngConfig": Schema(
        required=("src",),
        properties={
            "id": "string",
            "pci_segment": "integer",
            "pci_device_id": "integer",
            "iommu": "boolean",
            "src": "string",
        },
    ),
    "SerialConfig": Schema(
        required=("mode",), properties={"file": "string", "socket": "string", "mode": "enum:ConsoleMode"}
    ),
    "ConsoleConfig": Schema(
        required=("mode",),
        properties={
            "file": "string",
            "socket": "string",
            "mode": "enum:ConsoleMode",
            "iommu": "boolean",
            "id": "string",
            "pci_segment": "integer",
            "pci_device_id": "integer",
        },
    ),
    "VmmPingResponse": Schema(
        required=("version",),
        properties={
            "build_version": "string",
            "version": "string",
            "pid": "integer",
            "features": "array:string",
        },
    ),
    "VsockConfig": Schema(
        required=("cid", "socket"),
        minimum={"cid": 3},
        properties={
            "cid": "integer",
            "socket": "string",
            "iommu": "boolean",
            "pci_segment": "integer",
            "pci_device_id": "integer",
            "id": "string",
        },
    ),
    "VmSnapshotConfig": Schema(properties={"destination_url": "string"}),
    "RestoreConfig": Schema(
        required=("source_url",),
        properties={
            "source_url": "string",
            "prefault": "boolean",
            "memory_restore_mode": "enum:MemoryRestoreMode",
            "resume": "boolean",
            "zone_updates": "array:object",
        },
    ),
    "PciDeviceInfo": Schema(required=("id", "bdf"), properties={"id": "string", "bdf": "string"}),
    "VmInfo": Schema(
        required=("config", "state"),
        properties={
            "config": "VmConfig",
            "state": "enum:VmState",
            "memory_actual_size": "integer",
            "device_tree": "object",
        },
    ),
}


@dataclass(frozen=True)
class Endpoint:
    body: str | None  # the request body's schema; None: the request has no body
    ok: int
    response: str | None = None


ENDPOINTS: dict[tuple[str, str], Endpoint] = {
    ("GET", "vmm.ping"): Endpoint(None, 200, "VmmPingResponse"),
    ("PUT", "vmm.shutdown"): Endpoint(None, 204),
    ("GET", "vm.info"): Endpoint(None, 200, "VmInfo"),
    ("PUT", "vm.create"): Endpoint("VmConfig", 204),
    ("PUT", "vm.delete"): Endpoint(None, 204),
    ("PUT", "vm.boot"): Endpoint(None, 204),
    ("PUT", "vm.shutdown"): Endpoint(None, 204),
    ("PUT", "vm.power-button"): Endpoint(None, 204),
    ("PUT", "vm.pause"): Endpoint(None, 204),
    ("PUT", "vm.resume"): Endpoint(None, 204),
    ("PUT", "vm.snapshot"): Endpoint("VmSnapshotConfig", 204),
    ("PUT", "vm.restore"): Endpoint("RestoreConfig", 204),
    ("PUT", "vm.add-net"): Endpoint("NetConfig", 200, "PciDeviceInfo"),
}
KNOWN_PATHS = {path for _, path in ENDPOINTS}


def validate(value: Any, kind: str, where: str) -> list[str]:
    """Where ``value`` breaks the schema type ``kind``: one message per problem."""
    if kind.startswith("array:"):
        if not isinstance(value, list):
            return [f"{where}: expected an array, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in validate(item, kind[6:], f"{where}[{i}]")]
    if kind.startswith("enum:"):
        allowed = ENUMS[kind[5:]]
        return [] if value in allowed else [f"{where}: {value!r} is not one of {allowed}"]
    if kind == "string":
        return [] if isinstance(value, str) else [f"{where}: expected a string, got {value!r}"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{where}: expected a boolean, got {value!r}"]
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{where}: expected an integer, got {value!r}"]
    if kind == "object":
        return [] if isinstance(value, dict) else [f"{where}: expected an object, got {value!r}"]
    schema = SCHEMAS[kind]
    if not isinstance(value, dict):
        return [f"{where}: expected a {kind} object, got {type(value).__name__}"]
    problems = [f"{where}: {kind} lacks required {name!r}" for name in schema.required if name not in value]
    for name, item in value.items():
        if name not in schema.properties:
            problems.append(f"{where}: {kind} has no property {name!r}")
            continue
        problems += validate(item, schema.properties[name], f"{where}.{name}")
        low = schema.minimum.get(name)
        if low is not None and isinstance(item, int) and item < low:
            problems.append(f"{where}.{name}: {item} is below the minimum {low}")
    return problems


def semantic_problems(config: dict[str, Any]) -> list[str]:
    """What the VMM rejects at vm.create beyond the schema."""
    problems = []
    cpus = config.get("cpus", {})
    if cpus and cpus.get("max_vcpus", 0) < cpus.get("boot_vcpus", 0):
        problems.append("cpus: max_vcpus < boot_vcpus")
    payload = config.get("payload", {})
    if not (payload.get("kernel") or payload.get("firmware") or payload.get("igvm")):
        problems.append("payload: needs a kernel, firmware or igvm")
    size = config.get("memory", {}).get("size", 0)
    if size % 4096:
        problems.append("memory.size: not a whole number of 4 KiB pages")
    for where, path in [
        ("payload.kernel", payload.get("kernel")),
        ("payload.initramfs", payload.get("initramfs")),
    ]:
        if path and not Path(path).is_file():
            problems.append(f"{where}: {path} does not exist")
    for i, disk in enumerate(config.get("disks", [])):
        if not Path(disk.get("path", "")).exists():
            problems.append(f"disks[{i}].path: {disk.get('path')} does not exist")
    for i, net in enumerate(config.get("net", [])):
        problems += _tap_problems(i, net)
    return problems


def _tap_problems(index: int, net: dict[str, Any]) -> list[str]:
    """cloud-hypervisor opens the tap by name and sets ip/mask on it (192.168.249.1/24 by default):
    both must be given and be exactly the tap's own host address, or the host's network changes."""
    tap, ip, mask = net.get("tap"), net.get("ip"), net.get("mask")
    if not tap or not ip or not mask:
        return [f"net[{index}]: tap, ip and mask must all be set (ip/mask default to 192.168.249.1/24)"]
    prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", tap], capture_output=True, text=True, check=False
    )
    if f" {ip}/{prefix} " not in out.stdout:
        return [f"net[{index}]: {ip}/{prefix} is not the address of tap {tap}: {out.stdout.strip()!r}"]
    return []


# -- the fake VMM ---------------------------------------------------------------------------------

REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    500: "Internal Server Error",
}


class FakeCloudHypervisor:
    """cloud-hypervisor's API as the VMM serves it, checking every request against the schema.

    ``guest``: "powers-off" (the guest handles the ACPI power button and powers off, and the VMM
    process then ends, as the real one does), "ignores-button" or "deaf" (it never listens on
    its identity port). ``fail``: an endpoint answered
    with HTTP 500 and an error text, as the VMM does when an action fails.

    Snapshots are written as cloud-hypervisor writes them (config.json: the VmConfig, state.json,
    memory-ranges: the RAM) and a restore reads config.json back, checked against VmConfig. Paths
    in the config are opened relative to the VMM's working directory, as the real one opens them.
    A vsock device is served as cloud-hypervisor's hybrid vsock (a unix socket where the host
    asks ``CONNECT <port>`` and gets ``OK <port>`` when the guest listens there, else the
    connection closed); the fake guest listens on the identity port while it runs and plays a
    template's part (booted, config, ready) once booted, and a clone's (identity, applied) once
    restored and resumed.
    """

    def __init__(
        self, socket: Path, *, guest: str = "powers-off", log: Path | None = None, fail: str = ""
    ) -> None:
        self.socket = socket
        self.guest = guest
        self.fail = fail
        self.restored = False
        self.identity_lines: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.log = log
        self.requests: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.config: dict[str, Any] | None = None
        self.state: str | None = None  # None: no VM created
        self.exited = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path=str(self.socket))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def serve_until_exit(self) -> None:
        await self.start()
        await self.exited.wait()
        await self.stop()

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _version = line.decode().split(" ", 2)
                headers = {}
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = header.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                if "chunked" in headers.get("transfer-encoding", ""):
                    self._violation(
                        f"{method} {target}: chunked body (the VMM's HTTP server wants Content-Length)"
                    )
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                status, answer = self._handle(method, target, headers, body)
                payload = b"" if answer is None else json.dumps(answer).encode()
                head = f"HTTP/1.1 {status} {REASONS[status]}\r\nServer: Cloud Hypervisor API\r\n"
                if payload:
                    head += "Content-Type: application/json\r\n"
                head += f"Content-Length: {len(payload)}\r\n\r\n"
                writer.write(head.encode() + payload)
                await writer.drain()
                if self.exited.is_set():
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def _handle(self, method: str, target: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        record: dict[str, Any] = {"method": method, "path": target, "body": None}
        self.requests.append(record)
        try:
            return self._dispatch(method, target, headers, raw, record)
        finally:
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(json.dumps({**record, "violations": self.violations}) + "\n")

    def _dispatch(
        self, method: str, target: str, headers: dict[str, str], raw: bytes, record: dict[str, Any]
    ) -> tuple[int, Any]:
        if not target.startswith(API_PREFIX):
            self._violation(f"{method} {target}: not under {API_PREFIX}")
            return 404, None
        name = target[len(API_PREFIX) :]
        endpoint = ENDPOINTS.get((method, name))
        if endpoint is None:
            why = "wrong method" if name in KNOWN_PATHS else "unknown endpoint"
            self._violation(f"{method} {target}: {why}")
            return (405 if name in KNOWN_PATHS else 404), None
        body: Any = None
        if endpoint.body is None:
            if raw:
                self._violation(f"{method} {target}: takes no body, got {raw[:100]!r}")
        else:
            if "application/json" not in headers.get("content-type", ""):
                self._violation(f"{method} {target}: body without Content-Type application/json")
            try:
                body = json.loads(raw)
            except ValueError:
                self._violation(f"{method} {target}: body is not JSON")
                return 400, None
            record["body"] = body
            problems = validate(body, endpoint.body, endpoint.body)
            problems += semantic_problems(body) if endpoint.body == "VmConfig" and not problems else []
            problems += _tap_problems(0, body) if endpoint.body == "NetConfig" and not problems else []
            if problems:
                self.violations += [f"{method} {target}: {p}" for p in problems]
                return 400, problems  # the real VMM answers with its error text
        status, answer = self._act(name, body)
        if status == endpoint.ok and endpoint.response is not None:
            self.violations += [
                f"fake's own {name} answer: {p}" for p in validate(answer, endpoint.response, name)
            ]
        return status, answer

    def _act(self, name: str, body: Any) -> tuple[int, Any]:
        if name == self.fail:
            return 500, f"Error from the VMM: {name} failed (fake)"
        if name in VM_ACTIONS:
            return self._vm_action(name, body)
        if name == "vmm.ping":
            return 200, {
                "build_version": "v48.0-fake",
                "version": "48.0.0",
                "pid": os.getpid(),
                "features": ["kvm"],
            }
        if name == "vmm.shutdown":
            self.state = None
            self.exited.set()
            return 204, None
        if name == "vm.create":
            if self.state is not None:
                return 500, None
            self.config, self.state = body, "Created"
            return 204, None
        if self.state is None and name != "vm.delete":
            return 404, None
        if name == "vm.info":
            assert self.config is not None
            size = self.config.get("memory", {}).get("size", 0)
            return 200, {"config": self.config, "state": self.state, "memory_actual_size": size}
        if name == "vm.boot":
            if self.state != "Created":
                return 405, None
            self.state = "Running"
            serial = (self.config or {}).get("serial", {})
            if serial.get("mode") == "File":
                with open(serial["file"], "a") as f:
                    f.write("fake cloud-hypervisor guest: booted\n")
            self._open_vsock()
            return 204, None
        if name == "vm.power-button":
            if self.state != "Running":
                return 405, None
            if self.guest == "powers-off":
                # The guest powers off; the real VMM then ends its process.
                self.state = "Shutdown"
                self.exited.set()
            return 204, None
        if name == "vm.shutdown":
            if self.state not in ("Running", "Paused"):
                return 405, None
            self.state = "Shutdown"
            return 204, None
        if name == "vm.delete":
            self.state, self.config = None, None
            return 204, None
        raise AssertionError(name)

    def _vm_action(self, name: str, body: Any) -> tuple[int, Any]:
        """vm.pause, vm.resume, vm.snapshot, vm.restore and vm.add-net, as the VMM answers them."""
        if name == "vm.restore":
            if self.state is not None:
                return 404, None  # "the VM is already created"
            source = _file_url(body["source_url"])
            if source is None or not (source / "config.json").is_file():
                return 400, f"Error restoring the VM: no snapshot at {body['source_url']}"
            config = json.loads((source / "config.json").read_text())
            problems = validate(config, "VmConfig", "config.json") + semantic_problems(config)
            if problems:
                self.violations += [f"vm.restore: {p}" for p in problems]
                return 400, problems
            if not (source / "memory-ranges").is_file() or not (source / "state.json").is_file():
                return 400, "Error restoring the VM: the snapshot lacks memory-ranges or state.json"
            self.config, self.state, self.restored = config, "Paused", True
            self._open_vsock()
            if body.get("resume"):
                self.state = "Running"
            return 204, None
        if self.state is None:
            return 404, None
        if name == "vm.pause":
            if self.state != "Running":
                return 405, None
            self.state = "Paused"
            return 204, None
        if name == "vm.resume":
            if self.state != "Paused":
                return 405, None
            self.state = "Running"
            return 204, None
        if name == "vm.snapshot":
            if self.state != "Paused":
                return 405, "Error snapshotting the VM: it is not paused"
            target = _file_url(body.get("destination_url", ""))
            if target is None or not target.is_dir():
                return 500, f"Error snapshotting the VM: {body.get('destination_url')!r} is no directory"
            assert self.config is not None
            (target / "config.json").write_text(json.dumps(self.config))
            (target / "state.json").write_text(json.dumps({"fake": "device state"}))
            with (target / "memory-ranges").open("wb") as ram:
                ram.truncate(self.config["memory"]["size"])
            return 204, None
        if name == "vm.add-net":
            assert self.config is not None
            nets = self.config.setdefault("net", [])
            if any(n.get("id") == body.get("id") for n in nets):
                return 409, None
            nets.append(body)
            return 200, {"id": body.get("id", "_net0"), "bdf": "0000:00:06.0"}
        raise AssertionError(name)

    def _open_vsock(self) -> None:
        """The vsock device's unix socket: listening (as the VMM does) from boot or restore on."""
        vsock = (self.config or {}).get("vsock")
        if not vsock:
            return
        path = Path(vsock["socket"])  # relative: in the VMM's working directory
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        task = asyncio.get_running_loop().create_task(self._serve_vsock(listener))
        self._tasks.add(task)

    async def _serve_vsock(self, listener: pysocket.socket) -> None:
        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = (await reader.readline()).decode().split()
                if request[:1] != ["CONNECT"] or len(request) != 2 or not request[1].isdigit():
                    self._violation(f"vsock: {request!r} is not CONNECT <port>")
                    return
                # The guest listens on its identity port while it runs (not paused, not before boot).
                listening = self.state == "Running" and self.guest != "deaf"
                if int(request[1]) != CH_IDENTITY_VSOCK_PORT or not listening:
                    return
                writer.write(b"OK 1073741824\n")
                await writer.drain()
                await self._guest(reader, writer)
            finally:
                writer.close()

        await asyncio.start_unix_server(connection, sock=listener)

    async def _guest(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The guest's side of the identity port (auraed/init/identity.py's protocol)."""
        if not self.restored:
            writer.write(b'{"template": "booted"}\n')
            self.identity_lines.append(json.loads(await reader.readline()))
            writer.write(b'{"template": "ready", "imports_s": 0.5}\n')
            await writer.drain()
            await reader.read()  # until the host goes (the template is saved, then killed)
            return
        message = json.loads(await reader.readline())
        self.identity_lines.append(message)
        nics = (self.config or {}).get("net", [])  # a clone's own NIC, plugged after its resume
        reply = {"identity": "applied", "boot_id": "fake-boot-id", "applied_ms": 1.0}
        if self.state != "Running":
            reply = {"identity": "failed", "error": f"the guest is {self.state}, not running"}
        elif message["net"].get("mac") not in [n.get("mac") for n in nics]:
            reply = {"identity": "failed", "error": "eth0 is missing"}
        writer.write(json.dumps(reply).encode() + b"\n")
        await writer.drain()


VM_ACTIONS = {"vm.pause", "vm.resume", "vm.snapshot", "vm.restore", "vm.add-net"}


def _file_url(url: str) -> Path | None:
    return Path(url.removeprefix("file://")) if url.startswith("file:///") else None


def fake_vmm_main(argv: list[str]) -> None:
    """The fake as a VMM process: ``<binary> --api-socket path=<socket>``."""
    if len(argv) != 2 or argv[0] != "--api-socket" or not argv[1].startswith("path="):
        sys.exit(f"fake cloud-hypervisor: unexpected arguments {argv}")
    socket = Path(argv[1].removeprefix("path="))
    log = socket.parent / f"api-requests-{os.getpid()}.jsonl"
    fake = FakeCloudHypervisor(
        socket,
        guest=os.environ.get("FAKE_CH_GUEST", "powers-off"),
        log=log,
        fail=os.environ.get("FAKE_CH_FAIL", ""),
    )
    asyncio.run(fake.serve_until_exit())


FAKE_BINARY = f"""#!{sys.executable}
import sys
sys.path.insert(0, {str(REPO)!r})
from tests.integration.test_cloud_hypervisor_contract import fake_vmm_main
fake_vmm_main(sys.argv[1:])
"""


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def root() -> Iterator[Path]:
    # Short: unix socket paths are limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="aurae-ch-", dir="/tmp"))
    try:
        yield path
    finally:
        common.kill_processes_referencing(path)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_binary(root: Path) -> Path:
    binary = root / "bin" / "cloud-hypervisor"
    binary.parent.mkdir()
    binary.write_text(FAKE_BINARY)
    binary.chmod(0o755)
    return binary


@pytest.fixture
def images(root: Path) -> dict[str, Path]:
    paths = {}
    for name in ("vmlinux", "initramfs.img", "rootfs.img", "config.img"):
        paths[name] = root / "images" / name
        paths[name].parent.mkdir(exist_ok=True)
        paths[name].write_bytes(b"\0" * 4096)
    return paths


def requests_of(handle: VmHandle) -> list[dict[str, Any]]:
    """What the fake VMM process of ``handle`` was asked, with the violations it found."""
    log = handle.control_socket.parent / f"api-requests-{handle.pid}.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def assert_clean(requests: list[dict[str, Any]]) -> None:
    violations = requests[-1]["violations"] if requests else []
    assert violations == [], "\n".join(violations)


# -- the client, in-process ------------------------------------------------------------------------


def test_the_schema_subset_catches_what_it_should() -> None:
    good = {
        "payload": {"kernel": "/k", "cmdline": "console=ttyS0"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 1 << 28},
        "serial": {"mode": "File", "file": "/c"},
        "console": {"mode": "Off"},
    }
    assert validate(good, "VmConfig", "VmConfig") == []
    assert validate({**good, "cpu": {}}, "VmConfig", "v") == ["v: VmConfig has no property 'cpu'"]
    assert validate({"cpus": good["cpus"]}, "VmConfig", "v") == ["v: VmConfig lacks required 'payload'"]
    assert validate({**good, "cpus": {"boot_vcpus": True, "max_vcpus": 0}}, "VmConfig", "v") == [
        "v.cpus.boot_vcpus: expected an integer, got True",
        "v.cpus.max_vcpus: 0 is below the minimum 1",
    ]
    assert validate({**good, "serial": {"mode": "file"}}, "VmConfig", "v") == [
        "v.serial.mode: 'file' is not one of ('Off', 'Pty', 'Tty', 'File', 'Socket', 'Null')"
    ]
    assert validate({**good, "disks": [{"path": "/d", "readonly": "yes"}]}, "VmConfig", "v") == [
        "v.disks[0].readonly: expected a boolean, got 'yes'"
    ]


async def test_client_lifecycle_against_the_published_api(root: Path, images: dict[str, Path]) -> None:
    socket = root / "api.sock"
    fake = FakeCloudHypervisor(socket, guest="ignores-button")
    await fake.start()
    client = ChClient(socket)
    try:
        assert (await client.ping())["version"] == "48.0.0"
        with pytest.raises(ChApiError) as caught:
            await client.info()
        assert caught.value.status == 404
        spec = LaunchSpec(
            name="contract",
            vcpus=2,
            memory_mib=256,
            kernel=str(images["vmlinux"]),
            initramfs=str(images["initramfs.img"]),
            disks=(
                LaunchDisk(str(images["rootfs.img"]), False, "root"),
                LaunchDisk(str(images["config.img"]), True, "disk1"),
            ),
            cmdline="auraed.hostname=contract",
            net=None,
            run_dir=root,
        )
        config = vm_config(spec, root / "console.log", "console=ttyS0 auraed.hostname=contract")
        await client.create(config)
        assert (await client.info())["state"] == "Created"
        await client.boot()
        info = await client.info()
        assert info["state"] == "Running"
        assert info["config"]["payload"] == {
            "kernel": str(images["vmlinux"]),
            "initramfs": str(images["initramfs.img"]),
            "cmdline": "console=ttyS0 auraed.hostname=contract",
        }
        assert info["config"]["cpus"] == {"boot_vcpus": 2, "max_vcpus": 2}
        assert info["config"]["memory"] == {"size": 256 << 20}
        assert [(d["path"], d["readonly"], d["serial"]) for d in info["config"]["disks"]] == [
            (str(images["rootfs.img"]), True, "root"),
            (str(images["config.img"]), False, "disk1"),
        ]
        assert info["config"]["serial"] == {"mode": "File", "file": str(root / "console.log")}
        assert (root / "console.log").read_text() == "fake cloud-hypervisor guest: booted\n"
        await client.power_button()  # this guest ignores it
        assert (await client.info())["state"] == "Running"
        await client.shutdown()
        assert (await client.info())["state"] == "Shutdown"
        with pytest.raises(ChApiError) as caught:
            await client.power_button()
        assert caught.value.status == 405
        await client.delete()
        with pytest.raises(ChApiError) as caught:
            await client.info()
        assert caught.value.status == 404
        await client.shutdown_vmm()
        assert fake.exited.is_set()
    finally:
        await client.close()
        await fake.stop()
    assert fake.violations == [], "\n".join(fake.violations)
    assert [f"{r['method']} {r['path'].removeprefix(API_PREFIX)}" for r in fake.requests] == [
        "GET vmm.ping",
        "GET vm.info",
        "PUT vm.create",
        "GET vm.info",
        "PUT vm.boot",
        "GET vm.info",
        "PUT vm.power-button",
        "GET vm.info",
        "PUT vm.shutdown",
        "GET vm.info",
        "PUT vm.power-button",
        "PUT vm.delete",
        "GET vm.info",
        "PUT vmm.shutdown",
    ]


# -- backend selection ----------------------------------------------------------------------------


def test_cloud_hypervisor_is_never_chosen_without_usable_kvm(fake_binary: Path) -> None:
    no_kvm = CloudHypervisorBackend(
        binary=str(fake_binary), kvm_usable=lambda: False, kvm_detail=lambda: "crawls"
    )
    backends: dict[str, Backend] = {"qemu": QemuBackend(), "cloud-hypervisor": no_kvm}
    assert choose_backend("", backends) == "qemu"
    with pytest.raises(VmError) as caught:
        choose_backend("cloud-hypervisor", backends)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "KVM" in caught.value.message and "crawls" in caught.value.message
    # Installed and with KVM that works, it is the automatic choice.
    with_kvm = CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: True)
    assert choose_backend("", {"qemu": QemuBackend(), "cloud-hypervisor": with_kvm}) == "cloud-hypervisor"
    # KVM works but the binary is missing: QEMU.
    missing = CloudHypervisorBackend(binary="/nonexistent/cloud-hypervisor", kvm_usable=lambda: True)
    assert choose_backend("", {"qemu": QemuBackend(), "cloud-hypervisor": missing}) == "qemu"
    assert "not installed" in (missing.problem() or "")


async def test_backend_refuses_to_start_without_kvm(
    root: Path, fake_binary: Path, images: dict[str, Path]
) -> None:
    backend = CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: False)
    spec = LaunchSpec("nokvm", 1, 128, str(images["vmlinux"]), "", (), "", None, root)
    with pytest.raises(VmError) as caught:
        await backend.start(spec)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert common.processes_referencing(root) == []
    assert not (root / "api.sock").exists()


# -- the backend and the domain, with the fake as the VMM process ------------------------------


@pytest.fixture
async def ch_vms(root: Path, fake_binary: Path) -> AsyncIterator[Vms]:
    pool = free_pool()
    backends = {
        "qemu": QemuBackend(),
        "cloud-hypervisor": CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: True),
    }
    store = Store(root / "state" / "auraed.db")
    vms = Vms(store, backends, runtime_dir=root / "run", pool=pool, default_stop_timeout=2.0)  # type: ignore[arg-type]
    try:
        yield vms
    finally:
        await vms.close()
        common.kill_processes_referencing(root)
        for _, doc in store.list(KIND):
            if doc.get("net"):
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(
                        network.delete_tap, doc["net"]["tap"], f"auraed-vm {doc['run_dir']}"
                    )
        store.close()


def free_pool() -> ipaddress.IPv4Network:
    host = network.host_networks()
    # This test worker's share of test_vm_edges.py's range only: another worker may be about to
    # take what looks free now, and a share of a range overlapping another one could overlap
    # another worker's share of that one.
    for pool in worker_share(ipaddress.IPv4Network("10.213.128.0/18")).subnets(new_prefix=28):
        if not network.conflicts(pool, host):
            return pool
    raise AssertionError("no free test pool")


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_vm_lifecycle_through_the_backend_and_a_fake_vmm_process(
    ch_vms: Vms, images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_vm(
        pb.VirtualMachine(
            name="chvm",
            kernel=str(images["vmlinux"]),
            initramfs=str(images["initramfs.img"]),
            root_disk=str(images["rootfs.img"]),
            extra_disks=[pb.Disk(path=str(images["config.img"]))],
            memory_mib=128,
            vcpus=2,
            network=True,
            role="guest",
        )
    )
    record = await ch_vms.allocate(spec)
    net = record.net
    assert record.backend == "cloud-hypervisor" and net is not None
    tap = net.tap

    # Boot; the guest handles the power button: a graceful stop.
    monkeypatch.setenv("FAKE_CH_GUEST", "powers-off")
    record, ready = await ch_vms.start("chvm", wait_for_console="guest: booted", timeout=30)
    assert ready is not None and record.accelerator == "kvm"
    handle = ch_vms.handle("chvm")
    assert handle is not None and handle.control_socket.name == "api.sock"
    (view,) = await ch_vms.list()
    assert (view.backend_status, view.pid) == ("running", handle.pid)
    stopped = await ch_vms.stop("chvm", timeout=5)
    assert stopped.state == State.STOPPED and stopped.reason == "stopped: the guest powered off"
    requests = requests_of(handle)
    assert_clean(requests)
    calls = [f"{r['method']} {r['path'].removeprefix(API_PREFIX)}" for r in requests]
    assert calls[:4] == ["GET vmm.ping", "PUT vm.create", "PUT vm.boot", "GET vm.info"]
    assert calls[-1] == "PUT vm.power-button"
    create = requests[1]["body"]
    assert create["net"] == [
        {
            "tap": tap,
            "ip": net.host_ip,
            "mask": "255.255.255.252",
            "mac": net.mac,
            "id": "net0",
        }
    ]
    assert [(d["serial"], d["readonly"]) for d in create["disks"]] == [("root", True), ("disk1", True)]
    cmdline = create["payload"]["cmdline"]
    assert cmdline.startswith("console=ttyS0 auraed.hostname=chvm ")
    assert f"auraed.ip={net.guest_ip}/30" in cmdline and "auraed.role=guest" in cmdline
    assert "tsc_early_khz" not in cmdline
    # The tap kept exactly its own address (cloud-hypervisor was told the same one).
    assert network.tap_addresses(tap) == [f"{net.host_ip}/30"]

    # Boot again; this guest ignores the power button: forced after the timeout.
    monkeypatch.setenv("FAKE_CH_GUEST", "ignores-button")
    await ch_vms.start("chvm", wait_for_console="guest: booted", timeout=30)
    second = ch_vms.handle("chvm")
    assert second is not None and second.pid != handle.pid
    started = time.monotonic()
    stopped = await ch_vms.stop("chvm", timeout=1)
    assert time.monotonic() - started >= 1
    assert stopped.state == State.STOPPED and "ended after the 1 s timeout" in stopped.reason
    requests = requests_of(second)
    assert_clean(requests)
    calls = [f"{r['method']} {r['path'].removeprefix(API_PREFIX)}" for r in requests]
    after_button = calls[calls.index("PUT vm.power-button") + 1 :]
    assert [c for c in after_button if c != "GET vm.info"] == [
        "PUT vm.shutdown",
        "PUT vm.delete",
        "PUT vmm.shutdown",
    ]
    assert not second.alive and second.process is not None and second.process.returncode == 0

    # A VMM killed under a running VM is noticed.
    await ch_vms.start("chvm", timeout=30)
    third = ch_vms.handle("chvm")
    assert third is not None
    os.kill(third.pid, signal.SIGKILL)
    await until(lambda: ch_vms.get("chvm").state == State.CRASHED)
    assert ch_vms.get("chvm").signal == signal.SIGKILL
    assert_clean(requests_of(third))

    await ch_vms.free("chvm")
    assert not network.tap_exists(tap)


# -- templates and clones ---------------------------------------------------------------------------


def calls_of(requests: list[dict[str, Any]]) -> list[str]:
    return [f"{r['method']} {r['path'].removeprefix(API_PREFIX)}" for r in requests]


def requests_in(directory: Path) -> list[dict[str, Any]]:
    """What the (one) fake VMM process that ran in ``directory`` was asked."""
    (log,) = directory.glob("api-requests-*.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_template_and_clone_bodies_are_the_published_schemas(root: Path, images: dict[str, Path]) -> None:
    build = root / "build-1"
    template = LaunchSpec(
        "template-t", 1, 128, str(images["vmlinux"]), str(images["initramfs.img"]),
        (LaunchDisk(str(images["rootfs.img"]), False, "root"),), "auraed.template=1",
        LaunchNet("", "52:54:00:a0:00:00", "", "", ""), build,
        image=MemoryImage(str(build / "memory"), str(build / "state"), clone=False),
    )  # fmt: skip
    config = vm_config(template, build / "console.log", "console=ttyS0 auraed.template=1")
    assert validate(config, "VmConfig", "VmConfig") == []
    # Its own files relative to the VMM's working directory (each clone opens its own), no NIC.
    assert config["serial"] == {"mode": "File", "file": "console.log"}
    assert config["vsock"] == {"cid": 3, "socket": "identity.sock"}
    assert "net" not in config
    assert validate(snapshot_config(build / "state"), "VmSnapshotConfig", "s") == []
    restore = restore_config(build / "state")
    assert restore == {"source_url": f"file://{build}/state", "memory_restore_mode": "OnDemand"}
    assert validate(restore, "RestoreConfig", "r") == []
    net = net_config(LaunchNet("aurae-t0", "52:54:00:00:00:01", "10.1.0.1", "10.1.0.2", "255.255.255.252"))
    assert validate(net, "NetConfig", "n") == []
    # What the published RestoreConfig does not have: a clone's devices cannot be changed there.
    assert validate({**restore, "net_fds": [{"id": "net0", "num_fds": 1}]}, "RestoreConfig", "r") == [
        "r: RestoreConfig has no property 'net_fds'"
    ]


def test_cloud_hypervisor_templates_are_refused_where_they_cannot_work(
    root: Path, fake_binary: Path, images: dict[str, Path]
) -> None:
    # The guest image's auraed finds its identity port by a virtio-serial name, which
    # cloud-hypervisor's console cannot give: refused, so guests boot cold instead.
    default = CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: True)
    assert default.template_problem() == IDENTITY_VSOCK_PROBLEM
    no_kvm = CloudHypervisorBackend(binary=str(fake_binary), identity_vsock=True)
    assert "KVM" in (no_kvm.template_problem() or "")
    ready = CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: True, identity_vsock=True)
    assert ready.template_problem() is None
    image = MemoryImage(str(root / "memory"), str(root / "state"), clone=True)
    pod_clone = LaunchSpec(
        "c", 1, 128, str(images["vmlinux"]), "", (), "",
        LaunchNet("aurae-p0", "52:54:00:00:00:01", "10.1.0.1", "10.1.0.2", "255.255.255.252", "/run/netns/p"),
        root, image=image,
    )  # fmt: skip
    assert "network namespace" in (ready.launch_problem(pod_clone) or "")


@pytest.fixture
async def ch_templates(root: Path, fake_binary: Path) -> AsyncIterator[tuple[Vms, Templates]]:
    backends: dict[str, Backend] = {
        "qemu": QemuBackend(),
        "cloud-hypervisor": CloudHypervisorBackend(
            binary=str(fake_binary), kvm_usable=lambda: True, identity_vsock=True
        ),
    }
    store = Store(root / "state" / "auraed.db")
    vms = Vms(store, backends, runtime_dir=root / "run", pool=free_pool(), default_stop_timeout=2.0)
    templates = Templates(store, backends, vms.templates_dir, 10.0, lambda: {"config.toml": "fake"})
    try:
        yield vms, templates
    finally:
        await vms.close()
        common.kill_processes_referencing(root)
        for _, doc in store.list(KIND):
            if doc.get("net"):
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(
                        network.delete_tap, doc["net"]["tap"], f"auraed-vm {doc['run_dir']}"
                    )
        store.close()


def shape_of(images: dict[str, Path]) -> TemplateShape:
    return TemplateShape(
        str(images["vmlinux"]), str(images["initramfs.img"]), str(images["rootfs.img"]), 1, 128, ()
    )


async def clone_vm(vms: Vms, images: dict[str, Path], name: str, memory_mib: int = 128) -> None:
    spec = parse_vm(
        pb.VirtualMachine(
            name=name,
            kernel=str(images["vmlinux"]),
            initramfs=str(images["initramfs.img"]),
            root_disk=str(images["rootfs.img"]),
            memory_mib=memory_mib,
            vcpus=1,
            network=True,
            role="guest",
            backend="cloud-hypervisor",
        )
    )
    await vms.allocate(spec)


async def test_a_template_saved_and_a_clone_restored_through_the_rest_api(
    ch_templates: tuple[Vms, Templates], images: dict[str, Path]
) -> None:
    vms, templates = ch_templates
    shape = shape_of(images)
    template = await templates.ensure("cht", shape, "cloud-hypervisor", auto=False)
    assert (template.state, template.backend) == (TemplateState.READY, "cloud-hypervisor")
    assert template.files_present() and template.save_seconds > 0 and template.imports_seconds == 0.5
    build = template.build_dir
    assert sorted(p.name for p in (build / "state").iterdir()) == [
        "config.json",
        "memory-ranges",
        "state.json",
    ]
    assert os.stat(build / "memory").st_ino == os.stat(build / "state" / "memory-ranges").st_ino
    made = requests_in(build)
    assert_clean(made)
    calls = [c for c in calls_of(made) if c != "GET vm.info"]
    assert calls == ["GET vmm.ping", "PUT vm.create", "PUT vm.boot", "PUT vm.pause", "PUT vm.snapshot"]
    create = made[1]["body"]
    assert "net" not in create and create["vsock"] == {"cid": 3, "socket": "identity.sock"}
    assert "auraed.identity_port=vsock:1024" in create["payload"]["cmdline"]
    assert "auraed.template=1" in create["payload"]["cmdline"]
    assert made[-1]["body"] == {"destination_url": f"file://{build}/state"}

    # A clone: a new VMM with no boot config, restored, resumed, its own NIC plugged.
    await clone_vm(vms, images, "clone1")
    record, _ = await vms.start("clone1", image=template.image(), template="cht", timeout=30)
    net = record.net
    assert net is not None and record.template == "cht" and record.restore_ms is not None
    handle = vms.handle("clone1")
    assert handle is not None and handle.identity is not None
    message = identity_message(
        "clone1",
        "clone1",
        {"iface": "eth0", "ip": f"{net.guest_ip}/30", "gateway": net.host_ip, "mac": net.mac},
        {},
    )
    reply = await send_identity(handle, message)
    assert reply["identity"] == "applied"
    stopped = await vms.stop("clone1", timeout=5)
    assert stopped.state == State.STOPPED
    restored = requests_of(handle)
    assert_clean(restored)
    calls = [c for c in calls_of(restored) if c != "GET vm.info"]
    assert calls == [
        "GET vmm.ping",
        "PUT vm.restore",
        "PUT vm.resume",
        "PUT vm.add-net",
        "PUT vm.power-button",
    ]
    by_call = dict(zip(calls_of(restored), restored, strict=True))
    assert by_call["PUT vm.restore"]["body"] == {
        "source_url": f"file://{build}/state",
        "memory_restore_mode": "OnDemand",
    }
    assert by_call["PUT vm.add-net"]["body"] == {
        "tap": net.tap,
        "ip": net.host_ip,
        "mask": "255.255.255.252",
        "mac": net.mac,
        "id": "net0",
    }
    # The clone's own files are in its own run directory, not the template's.
    assert (Path(record.run_dir) / "identity.sock").exists()
    await vms.free("clone1")


async def test_a_template_is_restored_only_by_the_backend_that_saved_it(
    ch_templates: tuple[Vms, Templates], images: dict[str, Path], root: Path
) -> None:
    vms, templates = ch_templates
    shape = shape_of(images)
    await templates.ensure("cht", shape, "cloud-hypervisor", auto=False)
    with pytest.raises(VmError) as caught:
        await templates.ensure("cht", shape, "qemu", auto=False)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "made with cloud-hypervisor" in caught.value.message and "on qemu" in caught.value.message
    # A QEMU-made template (as the store has it) is refused for a cloud-hypervisor clone.
    qemu_made = TemplateRecord(
        name="qt", shape=shape, backend="qemu", run_dir=str(root / "run" / "templates" / "qt"),
        state=TemplateState.READY,
    )  # fmt: skip
    vms.store.put(TEMPLATE_KIND, "qt", qemu_made.to_doc())
    again = Templates(vms.store, vms.backends, vms.templates_dir, 10.0, dict)
    with pytest.raises(VmError) as caught:
        await again.ensure("qt", shape, "cloud-hypervisor", auto=False)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "made with qemu" in caught.value.message
    await clone_vm(vms, images, "c2")
    with pytest.raises(VmError) as caught:
        again.check_shape(dataclasses.replace(vms.get("c2").spec, template="qt"))
    assert "VM c2 runs on cloud-hypervisor" in caught.value.message
    # The host's own templates of one shape are one per backend (QEMU's named as before).
    assert auto_name(shape, "qemu") == AUTO_PREFIX + shape.key()[:12]
    assert auto_name(shape, "cloud-hypervisor") != auto_name(shape, "qemu")
    await vms.free("c2")


async def test_errors_of_save_and_restore_are_clear(
    ch_templates: tuple[Vms, Templates], images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    vms, templates = ch_templates
    shape = shape_of(images)
    monkeypatch.setenv("FAKE_CH_FAIL", "vm.snapshot")
    with pytest.raises(VmError) as caught:
        await templates.ensure("bad", shape, "cloud-hypervisor", auto=False)
    assert caught.value.kind is ErrorKind.INTERNAL
    assert caught.value.message.startswith("saving the template: cloud-hypervisor PUT vm.snapshot: HTTP 500")
    assert "vm.snapshot failed (fake)" in caught.value.message
    failed = templates.get("bad")
    assert failed.state == TemplateState.FAILED and not failed.build_dir.exists()

    monkeypatch.setenv("FAKE_CH_FAIL", "")
    template = await templates.ensure("good", shape, "cloud-hypervisor", auto=False)
    await clone_vm(vms, images, "c3")
    monkeypatch.setenv("FAKE_CH_FAIL", "vm.restore")
    with pytest.raises(VmError) as caught:
        await vms.start("c3", image=template.image(), template="good", timeout=30)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "restoring the clone: cloud-hypervisor PUT vm.restore: HTTP 500" in caught.value.message
    assert common.processes_referencing(Path(vms.get("c3").run_dir)) == []

    # A snapshot that is gone is said so before any VMM is asked.
    monkeypatch.setenv("FAKE_CH_FAIL", "")
    gone = MemoryImage(template.image().memory_path, str(template.build_dir / "nothing"), clone=True)
    with pytest.raises(VmError) as caught:
        await vms.start("c3", image=gone, template="good", timeout=30)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "holds no cloud-hypervisor snapshot" in caught.value.message
    await vms.free("c3")

    # A clone whose machine is not its template's snapshot is refused before any VMM is asked.
    await clone_vm(vms, images, "c4", memory_mib=256)
    with pytest.raises(VmError) as caught:
        await vms.start("c4", image=template.image(), template="good", timeout=30)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "its template was saved with (vCPUs, memory, disks) (1, 134217728" in caught.value.message
    await vms.free("c4")


async def test_a_guest_that_never_listens_on_its_identity_port_is_a_deadline(
    root: Path, fake_binary: Path, images: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CH_GUEST", "deaf")
    backend = CloudHypervisorBackend(binary=str(fake_binary), kvm_usable=lambda: True, identity_vsock=True)
    build = root / "build-1"
    build.mkdir()
    spec = LaunchSpec(
        "template-deaf", 1, 128, str(images["vmlinux"]), "", (), "auraed.template=1", None, build,
        timeout=1.0, image=MemoryImage(str(build / "memory"), str(build / "state"), clone=False),
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(VmError) as caught:
        await backend.start(spec)
    assert 1.0 <= time.monotonic() - started < 5
    assert caught.value.kind is ErrorKind.DEADLINE_EXCEEDED
    assert "does not listen on vsock port 1024" in caught.value.message
    assert common.processes_referencing(build) == []
    (log,) = build.glob("api-requests-*.jsonl")
    assert_clean([json.loads(line) for line in log.read_text().splitlines()])
