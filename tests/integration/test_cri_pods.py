"""CRI pods on the ``cell`` handler through the kubelet's socket: RunPodSandbox, StopPodSandbox,
RemovePodSandbox, PodSandboxStatus, ListPodSandbox and StreamPodSandboxes, as critest and a
kubelet use them.

Each daemon gets a private CNI network (tests.support.cni: Debian's bridge, host-local, portmap
and loopback on a /24 the host does not use). What a pod is made of is checked on the host: its
pinned namespaces (entered with nsenter), files, /dev/shm, cgroup and CNI allocation, and that
nothing of it stays once it is removed, after a failed run, and after auraed was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient, ClientError
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.support.cni import CniNetwork, cni_network, free_port, listener_in, probe
from tests.support.cri import (
    RUNTIME_SERVICE,
    cri_client,
    list_pods,
    namespaces,
    pod_config,
    pod_status,
    remove_pod,
    run_pod,
    stop_pod,
    stream_pods,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
POD_PORT = 8080
NODE, POD, CONTAINER = cri.NamespaceMode.NODE, cri.NamespaceMode.POD, cri.NamespaceMode.CONTAINER
READY, NOT_READY = cri.PodSandboxState.SANDBOX_READY, cri.PodSandboxState.SANDBOX_NOTREADY
MIB = 1024 * 1024

# A CNI plugin for the chain after bridge: it takes ``sleep`` seconds over ADD (so that a test can
# cut a run short, or kill auraed, while the pod has its address), then passes the result on.
SLOW_PLUGIN = """
import json, os, sys, time
config = json.load(sys.stdin)
command = os.environ["CNI_COMMAND"]
if command == "ADD":
    time.sleep(config["sleep"])
    json.dump(config["prevResult"], sys.stdout)
elif command == "VERSION":
    json.dump({"cniVersion": "1.0.0", "supportedVersions": ["0.3.1", "0.4.0", "1.0.0"]}, sys.stdout)
"""


@dataclass
class Node:
    """A daemon with its own CNI network, and a client on its CRI socket."""

    daemon: DaemonProcess
    network: CniNetwork
    client: AuraeClient
    bin_dir: Path

    @property
    def pods_dir(self) -> Path:
        return self.daemon.root / "run" / "pods"

    def cgroup(self, path: str, hierarchy: str = "memory") -> Path:
        return CGROUP_ROOT / hierarchy / self.daemon.cgroup_base / path

    def slow_plugin(self, seconds: float) -> None:
        """The network's chain with SLOW_PLUGIN after bridge (the daemon finds it in bin_dir)."""
        plugin = self.bin_dir / "slow"
        plugin.write_text(f"#!{sys.executable} -S\n{SLOW_PLUGIN}")
        plugin.chmod(0o755)
        self.network.write(self.network.conflist(extra=({"type": "slow", "sleep": seconds},)))

    def slow_plugin_pids(self) -> list[int]:
        marker = str(self.bin_dir / "slow").encode()
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if marker in (proc / "cmdline").read_bytes():
                        found.append(int(proc.name))
        return found

    def leftovers(self) -> list[str]:
        """What pods left on the host: directories, mounts, cgroups, CNI addresses and rules."""
        found = [str(p) for p in self.pods_dir.iterdir()] if self.pods_dir.is_dir() else []
        root = str(self.daemon.root)
        found += [line for line in Path("/proc/self/mounts").read_text().splitlines() if root in line]
        for hierarchy in CGROUP_ROOT.iterdir():
            base = hierarchy / self.daemon.cgroup_base
            if base.is_dir():
                found += [str(p) for p in base.iterdir() if p.is_dir()]
        found += [f"address {ip} of {owner}" for ip, owner in self.network.allocations().items()]
        return found + self.network.rules()


@contextlib.asynccontextmanager
async def node(daemon_factory: DaemonFactory, tmp_path: Path, conflist: bool = True) -> AsyncIterator[Node]:
    with cni_network(tmp_path) as network:
        if conflist:
            network.write(network.conflist())
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        daemon = daemon_factory(
            "--cni-conf-dir", str(network.conf_dir), "--cni-bin-dirs", f"{bin_dir}:/usr/lib/cni:/opt/cni/bin"
        )
        made = Node(daemon, network, cri_client(daemon), bin_dir)
        try:
            yield made
        finally:
            await remove_all(made)
            await made.client.close()
            daemon.stop()
        # No failed undo or recovery, no run whose failure nobody took.
        problems = ("ERROR auraed.cri", "never retrieved", "Exception in callback")
        assert not any(problem in daemon.log() for problem in problems), daemon.log()


async def remove_all(made: Node) -> None:
    """Whatever the test left (it failed half-way), while the daemon still runs."""
    if made.daemon.process is None or made.daemon.process.poll() is not None:
        return
    with contextlib.suppress(ClientError):
        for pod in await list_pods(made.client):
            await remove_pod(made.client, pod.id)


@pytest.fixture
async def pods(daemon_factory: DaemonFactory, tmp_path: Path) -> AsyncIterator[Node]:
    async with node(daemon_factory, tmp_path) as made:
        yield made


async def restarted(made: Node) -> AuraeClient:
    """The killed daemon started again, and a new client on its socket."""
    await made.client.close()
    made.daemon.start()
    made.client = cri_client(made.daemon)
    return made.client


def verbose(response: cri.PodSandboxStatusResponse) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(response.info["info"])
    return info


async def cell_of(client: AuraeClient, pod_id: str) -> dict[str, Any]:
    """The pod's cell layout (directory, cgroup, ...) and pinned namespaces, from verbose status."""
    sandbox: dict[str, Any] = verbose(await pod_status(client, pod_id, verbose=True))["sandbox"]
    return {**sandbox["cell"], "namespaces": sandbox.get("namespaces")}


def nsenter(kind: str, pin: str, *argv: str) -> str:
    result = subprocess.run(["nsenter", f"--{kind}={pin}", *argv], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def shm_mounts(directory: Path) -> list[str]:
    target = str(directory / "shm")
    return [line for line in Path("/proc/self/mounts").read_text().splitlines() if line.split()[1] == target]


async def expect_error(call: Any, code: str) -> str:
    with pytest.raises(ClientError) as caught:
        await call
    assert caught.value.code == code, caught.value.message
    return caught.value.message


# -- lifecycle ------------------------------------------------------------------------------------


async def test_status_and_list_echo_the_pod(pods: Node) -> None:
    client = pods.client
    labels = {"foo": "bar", "io.kubernetes.pod.name": "web", "io.kubernetes.pod.uid": "u-1"}
    config = pod_config("web", uid="u-1", namespace="ns", labels=labels, annotations={"abc": "def"})
    pod_id = await run_pod(client, config)
    assert len(pod_id) == 64

    reply = await pod_status(client, pod_id)
    status = reply.status
    assert status is not None and status.id == pod_id and status.state == READY
    assert status.metadata == cri.PodSandboxMetadata(name="web", uid="u-1", namespace="ns", attempt=2)
    assert status.labels == labels and status.annotations == {"abc": "def"}
    assert status.runtime_handler == "cell" and status.created_at > 0 and reply.timestamp > 0
    assert status.network is not None and ipaddress.ip_address(status.network.ip) in pods.network.subnet
    assert status.linux is not None and status.linux.namespaces is not None
    assert status.linux.namespaces.options == cri.NamespaceOption(network=POD, pid=POD, ipc=POD)
    assert reply.info == {}
    info = verbose(await pod_status(client, pod_id, verbose=True))
    assert info["id"] == pod_id and info["ips"] == [status.network.ip]
    assert info["config"]["metadata"]["name"] == "web"
    assert pods.network.allocations() == {status.network.ip: pod_id}

    other = await run_pod(client, pod_config("other", labels={"foo": "baz"}))
    by = cri.PodSandboxFilter
    assert [p.id for p in await list_pods(client)] == [pod_id, other]
    [listed] = await list_pods(client, by(id=pod_id))
    assert (listed.metadata, listed.state, listed.labels) == (status.metadata, READY, labels)
    assert (listed.annotations, listed.created_at, listed.runtime_handler) == (
        {"abc": "def"},
        status.created_at,
        "cell",
    )
    assert [p.id for p in await list_pods(client, by(id=pod_id[:13]))] == [pod_id]
    assert [p.id for p in await list_pods(client, by(label_selector={"foo": "bar"}))] == [pod_id]
    assert await list_pods(client, by(label_selector={"foo": "qux"})) == []
    assert await list_pods(client, by(id="non-existent-id")) == []
    assert [p.id for p in await stream_pods(client, by(label_selector={"foo": "baz"}))] == [other]
    assert await stream_pods(client, by(id="non-existent-id")) == []
    # A pod's id prefix names it in every call (crictl shows 13 digits).
    assert (await pod_status(client, pod_id[:13])).status.id == pod_id  # type: ignore[union-attr]

    await remove_pod(client, other)


async def test_stop_and_remove_are_idempotent(pods: Node) -> None:
    client = pods.client
    pod_id = await run_pod(client, pod_config("web"))
    other = await run_pod(client, pod_config("other"))
    by, state = cri.PodSandboxFilter, cri.PodSandboxStateValue
    for _ in range(2):  # Stop is idempotent
        await stop_pod(client, pod_id)
        status = (await pod_status(client, pod_id)).status
        assert status is not None and status.state == NOT_READY and status.network.ip == ""  # type: ignore[union-attr]
    assert list(pods.network.allocations().values()) == [other], "stop released the pod's address"
    assert [p.id for p in await list_pods(client, by(state=state(state=NOT_READY)))] == [pod_id]
    assert [p.id for p in await list_pods(client, by(state=state(state=READY)))] == [other]
    layout = await cell_of(client, pod_id)
    assert os.path.ismount(layout["namespaces"]["net"]), "a stopped pod keeps its namespaces"

    for _ in range(2):  # Remove is idempotent
        await remove_pod(client, pod_id)
    assert [p.id for p in await list_pods(client)] == [other]
    message = await expect_error(pod_status(client, pod_id), "NOT_FOUND")
    assert pod_id[:13] in message
    assert not Path(layout["directory"]).exists()
    await remove_pod(client, other)
    assert pods.leftovers() == []

    # Stop and Remove of a pod that never was succeed; an empty id names the field.
    missing = uuid.uuid4().hex
    await stop_pod(client, missing)
    await remove_pod(client, missing)
    for method in ("StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus"):
        request = getattr(cri, f"{method}Request")(pod_sandbox_id="")
        message = await expect_error(client.call(RUNTIME_SERVICE, method, request), "INVALID_ARGUMENT")
        assert message.startswith("pod_sandbox_id: ")


async def test_bad_requests_name_the_field(pods: Node) -> None:
    client = pods.client
    cases = {
        "config.metadata": cri.PodSandboxConfig(),
        "config.metadata.uid": pod_config("x", uid=""),
        "runtime_handler": pod_config("x"),
        "config.linux.sysctls[kernel.pid_max]": pod_config(
            "x", linux=cri.LinuxPodSandboxConfig(sysctls={"kernel.pid_max": "4096"})
        ),
        "config.linux.cgroup_parent": pod_config(
            "x", linux=cri.LinuxPodSandboxConfig(cgroup_parent="/test.slice")
        ),
        "config.hostname": pod_config("x", hostname="not a hostname"),
        "config.linux.overhead.cpu_quota": pod_config(
            "x", linux=cri.LinuxPodSandboxConfig(overhead=cri.LinuxContainerResources(cpu_quota=999))
        ),
    }
    cases["config.metadata.uid"].metadata.uid = ""  # type: ignore[union-attr]
    for field, config in cases.items():
        handler = "no-such-handler" if field == "runtime_handler" else ""
        message = await expect_error(run_pod(client, config, handler), "INVALID_ARGUMENT")
        assert message.startswith(f"{field}: "), message
    assert await list_pods(client) == [] and pods.leftovers() == []


# -- what a pod is made of ----------------------------------------------------------------------


async def test_a_pod_on_its_own_network_namespaces_files_and_cgroup(pods: Node) -> None:
    client, network = pods.client, pods.network
    host_port = free_port()
    sysctls = {
        "kernel.shm_rmid_forced": "1",
        "fs.mqueue.msg_max": "100",
        "net.ipv4.ip_unprivileged_port_start": "0",
    }
    resources = cri.LinuxContainerResources(
        cpu_period=100_000, cpu_quota=50_000, cpu_shares=1024, memory_limit_in_bytes=64 * MIB
    )
    overhead = cri.LinuxContainerResources(cpu_quota=10_000, memory_limit_in_bytes=16 * MIB)
    config = pod_config(
        "net-pod",
        hostname="test-hostname",
        dns=cri.DnsConfig(servers=["10.10.10.10"], searches=["google.com"], options=["ndots:8"]),
        port_mappings=[
            cri.PortMapping(container_port=POD_PORT, host_port=host_port),
            cri.PortMapping(container_port=80),  # the container's port only: nothing on the host
        ],
        linux=cri.LinuxPodSandboxConfig(sysctls=sysctls, resources=resources, overhead=overhead),
    )
    pod_id = await run_pod(client, config)
    status = (await pod_status(client, pod_id)).status
    assert status is not None and status.network is not None
    ip = status.network.ip
    cell = await cell_of(client, pod_id)
    directory, pins = Path(cell["directory"]), cell["namespaces"]
    assert directory == pods.pods_dir / pod_id
    assert {kind: Path(pins[kind]) for kind in ("net", "ipc", "uts", "pid")} == {
        kind: directory / "ns" / kind for kind in ("net", "ipc", "uts", "pid")
    }

    # The pod's address and its hostPort, reached from the host.
    with listener_in(pins["net"], POD_PORT):
        assert probe(ip, POD_PORT) == f"hello from {network.gateway}"
        assert probe("127.0.0.1", host_port) == f"hello from {network.gateway}"
    # Hostname, sysctls, each in its namespace.
    assert nsenter("uts", pins["uts"], "hostname") == "test-hostname"
    assert nsenter("ipc", pins["ipc"], "cat", "/proc/sys/kernel/shm_rmid_forced") == "1"
    assert nsenter("ipc", pins["ipc"], "cat", "/proc/sys/fs/mqueue/msg_max") == "100"
    assert nsenter("net", pins["net"], "cat", "/proc/sys/net/ipv4/ip_unprivileged_port_start") == "0"
    # The files its containers bind-mount, and /dev/shm.
    assert (directory / "hostname").read_text() == "test-hostname\n"
    resolv = (directory / "resolv.conf").read_text().splitlines()
    assert {"nameserver 10.10.10.10", "search google.com", "options ndots:8"} <= set(resolv)
    hosts = (directory / "hosts").read_text()
    assert hosts.startswith("127.0.0.1\tlocalhost\n") and f"{ip}\ttest-hostname\n" in hosts
    [shm] = shm_mounts(directory)
    assert shm.split()[2] == "tmpfs" and "size=65536k" in shm.split()[3]
    assert (directory / "shm").stat().st_mode & 0o7777 == 0o1777
    # The pod cgroup: resources plus overhead; the PID namespace's init is in its own child (on
    # cgroup v2 a pod cgroup holding a process could not give its containers' cgroups controllers).
    cgroup = f"_pods/{pod_id}"
    assert cell["cgroup"] == cgroup
    assert int((pods.cgroup(cgroup) / "memory.limit_in_bytes").read_text()) == 80 * MIB
    assert int((pods.cgroup(cgroup, "cpu") / "cpu.cfs_quota_us").read_text()) == 60_000
    assert abs(int((pods.cgroup(cgroup, "cpu") / "cpu.shares").read_text()) - 1024) < 32
    init = pins["init_pid"]
    assert (pods.cgroup(cgroup) / "cgroup.procs").read_text().split() == []
    assert (pods.cgroup(f"{cgroup}/_init-{pod_id[:16]}") / "cgroup.procs").read_text().split() == [str(init)]
    assert Path(f"/proc/{init}/cmdline").read_bytes().startswith(b"aurae-pod-init")
    assert os.stat(f"/proc/{init}/ns/pid").st_ino == os.stat(pins["pid"]).st_ino
    nspid = next(
        line for line in Path(f"/proc/{init}/status").read_text().splitlines() if line.startswith("NSpid:")
    )
    assert nspid.split()[1:] == [str(init), "1"], "PID 1 of the pod's PID namespace"

    await remove_pod(client, pod_id)
    assert not os.path.exists(f"/proc/{init}")
    assert pods.leftovers() == []


def pod_limits(pods: Node, cgroup: str) -> tuple[int, int, int, int]:
    """The pod cgroup's memory limit, CFS quota and period, and CPU shares (v1 files)."""
    cpu = pods.cgroup(cgroup, "cpu")
    return (
        int((pods.cgroup(cgroup) / "memory.limit_in_bytes").read_text()),
        int((cpu / "cpu.cfs_quota_us").read_text()),
        int((cpu / "cpu.cfs_period_us").read_text()),
        int((cpu / "cpu.shares").read_text()),
    )


async def resize(
    client: AuraeClient,
    pod_id: str,
    overhead: cri.LinuxContainerResources | None,
    resources: cri.LinuxContainerResources | None,
) -> None:
    request = cri.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod_id, overhead=overhead, resources=resources
    )
    await client.call(RUNTIME_SERVICE, "UpdatePodSandboxResources", request)


async def test_a_resize_changes_the_pod_cgroup(pods: Node) -> None:
    """UpdatePodSandboxResources, as a kubelet resizes a pod in place: the pod cgroup takes the new
    resources plus overhead; a field left 0 keeps its value; verbose status reports them in
    containerd's shape. Bad values change nothing and name the field."""
    client = pods.client
    resources = cri.LinuxContainerResources(
        cpu_period=100_000, cpu_quota=50_000, cpu_shares=1024, memory_limit_in_bytes=64 * MIB
    )
    overhead = cri.LinuxContainerResources(cpu_quota=10_000, memory_limit_in_bytes=16 * MIB)
    pod_id = await run_pod(
        client, pod_config("resized", linux=cri.LinuxPodSandboxConfig(resources=resources, overhead=overhead))
    )
    cgroup = f"_pods/{pod_id}"
    memory, quota, period, shares = pod_limits(pods, cgroup)
    assert (memory, quota, period) == (80 * MIB, 60_000, 100_000) and abs(shares - 1024) < 32

    grown = cri.LinuxContainerResources(
        cpu_period=100_000, cpu_quota=150_000, cpu_shares=512, memory_limit_in_bytes=128 * MIB
    )
    await resize(client, pod_id, cri.LinuxContainerResources(memory_limit_in_bytes=32 * MIB), grown)
    memory, quota, period, shares = pod_limits(pods, cgroup)
    assert (memory, quota, period) == (160 * MIB, 160_000, 100_000) and abs(shares - 512) < 32
    info = verbose(await pod_status(client, pod_id, verbose=True))
    assert info["resources"] == {
        "linux": {
            "cpu_period": 100_000,
            "cpu_quota": 150_000,
            "cpu_shares": 512,
            "memory_limit_in_bytes": 128 * MIB,
        }
    }
    assert info["overhead"] == {  # the quota kept: the update left it 0
        "linux": {"cpu_period": 0, "cpu_quota": 10_000, "cpu_shares": 0, "memory_limit_in_bytes": 32 * MIB}
    }

    # Memory only: the CPU limits stay.
    await resize(client, pod_id, None, cri.LinuxContainerResources(memory_limit_in_bytes=96 * MIB))
    assert pod_limits(pods, cgroup)[:3] == (128 * MIB, 160_000, 100_000)

    before = pod_limits(pods, cgroup)
    bad = {
        "resources.memory_limit_in_bytes": (None, cri.LinuxContainerResources(memory_limit_in_bytes=-1)),
        "overhead.cpu_quota": (cri.LinuxContainerResources(cpu_quota=500), None),
        "resources.cpu_period": (None, cri.LinuxContainerResources(cpu_period=2_000_000)),
    }
    for field, (bad_overhead, bad_resources) in bad.items():
        message = await expect_error(resize(client, pod_id, bad_overhead, bad_resources), "INVALID_ARGUMENT")
        assert message.startswith(f"{field}: "), message
    assert pod_limits(pods, cgroup) == before
    assert (await expect_error(resize(client, "0" * 64, None, grown), "NOT_FOUND")).startswith("pod sandbox")
    assert "pod_sandbox_id" in await expect_error(resize(client, "", None, grown), "INVALID_ARGUMENT")
    await stop_pod(client, pod_id)
    await expect_error(resize(client, pod_id, None, grown), "FAILED_PRECONDITION")
    assert pod_limits(pods, cgroup) == before

    await remove_pod(client, pod_id)
    assert pods.leftovers() == []


async def test_defaults_are_the_hosts_name_and_resolv_conf(pods: Node) -> None:
    pod_id = await run_pod(pods.client, pod_config("plain"))
    cell = await cell_of(pods.client, pod_id)
    directory = Path(cell["directory"])
    assert (directory / "hostname").read_text() == socket.gethostname() + "\n"
    assert nsenter("uts", cell["namespaces"]["uts"], "hostname") == socket.gethostname()
    assert (directory / "resolv.conf").read_text() == Path("/etc/resolv.conf").read_text()
    await remove_pod(pods.client, pod_id)
    assert pods.leftovers() == []


async def test_the_kubelets_cgroup_parent_shared_by_attempts(pods: Node) -> None:
    client = pods.client
    parent = f"kubepods/burstable/pod{uuid.uuid4()}"
    resources = cri.LinuxContainerResources(memory_limit_in_bytes=32 * MIB)
    linux = cri.LinuxPodSandboxConfig(cgroup_parent=f"/{parent}", resources=resources)
    first = await run_pod(client, pod_config("kube", attempt=0, linux=linux))
    second = await run_pod(client, pod_config("kube", attempt=1, linux=linux))
    assert first != second
    assert int((pods.cgroup(parent) / "memory.limit_in_bytes").read_text()) == 32 * MIB
    await remove_pod(client, first)
    assert pods.cgroup(parent).is_dir(), "the other attempt still uses it"
    await remove_pod(client, second)
    assert not pods.cgroup("kubepods").exists() and pods.leftovers() == []


async def test_pods_with_the_hosts_namespaces(pods: Node) -> None:
    client = pods.client
    everything = cri.LinuxPodSandboxConfig(security_context=namespaces(network=NODE, pid=NODE, ipc=NODE))
    host_pod = await run_pod(client, pod_config("host", linux=everything))
    status = (await pod_status(client, host_pod)).status
    assert status is not None and status.state == READY and status.network.ip == ""  # type: ignore[union-attr]
    assert status.linux.namespaces.options == cri.NamespaceOption(network=NODE, pid=NODE, ipc=NODE)  # type: ignore[union-attr]
    cell = await cell_of(client, host_pod)
    directory = Path(cell["directory"])
    assert cell["namespaces"] is None and sorted(p.name for p in directory.iterdir()) == [
        "hostname",
        "hosts",
        "resolv.conf",
    ]
    assert (directory / "hosts").read_text() == Path("/etc/hosts").read_text()
    assert pods.network.allocations() == {}

    # Host network only: the pod's own IPC namespace and /dev/shm, no PID namespace of its own.
    some = cri.LinuxPodSandboxConfig(
        security_context=namespaces(network=NODE, pid=CONTAINER), sysctls={"kernel.shm_rmid_forced": "1"}
    )
    mixed = await run_pod(client, pod_config("mixed", linux=some))
    cell = await cell_of(client, mixed)
    pinned = cell["namespaces"]
    assert (pinned["net"], pinned["uts"], pinned["pid"]) == (None, None, None)
    assert nsenter("ipc", pinned["ipc"], "cat", "/proc/sys/kernel/shm_rmid_forced") == "1"
    assert shm_mounts(Path(cell["directory"]))
    options = (await pod_status(client, mixed)).status.linux.namespaces.options  # type: ignore[union-attr]
    assert options == cri.NamespaceOption(network=NODE, pid=CONTAINER, ipc=POD)

    # A sysctl of a namespace the pod shares with the host would change the host's: refused.
    for name, value in (("net.ipv4.ip_unprivileged_port_start", "0"), ("kernel.domainname", "x")):
        bad = cri.LinuxPodSandboxConfig(security_context=namespaces(network=NODE), sysctls={name: value})
        message = await expect_error(run_pod(client, pod_config("bad", linux=bad)), "INVALID_ARGUMENT")
        assert message.startswith(f"config.linux.sysctls[{name}]: needs the pod's own")
    bad = cri.LinuxPodSandboxConfig(
        security_context=namespaces(ipc=NODE), sysctls={"fs.mqueue.msg_max": "100"}
    )
    await expect_error(run_pod(client, pod_config("bad", linux=bad)), "INVALID_ARGUMENT")
    assert len(await list_pods(client)) == 2
    for pod_id in (host_pod, mixed):
        await remove_pod(client, pod_id)
    assert pods.leftovers() == []


# -- one pod per metadata -------------------------------------------------------------------------


async def test_one_pod_per_metadata(pods: Node) -> None:
    client = pods.client
    config = pod_config("unique", attempt=0, labels={"uniqueness": "yes"})
    first = await run_pod(client, config)
    assert await run_pod(client, config) == first
    await stop_pod(client, first)
    assert await run_pod(client, config) == first, "a stopped pod is still the pod of its metadata"
    next_attempt = await run_pod(client, pod_config("unique", attempt=1, labels={"uniqueness": "yes"}))
    new_uid = await run_pod(client, pod_config("unique", uid="another", attempt=0))
    assert len({first, next_attempt, new_uid}) == 3
    await remove_pod(client, first)
    again = await run_pod(client, config)
    assert again not in (first, next_attempt)
    assert len(await list_pods(client, cri.PodSandboxFilter(label_selector={"uniqueness": "yes"}))) == 2


async def test_concurrent_runs_of_one_metadata_make_one_pod(pods: Node) -> None:
    pods.slow_plugin(0.5)
    config = pod_config("concurrent", attempt=0)
    ids = await asyncio.gather(*(run_pod(pods.client, config, timeout=30) for _ in range(5)))
    assert len(set(ids)) == 1
    assert [p.id for p in await list_pods(pods.client)] == [ids[0]]


async def test_a_run_cut_short_by_its_caller_finishes_into_one_pod(pods: Node) -> None:
    client = pods.client
    pods.slow_plugin(2.0)
    config = pod_config("retried", attempt=0)
    # critest's deadline is 100 ms; a little more here, so that a loaded machine still delivers
    # the call before its deadline (the run must have begun for this test to mean anything).
    await expect_error(run_pod(client, config, timeout=0.5), "DEADLINE_EXCEEDED")
    [listed] = await list_pods(client)
    assert listed.state == NOT_READY, "the run goes on"
    pod_id = await run_pod(client, config, timeout=30)  # the retry gets the run in flight
    assert pod_id == listed.id
    for _ in range(5):
        [listed] = await list_pods(client)
        assert (listed.id, listed.state) == (pod_id, READY)
        await asyncio.sleep(0.2)


# -- failures leave nothing -----------------------------------------------------------------------


async def test_failed_runs_leave_nothing(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    async with node(daemon_factory, tmp_path, conflist=False) as made:
        client, network = made.client, made.network
        message = await expect_error(run_pod(client, pod_config("no-network")), "FAILED_PRECONDITION")
        assert "no CNI network config found" in message
        assert await list_pods(client) == [] and made.leftovers() == []

        # A plugin after bridge and host-local fails: the address they gave is freed again.
        bad = {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.no_such_setting": "1"}}
        network.write(network.conflist(extra=(bad,)))
        with_port = pod_config(
            "cni-fails", port_mappings=[cri.PortMapping(container_port=80, host_port=free_port())]
        )
        message = await expect_error(run_pod(client, with_port), "INTERNAL")
        assert "plugin tuning ADD failed" in message
        assert await list_pods(client) == [] and made.leftovers() == []

        # The kernel refuses a value (shm_rmid_forced is 0 or 1), after the cgroup and pins exist.
        network.write(network.conflist())
        shared = cri.LinuxPodSandboxConfig(sysctls={"kernel.shm_rmid_forced": "5"})
        message = await expect_error(run_pod(client, pod_config("sysctl", linux=shared)), "INVALID_ARGUMENT")
        assert message.startswith("config.linux.sysctls[kernel.shm_rmid_forced]: cannot set '5'")
        assert await list_pods(client) == [] and made.leftovers() == []

        # And the same pod runs once its request is right.
        pod_id = await run_pod(client, pod_config("sysctl"))
        await remove_pod(client, pod_id)
        assert made.leftovers() == []


# -- auraed killed ---------------------------------------------------------------------------------


async def test_pods_outlive_auraed_killed_or_stopped(pods: Node) -> None:
    client = pods.client
    shared = await run_pod(client, pod_config("survivor", hostname="survivor"))
    host = await run_pod(
        pods.client,
        pod_config("host", linux=cri.LinuxPodSandboxConfig(security_context=namespaces(network=NODE))),
    )
    stopped = await run_pod(client, pod_config("stopped"))
    await stop_pod(client, stopped)
    before = {pod_id: (await pod_status(client, pod_id)).status for pod_id in (shared, host, stopped)}
    cell = await cell_of(client, shared)

    pods.daemon.kill9()
    client = await restarted(pods)
    for pod_id, status in before.items():
        assert (await pod_status(client, pod_id)).status == status
    with listener_in(cell["namespaces"]["net"], POD_PORT):
        assert probe(before[shared].network.ip, POD_PORT) == f"hello from {pods.network.gateway}"  # type: ignore[union-attr]
    assert await run_pod(client, pod_config("survivor", hostname="survivor")) == shared

    pods.daemon.stop()  # a graceful stop stops no pod either
    client = await restarted(pods)
    for pod_id, status in before.items():
        assert (await pod_status(client, pod_id)).status == status
    assert os.path.ismount(cell["namespaces"]["net"])

    for pod_id in before:
        await remove_pod(client, pod_id)
    assert pods.leftovers() == []


async def test_a_run_killed_during_its_cni_add_is_undone_at_start(pods: Node) -> None:
    pods.slow_plugin(60)
    run = asyncio.ensure_future(run_pod(pods.client, pod_config("killed", attempt=0), timeout=90))
    await wait_until(pods.slow_plugin_pids, timeout=30)
    assert len(pods.network.allocations()) == 1, "bridge and host-local ran before the slow plugin"
    [pod_id] = pods.network.allocations().values()
    assert (pods.pods_dir / pod_id / "ns" / "net").exists()

    pods.daemon.kill9()
    await expect_error(run, "UNAVAILABLE")
    for pid in pods.slow_plugin_pids():  # the plugin outlives auraed (its own session): end it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pods.network.write(pods.network.conflist())
    assert await list_pods(await restarted(pods)) == []
    assert "finishing its interrupted run" in pods.daemon.log()
    assert pods.leftovers() == []
