"""orka workloads each in a guest VM of their own (orka_workload_isolation = vm), with real QEMU
guests (TCG here: each boot costs ~20 s, so one daemon boots two guests side by side): sizing from
the limits, the image placed in the guest, the container's status and usage from the guest,
Signal STOP and KILL, a restart in between, and a guest that never serves, which leaves nothing."""

from __future__ import annotations

import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from auraed.api import node_agent as na
from auraed.api.aurae.vms import v0 as vms
from auraed.client import AuraeClient
from auraed.orka.model import container_name
from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.vms.guests import GUEST_BASE_MIB
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.containers_helpers import exec_in, logs, status
from tests.integration.test_orka_agent import agent_args
from tests.integration.test_orka_workloads import (
    GRACE,
    KILL,
    RUNNING,
    STOP,
    STUBBORN,
    STUBBORN_CONFIG,
    TERMINATED,
    WAITING,
    WORKER,
    WORKER_CONFIG,
    refusal,
    state,
    statuses_until,
    usage,
    workload,
)
from tests.integration.test_vms import NO_POD_TEMPLATE, guest_host_args
from tests.support.cri import mirrors_config, publish
from tests.support.images import build_busybox_layout
from tests.support.orka import SchedulerProcess, WorkloadClient
from tests.support.registry import LocalRegistry, free_port

VMS = "aurae.vms.v0.VmService"
BOOT_TIMEOUT = 240.0  # seconds for a Create's stream to reach RUNNING: a boot under TCG, loaded


@pytest.fixture(scope="module")
def vm_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    root = tmp_path_factory.mktemp("orka-vm-images")
    with LocalRegistry() as found:
        for name, config in ((WORKER, WORKER_CONFIG), (STUBBORN, STUBBORN_CONFIG)):
            publish(
                build_busybox_layout(root / name.rsplit("/", 1)[1].replace(":", "-"), config), found, name
            )
        yield found


def vm_node_args(guest_image: Path, pki: PkiPaths, scheduler: SchedulerProcess, port: int) -> list[str]:
    return [
        *agent_args(scheduler, port=port),
        "--orka-workload-isolation", "vm",
        "--orka-workload-status-interval", "0.5",
        *guest_host_args(guest_image, pki.ca_key),
        *NO_POD_TEMPLATE,
    ]  # fmt: skip


@pytest.fixture
async def scheduler_client(
    pki: PkiPaths, tmp_path: Path
) -> AsyncIterator[tuple[SchedulerProcess, int, WorkloadClient]]:
    """Our scheduler, running, a port for the node's WorkloadService and a client of it."""
    scheduler_pki = ensure_dev_pki(pki.ca_crt.parent, client_names=(*pki.clients, "orka-scheduler"))
    scheduler = SchedulerProcess(free_port(), tmp_path / "scheduler-events.jsonl")
    scheduler.start()
    port = free_port()
    crt, key = scheduler_pki.clients["orka-scheduler"]
    client = WorkloadClient.connect(f"127.0.0.1:{port}", scheduler_pki.ca_crt, crt, key)
    try:
        yield scheduler, port, client
    finally:
        await client.close()
        scheduler.stop()


async def guests_of(daemon: DaemonProcess) -> dict[str, tuple[int, int, str, str]]:
    """The daemon's VMs: (vCPUs, MiB, role, tap) by name."""
    async with daemon.client() as aurae:
        listing = (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms
    return {s.vm.name: (s.vm.vcpus, s.vm.memory_mib, s.vm.role, s.tap) for s in listing if s.vm is not None}


def taps_of(daemon: DaemonProcess) -> list[str]:
    """The taps the daemon made (their alias names its run dir: tests/conftest.py)."""
    lines = subprocess.run(["ip", "-o", "-d", "link"], capture_output=True, text=True, check=True).stdout
    return [line.split(": ")[1] for line in lines.splitlines() if f"alias auraed-vm {daemon.root}" in line]


async def free_every_vm(daemon: DaemonProcess) -> None:
    """What a failed test left (the daemon's leftovers are removed after it anyway)."""
    async with daemon.client() as aurae:
        for name in await guests_of(daemon):
            await aurae.call(VMS, "Free", vms.VmServiceFreeRequest(name=name, timeout_ms=0))


def check_stages_and_usage(seen: list[na.WorkloadStatus], vm: str) -> None:
    stages = [state(s)[1] for s in seen if state(s)[0] == WAITING]
    assert stages[0] == f"pulling {WORKER}"
    assert f"booting its guest VM {vm} (1 vCPU, {GUEST_BASE_MIB + 96} MiB)" in stages, stages
    # Usage from the guest's stats: the worker spins, held to its 900 millicores by the guest's
    # CFS quota (whose 100 ms periods do not line up with the intervals, hence the margin).
    running = [s for s in seen if state(s)[0] == RUNNING]
    cpus = [usage(s).cpu for s in running]
    assert all(500 <= cpu <= 1000 for cpu in cpus[1:]), cpus
    assert all(0 < usage(s).memory < 96 for s in running), [usage(s) for s in running]


async def check_in_guest(daemon: DaemonProcess, vm: str, instance_id: str) -> None:
    """The container as the guest has it, reached through the host's relay."""
    async with daemon.client() as aurae:
        in_guest = AuraeClient(aurae.channel, vm=vm)
        container = await status(in_guest, container_name(instance_id))
        assert dict(container.labels) == {"orka.instance-id": instance_id} and container.image == WORKER
        assert await logs(in_guest, container.name) == ["worker hi"]
        # Its limits hold in the guest's kernel (cgroup v2, its own cgroup namespace).
        out, _, code = await exec_in(in_guest, container.name, ["cat", "/sys/fs/cgroup/cpu.max"])
        assert (code, out) == (0, b"90000 100000\n")
        out, _, _ = await exec_in(in_guest, container.name, ["cat", "/sys/fs/cgroup/memory.max"])
        assert int(out) == 96 << 20


async def test_workloads_run_in_guest_vms_sized_from_their_limits_and_signals_free_them(
    daemon_factory: DaemonFactory,
    guest_image: Path,
    pki: PkiPaths,
    vm_registry: LocalRegistry,
    scheduler_client: tuple[SchedulerProcess, int, WorkloadClient],
) -> None:
    scheduler, port, client = scheduler_client
    daemon = daemon_factory(
        *vm_node_args(guest_image, pki, scheduler, port),
        config_text=mirrors_config(vm_registry, ("docker.io",)),
    )
    try:
        began = time.monotonic()
        limits = na.WorkloadResources(cpu=900, memory=96)
        web = client.create(
            workload("web", WORKER, environment=["GREETING=hi"], resource_limits=limits), timeout=600
        )
        calm = client.create(
            workload("calm", STUBBORN, resource_limits=na.WorkloadResources(memory=64)), timeout=600
        )
        # Each stream's call begins at its first message: both are asked for, then the guests
        # boot side by side.
        first = await anext(web)
        assert state(await anext(calm))[0] == WAITING
        seen = [first, *await statuses_until(web, RUNNING, count=4)]
        await statuses_until(calm, RUNNING)
        booted = time.monotonic() - began
        assert booted < BOOT_TIMEOUT, booted
        web_vm, calm_vm = container_name("web"), container_name("calm")
        check_stages_and_usage(seen, web_vm)
        guests = await guests_of(daemon)
        assert guests == {
            web_vm: (1, GUEST_BASE_MIB + 96, "guest", guests[web_vm][3]),
            calm_vm: (1, GUEST_BASE_MIB + 64, "guest", guests[calm_vm][3]),
        }
        await check_in_guest(daemon, web_vm, "web")

        error = await refusal(client.create(workload("web", WORKER)))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS

        # STOP: the image's StopSignal in the guest (it exits 7), then its VM is stopped and freed.
        stopping = time.monotonic()
        await client.signal("web", STOP)
        stopped = time.monotonic() - stopping
        assert stopped < GRACE + 5, stopped
        rest = [reply async for reply in web]
        assert state(rest[-1]) == (TERMINATED, "Signal STOP: exited with code 7"), [state(r) for r in rest]
        assert list(await guests_of(daemon)) == [calm_vm]
        assert taps_of(daemon) == [guests[calm_vm][3]]
        await client.signal("web", KILL)  # a repeated signal: a success

        # After a restart the workload in its VM is known still: KILL ends it at once, and frees it.
        daemon.stop()
        daemon.start()
        error = await refusal(client.create(workload("calm", STUBBORN)))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS
        killing = time.monotonic()
        await client.signal("calm", KILL)
        assert time.monotonic() - killing < 5
        assert await guests_of(daemon) == {}
        assert taps_of(daemon) == []
        print(f"booted both in {booted:.1f} s; STOP took {stopped:.1f} s")
    finally:
        await free_every_vm(daemon)


async def test_a_guest_that_never_serves_ends_its_workload_and_leaves_nothing(
    daemon_factory: DaemonFactory,
    guest_image: Path,
    pki: PkiPaths,
    vm_registry: LocalRegistry,
    scheduler_client: tuple[SchedulerProcess, int, WorkloadClient],
) -> None:
    scheduler, port, client = scheduler_client
    daemon = daemon_factory(
        *vm_node_args(guest_image, pki, scheduler, port),
        "--guest-ready-timeout", "2",
        "--orka-vm-memory-mib", "300",
        config_text=mirrors_config(vm_registry, ("docker.io",)),
    )  # fmt: skip
    try:
        vm = container_name("slow")
        replies = [reply async for reply in client.create(workload("slow", STUBBORN), timeout=120)]
        code, message = state(replies[-1])
        assert code == TERMINATED
        prefix = f"booting its guest VM {vm} (1 vCPU, 300 MiB) failed: guest {vm} at "
        assert message.startswith(prefix) and "was not serving within 2 s" in message, message
        tail = message.split("Console tail:\n", 1)[1]
        assert tail.strip(), message  # what the guest's console showed
        assert await guests_of(daemon) == {} and taps_of(daemon) == []
        await client.signal("slow", STOP)  # what never ran is removed as well

        # A Signal while its guest boots: the boot is undone, and the VM freed.
        early = client.create(workload("early", STUBBORN), timeout=120)
        async for reply in early:
            if state(reply)[1].startswith("booting its guest VM"):
                break
        await client.signal("early", KILL)
        rest = [reply async for reply in early]
        assert state(rest[-1]) == (TERMINATED, "Signal KILL before it ran")
        assert await guests_of(daemon) == {}
        assert taps_of(daemon) == []
    finally:
        await free_every_vm(daemon)
