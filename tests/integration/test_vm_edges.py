"""VMs at their edges, for real: hostile guests on a tap, callers that hang up, pools that change.

- Taps are hardened before they are up: checked in a network namespace of the test's own (made
  by unshare in a thread, gone with it), where a router advertisement is written into the tap the
  way a guest would send it, so that nothing on the host's own network could ever be changed.
- Allocate and Start cancelled mid-way (a client hanging up) leave no tap and no VMM behind. The
  VMM is QEMU (TCG) booting a tiny PVH kernel made here that halts at once and stays up.
- A VM's /30 is held by network: a pool changed in the configuration never hands it out twice.

Taps on the host come from a small pool checked free on the host; every tap, process and file a
test makes is removed by the fixture, also when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from auraed.api.aurae.vms import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.pki import PkiPaths
from auraed.server.rpc import generic_handler
from auraed.state.store import Store
from auraed.vms import backend as common
from auraed.vms import network
from auraed.vms.errors import VmError
from auraed.vms.guests import Guests, GuestTrust
from auraed.vms.model import NetInfo, State, VmSpec, parse_vm
from auraed.vms.qemu import QemuBackend
from auraed.vms.servicer import SERVICE_NAME, VmServicer
from auraed.vms.vms import KIND, Vms, tap_owner
from tests.integration.test_vms import free_test_pool

# A console line in a VM's status is cut to this (auraed.vms.vms.TAIL_LINE_MAX).
TAIL_LINE_MAX = 1024

pytestmark = pytest.mark.slow

T = TypeVar("T")

# Test pools come from here (apart from test_vms.py's range), checked free on the host.
TEST_RANGE = ipaddress.IPv4Network("10.213.128.0/18")
MEMORY_MIB = 64
DATA_DISK_BYTES = 4096
SETTLE = 1.0  # seconds for work a cancelled call left in a thread to finish (it would leak then)
GUEST_READY_TIMEOUT = 120.0  # longer than the test waits: only the cancellation ends the wait
GUEST_WAITED = 0.5  # seconds the host waits for the guest before the Start is cancelled
CANCEL_DELAYS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1)  # seconds into the call it is cancelled

# -- a kernel that boots at once and then does nothing -------------------------------------------

PVH_LOAD_ADDRESS = 0x100000  # 1 MiB, where x86 kernels load
HALT_CODE = bytes([0xFA, 0xF4, 0xEB, 0xFD])  # cli; hlt; jmp back to hlt
XEN_ELFNOTE_PHYS32_ENTRY = 18  # the note QEMU boots an ELF kernel through PVH by
NOTE_OFFSET, CODE_OFFSET = 0x100, 0x200


def halting_kernel(path: Path) -> Path:
    """A 32-bit ELF kernel with a PVH entry note whose entry halts forever (QEMU keeps running)."""
    note = (
        struct.pack("<III", 4, 4, XEN_ELFNOTE_PHYS32_ENTRY) + b"Xen\0" + struct.pack("<I", PVH_LOAD_ADDRESS)
    )
    ident = b"\x7fELF\x01\x01\x01".ljust(16, b"\0")  # 32-bit, little-endian, version 1
    header = struct.pack("<16sHHIIIIIHHHHHH", ident, 2, 3, 1, PVH_LOAD_ADDRESS, 52, 0, 0, 52, 32, 2, 40, 0, 0)
    load = struct.pack("<8I", 1, CODE_OFFSET, PVH_LOAD_ADDRESS, PVH_LOAD_ADDRESS, 4, 4, 5, 0x100)
    note_header = struct.pack("<8I", 4, NOTE_OFFSET, 0, 0, len(note), len(note), 4, 4)
    image = bytearray(CODE_OFFSET + len(HALT_CODE))
    image[: len(header) + 64] = header + load + note_header
    image[NOTE_OFFSET : NOTE_OFFSET + len(note)] = note
    image[CODE_OFFSET:] = HALT_CODE
    path.write_bytes(bytes(image))
    return path


# -- a network namespace of the test's own ---------------------------------------------------------

# What a tap must have (net.<family>.conf.<tap>.<setting>) before a guest can send anything.
HARDENED = {
    "ipv6.disable_ipv6": "1",
    "ipv6.accept_ra": "0",
    "ipv4.rp_filter": "1",
    "ipv4.accept_redirects": "0",
    "ipv4.send_redirects": "0",
}
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def in_new_netns(work: Callable[[], T]) -> T:
    """Run ``work`` in a thread of its own that unshared its network namespace first.

    The namespace has no name and nothing else in it: it goes when the thread ends, with every
    link made in it. pyroute2's own netns helpers fork, which is avoided here as in the daemon.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            result.append(work())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="test-netns")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def router_advertisement() -> bytes:
    """An Ethernet frame a guest could send: an IPv6 RA offering itself as the default router
    (lifetime 1800 s) and a prefix for addresses (2001:db8:1::/64, on-link, autonomous)."""
    source = socket.inet_pton(socket.AF_INET6, "fe80::ae:1")
    all_nodes = socket.inet_pton(socket.AF_INET6, "ff02::1")
    icmp = struct.pack("!BBHBBHII", 134, 0, 0, 64, 0, 1800, 0, 0)
    prefix = socket.inet_pton(socket.AF_INET6, "2001:db8:1::")
    icmp += struct.pack("!BBBBIII", 3, 4, 64, 0xC0, 86400, 14400, 0) + prefix
    pseudo = source + all_nodes + struct.pack("!I3xB", len(icmp), socket.IPPROTO_ICMPV6)
    icmp = icmp[:2] + struct.pack("!H", _checksum(pseudo + icmp)) + icmp[4:]
    ipv6 = struct.pack("!IHBB", 6 << 28, len(icmp), socket.IPPROTO_ICMPV6, 255) + source + all_nodes
    ethernet = bytes.fromhex("333300000001") + bytes.fromhex("02ae00000001") + b"\x86\xdd"
    return ethernet + ipv6 + icmp


def test_a_tap_is_hardened_before_it_is_up_and_a_guest_s_router_advertisement_changes_nothing() -> None:
    net = NetInfo(0, "atap0", "10.213.0.1", "10.213.0.2", 30, "02:ae:0a:d5:00:02")

    def work() -> tuple[dict[str, str], list[tuple[object, int]], list[str]]:
        from pyroute2 import IPRoute

        network.create_tap(net, "test")
        settings = {
            f"{family}.{setting}": (Path("/proc/sys/net") / family / "conf" / net.tap / setting)
            .read_text()
            .strip()
            for family, setting in (key.split(".") for key in HARDENED)
        }
        # Be the guest: attach to the tap and send router advertisements into it.
        tap = os.open("/dev/net/tun", os.O_RDWR)
        try:
            fcntl.ioctl(tap, TUNSETIFF, struct.pack("16sH", net.tap.encode(), IFF_TAP | IFF_NO_PI))
            for _ in range(3):
                os.write(tap, router_advertisement())
                time.sleep(0.2)
            with IPRoute() as ipr:
                routes = [
                    (r.get_attr("RTA_DST"), r["dst_len"]) for r in ipr.get_routes(family=socket.AF_INET6)
                ]
                addresses = [str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr(family=socket.AF_INET6)]
        finally:
            os.close(tap)
            network.delete_tap(net.tap)
        return settings, routes, addresses

    settings, routes, addresses = in_new_netns(work)
    assert routes == [], "a guest's router advertisement installed routes"
    assert addresses == [], "a guest's router advertisement gave the host addresses"
    assert settings == HARDENED


# -- VMs on the host ------------------------------------------------------------------------------


class Env:
    """One test's VMs: its store, run directory, pool and kernel; cleaned up whatever happens."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = free_test_pool(within=TEST_RANGE)
        self.store = Store(root / "state" / "auraed.db")
        self.kernel = halting_kernel(root / "halt.elf")
        self.made: list[Vms] = []

    def vms(self, pool: ipaddress.IPv4Network | None = None) -> Vms:
        made = Vms(
            self.store,
            {"qemu": QemuBackend(kvm_usable=lambda: False)},
            runtime_dir=self.root / "run",
            pool=pool or self.pool,
            default_stop_timeout=0.0,
        )
        self.made.append(made)
        return made

    def spec(self, name: str, network: bool = True, role: str = "") -> VmSpec:
        message = pb.VirtualMachine(
            name=name,
            kernel=str(self.kernel),
            memory_mib=MEMORY_MIB,
            network=network,
            backend="qemu",
            role=role,
        )
        return parse_vm(message)

    def taps(self) -> set[str]:
        """The taps on the host that VMs of this test made."""
        mine = set()
        for name in network.link_names():
            if network.TAP_NAME.match(name):
                owner = network.tap_owner(name) or ""
                if owner.startswith(f"auraed-vm {self.root}/"):
                    mine.add(name)
        return mine

    async def cleanup(self) -> None:
        for made in self.made:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await made.close()
        common.kill_processes_referencing(self.root)
        for tap in self.taps():
            with contextlib.suppress(Exception):
                network.delete_tap(tap)
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="aurae-vme-", dir="/tmp"))  # short: unix socket paths
    try:
        made = Env(root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield made
    finally:
        await made.cleanup()


async def cancel_when(task: asyncio.Task[object], ready: Callable[[], bool], delay: float) -> None:
    """Cancel ``task`` ``delay`` seconds after ``ready()`` first holds; wait for it to end."""
    while True:
        if ready() or task.done():
            break
        await asyncio.sleep(0)
    if delay:
        await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, VmError):
        await task


def _has_record(vms: Vms, name: str) -> bool:
    """The VM's record is written (so its tap is being made)."""
    return name in vms._records


async def test_a_cancelled_allocate_leaves_no_tap_and_no_record(env: Env) -> None:
    vms = env.vms()
    for attempt, delay in enumerate(CANCEL_DELAYS):
        name = f"cut{attempt}"
        task = asyncio.create_task(vms.allocate(env.spec(name)))
        await cancel_when(task, functools.partial(_has_record, vms, name), delay)
        await asyncio.sleep(SETTLE)
        if task.cancelled():
            assert env.taps() == set(), f"cancelled {delay} s into Allocate"
            assert env.store.get(KIND, name) is None
            with pytest.raises(VmError):
                vms.get(name)
            assert not (env.root / "run" / "vms" / name).exists()
        else:  # done before the cancellation: a whole VM, freed again
            await vms.free(name)
    # The pool is whole again: a VM allocated now gets its first block.
    record = await vms.allocate(env.spec("after"))
    assert record.net is not None and record.net.index == 0
    await vms.free("after")
    assert env.taps() == set()


async def test_a_cancelled_start_leaves_no_vmm_running(env: Env) -> None:
    vms = env.vms()
    record = await vms.allocate(env.spec("boot", network=False))
    run_dir = Path(record.run_dir)
    # Cancelled while it waits for the console: the VM it booted is stopped, not left running.
    task = asyncio.create_task(vms.start("boot", wait_for_console="NEVER-PRINTED", timeout=120))
    await cancel_when(task, lambda: vms.get("boot").state == State.RUNNING, 0.2)
    assert task.cancelled()
    assert common.processes_referencing(run_dir) == []
    assert vms.get("boot").state == State.STOPPED and "cancelled" in vms.get("boot").reason
    # Cancelled while the VMM is being launched, at various points. An operator's reader of the
    # console log (it names the run directory too) is no VMM: it is left alone.
    reader = subprocess.Popen(
        ["tail", "-F", str(run_dir / "console.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for delay in CANCEL_DELAYS:
            task = asyncio.create_task(vms.start("boot"))
            await cancel_when(task, lambda: vms.get("boot").state == State.STARTING, delay)
            if not task.cancelled():
                await vms.stop("boot", 0.0)
                continue
            await asyncio.sleep(SETTLE)
            assert common.processes_referencing(run_dir) == [reader.pid], f"cancelled {delay} s into Start"
            assert vms.get("boot").state == State.STOPPED
        assert reader.poll() is None, "the console's reader was killed"
    finally:
        reader.kill()
        reader.wait()
    # And the VM still starts afterwards.
    await vms.start("boot")
    assert vms.get("boot").state == State.RUNNING
    await vms.free("boot")
    assert common.processes_referencing(run_dir) == []


async def test_a_start_cancelled_while_its_guest_is_awaited_stops_the_vm(env: Env, pki: PkiPaths) -> None:
    # The guest never serves (its kernel halts): the host waits for its health until cancelled.
    vms = env.vms()
    guests = Guests(vms, GuestTrust(pki.ca_crt, pki.ca_key, env.root / "pki"), env.root, GUEST_READY_TIMEOUT)
    record = await vms.allocate(guests.with_config_disk(env.spec("guest", role="guest")))

    task = asyncio.create_task(guests.boot("guest"))  # as VmService.Start does
    await cancel_when(task, lambda: vms.get("guest").state == State.RUNNING, GUEST_WAITED)
    assert task.cancelled()
    assert common.processes_referencing(Path(record.run_dir)) == []
    assert vms.get("guest").state == State.STOPPED and "cancelled" in vms.get("guest").reason
    await guests.free("guest", 0.0)
    await guests.trust.close()
    assert env.taps() == set()


async def test_a_changed_pool_never_hands_out_a_held_block_again(env: Env) -> None:
    vms = env.vms()
    await vms.allocate(env.spec("a"))
    b = await vms.allocate(env.spec("b"))
    assert b.net is not None and b.net.index == 1
    await vms.free("a")
    # The host reboots (taps are gone, records stay) and the pool is changed to b's /30 alone.
    network.delete_tap(b.net.tap, tap_owner(b))
    await vms.close()
    held = ipaddress.IPv4Network(f"{b.net.host_ip}/30", strict=False)
    changed = env.vms(pool=held)
    await changed.recover()
    with pytest.raises(VmError) as caught:
        await changed.allocate(env.spec("c"))
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert env.store.get(KIND, "c") is None
    # b still starts with its own address, which nobody else got.
    await changed.start("b")
    assert network.tap_addresses(b.net.tap) == [f"{b.net.host_ip}/30"]
    await changed.free("b")
    assert env.taps() == set()


def _tap_settings(tap: str) -> dict[str, str]:
    return {
        key: (Path("/proc/sys/net") / key.split(".")[0] / "conf" / tap / key.split(".")[1])
        .read_text()
        .strip()
        for key in HARDENED
    }


async def test_a_tap_left_by_an_older_auraed_is_hardened_before_its_vm_starts(env: Env) -> None:
    vms = env.vms()
    record = await vms.allocate(env.spec("old"))
    assert record.net is not None
    tap = record.net.tap
    assert _tap_settings(tap) == HARDENED
    # The kernel's defaults, as taps made before hardening have them (no guest is attached yet).
    defaults = {"ipv6.accept_ra": "1", "ipv6.disable_ipv6": "0", "ipv4.rp_filter": "0"}
    for key, value in defaults.items():
        family, setting = key.split(".")
        (Path("/proc/sys/net") / family / "conf" / tap / setting).write_text(value)
    await vms.start("old")
    assert _tap_settings(tap) == HARDENED
    await vms.free("old")
    assert env.taps() == set()


# -- the console log ----------------------------------------------------------------------------

ENDLESS_LINE = 5 * 1024 * 1024  # one line, as a guest printing without newlines makes it
TRIM_LIMIT = 1024 * 1024
WRITTEN = 8 * 1024 * 1024


def _no_guests(vms: Vms) -> Guests:
    """These VMs run no guest auraed: the guest hooks stay idle."""
    nowhere = Path("/nonexistent")
    return Guests(vms, GuestTrust(nowhere / "ca.crt", nowhere / "ca.key", nowhere), nowhere, 1.0)


async def test_a_guest_s_endless_console_line_does_not_break_list(env: Env) -> None:
    vms = env.vms()
    record = await vms.allocate(env.spec("loud", network=False))
    await vms.start("loud")
    with record.console_path.open("ab") as log:  # as if the guest had printed it
        log.write(b"booting\n" + b"y" * ENDLESS_LINE + b"\nlast words\n")
    handle = vms.handle("loud")
    assert handle is not None
    os.kill(handle.pid, signal.SIGKILL)
    await eventually(lambda: vms.get("loud").state == State.CRASHED)
    assert vms.get("loud").console_tail[-1] == "last words"
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([generic_handler(SERVICE_NAME, VmServicer(vms, _no_guests(vms)))])
    address = f"unix:{env.root}/vms.sock"
    server.add_insecure_port(address)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            listing = channel.unary_unary(
                f"/{SERVICE_NAME}/List",
                request_serializer=bytes,
                response_deserializer=pb.VmServiceListResponse().parse,
            )
            reply = await listing(pb.VmServiceListRequest(), timeout=30)
    finally:
        await server.stop(0)
    (status,) = reply.vms
    assert status.console_tail[-1] == "last words" and status.state == pb.VmState.CRASHED
    assert all(len(line) <= TAIL_LINE_MAX for line in status.console_tail)
    await vms.free("loud")


async def test_a_running_vm_s_console_log_is_kept_small(env: Env) -> None:
    vms = env.vms()
    vms.console_log_limit = TRIM_LIMIT
    record = await vms.allocate(env.spec("chatty", network=False))
    await vms.start("chatty")
    log = record.console_path
    line = b"a guest talking a lot\n"
    talk = line * (WRITTEN // len(line)) + b"the end\n"
    with log.open("ab") as f:
        f.write(talk)
    block = log.stat().st_blksize

    def trimmed() -> bool:
        return log.stat().st_blocks * 512 <= TRIM_LIMIT + 2 * block

    await eventually(trimmed, timeout=30)
    assert log.stat().st_size == len(talk)  # trimmed in place: the VMM's file offset stays valid
    assert vms.console_tail("chatty")[-1] == "the end"
    lines = [text async for text in vms.console("chatty", tail=None, follow=False)]
    assert lines[-1] == "the end" and "\0" not in "".join(lines)
    assert len(lines) < 2 * TRIM_LIMIT // len(line)
    await vms.free("chatty")


async def eventually(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_a_guest_s_disk_may_not_take_the_config_disk_s_serial(env: Env) -> None:
    """The guest finds its config disk by serial: a disk of the VM's own may not claim it."""
    guests = _no_guests(env.vms())
    disk = env.root / "data.img"
    disk.write_bytes(bytes(DATA_DISK_BYTES))

    def guest_with(serial: str) -> VmSpec:
        extra = [pb.Disk(path=str(disk), serial=serial)]
        message = pb.VirtualMachine(
            name="g", kernel=str(env.kernel), memory_mib=MEMORY_MIB, role="guest", extra_disks=extra
        )
        return parse_vm(message)

    with pytest.raises(AuraeError) as refused:
        guests.with_config_disk(guest_with("config"))
    assert refused.value.kind == ErrorKind.INVALID_ARGUMENT and "'config'" in refused.value.message
    # Any other serial: the config disk comes after the VM's own disks.
    serials = [d.serial for d in guests.with_config_disk(guest_with("data")).extra_disks]
    assert serials == ["data", "config"]


async def test_a_guest_left_without_files_gets_the_guest_image_s(env: Env) -> None:
    """Allocate completes a guest's spec: the guest image's files for those it names none of, a
    network, transparent huge pages on madvise; a guest image lacking a file is refused."""
    image = env.root / "guest-image"
    image.mkdir()
    for filename in ("vmlinuz", "initramfs.img", "rootfs.img"):
        shutil.copy(env.kernel, image / filename)  # any readable file stands for one here
    nowhere = Path("/nonexistent")
    guests = Guests(env.vms(), GuestTrust(nowhere / "ca.crt", nowhere / "ca.key", nowhere), image, 1.0)

    def guest(**fields: Any) -> VmSpec:
        return parse_vm(pb.VirtualMachine(name="g", memory_mib=MEMORY_MIB, role="guest", **fields))

    spec = guests.complete(guest())
    assert (spec.kernel, spec.initramfs, spec.root_disk) == tuple(
        str(image / f) for f in ("vmlinuz", "initramfs.img", "rootfs.img")
    )
    assert spec.network and spec.kernel_args == ("transparent_hugepage=madvise",)
    # What the guest names itself stays.
    own = guests.complete(guest(kernel=str(env.kernel), kernel_args=["transparent_hugepage=never"]))
    assert own.kernel == str(env.kernel) and own.kernel_args == ("transparent_hugepage=never",)
    # Not a guest: nothing is filled in, and a kernel is required.
    assert guests.complete(env.spec("plain", network=False)).initramfs == ""
    with pytest.raises(AuraeError) as refused:
        parse_vm(pb.VirtualMachine(name="plain", memory_mib=MEMORY_MIB))
    assert refused.value.kind == ErrorKind.INVALID_ARGUMENT and "vm.kernel" in refused.value.message
    (image / "rootfs.img").unlink()
    with pytest.raises(AuraeError) as refused:
        guests.complete(guest())
    assert refused.value.kind == ErrorKind.FAILED_PRECONDITION and "rootfs.img" in refused.value.message
