"""A kubelet's part, run inside a machine booted from the host image (test_host_image.py sends it
to a cell there): CRI calls on the machine's own CRI socket, their results as one JSON line.

It uses only what the image holds (its Python, grpcio and auraed's generated CRI messages), so
what it shows is what a kubelet on that machine would get. ``argv[1]`` is a JSON object: ``do``
(``status``, the default, ``run``, ``probe`` or ``remove``), ``socket``, and for ``run`` the
``image`` and ``host_port``; for ``probe`` the ``pod_id``, ``container_id`` and ``image_id``; for
``remove`` the ``pod_id``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient

RUNTIME = "runtime.v1.RuntimeService"
IMAGES = "runtime.v1.ImageService"
RESULT = "CRI-RESULT "
CALL_TIMEOUT = 300.0  # a pod's first CNI ADD and a container's start under TCG, on a loaded machine
RUNNING_WAIT = 120.0
POD_NAME = "web"
# busybox's httpd serving one page on the container's port 80.
SERVER = "mkdir -p /www && echo hello-from-pod > /www/index.html && exec httpd -f -p 80 -h /www"
# In the container: its own cgroup (v2, its namespace's root) and the limit there.
READ_LIMIT = "echo exec-ok; cat /sys/fs/cgroup/memory.max"
RESIZED_MEMORY = 64 << 20


async def status(client: AuraeClient) -> dict[str, Any]:
    version = await client.call(RUNTIME, "Version", cri.VersionRequest(), CALL_TIMEOUT)
    reply = await client.call(RUNTIME, "Status", cri.StatusRequest(), CALL_TIMEOUT)
    conditions = {c.type: c.status for c in reply.status.conditions}
    return {"runtime": version.runtime_name, "conditions": conditions}


async def run(client: AuraeClient, image: str, host_port: int) -> dict[str, Any]:
    found = await client.call(
        IMAGES, "ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=image)), CALL_TIMEOUT
    )
    metadata = cri.PodSandboxMetadata(name=POD_NAME, uid=f"{POD_NAME}-uid", namespace="default")
    pod = cri.PodSandboxConfig(
        metadata=metadata,
        hostname=POD_NAME,
        log_directory=f"/var/log/pods/default_{POD_NAME}_{POD_NAME}-uid",
        port_mappings=[cri.PortMapping(protocol=cri.Protocol.TCP, container_port=80, host_port=host_port)],
        linux=cri.LinuxPodSandboxConfig(),
    )
    # The cell handler: a vm pod here would be a guest under TCG inside TCG (minutes to serve).
    request = cri.RunPodSandboxRequest(config=pod, runtime_handler="cell")
    pod_id = (await client.call(RUNTIME, "RunPodSandbox", request, CALL_TIMEOUT)).pod_sandbox_id
    container = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="server"),
        image=cri.ImageSpec(image=found.image.id),
        command=["sh", "-c", SERVER],
        log_path="server/0.log",
    )
    create = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=pod)
    container_id = (await client.call(RUNTIME, "CreateContainer", create, CALL_TIMEOUT)).container_id
    await client.call(RUNTIME, "StartContainer", cri.StartContainerRequest(container_id=container_id))
    state = await wait_running(client, container_id)
    reply = await client.call(RUNTIME, "PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    return {
        "image_id": found.image.id,
        "pod_id": pod_id,
        "container_id": container_id,
        "container_state": state,
        "pod_ip": reply.status.network.ip,
    }


async def wait_running(client: AuraeClient, container_id: str) -> str:
    status = await wait_state(
        client, container_id, lambda state: state != cri.ContainerState.CONTAINER_CREATED
    )
    return str(status.state.name)


async def wait_state(
    client: AuraeClient, container_id: str, done: Callable[[cri.ContainerState], bool]
) -> cri.ContainerStatus:
    """The container's status once ``done`` says its state is what was waited for (or, past
    RUNNING_WAIT, as it is then)."""
    request = cri.ContainerStatusRequest(container_id=container_id)
    deadline = time.monotonic() + RUNNING_WAIT
    while True:
        status: cri.ContainerStatus = (
            await client.call(RUNTIME, "ContainerStatus", request, CALL_TIMEOUT)
        ).status
        if done(status.state) or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


async def probe(client: AuraeClient, pod_id: str, container_id: str, image_id: str) -> dict[str, Any]:
    """What a kubelet asks of a running pod on this machine's cgroup v2: exec, stats, a resize,
    and a container killed by its memory limit."""
    exec_sync = cri.ExecSyncRequest(container_id=container_id, cmd=["sh", "-c", READ_LIMIT], timeout=60)
    before = await client.call(RUNTIME, "ExecSync", exec_sync, CALL_TIMEOUT)
    limits = cri.LinuxContainerResources(memory_limit_in_bytes=RESIZED_MEMORY)
    update = cri.UpdateContainerResourcesRequest(container_id=container_id, linux=limits)
    await client.call(RUNTIME, "UpdateContainerResources", update, CALL_TIMEOUT)
    after = await client.call(RUNTIME, "ExecSync", exec_sync, CALL_TIMEOUT)
    stats = (
        await client.call(RUNTIME, "ContainerStats", cri.ContainerStatsRequest(container_id=container_id))
    ).stats
    pod_stats = (
        await client.call(RUNTIME, "PodSandboxStats", cri.PodSandboxStatsRequest(pod_sandbox_id=pod_id))
    ).stats
    return {
        "exec_before": [before.exit_code, before.stdout.decode().split()],
        "exec_after": [after.exit_code, after.stdout.decode().split()],
        "cpu_ns": stats.cpu.usage_core_nano_seconds.value,
        "working_set": stats.memory.working_set_bytes.value,
        "pod_cpu_ns": pod_stats.linux.cpu.usage_core_nano_seconds.value,
        "pod_memory": pod_stats.linux.memory.working_set_bytes.value,
        "oom": await oom_killed(client, pod_id, image_id),
    }


async def oom_killed(client: AuraeClient, pod_id: str, image_id: str) -> list[Any]:
    """A container of 16 MiB that asks for 64: its exit code and reason once it ended."""
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="hog"),
        image=cri.ImageSpec(image=image_id),
        command=["dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1"],
        log_path="hog/0.log",
        linux=cri.LinuxContainerConfig(resources=cri.LinuxContainerResources(memory_limit_in_bytes=16 << 20)),
    )
    create = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
    hog = (await client.call(RUNTIME, "CreateContainer", create, CALL_TIMEOUT)).container_id
    await client.call(RUNTIME, "StartContainer", cri.StartContainerRequest(container_id=hog), CALL_TIMEOUT)
    status = await wait_state(client, hog, lambda state: state == cri.ContainerState.CONTAINER_EXITED)
    return [str(status.state.name), status.exit_code, status.reason]


async def remove(client: AuraeClient, pod_id: str) -> dict[str, Any]:
    await client.call(
        RUNTIME, "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), CALL_TIMEOUT
    )
    await client.call(RUNTIME, "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    pods = (await client.call(RUNTIME, "ListPodSandbox", cri.ListPodSandboxRequest())).items
    containers = (await client.call(RUNTIME, "ListContainers", cri.ListContainersRequest())).containers
    return {"pods": len(pods), "containers": len(containers)}


async def main(args: dict[str, Any]) -> dict[str, Any]:
    client = AuraeClient(grpc.aio.insecure_channel(f"unix:{args['socket']}"))
    try:
        do = args.get("do", "status")
        if do == "run":
            return await run(client, args["image"], int(args["host_port"]))
        if do == "probe":
            return await probe(client, args["pod_id"], args["container_id"], args["image_id"])
        if do == "remove":
            return await remove(client, args["pod_id"])
        return await status(client)
    finally:
        await client.close()


if __name__ == "__main__":
    print(RESULT + json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
