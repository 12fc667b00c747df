"""The nested flow for real: a host auraed boots a guest VM (QEMU, TCG here) whose PID 1 is auraed,
and places a container in it; the guest runs it with crun on cgroup v2.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from auraed.api.aurae.cells import v0 as cells
from auraed.api.aurae.containers import v0 as pb
from auraed.api.aurae.discovery import v0 as discovery
from auraed.api.aurae.network import v0 as network
from auraed.api.aurae.vms import v0 as vms
from auraed.client import AuraeClient, ClientConfig, ClientError, log_lines
from auraed.pki import PkiPaths, create_ca, issue_client_cert, write_pem_files
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.integration.containers_helpers import CONTAINERS, import_layout
from tests.integration.test_vms import NO_POD_TEMPLATE, guest_host_args
from tests.support.images import BuiltImage

VMS = "aurae.vms.v0.VmService"
NETWORK = "aurae.network.v0.NetworkService"
IMAGE = "localhost/busybox:nested"
DATA_DISK_BYTES = 1 << 20


@pytest.fixture
async def host(
    daemon_factory: DaemonFactory, guest_image: Path, pki: PkiPaths
) -> AsyncIterator[DaemonProcess]:
    daemon = daemon_factory(*guest_host_args(guest_image, pki.ca_key), *NO_POD_TEMPLATE)
    yield daemon
    async with daemon.client() as client:
        listing = await client.call(VMS, "List", vms.VmServiceListRequest())
        for status in listing.vms:
            await client.call(VMS, "Free", vms.VmServiceFreeRequest(name=status.vm.name, timeout_ms=0))


def guest_client(
    daemon: DaemonProcess, address: str, crt: Path, key: Path, ca: Path | None = None
) -> AuraeClient:
    """A client that talks to the guest directly (tests only; users go through the host)."""
    config = ClientConfig(ca or daemon.pki.ca_crt, crt, key, address, server_name="g1.guest.aurae")
    return AuraeClient.connect(config)


async def _allocate_g1(client: AuraeClient, busybox_layout: BuiltImage, *disks: Path) -> None:
    """The busybox image in the host's store, and a guest VM g1 allocated (not started) with
    ``disks`` as extra disks."""
    await import_layout(client, busybox_layout.layout, IMAGE)
    extra = [vms.Disk(path=str(disk)) for disk in disks]
    guest = vms.VirtualMachine(name="g1", role="guest", memory_mib=768, extra_disks=extra)
    await client.call(VMS, "Allocate", vms.VmServiceAllocateRequest(vm=guest))


async def test_guest_boots_and_runs_a_placed_container(
    host: DaemonProcess, busybox_layout: BuiltImage, tmp_path: Path
) -> None:
    # A disk of the user's comes before the config disk the host adds: the guest finds its
    # config by the disk's serial, not at /dev/vdb (where this one is).
    data_disk = tmp_path / "data.img"
    data_disk.write_bytes(bytes(DATA_DISK_BYTES))
    async with host.client() as client:
        await _allocate_g1(client, busybox_layout, data_disk)
        sent = time.monotonic()
        started = await client.call(VMS, "Start", vms.VmServiceStartRequest(name="g1"), timeout=300)
        took_ms = (time.monotonic() - sent) * 1000
        address = started.address
        assert started.status.state == vms.VmState.RUNNING and address.endswith(":8443")
        # From launching QEMU until the guest served: most of Start, never more than all of it.
        assert took_ms / 2 < started.console_ready_ms <= took_ms

        await _run_containers_in_guest(AuraeClient(client.channel, vm="g1"))
        await _change_the_guests_network(client, address.rsplit(":", 1)[0])
        await _use_guest_directly(host, address)
        await _refusals(host, address, tmp_path)
        # Stop and free leave nothing behind: no tap, no QEMU, no files.
        status = (await client.call(VMS, "List", vms.VmServiceListRequest(name="g1"))).vms[0]
        await client.call(VMS, "Stop", vms.VmServiceStopRequest(name="g1", timeout_ms=30_000), timeout=120)
        await client.call(VMS, "Free", vms.VmServiceFreeRequest(name="g1"), timeout=60)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert status.tap not in links
    assert not Path(status.console_path).exists()
    await wait_until(lambda: not _qemu_running(status.pid))


async def test_calls_to_a_guest_end_when_its_vm_dies(host: DaemonProcess, busybox_layout: BuiltImage) -> None:
    """A guest whose QEMU is killed: the boot, a relayed log stream and new calls end at once.

    Before, Start waited out the guest ready timeout (120 s), the stream hung on the dead TCP
    connection, and each new call waited for its deadline.
    """
    async with host.client() as client:
        await _allocate_g1(client, busybox_layout)

        async def qemu_pid() -> int:
            return (await client.call(VMS, "List", vms.VmServiceListRequest(name="g1"))).vms[0].pid

        # Killed while it boots: Start says so instead of waiting for the guest to serve.
        booting = asyncio.create_task(
            client.call(VMS, "Start", vms.VmServiceStartRequest(name="g1"), timeout=300)
        )
        await wait_until(qemu_pid, timeout=30)
        await asyncio.sleep(1)
        os.kill(await qemu_pid(), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(ClientError) as error:
            await booting
        assert time.monotonic() - killed < 20
        assert error.value.code == "UNAVAILABLE"
        assert "never served: its VM crashed" in error.value.message and "signal 9" in error.value.message

        # Killed while a container's logs are followed through the host: the stream ends.
        await client.call(VMS, "Start", vms.VmServiceStartRequest(name="g1"), timeout=300)
        on_guest = AuraeClient(client.channel, vm="g1")
        config = pb.ContainerConfig(name="ticker", image=IMAGE, command=["sh", "-c", "echo up; sleep 300"])
        await on_guest.call(
            CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=config, start=True), timeout=120
        )
        request = pb.ContainerServiceLogsRequest(container_id="ticker", follow=True)
        lines = on_guest.stream(CONTAINERS, "Logs", request, timeout=300)
        assert [line.line for line in log_lines(await anext(lines))] == ["up"]
        os.kill(await qemu_pid(), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(ClientError) as error:
            await anext(lines)
        assert time.monotonic() - killed < 20
        assert error.value.code == "UNAVAILABLE"
        assert error.value.message.startswith("guest g1: its VM crashed")

        # And a new call is refused by the host, saying why, without trying the guest.
        with pytest.raises(ClientError) as error:
            await on_guest.call(CONTAINERS, "List", pb.ContainerServiceListRequest(), timeout=60)
        assert error.value.code == "FAILED_PRECONDITION"
        assert error.value.message.startswith("VM g1 is crashed")


async def _run_containers_in_guest(on_guest: AuraeClient) -> None:
    # The host places a container in the guest: the image travels as blobs, crun runs it.
    config = pb.ContainerConfig(
        name="hello",
        image=IMAGE,
        command=["sh", "-c", "echo hello from the guest; cat /proc/self/cgroup"],
        resources=pb.Resources(memory_max=64 << 20),
    )
    await on_guest.call(CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=config), timeout=120)
    await on_guest.call(
        CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id="hello"), timeout=60
    )
    final = await on_guest.call(
        CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id="hello"), timeout=120
    )
    assert final.status.exit_code == 0
    lines = [
        line.line
        async for reply in on_guest.stream(
            CONTAINERS, "Logs", pb.ContainerServiceLogsRequest(container_id="hello"), timeout=60
        )
        for line in log_lines(reply)
    ]
    assert lines[0] == "hello from the guest"
    assert lines[1].startswith("0::/")  # cgroup v2, inside its own cgroup namespace

    # The memory limit is enforced by the guest's kernel.
    hog = pb.ContainerConfig(
        name="hog",
        image=IMAGE,
        resources=pb.Resources(memory_max=32 << 20),
        command=["sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}"],
    )
    # Created and started in one call (crun run --detach): the monitor still adopts the process
    # and so learns how it ended.
    started = await on_guest.call(
        CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=hog, start=True), timeout=120
    )
    assert started.status.state in (pb.ContainerState.RUNNING, pb.ContainerState.EXITED)
    final = await on_guest.call(
        CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id="hog"), timeout=120
    )
    assert final.status.oom_killed and final.status.signal == 9
    oneshot = pb.ContainerConfig(name="oneshot", image=IMAGE, command=["sh", "-c", "echo one; exit 7"])
    await on_guest.call(
        CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=oneshot, start=True), timeout=120
    )
    final = await on_guest.call(
        CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id="oneshot"), timeout=120
    )
    assert final.status.exit_code == 7
    request = pb.ContainerServiceLogsRequest(container_id="oneshot")
    replies = on_guest.stream(CONTAINERS, "Logs", request, timeout=60)
    assert [line.line async for reply in replies for line in log_lines(reply)] == ["one"]

    # Exec, relayed both ways.
    box = pb.ContainerConfig(name="box", image=IMAGE, command=["sleep", "300"])
    await on_guest.call(CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=box), timeout=120)
    await on_guest.call(CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id="box"), timeout=60)

    async def exec_requests() -> AsyncIterator[pb.ContainerServiceExecRequest]:
        yield pb.ContainerServiceExecRequest(
            start=pb.ExecStart(container_id="box", command=["cat"], stdin=True)
        )
        yield pb.ContainerServiceExecRequest(stdin=b"through the host\n")
        yield pb.ContainerServiceExecRequest(close_stdin=True)

    out = b"".join([r.stdout async for r in on_guest.duplex(CONTAINERS, "Exec", exec_requests(), timeout=60)])
    assert out == b"through the host\n"


async def _change_the_guests_network(client: AuraeClient, guest_ip: str) -> None:
    """The guest's interfaces and routes by RPC (relayed by the host): an address and a route
    added, then the routes put back; the host itself refuses to change its own network."""
    on_guest = AuraeClient(client.channel, vm="g1")
    listed = await on_guest.call(NETWORK, "ListInterfaces", network.NetworkServiceListInterfacesRequest())
    eth0 = next(i for i in listed.interfaces if i.name == "eth0")
    assert eth0.up and any(a.startswith(f"{guest_ip}/") for a in eth0.addresses), eth0
    # A documentation address on the guest's NIC: only the guest has it, no traffic goes to it.
    extra = "198.51.100.7/32"
    update = network.NetworkServiceUpdateInterfaceRequest(
        name="eth0", replace_addresses=True, addresses=[*eth0.addresses, extra], mtu=1400
    )
    changed = (await on_guest.call(NETWORK, "UpdateInterface", update)).interface
    assert extra in changed.addresses and set(eth0.addresses) <= set(changed.addresses)
    assert changed.mtu == 1400
    routes = list(
        (await on_guest.call(NETWORK, "ListRoutes", network.NetworkServiceListRoutesRequest())).routes
    )
    assert any(r.destination == "default" and r.device == "eth0" for r in routes), routes
    added = network.Route(destination="203.0.113.0/24", device="eth0", source="198.51.100.7")
    replaced = await on_guest.call(
        NETWORK, "UpdateRoutes", network.NetworkServiceUpdateRoutesRequest(routes=[*routes, added])
    )
    assert added in replaced.routes
    restored = await on_guest.call(
        NETWORK, "UpdateRoutes", network.NetworkServiceUpdateRoutesRequest(routes=routes)
    )
    assert added not in restored.routes and sorted(map(bytes, restored.routes)) == sorted(map(bytes, routes))
    back = network.NetworkServiceUpdateInterfaceRequest(
        name="eth0", replace_addresses=True, addresses=list(eth0.addresses), mtu=eth0.mtu
    )
    assert (await on_guest.call(NETWORK, "UpdateInterface", back)).interface.addresses == eth0.addresses
    with pytest.raises(ClientError) as refused:
        await client.call(NETWORK, "ListInterfaces", network.NetworkServiceListInterfacesRequest())
    assert refused.value.code == "FAILED_PRECONDITION" and "machine's init" in refused.value.message


async def _use_guest_directly(host: DaemonProcess, address: str) -> None:
    # Straight to the guest with the host's identity: its cells use cgroup v2, PID 1 reaps.
    host_crt = host.root / "state" / "pki" / "aurae-host.crt"
    async with guest_client(host, address, host_crt, host_crt.with_suffix(".key")) as guest:
        found = await guest.call(
            "aurae.discovery.v0.DiscoveryService",
            "Discover",
            discovery.DiscoveryServiceDiscoverRequest(),
            timeout=30,
        )
        assert found.role == "guest" and found.capabilities.cgroup_layout == discovery.CgroupLayout.V2
        await guest.call(
            "aurae.cells.v0.CellService",
            "Allocate",
            cells.CellServiceAllocateRequest(
                cell=cells.Cell(name="orphans", memory=cells.MemoryController(max=48 << 20))
            ),
            timeout=30,
        )
        await guest.call(
            "aurae.cells.v0.CellService",
            "Start",
            cells.CellServiceStartRequest(
                cell_name="orphans",
                executable=cells.Executable(
                    name="spawn",
                    shell_command="cat /sys/fs/cgroup/aurae/orphans/memory.max; "
                    "for i in $(seq 30); do (sleep 0.2 &); done",
                ),
            ),
            timeout=30,
        )

        from auraed.api.aurae.observe import v0 as observe

        async def output(name: str) -> list[str]:
            request = observe.ObserveServiceGetSubProcessStreamRequest(
                cell_name="orphans", executable_name=name, follow=True
            )
            return [
                i.item.line
                async for i in guest.stream(
                    "aurae.observe.v0.ObserveService", "GetSubProcessStream", request, timeout=60
                )
            ]

        await output("spawn")  # the orphans' parent has ended; they now belong to PID 1
        await guest.call(
            "aurae.cells.v0.CellService",
            "Start",
            cells.CellServiceStartRequest(
                cell_name="orphans",
                executable=cells.Executable(
                    name="count",
                    # Once the orphans have ended (1.5 s), up to 10 s for no zombie to be left:
                    # one now and then is normal (a process just ended); unreaped orphans stay.
                    shell_command="sleep 1.5; for i in $(seq 100); do "
                    "n=$(grep -l '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l); "
                    '[ "$n" = 0 ] && break; sleep 0.1; done; echo "$n"',
                ),
            ),
            timeout=30,
        )
        assert (await output("spawn"))[0] == str(48 << 20)
        assert (await output("count")) == ["0"]


async def _refusals(host: DaemonProcess, address: str, tmp_path: Path) -> None:
    # A certificate from another CA is refused by the guest; the host's ordinary client
    # identity is authenticated but not authorized there.
    foreign_ca = create_ca("elsewhere")
    crt, key = write_pem_files(tmp_path, "foreign", *issue_client_cert(foreign_ca, "aurae-host"))
    async with guest_client(host, address, crt, key) as intruder:
        with pytest.raises(ClientError) as error:
            await intruder.call(
                "aurae.discovery.v0.DiscoveryService",
                "Discover",
                discovery.DiscoveryServiceDiscoverRequest(),
                timeout=10,
            )
        assert error.value.code == "UNAVAILABLE"
    client_crt, client_key = host.pki.clients["aurae-client"]
    async with guest_client(host, address, client_crt, client_key) as stranger:
        with pytest.raises(ClientError) as error:
            await stranger.call(
                "aurae.discovery.v0.DiscoveryService",
                "Discover",
                discovery.DiscoveryServiceDiscoverRequest(),
                timeout=10,
            )
        assert error.value.code == "PERMISSION_DENIED"


def _qemu_running(pid: int) -> bool:
    try:
        return b"qemu" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def test_clones_keep_serving_after_the_host_auraed_is_killed(
    host: DaemonProcess, busybox_layout: BuiltImage
) -> None:
    """A clone of the host's auto template, the host auraed ``kill -9``ed and started again: the
    clone is found running (reattached), still serves through the host, the template is still
    there, and a new clone is restored from it without rebuilding it."""
    async with host.client() as client:
        await import_layout(client, busybox_layout.layout, IMAGE)
        clone = vms.VirtualMachine(name="k1", role="guest", memory_mib=768, template="auto")
        await client.call(VMS, "Allocate", vms.VmServiceAllocateRequest(vm=clone))
        await client.call(VMS, "Start", vms.VmServiceStartRequest(name="k1"), timeout=300)
        (template,) = (await client.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())).templates
        assert template.template is not None and template.clones == ["k1"]
    host.kill9()
    host.start()
    async with host.client() as client:
        (status,) = (await client.call(VMS, "List", vms.VmServiceListRequest(name="k1"))).vms
        assert status.state == vms.VmState.RUNNING and status.template == template.template.name
        on_clone = AuraeClient(client.channel, vm="k1")
        images = await on_clone.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())
        assert images.images == []  # the clone's own store: nothing placed in it yet
        again = vms.VirtualMachine(name="k2", role="guest", memory_mib=768, template="auto")
        await client.call(VMS, "Allocate", vms.VmServiceAllocateRequest(vm=again))
        await client.call(VMS, "Start", vms.VmServiceStartRequest(name="k2"), timeout=300)
        (after,) = (await client.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())).templates
        assert after.template is not None and after.template.name == template.template.name
        assert after.build_ms == template.build_ms and sorted(after.clones) == ["k1", "k2"]  # not rebuilt
        for name in ("k1", "k2"):
            await client.call(VMS, "Free", vms.VmServiceFreeRequest(name=name, timeout_ms=0), timeout=60)
        await client.call(
            VMS, "RemoveTemplate", vms.VmServiceRemoveTemplateRequest(name=template.template.name), timeout=60
        )
