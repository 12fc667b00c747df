"""``vm`` pods cloned from the host's guest template (``cri_vm_boot = "template"``, q35), with real
QEMU guests (TCG here) through the kubelet's socket.

One test: the first pod of its shape makes the template (a boot of its own), and its guest is a
clone of it, its virtio-fs (the pod's volumes) plugged as it resumed: a host path is read and
written from a container in the guest, the pod IP reaches the guest's auraed, its RAM copy is
gone from the host's files and charged to the pod's VMM cgroup. A second pod of the same shape
is cloned from the same template, not made again. Stopped and removed, neither leaves anything
(nor any RAM copy). With microvm, which cannot plug a clone's virtio-fs, a pod boots cold and the
log says why.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import pytest

from auraed.api.aurae.vms import v0 as vms
from auraed.api.runtime import v1 as cri
from auraed.vms.qemu import CLONE_MEMORY_FILE
from auraed.vms.templates import AUTO_PREFIX
from tests.integration.test_cri_containers import Node
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.integration.test_cri_vm_containers import BOOT_TIMEOUT, VmPod, eventually
from tests.integration.vm_pods_helpers import VMS, leftovers_of_pod, vm_node_fixture
from tests.support.cri import (
    pod_config,
    pod_status,
    run_pod,
)

pytestmark = pytest.mark.slow

mirror = busybox_mirror  # the registry fixture, used by name
GUEST_PORT = 8443
log = logging.getLogger(__name__)


vm_node = vm_node_fixture("--vm-machine", "q35", "--cri-vm-boot", "template")
# microvm cannot plug a clone's virtio-fs (no PCIe hotplug), and every vm pod has its share.
microvm_node = vm_node_fixture("--vm-machine", "microvm", "--cri-vm-boot", "template", name="microvm_node")


async def guest_of(node: Node, pod_id: str) -> vms.VmStatus:
    async with node.daemon.client() as aurae:
        listing = await aurae.call(VMS, "List", vms.VmServiceListRequest())
    (status,) = [s for s in listing.vms if s.vm is not None and s.vm.name == f"pod-{pod_id[:16]}"]
    return status


def vmm_page_cache(node: Node, pod_id: str) -> int:
    """Bytes of file pages (the RAM copy among them) charged to the pod's VMM cgroup (v1 memory)."""
    stat = Path("/sys/fs/cgroup/memory") / node.daemon.cgroup_base / "_pods" / pod_id / "vmm" / "memory.stat"
    fields = dict(line.split() for line in stat.read_text().splitlines())
    return int(fields["cache"])


def ram_copies(node: Node) -> list[Path]:
    return list((node.daemon.root / "run" / "vms").glob(f"*/{CLONE_MEMORY_FILE}"))


async def test_a_vm_pod_is_cloned_from_the_template_of_its_shape_with_its_volumes(
    vm_node: Node, tmp_path: Path
) -> None:
    node = vm_node
    logs = node.log_root / "tpl-pod"
    logs.mkdir(parents=True, mode=0o777)
    config = pod_config("tpl-pod", namespace="vm-pods", hostname="tpl-pod-host")
    config.log_directory = str(logs)
    started = time.monotonic()
    pod_id = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    first = time.monotonic() - started  # the template's boot, then the clone's start
    guest = await guest_of(node, pod_id)
    assert guest.template.startswith(AUTO_PREFIX) and guest.restore_ms is not None, guest
    assert ram_copies(node) == []  # unlinked once QEMU mapped it
    # The copy was written by a child in the pod's VMM cgroup: its pages are the pod's to pay for,
    # not the daemon's (the pod cgroup holds the clone's QEMU and its memory).
    copied_mib = int(
        re.findall(r"RAM copied for its shared directory in \d+ ms \((\d+) MiB", node.daemon.log())[-1]
    )
    assert copied_mib > 64
    assert vmm_page_cache(node, pod_id) >= copied_mib << 20

    # The pod IP is the guest's: its auraed's TLS port answers there.
    status = (await pod_status(node.client, pod_id)).status
    assert status is not None and status.network is not None
    ip = status.network.ip
    assert guest.address == f"{ip}:{GUEST_PORT}"
    _, writer = await asyncio.wait_for(asyncio.open_connection(ip, GUEST_PORT), 30)
    writer.close()

    # A host path read and written from a container in the guest (the plugged virtio-fs).
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

    # A second pod of the same shape: a clone of the same template, made once.
    started = time.monotonic()
    two = pod_config("tpl-two", namespace="vm-pods")
    second = await asyncio.wait_for(run_pod(node.client, two, "vm"), 120)
    cloned = time.monotonic() - started
    assert (await guest_of(node, second)).template == guest.template
    async with node.daemon.client() as aurae:
        (template,) = (await aurae.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())).templates
    assert template.template is not None and template.template.name == guest.template
    assert sorted(template.clones) == sorted([f"pod-{pod_id[:16]}", f"pod-{second[:16]}"])
    log.warning("RunPodSandbox: %.1f s with the template made, %.1f s from it", first, cloned)

    await node.stop(volume)
    await node.remove(volume)
    for made in (pod_id, second):
        await node.stop_pod(made)
        await node.remove_pod(made)
    for made in (pod_id, second):  # the bridge's veths are any pod's: checked once both are gone
        assert leftovers_of_pod(node.daemon, node.network, made) == {}
    assert ram_copies(node) == []


async def test_a_pod_that_cannot_be_a_clone_boots_cold_and_says_why(microvm_node: Node) -> None:
    node = microvm_node
    pod_id = await asyncio.wait_for(
        run_pod(node.client, pod_config("cold-pod", namespace="vm-pods"), "vm"), BOOT_TIMEOUT
    )
    guest = await guest_of(node, pod_id)
    assert guest.template == "" and guest.restore_ms is None, guest
    said = f"VM pod-{pod_id[:16]} boots cold instead of from template auto: it has a shared directory"
    assert said in node.daemon.log() and "hotplug" in node.daemon.log().split(said, 1)[1].split("\n", 1)[0]
    async with node.daemon.client() as aurae:  # none was made for it
        assert (await aurae.call(VMS, "ListTemplates", vms.VmServiceListTemplatesRequest())).templates == []
    status = (await pod_status(node.client, pod_id)).status
    assert status is not None and status.network is not None
    _, writer = await asyncio.wait_for(asyncio.open_connection(status.network.ip, GUEST_PORT), 30)
    writer.close()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    assert leftovers_of_pod(node.daemon, node.network, pod_id) == {}
