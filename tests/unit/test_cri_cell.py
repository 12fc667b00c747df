"""The ``cell`` handler's decisions, without making anything: which namespaces a pod owns, which
sysctls it may set, its cgroup and limits, and what its containers join."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from auraed.api.runtime import v1 as cri
from auraed.cni.cni import Cni
from auraed.cri.cell import (
    SANDBOX_KEY,
    CellLayout,
    CellSandbox,
    check_sysctls,
    cpu_weight,
    own_namespaces,
    pod_cgroup,
    pod_limits,
)
from auraed.cri.errors import CriError
from auraed.cri.model import PodRecord, PodResources, PodSpec, PodState, pod_spec
from auraed.errors import ErrorKind
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs, CgroupLayout, CgroupLimits, cpu_weight_to_shares

NODE, POD, CONTAINER = cri.NamespaceMode.NODE, cri.NamespaceMode.POD, cri.NamespaceMode.CONTAINER
POD_ID = "ab" * 32


def spec(
    network: cri.NamespaceMode = POD,
    pid: cri.NamespaceMode = POD,
    ipc: cri.NamespaceMode = POD,
    *,
    sysctls: dict[str, str] | None = None,
    cgroup_parent: str = "",
) -> PodSpec:
    context = cri.LinuxSandboxSecurityContext(
        namespace_options=cri.NamespaceOption(network=network, pid=pid, ipc=ipc)
    )
    linux = cri.LinuxPodSandboxConfig(
        security_context=context, sysctls=sysctls or {}, cgroup_parent=cgroup_parent
    )
    metadata = cri.PodSandboxMetadata(name="p", uid="u", namespace="n")
    return pod_spec(cri.PodSandboxConfig(metadata=metadata, linux=linux), "cell")


@pytest.fixture
def cgroups(tmp_path: Path) -> Cgroupfs:
    return Cgroupfs(root=tmp_path / "cgroup", layout=CgroupLayout.V2)


@pytest.fixture
def sandbox(tmp_path: Path, cgroups: Cgroupfs) -> Iterator[CellSandbox]:
    store = Store(tmp_path / "state.db")
    try:
        yield CellSandbox(Cni(store), cgroups, tmp_path / "pods")
    finally:
        store.close()


@pytest.mark.parametrize(
    ("modes", "owned"),
    [
        ((POD, POD, POD), ("net", "ipc", "uts", "pid")),
        ((POD, CONTAINER, POD), ("net", "ipc", "uts")),
        ((NODE, POD, POD), ("ipc", "pid")),  # the host's network is the host's name too
        ((POD, NODE, NODE), ("net", "uts")),
        ((NODE, NODE, NODE), ()),
    ],
)
def test_the_namespaces_a_pod_owns(modes: tuple[cri.NamespaceMode, ...], owned: tuple[str, ...]) -> None:
    network, pid, ipc = modes
    assert own_namespaces(spec(network, pid, ipc)) == owned


def test_sysctls_of_namespaces_shared_with_the_host_are_refused() -> None:
    ok = spec(sysctls={"net.core.somaxconn": "1024", "kernel.shm_rmid_forced": "1"})
    check_sysctls(ok, own_namespaces(ok))
    for modes, name in (((NODE, POD, POD), "net.core.somaxconn"), ((POD, POD, NODE), "fs.mqueue.msg_max")):
        refused = spec(*modes, sysctls={name: "1"})
        with pytest.raises(CriError) as caught:
            check_sysctls(refused, own_namespaces(refused))
        assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
        assert caught.value.message.startswith(f"config.linux.sysctls[{name}]: needs the pod's own")
    host = spec(sysctls={"vm.swappiness": "1"})
    with pytest.raises(CriError, match=r"sysctls\[vm.swappiness\]: is not namespaced"):
        check_sysctls(host, own_namespaces(host))


def test_the_pod_cgroup(cgroups: Cgroupfs) -> None:
    assert pod_cgroup(spec(), POD_ID, cgroups) == f"_pods/{POD_ID}"
    assert pod_cgroup(spec(cgroup_parent="/kubepods/besteffort/pod-1/"), POD_ID, cgroups) == (
        "kubepods/besteffort/pod-1"
    )
    for parent, problem in (
        ("/test.slice", "is a systemd slice"),
        ("kubepods.slice/kubepods-pod1.slice", "is a systemd slice"),
        ("/_containers", "auraed's own"),
        ("/kube pods", "bad component"),
    ):
        with pytest.raises(CriError) as caught:
            pod_cgroup(spec(cgroup_parent=parent), POD_ID, cgroups)
        assert (
            caught.value.message.startswith("config.linux.cgroup_parent: ")
            and problem in caught.value.message
        )


def test_limits_are_the_resources_plus_the_overhead() -> None:
    resources = PodResources(cpu_period=50_000, cpu_quota=25_000, cpu_shares=512, memory_limit=100)
    overhead = PodResources(cpu_period=100_000, cpu_quota=10_000, cpu_shares=2, memory_limit=20)
    assert pod_limits(resources, overhead) == CgroupLimits(
        cpu_weight=cpu_weight(514), cpu_max_us=30_000, cpu_period_us=50_000, memory_max=120
    )
    # No limit of the containers, no limit of the pod: the overhead alone limits nothing.
    assert pod_limits(PodResources(), overhead) == CgroupLimits()
    assert abs(cpu_weight_to_shares(cpu_weight(1024)) - 1024) < 32
    assert (cpu_weight(2), cpu_weight(262_144), cpu_weight(10**9)) == (1, 10_000, 10_000)


def test_a_resize_sets_what_it_names() -> None:
    current = PodResources(cpu_period=50_000, cpu_quota=25_000, cpu_shares=512, memory_limit=100)
    assert current.updated(PodResources(cpu_quota=40_000, memory_limit=200)) == PodResources(
        cpu_period=50_000, cpu_quota=40_000, cpu_shares=512, memory_limit=200
    )
    assert current.updated(PodResources()) == current


def layout_of(pod: PodRecord, sandbox: CellSandbox) -> CellLayout:
    layout, _, _ = sandbox._plan(pod, None)
    pod.sandbox[SANDBOX_KEY] = layout.to_doc()
    return layout


def test_what_a_container_joins(sandbox: CellSandbox, tmp_path: Path) -> None:
    pod = PodRecord(POD_ID, spec(pid=CONTAINER, ipc=NODE), PodState.READY, 1)
    layout = layout_of(pod, sandbox)
    directory = tmp_path / "pods" / POD_ID
    assert CellLayout.from_doc(layout.to_doc()) == layout
    join = sandbox.container_join(pod)
    assert join.namespaces == {"network": str(directory / "ns/net"), "uts": str(directory / "ns/uts")}
    assert join.host_namespaces == {"ipc"}  # pid is each container's own: in neither
    assert (join.hostname_file, join.resolv_conf, join.hosts) == (
        directory / "hostname",
        directory / "resolv.conf",
        directory / "hosts",
    )
    assert join.shm == Path("/dev/shm") and join.cgroup_parent == f"_pods/{POD_ID}"

    shared = PodRecord(POD_ID, spec(network=NODE), PodState.READY, 1)
    layout_of(shared, sandbox)
    join = sandbox.container_join(shared)
    assert set(join.namespaces) == {"ipc", "pid"} and join.host_namespaces == {"network", "uts"}
    assert join.shm == directory / "shm"

    shared.sandbox["step"] = "running"
    with pytest.raises(CriError) as caught:
        sandbox.container_join(shared)
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
