"""Typed, validated VM specs (parsed from requests at the edge) and the records persisted for them."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Any

from auraed.api.aurae.vms import v0 as pb
from auraed.config import ROLES
from auraed.errors import ErrorKind
from auraed.names import validate_label
from auraed.vms.errors import VmError

BACKENDS = ("qemu", "cloud-hypervisor")
DEFAULT_VCPUS = 1
MAX_VCPUS = 255
DEFAULT_MEMORY_MIB = 512
MIN_MEMORY_MIB = 64
MAX_EXTRA_DISKS = 16
MAX_KERNEL_ARGS = 256
# x86's COMMAND_LINE_SIZE is 2048 bytes, including what auraed adds (~150 bytes).
MAX_KERNEL_ARGS_BYTES = 1700
SERIAL = re.compile(r"^[A-Za-z0-9_-]{1,20}$")
ROOT_SERIAL = "root"
# A VM of this role runs a guest auraed booted from the guest image, whose files fill in those
# it does not name (vms/guests.py).
GUEST_ROLE = "guest"


class State:
    ALLOCATING = "allocating"  # record written, kernel objects being made; torn down at start
    ALLOCATED = "allocated"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    EXITED = "exited"
    CRASHED = "crashed"


# States in which a VMM process may exist.
ACTIVE_STATES = frozenset({State.STARTING, State.RUNNING, State.STOPPING})
# States from which Start may boot the VM.
STARTABLE_STATES = frozenset({State.ALLOCATED, State.STOPPED, State.EXITED, State.CRASHED})


@dataclasses.dataclass(frozen=True)
class DiskSpec:
    path: str
    writable: bool
    serial: str


@dataclasses.dataclass(frozen=True)
class VmSpec:
    name: str
    vcpus: int
    memory_mib: int
    kernel: str
    initramfs: str
    root_disk: str
    extra_disks: tuple[DiskSpec, ...]
    kernel_args: tuple[str, ...]
    network: bool
    backend: str  # as requested: "", "qemu" or "cloud-hypervisor"
    role: str
    # A host directory the guest mounts at auraed.bootargs.SHARE_MOUNT (virtio-fs): a pod's
    # volumes. "": none.
    shared_dir: str = ""
    # The mount namespace (its pinned file) ``shared_dir`` is mounted in and virtiofsd serves it
    # from: a vm pod's own (auraed.cri.pod_share). "": the daemon's.
    shared_namespace: str = ""
    # A guest cloned from a template: "" boots cold, "auto" the host's template of its shape, or a
    # template's name (vms/templates.py).
    template: str = ""
    # The cgroup.procs files the VMM and its helpers (virtiofsd) start in, e.g. a pod's cgroup
    # (its owner makes and removes the cgroup). (): the daemon's own cgroup.
    cgroup_procs: tuple[str, ...] = ()
    # QEMU's machine type: "" the configured one at each start (vm_machine), else this one (a vm
    # pod's guest: cri_vm_machine).
    machine: str = ""

    @classmethod
    def guest(
        cls,
        name: str,
        vcpus: int,
        memory_mib: int,
        *,
        kernel: str = "",
        initramfs: str = "",
        root_disk: str = "",
        kernel_args: tuple[str, ...] = (),
        backend: str = "",
        **fields: Any,
    ) -> VmSpec:
        """A networked guest (the guest role) with no extra disk; its files, left empty, are the
        host's guest image's (Guests.complete fills them in). ``fields``: the optional ones."""
        return cls(
            name=name,
            vcpus=vcpus,
            memory_mib=memory_mib,
            kernel=kernel,
            initramfs=initramfs,
            root_disk=root_disk,
            extra_disks=(),
            kernel_args=kernel_args,
            network=True,
            backend=backend,
            role=GUEST_ROLE,
            **fields,
        )

    def files(self) -> list[tuple[str, str]]:
        """(field, path) of every file the VM boots from."""
        files = [("vm.kernel", self.kernel)]
        if self.initramfs:
            files.append(("vm.initramfs", self.initramfs))
        if self.root_disk:
            files.append(("vm.root_disk", self.root_disk))
        files += [(f"vm.extra_disks[{i}].path", d.path) for i, d in enumerate(self.extra_disks)]
        return files

    def to_doc(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["extra_disks"] = [dataclasses.asdict(d) for d in self.extra_disks]
        doc["kernel_args"] = list(self.kernel_args)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> VmSpec:
        return cls(
            **{
                **doc,
                "extra_disks": tuple(DiskSpec(**d) for d in doc["extra_disks"]),
                "kernel_args": tuple(doc["kernel_args"]),
                "cgroup_procs": tuple(doc.get("cgroup_procs", ())),
            }
        )

    def to_message(self) -> pb.VirtualMachine:
        return pb.VirtualMachine(
            name=self.name,
            vcpus=self.vcpus,
            memory_mib=self.memory_mib,
            kernel=self.kernel,
            initramfs=self.initramfs,
            root_disk=self.root_disk,
            extra_disks=[
                pb.Disk(path=d.path, writable=d.writable, serial=d.serial) for d in self.extra_disks
            ],
            kernel_args=list(self.kernel_args),
            network=self.network,
            backend=self.backend,
            role=self.role,
            template=self.template,
        )


@dataclasses.dataclass(frozen=True)
class NetInfo:
    """A VM's share of the address pool: block ``index`` (a /30), its tap, both addresses.

    With ``netns``, a network its allocator brought instead (a pod's): the tap lives in the
    network namespace pinned at that path, made and removed with the namespace by its owner;
    ``host_ip`` is the gateway the guest routes through, ``index`` -1 (no block of the pool).
    """

    index: int
    tap: str
    host_ip: str
    guest_ip: str
    prefixlen: int
    mac: str
    netns: str = ""

    @property
    def from_pool(self) -> bool:
        return not self.netns

    @property
    def netmask(self) -> str:
        bits = (0xFFFFFFFF << (32 - self.prefixlen)) & 0xFFFFFFFF
        return ".".join(str((bits >> shift) & 0xFF) for shift in (24, 16, 8, 0))

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> NetInfo:
        return cls(**doc)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """The VMM process of a running VM: identity (pid + start ticks) and its control socket."""

    pid: int
    start_ticks: int | None
    control_socket: str
    console_path: str
    accelerator: str
    # QEMU's machine type, and the room the VMM was started with to grow (Resize; 0: none).
    machine: str = ""
    max_vcpus: int = 0
    max_memory_mib: int = 0

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> RunInfo:
        return cls(**doc)


@dataclasses.dataclass
class VmRecord:
    spec: VmSpec
    backend: str  # resolved: "qemu" or "cloud-hypervisor"
    run_dir: str  # runtime_dir/vms/<name>: control socket, console log, VMM log
    state: str = State.ALLOCATING
    net: NetInfo | None = None
    run: RunInfo | None = None
    accelerator: str = ""
    started_at: float = 0.0
    finished_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    console_tail: list[str] = dataclasses.field(default_factory=list)
    template: str = ""  # the template this run was cloned from ("": booted cold)
    restore_ms: float | None = None  # a clone: loading its state and resuming it took this long
    # What Resize plugged into this run (on top of what it booted with; the spec holds the sum).
    plugged_vcpus: int = 0
    plugged_memory_mib: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def state_with_reason(self) -> str:
        """'crashed (killed by signal 9)', 'stopped: the guest powered off' (a reason that starts
        with the state stands alone), or the state alone."""
        if not self.reason or self.reason == self.state:
            return self.state
        return self.reason if self.reason.startswith(self.state) else f"{self.state} ({self.reason})"

    @property
    def console_path(self) -> Path:
        return Path(self.run_dir) / "console.log"

    def to_doc(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["spec"] = self.spec.to_doc()
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> VmRecord:
        return cls(
            **{
                **doc,
                "spec": VmSpec.from_doc(doc["spec"]),
                "net": NetInfo.from_doc(doc["net"]) if doc.get("net") else None,
                "run": RunInfo.from_doc(doc["run"]) if doc.get("run") else None,
            }
        )


MEMORY_BLOCK_MIB = 128
"""Linux on x86-64 onlines memory in blocks of 128 MiB (below 64 GiB of RAM): memory is plugged
in whole blocks, so that every DIMM starts and ends on one."""


def grown_memory_mib(current_mib: int, wanted_mib: int) -> int:
    """The memory a VM of ``current_mib`` has once grown to at least ``wanted_mib``: whole blocks
    added (nothing when it has as much already)."""
    missing = max(0, wanted_mib - current_mib)
    return current_mib + -(-missing // MEMORY_BLOCK_MIB) * MEMORY_BLOCK_MIB


# -- validation ---------------------------------------------------------------------------------


def host_memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_file(field: str, path: str) -> None:
    """The file must exist and be a readable regular file (or block device): NOT_FOUND naming it."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise VmError(ErrorKind.NOT_FOUND, f"{field}: {path} not found") from None
    except OSError as exc:
        raise VmError.invalid(field, f"cannot access {path}: {exc.strerror}") from None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISBLK(info.st_mode)):
        raise VmError.invalid(field, f"{path} is not a regular file or block device")
    if not os.access(path, os.R_OK):
        raise VmError.invalid(field, f"{path} is not readable")


def parse_path(value: str, field: str, required: bool) -> str:
    """A file a VM boots from, normalized: absolute, and one a VMM command line can carry."""
    if not value:
        if required:
            raise VmError.invalid(field, "is required")
        return ""
    if "\0" in value or len(value) > 4096:
        raise VmError.invalid(field, "is not a plausible path")
    if not os.path.isabs(value):
        raise VmError.invalid(field, f"{value[:80]!r} is not an absolute path")
    # QEMU's -drive/-kernel options are comma-separated: a comma would be read as an option.
    if "," in value:
        raise VmError.invalid(field, f"{value[:80]!r} contains a comma, which VMM command lines cannot carry")
    return os.path.normpath(value)


def parse_kernel_args(values: list[str]) -> tuple[str, ...]:
    if len(values) > MAX_KERNEL_ARGS:
        raise VmError.invalid("vm.kernel_args", f"more than {MAX_KERNEL_ARGS} arguments")
    for index, arg in enumerate(values):
        if not arg or any(c.isspace() or not c.isprintable() for c in arg):
            raise VmError.invalid(
                f"vm.kernel_args[{index}]",
                f"{arg[:80]!r} must be one non-empty argument of printable characters without whitespace",
            )
    if sum(len(a) + 1 for a in values) > MAX_KERNEL_ARGS_BYTES:
        raise VmError.invalid("vm.kernel_args", f"longer than {MAX_KERNEL_ARGS_BYTES} bytes in all")
    return tuple(values)


def _disks(values: list[pb.Disk]) -> tuple[DiskSpec, ...]:
    if len(values) > MAX_EXTRA_DISKS:
        raise VmError.invalid("vm.extra_disks", f"more than {MAX_EXTRA_DISKS} disks")
    disks = []
    seen = {ROOT_SERIAL}
    for index, disk in enumerate(values):
        field = f"vm.extra_disks[{index}]"
        serial = disk.serial or f"disk{index + 1}"
        if not SERIAL.match(serial):
            raise VmError.invalid(
                f"{field}.serial", f"{serial[:40]!r} is not 1-20 characters of [A-Za-z0-9_-]"
            )
        if serial in seen:
            raise VmError.invalid(f"{field}.serial", f"{serial!r} is used by another disk")
        seen.add(serial)
        disks.append(DiskSpec(parse_path(disk.path, f"{field}.path", True), bool(disk.writable), serial))
    return tuple(disks)


def parse_vm(message: pb.VirtualMachine | None, *, memory_limit_mib: int | None = None) -> VmSpec:
    """Validate a request's VM into a VmSpec; every file must exist (NOT_FOUND names the path).

    A guest's kernel may be left out: Guests.complete fills in the guest image's.
    """
    if message is None:
        raise VmError.invalid("vm", "is required")
    name = validate_label(message.name, "vm.name")
    vcpus = message.vcpus or DEFAULT_VCPUS
    if not 1 <= vcpus <= MAX_VCPUS:
        raise VmError.invalid("vm.vcpus", f"{vcpus} is out of range 1..{MAX_VCPUS}")
    memory = message.memory_mib or DEFAULT_MEMORY_MIB
    limit = host_memory_mib() if memory_limit_mib is None else memory_limit_mib
    if memory < MIN_MEMORY_MIB:
        raise VmError.invalid(
            "vm.memory_mib", f"{memory} MiB is less than the minimum of {MIN_MEMORY_MIB} MiB"
        )
    if limit and memory > limit:
        raise VmError.invalid(
            "vm.memory_mib", f"{memory} MiB is more than the host has ({limit} MiB MemTotal)"
        )
    backend = message.backend
    if backend and backend not in BACKENDS:
        raise VmError.invalid(
            "vm.backend", f"{backend[:40]!r} is not one of {', '.join(BACKENDS)} (or empty)"
        )
    role = message.role
    if role and role not in ROLES:
        raise VmError.invalid("vm.role", f"{role[:40]!r} is not one of {', '.join(ROLES)} (or empty)")
    spec = VmSpec(
        name=name,
        vcpus=vcpus,
        memory_mib=memory,
        kernel=parse_path(message.kernel, "vm.kernel", role != GUEST_ROLE),
        initramfs=parse_path(message.initramfs, "vm.initramfs", False),
        root_disk=parse_path(message.root_disk, "vm.root_disk", False),
        extra_disks=_disks(list(message.extra_disks)),
        kernel_args=parse_kernel_args(list(message.kernel_args)),
        network=bool(message.network),
        backend=backend,
        role=role,
        template=_template(message.template, role),
    )
    for field, path in spec.files():
        if path:  # a guest's kernel left out: the guest image's, checked as it is filled in
            check_file(field, path)
    return spec


def _template(value: str, role: str) -> str:
    template = value if value in ("", "auto") else validate_label(value, "vm.template")
    if template and role != GUEST_ROLE:
        raise VmError.invalid("vm.template", f"only a guest (role {GUEST_ROLE!r}) is cloned from a template")
    return template
