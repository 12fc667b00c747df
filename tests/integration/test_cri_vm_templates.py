"""``vm`` pods with the default configuration: clones of the host's guest template (q35), grown to
each pod's size, with real QEMU guests (TCG here) through the kubelet's socket.

One daemon for the module, on a copy of the guest image, with the template settings left at their
defaults (``cri_vm_boot = "template"``, ``cri_vm_machine = "q35"``, ``vm_template_memory_mib =
256``; room for 3 vCPUs):

- the template is made in the background as the daemon starts (the log says so), before any pod
  asks; the first pod is its clone, grown from the template's 256 MiB to its own 512 MiB as it is
  restored, its virtio-fs (the pod's volumes) plugged then: a host path read and written from a
  container, the clone's RAM copy gone from the host's files and charged to the pod's VMM cgroup;
- a pod bigger than the template (2 vCPUs, a 300 MiB limit: 640 MiB) is a clone of the same
  template, grown as it is restored: its container sees 2 CPUs and the memory; then
  UpdatePodSandboxResources grows it again (a third vCPU, more memory), as it grows a cold guest;
- stopping and removing pods logs no "lost its sandbox", a guest killed under a READY pod does;
- the guest image changes: the template is made again in the background, the next pod is a clone
  of the new build while the older clones keep running.

With ``cri_vm_machine = "microvm"``, which cannot plug a clone's virtio-fs (no PCIe hotplug), no
template is made and a pod boots cold; the log says why.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from auraed.api.aurae.vms import v0 as vms
from auraed.api.runtime import v1 as cri
from auraed.pki import PkiPaths
from auraed.vms.qemu import CLONE_MEMORY_FILE
from auraed.vms.templates import AUTO_PREFIX
from tests.integration.test_cri_containers import Node
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.integration.test_cri_vm_containers import BOOT_TIMEOUT, VmPod, eventually
from tests.integration.vm_pods_helpers import (
    VM_MEMORY_MIB,
    VMS,
    leftovers_of_pod,
    module_vm_node,
    qemu_of,
    vm_node_fixture,
)
from tests.support.cri import (
    pod_config,
    pod_status,
    run_pod,
)
from tests.support.registry import LocalRegistry

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the module's daemon's tests

mirror = busybox_mirror  # the registry fixture, used by name
GUEST_PORT = 8443
MIB = 1024 * 1024
MAX_VCPUS = 3
TEMPLATE_READY = re.compile(r"vm pods' guest template (auto-\w+) is ready \(build (\d+)")
LOST = "lost its sandbox"


def lost(log: str, pod_id: str) -> bool:
    """Whether the daemon said the pod lost its sandbox (a WARNING)."""
    return f"pod {pod_id[:13]} {LOST}" in log


@dataclass
class TemplateNode:
    node: Node
    image: Path  # the daemon's copy of the guest image

    def log(self) -> str:
        return self.node.daemon.log()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def template_node(
    mirror: LocalRegistry, guest_image: Path, pki: PkiPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[TemplateNode]:
    """A daemon of vm pods with the template settings at their defaults, on its own copy of the
    guest image (changed by a test); at the end every pod is gone and nothing of the daemon left."""
    work = tmp_path_factory.mktemp("vm-templates")
    image = work / "image"
    image.mkdir()
    for name in ("vmlinuz", "initramfs.img", "rootfs.img"):
        shutil.copyfile(guest_image / name, image / name)
    async with module_vm_node(
        work, "aurae-tpl-", image, pki, mirror, "--vm-max-vcpus", str(MAX_VCPUS)
    ) as node:
        yield TemplateNode(node, image)


async def guest_of(node: Node, pod_id: str) -> vms.VmStatus:
    async with node.daemon.client() as aurae:
        listing = await aurae.call(VMS, "List", vms.VmServiceListRequest())
    (status,) = [s for s in listing.vms if s.vm is not None and s.vm.name == f"pod-{pod_id[:16]}"]
    return status


async def templates_of(node: Node) -> list[vms.TemplateStatus]:
    async with node.daemon.client() as aurae:
        return list((await aurae.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())).templates)


def vmm_page_cache(node: Node, pod_id: str) -> int:
    """Bytes of file pages (the RAM copy among them) charged to the pod's VMM cgroup (v1 memory)."""
    stat = Path("/sys/fs/cgroup/memory") / node.daemon.cgroup_base / "_pods" / pod_id / "vmm" / "memory.stat"
    fields = dict(line.split() for line in stat.read_text().splitlines())
    return int(fields["cache"])


def ram_copies(node: Node) -> list[Path]:
    return list((node.daemon.root / "run" / "vms").glob(f"*/{CLONE_MEMORY_FILE}"))


async def template_ready(template_node: TemplateNode, build: int) -> str:
    """The name of vm pods' template once the daemon says its build ``build`` is ready."""

    def ready() -> bool:
        return any(int(b) == build for _, b in TEMPLATE_READY.findall(template_node.log()))

    await eventually(ready, BOOT_TIMEOUT)
    (name,) = {n for n, b in TEMPLATE_READY.findall(template_node.log()) if int(b) == build}
    return name


async def sleeper(pod: VmPod) -> str:
    return await pod.run("sleeper", ["sleep", "3600"])


async def guest_sees(pod: VmPod, container: str) -> tuple[int, int]:
    """(nproc, MemTotal in KiB) in a container of the pod's guest."""
    reply = await pod.node.exec_sync(container, ["sh", "-c", "nproc; grep MemTotal /proc/meminfo"])
    nproc, meminfo = reply.stdout.decode().splitlines()
    return int(nproc), int(meminfo.split()[1])


def new_pod(node: Node, name: str, **fields: object) -> tuple[cri.PodSandboxConfig, Path]:
    logs = node.log_root / name
    logs.mkdir(parents=True, mode=0o777)
    config = pod_config(name, namespace="vm-templates", **fields)  # type: ignore[arg-type]
    config.log_directory = str(logs)
    return config, logs


@in_module_loop
async def test_the_template_is_made_at_start_and_the_first_pod_is_its_clone_grown_to_its_size(
    template_node: TemplateNode, tmp_path: Path
) -> None:
    node = template_node.node
    name = await template_ready(template_node, 1)
    assert name.startswith(AUTO_PREFIX)
    log_before_pod = template_node.log()
    assert "vm pods' guest template: making it ready in the background" in log_before_pod
    assert f"VM template {name} made in" in log_before_pod

    config, logs = new_pod(node, "first", hostname="first-host")
    pod_id = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    guest = await guest_of(node, pod_id)
    assert guest.template == name and guest.restore_ms is not None, guest
    assert guest.vm is not None and (guest.vm.vcpus, guest.vm.memory_mib) == (1, VM_MEMORY_MIB)
    # The pod paid no template's boot: made once, before it asked.
    assert template_node.log().count(f"VM template {name} made in") == 1
    (template,) = await templates_of(node)
    assert template.template is not None and template.template.name == name
    assert (template.template.vcpus, template.template.memory_mib, template.machine) == (1, 256, "q35")
    assert (template.max_vcpus, template.build) == (MAX_VCPUS, 1) and template.max_memory_mib > 2048
    assert template.clones == [f"pod-{pod_id[:16]}"]
    said = f"guest pod-{pod_id[:16]} cloned from template {name}"
    assert said in template_node.log()
    assert "grown from 1 vCPU and 256 MiB to 1 vCPUs and 512 MiB" in template_node.log()
    # Its RAM copy was written by a child in the pod's VMM cgroup and unlinked once QEMU mapped it.
    assert ram_copies(node) == []
    copied_mib = int(
        re.findall(r"RAM copied for its shared directory in \d+ ms \((\d+) MiB", template_node.log())[-1]
    )
    assert copied_mib > 64
    assert vmm_page_cache(node, pod_id) >= copied_mib << 20

    # The pod IP is the guest's: its auraed's TLS port answers there.
    status = (await pod_status(node.client, pod_id)).status
    assert status is not None and status.network is not None
    assert guest.address == f"{status.network.ip}:{GUEST_PORT}"

    # A host path read and written from a container in the guest (the plugged virtio-fs), which
    # sees the memory the guest was grown to.
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("from the host\n")
    pod = VmPod(node, pod_id, config, logs)
    script = "cat /data/in.txt; echo from the guest > /data/out.txt; echo written; sleep 3600"
    volume = await pod.create(
        "volume", ["sh", "-c", script], mounts=[cri.Mount(container_path="/data", host_path=str(data))]
    )
    await node.start(volume)
    await eventually(lambda: "written" in pod.lines("volume"))
    assert pod.lines("volume") == ["from the host", "written"]
    assert (data / "out.txt").read_text() == "from the guest\n"
    nproc, mem_total = await guest_sees(pod, volume)
    assert nproc == 1 and mem_total > (VM_MEMORY_MIB - 64) * 1024, mem_total

    # A normal stop and removal is no loss of the sandbox.
    await node.stop(volume)
    await node.remove(volume)
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    assert leftovers_of_pod(node.daemon, node.network, pod_id) == {}
    assert ram_copies(node) == []
    assert not lost(template_node.log(), pod_id)


@in_module_loop
async def test_a_pod_bigger_than_the_template_is_grown_as_it_is_restored_and_again_by_a_resize(
    template_node: TemplateNode,
) -> None:
    node = template_node.node
    name = await template_ready(template_node, 1)
    limits = cri.LinuxContainerResources(
        cpu_quota=200_000, cpu_period=100_000, memory_limit_in_bytes=300 * MIB
    )
    config, logs = new_pod(node, "big", linux=cri.LinuxPodSandboxConfig(resources=limits))
    pod_id = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    guest = await guest_of(node, pod_id)
    # 2 vCPUs; 256 MiB for the guest itself and 300 for its containers, in whole 128 MiB blocks.
    assert guest.template == name and guest.vm is not None, guest
    assert (guest.vm.vcpus, guest.vm.memory_mib) == (2, 640)
    assert "grown from 1 vCPU and 256 MiB to 2 vCPUs and 640 MiB (the guest has 2 CPUs" in template_node.log()
    pod = VmPod(node, pod_id, config, logs)
    container = await sleeper(pod)
    nproc, before = await guest_sees(pod, container)
    assert nproc == 2 and before > 560 * 1024, before

    grown = cri.LinuxContainerResources(
        cpu_quota=300_000, cpu_period=100_000, memory_limit_in_bytes=600 * MIB
    )
    request = cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod_id, resources=grown)
    await node.call("UpdatePodSandboxResources", request, BOOT_TIMEOUT)
    guest = await guest_of(node, pod_id)
    assert guest.vm is not None and (guest.vm.vcpus, guest.vm.memory_mib) == (3, 896), guest.vm
    nproc, after = await guest_sees(pod, container)
    assert nproc == 3 and after - before == 256 * 1024, (before, after)

    # A guest that dies under its READY pod is a loss: said, and the pod NOT_READY.
    assert not lost(template_node.log(), pod_id)
    (qemu,) = qemu_of(f"pod-{pod_id[:16]}")
    os.kill(qemu, signal.SIGKILL)

    async def not_ready() -> bool:
        status = (await pod_status(node.client, pod_id)).status
        return status is not None and status.state == cri.PodSandboxState.SANDBOX_NOTREADY

    await eventually(not_ready)
    assert f"pod {pod_id[:13]} {LOST}: its guest VM pod-{pod_id[:16]} is crashed" in template_node.log()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    assert leftovers_of_pod(node.daemon, node.network, pod_id) == {}


@in_module_loop
async def test_a_changed_guest_image_makes_the_template_again_in_the_background(
    template_node: TemplateNode,
) -> None:
    node = template_node.node
    first = await template_ready(template_node, 1)
    config, _ = new_pod(node, "old-build")
    old = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    assert (await guest_of(node, old)).template == first
    with (template_node.image / "rootfs.img").open("ab") as rootfs:
        rootfs.write(b"\0" * 4096)
    assert await template_ready(template_node, 2) == first
    assert (
        f"VM template {first} rebuilt (its files, machine type, room or accelerator changed)"
        in template_node.log()
    )
    (template,) = await templates_of(node)
    assert template.build == 2 and template.state == "ready"
    config, _ = new_pod(node, "new-build")
    new = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    assert (await guest_of(node, new)).template == first
    assert template_node.log().count(f"VM template {first} rebuilt") == 1  # not again for the pod
    assert (await guest_of(node, old)).state == vms.VmState.RUNNING  # the old build's clone runs on
    for pod_id in (old, new):
        await node.stop_pod(pod_id)
        await node.remove_pod(pod_id)
        assert not lost(template_node.log(), pod_id)


microvm_node = vm_node_fixture("--cri-vm-machine", "microvm", name="microvm_node")


async def test_a_pod_that_cannot_be_a_clone_boots_cold_and_says_why(microvm_node: Node) -> None:
    node = microvm_node
    assert "vm pods boot cold, not from a guest template: it has a shared directory" in node.daemon.log()
    pod_id = await asyncio.wait_for(
        run_pod(node.client, pod_config("cold-pod", namespace="vm-pods"), "vm"), BOOT_TIMEOUT
    )
    guest = await guest_of(node, pod_id)
    assert guest.template == "" and guest.restore_ms is None, guest
    said = f"VM pod-{pod_id[:16]} boots cold instead of from template auto: it has a shared directory"
    assert said in node.daemon.log() and "hotplug" in node.daemon.log().split(said, 1)[1].split("\n", 1)[0]
    assert await templates_of(node) == []  # none was made for it
    status = (await pod_status(node.client, pod_id)).status
    assert status is not None and status.network is not None
    _, writer = await asyncio.wait_for(asyncio.open_connection(status.network.ip, GUEST_PORT), 30)
    writer.close()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    assert leftovers_of_pod(node.daemon, node.network, pod_id) == {}
    assert not lost(node.daemon.log(), pod_id)
