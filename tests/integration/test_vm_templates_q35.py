"""Templates and clones on QEMU's q35 machine (test_vm_templates.py has microvm's), for real:
QEMU under TCG, the guest image's auraed, real taps. One template is made for the module (its
clones reuse it); each test starts its clones from it and frees them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from auraed.bootargs import SHARE_MOUNT
from auraed.errors import AuraeError, ErrorKind
from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.vms import backend as common
from auraed.vms.backend import Room
from auraed.vms.guests import Guests
from auraed.vms.qemu import CLONE_MEMORY_FILE, HOTPLUG_PORT, SHARE_DEVICE
from auraed.vms.templates import TemplateRecord, TemplateState
from auraed.vms.vms import Vms
from tests.integration.test_vm_templates import clone_spec, guests_over, peer_certificate, run_in_guest
from tests.integration.test_vms import VmEnv

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TEMPLATE = "q35"
MAX_VCPUS = 3  # more than this 2-core host's: TCG runs them all the same
MAX_MEMORY_MIB = 2048
SLOTS = 4


class Q35:
    def __init__(self, env: VmEnv, vms: Vms, guests: Guests, template: TemplateRecord) -> None:
        self.env, self.vms, self.guests, self.template = env, vms, guests, template


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("q35-pki"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def q35(guest_image: Path, pki: PkiPaths) -> AsyncIterator[Q35]:
    root = Path(tempfile.mkdtemp(prefix="aurae-q35-", dir="/tmp"))  # unix socket paths are short
    env = VmEnv(root, guest_image, machine="q35", room=Room(MAX_VCPUS, MAX_MEMORY_MIB, SLOTS))
    try:
        vms, guests = guests_over(env, pki, guest_image)
        template = await guests.create_template(TEMPLATE, vcpus=1, memory_mib=384)
        yield Q35(env, vms, guests, template)
        await guests.remove_template(TEMPLATE)
        await guests.trust.close()
    finally:
        await env.cleanup()


async def test_a_q35_template_s_clone_serves_with_its_own_identity(q35: Q35, pki: PkiPaths) -> None:
    template = q35.template
    assert (template.state, template.machine) == (TemplateState.READY, "q35")
    guests, vms = q35.guests, q35.vms
    await guests.allocate(clone_spec("q1", TEMPLATE))
    booted = await guests.boot("q1")
    assert booted.record.template == TEMPLATE and booted.record.run is not None
    assert booted.record.run.machine == "q35"
    assert booted.record.restore_ms is not None and booted.record.restore_ms < 1000, booted.record.restore_ms
    # The template's free root port, where a clone's virtio-fs is plugged (none is yet).
    handle = vms.handle("q1")
    assert handle is not None
    buses = await vms.backends["qemu"].query(handle, "query-pci")  # type: ignore[attr-defined]
    ports = [d for bus in buses for d in bus["devices"] if d.get("qdev_id") == HOTPLUG_PORT]
    assert len(ports) == 1 and ports[0]["pci_bridge"]["devices"] == [], ports
    address = vms.address(vms.get("q1"))
    cert = await asyncio.to_thread(peer_certificate, q35.env, pki, address, "q1")
    assert cert.subject.rfc4514_string()
    (hostname,) = await run_in_guest(guests, "q1", "hostname")
    assert hostname == "q1"
    # Of the template's size, it was not grown as it was restored.
    assert (booted.record.plugged_vcpus, booted.record.plugged_memory_mib) == (0, 0)
    await guests.free("q1", 0.0)
    assert guests.template_users(TEMPLATE) == []


async def test_a_q35_clone_bigger_than_its_template_is_grown_as_it_is_restored_and_grows_again(
    q35: Q35, caplog: pytest.LogCaptureFixture
) -> None:
    """The template (1 vCPU, 384 MiB) has the node's room: a VM of 2 vCPUs and 600 MiB is its
    clone, grown by hotplug as it is restored (memory in whole blocks: 640 MiB), its guest serving
    with both CPUs online and the memory in its MemTotal; then Resize grows it as it grows a cold
    guest. Smaller than the template, or beyond its room, is refused at Allocate."""
    caplog.set_level(logging.INFO, logger="auraed.vms")
    guests, template = q35.guests, q35.template
    assert template.room == Room(MAX_VCPUS, MAX_MEMORY_MIB, SLOTS)
    for vcpus, memory_mib, said in ((1, 256, "never shrunk"), (MAX_VCPUS + 1, 384, "vm_max_vcpus")):
        with pytest.raises(AuraeError) as refused:
            await guests.allocate(
                dataclasses.replace(clone_spec("q3", TEMPLATE), vcpus=vcpus, memory_mib=memory_mib)
            )
        assert refused.value.kind is ErrorKind.FAILED_PRECONDITION and said in refused.value.message, (
            refused.value
        )
    await guests.allocate(dataclasses.replace(clone_spec("q3", TEMPLATE), vcpus=2, memory_mib=600))
    booted = await guests.boot("q3")
    record = booted.record
    assert record.template == TEMPLATE and record.restore_ms is not None
    assert (record.spec.vcpus, record.spec.memory_mib) == (2, 640)
    assert (record.plugged_vcpus, record.plugged_memory_mib) == (1, 256)
    await tmpfs_take_half(guests, "q3")  # first: before anything asks the guest to online more
    (nproc,) = await run_in_guest(guests, "q3", "nproc")
    meminfo = await guests.online_cpu_mem("q3")
    assert int(nproc) == 2 and meminfo.online_cpus == 2
    base = template.mem_total_kib  # the template's guest's, as it said when it was ready
    assert base > 300 * 1024 and meminfo.mem_total_kib - base == 256 * 1024, (meminfo.mem_total_kib, base)
    said = "grown from 1 vCPU and 384 MiB to 2 vCPUs and 640 MiB (the guest has 2 CPUs online"
    assert said in caplog.text, caplog.text[-3000:]

    # And again, as a cold guest grows: a vCPU and a DIMM more, onlined through OnlineCpuMem.
    record, resized = await guests.resize_reporting("q3", 3, 896)
    assert (record.spec.vcpus, record.spec.memory_mib) == (3, 896)
    assert (record.plugged_vcpus, record.plugged_memory_mib) == (2, 512)
    assert resized.online_cpus == 3 and resized.mem_total_kib - base == 512 * 1024
    (nproc,) = await run_in_guest(guests, "q3", "nproc")
    assert int(nproc) == 3
    await tmpfs_take_half(guests, "q3")
    await guests.free("q3", 0.0)


async def tmpfs_take_half(guests: Guests, name: str) -> None:
    """The guest's tmpfs mounts (/run holds its containers' layers) are half its memory now, as a
    cold guest of its size has them, not half its template's."""
    lines = await run_in_guest(guests, name, "grep MemTotal /proc/meminfo; df -k /run /tmp /dev/shm")
    mem_total_kib = int(lines[0].split()[1])
    sizes = [int(line.split()[1]) for line in lines[2:]]
    assert len(sizes) == 3 and all(abs(size - mem_total_kib // 2) <= 8 for size in sizes), (
        lines,
        mem_total_kib,
    )


async def test_a_q35_clone_with_a_shared_directory_gets_a_copy_of_the_ram_and_virtio_fs_plugged(
    q35: Q35,
) -> None:
    guests, vms = q35.guests, q35.vms
    share = q35.env.root / "share-q2"
    share.mkdir()
    (share / "hello").write_text("from the host\n")
    await guests.allocate(dataclasses.replace(clone_spec("q2", TEMPLATE), shared_dir=str(share)))
    booted = await guests.boot("q2")
    # A clone, not a cold boot: its RAM a copy of the template's (data only, then unlinked: QEMU
    # and virtiofsd map it), virtio-fs plugged into the root port as it resumed.
    assert booted.record.template == TEMPLATE and booted.record.restore_ms is not None
    handle = vms.handle("q2")
    assert handle is not None and handle.share_plug is not None
    took, copied, plugged = handle.share_plug
    assert 0 < copied <= q35.template.memory_resident_bytes() and took < 5 and plugged < 5, handle.share_plug
    run_dir = Path(vms.get("q2").run_dir)
    assert not (run_dir / CLONE_MEMORY_FILE).exists()
    buses = await vms.backends["qemu"].query(handle, "query-pci")  # type: ignore[attr-defined]
    (port,) = [d for bus in buses for d in bus["devices"] if d.get("qdev_id") == HOTPLUG_PORT]
    assert [d["qdev_id"] for d in port["pci_bridge"]["devices"]] == [SHARE_DEVICE]
    # Mounted by the clone with its identity, where a cold guest mounts its share: read, written.
    lines = await run_in_guest(guests, "q2", f"cat {SHARE_MOUNT}/hello; echo back > {SHARE_MOUNT}/back")
    assert lines == ["from the host"]
    assert (share / "back").read_text() == "back\n"
    await guests.free("q2", 0.0)
    assert not run_dir.exists()
    assert not common.kill_processes_referencing(q35.env.root / "run" / "vms")  # no QEMU, no virtiofsd
