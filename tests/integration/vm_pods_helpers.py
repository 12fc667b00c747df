"""What the tests of ``vm`` pods share: a daemon that boots pods as guests (real QEMU, TCG here),
and the check that nothing of a pod is left on the host once it is gone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from auraed.pki import PkiPaths
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.test_vms import guest_host_args
from tests.support.cni import CniNetwork

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
