"""CRI containers in cell pods through the kubelet's socket, as critest and a kubelet use them:
CreateContainer, StartContainer, StopContainer, RemoveContainer, ListContainers,
StreamContainers, ContainerStatus, UpdateContainerResources, ReopenContainerLog, ExecSync,
container and pod stats, the pods' and containers' metrics (ListMetricDescriptors,
ListPodSandboxMetrics, StreamPodSandboxMetrics), GetContainerEvents and PodSandboxStatus's
containers; and a daemon killed with -9 finding them again.

Each daemon has a private CNI network (tests.support.cni) and critest's busybox image from a
local registry that mirrors registry.k8s.io. The test image is Debian's busybox-static, which
has no ``pgrep``: critest's check that a timed-out exec was killed is made with ``pidof``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient, ClientError
from auraed.cri.containers import EXEC_OUTPUT_MAX
from auraed.cri.streaming.client import open_port_forward
from auraed.system import processes
from auraed.system.cri_log import parse_rfc3339_ns
from auraed.system.mount_api import mounts_below
from auraed.system.userns import DEFAULT_USERNS_ROOTFS_DIR
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.support.cni import CniNetwork, cni_network, free_port
from tests.support.cri import (
    BUSYBOX_IMAGE,
    CALL_TIMEOUT,
    IMAGE_SERVICE,
    PREDEFINED_GROUP_IMAGE,
    RUNTIME_SERVICE,
    TEST_IMAGES,
    cri_client,
    list_pods,
    mirrors_config,
    namespaces,
    pod_config,
    pod_status,
    predefined_group_image,
    publish,
    pull_image,
    remove_pod,
    run_pod,
    stop_pod,
    supplemental_groups_cases,
)
from tests.support.images import BuiltImage, build_multilayer_layout
from tests.support.registry import LocalRegistry

CREATED = cri.ContainerState.CONTAINER_CREATED
RUNNING = cri.ContainerState.CONTAINER_RUNNING
EXITED = cri.ContainerState.CONTAINER_EXITED
ATTEMPT = 2  # critest's DefaultAttempt
CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1024 * 1024
TOP = ["top"]
LOOP_LOG = ["sh", "-c", "while true; do echo hello World; sleep 0.2; done"]
IGNORES_TERM = ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"]
ATTRIBUTES = {
    "foo": "bar",
    "io.kubernetes.container.name": "preserved",
    "io.kubernetes.pod.name": "fake-pod-name",
    "io.kubernetes.pod.namespace": "fake-pod-namespace",
    "io.kubernetes.pod.uid": "fake-pod-uid",
}
BIG_RECEIVE = [("grpc.max_receive_message_length", 32 * MIB)]


@pytest.fixture(scope="module")
def mirror(busybox_layout: BuiltImage) -> Iterator[LocalRegistry]:
    """A registry serving critest's busybox as the mirror of registry.k8s.io."""
    with LocalRegistry() as registry:
        publish(busybox_layout, registry, BUSYBOX_IMAGE)
        yield registry


@dataclass
class Node:
    """A daemon with its own CNI network and busybox pulled, and a client on its CRI socket."""

    daemon: DaemonProcess
    network: CniNetwork
    client: AuraeClient
    image_id: str
    log_root: Path

    async def call(self, method: str, request: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return await self.client.call(RUNTIME_SERVICE, method, request, timeout)

    async def stream(self, method: str, request: Any) -> list[Any]:
        return [reply async for reply in self.client.stream(RUNTIME_SERVICE, method, request, CALL_TIMEOUT)]

    # -- pods --------------------------------------------------------------------------------

    async def run_pod(
        self, name: str, *, log_directory: bool = False, labels: dict[str, str] | None = None
    ) -> str:
        """A pod as critest's helpers make one, with a log directory of its own under log_root
        when asked."""
        config = pod_config(name, namespace="critest", labels=labels)
        if log_directory:
            path = self.log_root / name
            path.mkdir(mode=0o777, parents=True)
            config.log_directory = str(path)
        return await run_pod(self.client, config)

    async def stop_pod(self, pod_id: str) -> None:
        await stop_pod(self.client, pod_id)

    async def remove_pod(self, pod_id: str) -> None:
        await remove_pod(self.client, pod_id)

    async def pod_ids(self) -> list[str]:
        return [pod.id for pod in await list_pods(self.client)]

    # -- containers --------------------------------------------------------------------------

    def config(
        self,
        name: str,
        command: list[str] | None = None,
        *,
        args: list[str] | None = None,
        log: bool = False,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        linux: cri.LinuxContainerConfig | None = None,
        **fields: Any,
    ) -> cri.ContainerConfig:
        """critest's container config: the image by id with the name the user gave, attempt 2."""
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=ATTEMPT),
            image=cri.ImageSpec(image=self.image_id, user_specified_image=BUSYBOX_IMAGE),
            command=command or [],
            args=args or [],
            log_path=f"{name}.log" if log else "",
            labels=labels or {},
            annotations=annotations or {},
            linux=linux,
            **fields,
        )

    async def create(self, pod_id: str, config: cri.ContainerConfig) -> str:
        request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
        container_id: str = (await self.call("CreateContainer", request)).container_id
        assert container_id
        return container_id

    async def start(self, container_id: str) -> None:
        await self.call("StartContainer", cri.StartContainerRequest(container_id=container_id))

    async def run(self, pod_id: str, config: cri.ContainerConfig) -> str:
        container_id = await self.create(pod_id, config)
        await self.start(container_id)
        return container_id

    async def stop(self, container_id: str, timeout: int = 0) -> None:
        await self.call("StopContainer", cri.StopContainerRequest(container_id=container_id, timeout=timeout))

    async def remove(self, container_id: str) -> None:
        await self.call("RemoveContainer", cri.RemoveContainerRequest(container_id=container_id))

    async def status_reply(self, container_id: str, verbose: bool = False) -> Any:
        return await self.call(
            "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id, verbose=verbose)
        )

    async def status(self, container_id: str) -> Any:
        status = (await self.status_reply(container_id)).status
        # What cri-client checks of every ContainerStatus before a test sees it.
        assert status.id and status.metadata.name and status.created_at
        assert status.image.image and status.image_ref
        return status

    async def containers(self, **filter_fields: Any) -> list[Any]:
        container_filter = cri.ContainerFilter(**filter_fields) if filter_fields else None
        listed: list[Any] = (
            await self.call("ListContainers", cri.ListContainersRequest(filter=container_filter))
        ).containers
        streamed = [
            c
            for reply in await self.stream(
                "StreamContainers", cri.StreamContainersRequest(filter=container_filter)
            )
            for c in reply.containers
        ]
        assert [c.id for c in streamed] == [c.id for c in listed]
        return listed

    async def ids(self, **filter_fields: Any) -> list[str]:
        return [c.id for c in await self.containers(**filter_fields)]

    async def wait_state(self, container_id: str, state: cri.ContainerState, timeout: float = 60) -> Any:
        async def reached() -> bool:
            return (await self.status(container_id)).state == state

        await eventually(reached, timeout)
        return await self.status(container_id)

    async def exec_sync(self, container_id: str, cmd: list[str], timeout: int = 30) -> cri.ExecSyncResponse:
        request = cri.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=timeout)
        reply: cri.ExecSyncResponse = await self.call("ExecSync", request, CALL_TIMEOUT + timeout)
        return reply


@pytest.fixture
async def node(daemon_factory: DaemonFactory, mirror: LocalRegistry, tmp_path: Path) -> AsyncIterator[Node]:
    with cni_network(tmp_path) as network:
        network.write(network.conflist())
        daemon = daemon_factory("--cni-conf-dir", str(network.conf_dir), config_text=mirrors_config(mirror))
        found = Node(daemon, network, cri_client(daemon), "", tmp_path / "logs")
        try:
            found.image_id = await pull_image(found.client, BUSYBOX_IMAGE)
            yield found
            # As critest's AfterEach: stop and remove every pod, which takes its containers.
            for pod_id in await found.pod_ids():
                await found.stop_pod(pod_id)
                await found.remove_pod(pod_id)
            assert await found.containers() == []
        finally:
            await found.client.close()  # the test's last client (a restart makes a new one)
        assert leftover_cgroups(daemon) == []


def leftover_cgroups(daemon: DaemonProcess) -> list[str]:
    found = []
    for hierarchy in CGROUP_ROOT.iterdir():
        base = hierarchy / daemon.cgroup_base
        if base.is_dir():
            found += [str(p) for p in base.rglob("*") if p.is_dir()]
    return found


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 60, interval: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def cri_error(call: Awaitable[object]) -> ClientError:
    with pytest.raises(ClientError) as error:
        await call
    return error.value


def container_cgroup(daemon: DaemonProcess, hierarchy: str, container_id: str) -> Path:
    found = list((CGROUP_ROOT / hierarchy / daemon.cgroup_base).rglob(container_id))
    assert len(found) == 1, found
    return found[0]


def log_records(path: Path) -> list[tuple[str, str, str, str]]:
    """The file's lines as critest's parser splits them: 4 fields, a valid timestamp, a tag."""
    records = []
    for line in path.read_text().splitlines():
        fields = line.split(" ", 3)
        assert len(fields) == 4, line
        parse_rfc3339_ns(fields[0])
        assert fields[1] in ("stdout", "stderr") and fields[2] in ("F", "P"), line
        records.append((fields[0], fields[1], fields[2], fields[3]))
    return records


def stdout_lines(path: Path) -> list[str]:
    """The stdout lines of a CRI log as the kubelet reads them: a line's P records joined with
    the F record that ends it."""
    lines, pending = [], ""
    for _, stream, tag, content in log_records(path):
        if stream == "stdout":
            pending += content
            if tag == "F":
                lines.append(pending)
                pending = ""
    return lines


# -- lifecycle ---------------------------------------------------------------------------------


async def test_created_container_keeps_its_attributes(node: Node) -> None:
    """critest's "preserving container attributes": no command (the image's), labels and
    annotations echoed by ContainerStatus and ListContainers, never started."""
    pod_id = await node.run_pod("attributes")
    config = node.config("preserved", labels=ATTRIBUTES, annotations={"abc": "def"})
    container_id = await node.create(pod_id, config)
    status = await node.status(container_id)
    assert (status.metadata.name, status.metadata.attempt) == ("preserved", ATTEMPT)
    assert status.state == CREATED and status.started_at == 0 and status.finished_at == 0
    assert status.labels == ATTRIBUTES and status.annotations == {"abc": "def"}
    assert status.image.image == BUSYBOX_IMAGE  # as the user named it
    assert status.image_ref == status.image_id == node.image_id
    assert abs(status.created_at - time.time_ns()) < 60 * 10**9
    assert status.log_path.startswith("/") and status.mounts == []
    [listed] = await node.containers(id=container_id)
    assert (listed.id, listed.pod_sandbox_id, listed.state) == (container_id, pod_id, CREATED)
    assert listed.metadata.name == "preserved" and listed.labels == ATTRIBUTES
    assert listed.annotations == {"abc": "def"} and listed.image_ref == node.image_id
    info = json.loads((await node.status_reply(container_id, verbose=True)).info["info"])
    assert info["sandboxID"] == pod_id and info["pid"] == 0
    assert info["runtimeSpec"]["process"]["args"] == ["/bin/sh"]  # the image's Cmd


async def test_start_stop_remove_and_filters(node: Node) -> None:
    pod_id = await node.run_pod("lifecycle", labels={"pod": "one"})
    other_pod = await node.run_pod("other")
    top = await node.run(pod_id, node.config("top", TOP, labels={"foo": "bar"}))
    created = await node.create(pod_id, node.config("created", TOP))
    elsewhere = await node.create(other_pod, node.config("elsewhere", TOP, labels={"foo": "bar"}))
    running = await node.wait_state(top, RUNNING)
    assert running.started_at >= running.created_at > 0
    pid = json.loads((await node.status_reply(top, verbose=True)).info["info"])["pid"]
    assert pid > 0 and Path(f"/proc/{pid}").exists()

    assert await node.ids(id=top[:8]) == [top]  # an id prefix, as crictl sends them
    assert await node.ids(state=cri.ContainerStateValue(state=RUNNING)) == [top]
    assert await node.ids(state=cri.ContainerStateValue(state=CREATED)) == [created, elsewhere]
    assert await node.ids(pod_sandbox_id=pod_id) == [top, created]
    assert await node.ids(label_selector={"foo": "bar"}) == [top, elsewhere]
    assert await node.ids(label_selector={"foo": "bar"}, pod_sandbox_id=other_pod) == [elsewhere]
    assert await node.ids(label_selector={"foo": "baz"}) == []
    assert await node.ids(id="non-existent-id") == []

    began = time.monotonic()
    await node.stop(top, timeout=60)  # critest: must return well before its 60 s
    assert time.monotonic() - began < 10
    stopped = await node.status(top)
    assert stopped.state == EXITED and stopped.finished_at >= stopped.started_at
    assert (stopped.exit_code, stopped.reason) == (143, "Error")  # SIGTERM
    assert not Path(f"/proc/{pid}").exists()
    await node.stop(top, timeout=60)  # stopped already: nothing to do

    await node.remove(top)
    await node.remove(created)  # never started
    assert await node.ids(pod_sandbox_id=pod_id) == []
    assert (await cri_error(node.status(top))).code == "NOT_FOUND"


async def test_stop_and_remove_are_idempotent(node: Node) -> None:
    """critest's idempotence specs: Stop and Remove of what does not exist, or no longer does."""
    pod_id = await node.run_pod("idempotence")
    missing = "0" * 64
    await node.stop(missing)
    await node.remove(missing)
    container_id = await node.run(pod_id, node.config("twice", TOP))
    await node.wait_state(container_id, RUNNING)
    await node.stop(container_id)
    assert (await node.status(container_id)).state == EXITED
    await node.remove(container_id)
    await node.remove(container_id)
    await node.stop(container_id)
    # A running container is removed directly (force), its process killed.
    running = await node.run(pod_id, node.config("running", IGNORES_TERM))
    await node.wait_state(running, RUNNING)
    pid = json.loads((await node.status_reply(running, verbose=True)).info["info"])["pid"]
    began = time.monotonic()
    await node.remove(running)
    assert time.monotonic() - began < 10
    assert await node.ids() == [] and not Path(f"/proc/{pid}").exists()


async def test_create_refuses_what_it_cannot_run(node: Node) -> None:
    pod_id = await node.run_pod("refusals")
    unknown_pod = await cri_error(node.create("0" * 64, node.config("c", TOP)))
    assert unknown_pod.code == "NOT_FOUND" and "pod sandbox" in unknown_pod.message
    not_pulled = node.config("c", TOP)
    not_pulled.image = cri.ImageSpec(image="registry.k8s.io/e2e-test-images/nginx:1.14-2")
    assert (await cri_error(node.create(pod_id, not_pulled))).code == "NOT_FOUND"
    no_metadata = node.config("c", TOP)
    no_metadata.metadata = None
    error = await cri_error(node.create(pod_id, no_metadata))
    assert error.code == "INVALID_ARGUMENT" and "config.metadata" in error.message
    no_image = node.config("c", TOP)
    no_image.image = None
    error = await cri_error(node.create(pod_id, no_image))
    assert error.code == "INVALID_ARGUMENT" and "config.image.image" in error.message
    bad_env = node.config("c", TOP, envs=[cri.KeyValue(key="", value="x")])
    error = await cri_error(node.create(pod_id, bad_env))
    assert error.code == "INVALID_ARGUMENT" and "config.envs[0].key" in error.message
    assert (await cri_error(node.start("0" * 64))).code == "NOT_FOUND"
    await node.stop_pod(pod_id)
    stopped = await cri_error(node.create(pod_id, node.config("c", TOP)))
    assert stopped.code == "FAILED_PRECONDITION"
    assert await node.ids() == []


async def test_host_path_volumes(node: Node, tmp_path: Path) -> None:
    """critest's "starting container with volume" and "volume when host path is a symlink":
    the mount point is made in the root filesystem; ContainerStatus reports the mounts as asked."""
    pod_id = await node.run_pod("volumes")
    directory = tmp_path / f"test{pod_id}"
    directory.mkdir()
    (directory / "testVolume.file").touch()
    symlink = Path(f"{directory}-symlink")
    symlink.symlink_to(directory)
    mounts = [
        cri.Mount(host_path=str(directory), container_path=str(directory), selinux_relabel=True),
        cri.Mount(host_path=str(symlink), container_path=str(symlink)),
        cri.Mount(host_path=str(directory), container_path="/read-only", readonly=True),
    ]
    container_id = await node.run(pod_id, node.config("volumes", ["sh", "-c", "top"], mounts=mounts))
    status = await node.wait_state(container_id, RUNNING)
    assert status.mounts == mounts
    for path in (directory, symlink):
        listed = await node.exec_sync(container_id, ["ls", "-A", str(path)])
        assert (listed.stdout, listed.stderr) == (b"testVolume.file\n", b"")
    refused = await node.exec_sync(container_id, ["touch", "/read-only/new"])
    assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
    assert not (directory / "new").exists()


# -- what runs, and its log ----------------------------------------------------------------------


async def test_command_args_env_workdir_and_logs(node: Node) -> None:
    """Command is the image's entrypoint replaced and args its Cmd, as the kubelet means them;
    each container's log is <pod log_directory>/<log_path>, lines in the CRI format."""
    pod_id = await node.run_pod("logs", log_directory=True)
    log_dir = node.log_root / "logs"
    env = node.config(
        "env",
        ["sh", "-c", "echo $GREETING from $(pwd); exit 3"],
        log=True,
        envs=[cri.KeyValue(key="GREETING", value="hi")],
        working_dir="/tmp",
    )
    args_only = node.config("args", args=["echo", "args only"], log=True)
    image_default = node.config("default", log=True)  # the image's /bin/sh: stdin is empty
    world = node.config("world", ["echo", "hello World"], log=True)  # critest's log spec
    empty_lines = node.config("empty", ["printf", "a\\n\\nb\\n"], log=True)
    stderr = node.config("stderr", ["sh", "-c", "echo oops >&2"], log=True)
    configs = {"env": env, "args": args_only, "default": image_default, "world": world}
    configs |= {"empty": empty_lines, "stderr": stderr}
    ids = {name: await node.run(pod_id, config) for name, config in configs.items()}
    statuses = {name: await node.wait_state(container_id, EXITED) for name, container_id in ids.items()}
    for name, status in statuses.items():
        assert status.log_path == str(log_dir / f"{name}.log")  # absolute, as multi-container reads it
    assert (statuses["env"].exit_code, statuses["env"].reason) == (3, "Error")
    assert stdout_lines(log_dir / "env.log") == ["hi from /tmp"]
    assert stdout_lines(log_dir / "args.log") == ["args only"]
    assert (statuses["default"].exit_code, statuses["default"].reason) == (0, "Completed")
    assert stdout_lines(log_dir / "world.log") == ["hello World"]
    assert stdout_lines(log_dir / "empty.log") == ["a", "", "b"]  # the empty line has its 4 fields
    assert [(stream, content) for _, stream, _, content in log_records(log_dir / "stderr.log")] == [
        ("stderr", "oops")
    ]


async def test_reopen_container_log(node: Node) -> None:
    """critest's "reopening container log": the kubelet renames the file, ReopenContainerLog;
    the path exists at once, new lines go there, the old file gets none."""
    pod_id = await node.run_pod("reopen", log_directory=True)
    container_id = await node.run(pod_id, node.config("looper", LOOP_LOG, log=True))
    path = Path((await node.wait_state(container_id, RUNNING)).log_path)

    async def lines_in(file: Path) -> bool:
        return file.exists() and bool(stdout_lines(file))

    await eventually(lambda: lines_in(path), 30)
    renamed = path.with_name(path.name + ".new")
    path.rename(renamed)
    await node.call("ReopenContainerLog", cri.ReopenContainerLogRequest(container_id=container_id))
    assert path.exists()  # right when the RPC returns
    count = len(stdout_lines(renamed))
    await eventually(lambda: lines_in(path), 30)
    await asyncio.sleep(1.5)
    assert len(stdout_lines(renamed)) == count
    assert set(stdout_lines(path)) == {"hello World"}

    await node.stop(container_id)
    error = await cri_error(
        node.call("ReopenContainerLog", cri.ReopenContainerLogRequest(container_id=container_id))
    )
    assert error.code == "FAILED_PRECONDITION"
    missing = await cri_error(
        node.call("ReopenContainerLog", cri.ReopenContainerLogRequest(container_id="0" * 64))
    )
    assert missing.code == "NOT_FOUND"


# -- exec ----------------------------------------------------------------------------------------


async def test_exec_sync(node: Node) -> None:
    pod_id = await node.run_pod("exec")
    container_id = await node.run(pod_id, node.config("top", TOP))
    await node.wait_state(container_id, RUNNING)
    hello = await node.exec_sync(container_id, ["echo", "-n", "hello"])
    assert (hello.stdout, hello.stderr, hello.exit_code) == (b"hello", b"", 0)
    # A failure is an exit code with what the command wrote, not an error.
    failed = await node.exec_sync(container_id, ["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (failed.stdout, failed.stderr, failed.exit_code) == (b"out\n", b"err\n", 7)
    # A command that cannot start is the runtime's error, as containerd reports it.
    missing = await cri_error(node.exec_sync(container_id, ["no-such-command"]))
    assert missing.code == "FAILED_PRECONDITION" and "no-such-command" in missing.message

    # critest's "execSync with timeout": auraed enforces it, and kills the command.
    began = time.monotonic()
    error = await cri_error(node.exec_sync(container_id, ["sleep", "4321"], timeout=1))
    assert error.code == "DEADLINE_EXCEEDED" and time.monotonic() - began < 10
    left = await node.exec_sync(container_id, ["sh", "-c", "pidof sleep || true"])
    assert (left.stdout.strip(), left.stderr) == (b"", b"")

    # Output beyond the cap is read and dropped: the command ends, the reply fits a kubelet.
    async with AuraeClient(
        grpc.aio.insecure_channel(f"unix:{node.daemon.cri_socket}", options=BIG_RECEIVE)
    ) as big:
        request = cri.ExecSyncRequest(
            container_id=container_id, cmd=["head", "-c", str(EXEC_OUTPUT_MAX + MIB), "/dev/zero"]
        )
        capped = await big.call(RUNTIME_SERVICE, "ExecSync", request, CALL_TIMEOUT)
    assert (len(capped.stdout), capped.exit_code) == (EXEC_OUTPUT_MAX, 0)

    created = await node.create(pod_id, node.config("created", TOP))
    assert (await cri_error(node.exec_sync(created, ["true"]))).code == "FAILED_PRECONDITION"
    assert (await cri_error(node.exec_sync(container_id, []))).code == "INVALID_ARGUMENT"
    assert (await cri_error(node.exec_sync("0" * 64, ["true"]))).code == "NOT_FOUND"


# -- resources -----------------------------------------------------------------------------------


async def test_oom_killed_container(node: Node) -> None:
    """critest's OOM spec: 15 MiB of memory and memory + swap, dd with 20 MiB blocks: exit 137,
    reason OOMKilled (cgroup v1's memsw limit holds swap back too)."""
    pod_id = await node.run_pod("oom")
    limit = 15 * MIB
    resources = cri.LinuxContainerResources(memory_limit_in_bytes=limit, memory_swap_limit_in_bytes=limit)
    config = node.config(
        "oom",
        ["sh", "-c", "dd if=/dev/zero of=/dev/null bs=20M"],
        linux=cri.LinuxContainerConfig(resources=resources),
    )
    container_id = await node.create(pod_id, config)
    spec = json.loads((await node.status_reply(container_id, verbose=True)).info["info"])["runtimeSpec"]
    assert spec["linux"]["resources"]["memory"] == {"limit": limit, "swap": limit}
    await node.start(container_id)
    status = await node.wait_state(container_id, EXITED)
    assert (status.exit_code, status.reason) == (137, "OOMKilled")


async def test_resources_at_create_and_update(node: Node) -> None:
    pod_id = await node.run_pod("resources")
    resources = cri.LinuxContainerResources(
        cpu_period=100_000,
        cpu_quota=20_000,
        cpu_shares=1024,
        memory_limit_in_bytes=64 * MIB,
        oom_score_adj=-500,
    )
    container_id = await node.run(
        pod_id, node.config("limited", TOP, linux=cri.LinuxContainerConfig(resources=resources))
    )
    await node.wait_state(container_id, RUNNING)
    cpu = container_cgroup(node.daemon, "cpu", container_id)
    memory = container_cgroup(node.daemon, "memory", container_id)
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"
    assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
    assert (cpu / "cpu.shares").read_text().strip() == "1024"
    assert int((memory / "memory.limit_in_bytes").read_text()) == 64 * MIB
    pid = json.loads((await node.status_reply(container_id, verbose=True)).info["info"])["pid"]
    own = int(Path("/proc/self/oom_score_adj").read_text())
    assert int(Path(f"/proc/{pid}/oom_score_adj").read_text()) == max(-500, own)  # never below auraed's

    update = cri.LinuxContainerResources(cpu_quota=50_000, cpu_shares=512, memory_limit_in_bytes=128 * MIB)
    request = cri.UpdateContainerResourcesRequest(container_id=container_id, linux=update)
    await node.call("UpdateContainerResources", request)
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert (cpu / "cpu.shares").read_text().strip() == "512"
    assert int((memory / "memory.limit_in_bytes").read_text()) == 128 * MIB
    spec = json.loads((await node.status_reply(container_id, verbose=True)).info["info"])["runtimeSpec"]
    assert spec["linux"]["resources"]["memory"]["limit"] == 128 * MIB  # kept for a later run

    too_small = cri.UpdateContainerResourcesRequest(
        container_id=container_id, linux=cri.LinuxContainerResources(memory_limit_in_bytes=1024)
    )
    error = await cri_error(node.call("UpdateContainerResources", too_small))
    assert error.code == "INVALID_ARGUMENT" and "memory_max" in error.message
    await node.stop(container_id)
    stopped = await cri_error(node.call("UpdateContainerResources", request))
    assert stopped.code == "FAILED_PRECONDITION"


# -- stats ---------------------------------------------------------------------------------------


async def test_container_and_pod_stats(node: Node) -> None:
    pod_id = await node.run_pod("stats", labels={"stream-pod-stats": "yes"})
    other_pod = await node.run_pod("quiet")
    labelled = await node.run(pod_id, node.config("container-for-stats-1", TOP, labels={"foo": "bar"}))
    others = [await node.run(pod_id, node.config(f"container-for-stats-{n}", TOP)) for n in (2, 3)]
    for container_id in (labelled, *others):
        await node.wait_state(container_id, RUNNING)
    written = await node.exec_sync(labelled, ["dd", "if=/dev/zero", "of=/written", "bs=1M", "count=2"])
    assert written.exit_code == 0

    reply = await node.call("ContainerStats", cri.ContainerStatsRequest(container_id=labelled))
    stats = reply.stats
    assert stats.attributes.id == labelled and "container-for-stats-" in stats.attributes.metadata.name
    assert stats.attributes.labels == {"foo": "bar"}
    assert stats.cpu.timestamp != 0 and stats.memory.timestamp != 0
    assert stats.memory.working_set_bytes.value > 0 and stats.memory.usage_bytes.value > 0
    assert stats.cpu.usage_core_nano_seconds is not None
    assert stats.writable_layer.used_bytes.value >= 2 * MIB and stats.writable_layer.inodes_used.value >= 1

    async def listed(stats_filter: cri.ContainerStatsFilter | None) -> list[str]:
        ids = [
            s.attributes.id
            for s in (
                await node.call("ListContainerStats", cri.ListContainerStatsRequest(filter=stats_filter))
            ).stats
        ]
        streamed = await node.stream(
            "StreamContainerStats", cri.StreamContainerStatsRequest(filter=stats_filter)
        )
        assert [s.attributes.id for reply in streamed for s in reply.container_stats] == ids
        return ids

    assert set(await listed(None)) == {labelled, *others}
    assert await listed(cri.ContainerStatsFilter(id=labelled)) == [labelled]
    assert await listed(cri.ContainerStatsFilter(label_selector={"foo": "bar"})) == [labelled]
    assert await listed(cri.ContainerStatsFilter(label_selector={"foo": "baz"})) == []
    assert await listed(cri.ContainerStatsFilter(pod_sandbox_id=other_pod)) == []

    pod_reply = await node.call("PodSandboxStats", cri.PodSandboxStatsRequest(pod_sandbox_id=pod_id))
    pod_stats = pod_reply.stats
    assert pod_stats.attributes.id == pod_id and pod_stats.attributes.metadata.name == "stats"
    assert pod_stats.attributes.labels == {"stream-pod-stats": "yes"}
    assert pod_stats.linux.cpu.timestamp != 0 and pod_stats.linux.memory.working_set_bytes.value > 0
    assert pod_stats.linux.process.process_count.value >= 3
    assert {c.attributes.id for c in pod_stats.linux.containers} == {labelled, *others}

    async def pods_listed(pod_filter: cri.PodSandboxStatsFilter | None) -> list[str]:
        request = cri.ListPodSandboxStatsRequest(filter=pod_filter)
        ids = [s.attributes.id for s in (await node.call("ListPodSandboxStats", request)).stats]
        streamed = await node.stream(
            "StreamPodSandboxStats", cri.StreamPodSandboxStatsRequest(filter=pod_filter)
        )
        assert [s.attributes.id for reply in streamed for s in reply.pod_sandbox_stats] == ids
        return ids

    assert await pods_listed(cri.PodSandboxStatsFilter(id=pod_id)) == [pod_id]  # exactly one
    assert set(await pods_listed(None)) == {pod_id, other_pod}
    assert await pods_listed(cri.PodSandboxStatsFilter(label_selector={"stream-pod-stats": "yes"})) == [
        pod_id
    ]

    missing = await cri_error(node.call("ContainerStats", cri.ContainerStatsRequest(container_id="0" * 64)))
    assert missing.code == "NOT_FOUND"
    missing = await cri_error(
        node.call("PodSandboxStats", cri.PodSandboxStatsRequest(pod_sandbox_id="0" * 64))
    )
    assert missing.code == "NOT_FOUND"


# -- metrics -------------------------------------------------------------------------------------

BUSY = ["sh", "-c", "while :; do :; done"]  # a CPU's worth of work


async def pod_metrics(node: Node) -> dict[str, Any]:
    """ListPodSandboxMetrics by pod id, checked as the kubelet's collector takes each metric:
    a descriptor of its name, as many label values as label keys; and the stream the same."""
    reply = await node.call("ListMetricDescriptors", cri.ListMetricDescriptorsRequest())
    descriptors = {d.name: d for d in reply.descriptors}
    before = time.time_ns()
    listed = (await node.call("ListPodSandboxMetrics", cri.ListPodSandboxMetricsRequest())).pod_metrics
    after = time.time_ns()
    for pod in listed:
        for metric in [*pod.metrics, *(m for c in pod.container_metrics for m in c.metrics)]:
            descriptor = descriptors[metric.name]
            assert len(metric.label_values) == len(descriptor.label_keys), metric
            assert (metric.metric_type == cri.MetricType.COUNTER) == metric.name.endswith("_total"), metric
            if metric.name != "container_fs_usage_bytes":  # measured at most every 10 s
                assert before <= metric.timestamp <= after, metric
    [streamed] = await node.stream("StreamPodSandboxMetrics", cri.StreamPodSandboxMetricsRequest())
    assert [p.pod_sandbox_id for p in streamed.pod_sandbox_metrics] == [p.pod_sandbox_id for p in listed]
    return {pod.pod_sandbox_id: pod for pod in listed}


def values(metrics: list[Any], name: str) -> dict[tuple[str, ...], int]:
    """A metric's values by its label values (container, id, image, name, namespace, pod, ...)."""
    return {tuple(m.label_values): m.value.value for m in metrics if m.name == name}


def value(metrics: list[Any], name: str) -> int:
    [only] = values(metrics, name).values()
    return only


def never_throttle_writes(node: Node, container_id: str) -> str:
    """cgroup v1 counts a cgroup's block I/O only where a throttle rule applies: one that never
    throttles the container's writes to the device of its writable layer; that device's id."""
    device = os.stat(node.daemon.root).st_dev
    device_id = f"{os.major(device)}:{os.minor(device)}"
    rule = container_cgroup(node.daemon, "blkio", container_id) / "blkio.throttle.write_bps_device"
    rule.write_text(f"{device_id} {1 << 40}\n")
    return device_id


async def test_metric_descriptors_are_cadvisors(node: Node) -> None:
    reply = await node.call("ListMetricDescriptors", cri.ListMetricDescriptorsRequest())
    by_name = {d.name: d for d in reply.descriptors}
    assert len(by_name) == len(reply.descriptors), "one descriptor a name"
    base = ["container", "id", "image", "name", "namespace", "pod"]
    for name in (
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_processes",
    ):
        assert by_name[name].label_keys == base and by_name[name].help
    assert by_name["container_fs_reads_bytes_total"].label_keys == [*base, "device"]


async def test_pod_and_container_metrics(node: Node) -> None:
    """ListPodSandboxMetrics: every READY pod, one without containers too, with its cgroup's
    metrics and each running container's, labelled as cAdvisor labels them, with plausible values."""
    pod_id = await node.run_pod("metrics")
    empty = await node.run_pod("metrics-empty")
    limited_config = cri.LinuxContainerConfig(
        resources=cri.LinuxContainerResources(memory_limit_in_bytes=64 * MIB)
    )
    limited = await node.run(pod_id, node.config("limited", TOP, linux=limited_config))
    quiet = await node.run(pod_id, node.config("quiet", TOP))
    created = await node.create(pod_id, node.config("created", TOP))  # not running: no metrics
    for container_id in (limited, quiet):
        await node.wait_state(container_id, RUNNING)
    device_id = never_throttle_writes(node, quiet)
    direct = ["dd", "if=/dev/zero", "of=/direct", "bs=1M", "count=4", "oflag=direct"]
    written = await node.exec_sync(quiet, direct)
    assert written.exit_code == 0, written.stderr

    pods = await pod_metrics(node)
    assert {pod_id, empty} <= set(pods)
    assert pods[empty].container_metrics == []
    # Its pod cgroup's (the pod's init is there; what it allocated before it was moved in stays
    # charged where it was, so its memory may read 0: a cgroup v2 charge never moves).
    assert value(pods[empty].metrics, "container_memory_usage_bytes") >= 0
    [(labels, processes)] = values(pods[empty].metrics, "container_processes").items()
    assert labels[0] == "" and labels[2:] == ("", "", "critest", "metrics-empty") and processes >= 1
    pod = pods[pod_id]
    by_container = {c.container_id: c.metrics for c in pod.container_metrics}
    assert set(by_container) == {limited, quiet} and created not in by_container

    limited_metrics = by_container[limited]
    [labels] = values(limited_metrics, "container_memory_working_set_bytes")
    container, cgroup_id, image, name, namespace, pod_name = labels
    assert (container, image, name, namespace, pod_name) == (
        "limited",
        BUSYBOX_IMAGE,
        limited,
        "critest",
        "metrics",
    )
    assert cgroup_id.startswith("/") and cgroup_id.endswith(limited)
    working_set = value(limited_metrics, "container_memory_working_set_bytes")
    assert 0 < working_set <= value(limited_metrics, "container_memory_usage_bytes")
    assert value(limited_metrics, "container_spec_memory_limit_bytes") == 64 * MIB
    assert value(by_container[quiet], "container_spec_memory_limit_bytes") == 0  # none
    assert (
        value(limited_metrics, "container_processes") >= 1
        and value(limited_metrics, "container_threads") >= 1
    )
    assert value(limited_metrics, "container_oom_events_total") == 0
    assert abs(value(limited_metrics, "container_start_time_seconds") - time.time()) < 120
    [(fs_labels, fs_used)] = values(by_container[quiet], "container_fs_usage_bytes").items()
    assert fs_labels[-1].startswith("/") and fs_used >= 4 * MIB  # the file dd wrote
    [(io_labels, io_written)] = values(by_container[quiet], "container_fs_writes_bytes_total").items()
    uevent = Path(f"/sys/dev/block/{device_id}/uevent").read_text().split()
    assert io_labels[-1] == "/dev/" + dict(line.split("=", 1) for line in uevent)["DEVNAME"]
    assert io_written >= 4 * MIB
    assert value(pod.metrics, "container_processes") >= 2  # both containers are in the pod cgroup


async def test_metrics_move_as_containers_work(node: Node) -> None:
    """A busy container's CPU counter grows by whole seconds, a quiet one's stays behind, the
    pod's sums them; a container that stops, and a pod that stops, are no longer listed."""
    pod_id = await node.run_pod("working")
    other = await node.run_pod("working-other")
    busy = await node.run(pod_id, node.config("busy", BUSY))
    quiet = await node.run(pod_id, node.config("quiet", TOP))
    for container_id in (busy, quiet):
        await node.wait_state(container_id, RUNNING)

    async def cpu_seconds() -> tuple[int, dict[str, int]]:
        pod = (await pod_metrics(node))[pod_id]
        by_container = {c.container_id: c.metrics for c in pod.container_metrics}
        used = {c: value(metrics, "container_cpu_usage_seconds_total") for c, metrics in by_container.items()}
        return value(pod.metrics, "container_cpu_usage_seconds_total"), used

    _, first = await cpu_seconds()

    async def counted_more() -> bool:
        return (await cpu_seconds())[1][busy] >= first[busy] + 2

    await eventually(counted_more, 60, 0.5)
    pod_used, used = await cpu_seconds()
    assert used[quiet] < used[busy]
    assert pod_used >= used[busy] - 1  # the pod's cgroup is read just before its containers'

    await node.stop(busy)
    await node.stop_pod(other)
    pods = await pod_metrics(node)
    assert other not in pods, "a pod that is not ready has nothing to measure"
    assert [c.container_id for c in pods[pod_id].container_metrics] == [quiet]


# -- events --------------------------------------------------------------------------------------


async def test_container_events_reach_every_subscriber(node: Node) -> None:
    pod_id = await node.run_pod("events")
    received: list[list[Any]] = [[], []]

    async def subscribe(into: list[Any]) -> None:
        async for event in node.client.stream(
            RUNTIME_SERVICE, "GetContainerEvents", cri.GetEventsRequest(), None
        ):
            into.append(event)

    subscribers = [asyncio.create_task(subscribe(into)) for into in received]
    probes = itertools.count()
    try:
        # A stream has begun once it sees an event: create containers until both have seen one.
        async def both_see_one() -> bool:
            await node.create(pod_id, node.config(f"probe-{next(probes)}", TOP))
            return all(received)

        await eventually(both_see_one, 30, 0.2)
        for events in received:
            events.clear()
        container_id = await node.run(pod_id, node.config("short", ["sh", "-c", "sleep 0.5"]))
        await node.wait_state(container_id, EXITED)
        await node.remove(container_id)

        kinds = [
            cri.ContainerEventType.CONTAINER_CREATED_EVENT,
            cri.ContainerEventType.CONTAINER_STARTED_EVENT,
            cri.ContainerEventType.CONTAINER_STOPPED_EVENT,
            cri.ContainerEventType.CONTAINER_DELETED_EVENT,
        ]

        async def all_seen() -> bool:
            return all(
                [e.container_event_type for e in events if e.container_id == container_id] == kinds
                for events in received
            )

        await eventually(all_seen, 30)
        for events in received:
            mine = [e for e in events if e.container_id == container_id]
            assert all(e.created_at > 0 and e.pod_sandbox_status.id == pod_id for e in mine)
            stopped = next(e for e in mine if e.container_event_type == kinds[2])
            [status] = [s for s in stopped.containers_statuses if s.id == container_id]
            assert status.state == EXITED and status.reason == "Completed"
            assert container_id not in [s.id for s in mine[3].containers_statuses]
    finally:
        for task in subscribers:
            task.cancel()
        await asyncio.gather(*subscribers, return_exceptions=True)


async def test_pod_status_carries_its_containers_statuses(node: Node) -> None:
    """A kubelet with the Evented PLEG takes a pod's containers from PodSandboxStatus whenever its
    timestamp is set: every container of the pod, verbose or not, as ContainerStatus says."""
    pod_id = await node.run_pod("statuses")
    empty = await node.run_pod("statuses-empty")
    running = await node.run(pod_id, node.config("running", TOP))
    created = await node.create(pod_id, node.config("created", TOP))
    await node.create(await node.run_pod("statuses-other"), node.config("other", TOP))  # not listed
    await node.wait_state(running, RUNNING)

    for verbose in (False, True):
        before = time.time_ns()
        reply = await pod_status(node.client, pod_id, verbose=verbose)
        assert before <= reply.timestamp <= time.time_ns()
        by_id = {status.id: status for status in reply.containers_statuses}
        assert set(by_id) == {running, created}
        for container_id, status in by_id.items():
            assert status == (await node.status_reply(container_id)).status
        assert (by_id[running].state, by_id[created].state) == (RUNNING, CREATED)
    assert (await pod_status(node.client, empty)).containers_statuses == []

    await node.remove(created)
    assert [s.id for s in (await pod_status(node.client, pod_id)).containers_statuses] == [running]


# -- pods take their containers ------------------------------------------------------------------


async def test_pod_stop_and_remove_take_its_containers(node: Node) -> None:
    pod_id = await node.run_pod("taken")
    stubborn = await node.run(pod_id, node.config("stubborn", IGNORES_TERM))
    created = await node.create(pod_id, node.config("created", TOP))
    done = await node.run(pod_id, node.config("done", ["true"]))
    await node.wait_state(stubborn, RUNNING)
    await node.wait_state(done, EXITED)
    pid = json.loads((await node.status_reply(stubborn, verbose=True)).info["info"])["pid"]
    began = time.monotonic()
    await node.stop_pod(pod_id)  # kills at once: the kubelet stopped each container before
    assert time.monotonic() - began < 10
    assert (await node.status(stubborn)).state == EXITED and not Path(f"/proc/{pid}").exists()
    assert (await node.status(created)).state == CREATED
    await node.remove_pod(pod_id)
    assert await node.ids() == []
    for container_id in (stubborn, created, done):
        assert (await cri_error(node.status(container_id))).code == "NOT_FOUND"


# -- restart -------------------------------------------------------------------------------------


async def test_containers_are_found_again_after_kill_9(node: Node) -> None:
    pod_id = await node.run_pod("restart", log_directory=True)
    looper = await node.run(pod_id, node.config("looper", LOOP_LOG, log=True, labels={"keep": "me"}))
    exited = await node.run(pod_id, node.config("exited", ["sh", "-c", "exit 4"], log=True))
    created = await node.create(pod_id, node.config("created", TOP))
    running = await node.wait_state(looper, RUNNING)
    before = {c: await node.status(c) for c in (looper, exited, created)}
    await node.wait_state(exited, EXITED)
    before[exited] = await node.status(exited)
    pid = json.loads((await node.status_reply(looper, verbose=True)).info["info"])["pid"]
    log_path = Path(running.log_path)

    node.daemon.kill9()
    grown = len(stdout_lines(log_path))
    await wait_until(lambda: len(stdout_lines(log_path)) > grown, 10)  # the log goes on meanwhile
    node.daemon.start()
    await node.client.close()
    node.client = cri_client(node.daemon)
    assert set(await node.ids(pod_sandbox_id=pod_id)) == {looper, exited, created}
    for container_id, earlier in before.items():
        status = await node.status(container_id)
        assert (status.state, status.created_at, status.started_at) == (
            earlier.state,
            earlier.created_at,
            earlier.started_at,
        )
        assert (status.exit_code, status.reason, status.labels) == (
            earlier.exit_code,
            earlier.reason,
            earlier.labels,
        )
    assert json.loads((await node.status_reply(looper, verbose=True)).info["info"])["pid"] == pid
    assert (await node.exec_sync(looper, ["echo", "-n", "still here"])).stdout == b"still here"
    await node.stop(looper)  # no grace: SIGKILL
    stopped = await node.status(looper)
    assert (stopped.state, stopped.exit_code, stopped.reason) == (EXITED, 137, "Error")
    count = len(stdout_lines(log_path))
    await asyncio.sleep(0.5)
    assert len(stdout_lines(log_path)) == count
    await node.start(created)  # created before the restart: it runs now
    await node.wait_state(created, RUNNING)


# -- security context, through the CRI ----------------------------------------------------------


async def test_security_context_reaches_the_container(node: Node, tmp_path: Path) -> None:
    """The CRI's security context and mounts (auraed.cri.security) applied at CreateContainer,
    seen from inside as critest sees them: user, read-only rootfs, seccomp, a host path mount."""
    pod_id = await node.run_pod("secure")
    Profile = cri.SecurityProfileProfileType
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "testVolume.file").write_text("")

    def secured(name: str, **context: Any) -> cri.ContainerConfig:
        linux = cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(**context))
        return node.config(name, TOP, linux=linux)

    user = await node.run(pod_id, secured("user", run_as_user=cri.Int64Value(value=1001)))
    readonly = await node.run(pod_id, secured("readonly", readonly_rootfs=True))
    default = await node.run(
        pod_id, secured("default", seccomp=cri.SecurityProfile(profile_type=Profile.RuntimeDefault))
    )
    mounted = await node.run(
        pod_id,
        dataclasses_replace(
            node.config("mounted", TOP),
            mounts=[cri.Mount(container_path=str(volume), host_path=str(volume), readonly=True)],
        ),
    )
    for container_id in (user, readonly, default, mounted):
        await node.wait_state(container_id, RUNNING)
    assert (await node.exec_sync(user, ["id", "-u"])).stdout == b"1001\n"
    touched = await node.exec_sync(readonly, ["touch", "/test"])
    assert touched.exit_code != 0 and b"Read-only file system" in touched.stderr
    # No profile asked is unconfined for the CRI (containerd's rule); RuntimeDefault filters.
    assert b"0" in (await node.exec_sync(user, ["grep", "Seccomp:", "/proc/self/status"])).stdout
    assert b"2" in (await node.exec_sync(default, ["grep", "Seccomp:", "/proc/self/status"])).stdout
    listed = await node.exec_sync(mounted, ["ls", "-A", str(volume)])
    assert (listed.stdout, listed.stderr) == (b"testVolume.file\n", b"")
    written = await node.exec_sync(mounted, ["touch", f"{volume}/new"])
    assert written.exit_code != 0
    refused = await cri_error(
        node.create(pod_id, secured("group-only", run_as_group=cri.Int64Value(value=1002)))
    )
    assert refused.code == "INVALID_ARGUMENT" and "run_as_group" in refused.message
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


@pytest.fixture
def tmpfs_below(tmp_path: Path) -> Iterator[Path]:
    """critest's host path of its read-only mount specs: a directory with a tmpfs mounted on
    ``tmpfs`` in it (unmounted at the end)."""
    host = tmp_path / "rro-volume"
    (host / "tmpfs").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(host / "tmpfs")], check=True)
    try:
        yield host
    finally:
        subprocess.run(["umount", "--lazy", str(host / "tmpfs")], check=True)


async def test_recursive_read_only_mounts(node: Node, tmpfs_below: Path) -> None:
    """critest's "runtime should support readonly mounts" specs: the cell handler says it makes
    recursive read-only mounts (the vm handler does not); a read-only volume leaves the tmpfs
    below it writable, a recursive one makes it read-only too; recursive needs readonly and
    private propagation, else CreateContainer fails."""
    handlers = (await node.call("Status", cri.StatusRequest())).runtime_handlers
    features = {handler.name: handler.features for handler in handlers}
    assert features["cell"] is not None and features["cell"].recursive_read_only_mounts
    # vm: the share makes every mount of an rro volume read-only where virtiofsd serves it.
    assert features["vm"] is None or features["vm"].recursive_read_only_mounts
    pod_id = await node.run_pod("read-only-mounts")

    def volume(**fields: Any) -> cri.Mount:
        asked = {"readonly": True, "selinux_relabel": True, **fields}
        return cri.Mount(host_path=str(tmpfs_below), container_path="/mnt", **asked)

    top_only = await node.run(pod_id, node.config("top-only", TOP, mounts=[volume()]))
    recursive = await node.run(
        pod_id, node.config("recursive", TOP, mounts=[volume(recursive_read_only=True)])
    )
    for container_id in (top_only, recursive):
        await node.wait_state(container_id, RUNNING)
    assert (await node.status(recursive)).mounts == [volume(recursive_read_only=True)]
    assert (await node.exec_sync(top_only, ["touch", "/mnt/tmpfs/file"])).exit_code == 0
    refused = await node.exec_sync(recursive, ["touch", "/mnt/tmpfs/foo"])
    assert (refused.exit_code, refused.stderr) == (1, b"touch: /mnt/tmpfs/foo: Read-only file system\n")
    assert (await node.exec_sync(recursive, ["touch", "/mnt/file"])).exit_code == 1
    assert sorted(os.listdir(tmpfs_below / "tmpfs")) == ["file"]
    propagation = cri.MountPropagation
    for fields, problem in (
        ({"propagation": propagation.PROPAGATION_HOST_TO_CONTAINER}, "needs PROPAGATION_PRIVATE"),
        ({"propagation": propagation.PROPAGATION_BIDIRECTIONAL}, "needs PROPAGATION_PRIVATE"),
        ({"readonly": False}, "needs readonly"),
    ):
        config = node.config("invalid", TOP, mounts=[volume(recursive_read_only=True, **fields)])
        error = await cri_error(node.create(pod_id, config))
        assert (error.code, error.message) == (
            "INVALID_ARGUMENT",
            f"config.mounts[0].recursive_read_only: {problem}",
        )
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


async def test_supplemental_groups_policy(node: Node, mirror: LocalRegistry, tmp_path: Path) -> None:
    """critest's SupplementalGroupsPolicy specs, on its image whose /etc/group makes the user a
    member of a group: Merge (the default) gives the process that group and the pod's, Strict
    only the pod's; ContainerStatus reports the ids the process runs with, and an exec'd process
    has the same."""
    reply = await node.call("Status", cri.StatusRequest())
    assert reply.features is not None and reply.features.supplemental_groups_policy
    publish(predefined_group_image(tmp_path / "image"), mirror, PREDEFINED_GROUP_IMAGE)
    await pull_image(node.client, PREDEFINED_GROUP_IMAGE)
    pod_id = await node.run_pod("groups", log_directory=True)
    for case in supplemental_groups_cases():
        linux = cri.LinuxContainerConfig(security_context=case.context)
        config = dataclasses_replace(
            node.config(case.name, ["sh", "-c", "id -G; sleep infinity"], log=True, linux=linux),
            image=cri.ImageSpec(image=PREDEFINED_GROUP_IMAGE),
        )
        container_id = await node.run(pod_id, config)
        status = await node.wait_state(container_id, RUNNING)
        assert case.reported(status), status
        log = node.log_root / "groups" / f"{case.name}.log"

        async def logged(log: Path = log, shown: str = case.shown) -> bool:
            return log.exists() and stdout_lines(log) == [shown]

        await eventually(logged, 30)
        assert (await node.exec_sync(container_id, ["id", "-G"])).stdout == f"{case.shown}\n".encode()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


# -- pod isolation -----------------------------------------------------------------------------


async def test_shared_pid_pod_init_shows_nothing_of_the_host(node: Node, tmp_path: Path) -> None:
    """The attack of issue 33: a pod sharing its PID namespace has auraed's pod init as PID 1;
    a container of it with CAP_SYS_PTRACE (a debugging sidecar; RuntimeDefault seccomp) reads
    and writes through /proc/1 whatever the init can reach. The init must reach nothing: an
    empty read-only root, no descriptors, no environment, no capabilities, an unprivileged id."""
    secret = tmp_path / "host-secret"
    secret.write_text("host secret\n")
    pod = pod_config(
        "shared-pid", namespace="critest", linux=cri.LinuxPodSandboxConfig(security_context=namespaces())
    )
    pod_id = await run_pod(node.client, pod)
    context = cri.LinuxContainerSecurityContext(
        capabilities=cri.Capability(add_capabilities=["SYS_PTRACE"]),
        seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfileProfileType.RuntimeDefault),
        namespace_options=cri.NamespaceOption(pid=cri.NamespaceMode.POD),
    )
    debugger = await node.run(
        pod_id, node.config("debugger", TOP, linux=cri.LinuxContainerConfig(security_context=context))
    )
    await node.wait_state(debugger, RUNNING)

    async def shell(script: str) -> tuple[int, str, str]:
        reply = await node.exec_sync(debugger, ["sh", "-c", script])
        return reply.exit_code, reply.stdout.decode(), reply.stderr.decode()

    assert (await shell("cat /proc/1/comm"))[1] == "aurae-pod-init\n"
    assert (await shell("ls -A /proc/1/root/"))[1] == "aurae-pod-init\n"
    assert (await shell("readlink /proc/1/root; readlink /proc/1/cwd; ls -A /proc/1/cwd/"))[
        1
    ] == "/\n/\naurae-pod-init\n"
    code, out, _ = await shell(f"cat /proc/1/root{secret}")
    assert code != 0 and "host secret" not in out
    for target in (f"/proc/1/root{tmp_path}/written", "/proc/1/root/written", "/proc/1/cwd/written"):
        assert (await shell(f"echo x > {target}"))[0] != 0, target
    assert not (tmp_path / "written").exists()
    # Its one descriptor is its signalfd: nothing of a file of the host's.
    assert (await shell("for fd in /proc/1/fd/*; do readlink $fd; done"))[1] == "anon_inode:[signalfd]\n"
    assert (await shell("wc -c < /proc/1/environ"))[1].strip() == "0"
    status = dict(
        line.split(":", 1) for line in (await shell("cat /proc/1/status"))[1].splitlines() if ":" in line
    )
    assert {key: status[key].split() for key in ("Uid", "Gid")} == {
        "Uid": ["65535"] * 4,
        "Gid": ["65535"] * 4,
    }
    capabilities = {key: status[key].strip() for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    assert set(capabilities.values()) == {"0000000000000000"}, capabilities
    assert status["NoNewPrivs"].strip() == "1" and status["Groups"].strip() == ""
    # And it still is the namespace's init: an orphan of the container is reaped.
    assert (await shell("sh -c 'sleep 0.1 &'; sleep 1; ps -o stat | grep -c Z"))[1].strip() == "0"
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


# -- pods in the host's namespaces ---------------------------------------------------------------


HOST, OWN, EACH = cri.NamespaceMode.NODE, cri.NamespaceMode.POD, cri.NamespaceMode.CONTAINER
HOST_NAMESPACE_PODS = {  # name: (network, pid, ipc), the combinations critest and a kubelet use
    "everything": (HOST, HOST, HOST),
    "host-pid": (OWN, HOST, OWN),
    "host-ipc": (OWN, EACH, HOST),
    "host-network": (HOST, EACH, OWN),
    "host-network-shared-pid": (HOST, OWN, OWN),
}
HOST_GREETING = b"hello from the host\n"


async def test_containers_of_pods_in_host_namespaces_run(node: Node) -> None:
    """critest's HostPID, HostIpc, HostNetwork and "portforward in host network" specs: every
    container of such a pod failed to start (runc joined /proc/1/ns/<kind>, which fails where
    auraed is not in PID 1's namespaces or may not open them: this machine's PID 1 is another
    program's). A host namespace is left out of the spec, as containerd does: the container stays
    in the runtime's own, and sees the host's processes, SysV IPC and network there."""
    own_start = processes.start_ticks(os.getpid())
    made = subprocess.run(["ipcmk", "-M", "4096"], capture_output=True, text=True, check=True).stdout
    shm_id = made.split()[-1]
    port = free_port()
    try:
        with listening_on_loopback(port, HOST_GREETING):
            for name, (network, pid, ipc) in HOST_NAMESPACE_PODS.items():
                context = namespaces(network=network, pid=pid, ipc=ipc)
                linux = cri.LinuxPodSandboxConfig(security_context=context)
                config = pod_config(name, namespace="critest", hostname=name, linux=linux)
                pod_id = await run_pod(node.client, config)
                container = await node.run(pod_id, node.config("c", TOP))
                await node.wait_state(container, RUNNING)
                seen = {
                    # This very process, by its pid and start time (the host's PID namespace).
                    "pid": f"grep -q ' {own_start} ' /proc/{os.getpid()}/stat",
                    "ipc": f"grep -qw {shm_id} /proc/sysvipc/shm",
                    "network": f"nc 127.0.0.1 {port} | grep -q 'hello from the host'",
                }
                for kind, mode in (("network", network), ("pid", pid), ("ipc", ipc)):
                    reply = await node.exec_sync(container, ["sh", "-c", seen[kind]])
                    assert (reply.exit_code == 0) == (mode == HOST), (name, kind, reply)
                hostname = (await node.exec_sync(container, ["hostname"])).stdout.decode().strip()
                assert hostname == (socket.gethostname() if network == HOST else name)
                if network == HOST:  # "portforward in host network": the host's own port
                    assert await forwarded(node, pod_id, port) == HOST_GREETING
                await node.stop_pod(pod_id)
                await node.remove_pod(pod_id)
    finally:
        subprocess.run(["ipcrm", "-m", shm_id], check=True)


async def forwarded(node: Node, pod_id: str, port: int) -> bytes:
    """What the pod's ``port`` sends first, through the CRI's PortForward."""
    url = (await node.call("PortForward", cri.PortForwardRequest(pod_sandbox_id=pod_id))).url
    forward = await open_port_forward(url)
    try:
        connection = await forward.connect(port)
        received = await asyncio.wait_for(connection.read(), 30)
        await connection.close()
        return received
    finally:
        await forward.close()


@contextlib.contextmanager
def listening_on_loopback(port: int, greeting: bytes) -> Iterator[None]:
    """A server on the host's 127.0.0.1:``port`` that sends ``greeting`` to each connection."""
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            with connection:
                connection.sendall(greeting)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        server.close()


# -- user namespaces (hostUsers: false) ------------------------------------------------------------

USERNS_HOST_ID = 1_000_000  # the pod's root on the host: an id no account of this machine has
USERNS_LENGTH = 65536


def userns_pod(
    name: str, userns: cri.UserNamespace, pid: cri.NamespaceMode = cri.NamespaceMode.POD
) -> cri.PodSandboxConfig:
    options = cri.NamespaceOption(pid=pid, userns_options=userns)
    context = cri.LinuxSandboxSecurityContext(namespace_options=options)
    return pod_config(
        name, namespace="critest", hostname=name, linux=cri.LinuxPodSandboxConfig(security_context=context)
    )


def processes_of_uid(uid: int) -> list[str]:
    """The host's processes (zombies too) whose real uid is ``uid``, as "pid state"."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if fields["Uid"].split()[0] == str(uid):
                found.append(f"{status.parent.name} {fields['State']}")
    return found


def mapping(
    container_id: int = 0, host_id: int = USERNS_HOST_ID, length: int = USERNS_LENGTH
) -> cri.IdMapping:
    return cri.IdMapping(container_id=container_id, host_id=host_id, length=length)


async def test_a_pod_in_a_user_namespace_of_its_own(node: Node) -> None:
    """critest's UserNamespaces specs (NamespaceMode_POD with one mapping of each kind): the
    container sees the pod's mappings, is root inside and an unprivileged host id outside, owns
    its root filesystem (the image's layers mapped, not copied), and the pod's init is that
    namespace's; NODE is the host's mappings."""
    reply = await node.call("Status", cri.StatusRequest(verbose=True))
    features = {handler.name: handler.features for handler in reply.runtime_handlers}
    assert features["cell"].user_namespaces
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=[mapping()], gids=[mapping()])
    pod_id = await run_pod(node.client, userns_pod("userns", userns))
    status = (await pod_status(node.client, pod_id)).status
    assert status.linux.namespaces.options.userns_options == userns  # type: ignore[union-attr]
    context = cri.LinuxContainerSecurityContext(namespace_options=cri.NamespaceOption(userns_options=userns))
    container = await node.run(
        pod_id, node.config("c", TOP, linux=cri.LinuxContainerConfig(security_context=context))
    )
    await node.wait_state(container, RUNNING)

    async def shell(script: str) -> str:
        reply = await node.exec_sync(container, ["sh", "-c", script])
        assert reply.exit_code == 0, (script, reply)
        return reply.stdout.decode()

    assert (await shell("cat /proc/self/uid_map")).split() == ["0", str(USERNS_HOST_ID), str(USERNS_LENGTH)]
    assert (await shell("cat /proc/self/gid_map")).split() == ["0", str(USERNS_HOST_ID), str(USERNS_LENGTH)]
    assert await shell("id -u; stat -c %u /bin/busybox; touch /written && stat -c %u /written") == "0\n0\n0\n"
    pid = (await node.status_reply(container, verbose=True)).info
    top = int(json.loads(pid["info"])["pid"])
    host_ids = [
        line.split()[1]
        for line in Path(f"/proc/{top}/status").read_text().splitlines()
        if line.startswith(("Uid:", "Gid:"))
    ]
    assert host_ids == [str(USERNS_HOST_ID)] * 2
    upper = list(node.daemon.root.rglob("upper/written"))
    assert len(upper) == 1 and upper[0].stat().st_uid == USERNS_HOST_ID  # what it wrote is its own
    # The pod's init is that namespace's, confined: the pause image's id there, no capabilities.
    assert (await shell("grep -E '^(Uid|CapEff)' /proc/1/status")).split() == [
        "Uid:",
        *["65535"] * 4,
        "CapEff:",
        "0" * 16,
    ]
    assert (await shell("cat /proc/1/comm")) == "aurae-pod-init\n"
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    # Its init is gone, reaped by the daemon (not a zombie left to whatever adopts orphans).
    assert processes_of_uid(USERNS_HOST_ID + 65535) == []

    host = await run_pod(
        node.client, userns_pod("host-users", cri.UserNamespace(mode=cri.NamespaceMode.NODE))
    )
    plain = await node.run(host, node.config("c", TOP))
    await node.wait_state(plain, RUNNING)
    seen = (await node.exec_sync(plain, ["cat", "/proc/self/uid_map"])).stdout.decode()
    assert seen.split() == Path("/proc/self/uid_map").read_text().split()
    await node.stop_pod(host)
    await node.remove_pod(host)


async def test_user_namespaces_it_cannot_give_are_refused(node: Node) -> None:
    """critest: more than one mapping, container id 0 unmapped, CONTAINER and TARGET modes."""
    POD_MODE = cri.NamespaceMode.POD
    for userns in (
        cri.UserNamespace(
            mode=POD_MODE, uids=[mapping(), mapping(host_id=2000)], gids=[mapping(), mapping(host_id=2000)]
        ),
        cri.UserNamespace(mode=POD_MODE, uids=[mapping(container_id=1)], gids=[mapping(container_id=1)]),
        cri.UserNamespace(mode=POD_MODE, uids=[mapping(host_id=0)], gids=[mapping(host_id=0)]),
        cri.UserNamespace(mode=cri.NamespaceMode.CONTAINER),
        cri.UserNamespace(mode=cri.NamespaceMode.TARGET),
    ):
        error = await cri_error(run_pod(node.client, userns_pod("refused", userns)))
        assert error.code == "INVALID_ARGUMENT" and "userns_options" in error.message, error
    userns = cri.UserNamespace(mode=POD_MODE, uids=[mapping()], gids=[mapping()])
    error = await cri_error(run_pod(node.client, userns_pod("refused", userns, pid=cri.NamespaceMode.NODE)))
    assert error.code == "INVALID_ARGUMENT", error
    assert await node.pod_ids() == []


LAYERED_IMAGE = f"{TEST_IMAGES}/aurae-layered:1"
"""tests.support.images' multilayer image, as an image volume of several layers."""


def in_user_namespace(userns: cri.UserNamespace) -> cri.LinuxContainerConfig:
    """A container's Linux config joining its pod's user namespace (as the kubelet asks)."""
    options = cri.NamespaceOption(userns_options=userns)
    return cri.LinuxContainerConfig(
        security_context=cri.LinuxContainerSecurityContext(namespace_options=options)
    )


def staged_mounts(container_id: str) -> list[str]:
    """The container's mounts below the default userns_rootfs_dir: its rootfs's bind and its
    idmapped binds."""
    return mounts_below(DEFAULT_USERNS_ROOTFS_DIR / container_id)


def host_volume(tmp_path: Path) -> Path:
    """A host directory as the kubelet makes an emptyDir: host root's, 0755, a root-owned file in it."""
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o755)
    volume.chmod(0o755)
    (volume / "owned").write_text("host\n")
    os.chown(volume, 0, 0)
    os.chown(volume / "owned", 0, 0)
    return volume


async def test_a_user_namespaced_pods_volumes_are_idmapped(
    node: Node, mirror: LocalRegistry, tmp_path: Path
) -> None:
    """KEP-127: in a pod with its own user namespace, a host path volume is idmapped (its host
    root's files are the pod root's, what the pod's root writes is the host root's), read-only
    where asked; the pod's /etc files and /dev/shm too; an image volume's files are root's as
    in its rootfs, one layer or several. The staged mounts go with the container."""
    volume = host_volume(tmp_path)
    publish(build_multilayer_layout(tmp_path / "layered"), mirror, LAYERED_IMAGE)
    await pull_image(node.client, LAYERED_IMAGE)
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=[mapping()], gids=[mapping()])
    pod_id = await run_pod(node.client, userns_pod("userns-volumes", userns))
    mounts = [
        cri.Mount(container_path="/data", host_path=str(volume)),
        cri.Mount(container_path="/ro", host_path=str(volume), readonly=True),
        cri.Mount(container_path="/image", image=cri.ImageSpec(image=BUSYBOX_IMAGE), readonly=True),
        cri.Mount(container_path="/layered", image=cri.ImageSpec(image=LAYERED_IMAGE), readonly=True),
    ]
    container = await node.run(pod_id, node.config("c", TOP, mounts=mounts, linux=in_user_namespace(userns)))
    await node.wait_state(container, RUNNING)

    async def shell(script: str) -> cri.ExecSyncResponse:
        return await node.exec_sync(container, ["sh", "-c", script])

    seen = [
        "/data",
        "/data/owned",
        "/ro/owned",
        "/etc/hosts",
        "/etc/resolv.conf",
        "/dev/shm",
        "/image/bin/busybox",
        "/layered/etc/app.conf",
    ]
    owners = await shell(f"stat -c %u:%g {' '.join(seen)}")
    assert owners.stdout.decode().split() == ["0:0"] * len(seen), owners
    written = await shell("echo pod > /data/new && stat -c %u:%g /data/new")
    assert (written.exit_code, written.stdout) == (0, b"0:0\n"), written
    assert ((volume / "new").stat().st_uid, (volume / "new").stat().st_gid) == (0, 0)  # host root's
    refused = await shell("touch /ro/x")
    assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr, refused
    assert (await shell("cat /layered/etc/app.conf")).stdout == b"mode=final\n"  # the top layer's
    staged = staged_mounts(container)
    assert any("/mounts/" in point for point in staged), staged
    await node.stop(container)
    await node.remove(container)
    assert staged_mounts(container) == []
    assert not (DEFAULT_USERNS_ROOTFS_DIR / container).exists()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


@pytest.fixture
def ramfs_volume(tmp_path: Path) -> Iterator[Path]:
    """A host directory on ramfs, a filesystem that takes no idmapped mount (unmounted at the end)."""
    volume = tmp_path / "ramfs"
    volume.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(volume)], check=True)
    try:
        yield volume
    finally:
        subprocess.run(["umount", "--lazy", str(volume)], check=True)


async def test_a_volume_that_cannot_be_idmapped_is_refused(node: Node, ramfs_volume: Path) -> None:
    """A user-namespaced pod's volume on a filesystem that refuses idmapping: CreateContainer
    fails naming the mount and the filesystem (as containerd's does), rather than a plain bind
    whose files the pod's root would see as nobody's; nothing of the attempt is left mounted."""
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=[mapping()], gids=[mapping()])
    pod_id = await run_pod(node.client, userns_pod("userns-ramfs", userns))
    mounts = [cri.Mount(container_path="/refused", host_path=str(ramfs_volume))]
    config = node.config("c", TOP, mounts=mounts, linux=in_user_namespace(userns))
    error = await cri_error(node.create(pod_id, config))
    assert error.code == "FAILED_PRECONDITION", error
    assert "/refused" in error.message and "ramfs" in error.message, error
    assert await node.ids() == []
    # Ours: the staged rootfs bind names this daemon's state directory in its overlay options.
    ours = [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(node.daemon.root) in line
    ]
    assert not [line for line in ours if f" {DEFAULT_USERNS_ROOTFS_DIR}/" in line]
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


async def test_staged_mounts_left_by_a_daemon_killed_mid_create_are_removed_at_start(
    node: Node, tmp_path: Path
) -> None:
    """A daemon killed with -9 while it made a user-namespaced container (its record still
    "creating"): at restart its rootfs bind and idmapped binds are found in the mount table
    and removed with it. Made by marking a created container's record so."""
    volume = host_volume(tmp_path)
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=[mapping()], gids=[mapping()])
    pod_id = await run_pod(node.client, userns_pod("userns-killed", userns))
    mounts = [cri.Mount(container_path="/data", host_path=str(volume))]
    container = await node.create(
        pod_id, node.config("c", TOP, mounts=mounts, linux=in_user_namespace(userns))
    )
    staged = staged_mounts(container)
    assert any("/mounts/" in point for point in staged), staged
    node.daemon.kill9()
    with contextlib.closing(sqlite3.connect(node.daemon.root / "state" / "auraed.db")) as db, db:
        (doc,) = db.execute("SELECT doc FROM records WHERE key = ?", (container,)).fetchone()
        record = json.loads(doc) | {"state": "creating"}
        db.execute("UPDATE records SET doc = ? WHERE key = ?", (json.dumps(record), container))
    node.daemon.start()
    await node.client.close()
    node.client = cri_client(node.daemon)
    assert await node.ids() == []
    assert staged_mounts(container) == []
    assert not (DEFAULT_USERNS_ROOTFS_DIR / container).exists()
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)


# -- image volumes (KEP-4639) -------------------------------------------------------------------


async def test_image_volumes(node: Node) -> None:
    """An image mounted as a volume: the image's files, read-only and not executable, its
    sub path resolved inside it; an image not pulled, or a sub path out of it, refused; the
    image kept while a container mounts it; the mount gone with the container."""
    pod_id = await node.run_pod("image-volumes")
    image = cri.ImageSpec(image=BUSYBOX_IMAGE)
    volumes = [
        cri.Mount(container_path="/volume", image=image, readonly=True),
        cri.Mount(container_path="/sub", image=image, image_sub_path="bin", readonly=True),
    ]
    container = await node.run(pod_id, node.config("c", TOP, mounts=volumes))
    await node.wait_state(container, RUNNING)

    async def shell(script: str) -> cri.ExecSyncResponse:
        return await node.exec_sync(container, ["sh", "-c", script])

    assert (await shell("test -x /volume/bin/busybox && ls /sub/busybox")).stdout == b"/sub/busybox\n"
    refused = await shell("touch /volume/new")
    assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
    not_executable = await shell("/volume/bin/busybox true")
    assert not_executable.exit_code != 0 and b"Permission denied" in not_executable.stderr
    status = await node.status(container)
    assert [
        (m.container_path, m.image.image if m.image else "", m.image_sub_path) for m in status.mounts
    ] == [
        ("/volume", BUSYBOX_IMAGE, ""),
        ("/sub", BUSYBOX_IMAGE, "bin"),
    ]
    # In use: RemoveImage refuses (the kubelet's GC skips it), as for a container's own image.
    removal = await cri_error(
        node.client.call(IMAGE_SERVICE, "RemoveImage", cri.RemoveImageRequest(image=image), CALL_TIMEOUT)
    )
    assert removal.code == "FAILED_PRECONDITION", removal
    mounted = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if container in line]
    assert len(mounted) >= 3  # the rootfs and the two volumes
    for bad, field in (
        (
            cri.Mount(
                container_path="/x", image=cri.ImageSpec(image="localhost/never-pulled:1"), readonly=True
            ),
            "source",
        ),
        (
            cri.Mount(container_path="/x", image=image, image_sub_path="no/such/dir", readonly=True),
            "sub_path",
        ),
        (
            cri.Mount(container_path="/x", image=image, image_sub_path="../..", readonly=True),
            "image_sub_path",
        ),
    ):
        error = await cri_error(node.create(pod_id, node.config(f"bad-{field}", TOP, mounts=[bad])))
        assert error.code in ("NOT_FOUND", "INVALID_ARGUMENT") and field in error.message, error
    await node.stop_pod(pod_id)
    await node.remove_pod(pod_id)
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if container in line]
