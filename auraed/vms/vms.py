"""VMs: allocate, start, stop, free, list and recover, persisted in the store.

Records are written before the kernel objects and processes they describe, and marked done after:
``allocating`` until the tap exists, ``starting`` until the VMM's pid is known. At start
(``recover``) a record left ``allocating`` is torn down, a ``starting`` one has any VMM naming its
run directory killed, and a running one is reattached by pid + start ticks + control socket and
watched again; a VMM that ended while auraed was away is reported from its console's tail.

Every running VMM is watched through a pidfd: its end is noticed at once, classified (guest
power-off -> exited; a kill or failure -> crashed; asked for -> stopped), persisted with the
console's tail, and its control socket removed. Its tap belongs to the allocation (the address
block stays with the VM) and goes with Free.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import ipaddress
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from auraed.bootargs import SHARE_TAG
from auraed.errors import ErrorKind
from auraed.state.store import Store
from auraed.system.tasks import run_to_end
from auraed.vms import backend as common
from auraed.vms import console, network
from auraed.vms.backend import Backend, ExitInfo, LaunchDisk, LaunchNet, LaunchSpec, MemoryImage, VmHandle
from auraed.vms.errors import VmError
from auraed.vms.model import (
    ACTIVE_STATES,
    ROOT_SERIAL,
    STARTABLE_STATES,
    NetInfo,
    State,
    VmRecord,
    VmSpec,
    check_file,
    grown_memory_mib,
)

log = logging.getLogger(__name__)

KIND = "vm"
TAIL_LINES = 20
# A line of a tail kept in a record (and sent with every status, List's for each VM) is cut here:
# one endless line from a guest would otherwise make replies too large to send.
TAIL_LINE_MAX = 1024
STATUS_TIMEOUT = 5.0
TAP_NAME_TRIES = 16  # names taken by other processes between pick and create before giving up
DEFAULT_START_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class VmView:
    """A VM's record plus what its VMM said just now."""

    record: VmRecord
    backend_status: str
    pid: int
    address: str


def tail_of(console_path: Path, lines: int = TAIL_LINES) -> list[str]:
    """A console's tail as records keep it and errors quote it: a few short lines, a small read."""
    return console.read_tail(console_path, lines, TAIL_LINE_MAX)


def tap_owner(record: VmRecord) -> str:
    """The alias marking a VM's tap as this VM's (its run directory is unique on the host)."""
    return f"auraed-vm {record.run_dir}"


def _starting(record: VmRecord, template: str) -> None:
    """A record as a new start begins (cloned from ``template``, or cold when "")."""
    record.state, record.run = State.STARTING, None
    record.finished_at = record.exit_code = record.signal = None
    record.reason, record.console_tail = "", []
    record.started_at = time.time()
    record.template, record.restore_ms = template, None
    record.plugged_vcpus = record.plugged_memory_mib = 0


def _grown_at_restore(record: VmRecord, launch: LaunchSpec, grown: tuple[int, int], seconds: float) -> None:
    """A clone grown from its template's size to its own as it was restored: the spec holds the
    size it has (memory in whole blocks: maybe more than asked), the record what was plugged."""
    vcpus, memory_mib = grown
    boot_vcpus, boot_memory_mib = launch.boot_size()
    record.plugged_vcpus, record.plugged_memory_mib = vcpus - boot_vcpus, memory_mib - boot_memory_mib
    record.spec = dataclasses.replace(record.spec, vcpus=vcpus, memory_mib=memory_mib)
    log.info(
        "VM %s grown as it was restored from %d vCPU and %d MiB to %d vCPUs and %d MiB in %.0f ms",
        record.name, boot_vcpus, boot_memory_mib, vcpus, memory_mib, seconds * 1000,
    )  # fmt: skip


class _Live:
    """The in-memory side of a running VM: its handle and the task watching its VMM."""

    def __init__(self, handle: VmHandle) -> None:
        self.handle = handle
        self.watcher: asyncio.Task[None] | None = None
        self.stopping = False


def choose_backend(requested: str, backends: Mapping[str, Backend]) -> str:
    """The backend for a VM: the one asked for if it can run here, else cloud-hypervisor when it
    can (binary + usable KVM), else QEMU. FAILED_PRECONDITION when nothing can boot it."""
    if requested:
        chosen = backends.get(requested)
        if chosen is None:
            raise VmError(ErrorKind.INVALID_ARGUMENT, f"vm.backend: {requested!r} is not available")
        problem = chosen.problem()
        if problem:
            raise VmError.precondition(f"vm.backend: {problem}")
        return requested
    problems = []
    for name in ("cloud-hypervisor", "qemu"):
        candidate = backends.get(name)
        if candidate is None:
            continue
        problem = candidate.problem()
        if problem is None:
            return name
        problems.append(problem)
    raise VmError.precondition("no VM backend can run here: " + "; ".join(problems))


class Vms:
    def __init__(
        self,
        store: Store,
        backends: Mapping[str, Backend],
        *,
        runtime_dir: Path,
        pool: ipaddress.IPv4Network,
        guest_port: int = 8080,
        default_stop_timeout: float = 10.0,
        console_log_limit: int = console.LOG_LIMIT,
    ) -> None:
        self._store = store
        self.store = store
        self.backends = dict(backends)
        self._vms_dir = runtime_dir / "vms"
        self.templates_dir = runtime_dir / "templates"
        self.pool = pool
        self.guest_port = guest_port
        self.default_stop_timeout = default_stop_timeout
        self.console_log_limit = console_log_limit
        self._records: dict[str, VmRecord] = {}
        self._live: dict[str, _Live] = {}
        self._vm_locks: dict[str, asyncio.Lock] = {}
        self._ended_listeners: list[Callable[[VmRecord], None]] = []
        # Membership and the pool: allocation and freeing.
        self._lock = asyncio.Lock()

    def when_ended(self, listener: Callable[[VmRecord], None]) -> None:
        """Have ``listener`` called with a VM's record each time its VMM ends, once that is saved."""
        self._ended_listeners.append(listener)

    # -- lookup ------------------------------------------------------------------------------

    def get(self, name: str) -> VmRecord:
        record = self._records.get(name)
        if record is None:
            raise VmError.not_found(f"VM {name}")
        return record

    def all(self) -> list[VmRecord]:
        return [self._records[name] for name in sorted(self._records)]

    def handle(self, name: str) -> VmHandle | None:
        live = self._live.get(name)
        return live.handle if live else None

    def run_dir(self, name: str) -> Path:
        return self._vms_dir / name

    def address(self, record: VmRecord) -> str:
        return f"{record.net.guest_ip}:{self.guest_port}" if record.net else ""

    def timeout(self, value: float | None) -> float:
        return self.default_stop_timeout if value is None else value

    def _vm_lock(self, name: str) -> asyncio.Lock:
        return self._vm_locks.setdefault(name, asyncio.Lock())

    def _running(self, name: str) -> bool:
        live = self._live.get(name)
        return live is not None and live.watcher is not None and not live.watcher.done()

    # -- allocate / free ---------------------------------------------------------------------

    async def allocate(self, spec: VmSpec, net: NetInfo | None = None) -> VmRecord:
        """A VM record, its run directory and its tap from the pool; or, given ``net`` (with a
        netns), the caller's network: its tap is the caller's to make and remove."""
        async with self._lock:
            if spec.name in self._records:
                raise VmError.already_exists(f"VM {spec.name}")
            backend = choose_backend(spec.backend, self.backends)
            if net is not None and (net.from_pool or not spec.network):
                raise VmError.internal(f"VM {spec.name}: a network brought along names its namespace")
            if net is not None and backend != "qemu":
                raise VmError.precondition(
                    f"VM {spec.name}: a tap in a network namespace (a pod's) needs the qemu backend"
                )
            record = VmRecord(spec=spec, backend=backend, run_dir=str(self.run_dir(spec.name)), net=net)
            if spec.network and net is None:
                nets = self._nets()
                record.net = await asyncio.to_thread(network.pick, self.pool, nets, {n.tap for n in nets})
            # The record (with its block) exists before the tap: a crash in between is cleaned at start.
            self._save(record)
            try:
                await self._make_with_a_free_tap(record, {n.tap for n in self._nets()})
                record.state = State.ALLOCATED
                self._save(record)  # may fail too (a full disk): then nothing stays either
            except BaseException:
                await run_to_end(asyncio.to_thread(self._unmake, record))
                self._delete(record)
                raise
        log.info(
            "allocated VM %s (%s%s)",
            spec.name,
            backend,
            f", {record.net.tap} {record.net.host_ip} -> {record.net.guest_ip}" if record.net else "",
        )
        return record

    def _nets(self) -> list[NetInfo]:
        return [r.net for r in self._records.values() if r.net is not None and r.net.from_pool]

    async def _make_with_a_free_tap(self, record: VmRecord, held_taps: set[str]) -> None:
        """``_make``; when another process (another auraed on the host) made a link of the picked
        tap's name since ``pick``, nothing was made: the record takes the next free name instead.
        Made to the end even when the caller goes (a client hanging up cancels us): the thread
        making the tap would go on regardless, and undoing it must follow it."""
        taken: set[str] = set()
        while True:
            try:
                await run_to_end(asyncio.to_thread(self._make, record))
                return
            except network.TapNameTaken as exc:
                if record.net is None or len(taken) >= TAP_NAME_TRIES:
                    raise
                taken.add(exc.tap)
                log.info("VM %s: tap %s was taken meanwhile; picking another name", record.name, exc.tap)
                tap = await asyncio.to_thread(network.free_tap_name, {*held_taps, *taken})
                record.net = dataclasses.replace(record.net, tap=tap)
                self._save(record)

    def _make(self, record: VmRecord) -> None:
        run_dir = Path(record.run_dir)
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if record.net is not None and record.net.from_pool:
            network.create_tap(record.net, tap_owner(record))

    def _unmake(self, record: VmRecord) -> None:
        """Remove every kernel object, process and file of a VM; safe on half-made ones, repeatable."""
        run_dir = Path(record.run_dir)
        killed = common.kill_processes_referencing(run_dir)
        if killed:
            log.warning("VM %s: killed leftover processes %s", record.name, killed)
        if record.net is not None and record.net.from_pool:
            try:
                network.delete_tap(record.net.tap, tap_owner(record))
            except Exception as exc:
                log.warning("VM %s: could not remove tap %s: %s", record.name, record.net.tap, exc)
        shutil.rmtree(run_dir, ignore_errors=True)

    async def free(self, name: str, timeout: float | None = None) -> None:
        async with self._vm_lock(name):
            record = self.get(name)
            if self._running(name):
                await self._stop(record, self.timeout(timeout))
            live = self._live.pop(name, None)
            if live is not None:
                await self.backends[record.backend].close(live.handle)
            async with self._lock:
                await asyncio.to_thread(self._unmake, record)
                self._delete(record)
            self._vm_locks.pop(name, None)
        log.info("freed VM %s", name)

    # -- start / stop ------------------------------------------------------------------------

    def _launch_spec(
        self,
        record: VmRecord,
        timeout: float,
        image: MemoryImage | None = None,
        without: tuple[str, ...] = (),
    ) -> LaunchSpec:
        spec = record.spec
        disks = []
        if spec.root_disk:
            disks.append(LaunchDisk(spec.root_disk, False, ROOT_SERIAL))
        disks += [
            LaunchDisk(d.path, d.writable, d.serial) for d in spec.extra_disks if d.serial not in without
        ]
        # The guest boot contract (auraed/bootargs.py BootArgs, guest-image/files/init).
        # The root disk is the first virtio disk (/dev/vda), extra disks follow (/dev/vdb, ...).
        args = [f"auraed.hostname={spec.name}"]
        net = None
        if record.net is not None:
            n = record.net
            net = LaunchNet(n.tap, n.mac, n.host_ip, n.guest_ip, n.netmask, n.netns)
            args += [f"auraed.ip={n.guest_ip}/{n.prefixlen}", f"auraed.gateway={n.host_ip}"]
        if spec.role:
            args.append(f"auraed.role={spec.role}")
        if spec.shared_dir:
            args.append(f"auraed.share={SHARE_TAG}")
        args += spec.kernel_args
        return LaunchSpec(
            name=spec.name,
            vcpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            kernel=spec.kernel,
            initramfs=spec.initramfs,
            disks=tuple(disks),
            cmdline=" ".join(args),
            net=net,
            run_dir=Path(record.run_dir),
            timeout=timeout,
            shared_dir=spec.shared_dir,
            shared_namespace=spec.shared_namespace,
            image=image,
            cgroup_procs=spec.cgroup_procs,
            machine=spec.machine,
        )

    async def start(
        self,
        name: str,
        *,
        wait_for_console: str = "",
        timeout: float = DEFAULT_START_TIMEOUT,
        image: MemoryImage | None = None,
        without_disks: tuple[str, ...] = (),
        template: str = "",
    ) -> tuple[VmRecord, float | None]:
        """Boot the VM; with ``wait_for_console``, return once that text is on its console.

        ``image``: restore it as a clone of that template (``template``, its name) instead, the
        disks whose serials are in ``without_disks`` left out (the template had none there).
        Returns the record and the seconds from launch to the marker (None when not waited for).
        """
        async with self._vm_lock(name):
            record = self.get(name)
            if record.state not in STARTABLE_STATES or self._running(name):
                raise VmError.precondition(f"VM {name} is {record.state}: it cannot be started")
            backend = self.backends[record.backend]
            left_out = {d.path for d in record.spec.extra_disks if d.serial in without_disks}
            for field, path in record.spec.files():
                if path not in left_out:
                    check_file(field, path)
            await asyncio.to_thread(self._prepare_run, record)
            launched = time.monotonic()
            _starting(record, template if image is not None else "")
            self._save(record)
            launch = self._launch_spec(record, timeout, image, without_disks)
            try:
                handle = await backend.start(launch)
            except BaseException as exc:
                # A cancelled start may have left a VMM the backend never returned (spawned in a
                # thread, or killed by a cleanup cancelled in turn): none may outlive the start.
                await run_to_end(asyncio.to_thread(common.kill_vmms_of, Path(record.run_dir)))
                record.state = State.STOPPED
                why = "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc)
                record.reason = f"start failed: {why}"
                record.finished_at = time.time()
                record.console_tail = tail_of(record.console_path)
                self._save(record)
                raise
            self._started(record, launch, handle)
        if not wait_for_console:
            return record, None
        # Waited for outside the VM's lock: a Stop or Free meanwhile is not held up by a slow boot.
        remaining = max(0.0, timeout - (time.monotonic() - launched))
        try:
            await console.wait_for_marker(
                handle.console_path, wait_for_console, remaining, alive=lambda: self._is_live(name, handle)
            )
        except console.MarkerTimeout:
            tail = tail_of(handle.console_path)
            why = f"{wait_for_console!r} not on the console within {timeout:g} s"
            async with self._vm_lock(name):
                if self._is_live(name, handle):
                    await self._stop(record, 0.0, reason=why)
            raise VmError.deadline(
                f"VM {name}: {wait_for_console!r} did not appear on the console within {timeout:g} s; "
                f"stopped it. Console tail:\n" + "\n".join(tail)
            ) from None
        except console.VmEnded:
            await self._wait_watcher(name)
            raise VmError.precondition(
                f"VM {name} ended ({record.reason}) before {wait_for_console!r} appeared on the console. "
                "Console tail:\n" + "\n".join(record.console_tail)
            ) from None
        except asyncio.CancelledError:
            await run_to_end(self.stop_boot(name, handle, "the Start was cancelled"))
            raise
        return record, time.monotonic() - launched

    def _started(self, record: VmRecord, launch: LaunchSpec, handle: VmHandle) -> None:
        """The VM runs the VMM of ``handle`` (started from ``launch``): saved so, and watched."""
        record.run = handle.run_info()
        record.accelerator = handle.accelerator
        if handle.restored_in is not None:
            record.restore_ms = round(handle.restored_in * 1000, 1)
        if handle.grown is not None:
            _grown_at_restore(record, launch, handle.grown, handle.grown_in)
        record.state = State.RUNNING
        self._save(record)
        self._watch(record, handle)
        log.info(
            "started VM %s (%s, %s, pid %d)", record.name, record.backend, handle.accelerator, handle.pid
        )

    async def stop_boot(self, name: str, handle: VmHandle | None, why: str) -> None:
        """End a boot its Start gave up on (``handle``'s, or the current one), saying ``why``.

        A Start undone (cancelled, or its guest never ready) leaves the VM stopped, as a failed
        one does, rather than running unbeknown to whoever asked for it.
        """
        async with self._vm_lock(name):
            live = self._live.get(name)
            if live is None or (handle is not None and live.handle is not handle):
                return  # ended, or already booted again by another Start
            if self._running(name):
                await self._stop(self.get(name), 0.0, reason=why)

    def _is_live(self, name: str, handle: VmHandle) -> bool:
        """The VM still runs the VMM of ``handle`` (not ended, not replaced by a new start)."""
        live = self._live.get(name)
        return live is not None and live.handle is handle and self._running(name)

    def _prepare_run(self, record: VmRecord) -> None:
        run_dir = Path(record.run_dir)
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if record.console_path.exists():
            record.console_path.replace(run_dir / "console.previous.log")
        if record.net is None or not record.net.from_pool:
            return  # a tap in a namespace is its owner's to keep
        if not network.tap_exists(record.net.tap):
            # Gone with a reboot of the host: make it again (checked against the host again).
            network.create_tap(record.net, tap_owner(record))
        elif network.tap_owner(record.net.tap) == tap_owner(record):
            # Made by an auraed that did not harden taps yet: hardened before the guest runs.
            network.harden_tap(record.net.tap)

    async def stop(self, name: str, timeout: float | None = None) -> VmRecord:
        """Power the guest off, ending the VMM after ``timeout``; a VM not running is left as it is."""
        async with self._vm_lock(name):
            record = self.get(name)
            if self._running(name):
                await self._stop(record, self.timeout(timeout))
            return record

    async def _stop(self, record: VmRecord, timeout: float, reason: str = "") -> None:
        live = self._live[record.name]
        live.stopping = True
        record.state = State.STOPPING
        self._save(record)
        backend = self.backends[record.backend]
        graceful = await backend.shutdown(live.handle, timeout)
        await self._wait_watcher(record.name)
        if reason:
            record.reason = f"stopped: {reason}"
        elif graceful:
            record.reason = "stopped: the guest powered off"
        elif timeout > 0:
            record.reason = f"stopped: the VMM was ended after the {timeout:g} s timeout"
        else:
            record.reason = "stopped: the VMM was ended"
        self._save(record)

    async def _wait_watcher(self, name: str) -> None:
        live = self._live.get(name)
        if live is not None and live.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(live.watcher)

    # -- growing -----------------------------------------------------------------------------

    async def grow(self, name: str, vcpus: int, memory_mib: int) -> VmRecord:
        """Hotplug the running VM ``name`` up to at least ``vcpus`` and ``memory_mib`` (never down:
        fewer is INVALID_ARGUMENT naming the field; as many: nothing is done). Its spec then holds
        its new size, saved (a later Start boots with it), and the record what was plugged.

        FAILED_PRECONDITION when it is not running, cannot grow (its machine type, its backend) or
        would grow beyond the room it was started with (vm_max_vcpus, vm_max_memory_mib). The
        guest's kernel still has to online what was plugged (Guests.resize has its auraed do it).
        """
        async with self._vm_lock(name):
            record = self.get(name)
            spec = record.spec
            if vcpus < spec.vcpus:
                raise VmError.invalid(
                    "vcpus", f"{vcpus} is fewer than VM {name}'s {spec.vcpus}: VMs never shrink"
                )
            if memory_mib < spec.memory_mib:
                raise VmError.invalid(
                    "memory_mib",
                    f"{memory_mib} MiB is less than VM {name}'s {spec.memory_mib} MiB: VMs never shrink",
                )
            if vcpus == spec.vcpus and memory_mib == spec.memory_mib:
                return record
            live = self._live.get(name)
            if live is None or not self._running(name) or record.state != State.RUNNING or record.run is None:
                raise VmError.precondition(
                    f"VM {name} is {record.state_with_reason()}: only a running VM grows"
                )
            backend = self.backends[record.backend]
            if problem := backend.grow_problem(record.run):
                raise VmError.precondition(f"VM {name} cannot grow: {problem}")
            room = record.run
            if vcpus > room.max_vcpus:
                raise VmError.precondition(
                    f"vcpus: VM {name} was started with room for {room.max_vcpus} vCPUs, not {vcpus} "
                    "(vm_max_vcpus; a VM started after a change of it gets the new room)"
                )
            if memory_mib > spec.memory_mib:
                wanted = grown_memory_mib(spec.memory_mib, memory_mib)
                if wanted > room.max_memory_mib:
                    raise VmError.precondition(
                        f"memory_mib: VM {name} was started with room for {room.max_memory_mib} MiB, not "
                        f"{memory_mib} MiB ({wanted} MiB in whole memory blocks; vm_max_memory_mib)"
                    )
            # vCPUs first, then memory, the record saved after each: what was plugged is recorded
            # even when the other part fails.
            for step in ((vcpus, spec.memory_mib), (vcpus, memory_mib)):
                spec = record.spec
                now_vcpus, now_memory = await run_to_end(
                    backend.grow(live.handle, vcpus=step[0], memory_mib=step[1], shared=bool(spec.shared_dir))
                )
                record.plugged_vcpus += now_vcpus - spec.vcpus
                record.plugged_memory_mib += now_memory - spec.memory_mib
                record.spec = dataclasses.replace(spec, vcpus=now_vcpus, memory_mib=now_memory)
                self._save(record)
            log.info(
                "VM %s grown to %d vCPUs and %d MiB (plugged since its start: %d vCPUs, %d MiB)",
                name,
                record.spec.vcpus,
                record.spec.memory_mib,
                record.plugged_vcpus,
                record.plugged_memory_mib,
            )
            return record

    # -- watching ----------------------------------------------------------------------------

    def _watch(self, record: VmRecord, handle: VmHandle) -> None:
        live = _Live(handle)
        self._live[record.name] = live
        live.watcher = asyncio.get_running_loop().create_task(
            self._watcher(record, live), name=f"vm-watch-{record.name}"
        )

    async def _watcher(self, record: VmRecord, live: _Live) -> None:
        backend = self.backends[record.backend]
        trimmer = asyncio.get_running_loop().create_task(
            console.keep_trimmed(live.handle.console_path, self.console_log_limit),
            name=f"vm-console-{record.name}",
        )
        try:
            info = await backend.wait(live.handle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let a watcher die silently
            log.exception("VM %s: watching its VMM failed", record.name)
            info = ExitInfo(None, None, None, f"watching the VMM failed: {exc}")
        finally:
            trimmer.cancel()
        with contextlib.suppress(Exception):
            await backend.close(live.handle)
        # Last, with no await after it: whoever sees the new state also sees the watcher done.
        self._ended(record, live, info)

    def _ended(self, record: VmRecord, live: _Live | None, info: ExitInfo) -> None:
        tail = tail_of(record.console_path)
        guest = info.guest_initiated
        if guest is None:
            guest = console.powered_off(tail)
        if live is not None and live.stopping:
            record.state = State.STOPPED
            record.reason = "stopped"  # the stop says how, once the backend has told it
        elif guest:
            record.state = State.EXITED
            record.reason = info.detail if info.guest_initiated else f"{info.detail}: the guest powered off"
        else:
            record.state = State.CRASHED
            record.reason = info.detail
        record.exit_code, record.signal = info.exit_code, info.signal
        record.finished_at = time.time()
        record.console_tail = tail
        record.run = None
        self._save(record)
        run_dir = Path(record.run_dir)
        common.remove_quietly(*(run_dir / n for n in ("qmp.sock", "api.sock")))
        log.log(
            logging.INFO if record.state != State.CRASHED else logging.WARNING,
            "VM %s %s: %s",
            record.name,
            record.state,
            record.reason,
        )
        for listener in self._ended_listeners:
            try:
                listener(record)
            except Exception:
                log.exception("VM %s: a listener for its end failed", record.name)

    # -- status and console ------------------------------------------------------------------

    async def view(self, record: VmRecord) -> VmView:
        live = self._live.get(record.name)
        if live is None or not self._running(record.name):
            return VmView(record, "", 0, self.address(record))
        backend = self.backends[record.backend]
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                status = await backend.status(live.handle)
        except Exception as exc:
            status = f"unreachable: {exc or type(exc).__name__}"
        return VmView(record, status, live.handle.pid, self.address(record))

    async def list(self, name: str = "") -> builtins.list[VmView]:
        records = [self.get(name)] if name else self.all()
        return list(await asyncio.gather(*(self.view(r) for r in records)))

    def console_tail(self, name: str, lines: int = TAIL_LINES) -> builtins.list[str]:
        return tail_of(self.get(name).console_path, lines)

    async def console(self, name: str, tail: int | None, follow: bool) -> AsyncIterator[str]:
        record = self.get(name)
        async for line in console.follow(
            record.console_path, tail=tail, follow=follow, alive=lambda: self._running(name)
        ):
            yield line

    async def wait_for_console_marker(self, name: str, marker: str, timeout: float) -> float:
        """Seconds until ``marker`` is on the console of the current boot.

        DEADLINE_EXCEEDED (with the console's tail) when it does not appear in time,
        FAILED_PRECONDITION when the VM is not running or ends first.
        """
        record = self.get(name)
        if not self._running(name):
            raise VmError.precondition(f"VM {name} is {record.state}, not running")
        try:
            return await console.wait_for_marker(
                record.console_path, marker, timeout, alive=lambda: self._running(name)
            )
        except console.MarkerTimeout:
            raise VmError.deadline(
                f"VM {name}: {marker!r} did not appear on the console within {timeout:g} s. Console tail:\n"
                + "\n".join(self.console_tail(name))
            ) from None
        except console.VmEnded:
            await self._wait_watcher(name)
            raise VmError.precondition(
                f"VM {name} ended ({record.reason}) before {marker!r} appeared. Console tail:\n"
                + "\n".join(record.console_tail)
            ) from None

    # -- persistence and recovery ------------------------------------------------------------

    def _save(self, record: VmRecord) -> None:
        self._store.put(KIND, record.name, record.to_doc())  # first: it may fail (disk full)
        self._records[record.name] = record

    def _delete(self, record: VmRecord) -> None:
        self._store.delete(KIND, record.name)
        self._records.pop(record.name, None)

    async def recover(self) -> None:
        """Reload VMs from the store, reattach running VMMs, clean what is half-made or gone."""
        for record in self._store.load(KIND, VmRecord.from_doc):
            name = record.name
            try:
                await self._recover_one(record)
            except Exception:
                log.exception("VM %s: recovery failed; keeping its record", name)
                self._records[name] = record
        running = sum(1 for n in self._records if self._running(n))
        log.info("recovered %d VMs (%d running)", len(self._records), running)

    async def _recover_one(self, record: VmRecord) -> None:
        name = record.name
        if record.backend not in self.backends:
            log.warning("VM %s uses backend %s, which is not configured", name, record.backend)
            self._records[name] = record
            return
        if record.state == State.ALLOCATING:
            log.warning("VM %s was being allocated when auraed stopped; removing it", name)
            await asyncio.to_thread(self._unmake, record)
            self._store.delete(KIND, name)
            return
        self._records[name] = record
        if record.state not in ACTIVE_STATES:
            return
        backend = self.backends[record.backend]
        handle = backend.reattach(record.run) if record.run is not None else None
        if handle is not None:
            record.state = State.RUNNING
            self._save(record)
            self._watch(record, handle)
            log.info("VM %s: reattached to its VMM (pid %d)", name, handle.pid)
            return
        killed = await asyncio.to_thread(common.kill_processes_referencing, Path(record.run_dir))
        if record.run is None:
            record.state, record.reason = State.STOPPED, "auraed stopped while starting it"
            record.finished_at = time.time()
            record.console_tail = tail_of(record.console_path)
            record.run = None
            self._save(record)
            common.remove_quietly(*(Path(record.run_dir) / n for n in ("qmp.sock", "api.sock")))
            log.warning("VM %s was starting when auraed stopped; killed %s", name, killed or "nothing")
            return
        detail = "the VMM ended while auraed was not running"
        if killed:
            detail = "the VMM lost its control socket while auraed was not running; killed it"
        self._ended(record, None, ExitInfo(None, None, None, detail))

    async def close(self) -> None:
        """Stop watching and drop control connections; VMs keep running (recover finds them)."""
        for name, live in list(self._live.items()):
            if live.watcher is not None:
                live.watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await live.watcher
            with contextlib.suppress(Exception):
                await self.backends[self._records[name].backend].close(live.handle)
        self._live.clear()

    async def shutdown(self, stop_vms: bool) -> None:
        """At daemon shutdown: stop every running VM (when asked) and close."""
        if stop_vms:
            for name in [n for n in self._records if self._running(n)]:
                with contextlib.suppress(VmError):
                    await self.stop(name)
        await self.close()
