"""A pod as a guest VM, through the CRI socket, as a kubelet drives it: RunPodSandbox with the `vm`
handler, a container created and started in the pod's guest, its output read from the kubelet's
log path on the host, an ExecSync, then the pod stopped and removed.

    python examples/cri_vm_pod.py --cri-socket /run/aurae/cri.sock --image localhost/busybox:demo \\
        --log-dir /tmp/pod-logs [--work DIR]

The daemon must have a guest image and a CNI network in its ``cni_conf_dir``. With ``--work``
(hack/demo's way), a private bridge network for the pod is made in ``DIR/net.d`` first, its
subnet checked against every host address and route, and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient

RUNTIME = "runtime.v1.RuntimeService"
HELLO = 'echo "hello from $(hostname), kernel $(uname -r), pod IP $(ip -4 -o addr show eth0 | cut -d" " -f7)"'
HELLO = 'echo "hello from $(hostname), kernel $(uname -r), pod IP $(ip -4 -o addr show eth0 | cut -d" " -f7)"'
BOOT_TIMEOUT = 600.0  # seconds: a cold guest boot under TCG, with the image placed in it


@contextlib.contextmanager
def pod_network(work: Path | None) -> Iterator[None]:
    if work is None:
        yield
        return
    from tests.support.cni import cni_network  # the test suite's private bridge network

    with cni_network(work) as network:
        network.write(network.conflist())
        print(f"pod network {network.name}: bridge {network.bridge}, {network.subnet}")
        yield


async def wait_exited(client: AuraeClient, container_id: str) -> cri.ContainerStatus:
    deadline = time.monotonic() + BOOT_TIMEOUT
    while time.monotonic() < deadline:
        reply = await client.call(
            RUNTIME, "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id)
        )
        if reply.status.state == cri.ContainerState.CONTAINER_EXITED:
            return reply.status  # type: ignore[no-any-return]
        await asyncio.sleep(0.5)
    raise TimeoutError(f"container {container_id[:13]} did not exit")


async def run(socket: str, image: str, log_dir: Path) -> None:
    client = AuraeClient(grpc.aio.insecure_channel(f"unix:{socket}"))
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="demo", namespace="default", uid="demo-uid"),
        hostname="demo-pod",
        log_directory=str(log_dir),
    )
    pod_id = ""
    try:
        started = time.monotonic()
        request = cri.RunPodSandboxRequest(config=config, runtime_handler="vm")
        pod_id = (await client.call(RUNTIME, "RunPodSandbox", request, BOOT_TIMEOUT)).pod_sandbox_id
        asked = cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id)
        status = (await client.call(RUNTIME, "PodSandboxStatus", asked)).status
        took = time.monotonic() - started
        print(f"pod {pod_id[:13]} ready in {took:.1f} s: a guest VM at {status.network.ip}")
        container = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="hello"),
            image=cri.ImageSpec(image=image),
            command=["sh", "-c", HELLO],
            log_path="hello.log",
        )
        create = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=config)
        container_id = (await client.call(RUNTIME, "CreateContainer", create, BOOT_TIMEOUT)).container_id
        await client.call(RUNTIME, "StartContainer", cri.StartContainerRequest(container_id=container_id))
        exited = await wait_exited(client, container_id)
        print(f"container {container_id[:13]} exited {exited.exit_code}; its log, {exited.log_path}:")
        print((await asyncio.to_thread(Path(exited.log_path).read_text)).rstrip())
        shell = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="shell"),
            image=cri.ImageSpec(image=image),
            command=["sleep", "3600"],
        )
        create = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=shell, sandbox_config=config)
        shell_id = (await client.call(RUNTIME, "CreateContainer", create, BOOT_TIMEOUT)).container_id
        await client.call(RUNTIME, "StartContainer", cri.StartContainerRequest(container_id=shell_id))
        execute = cri.ExecSyncRequest(
            container_id=shell_id, cmd=["sh", "-c", "ps; cat /proc/sys/kernel/hostname"], timeout=60
        )
        result = await client.call(RUNTIME, "ExecSync", execute, 120)
        print(f"ExecSync in {shell_id[:13]}, exit {result.exit_code}:\n{result.stdout.decode().rstrip()}")
    finally:
        if pod_id:
            await client.call(
                RUNTIME, "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), 120
            )
            await client.call(
                RUNTIME, "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id), 120
            )
            print(f"pod {pod_id[:13]} stopped and removed: its guest, tap and address are gone")
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cri-socket", required=True)
    parser.add_argument("--image", required=True, help="an image in the daemon's store")
    parser.add_argument("--log-dir", type=Path, required=True, help="the pod's log directory")
    parser.add_argument("--work", type=Path, help="make a private pod network in DIR/net.d")
    args = parser.parse_args()
    with pod_network(args.work):
        asyncio.run(run(args.cri_socket, args.image, args.log_dir))


if __name__ == "__main__":
    main()
