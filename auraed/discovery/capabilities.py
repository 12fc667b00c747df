"""What the machine under auraed can do, probed once at start (never assumed)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

from auraed.system.cgroupfs import Cgroupfs, CgroupLayout
from auraed.system.kvm import probe_kvm

OCI_RUNTIMES = ("runc", "crun")
# crun 1.8 refuses cgroup v1/hybrid hosts ("cgroups in hybrid mode not supported").
V2_ONLY_RUNTIMES = frozenset({"crun"})


@dataclasses.dataclass(frozen=True)
class OciRuntimeInfo:
    name: str
    path: str
    version: str
    usable: bool


@dataclasses.dataclass(frozen=True)
class Capabilities:
    cgroup_layout: CgroupLayout
    cgroup_controllers: tuple[str, ...]
    oci_runtimes: tuple[OciRuntimeInfo, ...]
    kvm_present: bool
    kvm_usable: bool
    kvm_detail: str
    qemu_path: str
    cloud_hypervisor_path: str
    kernel_release: str
    cpus: int
    memory_bytes: int


def _version_of(path: str) -> str:
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    match = re.search(r"\d+\.\d+(\.\d+)?", result.stdout)
    return match.group(0) if match else ""


def oci_runtimes(layout: CgroupLayout) -> tuple[OciRuntimeInfo, ...]:
    found = []
    for name in OCI_RUNTIMES:
        path = shutil.which(name)
        if path:
            usable = layout is CgroupLayout.V2 or name not in V2_ONLY_RUNTIMES
            found.append(OciRuntimeInfo(name, path, _version_of(path), usable))
    return tuple(found)


def memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def probe(cgroups: Cgroupfs) -> Capabilities:
    kvm = probe_kvm()
    return Capabilities(
        cgroup_layout=cgroups.layout,
        cgroup_controllers=tuple(cgroups.controllers()),
        oci_runtimes=oci_runtimes(cgroups.layout),
        kvm_present=kvm.present,
        kvm_usable=kvm.usable,
        kvm_detail=kvm.detail,
        qemu_path=shutil.which("qemu-system-x86_64") or "",
        cloud_hypervisor_path=shutil.which("cloud-hypervisor") or "",
        kernel_release=os.uname().release,
        cpus=os.cpu_count() or 0,
        memory_bytes=memory_bytes(),
    )
