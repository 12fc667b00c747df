"""The QEMU backend: microvm (default) or q35, KVM when it really works and TCG otherwise, QMP control.

- ``-M microvm,x-option-roms=off,isa-serial=on,rtc=on`` with virtio-*-device (virtio-mmio,
  described to the guest through ACPI), or ``-M q35`` with virtio-*-pci;
- ``-accel kvm -cpu host`` only when the KVM probe says guests really run; otherwise
  ``-accel tcg -cpu max``;
- on microvm the kernel gets ``tsc_early_khz=<host TSC kHz>``: without it microvm hangs on about one
  boot in three (the TSC calibration against the PIT races under emulation);
- disks are raw images attached ``if=none`` (read-only unless asked), the root disk first with serial
  "root"; the NIC is the VM's tap (``script=no,downscript=no``) with its MAC;
- the serial console goes to a file (chardev file), readable while it grows; QMP listens on a unix
  socket (``server=on,wait=off``); ``-no-reboot``: a guest reboot ends the VM, it is reported;
- QEMU runs sandboxed (``-sandbox on``: no spawning, no privilege changes) in its own session;
- a shared directory (a pod's volumes) is served by virtiofsd (QEMU's, from qemu-system-common)
  over vhost-user: the guest's RAM is then a shared memfd (vhost-user needs to map it), and the
  device is vhost-user-fs with the tag auraed.bootargs.SHARE_TAG. virtiofsd is started in the
  directory's mount namespace when it has one (``nsenter --mount``), and runs in its own
  namespace sandbox and ends when QEMU disconnects; what the guest may write there is what the
  mounts of the directory allow in that namespace (a vm pod's share: auraed.cri.pod_share), and
  its xattrs are mapped (VIRTIOFS_XATTR_MAP: a guest's trusted.* is the host's user.virtiofs.*);
- the machine type is the VM's own (``LaunchSpec.machine``: a vm pod's is cri_vm_machine) or the
  configured one (vm_machine);
- on q35 a VM starts with room to grow (``-smp N,maxcpus=M``, ``-m SIZE,slots=S,maxmem=MAX``),
  ``memhp_default_state=online`` and ``swiotlb=noforce`` on its kernel command line (see
  kernel_args); ``grow`` hotplugs vCPUs (``device_add`` of a slot ``query-hotpluggable-cpus``
  reports free) and memory (a ``pc-dimm`` over a new memory object: a shared memfd when the VM's
  RAM is, for virtiofsd, else plain RAM). A template is made with the node's whole room at its
  base size (templates.py), and each clone starts as its template did (its command line must be
  the template's) and is grown to its own size right after its restore, before its guest is
  given its identity. microvm has no hotplug at all (nor room);
- on q35 a template and its clones have one free PCIe root port (HOTPLUG_PORT); a clone with a
  shared directory maps its own copy of the template's RAM file shared (vhost-user maps it; the
  file is unlinked once QEMU has it) and gets vhost-user-fs-pci plugged there after its restore
  (QEMU 7.2 cannot migrate it, so no template has it); microvm cannot (such a clone boots cold);
- with ``debug_console`` (vm_debug_console) a VM booted cold or a template gets a second
  virtio-serial port, ``auraed.bootargs.DEBUG_PORT``, on a unix socket QEMU listens on
  (``debug.sock`` in the run dir), and ``auraed.debug_console=1`` on its kernel command line (the
  guest's PID 1 then runs a shell there); a clone has the port when its template has it
  (``MemoryImage.debug_console``: a clone's devices must be its template's), on its own socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from auraed.bootargs import DEBUG_PORT, IDENTITY_PORT, SHARE_TAG
from auraed.config import VM_MACHINES
from auraed.errors import ErrorKind
from auraed.images.content import SHARED_XATTR_PREFIX
from auraed.system import processes
from auraed.system.tasks import run_to_end
from auraed.vms import backend as common
from auraed.vms import network
from auraed.vms.backend import NO_ROOM, ExitInfo, LaunchSpec, MemoryImage, Room, VmHandle
from auraed.vms.errors import VmError
from auraed.vms.model import RunInfo, grown_memory_mib, host_memory_mib
from auraed.vms.qmp import QmpClient, QmpError

log = logging.getLogger(__name__)

MACHINES = VM_MACHINES
QMP_SOCKET = "qmp.sock"
STATUS_TIMEOUT = 5.0
QUIT_WAIT = 5.0
VIRTIOFS_SOCKET = "virtiofs.sock"
VIRTIOFSD_LOG = "virtiofsd.log"
NSENTER = "nsenter"
"""util-linux's, which starts virtiofsd in a shared directory's mount namespace."""
VIRTIOFSD_START = 10.0
"""Seconds virtiofsd has to open its socket."""
MICROVM = "microvm,x-option-roms=off,isa-serial=on,rtc=on"
MEMORY_ID = "ram0"
MIGRATION_POLL = 0.005
MIGRATION_TIMEOUT = 60.0
MIB = 1024 * 1024
HOTPLUG_MEMORY_ARG = "memhp_default_state=online"
NO_SWIOTLB_ARG = "swiotlb=noforce"
DIMM_PREFIX = "dimm"
DIMM_MEMORY_PREFIX = "mem-dimm"
DEBUG_CONSOLE_ARG = "auraed.debug_console=1"
CLONE_MEMORY_FILE = "memory"
"""A clone's own copy of its template's RAM file, in its run dir (unlinked once QEMU has it)."""
SHARE_CHARDEV = "fs0"
SHARE_DEVICE = "share0"
HOTPLUG_PORT = "hotplug0"
VIRTIOFS_XATTR_MAP = (
    f"/prefix/all/trusted./{SHARED_XATTR_PREFIX}/"
    f"/bad/client/{SHARED_XATTR_PREFIX}//"
    "/ok/all/user./user./"
    "/ok/all/security.capability/security.capability/"
    "/unsupported/all///"
)
"""The xattrs virtiofsd lets a guest read and write (its -o xattrmap rules, the first matching a
name applying). A guest's ``trusted.X`` is the host's ``user.virtiofs.trusted.X``: a guest's overlay
reads the opaque mark of the host's layer snapshots there (auraed.images.content), and what a
guest sets on a writable volume lands there, never in the host's own trusted.* (which virtiofsd,
without CAP_SYS_ADMIN, could not read anyway). A guest naming user.virtiofs.* itself is refused;
user.* and file capabilities pass as they are; anything else is unsupported, as on a filesystem
without it."""
"""A q35 template's (and so its clones') free PCIe root port: a clone's virtio-fs is plugged there."""


def host_tsc_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The host's TSC frequency in kHz, from the first "cpu MHz" line of /proc/cpuinfo."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu MHz":
                return round(float(value) * 1000)
    except (OSError, ValueError):
        pass
    return None


def build_command(
    spec: LaunchSpec,
    *,
    binary: str,
    machine: str,
    accelerator: str,
    qmp_socket: Path,
    console_path: Path,
    kernel_cmdline: str,
    tap_fd: int = -1,
    room: Room | None = None,
    debug_console: bool = False,
    tcg_cache_mib: int = 0,
) -> list[str]:
    """The QEMU command line for a VM (pure: tested without QEMU); ``room``: what it can grow to
    (q35 only); ``debug_console``: the debug port (for a clone: its template's, see debug_wanted)."""
    if machine not in MACHINES:
        raise ValueError(f"unknown machine {machine!r}")
    mmio = machine == "microvm"
    blk = "virtio-blk-device" if mmio else "virtio-blk-pci"
    nic = "virtio-net-device" if mmio else "virtio-net-pci"
    rng = "virtio-rng-device" if mmio else "virtio-rng-pci"
    image = spec.image
    machine_arg = MICROVM if mmio else "q35"
    if image is not None or spec.shared_dir:
        # A template's RAM file, or a shared memfd virtiofsd maps (vhost-user).
        machine_arg += f",memory-backend={MEMORY_ID}"
    vcpus, memory_mib = spec.boot_size()
    smp, memory = str(vcpus), f"{memory_mib}M"
    if room is not None and not mmio:
        if room.max_vcpus > vcpus:
            smp += f",maxcpus={room.max_vcpus}"
        if room.slots and room.max_memory_mib > memory_mib:
            memory += f",slots={room.slots},maxmem={room.max_memory_mib}M"
    argv = [
        binary,
        "-name", f"{spec.name},debug-threads=on",
        "-M", machine_arg,
        "-accel", accel_option(accelerator, tcg_cache_mib),
        "-cpu", "host" if accelerator == "kvm" else "max",
        "-smp", smp,
        "-m", memory,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-kernel", spec.kernel,
        "-append", kernel_cmdline,
        "-chardev", f"file,id=console,path={console_path}",
        "-serial", "chardev:console",
        "-qmp", f"unix:{qmp_socket},server=on,wait=off",
        "-object", "rng-random,id=rng0,filename=/dev/urandom",
        "-device", f"{rng},rng=rng0",
    ]  # fmt: skip
    if spec.initramfs:
        argv += ["-initrd", spec.initramfs]
    if spec.shared_dir and image is None:
        fs = "vhost-user-fs-device" if mmio else "vhost-user-fs-pci"
        argv += [
            "-object", f"memory-backend-memfd,id=ram0,size={spec.memory_mib}M,share=on",
            "-chardev", f"socket,id=fs0,path={spec.run_dir / VIRTIOFS_SOCKET}",
            "-device", f"{fs},chardev=fs0,tag={SHARE_TAG}",
        ]  # fmt: skip
        if mmio:
            # virtiofsd's libvhost-user serves virtio 1.0 only; microvm's virtio-mmio is legacy
            # (0.9.5) unless told otherwise.
            argv += ["-global", "virtio-mmio.force-legacy=false"]
    for index, disk in enumerate(spec.disks):
        readonly = "off" if disk.writable else "on"
        argv += [
            "-drive", f"id=disk{index},file={disk.path},format=raw,if=none,readonly={readonly}",
            "-device", f"{blk},drive=disk{index},serial={disk.serial}",
        ]  # fmt: skip
    if spec.net is not None and not spec.net.tap:
        # A template's NIC has no peer: it is never on a network (its clones' are, the same device).
        argv += ["-device", f"{nic},mac={spec.net.mac}"]
    elif spec.net is not None:
        # A tap in a namespace (a pod's) is handed over open: QEMU would look its name up in its own.
        tap = f"fd={tap_fd}" if tap_fd >= 0 else f"ifname={spec.net.tap},script=no,downscript=no"
        argv += [
            "-netdev", f"tap,id=net0,{tap}",
            "-device", f"{nic},netdev=net0,mac={spec.net.mac}",
        ]  # fmt: skip
    if image is not None:
        argv += image_arguments(spec, image, mmio)
    if debug_console:
        argv += debug_arguments(spec, mmio)
    return argv


def accel_option(accelerator: str, tcg_cache_mib: int) -> str:
    """``-accel``'s value: TCG with its translation cache capped at ``tcg_cache_mib`` (0: QEMU's own
    size, 1 GiB on a 64-bit host, which each VM fills with the code its guest runs, privately)."""
    if accelerator == "tcg" and tcg_cache_mib > 0:
        return f"tcg,tb-size={tcg_cache_mib}"
    return accelerator


def debug_arguments(spec: LaunchSpec, mmio: bool) -> list[str]:
    """The debug console's port: its own virtio-serial bus, on ``debug.sock`` in the run dir (after
    a template's own devices: a clone's are in the same order, its socket in its own run dir)."""
    serial = "virtio-serial-device" if mmio else "virtio-serial-pci"
    return [
        "-device", f"{serial},id=debug-bus",
        "-chardev", f"socket,id=debug,path={spec.run_dir / common.DEBUG_SOCKET},server=on,wait=off",
        "-device", f"virtserialport,bus=debug-bus.0,chardev=debug,name={DEBUG_PORT}",
    ]  # fmt: skip


def image_arguments(spec: LaunchSpec, image: MemoryImage, mmio: bool) -> list[str]:
    """A template's or a clone's own arguments, after the devices they share with every guest.

    The RAM is a file-backed memory object: shared while the template is made (the file is its
    RAM), private for a clone (copy-on-write: clones share every page they have not written). The
    host-only identity port is a virtio-serial port on a unix socket QEMU listens on. A clone
    waits for its device state (``-incoming defer``; the host loads it with migrate-incoming).
    """
    # A clone with a shared directory maps its own copy of the RAM file shared (CLONE_MEMORY_FILE,
    # see QemuBackend.start): vhost-user (virtiofsd) maps the guest's RAM too.
    share = "off" if image.clone and not spec.shared_dir else "on"
    memory_path = spec.run_dir / CLONE_MEMORY_FILE if image.clone and spec.shared_dir else image.memory_path
    serial = "virtio-serial-device" if mmio else "virtio-serial-pci"
    _, memory_mib = spec.boot_size()
    argv = [
        "-object",
        f"memory-backend-file,id={MEMORY_ID},size={memory_mib}M,mem-path={memory_path},share={share}",
        "-device", f"{serial},id=identity-bus",
        "-chardev", f"socket,id=identity,path={spec.run_dir / common.IDENTITY_SOCKET},server=on,wait=off",
        "-device", f"virtserialport,bus=identity-bus.0,chardev=identity,name={IDENTITY_PORT}",
    ]  # fmt: skip
    if not mmio:
        # Empty in the template: what a clone needs that a template cannot hold (vhost-user-fs
        # is unmigratable in QEMU 7.2) is plugged into it after the restore.
        argv += ["-device", f"pcie-root-port,id={HOTPLUG_PORT},chassis=1"]
    if image.clone:
        argv += ["-incoming", "defer"]
    return argv


class QemuBackend:
    name = "qemu"

    def __init__(
        self,
        *,
        binary: str = "qemu-system-x86_64",
        machine: str = "microvm",
        kvm_usable: Callable[[], bool] = lambda: False,
        virtiofsd: str = "/usr/lib/qemu/virtiofsd",
        max_vcpus: int = 0,
        max_memory_mib: int = 0,
        memory_slots: int = 10,
        debug_console: bool = False,
        tcg_cache_mib: int = 0,
    ) -> None:
        if machine not in MACHINES:
            raise VmError(ErrorKind.INVALID_ARGUMENT, f"vm_machine: {machine!r} is not one of {MACHINES}")
        self.binary = binary
        self.machine = machine
        self._kvm_usable = kvm_usable
        self.virtiofsd = virtiofsd
        # 0: the host's online CPUs / its MemTotal (the config's vm_max_vcpus, vm_max_memory_mib).
        self.max_vcpus = max_vcpus
        self.max_memory_mib = max_memory_mib
        self.memory_slots = memory_slots
        self.debug_console = debug_console
        self.tcg_cache_mib = tcg_cache_mib  # vm_tcg_cache_mib

    def machine_of(self, requested: str) -> str:
        """The VM's own machine type, else the configured one (vm_machine)."""
        if requested and requested not in MACHINES:
            raise VmError(ErrorKind.INVALID_ARGUMENT, f"machine: {requested!r} is not one of {MACHINES}")
        return requested or self.machine

    def template_room(self, machine: str) -> Room | None:
        """The node's room (vm_max_vcpus, vm_max_memory_mib, vm_memory_slots) on q35; None on
        microvm, which cannot hotplug."""
        if self.machine_of(machine) != "q35":
            return None
        return Room(
            self.max_vcpus or os.cpu_count() or 1, self.max_memory_mib or host_memory_mib(), self.memory_slots
        )

    def room(self, spec: LaunchSpec) -> Room:
        """The room ``spec`` gets to grow: a template's or a clone's is the template's (a clone's
        command line must be its template's); none on microvm."""
        if spec.image is not None:
            return spec.image.room or NO_ROOM
        most = self.template_room(spec.machine)
        if most is None:
            return NO_ROOM
        vcpus = max(spec.vcpus, most.max_vcpus)
        memory = max(spec.memory_mib, most.max_memory_mib)
        return Room(vcpus, memory, most.slots if memory > spec.memory_mib else 0)

    def debug_wanted(self, spec: LaunchSpec) -> bool:
        """Whether ``spec`` gets the debug port: the daemon's setting for a VM booted cold; for a
        template and its clones, what the template's record says (templates.py: the setting as
        it was made)."""
        if spec.image is not None:
            return spec.image.debug_console
        return self.debug_console

    def problem(self) -> str | None:
        if shutil.which(self.binary) is None:
            return f"QEMU ({self.binary}) is not installed"
        return None

    @property
    def accelerator(self) -> str:
        return "kvm" if self._kvm_usable() else "tcg"

    def kernel_args(self, machine: str = "") -> list[str]:
        args = ["console=ttyS0"]
        if self.machine_of(machine) == "microvm":
            khz = host_tsc_khz()
            if khz:
                args.append(f"tsc_early_khz={khz}")
        else:
            # Memory plugged in (Resize) is onlined by the kernel itself; CPUs by the guest's auraed.
            # Room for memory puts the hotplug range above 4 GiB (ACPI SRAT), and a kernel that
            # may have memory there reserves 64 MiB of bounce buffers (SWIOTLB) out of the guest's
            # RAM at boot: 13% of a 512 MiB guest. Our q35 devices are virtio (guest-physical
            # addresses, no DMA API) and need none.
            args += [HOTPLUG_MEMORY_ARG, NO_SWIOTLB_ARG]
        return args

    def console_log_path(self, run_dir: Path) -> Path:
        return run_dir / common.CONSOLE_LOG

    async def start(self, spec: LaunchSpec) -> VmHandle:
        shared_clone = spec.image is not None and spec.image.clone and bool(spec.shared_dir)
        if not shared_clone:
            return await self._start(spec, shared_clone=False)
        assert spec.image is not None
        problem = self.shared_clone_problem(spec.machine)
        if problem:
            raise VmError.precondition(problem)
        copy = spec.run_dir / CLONE_MEMORY_FILE
        try:
            source = Path(spec.image.memory_path)
            took, copied = await run_to_end(copy_sparse(source, copy, spec.cgroup_procs))
            handle = await self._start(spec, shared_clone=True)
        finally:
            common.remove_quietly(copy)  # never left, the clone made or not
        plugged = handle.share_plug[2] if handle.share_plug is not None else 0.0
        handle.share_plug = (took, copied, plugged)
        log.info(
            "VM %s: RAM copied for its shared directory in %.0f ms (%d MiB of data), "
            "virtio-fs plugged in %.0f ms",
            spec.name, took * 1000, copied >> 20, plugged * 1000,
        )  # fmt: skip
        return handle

    async def _start(self, spec: LaunchSpec, *, shared_clone: bool) -> VmHandle:
        problem = self.problem()
        if problem:
            raise VmError.precondition(problem)
        run_dir = spec.run_dir
        qmp_socket = run_dir / QMP_SOCKET
        console = self.console_log_path(run_dir)
        common.remove_quietly(qmp_socket, run_dir / common.DEBUG_SOCKET)
        debug = self.debug_wanted(spec)
        machine = self.machine_of(spec.machine)
        # Before the VM's own words: a kernel_args "auraed.debug_console=0" overrides it.
        words = [*self.kernel_args(machine), *([DEBUG_CONSOLE_ARG] if debug else []), spec.cmdline]
        cmdline = " ".join(words).strip()
        accelerator = self.accelerator
        tap_fd = state_fd = -1
        if spec.shared_dir:
            await self._start_virtiofsd(spec)
        if spec.image is not None:
            common.remove_quietly(run_dir / common.IDENTITY_SOCKET)
            if spec.image.clone:
                state_fd = os.open(spec.image.state_path, os.O_RDONLY | os.O_CLOEXEC)
        if spec.net is not None and spec.net.netns:
            try:
                tap_fd = await asyncio.to_thread(network.open_tap_in, spec.net.netns, spec.net.tap)
            except BaseException:
                if state_fd >= 0:
                    os.close(state_fd)
                raise
        room = self.room(spec)
        try:
            argv = build_command(
                spec,
                room=room,
                binary=self.binary,
                machine=machine,
                accelerator=accelerator,
                qmp_socket=qmp_socket,
                console_path=console,
                kernel_cmdline=cmdline,
                tap_fd=tap_fd,
                debug_console=debug,
                tcg_cache_mib=self.tcg_cache_mib,
            )
            log.debug("starting VM %s: %s", spec.name, " ".join(argv))
            # To completion: a QEMU spawned by a thread its caller stopped waiting for would run on.
            fds = tuple(fd for fd in (tap_fd, state_fd) if fd >= 0)
            process = await run_to_end(asyncio.to_thread(common.spawn, argv, run_dir, fds, spec.cgroup_procs))
        finally:
            for fd in (tap_fd, state_fd):
                if fd >= 0:
                    os.close(fd)  # QEMU has its own
        handle = VmHandle(
            backend=self.name,
            pid=process.pid,
            start_ticks=processes.start_ticks(process.pid),
            control_socket=qmp_socket,
            console_path=console,
            accelerator=accelerator,
            process=process,
            client=QmpClient(qmp_socket),
            machine=machine,
            max_vcpus=room.max_vcpus,
            max_memory_mib=room.max_memory_mib,
        )
        try:
            await self._bring_up(handle, spec, state_fd, shared_clone)
        except BaseException:
            if handle.identity is not None:
                handle.identity[1].close()
            await run_to_end(self.kill(handle))
            raise
        return handle

    async def _bring_up(self, handle: VmHandle, spec: LaunchSpec, state_fd: int, shared_clone: bool) -> None:
        """QMP connected; a template's or a clone's identity port; a clone restored (and its
        virtio-fs plugged); the VM running."""
        await self._connect(handle, spec.timeout)
        if spec.image is not None:
            # Connected before the guest runs (a clone: before its state is loaded), so the
            # port is open on the host's side all along, in the template as in its clones.
            handle.identity = await asyncio.open_unix_connection(spec.run_dir / common.IDENTITY_SOCKET)
        if shared_clone:
            # QEMU has mapped its copy (its memory objects exist before QMP answers): the file
            # goes, its pages stay QEMU's (and virtiofsd's) until they end.
            common.remove_quietly(spec.run_dir / CLONE_MEMORY_FILE)
        if spec.image is not None and spec.image.clone:
            handle.restored_in = await self._restore(handle, state_fd)
            if (spec.vcpus, spec.memory_mib) != spec.boot_size():
                # Before its virtio-fs: virtiofsd is then given the whole memory table at once.
                started = time.monotonic()
                handle.grown = await self.grow(
                    handle, vcpus=spec.vcpus, memory_mib=spec.memory_mib, shared=shared_clone
                )
                handle.grown_in = time.monotonic() - started
        if shared_clone:
            handle.share_plug = (0.0, 0, await self._plug_share(handle, spec))
        status = await self.status(handle)
        if status not in ("running", "prelaunch"):
            raise VmError.internal(f"QEMU reports the new VM {status!r}, not running")

    def shared_clone_problem(self, machine: str = "") -> str | None:
        """Why a clone of ``machine`` cannot have a shared directory (None: it can, q35's hotplug)."""
        machine = self.machine_of(machine)
        if machine != "q35":
            return (
                f"QEMU's {machine} machine cannot hotplug: a clone's virtio-fs is plugged after its "
                'restore (QEMU 7.2 cannot migrate vhost-user-fs), which needs vm_machine = "q35" '
                '(cri_vm_machine = "q35" for vm pods)'
            )
        return None

    async def _plug_share(self, handle: VmHandle, spec: LaunchSpec) -> float:
        """The clone's virtio-fs, plugged into the template's free root port once it runs: the
        chardev to its virtiofsd, then vhost-user-fs-pci; the seconds it took."""
        started = time.monotonic()
        client = await self._client(handle)
        chardev = {
            "id": SHARE_CHARDEV,
            "backend": {
                "type": "socket",
                "data": {
                    "addr": {"type": "unix", "data": {"path": str(spec.run_dir / VIRTIOFS_SOCKET)}},
                    "server": False,
                },
            },
        }
        device = {
            "driver": "vhost-user-fs-pci",
            "id": SHARE_DEVICE,
            "chardev": SHARE_CHARDEV,
            "tag": SHARE_TAG,
            "bus": HOTPLUG_PORT,
        }
        try:
            await client.execute("chardev-add", chardev, timeout=STATUS_TIMEOUT)
            await client.execute("device_add", device, timeout=STATUS_TIMEOUT)
        except QmpError as exc:
            raise VmError.internal(f"QEMU: plugging the clone's virtio-fs: {exc}") from None
        return time.monotonic() - started

    async def _start_virtiofsd(self, spec: LaunchSpec) -> None:
        """virtiofsd for the VM's shared directory, listening on its socket in the run dir. It
        serves the one QEMU that connects and ends when that QEMU does (reaped by a thread)."""
        if not os.access(self.virtiofsd, os.X_OK):
            raise VmError.precondition(
                f"virtiofsd ({self.virtiofsd}) is not installed: a VM with a shared directory needs it"
            )
        socket_path = spec.run_dir / VIRTIOFS_SOCKET
        common.remove_quietly(socket_path)
        process = await run_to_end(asyncio.to_thread(self._spawn_virtiofsd, spec, socket_path))
        deadline = time.monotonic() + VIRTIOFSD_START
        while not socket_path.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                tail = _tail(spec.run_dir / VIRTIOFSD_LOG) or "no output"
                raise VmError.precondition(f"virtiofsd did not start for {spec.shared_dir}: {tail}")
            await asyncio.sleep(0.02)

    def _spawn_virtiofsd(self, spec: LaunchSpec, socket_path: Path) -> subprocess.Popen[bytes]:
        argv = [
            self.virtiofsd,
            f"--socket-path={socket_path}",
            "-o", f"source={spec.shared_dir}",
            "-o", "cache=none",  # what the host changes (a configMap update) the guest sees at once
            "-o", "sandbox=namespace",
            "-o", f"xattrmap={VIRTIOFS_XATTR_MAP}",
        ]  # fmt: skip
        if spec.shared_namespace:  # where the directory's mounts are (a vm pod's share)
            argv = [NSENTER, f"--mount={spec.shared_namespace}", "--", *argv]
        with (spec.run_dir / VIRTIOFSD_LOG).open("ab") as output:
            process = subprocess.Popen(
                common.in_cgroup(argv, spec.cgroup_procs), stdin=subprocess.DEVNULL, stdout=output,
                stderr=output, start_new_session=True,
                cwd=spec.run_dir,
            )  # fmt: skip
        threading.Thread(target=process.wait, name=f"virtiofsd {spec.name}", daemon=True).start()
        return process

    async def _connect(self, handle: VmHandle, timeout: float) -> None:
        """Wait for QEMU's QMP socket and connect; fail with QEMU's own words if it exits."""
        deadline = time.monotonic() + timeout
        client: QmpClient = handle.client
        while True:
            if handle.process is not None and handle.process.poll() is not None:
                code, sig = common.exit_of(handle.process)
                how = f"exit code {code}" if sig is None else f"signal {sig}"
                detail = common.vmm_log_tail(handle.control_socket.parent) or "no output"
                raise VmError.precondition(f"QEMU ended at start ({how}): {detail}")
            if handle.control_socket.exists():
                try:
                    await client.connect(timeout=max(0.5, deadline - time.monotonic()))
                    return
                except QmpError:
                    if time.monotonic() > deadline:
                        raise
            if time.monotonic() > deadline:
                raise VmError.deadline(f"QEMU did not open its QMP socket within {timeout:g} s")
            await asyncio.sleep(0.02)

    async def _client(self, handle: VmHandle) -> QmpClient:
        client: QmpClient = handle.client
        if not client.connected:
            await client.connect(timeout=STATUS_TIMEOUT)
        return client

    async def status(self, handle: VmHandle) -> str:
        client = await self._client(handle)
        result = await client.execute("query-status", timeout=STATUS_TIMEOUT)
        return str(result.get("status", "unknown")) if isinstance(result, dict) else "unknown"

    async def query(self, handle: VmHandle, command: str) -> object:
        """Any QMP query (e.g. query-block), for diagnostics and tests."""
        client = await self._client(handle)
        return await client.execute(command, timeout=STATUS_TIMEOUT)

    def template_problem(self) -> str | None:
        return self.problem()

    def grow_problem(self, run: RunInfo) -> str | None:
        machine = run.machine or self.machine
        if machine != "q35":
            return (
                f"QEMU's {machine} machine cannot hotplug vCPUs or memory: VMs that are to grow need "
                'vm_machine = "q35" (cri_vm_machine = "q35" for vm pods; in the daemon\'s '
                "configuration: VMs started after it get it)"
            )
        if not run.max_vcpus:
            return (
                "it was started without room to grow: a clone of a template made without room (its "
                "command line is its template's), or started by an auraed before Resize existed"
            )
        return None

    async def grow(self, handle: VmHandle, *, vcpus: int, memory_mib: int, shared: bool) -> tuple[int, int]:
        client = await self._client(handle)
        plugged = await self._plug_vcpus(client, vcpus)
        memory = await self._plug_memory(client, memory_mib, shared)
        return plugged, memory

    @staticmethod
    async def _plug_vcpus(client: QmpClient, vcpus: int) -> int:
        """vCPUs plugged into free slots until the VM has ``vcpus``; how many it has then."""
        slots = await client.execute("query-hotpluggable-cpus", timeout=STATUS_TIMEOUT)
        assert isinstance(slots, list)
        present = sum(1 for slot in slots if slot.get("qom-path"))
        free = sorted(
            (slot for slot in slots if not slot.get("qom-path")),
            key=lambda slot: sorted(slot.get("props", {}).items()),
        )
        needed = vcpus - present
        if needed > len(free):
            raise VmError.precondition(
                f"vcpus: {vcpus} is more than the VM's {present + len(free)} slots (vm_max_vcpus)"
            )
        for slot in free[: max(0, needed)]:
            props = dict(slot.get("props", {}))
            # The slot's own topology names the device: a free slot's name is free (also for a VM
            # grown by an auraed before a restart, whose devices QEMU reports the same way).
            ident = "vcpu-" + "-".join(
                f"{key.removesuffix('-id')}{value}" for key, value in sorted(props.items())
            )
            try:
                await client.execute(
                    "device_add", {"driver": slot["type"], "id": ident, **props}, timeout=STATUS_TIMEOUT
                )
            except QmpError as exc:
                raise VmError.internal(f"QEMU: plugging vCPU {ident}: {exc}") from None
            present += 1
        return present

    @staticmethod
    async def _plug_memory(client: QmpClient, memory_mib: int, shared: bool) -> int:
        """A DIMM (whole memory blocks) if the VM has less than ``memory_mib``; the MiB it has then."""
        summary = await client.execute("query-memory-size-summary", timeout=STATUS_TIMEOUT)
        assert isinstance(summary, dict)
        current = (int(summary.get("base-memory", 0)) + int(summary.get("plugged-memory", 0))) // MIB
        if memory_mib <= current:
            return current
        size = grown_memory_mib(current, memory_mib) - current
        devices = await client.execute("query-memory-devices", timeout=STATUS_TIMEOUT)
        objects = await client.execute("qom-list", {"path": "/objects"}, timeout=STATUS_TIMEOUT)
        used = {str(d.get("data", {}).get("id", "")) for d in devices if isinstance(d, dict)}
        used |= {str(o.get("name", "")) for o in objects if isinstance(o, dict)}
        number = next(
            n for n in itertools.count() if not {f"{DIMM_PREFIX}{n}", f"{DIMM_MEMORY_PREFIX}{n}"} & used
        )
        memdev, dimm = f"{DIMM_MEMORY_PREFIX}{number}", f"{DIMM_PREFIX}{number}"
        # The same kind of RAM as the VM's own: shared (a memfd) when virtiofsd maps guest RAM.
        backend: dict[str, object] = {"qom-type": "memory-backend-ram", "id": memdev, "size": size * MIB}
        if shared:
            backend.update({"qom-type": "memory-backend-memfd", "share": True})
        try:
            await client.execute("object-add", backend, timeout=STATUS_TIMEOUT)
        except QmpError as exc:
            raise VmError.internal(f"QEMU: making {size} MiB of memory ({memdev}): {exc}") from None
        try:
            await client.execute(
                "device_add", {"driver": "pc-dimm", "id": dimm, "memdev": memdev}, timeout=STATUS_TIMEOUT
            )
        except QmpError as exc:
            with contextlib.suppress(QmpError):
                await client.execute("object-del", {"id": memdev}, timeout=STATUS_TIMEOUT)
            raise VmError.precondition(
                f"QEMU: plugging {size} MiB of memory ({dimm}): {exc} (vm_memory_slots)"
            ) from None
        return current + size

    async def save(self, handle: VmHandle, state_path: Path) -> float:
        started = time.monotonic()
        client = await self._client(handle)
        await client.execute("stop", timeout=STATUS_TIMEOUT)
        await self._ignore_shared(client)
        # To a descriptor handed over QMP, not exec: (QEMU runs with spawning denied; 7.2 has no file:).
        fd = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await client.send_fd("template-state", fd)
        finally:
            os.close(fd)
        await client.execute("migrate", {"uri": "fd:template-state"}, timeout=STATUS_TIMEOUT)
        await self._migrated(client, "saving the template")
        return time.monotonic() - started

    async def _restore(self, handle: VmHandle, state_fd: int) -> float:
        """Load a clone's device state (``-incoming defer``: from the descriptor QEMU inherited)
        and resume it; the seconds from migrate-incoming to running."""
        client = await self._client(handle)
        await self._ignore_shared(client)
        started = time.monotonic()
        await client.execute("migrate-incoming", {"uri": f"fd:{state_fd}"}, timeout=STATUS_TIMEOUT)
        await self._migrated(client, "restoring the clone")
        await client.execute("cont", timeout=STATUS_TIMEOUT)
        return time.monotonic() - started

    @staticmethod
    async def _ignore_shared(client: QmpClient) -> None:
        # RAM in a shared file is not in the stream: only the device state is (~300 KB).
        caps = [{"capability": "x-ignore-shared", "state": True}]
        await client.execute("migrate-set-capabilities", {"capabilities": caps}, timeout=STATUS_TIMEOUT)

    @staticmethod
    async def _migrated(client: QmpClient, what: str) -> None:
        deadline = time.monotonic() + MIGRATION_TIMEOUT
        while True:
            info = await client.execute("query-migrate", timeout=STATUS_TIMEOUT)
            status = info.get("status", "") if isinstance(info, dict) else ""
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                detail = info.get("error-desc", status) if isinstance(info, dict) else status
                raise VmError.internal(f"QEMU: {what} failed: {detail}")
            if time.monotonic() > deadline:
                raise VmError.deadline(f"QEMU: {what} did not end within {MIGRATION_TIMEOUT:g} s ({status})")
            await asyncio.sleep(MIGRATION_POLL)

    async def shutdown(self, handle: VmHandle, timeout: float) -> bool:
        if processes.is_stopped(handle.pid, handle.start_ticks):
            # Stopped by a signal, it would answer neither a powerdown nor a quit: ended at once.
            log.warning("VM at %s: QEMU is stopped (SIGSTOP): killing it", handle.control_socket)
            await self.kill(handle)
            return False
        if timeout > 0:
            try:
                client = await self._client(handle)
                await client.execute("system_powerdown", timeout=STATUS_TIMEOUT)
            except QmpError as exc:
                log.warning("VM at %s: system_powerdown failed: %s", handle.control_socket, exc)
            if await common.wait_exit(handle, timeout):
                return True
        try:
            client = await self._client(handle)
        except QmpError as exc:
            log.warning("VM at %s: no QMP to quit through (%s): killing QEMU", handle.control_socket, exc)
            await self.kill(handle)
            return False
        try:
            await client.execute("quit", timeout=STATUS_TIMEOUT)
        except QmpError as exc:
            # quit often loses the race with QEMU closing the socket; the exit is what counts.
            log.debug("VM at %s: quit: %s", handle.control_socket, exc)
        if not await common.wait_exit(handle, QUIT_WAIT):
            await self.kill(handle)
        return False

    async def kill(self, handle: VmHandle) -> None:
        await common.kill(handle)
        await self.close(handle)

    async def wait(self, handle: VmHandle) -> ExitInfo:
        client: QmpClient = handle.client
        if not client.connected and handle.alive:
            # A reattached VMM: listen for its events (SHUTDOWN says who ended it).
            try:
                await client.connect(timeout=STATUS_TIMEOUT)
            except QmpError as exc:
                log.warning("VM at %s: cannot connect to QMP: %s", handle.control_socket, exc)
        await common.wait_exit(handle)
        # The SHUTDOWN event precedes QEMU closing the socket: give the reader a moment to see it.
        if client.connected:
            try:
                async with asyncio.timeout(1.0):
                    await client.wait_closed()
            except TimeoutError:
                pass
        code, sig = common.exit_of(handle.process)
        event = client.shutdown_event
        # QEMU's own SHUTDOWN event says best who ended it; without one, a signal means a kill.
        if event is not None:
            reason = str(event.get("reason", ""))
            guest = bool(event.get("guest"))
            if reason == "guest-reset":
                detail = "the guest rebooted (VMs end on reboot)"
            elif guest:
                detail = "the guest powered off"
            else:
                detail = f"QEMU shut down ({reason or 'host request'})"
            return ExitInfo(code, sig, guest, detail)
        if sig is not None:
            return ExitInfo(code, sig, False, f"QEMU killed by signal {sig}")
        if code is not None:
            return ExitInfo(code, None, False if code else None, f"QEMU exited with code {code}")
        return ExitInfo(None, None, None, "QEMU ended")

    def reattach(self, run: RunInfo) -> VmHandle | None:
        return common.reattach(self.name, run, QmpClient)

    async def close(self, handle: VmHandle) -> None:
        if handle.identity is not None:
            handle.identity[1].close()
            handle.identity = None
        client: QmpClient = handle.client
        await client.close()


async def copy_sparse(source: Path, target: Path, cgroup_procs: tuple[str, ...] = ()) -> tuple[float, int]:
    """``source`` copied to ``target`` by a child in the cgroup(s) of ``cgroup_procs`` (auraed.vms.sparse:
    its pages are charged there, the VMM's, not the daemon's); the seconds it took and the bytes
    of data copied."""
    started = time.monotonic()
    common.remove_quietly(target)
    argv = common.in_cgroup(
        [sys.executable, "-m", "auraed.vms.sparse", str(source), str(target)], cgroup_procs
    )
    child = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await child.communicate()
    if child.returncode != 0:
        common.remove_quietly(target)
        why = err.decode(errors="replace").strip() or f"exit status {child.returncode}"
        raise VmError.internal(f"could not copy the template's RAM {source} for a clone: {why}")
    return time.monotonic() - started, int(out)


def _tail(path: Path, limit: int = 1000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""
