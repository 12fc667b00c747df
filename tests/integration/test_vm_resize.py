"""Growing a running guest, for real: QEMU's q35 under TCG, the guest image's auraed, real taps.

One q35 guest boots with 1 vCPU and 512 MiB; it grows to 2 vCPUs and 768 MiB (a vCPU and a DIMM
hotplugged through QMP, onlined by the guest's auraed), then, after a host restart (a new Vms
and Guests over the same store, the VMM reattached), to 3 vCPUs and 1024 MiB through the
VmService: the new devices' ids are QEMU's free ones, not the first run's again. A cell in the
guest sees the CPUs (nproc) and its MemTotal grows. Shrinking, growing beyond the room the VM
started with, a VM not running and a microvm VM are refused. Boot and resize times are printed
(pytest -s).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from auraed.api.aurae.vms import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.vms.guests import Guests, GuestTrust
from auraed.vms.model import State, VmRecord, parse_vm
from auraed.vms.qemu import QemuBackend
from auraed.vms.servicer import VmServicer
from auraed.vms.vms import KIND, Vms
from tests.integration.test_vm_templates import run_in_guest
from tests.integration.test_vms import BOOT_TIMEOUT, PANIC_MARKER, VmEnv, start_lingering

pytestmark = pytest.mark.slow

READY_TIMEOUT = 300.0  # a q35 guest's boot under TCG on a loaded 2-core machine
MAX_VCPUS = 3
MAX_MEMORY_MIB = 2048


@pytest.fixture
async def env(guest_image: Path) -> AsyncIterator[VmEnv]:
    root = Path(tempfile.mkdtemp(prefix="aurae-rsz-", dir="/tmp"))  # unix socket paths are short
    made = VmEnv(root, guest_image)
    try:
        yield made
    finally:
        await made.cleanup()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("rsz-pki"))


def q35_vms(env: VmEnv) -> Vms:
    backend = QemuBackend(
        machine="q35",
        kvm_usable=lambda: env.kvm_usable,
        max_vcpus=MAX_VCPUS,
        max_memory_mib=MAX_MEMORY_MIB,
        memory_slots=4,
    )
    vms = Vms(
        env.store, {"qemu": backend}, runtime_dir=env.root / "run", pool=env.pool, default_stop_timeout=2.0
    )
    env.made.append(vms)
    return vms


def q35_guests(env: VmEnv, pki: PkiPaths) -> tuple[Vms, Guests]:
    vms = q35_vms(env)
    return vms, Guests(vms, GuestTrust(pki.ca_crt, pki.ca_key, env.root / "pki"), env.guest, READY_TIMEOUT)


def size_of(reply: pb.VmServiceResizeResponse) -> tuple[int, int]:
    assert reply.status is not None and reply.status.vm is not None
    return reply.status.vm.vcpus, reply.status.vm.memory_mib


def refused(kind: ErrorKind) -> pytest.RaisesExc[AuraeError]:
    return pytest.raises(AuraeError, check=lambda e: e.kind is kind)


async def guest_view(guests: Guests, name: str) -> tuple[int, int]:
    """(nproc in a cell of the guest, the guest's MemTotal in KiB)."""
    (nproc,) = await run_in_guest(guests, name, "nproc")
    meminfo = await guests.online_cpu_mem(name)
    return int(nproc), meminfo.mem_total_kib


async def qemu_ids(vms: Vms, name: str) -> tuple[list[str], list[str]]:
    """The ids of the hotplugged vCPU and memory devices, as QEMU reports them."""
    backend = vms.backends["qemu"]
    assert isinstance(backend, QemuBackend)
    handle = vms.handle(name)
    assert handle is not None
    cpus = await backend.query(handle, "query-hotpluggable-cpus")
    dimms = await backend.query(handle, "query-memory-devices")
    assert isinstance(cpus, list) and isinstance(dimms, list)
    plugged = sorted(c["qom-path"].rsplit("/", 1)[1] for c in cpus if "peripheral" in c.get("qom-path", ""))
    return plugged, sorted(d["data"]["id"] for d in dimms)


async def check_refusals(guests: Guests) -> None:
    """g1 (1 vCPU, 512 MiB) never shrinks; as much as it has is nothing to do; beyond the room it
    started with is refused, naming the setting."""
    with refused(ErrorKind.INVALID_ARGUMENT) as error:
        await guests.resize("g1", 0, 512)
    assert "vcpus" in error.value.message
    with refused(ErrorKind.INVALID_ARGUMENT) as error:
        await guests.resize("g1", 1, 256)
    assert "memory_mib" in error.value.message
    assert (await guests.resize("g1", 1, 512)).spec.vcpus == 1
    with refused(ErrorKind.FAILED_PRECONDITION) as error:
        await guests.resize("g1", MAX_VCPUS + 1, 512)
    assert "vm_max_vcpus" in error.value.message
    with refused(ErrorKind.FAILED_PRECONDITION) as error:
        await guests.resize("g1", 1, MAX_MEMORY_MIB + 1)
    assert "vm_max_memory_mib" in error.value.message


async def test_a_q35_guest_grows_twice_across_a_host_restart_and_never_shrinks(
    env: VmEnv, pki: PkiPaths
) -> None:
    vms, guests = q35_guests(env, pki)
    await guests.allocate(parse_vm(pb.VirtualMachine(name="g1", role="guest", vcpus=1, memory_mib=512)))
    started = time.monotonic()
    booted = await guests.boot("g1", timeout=BOOT_TIMEOUT)
    print(f"\nq35 guest (TCG): serving {time.monotonic() - started:.1f} s after Start")
    assert booted.record.run is not None
    assert (booted.record.run.machine, booted.record.run.max_vcpus) == ("q35", MAX_VCPUS)
    assert booted.record.run.max_memory_mib == MAX_MEMORY_MIB
    nproc, mem_total = await guest_view(guests, "g1")
    assert nproc == 1
    # The room costs the guest no RAM: no 64 MiB of bounce buffers for the hotplug range above
    # 4 GiB (swiotlb=noforce; with them MemTotal was 404 MiB, without room 469 MiB).
    assert mem_total > 460 * 1024, mem_total

    await check_refusals(guests)

    started = time.monotonic()
    record, resized = await guests.resize_reporting("g1", 2, 768)
    print(f"resize 1 -> 2 vCPUs, 512 -> 768 MiB: {time.monotonic() - started:.2f} s (guest: {resized})")
    assert (record.spec.vcpus, record.spec.memory_mib) == (2, 768)
    assert (record.plugged_vcpus, record.plugged_memory_mib) == (1, 256)
    assert resized.online_cpus == 2 and resized.mem_total_kib - mem_total == 256 * 1024
    nproc, grown = await guest_view(guests, "g1")
    assert nproc == 2 and grown - mem_total == 256 * 1024
    assert await qemu_ids(vms, "g1") == (["vcpu-core1-node0-socket0-thread0"], ["dimm0"])
    saved = {name: VmRecord.from_doc(doc) for name, doc in env.store.list(KIND)}["g1"]
    assert (saved.spec.vcpus, saved.spec.memory_mib, saved.plugged_vcpus) == (2, 768, 1)

    # A host restart: the VMM is reattached, and grows again through the VmService.
    await vms.close()
    await guests.trust.close()
    vms, guests = q35_guests(env, pki)
    await vms.recover()
    assert vms.get("g1").state == State.RUNNING and vms.handle("g1") is not None
    servicer = VmServicer(vms, guests)
    started = time.monotonic()
    reply = await servicer.resize(pb.VmServiceResizeRequest(name="g1", vcpus=3, memory_mib=1000), None)
    print(f"resize 2 -> 3 vCPUs, 768 -> 1024 MiB after a restart: {time.monotonic() - started:.2f} s")
    # Memory in whole 128 MiB blocks: 1000 MiB asked, 1024 MiB plugged.
    assert size_of(reply) == (3, 1024)
    assert reply.guest_online_cpus == 3 and reply.guest_mem_total_kib - mem_total == 512 * 1024
    assert reply.resize_ms > 0
    assert await qemu_ids(vms, "g1") == (
        ["vcpu-core1-node0-socket0-thread0", "vcpu-core2-node0-socket0-thread0"],
        ["dimm0", "dimm1"],
    )
    assert (vms.get("g1").plugged_vcpus, vms.get("g1").plugged_memory_mib) == (2, 512)
    nproc, grown = await guest_view(guests, "g1")
    assert nproc == 3 and grown - mem_total == 512 * 1024
    # Through the servicer too: 0 keeps a value; fewer is refused.
    reply = await servicer.resize(pb.VmServiceResizeRequest(name="g1"), None)
    assert size_of(reply) == (3, 1024)
    with refused(ErrorKind.INVALID_ARGUMENT):
        await servicer.resize(pb.VmServiceResizeRequest(name="g1", vcpus=2), None)

    # Stopped, it cannot grow; started again, it boots at its new size.
    await vms.stop("g1", 0.0)
    with refused(ErrorKind.FAILED_PRECONDITION) as error:
        await guests.resize("g1", 3, 2048)
    assert "only a running VM grows" in error.value.message
    assert (vms.get("g1").spec.vcpus, vms.get("g1").spec.memory_mib) == (3, 1024)
    await guests.free("g1", 0.0)
    await guests.trust.close()


async def test_a_microvm_vm_cannot_grow(env: VmEnv) -> None:
    vms = env.vms()
    await start_lingering(vms, env, "m1")
    with refused(ErrorKind.FAILED_PRECONDITION) as error:
        await vms.grow("m1", 2, 256)
    assert "microvm" in error.value.message and 'vm_machine = "q35"' in error.value.message
    assert vms.get("m1").spec.vcpus == 1
    await vms.free("m1", 0.0)
    assert not list(env.store.list(KIND))


async def test_memory_plugged_into_a_vm_with_a_share_is_shared_too(env: VmEnv) -> None:
    """virtiofsd maps the guest's RAM: a DIMM of a VM with a shared directory is a shared memfd
    (the VM's own RAM is one), that of a VM without a plain RAM object."""
    share = env.root / "share"
    share.mkdir()
    vms = q35_vms(env)
    for name, shared_dir in (("s1", str(share)), ("p1", "")):
        spec = dataclasses.replace(env.spec(name, guest="kernel-only"), shared_dir=shared_dir)
        await vms.allocate(spec)
        await vms.start(name, wait_for_console=PANIC_MARKER, timeout=BOOT_TIMEOUT)
        # The kernel has panicked: the DIMM is plugged (QEMU's part), never onlined.
        record = await vms.grow(name, 1, 384)
        assert record.spec.memory_mib == 384 and record.plugged_memory_mib == 128
        backend = vms.backends["qemu"]
        handle = vms.handle(name)
        assert isinstance(backend, QemuBackend) and handle is not None
        client = handle.client
        kind = await client.execute("qom-get", {"path": "/objects/mem-dimm0", "property": "type"})
        if shared_dir:
            assert kind == "memory-backend-memfd"
            assert (
                await client.execute("qom-get", {"path": "/objects/mem-dimm0", "property": "share"}) is True
            )
        else:
            assert kind == "memory-backend-ram"
        await vms.free(name, 0.0)
