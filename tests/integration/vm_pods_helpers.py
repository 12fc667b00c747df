"""What the tests of ``vm`` pods share: a daemon that boots pods as guests (real QEMU, TCG here),
a node fixture over one, and the check that nothing of a pod is left on the host once it is gone."""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.vms import v0 as vms
from auraed.pki import PkiPaths
from tests.conftest import DaemonFactory, DaemonProcess, remove_daemon_leftovers
from tests.integration.test_cri_containers import Node
from tests.integration.test_vms import guest_host_args
from tests.support.cni import CniNetwork, cni_network
from tests.support.cri import BUSYBOX_IMAGE, cri_client, mirrors_config, pull_image
from tests.support.registry import LocalRegistry

VMS = "aurae.vms.v0.VmService"
VM_MEMORY_MIB = 512
"""A test pod's guest: enough for its auraed and a busybox container, small for the CI host."""


def vm_daemon(
    daemon_factory: DaemonFactory,
    network: CniNetwork,
    guest_image: Path,
    pki: PkiPaths,
    *extra_args: str,
    config_text: str = "",
) -> DaemonProcess:
    """A daemon whose vm pods are guests from ``guest_image`` on ``network`` (written first)."""
    network.write(network.conflist())
    return daemon_factory(
        "--cni-conf-dir",
        str(network.conf_dir),
        *guest_host_args(guest_image, pki.ca_key),
        "--cri-vm-memory-mib",
        str(VM_MEMORY_MIB),
        *extra_args,
        config_text=config_text,
    )


def vm_node_fixture(*extra_args: str, name: str = "vm_node") -> Callable[..., Any]:
    """A ``vm_node`` fixture (or ``name``): a daemon of vm pods (``extra_args`` its further flags)
    with its own CNI network and busybox pulled from the module's ``mirror``; at the end every pod
    is stopped and removed, and no container, VM or guest-container record may be left."""

    @pytest.fixture(name=name)
    async def vm_node(
        daemon_factory: DaemonFactory, mirror: LocalRegistry, guest_image: Path, pki: PkiPaths, tmp_path: Path
    ) -> AsyncIterator[Node]:
        with cni_network(tmp_path) as network:
            config = mirrors_config(mirror)
            daemon = vm_daemon(daemon_factory, network, guest_image, pki, *extra_args, config_text=config)
            async with _serving(daemon, network, tmp_path / "logs") as node:
                yield node

    return vm_node


@contextlib.asynccontextmanager
async def _serving(daemon: DaemonProcess, network: CniNetwork, logs: Path) -> AsyncIterator[Node]:
    """The daemon's CRI client as a Node, busybox pulled; at the end every pod stopped and
    removed, and the client closed."""
    node = Node(daemon, network, cri_client(daemon), "", logs)
    try:
        node.image_id = await pull_image(node.client, BUSYBOX_IMAGE)
        yield node
        await remove_every_pod(node)
    finally:
        await node.client.close()


@contextlib.asynccontextmanager
async def module_vm_node(
    work: Path, prefix: str, guest_image: Path, pki: PkiPaths, mirror: LocalRegistry, *extra_args: str
) -> AsyncIterator[Node]:
    """:func:`vm_node_fixture`'s node for a module-scoped fixture (a booted guest held by the
    module; ``daemon_factory`` is per test): its root under /tmp named ``prefix`` (unix socket
    paths are short), its own CNI network in ``work``, busybox pulled; at the end every pod is
    stopped and removed, and the daemon stopped with nothing of it left."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    with cni_network(work) as network:
        network.write(network.conflist())
        args = [
            "--cni-conf-dir", str(network.conf_dir), *guest_host_args(guest_image, pki.ca_key),
            "--cri-vm-memory-mib", str(VM_MEMORY_MIB), *extra_args,
        ]  # fmt: skip
        daemon = DaemonProcess(root, pki, args, mirrors_config(mirror))
        try:
            daemon.start()
            async with _serving(daemon, network, work / "logs") as node:
                yield node
        finally:
            daemon.stop()
            remove_daemon_leftovers(daemon)


async def remove_every_pod(node: Node) -> None:
    """Every pod stopped and removed; then no container, VM or guest-container record is left."""
    for pod_id in await node.pod_ids():
        await node.stop_pod(pod_id)
        await node.remove_pod(pod_id)
    assert await node.containers() == []
    async with node.daemon.client() as aurae:
        assert (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms == []
    assert not any((node.daemon.root / "state" / "cri" / "guest-containers").glob("*"))


def pids_of(pattern: str) -> list[int]:
    """The processes whose command line matches ``pattern`` (pgrep -f's regex)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return [int(pid) for pid in found.stdout.split()]


def qemu_of(vm: str) -> list[int]:
    return pids_of(f"qemu-system.*{vm}")


def cgroups_of(daemon: DaemonProcess, pod_id: str) -> list[str]:
    """The pod's cgroup (``<cgroup base>/_pods/<pod>``, its ``vmm`` child with it) in any hierarchy."""
    return [
        str(path)
        for hierarchy in Path("/sys/fs/cgroup").iterdir()
        if (path := hierarchy / daemon.cgroup_base / "_pods" / pod_id).exists()
    ]


def veths_on(bridge: str) -> list[str]:
    """The links enslaved to ``bridge``: a pod's host-side veth while it is on the network."""
    out = subprocess.run(
        ["ip", "-j", "link", "show", "master", bridge], capture_output=True, text=True, check=False
    ).stdout
    return sorted(link["ifname"] for link in json.loads(out or "[]"))


def in_share_namespace(share: Path, *command: str) -> str:
    """What ``command`` prints run in the mount namespace of the vm pod whose share directory is
    ``share`` (``<runtime dir>/pod-shares/<pod id>``, its pin ``mnt``): where the share's mounts
    are (auraed.cri.pod_share); "" when the pod has none any more."""
    pin = share / "mnt"
    if not pin.exists():
        return ""
    run = subprocess.run(["nsenter", f"--mount={pin}", *command], capture_output=True, text=True, check=True)
    return run.stdout


def leftovers_of_pod(daemon: DaemonProcess, network: CniNetwork, pod_id: str) -> dict[str, object]:
    """Whatever of the pod ``pod_id`` (its VM ``pod-<id[:16]>``) is still on the host: its QEMU
    and virtiofsd, its directory and pinned namespaces, its share, its VM's run dir, its pod
    cgroup, its CNI lease and veth. Empty when nothing is."""
    vm = f"pod-{pod_id[:16]}"
    root = daemon.root / "run"
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    found: dict[str, object] = {
        "qemu": qemu_of(vm),
        "virtiofsd": pids_of(f"virtiofsd.*{pod_id}"),
        "pod dir": (root / "pods" / pod_id).exists(),
        "namespace pins": [m for m in mounts if pod_id in m],
        "share": (root / "pod-shares" / pod_id).exists(),
        "vm run dir": (root / "vms" / vm).exists(),
        "cgroups": cgroups_of(daemon, pod_id),
        "cni leases": [ip for ip, owner in network.allocations().items() if owner == pod_id],
        "veths": veths_on(network.bridge),
    }
    return {what: there for what, there in found.items() if there}
