"""The one interface every VMM backend implements, and what they share: launching and watching the VMM.

A backend boots a ``LaunchSpec`` and returns a ``VmHandle``; from then on everything goes through
the handle: ``status`` (asked of the VMM: QMP query-status or the REST API's vm.info),
``shutdown`` (graceful, then forced once the timeout has passed), ``kill``, ``wait`` (until the
VMM process ends, through a pidfd) and ``close`` (drop the control connection but leave the VMM
running, as when auraed stops). After a restart ``reattach`` finds a VMM again by pid and start
time (so a recycled pid is never mistaken for it) and its control socket.

The VMM runs as a child of auraed in its own session, so it outlives auraed (and its process
group's signals); its stdout/stderr go to ``vmm.log`` in the VM's run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from auraed.system import processes
from auraed.vms.model import RunInfo

CONSOLE_LOG = "console.log"
IDENTITY_SOCKET = "identity.sock"  # the host's end of a template's or a clone's identity port
DEBUG_SOCKET = "debug.sock"  # the host's end of the debug console's port (vm_debug_console)
VMM_LOG = "vmm.log"
KILL_WAIT = 10.0  # seconds to wait for a SIGKILLed VMM to be gone


@dataclasses.dataclass(frozen=True)
class LaunchDisk:
    path: str
    writable: bool
    serial: str


@dataclasses.dataclass(frozen=True)
class LaunchNet:
    tap: str
    mac: str
    host_ip: str
    guest_ip: str
    netmask: str
    netns: str = ""  # the tap is in the network namespace pinned here ("": the host's)


@dataclasses.dataclass(frozen=True)
class Room:
    """What a VM can grow to: its vCPUs (QEMU's ``-smp maxcpus``) and memory (``-m maxmem``, with
    ``slots`` DIMM slots); both its boot values when it cannot grow."""

    max_vcpus: int
    max_memory_mib: int
    slots: int


NO_ROOM = Room(0, 0, 0)


@dataclasses.dataclass(frozen=True)
class MemoryImage:
    """A guest kept as files: its RAM (``memory_path``, a file-backed memory object) and its device
    state (``state_path``, a migration stream without the RAM).

    ``clone`` False: the template is being made (the RAM *is* the file, shared; the backend's
    ``save`` writes the state); True: a clone is restored from it (the file mapped private,
    copy-on-write, the state loaded before the guest resumes). Either way the VM has the
    host-only identity port, whose host end is ``identity.sock`` in the run directory.
    ``debug_console``: the template has the debug port (vm_debug_console), so its clones have it
    too (a clone's devices are its template's), each its own ``debug.sock`` in its run directory.
    ``vcpus``, ``memory_mib`` and ``room``: the template's boot size and the room it was made with
    (0 and None: the VM's own size, no room); a clone starts as its template did (its command
    line must be the template's) and is grown to its own size by hotplug once restored.
    """

    memory_path: str
    state_path: str
    clone: bool
    debug_console: bool = False
    vcpus: int = 0
    memory_mib: int = 0
    room: Room | None = None


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything a backend needs to boot a VM; paths are checked by the caller."""

    name: str
    vcpus: int
    memory_mib: int
    kernel: str
    initramfs: str
    disks: tuple[LaunchDisk, ...]
    # The complete kernel command line but for what the backend itself adds (kernel_args()).
    cmdline: str
    net: LaunchNet | None
    run_dir: Path
    timeout: float = 30.0  # for the VMM to come up and report the guest running
    shared_dir: str = ""  # shared with the guest over virtio-fs (its tag: SHARE_TAG)
    shared_namespace: str = ""  # the pinned mount namespace shared_dir is in ("": the daemon's)
    image: MemoryImage | None = None  # a template being made, or a clone to restore
    # The cgroup files (cgroup.procs) the VMM and its helpers join as they start (VmSpec's).
    cgroup_procs: tuple[str, ...] = ()
    machine: str = ""  # QEMU's machine type ("": the backend's configured one, vm_machine)

    def boot_size(self) -> tuple[int, int]:
        """The vCPUs and MiB the VMM starts with: a clone's are its template's (``image``), and
        it is grown to ``vcpus`` and ``memory_mib`` once restored; any other VM's are its own."""
        image = self.image
        if image is not None and image.vcpus and image.memory_mib:
            return image.vcpus, image.memory_mib
        return self.vcpus, self.memory_mib


@dataclasses.dataclass
class VmHandle:
    """A running VMM: its process identity, control socket and (for a backend) its client."""

    backend: str
    pid: int
    start_ticks: int | None
    control_socket: Path
    console_path: Path
    accelerator: str
    # Our child when this auraed started it (then its exit status can be collected).
    process: subprocess.Popen[bytes] | None = None
    client: Any = None
    # A template's or a clone's identity port, connected: (asyncio StreamReader, StreamWriter).
    identity: Any = None
    restored_in: float | None = None  # a clone: seconds its device state took to load and resume
    # A clone with a shared directory: (seconds its RAM copy took, bytes copied, seconds to plug virtio-fs).
    share_plug: tuple[float, int, float] | None = None
    # QEMU's machine type, and the vCPUs and memory the VM was started with room for (0: none).
    machine: str = ""
    max_vcpus: int = 0
    max_memory_mib: int = 0
    # A clone grown to its own size as it was restored: the vCPUs and MiB it has then, and the
    # seconds the hotplug took (None: it started at its size).
    grown: tuple[int, int] | None = None
    grown_in: float = 0.0

    def run_info(self) -> RunInfo:
        return RunInfo(
            pid=self.pid,
            start_ticks=self.start_ticks,
            control_socket=str(self.control_socket),
            console_path=str(self.console_path),
            accelerator=self.accelerator,
            machine=self.machine,
            max_vcpus=self.max_vcpus,
            max_memory_mib=self.max_memory_mib,
        )

    @property
    def alive(self) -> bool:
        return processes.is_alive(self.pid, self.start_ticks)


@dataclasses.dataclass(frozen=True)
class ExitInfo:
    """How a VMM ended, as far as it can be known.

    ``guest_initiated``: True when the guest powered off (or reset) itself, False when the host
    side ended it (a signal, a quit), None when unknown (the VMM was not our child and said
    nothing before it ended).
    """

    exit_code: int | None
    signal: int | None
    guest_initiated: bool | None
    detail: str


class Backend(Protocol):
    name: str

    def problem(self) -> str | None:
        """Why this backend cannot boot VMs on this host (binary missing, no KVM); None when it can."""
        ...

    def kernel_args(self, machine: str = "") -> list[str]:
        """Arguments this backend puts first on every kernel command line (console, clock) of a
        VM of ``machine`` ("": the configured one)."""
        ...

    def machine_of(self, requested: str) -> str:
        """The machine type a VM asking for ``requested`` ("": the configured one) runs on; ""
        for a backend without machine types."""
        ...

    def template_room(self, machine: str) -> Room | None:
        """The room a template of ``machine`` is made with, so that its clones grow to any size
        within it as they are restored; None where clones cannot grow (they are then their
        template's shape)."""
        ...

    def console_log_path(self, run_dir: Path) -> Path: ...

    def template_problem(self) -> str | None:
        """Why this backend cannot make templates or restore clones here; None when it can."""
        ...

    async def save(self, handle: VmHandle, state_path: Path) -> float:
        """Pause a template's guest and write its device state (not its RAM, which is its memory
        file) to ``state_path``; the seconds it took. The VMM is left paused. (cloud-hypervisor:
        ``state_path`` is the directory of its snapshot, RAM included, the memory file a link to
        that RAM.)"""
        ...

    async def start(self, spec: LaunchSpec) -> VmHandle: ...

    def grow_problem(self, run: RunInfo) -> str | None:
        """Why the VM running as ``run`` says cannot grow at all (its machine type, its backend);
        None when it can, up to ``run.max_vcpus`` and ``run.max_memory_mib``."""
        ...

    async def grow(self, handle: VmHandle, *, vcpus: int, memory_mib: int, shared: bool) -> tuple[int, int]:
        """Hotplug vCPUs and memory until the VM has at least ``vcpus`` and ``memory_mib`` (memory
        in whole blocks, so maybe more; ``shared``: its RAM is shared, for virtiofsd). Returns the
        vCPUs and MiB it has then, as the VMM reports them."""
        ...

    async def status(self, handle: VmHandle) -> str:
        """The guest's state as the VMM reports it now, lower-case ("running", "paused", ...)."""
        ...

    async def shutdown(self, handle: VmHandle, timeout: float) -> bool:
        """Power the guest off gracefully, then end the VMM after ``timeout``; True if graceful."""
        ...

    async def kill(self, handle: VmHandle) -> None: ...

    async def wait(self, handle: VmHandle) -> ExitInfo:
        """Return once the VMM process has ended, saying how."""
        ...

    def reattach(self, run: RunInfo) -> VmHandle | None:
        """The VMM of a record after an auraed restart, or None when it is gone."""
        ...

    async def close(self, handle: VmHandle) -> None:
        """Drop the control connection; the VMM keeps running."""
        ...


# -- shared process handling -------------------------------------------------------------------


def reattach(backend: str, run: RunInfo, client: Callable[[Path], Any]) -> VmHandle | None:
    """The handle of a VMM still running from before a restart (same pid and start time, socket
    present); None when it is gone. ``client`` makes the backend's control client for the socket."""
    if not processes.is_alive(run.pid, run.start_ticks):
        return None
    socket = Path(run.control_socket)
    if not socket.exists():
        return None
    return VmHandle(
        backend=backend,
        pid=run.pid,
        start_ticks=run.start_ticks,
        control_socket=socket,
        console_path=Path(run.console_path),
        accelerator=run.accelerator,
        process=None,
        client=client(socket),
        machine=run.machine,
        max_vcpus=run.max_vcpus,
        max_memory_mib=run.max_memory_mib,
    )


JOIN_CGROUP = 'for procs in "$@"; do [ "$procs" = -- ] && break; echo 0 > "$procs" || exit 126; done'
"""A shell that writes itself into each cgroup.procs before ``--``, then becomes the command
after it (same pid): the process is in its cgroup from its first instruction, so everything it
allocates is charged there (cgroup v2 never moves charges made before a process moves)."""


def in_cgroup(argv: list[str], cgroup_procs: tuple[str, ...]) -> list[str]:
    """``argv`` started in the cgroup(s) whose ``cgroup.procs`` files are given (none: as it is).
    Python's subprocess has no CLONE_INTO_CGROUP, and a preexec_fn is unsafe in a threaded
    daemon; a shell that joins, then execs, is neither."""
    if not cgroup_procs:
        return argv
    script = f'{JOIN_CGROUP}; shift {len(cgroup_procs) + 1}; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *cgroup_procs, "--", *argv]


def spawn(
    argv: list[str], run_dir: Path, pass_fds: tuple[int, ...] = (), cgroup_procs: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """Start a VMM in its own session with output to run_dir/vmm.log (and ``pass_fds`` open), in
    the cgroup(s) of ``cgroup_procs`` when given."""
    with (run_dir / VMM_LOG).open("ab") as log:
        return subprocess.Popen(
            in_cgroup(argv, cgroup_procs),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            cwd=run_dir,
        )


def vmm_log_tail(run_dir: Path, limit: int = 2000) -> str:
    try:
        data = (run_dir / VMM_LOG).read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def exit_of(process: subprocess.Popen[bytes] | None) -> tuple[int | None, int | None]:
    """(exit code, signal) of an ended child; (None, None) when it is not our child."""
    if process is None:
        return None, None
    code = process.poll()
    if code is None:
        return None, None
    return (None, -code) if code < 0 else (code, None)


async def wait_exit(handle: VmHandle, timeout: float | None = None) -> bool:
    """Wait until the VMM has ended (and reap it if it is ours); False if still running at timeout."""
    try:
        if timeout is None:
            await processes.wait_for_exit(handle.pid, handle.start_ticks)
        else:
            async with asyncio.timeout(timeout):
                await processes.wait_for_exit(handle.pid, handle.start_ticks)
    except TimeoutError:
        return False
    if handle.process is not None:
        # It has exited: this does not block (for more than the kernel's bookkeeping).
        await asyncio.to_thread(handle.process.wait)
    return True


async def kill(handle: VmHandle) -> None:
    processes.send_signal(handle.pid, signal.SIGKILL, handle.start_ticks)
    await wait_exit(handle, KILL_WAIT)


def processes_referencing(run_dir: Path) -> list[int]:
    """Pids with an argument that is run_dir or names something inside it (a VMM whose pid was
    never recorded). ``/vms/web`` does not match ``/vms/web2/qmp.sock``."""
    directory = os.fsencode(str(run_dir).rstrip("/"))
    inside = directory + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if any(arg == directory or inside in arg for arg in args):
                found.append(int(entry.name))
    return found


def kill_processes_referencing(run_dir: Path) -> list[int]:
    """SIGKILL every process naming run_dir and wait (briefly) until they are gone."""
    return _kill_and_wait(processes_referencing(run_dir))


def kill_vmms_of(run_dir: Path) -> list[int]:
    """SIGKILL the VMMs started for run_dir (their output goes to its vmm.log, see ``spawn``) and
    wait (briefly) until they are gone. Nothing else: not a ``tail -f`` of its console log."""
    try:
        log_file = os.stat(run_dir / VMM_LOG)
    except FileNotFoundError:
        return []  # no VMM was started there
    mine = os.getpid()
    candidates = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and int(e.name) != mine]
    return _kill_and_wait([pid for pid in candidates if processes.writes_to(pid, log_file)])


def _kill_and_wait(pids: list[int]) -> list[int]:
    killed = []
    for pid in pids:
        ticks = processes.start_ticks(pid)
        if processes.send_signal(pid, signal.SIGKILL, ticks):
            killed.append((pid, ticks))
    deadline = time.monotonic() + KILL_WAIT
    for pid, ticks in killed:
        while processes.is_alive(pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # our own child (a VMM whose start was interrupted)
    return [pid for pid, _ in killed]


def remove_quietly(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
