"""Guest templates: a guest booted once and kept as files, and the clones restored from it.

A template is a guest booted from the guest image with a given machine shape (vCPUs, memory,
kernel arguments) and ``auraed.template=1``: its auraed does all its imports, says so on the
host-only identity port and waits there (auraed/init/identity.py). The host then pauses it and
saves it: its RAM is already a file (a shared file-backed memory object under
``runtime_dir/templates/<name>/``), its device state goes to ``state`` by QEMU's migration with
``x-ignore-shared`` (only the device state, ~300 KB), and the VMM ends. A template has no
network, no config disk and never holds a key.

A clone is a VM started from the template's files (the backend maps the RAM private, loads the
device state, resumes it) that is then given its identity on its identity port before it serves:
fresh entropy, the time, its hostname and network, its own certificate and key from the host CA
(``send_identity``). A clone that did not take its identity is stopped and reported, never served.

With the daemon's vm_debug_console on, a template is made with the debug port (its record says
so) and its clones have it too, each on its own socket; with it flipped, the template is rebuilt
before its next clone (a clone's devices must be its template's, or QEMU refuses its state).

Room to grow: on a machine whose VMs grow by hotplug (QEMU's q35), a template is made with the
node's whole room (vm_max_vcpus, vm_max_memory_mib, vm_memory_slots) on its command line, which
its clones share; each clone is grown to its own size as it is restored (the backend hotplugs
vCPUs and memory, the guest onlines them as it takes its identity). So a VM of any size within
the room is a clone of the one ``auto`` template of its files and machine, made at the base size
(TEMPLATE_VCPUS, vm_template_memory_mib); a VM smaller than that base or beyond the room boots
cold (Guests.boot says why). Where VMs cannot grow (microvm, cloud-hypervisor) a clone is its
template's shape, and ``auto`` means the template of the VM's own shape.

Records are in the store (kind ``vm-template``). A template is rebuilt when what it was made
from changes (the files' content hash, the accelerator, the machine type, the room, the debug
console), and made on first use when a VM asks for ``auto`` (or before, at daemon start, for vm
pods: auraed.cri.vm_template): named ``auto-<hash of the shape>``. A template still used by a
running VM is not removed. At start, a template left building is cleaned up (its VMM killed, its
files removed) and one whose files are gone (a host reboot emptied the runtime dir) is made again
at its next use.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from auraed.errors import ErrorKind
from auraed.state.store import Store
from auraed.system.tasks import run_to_end
from auraed.vms import backend as common
from auraed.vms.backend import Backend, LaunchDisk, LaunchNet, LaunchSpec, MemoryImage, Room, VmHandle
from auraed.vms.errors import VmError
from auraed.vms.model import ACTIVE_STATES, ROOT_SERIAL, VmRecord, VmSpec, check_file, grown_memory_mib

log = logging.getLogger(__name__)

KIND = "vm-template"
AUTO = "auto"
AUTO_PREFIX = "auto-"
MEMORY_FILE = "memory"
STATE_FILE = "state"
TEMPLATE_MAC = "52:54:00:a0:00:00"  # a template's NIC (never on a network); each clone sets its own
IDENTITY_ARGS = ("auraed.hostname=", "auraed.ip=", "auraed.gateway=", "auraed.iface=")
IDENTITY_TIMEOUT = 30.0
ENTROPY_BYTES = 64
MAX_REPLY = 64 * 1024
TEMPLATE_VCPUS = 1
"""A template's vCPUs where its clones grow: the fewest a VM has."""


class TemplateState:
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"
    STALE = "stale"  # its files are gone or out of date: made again at its next use


@dataclasses.dataclass(frozen=True)
class TemplateShape:
    """What a clone must share with its template: what it boots from and its machine."""

    kernel: str
    initramfs: str
    root_disk: str
    vcpus: int
    memory_mib: int
    kernel_args: tuple[str, ...]  # the guest's own, without the identity ones (IDENTITY_ARGS)
    machine: str = ""  # QEMU's machine type, resolved (Backend.machine_of); "" on cloud-hypervisor

    @classmethod
    def of(cls, spec: VmSpec, machine: str = "") -> TemplateShape:
        return cls(
            kernel=spec.kernel,
            initramfs=spec.initramfs,
            root_disk=spec.root_disk,
            vcpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            kernel_args=tuple(a for a in spec.kernel_args if not a.startswith(IDENTITY_ARGS)),
            machine=machine,
        )

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()

    def files(self) -> list[str]:
        return [f for f in (self.kernel, self.initramfs, self.root_disk) if f]

    def describe(self) -> str:
        return f"{self.vcpus} vCPU, {self.memory_mib} MiB" + (f", {self.machine}" if self.machine else "")

    def size(self) -> tuple[int, int]:
        return self.vcpus, self.memory_mib


@dataclasses.dataclass
class TemplateRecord:
    name: str
    shape: TemplateShape
    backend: str
    run_dir: str  # runtime_dir/templates/<name>
    state: str = TemplateState.BUILDING
    digest: str = ""  # of the files' contents, the machine type and the accelerator
    accelerator: str = ""
    machine: str = ""
    build: int = 0  # each build has its own directory: build-<n>
    auto: bool = False
    reason: str = ""
    created_at: float = 0.0
    build_seconds: float = 0.0
    save_seconds: float = 0.0
    imports_seconds: float = 0.0
    debug_console: bool = False  # made with the debug port (vm_debug_console), so its clones have it
    # The room it was made with (its clones grow within it as they are restored); 0: none.
    max_vcpus: int = 0
    max_memory_mib: int = 0
    memory_slots: int = 0
    mem_total_kib: int = 0  # its guest's MemTotal, as it said when ready (a grown clone's is above it)

    @property
    def build_dir(self) -> Path:
        return Path(self.run_dir) / f"build-{self.build}"

    @property
    def room(self) -> Room | None:
        return Room(self.max_vcpus, self.max_memory_mib, self.memory_slots) if self.max_vcpus else None

    def image(self) -> MemoryImage:
        build = self.build_dir
        return MemoryImage(
            str(build / MEMORY_FILE),
            str(build / STATE_FILE),
            clone=True,
            debug_console=self.debug_console,
            vcpus=self.shape.vcpus,
            memory_mib=self.shape.memory_mib,
            room=self.room,
        )

    def fit_problem(self, vcpus: int, memory_mib: int) -> str | None:
        """Why a VM of ``vcpus`` and ``memory_mib`` cannot be this template's clone (None: it can):
        its shape's size without room, else at least the base size and within the room."""
        return size_problem(self.shape, self.room, vcpus, memory_mib)

    def files_present(self) -> bool:
        # The state is a file (QEMU's migration stream) or a directory (cloud-hypervisor's snapshot).
        return (self.build_dir / MEMORY_FILE).is_file() and (self.build_dir / STATE_FILE).exists()

    def memory_resident_bytes(self) -> int:
        """What the template's RAM file holds in memory (tmpfs pages), shared by its clones."""
        try:
            return os.stat(self.build_dir / MEMORY_FILE).st_blocks * 512
        except OSError:
            return 0

    def to_doc(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["shape"]["kernel_args"] = list(self.shape.kernel_args)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TemplateRecord:
        shape = dict(doc["shape"])
        shape["kernel_args"] = tuple(shape["kernel_args"])
        # A record saved before the shape named its machine: the one it was made on.
        shape.setdefault("machine", doc.get("machine", ""))
        return cls(**{**doc, "shape": TemplateShape(**shape)})


class _Fingerprints:
    """Content hashes of boot files, computed again only when a file's inode, size or times change."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, ...], str]] = {}

    def digest(self, path: str) -> str:
        info = os.stat(path)
        stamp = (info.st_ino, info.st_dev, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        known = self._known.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        self._known[path] = (stamp, digest.hexdigest())
        return digest.hexdigest()


class Templates:
    def __init__(
        self,
        store: Store,
        backends: dict[str, Backend],
        templates_dir: Path,
        ready_timeout: float,
        template_config: Callable[[], dict[str, str]],
        *,
        base_memory_mib: int = 256,
    ) -> None:
        self._base_memory_mib = base_memory_mib  # vm_template_memory_mib
        self._store = store
        self._template_config = template_config
        self._backends = backends
        self._dir = templates_dir
        self._ready_timeout = ready_timeout
        self._records: dict[str, TemplateRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._fingerprints = _Fingerprints()
        self._recover()

    # -- lookup ------------------------------------------------------------------------------

    def get(self, name: str) -> TemplateRecord:
        record = self._records.get(name)
        if record is None:
            raise VmError.not_found(f"VM template {name}")
        return record

    def all(self) -> builtins.list[TemplateRecord]:
        return [self._records[n] for n in sorted(self._records)]

    def users(self, name: str, vms: list[VmRecord]) -> list[str]:
        """The VMs running (or starting) as clones of ``name``."""
        return [r.name for r in vms if r.template == name and r.state in ACTIVE_STATES]

    def problem(self, backend: str) -> str | None:
        """Why VMs of ``backend`` cannot be cloned here (None: they can)."""
        chosen = self._backends.get(backend)
        if chosen is None:
            return f"backend {backend} is not available"
        return chosen.template_problem()

    def digest(self, shape: TemplateShape, backend: Backend) -> str:
        """What a template must be rebuilt for when it changes: the files' contents, the machine
        type, the accelerator, the room and the debug port (the last two only when there: a
        template made before either could be stays)."""
        parts = [self._fingerprints.digest(f) for f in shape.files()]
        parts += [shape.machine, str(getattr(backend, "accelerator", ""))]
        parts += ["debug_console"] if debug_console_of(backend) else []
        room = backend.template_room(shape.machine)
        parts += [f"room {room.max_vcpus} {room.max_memory_mib} {room.slots}"] if room else []
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def shape_for(self, spec: VmSpec, backend_name: str) -> TemplateShape:
        """The shape of the template a VM of ``spec`` is cloned from when it asks for ``auto``:
        where clones grow, the base size (TEMPLATE_VCPUS, vm_template_memory_mib), whatever the
        VM's; else the VM's own shape."""
        backend = self._backends[backend_name]
        machine = backend.machine_of(spec.machine)
        shape = TemplateShape.of(spec, machine)
        if backend.template_room(machine) is not None:
            shape = dataclasses.replace(shape, vcpus=TEMPLATE_VCPUS, memory_mib=self._base_memory_mib)
        return shape

    def clone_problem(self, spec: VmSpec, backend_name: str) -> str | None:
        """Why a VM of ``spec`` cannot be a clone of its ``auto`` template (None: it can): smaller
        than the template's base, or beyond its room. A VM naming a template is held to it at
        Allocate (check_shape) instead."""
        if spec.template != AUTO or backend_name not in self._backends:
            return None
        backend = self._backends[backend_name]
        shape = self.shape_for(spec, backend_name)
        return size_problem(shape, backend.template_room(shape.machine), spec.vcpus, spec.memory_mib)

    # -- making ------------------------------------------------------------------------------

    async def for_clone(self, spec: VmSpec, backend_name: str) -> TemplateRecord:
        """The template a VM of ``spec`` is cloned from, ready (made or rebuilt first when needed).

        ``spec.template`` is "auto" (the template of the VM's shape) or a template's name, whose
        shape must be the VM's (FAILED_PRECONDITION naming the difference otherwise).
        """
        if spec.template == AUTO:
            shape = self.shape_for(spec, backend_name)
            name = auto_name(shape, backend_name)
        else:
            name = spec.template
            self.check_shape(dataclasses.replace(spec, backend=backend_name))
            shape = self.get(name).shape
        return await self.ensure(name, shape, backend_name, auto=spec.template == AUTO)

    def check_shape(self, spec: VmSpec) -> None:
        """A VM naming a template must be of its shape but for its size, which must fit it (its
        own without room, else at least its base and within its room): FAILED_PRECONDITION
        naming the difference."""
        template = self.get(spec.template)
        if spec.backend and template.backend != spec.backend:
            raise VmError.precondition(_other_backend(template, spec.name, spec.backend))
        backend = self._backends.get(template.backend)
        machine = backend.machine_of(spec.machine) if backend is not None else template.shape.machine
        known = template.shape
        shape = dataclasses.replace(
            TemplateShape.of(spec, machine), vcpus=known.vcpus, memory_mib=known.memory_mib
        )
        misfit = template.fit_problem(spec.vcpus, spec.memory_mib)
        if known != shape or misfit:
            asked = dataclasses.replace(shape, vcpus=spec.vcpus, memory_mib=spec.memory_mib)
            raise VmError.precondition(
                f"VM {spec.name} ({asked.describe()}, kernel args {list(shape.kernel_args)}) does not "
                f"match template {spec.template} ({known.describe()}, kernel args {list(known.kernel_args)})"
                + ("" if known.files() == shape.files() else ", or boots other files")
                + (f": {misfit}" if misfit and known == shape else "")
            )

    async def ensure(
        self, name: str, shape: TemplateShape, backend_name: str, *, auto: bool
    ) -> TemplateRecord:
        """Template ``name`` of ``shape``, ready: made when missing, rebuilt when out of date."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            backend = self._backends[backend_name]
            for path in shape.files():
                check_file("template file", path)
            digest = await asyncio.to_thread(self.digest, shape, backend)
            record = self._records.get(name)
            if record is not None and record.backend != backend_name:
                # A snapshot is one VMM's own format: never restored by the other, nor remade.
                raise VmError.precondition(_other_backend(record, "", backend_name))
            if (
                record is not None
                and record.state == TemplateState.READY
                and record.digest == digest
                and record.files_present()
            ):
                return record
            if record is not None and record.shape != shape:
                raise VmError.already_exists(
                    f"VM template {name} (of another shape: {record.shape.describe()})"
                )
            why = "made" if record is None else f"rebuilt ({why_rebuilt(record, digest, backend)})"
            record = await self._build(
                name, shape=shape, backend_name=backend_name, digest=digest, auto=auto, previous=record
            )
            log.info(
                "VM template %s %s in %.1f s (imports %.1f s, saved in %.0f ms, %d MiB resident)",
                name,
                why,
                record.build_seconds,
                record.imports_seconds,
                record.save_seconds * 1000,
                record.memory_resident_bytes() >> 20,
            )
            return record

    async def _build(
        self,
        name: str,
        *,
        shape: TemplateShape,
        backend_name: str,
        digest: str,
        auto: bool,
        previous: TemplateRecord | None,
    ) -> TemplateRecord:
        backend = self._backends[backend_name]
        problem = backend.template_problem()
        if problem:
            raise VmError.precondition(f"VM template {name}: {problem}")
        room = backend.template_room(shape.machine)
        record = TemplateRecord(
            name=name,
            shape=shape,
            backend=backend_name,
            run_dir=str(self._dir / name),
            digest=digest,
            machine=shape.machine,
            build=(previous.build + 1) if previous is not None else 1,
            auto=auto,
            created_at=time.time(),
            debug_console=debug_console_of(backend),
            max_vcpus=room.max_vcpus if room else 0,
            max_memory_mib=room.max_memory_mib if room else 0,
            memory_slots=room.slots if room else 0,
        )
        self._save(record)  # building: a crash from here on is cleaned up at start
        old_build = previous.build_dir if previous is not None else None
        started = time.monotonic()
        try:
            await run_to_end(asyncio.to_thread(_fresh_dir, record.build_dir))
            handle = await backend.start(self._launch_spec(record))
            record.accelerator = handle.accelerator
            try:
                ready = await self._wait_ready(record, handle)
                record.imports_seconds = float(ready.get("imports_s", 0.0))
                record.mem_total_kib = int(ready.get("mem_total_kib", 0))
                record.save_seconds = await backend.save(handle, record.build_dir / STATE_FILE)
            finally:
                await run_to_end(backend.kill(handle))
        except BaseException as exc:
            record.state = TemplateState.FAILED
            record.reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc)
            await run_to_end(asyncio.to_thread(_remove_build, record.build_dir))
            self._save(record)
            raise
        record.build_seconds = time.monotonic() - started
        record.state = TemplateState.READY
        self._save(record)
        if old_build is not None and old_build != record.build_dir:
            # Running clones keep the old RAM file mapped: unlinking it frees it when they end.
            await asyncio.to_thread(_remove_build, old_build)
        return record

    def _launch_spec(self, record: TemplateRecord) -> LaunchSpec:
        shape = record.shape
        disks = (LaunchDisk(shape.root_disk, False, ROOT_SERIAL),) if shape.root_disk else ()
        args = [f"auraed.hostname=template-{record.name}", "auraed.role=guest", "auraed.template=1"]
        build = record.build_dir
        return LaunchSpec(
            name=f"template-{record.name}",
            vcpus=shape.vcpus,
            memory_mib=shape.memory_mib,
            kernel=shape.kernel,
            initramfs=shape.initramfs,
            disks=disks,
            cmdline=" ".join([*args, *shape.kernel_args]),
            # The same NIC as its clones', with no peer: a template is on no network.
            net=LaunchNet("", TEMPLATE_MAC, "", "", ""),
            run_dir=build,
            image=MemoryImage(
                str(build / MEMORY_FILE),
                str(build / STATE_FILE),
                clone=False,
                debug_console=record.debug_console,
                vcpus=shape.vcpus,
                memory_mib=shape.memory_mib,
                room=record.room,
            ),
            machine=shape.machine,
        )

    async def _wait_ready(self, record: TemplateRecord, handle: VmHandle) -> dict[str, Any]:
        """The guest booted: it is given the guests' config; then its "ready" line, once its
        Daemon has started as far as it can without an identity. Its console tail if it ends."""
        reader: asyncio.StreamReader = handle.identity[0]
        writer: asyncio.StreamWriter = handle.identity[1]
        message: dict[str, Any] = {}
        line = b""
        why = f"not ready within {self._ready_timeout:g} s"
        try:
            async with asyncio.timeout(self._ready_timeout):
                line = await reader.readline()
                if _json_line(line).get("template") == "booted":
                    writer.write(json.dumps({"template_config": self._template_config()}).encode() + b"\n")
                    await writer.drain()
                    line = await reader.readline()
            message = _json_line(line)
            why = "its VMM or guest ended before it was ready"
        except TimeoutError:
            pass
        except OSError as exc:
            why = f"its identity port failed: {exc}"
        if message.get("template") != "ready":
            tail = common.vmm_log_tail(record.build_dir) if not handle.alive else ""
            console = _console_tail(handle.console_path)
            raise VmError(
                ErrorKind.UNAVAILABLE,
                f"VM template {record.name}: {why}{': ' + tail if tail else ''}. Console tail:\n{console}",
            )
        return message

    # -- removing ----------------------------------------------------------------------------

    async def remove(self, name: str, vms: list[VmRecord]) -> None:
        async with self._locks.setdefault(name, asyncio.Lock()):
            record = self.get(name)
            users = self.users(name, vms)
            if users:
                raise VmError.precondition(f"VM template {name} is used by running VMs: {', '.join(users)}")
            await asyncio.to_thread(_remove_all, Path(record.run_dir))
            self._store.delete(KIND, name)
            self._records.pop(name, None)
        self._locks.pop(name, None)
        log.info("removed VM template %s", name)

    # -- persistence -------------------------------------------------------------------------

    def _save(self, record: TemplateRecord) -> None:
        self._store.put(KIND, record.name, record.to_doc())
        self._records[record.name] = record

    def _recover(self) -> None:
        for record in self._store.load(KIND, TemplateRecord.from_doc):
            self._records[record.name] = record
            if record.state == TemplateState.BUILDING:
                killed = common.kill_vmms_of(record.build_dir)
                _remove_build(record.build_dir)
                record.state, record.reason = TemplateState.FAILED, "auraed stopped while making it"
                log.warning(
                    "VM template %s was being made when auraed stopped; killed %s", record.name, killed
                )
                self._save(record)
            elif record.state == TemplateState.READY and not record.files_present():
                record.state, record.reason = (
                    TemplateState.STALE,
                    "its files are gone (made again at its next use)",
                )
                self._save(record)
        if self._records:
            log.info("recovered %d VM templates", len(self._records))


def auto_name(shape: TemplateShape, backend: str) -> str:
    """The name of the host's template of ``shape`` on ``backend`` (QEMU's as it always was)."""
    key = (
        shape.key() if backend == "qemu" else hashlib.sha256(f"{shape.key()}\n{backend}".encode()).hexdigest()
    )
    return AUTO_PREFIX + key[:12]


def debug_console_of(backend: Backend) -> bool:
    """Whether ``backend`` gives VMs the debug port (QEMU's vm_debug_console; never cloud-hypervisor)."""
    return bool(getattr(backend, "debug_console", False))


def why_rebuilt(record: TemplateRecord, digest: str, backend: Backend) -> str:
    """Why a template is made again: its state, the debug console flipped, or what its digest is of."""
    if record.state != TemplateState.READY:
        return f"it was {record.state}"
    if record.debug_console != debug_console_of(backend):
        return f"vm_debug_console is {'on' if debug_console_of(backend) else 'off'} now"
    if record.digest != digest:
        return "its files, machine type, room or accelerator changed"
    return "its files were gone"


def size_problem(shape: TemplateShape, room: Room | None, vcpus: int, memory_mib: int) -> str | None:
    """Why a VM of ``vcpus`` and ``memory_mib`` cannot be a clone of a template of ``shape`` made
    with ``room`` (None: it can): without room it must be of the shape's size; with room at
    least that (a clone grows, never shrinks) and within the room."""
    if room is None:
        if (vcpus, memory_mib) != shape.size():
            return f"its clones are its size ({shape.describe()}): its machine cannot grow them"
        return None
    if vcpus < shape.vcpus or memory_mib < shape.memory_mib:
        return (
            f"a clone is grown from its template's {shape.vcpus} vCPU and {shape.memory_mib} MiB, never "
            f"shrunk to {vcpus} vCPU and {memory_mib} MiB (vm_template_memory_mib)"
        )
    if vcpus > room.max_vcpus:
        return f"its template leaves room for {room.max_vcpus} vCPUs, not {vcpus} (vm_max_vcpus)"
    grown = grown_memory_mib(shape.memory_mib, memory_mib)
    if grown > room.max_memory_mib:
        return (
            f"its template leaves room for {room.max_memory_mib} MiB, not {grown} MiB "
            "(whole memory blocks; vm_max_memory_mib)"
        )
    return None


def _other_backend(template: TemplateRecord, vm: str, backend: str) -> str:
    who = f"VM {vm} runs" if vm else "the clone would run"
    return (
        f"VM template {template.name} was made with {template.backend}, and {who} on {backend}: "
        f"a template is restored only by the backend that saved it"
    )


# -- a clone's identity -------------------------------------------------------------------------


def identity_message(
    name: str, hostname: str, net: dict[str, str] | None, files: dict[str, str], share: str = ""
) -> dict[str, Any]:
    """What a clone is told before it serves (auraed/init/identity.py applies it); ``share``: the
    tag of the virtio-fs plugged into it, which it mounts."""
    extra = {"share": share} if share else {}
    return {
        **extra,
        "identity": 1,
        "name": name,
        "hostname": hostname,
        "entropy": base64.b64encode(os.urandom(ENTROPY_BYTES)).decode(),
        "time_ns": time.time_ns(),
        "net": net or {},
        "files": files,
    }


async def send_identity(
    handle: VmHandle, message: dict[str, Any], timeout: float = IDENTITY_TIMEOUT
) -> dict[str, Any]:
    """Give a clone its identity on its identity port and return its answer ("applied", its boot
    id); VmError when it failed, did not answer in time, or the port closed."""
    if handle.identity is None:
        raise VmError.internal("the clone has no identity port")
    reader: asyncio.StreamReader = handle.identity[0]
    writer: asyncio.StreamWriter = handle.identity[1]
    message = {**message, "time_ns": time.time_ns()}  # as late as possible
    try:
        async with asyncio.timeout(timeout):
            writer.write(json.dumps(message).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        raise VmError.deadline(f"the clone did not take its identity within {timeout:g} s") from None
    except OSError as exc:
        raise VmError(ErrorKind.UNAVAILABLE, f"the clone's identity port failed: {exc}") from None
    finally:
        writer.close()
        handle.identity = None
    reply = _json_line(line)
    if reply.get("identity") != "applied":
        why = reply.get("error") or ("its port closed" if not line else f"it answered {line[:200]!r}")
        raise VmError(ErrorKind.UNAVAILABLE, f"the clone did not take its identity: {why}")
    return reply


def _json_line(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line[:MAX_REPLY]) if line else {}
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _console_tail(path: Path, lines: int = 20) -> str:
    from auraed.vms import console

    return "\n".join(console.read_tail(path, lines, 1024))


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)


def _remove_build(path: Path) -> None:
    """A build's files, and its template's VMM if one is left; never its clones' (they name its
    RAM file too, and keep it mapped until they end)."""
    common.kill_vmms_of(path)
    shutil.rmtree(path, ignore_errors=True)


def _remove_all(path: Path) -> None:
    for build in path.glob("build-*"):
        _remove_build(build)
    shutil.rmtree(path, ignore_errors=True)
