"""VMs for real: QEMU (TCG here) booting guest-image/build's kernel, real taps, real host routes.

Guests:
- the bare initramfs prints AURAE-BARE-BOOT-OK and powers off (the "exits by itself" guest);
- the kernel alone, without an initramfs, panics for want of a root and then stays up (panic
  timeout 0): a guest that runs until it is stopped and ignores the power button.

Every test gets its own state, run directory and a small address pool checked free on the host;
the fixture kills every process and removes every tap and file it made, also when a test fails.
Set AURAED_TEST_GUEST_IMAGE to a directory guest-image/build printed to skip its (cached) run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from auraed.api.aurae.vms import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.server.rpc import generic_handler
from auraed.state.store import Store
from auraed.system.kvm import probe_kvm
from auraed.vms import backend as common
from auraed.vms import network
from auraed.vms.backend import Room
from auraed.vms.cloud_hypervisor import CloudHypervisorBackend
from auraed.vms.errors import VmError
from auraed.vms.guests import Guests, GuestTrust
from auraed.vms.model import State, VmRecord, VmSpec, parse_vm
from auraed.vms.qemu import QemuBackend
from auraed.vms.servicer import SERVICE_NAME, VmServicer
from auraed.vms.vms import KIND, Vms
from tests.support.workers import worker_share

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BARE_MARKER = "AURAE-BARE-BOOT-OK"
PANIC_MARKER = "end Kernel panic"
BOOT_TIMEOUT = 120.0
# Test pools come from here, one random /28 (4 blocks) per test, checked free on the host.
TEST_RANGE = ipaddress.IPv4Network("10.213.192.0/18")


def free_test_pool(prefixlen: int = 28, within: ipaddress.IPv4Network = TEST_RANGE) -> ipaddress.IPv4Network:
    """A random /``prefixlen`` of this worker's share of ``within`` (``worker_share``: no other
    test worker picks from it) that nothing on the host overlaps."""
    host = network.host_networks()
    candidates = list(worker_share(within).subnets(new_prefix=prefixlen))
    random.shuffle(candidates)
    for pool in candidates:
        if not network.conflicts(pool, host):
            return pool
    raise AssertionError(f"no free /{prefixlen} in {within} on this host")


NO_POD_TEMPLATE = ("--cri-vm-boot", "cold")
"""For a daemon that boots guests but runs no vm pod: no guest template made in the background at
its start for pods it never has (a guest's boot of CPU on a 2-core machine, beside its own)."""


def guest_host_args(guest_image: Path, ca_key: Path) -> list[str]:
    """A host daemon's flags for booting guests: the guest image, the CA key that issues each
    guest its certificate, and a free address pool of the tests' range."""
    return [
        "--guest-image", str(guest_image),
        "--ca-key", str(ca_key),
        "--vm-address-pool", str(free_test_pool()),
    ]  # fmt: skip


class VmEnv:
    """One test's VMs: store, run directory, pool; every Vms made here is cleaned up."""

    def __init__(self, root: Path, guest: Path, machine: str = "microvm", room: Room | None = None) -> None:
        self.root = root
        self.guest = guest
        self.machine = machine  # QEMU's
        self.room = room  # QEMU's vm_max_vcpus, vm_max_memory_mib, vm_memory_slots (None: defaults)
        self.pool = free_test_pool()
        self.store = Store(root / "state" / "auraed.db")
        self.made: list[Vms] = []
        self.kvm_usable = probe_kvm().usable

    def backends(self) -> dict[str, QemuBackend | CloudHypervisorBackend]:
        return {
            "qemu": QemuBackend(
                machine=self.machine,
                kvm_usable=lambda: self.kvm_usable,
                max_vcpus=self.room.max_vcpus if self.room else 0,
                max_memory_mib=self.room.max_memory_mib if self.room else 0,
                memory_slots=self.room.slots if self.room else 10,
            ),
            "cloud-hypervisor": CloudHypervisorBackend(kvm_usable=lambda: self.kvm_usable),
        }

    def vms(self, store: Store | None = None, pool: ipaddress.IPv4Network | None = None) -> Vms:
        made = Vms(
            store or self.store,
            self.backends(),
            runtime_dir=self.root / "run",
            pool=pool or self.pool,
            guest_port=8080,
            default_stop_timeout=2.0,
        )
        self.made.append(made)
        return made

    def spec(self, name: str, guest: str = "bare", **fields: object) -> VmSpec:
        values: dict[str, object] = {
            "name": name,
            "kernel": str(self.guest / "vmlinuz"),
            "memory_mib": 256,
            "network": True,
        }
        if guest == "bare":
            values["initramfs"] = str(self.guest / "bare-initramfs.img")
        values.update(fields)
        return parse_vm(pb.VirtualMachine(**values))  # type: ignore[arg-type]

    def taps(self) -> set[str]:
        """Every tap holding an address of this test's pool."""
        found = set()
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            words = line.split()
            if words[1].startswith("atap") and ipaddress.IPv4Interface(words[3]).ip in self.pool:
                found.add(words[1])
        return found

    async def cleanup(self) -> None:
        for made in self.made:
            # Whatever close() raises, even a CancelledError, the tear-down below must still run.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await made.close()
        common.kill_processes_referencing(self.root)
        taps = self.taps()
        for _, doc in self.store.list(KIND):
            if doc.get("net"):
                taps.add(doc["net"]["tap"])
        for tap in taps:
            owner = network.tap_owner(tap) or ""
            if owner.startswith(f"auraed-vm {self.root}/"):  # ours, never another run's
                with contextlib.suppress(Exception):
                    network.delete_tap(tap)
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
async def env(guest_image: Path) -> AsyncIterator[VmEnv]:
    # Short paths: unix socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="aurae-vm-", dir="/tmp"))
    try:
        made = VmEnv(root, guest_image)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield made
    finally:
        await made.cleanup()


async def eventually(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False).stdout


def host_state() -> tuple[str, str, str]:
    return ip("-o", "link"), ip("-o", "addr"), ip("-4", "route", "show", "table", "all")


def expect_error(kind: ErrorKind) -> pytest.RaisesExc[AuraeError]:
    return pytest.raises(AuraeError, check=lambda e: e.kind is kind)


# -- allocation and the network ------------------------------------------------------------------


async def test_allocate_makes_a_checked_tap_and_free_removes_everything(env: VmEnv) -> None:
    vms = env.vms()
    host_before = network.host_networks()
    record = await vms.allocate(env.spec("net1"))
    assert record.state == State.ALLOCATED and record.backend == "qemu"
    net = record.net
    assert net is not None
    block = ipaddress.IPv4Network(f"{net.host_ip}/30", strict=False)
    assert block.subnet_of(env.pool)
    assert (net.host_ip, net.guest_ip) == (str(block.network_address + 1), str(block.network_address + 2))
    assert net.tap.startswith("atap") and len(net.tap) <= 15
    assert network.tap_owner(net.tap) == f"auraed-vm {record.run_dir}"
    # The block overlapped nothing the host had before.
    assert network.conflicts(block, host_before) == []
    # The tap: ours, up, with exactly the host address, and only the kernel's connected routes.
    assert network.tap_addresses(net.tap) == [f"{net.host_ip}/30"]
    details = ip("-d", "link", "show", "dev", net.tap)
    assert "tun type tap" in details and "UP" in details
    routes = [
        line for line in ip("-4", "route", "show", "table", "all").splitlines() if f"dev {net.tap}" in line
    ]
    assert routes and all("proto kernel" in line for line in routes), routes
    assert any(line.startswith(f"{block} dev {net.tap}") for line in routes)
    # Persisted, before and after.
    doc = env.store.get(KIND, "net1")
    assert doc is not None and doc["state"] == State.ALLOCATED and doc["net"]["tap"] == net.tap
    with expect_error(ErrorKind.ALREADY_EXISTS):
        await vms.allocate(env.spec("net1"))
    run_dir = Path(record.run_dir)
    assert run_dir.is_dir()

    await vms.free("net1")
    assert not network.tap_exists(net.tap)
    assert not run_dir.exists()
    assert env.store.get(KIND, "net1") is None
    with expect_error(ErrorKind.NOT_FOUND):
        vms.get("net1")
    with expect_error(ErrorKind.NOT_FOUND):
        await vms.free("net1")


async def test_pool_exhaustion_and_reuse(env: VmEnv) -> None:
    pool = ipaddress.IPv4Network(f"{env.pool.network_address}/29")  # 2 blocks
    vms = env.vms(pool=pool)
    first = await vms.allocate(env.spec("a"))
    second = await vms.allocate(env.spec("b"))
    assert first.net is not None and second.net is not None
    assert first.net.index != second.net.index
    # Without network a VM needs no block.
    await vms.allocate(env.spec("quiet", network=False))
    with pytest.raises(VmError) as caught:
        await vms.allocate(env.spec("c"))
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert str(pool) in caught.value.message
    assert env.store.get(KIND, "c") is None
    await vms.free("a")
    third = await vms.allocate(env.spec("c"))
    assert third.net is not None and third.net.index == first.net.index


async def test_a_pool_overlapping_the_host_is_refused_without_touching_anything(env: VmEnv) -> None:
    before = host_state()
    vms = env.vms(pool=ipaddress.IPv4Network("192.0.2.0/24"))
    with pytest.raises(VmError) as caught:
        await vms.allocate(env.spec("clash"))
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "192.0.2.0/24" in caught.value.message and "eth0" in caught.value.message
    assert host_state() == before
    assert env.store.list(KIND) == []
    assert not (env.root / "run" / "vms" / "clash").exists()


async def test_blocks_another_daemon_holds_on_the_host_are_skipped(env: VmEnv) -> None:
    pool = ipaddress.IPv4Network(f"{env.pool.network_address}/29")
    first = env.vms(pool=pool)
    ours = await first.allocate(env.spec("one"))
    # A second daemon (its own store) knows nothing of "one", but sees its tap's route.
    other = env.vms(store=Store(env.root / "other" / "auraed.db"), pool=pool)
    theirs = await other.allocate(env.spec("two"))
    assert ours.net is not None and theirs.net is not None
    assert (ours.net.index, theirs.net.index) == (0, 1)
    with pytest.raises(VmError) as caught:
        await other.allocate(env.spec("three"))
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "overlapping the host" in caught.value.message and ours.net.tap in caught.value.message
    # A tap is only ever removed by its owner.
    assert network.delete_tap(ours.net.tap, owner=f"auraed-vm {env.root}/elsewhere") is False
    assert network.tap_exists(ours.net.tap)
    await other.free("two")


async def test_a_tap_name_another_daemon_takes_after_the_pick_is_not_taken_over(
    env: VmEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two daemons allocating at once may pick the same free ``atap<N>``. The one that creates it
    second must neither fail nor attach to the other's tap (TUNSETIFF without IFF_TUN_EXCL
    attaches to an existing tap): it takes the next free name, and the other's tap is untouched."""
    foreign_owner = f"auraed-vm {env.root}/other/run/foreign"
    foreign: list[str] = []
    real_pick = network.pick

    def pick_and_lose_the_race(*args: object) -> object:
        picked = real_pick(*args)  # type: ignore[arg-type]
        if not foreign:  # the other daemon makes a tap of the same name right after our pick
            foreign.append(picked.tap)
            subprocess.run(["ip", "tuntap", "add", "dev", picked.tap, "mode", "tap"], check=True)
            subprocess.run(["ip", "link", "set", "dev", picked.tap, "alias", foreign_owner], check=True)
        return picked

    monkeypatch.setattr(network, "pick", pick_and_lose_the_race)
    vms = env.vms()
    try:
        record = await vms.allocate(env.spec("racer"))
        assert record.net is not None and foreign and record.net.tap != foreign[0]
        assert network.tap_owner(record.net.tap) == f"auraed-vm {record.run_dir}"
        assert network.tap_addresses(record.net.tap) == [f"{record.net.host_ip}/30"]
        doc = env.store.get(KIND, "racer")
        assert doc is not None and doc["net"]["tap"] == record.net.tap
        assert network.tap_owner(foreign[0]) == foreign_owner and network.tap_addresses(foreign[0]) == []
        # The kernel itself refuses the name now taken, however late the check before it was.
        with pytest.raises(network.TapNameTaken):
            network._add_persistent_tap(foreign[0])
        assert network.tap_owner(foreign[0]) == foreign_owner
        await vms.free("racer")
        assert not network.tap_exists(record.net.tap) and network.tap_exists(foreign[0])
    finally:
        for tap in foreign:
            subprocess.run(["ip", "link", "del", "dev", tap], capture_output=True, check=False)


async def test_bad_requests(env: VmEnv) -> None:
    vms = env.vms()
    kernel = env.root / "vmlinuz"
    shutil.copy(env.guest / "vmlinuz", kernel)
    await vms.allocate(env.spec("gone", kernel=str(kernel), network=False))
    kernel.unlink()
    with pytest.raises(VmError) as caught:
        await vms.start("gone")
    assert caught.value.kind is ErrorKind.NOT_FOUND and str(kernel) in caught.value.message
    assert vms.get("gone").state == State.ALLOCATED
    with expect_error(ErrorKind.NOT_FOUND):
        await vms.start("absent")
    with expect_error(ErrorKind.NOT_FOUND):
        env.spec("x", initramfs=str(env.root / "missing.img"))
    # cloud-hypervisor is refused here: not installed, and KVM does not really work.
    with pytest.raises(VmError) as caught:
        await vms.allocate(env.spec("ch", backend="cloud-hypervisor"))
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert env.store.get(KIND, "ch") is None


# -- real guests ------------------------------------------------------------------------------


async def test_bare_guest_boots_prints_its_marker_and_its_power_off_is_reported(env: VmEnv) -> None:
    config = env.root / "config.img"
    config.write_bytes(b"\0" * 65536)
    vms = env.vms()
    spec = env.spec(
        "bare",
        root_disk=str(env.guest / "rootfs.img"),
        extra_disks=[pb.Disk(path=str(config))],
    )
    record = await vms.allocate(spec)
    assert record.net is not None
    started = time.monotonic()
    record, ready = await vms.start("bare", wait_for_console=BARE_MARKER, timeout=BOOT_TIMEOUT)
    assert ready is not None and 0 < ready < BOOT_TIMEOUT
    assert record.net is not None
    print(f"\nQEMU ({record.accelerator}) start to {BARE_MARKER}: {ready:.2f} s")
    handle = vms.handle("bare")
    assert handle is not None
    # The console as a stream: everything from the start, ending when the VMM ends.
    lines = [line async for line in vms.console("bare", tail=None, follow=True)]
    assert BARE_MARKER in lines
    await eventually(lambda: record.state != State.RUNNING)
    assert record.state == State.EXITED, record.reason
    assert record.reason == "the guest powered off"
    assert record.exit_code == 0 and record.signal is None
    assert BARE_MARKER in record.console_tail
    assert any("reboot: Power down" in line for line in record.console_tail)
    assert time.monotonic() - started < BOOT_TIMEOUT
    # The VMM is gone and reaped, its socket removed; the allocation (tap) stays.
    assert not handle.alive and handle.process is not None and handle.process.returncode == 0
    assert not handle.control_socket.exists()
    assert network.tap_exists(record.net.tap)
    (view,) = await vms.list()
    assert (view.backend_status, view.pid) == ("", 0)
    doc = env.store.get(KIND, "bare")
    assert doc is not None and doc["state"] == State.EXITED and doc["run"] is None
    # The kernel got what auraed sets, the guest's network among it.
    cmdline = next(line for line in console_lines(record) if "Command line:" in line)
    for word in (
        "console=ttyS0",
        "tsc_early_khz=",
        "auraed.hostname=bare",
        f"auraed.ip={record.net.guest_ip}/30",
        f"auraed.gateway={record.net.host_ip}",
    ):
        assert word in cmdline
    await vms.free("bare")
    assert not network.tap_exists(record.net.tap)
    assert not Path(record.run_dir).exists()


def console_lines(record: VmRecord) -> list[str]:
    return record.console_path.read_text(errors="replace").splitlines()


async def start_lingering(vms: Vms, env: VmEnv, name: str, **fields: object) -> VmRecord:
    """A guest that stays up: the kernel alone panics (no root) and then waits forever."""
    await vms.allocate(env.spec(name, guest="kernel-only", **fields))
    record, _ = await vms.start(name, wait_for_console=PANIC_MARKER, timeout=BOOT_TIMEOUT)
    return record


async def test_running_guest_status_forced_stop_restart_and_free(env: VmEnv) -> None:
    config = env.root / "config.img"
    config.write_bytes(b"\0" * 65536)
    vms = env.vms()
    record = await start_lingering(
        vms, env, "linger", root_disk=str(env.guest / "rootfs.img"), extra_disks=[pb.Disk(path=str(config))]
    )
    handle = vms.handle("linger")
    assert handle is not None and handle.alive
    (view,) = await vms.list()
    assert (view.record.state, view.backend_status, view.pid) == (State.RUNNING, "running", handle.pid)
    assert view.address == f"{record.net.guest_ip}:8080" if record.net else False
    # Both disks read-only, as QEMU itself reports them.
    qemu = vms.backends["qemu"]
    assert isinstance(qemu, QemuBackend)
    blocks = await qemu.query(handle, "query-block")
    assert isinstance(blocks, list)
    assert sorted((b["inserted"]["file"], b["inserted"]["ro"]) for b in blocks) == sorted(
        [(str(env.guest / "rootfs.img"), True), (str(config), True)]
    )
    # The panicked guest ignores the power button: forced after the timeout.
    started = time.monotonic()
    stopped = await vms.stop("linger", timeout=1.0)
    took = time.monotonic() - started
    assert stopped.state == State.STOPPED
    assert "ended after the 1 s timeout" in stopped.reason
    assert 1.0 <= took < 15
    assert not handle.alive and not handle.control_socket.exists()
    assert stopped.console_tail and any(PANIC_MARKER in line for line in stopped.console_tail)
    # Stop again: nothing to do.
    assert (await vms.stop("linger")).state == State.STOPPED
    # Start again: a new VMM, the last boot's console kept aside.
    again, _ = await vms.start("linger", wait_for_console=PANIC_MARKER, timeout=BOOT_TIMEOUT)
    second = vms.handle("linger")
    assert again.state == State.RUNNING and second is not None and second.pid != handle.pid
    assert (Path(again.run_dir) / "console.previous.log").exists()
    with expect_error(ErrorKind.FAILED_PRECONDITION):
        await vms.start("linger")
    # Free a running VM: VMM, tap, sockets and files all go.
    await vms.free("linger", timeout=0)
    assert not second.alive
    assert record.net is not None and not network.tap_exists(record.net.tap)
    assert not Path(again.run_dir).exists()
    assert common.processes_referencing(env.root) == []


async def test_kill_9_of_qemu_is_noticed_and_reported(env: VmEnv) -> None:
    vms = env.vms()
    record = await start_lingering(vms, env, "victim")
    handle = vms.handle("victim")
    assert handle is not None
    os.kill(handle.pid, signal.SIGKILL)
    await eventually(lambda: record.state != State.RUNNING, timeout=10)
    assert record.state == State.CRASHED
    assert record.signal == signal.SIGKILL and record.exit_code is None
    assert "signal 9" in record.reason
    assert any(PANIC_MARKER in line for line in record.console_tail)
    assert not handle.control_socket.exists()
    (view,) = await vms.list()
    assert view.backend_status == "" and view.pid == 0
    doc = env.store.get(KIND, "victim")
    assert doc is not None and doc["state"] == State.CRASHED and doc["signal"] == 9


async def test_start_timeout_stops_the_vm_and_reports_the_console(env: VmEnv) -> None:
    vms = env.vms()
    await vms.allocate(env.spec("slow", guest="kernel-only", network=False))
    with pytest.raises(VmError) as caught:
        await vms.start("slow", wait_for_console="NEVER-PRINTED", timeout=5)
    assert caught.value.kind is ErrorKind.DEADLINE_EXCEEDED
    assert "NEVER-PRINTED" in caught.value.message and "Console tail" in caught.value.message
    record = vms.get("slow")
    assert record.state == State.STOPPED and "NEVER-PRINTED" in record.reason
    assert common.processes_referencing(env.root) == []


# -- recovery -----------------------------------------------------------------------------------


async def test_recovery_reattaches_a_running_vm_by_pid_and_notices_its_end(env: VmEnv) -> None:
    first = env.vms()
    record = await start_lingering(first, env, "survivor")
    handle = first.handle("survivor")
    assert handle is not None
    pid = handle.pid
    await first.close()  # auraed goes away; the VM does not
    assert handle.alive
    second = env.vms()
    await second.recover()
    (view,) = await second.list()
    assert (view.record.state, view.pid, view.backend_status) == (State.RUNNING, pid, "running")
    reattached = second.handle("survivor")
    assert reattached is not None and reattached.process is None
    # Its end is noticed through the pidfd, though it is not our child.
    os.kill(pid, signal.SIGKILL)
    recovered = second.get("survivor")
    await eventually(lambda: recovered.state != State.RUNNING, timeout=10)
    assert recovered.state == State.CRASHED
    assert recovered.exit_code is None  # not our child: its status is not ours to read
    assert record.net is not None and network.tap_exists(record.net.tap)
    await second.free("survivor")
    assert not network.tap_exists(record.net.tap)


async def test_recovery_of_vms_that_ended_or_were_half_made_while_auraed_was_down(env: VmEnv) -> None:
    first = env.vms()
    await first.allocate(env.spec("ended"))
    await first.start("ended")
    handle = first.handle("ended")
    assert handle is not None
    await first.close()
    # The guest powers off while no auraed watches it.
    await eventually(lambda: not handle.alive, timeout=BOOT_TIMEOUT)
    assert handle.process is not None
    handle.process.wait()
    # A VM whose allocation was interrupted after its tap was made.
    half = await first.allocate(env.spec("half"))
    assert half.net is not None
    doc = env.store.get(KIND, "half")
    assert doc is not None
    env.store.put(KIND, "half", {**doc, "state": State.ALLOCATING})
    # A VM whose start was interrupted before its VMM's pid was recorded: a stray process.
    await first.allocate(env.spec("starting", network=False))
    starting_dir = env.root / "run" / "vms" / "starting"
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", str(starting_dir)], start_new_session=True
    )
    doc = env.store.get(KIND, "starting")
    assert doc is not None
    env.store.put(KIND, "starting", {**doc, "state": State.STARTING, "run": None})

    second = env.vms()
    await second.recover()
    ended = second.get("ended")
    assert ended.state == State.EXITED
    assert "while auraed was not running" in ended.reason and "powered off" in ended.reason
    assert BARE_MARKER in ended.console_tail
    with expect_error(ErrorKind.NOT_FOUND):
        second.get("half")
    assert not network.tap_exists(half.net.tap)
    assert env.store.get(KIND, "half") is None
    await eventually(lambda: stray.poll() is not None, timeout=10)
    assert second.get("starting").state == State.STOPPED
    # Everything recovered is usable again.
    _, ready = await second.start("ended", wait_for_console=BARE_MARKER, timeout=BOOT_TIMEOUT)
    assert ready is not None


# -- over gRPC ----------------------------------------------------------------------------------


async def test_vm_service_over_grpc(env: VmEnv) -> None:
    vms = env.vms()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([generic_handler(SERVICE_NAME, VmServicer(vms, _no_guests(vms)))])
    address = f"unix:{env.root}/vms.sock"
    server.add_insecure_port(address)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:

            def unary(method: str, response: type) -> Callable[..., object]:
                return channel.unary_unary(
                    f"/{SERVICE_NAME}/{method}",
                    request_serializer=bytes,
                    response_deserializer=response().parse,
                )

            allocate = unary("Allocate", pb.VmServiceAllocateResponse)
            start = unary("Start", pb.VmServiceStartResponse)
            listing = unary("List", pb.VmServiceListResponse)
            free = unary("Free", pb.VmServiceFreeResponse)
            vm = pb.VirtualMachine(
                name="rpc",
                kernel=str(env.guest / "vmlinuz"),
                initramfs=str(env.guest / "bare-initramfs.img"),
                memory_mib=256,
                network=True,
                # Not "guest": that role makes the host provision a guest auraed (config disk,
                # readiness), which the bare initramfs is not. Any role reaches the command line.
                role="nested",
            )
            allocated = await allocate(pb.VmServiceAllocateRequest(vm=vm))  # type: ignore[misc]
            status = allocated.status
            assert status.state == pb.VmState.ALLOCATED and status.backend == "qemu"
            assert status.tap.startswith("atap") and status.host_address.endswith("/30")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await allocate(pb.VmServiceAllocateRequest(vm=vm))  # type: ignore[misc]
            assert failed.value.code() == grpc.StatusCode.ALREADY_EXISTS
            missing = pb.VirtualMachine(name="nokernel", kernel="/nonexistent/vmlinuz")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await allocate(pb.VmServiceAllocateRequest(vm=missing))  # type: ignore[misc]
            assert failed.value.code() == grpc.StatusCode.NOT_FOUND
            assert "/nonexistent/vmlinuz" in (failed.value.details() or "")

            started = await start(  # type: ignore[misc]
                pb.VmServiceStartRequest(name="rpc", wait_for_console=BARE_MARKER, timeout_ms=120_000)
            )
            guest_ip = status.guest_address.split("/")[0]
            assert started.address == f"{guest_ip}:8080"
            assert started.console_ready_ms > 0
            console = channel.unary_stream(
                f"/{SERVICE_NAME}/GetConsole",
                request_serializer=bytes,
                response_deserializer=pb.VmServiceGetConsoleResponse().parse,
            )
            lines = [m.line async for m in console(pb.VmServiceGetConsoleRequest(name="rpc", follow=True))]
            assert BARE_MARKER in lines
            assert any("auraed.role=nested" in line for line in lines)
            await eventually(lambda: vms.get("rpc").state == State.EXITED)
            (listed,) = (await listing(pb.VmServiceListRequest())).vms  # type: ignore[misc]
            assert listed.state == pb.VmState.EXITED and listed.exit_code == 0
            assert BARE_MARKER in listed.console_tail
            tail = [m.line async for m in console(pb.VmServiceGetConsoleRequest(name="rpc", tail=2))]
            assert len(tail) == 2 and "Power down" in tail[-1]
            await free(pb.VmServiceFreeRequest(name="rpc"))  # type: ignore[misc]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await listing(pb.VmServiceListRequest(name="rpc"))  # type: ignore[misc]
            assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)


def _no_guests(vms: Vms) -> Guests:
    """These VMs run no guest auraed: the guest hooks stay idle."""
    return Guests(
        vms,
        GuestTrust(Path("/nonexistent/ca.crt"), Path("/nonexistent/ca.key"), Path("/nonexistent")),
        Path("/nonexistent"),
        1.0,
    )
