"""The CRI's ``vm`` handler with real QEMU guests (TCG here): a pod is a guest VM on the pod's CNI
network, its IP the guest's. Its guests are microvm's (``cri_vm_machine = "microvm"``), booted
cold (a clone needs q35: test_cri_vm_templates has the default's clones), which cannot grow.

One pod is booted for the module and shared by the tests that only look at it (each boot costs
seconds of TCG): its status, the guest's auraed reached at the pod IP over mTLS, port-forward into
it; then the refusals made before anything exists, and a stop and remove that leave nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.vms import v0 as vms
from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient, ClientError
from auraed.cri.model import PodResources
from auraed.cri.streaming.client import open_port_forward
from auraed.cri.vm import VmSizing, cgroup_overhead, guest_size
from auraed.pki import PkiPaths
from auraed.vms.guests import GUEST_BASE_MIB
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.vm_pods_helpers import VMS, vm_daemon
from tests.support.cni import CniNetwork, cni_network
from tests.support.cri import (
    RUNTIME_SERVICE,
    cri_client,
    pod_config,
    pod_status,
    remove_pod,
    run_pod,
    stop_pod,
)

GUEST_PORT = 8443
TIMEOUT = 240.0
MIB = 1024 * 1024


@dataclass
class VmNode:
    daemon: DaemonProcess
    network: CniNetwork
    client: AuraeClient


@pytest.fixture
async def vm_node(
    daemon_factory: DaemonFactory, guest_image: Path, pki: PkiPaths, tmp_path: Path
) -> AsyncIterator[VmNode]:
    with cni_network(tmp_path) as network:
        daemon = vm_daemon(daemon_factory, network, guest_image, pki, "--cri-vm-machine", "microvm")
        client = cri_client(daemon)
        try:
            yield VmNode(daemon, network, client)
            for pod in (
                await client.call(RUNTIME_SERVICE, "ListPodSandbox", cri.ListPodSandboxRequest())
            ).items:
                await stop_pod(client, pod.id)
                await remove_pod(client, pod.id)
            async with daemon.client() as aurae:
                listing = await aurae.call(VMS, "List", vms.VmServiceListRequest())
                assert [status.vm.name for status in listing.vms] == []
        finally:
            await client.close()


def vm_pod(name: str, **fields: Any) -> cri.PodSandboxConfig:
    return pod_config(name, namespace="vm-pods", **fields)


async def expect(call: Any, code: str) -> str:
    with pytest.raises(ClientError) as error:
        await call
    assert error.value.code == code, error.value
    return error.value.message


def links_in(netns: str) -> list[str]:
    out = subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-j", "link"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(link["ifname"] for link in json.loads(out))


async def test_a_vm_pod_is_a_guest_on_the_pod_network(vm_node: VmNode) -> None:
    client = vm_node.client
    pod_id = await asyncio.wait_for(
        run_pod(client, vm_pod("guest-pod", hostname="guest-pod-host"), "vm"), TIMEOUT
    )
    status = (await pod_status(client, pod_id, verbose=True)).status
    assert status is not None and status.network is not None
    assert status.state == cri.PodSandboxState.SANDBOX_READY and status.runtime_handler == "vm"
    ip = status.network.ip
    assert ipaddress.IPv4Address(ip) in vm_node.network.subnet

    # The guest's auraed answers at the pod IP, over mTLS only: a plain connection is refused.
    async with vm_node.daemon.client() as aurae:
        listing = await aurae.call(VMS, "List", vms.VmServiceListRequest())
        [guest] = listing.vms
        assert guest.vm.name == f"pod-{pod_id[:16]}" and guest.vm.memory_mib == 512
        assert guest.address == f"{ip}:{GUEST_PORT}"

    # The guest took the pod's hostname (its PID 1 says so on the console).
    console = vm_node.daemon.root / "run" / "vms" / guest.vm.name / "console.log"
    assert "hostname guest-pod-host" in console.read_text(errors="replace")

    # The pod's namespace holds the CNI interface and the guest's tap, nothing else.
    cell_dir = vm_node.daemon.root / "run" / "pods" / pod_id
    netns = str(cell_dir / "ns" / "net")
    assert links_in(netns) == ["eth0", "lo", "tap0"]

    # Port-forward reaches the guest at the pod IP: its auraed's TLS port answers a TCP connect.
    url = (
        await client.call(RUNTIME_SERVICE, "PortForward", cri.PortForwardRequest(pod_sandbox_id=pod_id))
    ).url
    forward = await open_port_forward(url)
    try:
        connection = await forward.connect(GUEST_PORT)
        await connection.write(b"GET / HTTP/1.0\r\n\r\n")  # no TLS hello: the guest's TLS ends it
        await connection.close_write()
        async with asyncio.timeout(60):
            while await connection.read():
                pass
            assert await connection.error() == ""
        await connection.close()
    finally:
        await forward.close()

    # A microvm guest cannot grow: a resize that needs it to is refused, saying what can.
    bigger = cri.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod_id, resources=cri.LinuxContainerResources(memory_limit_in_bytes=1 << 30)
    )
    message = await expect(
        client.call(RUNTIME_SERVICE, "UpdatePodSandboxResources", bigger), "FAILED_PRECONDITION"
    )
    assert "microvm" in message and "q35" in message, message

    # Stop ends the guest and releases the address; remove leaves nothing of the pod.
    await stop_pod(client, pod_id)
    status = (await pod_status(client, pod_id)).status
    assert status is not None and status.state == cri.PodSandboxState.SANDBOX_NOTREADY
    await remove_pod(client, pod_id)
    assert not cell_dir.exists()
    async with vm_node.daemon.client() as aurae:
        assert (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms == []


async def test_a_vm_pod_asking_for_a_host_namespace_is_refused_before_anything(vm_node: VmNode) -> None:
    client = vm_node.client
    node = cri.NamespaceMode.NODE
    for option, options in (
        ("network", cri.NamespaceOption(network=node)),
        ("pid", cri.NamespaceOption(pid=node)),
        ("ipc", cri.NamespaceOption(ipc=node)),
    ):
        config = vm_pod(
            f"host-{option}",
            linux=cri.LinuxPodSandboxConfig(
                security_context=cri.LinuxSandboxSecurityContext(namespace_options=options)
            ),
        )
        message = await expect(run_pod(client, config, "vm"), "INVALID_ARGUMENT")
        assert message.startswith(f"config.linux.security_context.namespace_options.{option}: ")
        assert "cell handler" in message
    listed = await client.call(RUNTIME_SERVICE, "ListPodSandbox", cri.ListPodSandboxRequest())
    assert listed.items == []
    pods_dir = vm_node.daemon.root / "run" / "pods"
    assert not pods_dir.exists() or list(pods_dir.iterdir()) == []


def test_a_guest_is_sized_from_the_pod_or_the_default() -> None:
    default = VmSizing(vcpus=2, memory_mib=600)
    assert guest_size(PodResources(), PodResources(), default) == (2, 600)
    limits = PodResources(cpu_period=100_000, cpu_quota=150_000, memory_limit=128 * MIB)
    overhead = PodResources(cpu_period=100_000, cpu_quota=10_000, memory_limit=16 * MIB)
    # The overhead's CPU counts (vCPUs run it); its memory is the VM's own cost, not the guest's.
    assert guest_size(limits, overhead, default) == (2, GUEST_BASE_MIB + 128)
    # The pod cgroup's overhead: at least what the VM takes beyond its containers.
    vm_overhead = (GUEST_BASE_MIB + default.vmm_overhead_mib) * MIB
    assert cgroup_overhead(overhead, default) == PodResources(100_000, 10_000, 0, vm_overhead)
    ample = PodResources(memory_limit=vm_overhead + MIB)
    assert cgroup_overhead(ample, default) == ample
    assert guest_size(PodResources(memory_limit=MIB + 1), PodResources(), default) == (2, GUEST_BASE_MIB + 2)
