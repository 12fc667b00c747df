"""Containers of ``vm`` pods through the kubelet's socket, with a real QEMU guest (TCG here).

One guest is booted for the whole module (a boot costs seconds of TCG), and one test walks what a
kubelet does with a pod's containers: a server and a client sharing the pod network (the client
reaches the server over localhost), their output in the kubelet's log path on the host, status
and stats from the guest, ExecSync, an exec with a terminal over SPDY, port-forward to the
server, host paths mounted from the host (virtio-fs), SupplementalGroupsPolicy, a ``kill -9``
of the host auraed with the logs resumed after it (nothing lost, nothing twice), QEMU killed
under the pod (NOT_READY, its containers EXITED with a reason), then the pod stopped and removed
leaving nothing (the fixture's checks and the leak check).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from auraed.api.aurae.vms import v0 as vms
from auraed.api.runtime import v1 as cri
from auraed.cri.guest_containers import guest_name
from auraed.cri.streaming.client import open_port_forward, open_remote_command, run_remote_command
from tests.integration.test_cri_containers import (
    ATTEMPT,
    EXITED,
    MIB,
    RUNNING,
    Node,
    cri_error,
    log_records,
    stdout_lines,
)
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.integration.test_cri_streaming_rpcs import read_until
from tests.integration.vm_pods_helpers import VMS, cgroups_of, in_share_namespace, qemu_of, vm_node_fixture
from tests.support.cni import free_port, probe
from tests.support.cri import (
    PREDEFINED_GROUP_IMAGE,
    cri_client,
    pod_config,
    pod_status,
    predefined_group_image,
    publish,
    pull_image,
    run_pod,
    supplemental_groups_cases,
)
from tests.support.registry import LocalRegistry

mirror = busybox_mirror  # the registry fixture, used by name

BOOT_TIMEOUT = 300.0
TIMEOUT = 120.0
PARTIAL_WAIT = 10.0
"""Seconds for output with no newline to reach an attached client through the guest's log, its
copy on the host and the host's follower, under TCG on a loaded machine (critest waits 60 s)."""
PORT = 8080
GREETING = "hello from the pod"
POD_DNS = "10.96.0.10"
POD_SYSCTLS = {"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100"}
SERVE = ["sh", "-c", f"echo serving; while true; do echo '{GREETING}' | nc -l -p {PORT}; done"]
REACH = ["sh", "-c", f"until nc 127.0.0.1 {PORT}; do sleep 0.5; done"]
TICK = ["sh", "-c", "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"]


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        outcome = check()
        if await outcome if isinstance(outcome, Awaitable) else outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.2)


# q35, whose guests can grow (microvm's cannot: test_cri_vm_pods checks the refusal).
vm_node = vm_node_fixture("--vm-machine", "q35")


def test_a_cri_name_becomes_a_dns_label_in_the_guest() -> None:
    assert guest_name("web_mypod_default_0123-uid_2") == "web-2"
    assert guest_name("Big.Name_pod_ns_uid_0") == "big-name-0"
    assert guest_name("___") == "container"
    assert len(guest_name("x" * 200 + "_p_n_u_1")) == 63


@dataclass
class VmPod:
    """A running vm pod, its log directory on the host, and how to make containers in it."""

    node: Node
    pod_id: str
    config: cri.PodSandboxConfig
    logs: Path

    async def create(self, name: str, command: list[str], **fields: Any) -> str:
        # What a kubelet gives a BestEffort pod's container on any node, cgroup v2 or not.
        fields.setdefault(
            "linux", cri.LinuxContainerConfig(resources=cri.LinuxContainerResources(cpu_shares=2))
        )
        request = cri.CreateContainerRequest(
            pod_sandbox_id=self.pod_id,
            config=self.node.config(name, command, log=True, **fields),
            sandbox_config=self.config,
        )
        reply = await self.node.call("CreateContainer", request, BOOT_TIMEOUT)
        return str(reply.container_id)

    async def run(self, name: str, command: list[str]) -> str:
        container_id = await self.create(name, command)
        await self.node.start(container_id)
        return container_id

    def lines(self, name: str) -> list[str]:
        path = self.logs / f"{name}.log"
        return stdout_lines(path) if path.exists() else []


async def test_a_vm_pods_containers_run_in_its_guest(
    vm_node: Node, mirror: LocalRegistry, tmp_path: Path
) -> None:
    logs = vm_node.log_root / "vm-pod"
    logs.mkdir(parents=True, mode=0o777)
    host_port = free_port()
    config = pod_config(
        "vm-pod",
        namespace="vm-pods",
        hostname="vm-pod-host",
        dns=cri.DnsConfig(servers=[POD_DNS], searches=["vm-pods.svc.example"], options=["ndots:5"]),
        port_mappings=[cri.PortMapping(container_port=PORT, host_port=host_port)],
        # critest's safe and unsafe sysctls: namespaced, so the guest's own (its IPC namespace).
        linux=cri.LinuxPodSandboxConfig(sysctls=POD_SYSCTLS),
    )
    config.log_directory = str(logs)
    pod_id = await asyncio.wait_for(run_pod(vm_node.client, config, "vm"), BOOT_TIMEOUT)
    pod = VmPod(vm_node, pod_id, config, logs)
    server = await a_server_and_its_client_share_the_pod_network(pod)
    await the_pods_files_and_host_port_reach_the_guest(pod, server, host_port)
    await the_pod_cgroup_holds_its_vm(pod, server)
    await exec_runs_in_the_guest(pod, server)
    await the_pod_init_shows_nothing_of_the_guest(pod)
    await resources_update_in_the_guest(pod, server)
    await the_guest_grows_with_its_pod(pod, server)
    await stats_and_port_forward(pod, server)
    await host_paths_reach_the_guest(pod, tmp_path)
    await security_and_namespaces_reach_the_guest(pod, tmp_path)
    await supplemental_groups_in_the_guest(pod, mirror, tmp_path / "groups-image")
    await attach_writes_to_a_guest_containers_stdin(pod)
    await the_logs_resume_after_kill_9(pod, server)
    await a_dead_guest_ends_its_pod(pod, server)


async def a_server_and_its_client_share_the_pod_network(pod: VmPod) -> str:
    node = pod.node
    server = await pod.run("server", SERVE)
    client = await pod.run("client", REACH)
    await node.wait_state(client, EXITED, TIMEOUT)
    status = await node.status(client)
    assert status.exit_code == 0 and status.metadata.attempt == ATTEMPT
    assert status.log_path == str(pod.logs / "client.log")
    await eventually(lambda: GREETING in pod.lines("client"))
    await eventually(lambda: "serving" in pod.lines("server"))
    assert (await node.status(server)).state == RUNNING
    assert {c.id for c in await node.containers(pod_sandbox_id=pod.pod_id)} == {server, client}
    return server


async def the_pods_files_and_host_port_reach_the_guest(pod: VmPod, server: str, host_port: int) -> None:
    """The pod's /etc/resolv.conf (its DNS config), /etc/hosts and /etc/hostname are the
    container's in the guest, as a cell pod's containers have them; its hostPort, from the host."""
    node = pod.node
    resolv = (await node.exec_sync(server, ["cat", "/etc/resolv.conf"])).stdout.decode().splitlines()
    assert {f"nameserver {POD_DNS}", "search vm-pods.svc.example", "options ndots:5"} <= set(resolv)
    # cpu_shares 2 (the kubelet's BestEffort share) is cpu.weight 1 on the guest's cgroup v2.
    weight = await node.exec_sync(server, ["cat", "/sys/fs/cgroup/cpu.weight"])
    assert (weight.exit_code, weight.stdout) == (0, b"1\n"), weight
    hosts = (await node.exec_sync(server, ["cat", "/etc/hosts"])).stdout.decode()
    assert "127.0.0.1\tlocalhost" in hosts or "127.0.0.1 localhost" in hosts, hosts
    hostname = await node.exec_sync(server, ["cat", "/etc/hostname"])
    assert hostname.stdout == b"vm-pod-host\n"
    # The pod's sysctls, in the guest's IPC namespace the containers share (crun refused them in
    # each container's spec: "requires a new IPC namespace").
    read = await node.exec_sync(
        server, ["cat", "/proc/sys/kernel/shm_rmid_forced", "/proc/sys/fs/mqueue/msg_max"]
    )
    assert read.stdout.decode().split() == [
        POD_SYSCTLS["kernel.shm_rmid_forced"],
        POD_SYSCTLS["fs.mqueue.msg_max"],
    ]
    assert await asyncio.to_thread(probe, "127.0.0.1", host_port) == f"{GREETING}\n"


async def the_pod_cgroup_holds_its_vm(pod: VmPod, server: str) -> None:
    """QEMU and virtiofsd run in a cgroup below the pod's: the pod's stats on the host are its
    whole VM's; its containers' metrics come from the guest."""
    node = pod.node
    vm = f"pod-{pod.pod_id[:16]}"
    for pattern in (f"qemu-system.*{vm}", f"virtiofsd.*{pod.pod_id}"):
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=True)
        for pid in found.stdout.split():
            # On a hybrid host each hierarchy has its own line; the pod's cgroup is in one.
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            assert any(line.endswith(f"/{pod.pod_id}/vmm") for line in lines), (pattern, lines)
    request = cri.PodSandboxStatsRequest(pod_sandbox_id=pod.pod_id)
    stats = (await node.call("PodSandboxStats", request)).stats
    assert stats is not None and stats.linux is not None
    container = next(c for c in stats.linux.containers if c.attributes.id == server)
    # The VM's memory (its RAM as the guest touched it, QEMU's own) is the pod's: more than any
    # container in it uses.
    vm_memory = stats.linux.memory.working_set_bytes.value
    assert vm_memory > container.memory.working_set_bytes.value > 0
    assert stats.linux.cpu.usage_core_nano_seconds.value > 0

    metrics = (await node.call("ListPodSandboxMetrics", cri.ListPodSandboxMetricsRequest())).pod_metrics
    ours = next(m for m in metrics if m.pod_sandbox_id == pod.pod_id)
    assert any(m.name == "container_memory_working_set_bytes" for m in ours.metrics)
    of_server = next(c for c in ours.container_metrics if c.container_id == server)
    names = {m.name: m.value.value for m in of_server.metrics if m.value is not None}
    assert names["container_memory_working_set_bytes"] > 0 and "container_cpu_usage_seconds_total" in names


async def exec_runs_in_the_guest(pod: VmPod, server: str) -> None:
    """ExecSync with the pod's hostname and exit codes as results; an exec with a terminal over
    SPDY, resized; a plain one."""
    node = pod.node
    hostname = await node.exec_sync(server, ["hostname"])
    assert (hostname.exit_code, hostname.stdout) == (0, b"vm-pod-host\n")
    # The pod shares a PID namespace (the CRI's default): one the guest made for it, whose PID 1
    # is the pod's init, never the guest's auraed.
    processes = (await node.exec_sync(server, ["ps", "-o", "pid,args"])).stdout.decode()
    assert "aurae-pod-init" in processes and "auraed" not in processes.replace("aurae-pod-init", "")
    assert "nc -l" in processes
    failed = await node.exec_sync(server, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (failed.exit_code, failed.stdout, failed.stderr) == (3, b"out\n", b"err\n")

    sized = cri.ExecRequest(
        container_id=server, cmd=["sh", "-c", "read l; stty size"], stdin=True, stdout=True, tty=True
    )
    command = await open_remote_command((await node.call("Exec", sized)).url, stdin=True, stdout=True,
                                        stderr=False, tty=True)  # fmt: skip
    try:
        await command.resize(width=132, height=43)
        await asyncio.sleep(0.5)  # the resize stream and stdin are separate: let it land first
        await command.write_stdin(b"go\r")
        seen = b""
        async with asyncio.timeout(TIMEOUT):
            while b"43 132" not in seen:
                chunk = await command.read_stdout()
                assert chunk, seen
                seen += chunk
        assert (await command.collect()).exit_code == 0
    finally:
        await command.close()
    plain = cri.ExecRequest(container_id=server, cmd=["echo", "hi"], stdout=True, stderr=True)
    result = await run_remote_command((await node.call("Exec", plain)).url)
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"hi\n", b"")


async def resources_update_in_the_guest(pod: VmPod, server: str) -> None:
    """UpdateContainerResources reaches the container's cgroup in the guest (cgroup v2 there)."""
    node = pod.node
    update = cri.LinuxContainerResources(
        cpu_quota=50_000, cpu_period=100_000, memory_limit_in_bytes=128 * MIB
    )
    await node.call(
        "UpdateContainerResources", cri.UpdateContainerResourcesRequest(container_id=server, linux=update)
    )
    limits = await node.exec_sync(server, ["cat", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/cpu.max"])
    assert limits.stdout.decode().split() == [str(128 * MIB), "50000", "100000"], limits
    too_small = cri.UpdateContainerResourcesRequest(
        container_id=server, linux=cri.LinuxContainerResources(memory_limit_in_bytes=1024)
    )
    error = await cri_error(node.call("UpdateContainerResources", too_small))
    assert error.code == "INVALID_ARGUMENT" and "memory_max" in error.message, error


async def the_guest_grows_with_its_pod(pod: VmPod, server: str) -> None:
    """UpdatePodSandboxResources asking for more than the guest has grows it (vCPU and memory
    hotplug on q35, onlined in the guest): its containers see the CPUs and memory; the pod
    cgroup on the host takes the new limits; asking for less shrinks nothing."""
    node = pod.node
    vm = f"pod-{pod.pod_id[:16]}"
    before = (await node.exec_sync(server, ["grep", "MemTotal", "/proc/meminfo"])).stdout.split()[1]
    grown = cri.LinuxContainerResources(
        cpu_quota=200_000, cpu_period=100_000, memory_limit_in_bytes=640 * MIB
    )
    request = cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod.pod_id, resources=grown)
    await node.call("UpdatePodSandboxResources", request, BOOT_TIMEOUT)
    async with node.daemon.client() as aurae:
        (listed,) = (await aurae.call(VMS, "List", vms.VmServiceListRequest(name=vm))).vms
    assert listed.vm is not None and (listed.vm.vcpus, listed.vm.memory_mib) == (2, 896), listed.vm
    assert (await node.exec_sync(server, ["nproc"])).stdout == b"2\n"
    after = (await node.exec_sync(server, ["grep", "MemTotal", "/proc/meminfo"])).stdout.split()[1]
    assert int(after) - int(before) >= (896 - 512) * 1024, (before, after)
    limits = [
        Path(c) / f
        for c in cgroups_of(node.daemon, pod.pod_id)
        for f in ("memory.limit_in_bytes", "memory.max")
    ]
    # The VM's own memory (the guest's 256 MiB and its QEMU's 160) above the containers': the
    # pod declared no overhead, and a limit of 640 MiB would have the host OOM-kill its QEMU.
    wanted = str((640 + 256 + 160) * MIB)
    assert any(f.exists() and f.read_text().strip() == wanted for f in limits), limits
    assert "below the 416 MiB its VM takes" in node.daemon.log()
    smaller = cri.LinuxContainerResources(memory_limit_in_bytes=600 * MIB)
    await node.call(
        "UpdatePodSandboxResources",
        cri.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod.pod_id, resources=smaller),
    )
    async with node.daemon.client() as aurae:
        (listed,) = (await aurae.call(VMS, "List", vms.VmServiceListRequest(name=vm))).vms
    assert listed.vm is not None and listed.vm.memory_mib == 896


async def the_pod_init_shows_nothing_of_the_guest(pod: VmPod) -> None:
    """The attack of issue 33 in a guest: a container with CAP_SYS_PTRACE reaching the pod's
    init through /proc/1 found the guest's root there (/etc/aurae/pki/server.key). It must find
    an empty root, no descriptor of a file, no environment, no capabilities."""
    node = pod.node
    context = cri.LinuxContainerSecurityContext(
        capabilities=cri.Capability(add_capabilities=["SYS_PTRACE"]),
        seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfileProfileType.RuntimeDefault),
    )
    linux = cri.LinuxContainerConfig(
        resources=cri.LinuxContainerResources(cpu_shares=2), security_context=context
    )
    debugger = await pod.create("debugger", ["sleep", "600"], linux=linux)
    await node.start(debugger)
    await node.wait_state(debugger, RUNNING, TIMEOUT)

    async def shell(script: str) -> tuple[int, str]:
        reply = await node.exec_sync(debugger, ["sh", "-c", script])
        return reply.exit_code, reply.stdout.decode()

    assert await shell("cat /proc/1/comm; ls -A /proc/1/root/ /proc/1/cwd/") == (
        0,
        "aurae-pod-init\n/proc/1/cwd/:\naurae-pod-init\n\n/proc/1/root/:\naurae-pod-init\n",
    )
    code, out = await shell("cat /proc/1/root/etc/aurae/pki/server.key")
    assert code != 0 and "PRIVATE KEY" not in out
    assert (await shell("echo x > /proc/1/root/written"))[0] != 0
    assert await shell("for fd in /proc/1/fd/*; do readlink $fd; done") == (0, "anon_inode:[signalfd]\n")
    assert await shell("wc -c < /proc/1/environ") == (0, "0\n")
    assert await shell("grep -E '^(CapEff|CapBnd|NoNewPrivs|Uid)' /proc/1/status") == (
        0,
        "Uid:\t65535\t65535\t65535\t65535\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\n"
        "NoNewPrivs:\t1\n",
    )
    await node.stop(debugger)
    await node.remove(debugger)


async def stats_and_port_forward(pod: VmPod, server: str) -> None:
    """Stats from the guest's cgroups; port-forward reaches the server at the pod's address."""
    node = pod.node
    stats = (await node.call("ContainerStats", cri.ContainerStatsRequest(container_id=server))).stats
    assert stats.cpu.usage_core_nano_seconds.value > 0 and stats.memory.working_set_bytes.value > 0
    url = (await node.call("PortForward", cri.PortForwardRequest(pod_sandbox_id=pod.pod_id))).url
    forward = await open_port_forward(url)
    try:
        connection = await forward.connect(PORT)
        received = b""
        async with asyncio.timeout(TIMEOUT):
            while chunk := await connection.read():
                received += chunk
        assert received == f"{GREETING}\n".encode()
        await connection.close()
    finally:
        await forward.close()


async def security_and_namespaces_reach_the_guest(pod: VmPod, tmp_path: Path) -> None:
    """Empty masked and read-only path lists (the defaults), a Localhost seccomp profile (a file
    on the host, read there), a container in another's PID namespace (TARGET, as the kubelet's
    ephemeral containers), and the writable layer the guest measures in ContainerStats."""
    node = pod.node

    def linux(**context: Any) -> cri.LinuxContainerConfig:
        return cri.LinuxContainerConfig(
            resources=cri.LinuxContainerResources(cpu_shares=2),
            security_context=cri.LinuxContainerSecurityContext(**context),
        )

    alone_ns = cri.NamespaceOption(pid=cri.NamespaceMode.CONTAINER)
    alone = await pod.create("alone", ["sleep", "600"], linux=linux(namespace_options=alone_ns))
    await node.start(alone)
    # Its empty masked and read-only path lists are the defaults in the guest too, not none.
    timers = await node.exec_sync(alone, ["cat", "/proc/timer_list"])
    assert (timers.exit_code, timers.stdout) == (0, b""), timers
    written = await node.exec_sync(alone, ["sh", "-c", "echo attacker > /proc/sys/kernel/domainname"])
    assert written.exit_code != 0 and b"Read-only file system" in written.stderr, written
    targeting = cri.NamespaceOption(pid=cri.NamespaceMode.TARGET, target_id=alone)
    joiner = await pod.create("joiner", ["ps", "-o", "args"], linux=linux(namespace_options=targeting))
    await node.start(joiner)
    await node.wait_state(joiner, EXITED, TIMEOUT)
    await eventually(lambda: "sleep 600" in pod.lines("joiner"))
    assert not any("nc -l" in line for line in pod.lines("joiner"))  # not the pod's namespace
    profile = tmp_path / "no-mkdir.json"
    denied = [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]
    profile.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": denied}))
    localhost = cri.SecurityProfile(
        profile_type=cri.SecurityProfileProfileType.Localhost, localhost_ref=str(profile)
    )
    command = ["sh", "-c", "mkdir /made && echo made || echo refused"]
    filtered = await pod.create("filtered", command, linux=linux(seccomp=localhost))
    await node.start(filtered)
    await node.wait_state(filtered, EXITED, TIMEOUT)
    await eventually(lambda: pod.lines("filtered") == ["refused"])
    written = await node.exec_sync(alone, ["sh", "-c", "head -c 262144 /dev/zero > /written"])
    assert written.exit_code == 0, written
    stats = (await node.call("ContainerStats", cri.ContainerStatsRequest(container_id=alone))).stats
    assert stats.writable_layer.used_bytes.value >= 262144 and stats.writable_layer.inodes_used.value >= 1
    assert stats.writable_layer.fs_id.mountpoint.endswith("/upper")  # the layer in the guest
    # The daemon logs at DEBUG here; pyroute2 (the pod's tap) would log every netlink message whole.
    assert "DEBUG pyroute2" not in node.daemon.log()
    for container in (alone, joiner, filtered):
        await node.stop(container)
        await node.remove(container)


async def supplemental_groups_in_the_guest(pod: VmPod, registry: LocalRegistry, workdir: Path) -> None:
    """critest's SupplementalGroupsPolicy specs in a guest, which reads the image's /etc/group:
    Merge adds the user's group there to the pod's, Strict does not; the guest's status carries
    the ids the process runs with to ContainerStatus on the host."""
    node = pod.node
    publish(predefined_group_image(workdir), registry, PREDEFINED_GROUP_IMAGE)
    await pull_image(node.client, PREDEFINED_GROUP_IMAGE)
    for case in supplemental_groups_cases():
        linux = cri.LinuxContainerConfig(
            resources=cri.LinuxContainerResources(cpu_shares=2), security_context=case.context
        )
        config = replace(
            node.config(case.name, ["sh", "-c", "id -G; sleep 600"], log=True, linux=linux),
            image=cri.ImageSpec(image=PREDEFINED_GROUP_IMAGE),
        )
        request = cri.CreateContainerRequest(
            pod_sandbox_id=pod.pod_id, config=config, sandbox_config=pod.config
        )
        container = (await node.call("CreateContainer", request, BOOT_TIMEOUT)).container_id
        await node.start(container)
        status = await node.wait_state(container, RUNNING, TIMEOUT)
        assert case.reported(status), status
        log_shows = functools.partial(lambda name, shown: pod.lines(name) == [shown], case.name, case.shown)
        await eventually(log_shows)
        assert (await node.exec_sync(container, ["id", "-G"])).stdout == f"{case.shown}\n".encode()
        await node.stop(container)
        await node.remove(container)


async def host_paths_reach_the_guest(pod: VmPod, tmp_path: Path) -> None:
    """Host paths mounted into a container in the guest (virtio-fs): read and written, a read-only
    one refused writes, a single file, and a change on the host seen in the guest at once."""
    node = pod.node
    data, locked = tmp_path / "data", tmp_path / "locked"
    data.mkdir()
    locked.mkdir()
    (data / "in.txt").write_text("from the host\n")
    (locked / "keep.txt").write_text("keep\n")
    greeting = tmp_path / "greeting"
    greeting.write_text("a single file\n")
    script = (
        "cat /data/in.txt; echo from the guest > /data/out.txt; cat /etc/greeting; "
        "if echo x > /locked/x 2>/dev/null; then echo locked-written; else echo locked-refused; fi; "
        "sleep 3600"
    )
    mounts = [
        cri.Mount(container_path="/data", host_path=str(data)),
        cri.Mount(container_path="/locked", host_path=str(locked), readonly=True),
        cri.Mount(container_path="/etc/greeting", host_path=str(greeting), readonly=True),
    ]
    volume = await pod.create("volume", ["sh", "-c", script], mounts=mounts)
    await node.start(volume)
    await eventually(lambda: "locked-refused" in pod.lines("volume"))
    assert pod.lines("volume") == ["from the host", "a single file", "locked-refused"]
    assert (data / "out.txt").read_text() == "from the guest\n"
    assert sorted(p.name for p in locked.iterdir()) == ["keep.txt"]
    (data / "in.txt").write_text("changed on the host\n")  # as a configMap's update
    assert (await node.exec_sync(volume, ["cat", "/data/in.txt"])).stdout == b"changed on the host\n"
    share = node.daemon.root / "run" / "pod-shares" / pod.pod_id
    keys = in_share_namespace(share, "ls", str(share / "share")).split()
    assert len(keys) == 3  # each container's binds under one key: the server's, the client's, this
    await node.stop(volume)
    await node.remove(volume)
    assert len(in_share_namespace(share, "ls", str(share / "share")).split()) == 2
    assert (data / "in.txt").exists() and (locked / "keep.txt").exists()  # released, not removed


async def attach_writes_to_a_guest_containers_stdin(pod: VmPod) -> None:
    """critest's attach spec on a guest's container: a shell with stdin and stdin_once, what the
    client types reaches its stdin, and its answer comes back (from the host's copy of its log)
    as it is written: exactly ``hello`` for ``echo -n hello``, while stdin is still open. The
    host's log holds that as a P record, completed by the next line's F. The end of the client's
    input closes the container's stdin: it reads EOF and exits, and the attach ends with it."""
    node = pod.node
    attached = await pod.create("attached", ["sh"], stdin=True, stdin_once=True)
    await node.start(attached)
    request = cri.AttachRequest(container_id=attached, stdin=True, stdout=True, stderr=True)
    command = await open_remote_command((await node.call("Attach", request)).url, stdin=True)
    try:
        await command.write_stdin(b"echo -n hello\n")
        assert await read_until(command, b"hello", PARTIAL_WAIT) == b"hello"
        await command.write_stdin(b"echo ' world'\n")
        assert await read_until(command, b" world\n", TIMEOUT) == b" world\n"
        await command.close_stdin()
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert (result.exit_code, result.stdout) == (0, b"")
    await node.wait_state(attached, EXITED, TIMEOUT)
    assert (await node.status(attached)).exit_code == 0
    records = log_records(pod.logs / "attached.log")
    assert [(stream, tag, content) for _, stream, tag, content in records] == [
        ("stdout", "P", "hello"),
        ("stdout", "F", " world"),
    ]
    await node.remove(attached)


async def the_logs_resume_after_kill_9(pod: VmPod, server: str) -> None:
    """The host auraed killed and started again: the containers are found again, the log's copy
    resumes where it was, no line lost and none twice; then stop and remove."""
    node = pod.node
    ticker = await pod.run("ticker", TICK)
    await eventually(lambda: len(pod.lines("ticker")) >= 3)
    node.daemon.kill9()
    await asyncio.sleep(2)  # the guest's container ticks on meanwhile
    node.daemon.start()
    await node.client.close()
    node.client = cri_client(node.daemon)
    assert (await node.status(ticker)).state == RUNNING
    before = len(pod.lines("ticker"))
    await eventually(lambda: len(pod.lines("ticker")) >= before + 15)
    lines = pod.lines("ticker")
    assert lines == [f"tick {i}" for i in range(len(lines))]
    assert (await node.exec_sync(server, ["echo", "-n", "still here"])).stdout == b"still here"
    info = json.loads((await node.status_reply(server, verbose=True)).info["info"])
    assert info["pid"] > 0
    # The new daemon binds in the pod's share, in the mount namespace it finds pinned.
    after = await pod.run("after-restart", ["cat", "/etc/hostname"])
    await node.wait_state(after, EXITED, TIMEOUT)
    assert pod.lines("after-restart") == ["vm-pod-host"]
    await node.remove(after)

    # Stop ends the process in the guest; remove forgets it; the log stays for the kubelet.
    await node.stop(ticker)
    stopped = await node.status(ticker)
    assert (stopped.state, stopped.exit_code) == (EXITED, 137)
    await node.remove(ticker)
    assert (pod.logs / "ticker.log").exists()
    assert ticker not in {c.id for c in await node.containers()}


async def a_dead_guest_ends_its_pod(pod: VmPod, server: str) -> None:
    """QEMU killed under the pod: the pod is NOT_READY, its container EXITED with the guest's end
    as its reason; the kubelet's stop and remove then work as for any pod (the fixture's)."""
    node = pod.node
    vm = f"pod-{pod.pod_id[:16]}"
    for pid in qemu_of(vm):
        os.kill(pid, signal.SIGKILL)

    async def not_ready() -> bool:
        status = (await pod_status(node.client, pod.pod_id)).status
        return status is not None and status.state == cri.PodSandboxState.SANDBOX_NOTREADY

    await eventually(not_ready)
    ended = await node.wait_state(server, EXITED, TIMEOUT)
    assert "guest VM" in ended.message or "guest VM" in ended.reason, ended
