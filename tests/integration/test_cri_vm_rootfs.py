"""A ``vm`` pod's container runs from the host's snapshots of its image, shared read-only through
the pod's virtio-fs share (issue 35), with real QEMU guests (TCG here) and real virtiofsd.

Two pods are booted for the module (a boot costs seconds of TCG), each with a container of one
image: busybox, a layer of files and a layer that deletes (whiteouts) and hides a directory
(opaque), so the guest's overlay must read both kinds of overlay metadata through virtiofsd. In
order:

- the container reads its image's files (deletions and the opaque directory as the image means
  them), with the image's config (working directory, environment, user); it writes its own upper
  layer in the guest, never the host's snapshot; its guest holds no image of its own; the pod's
  share holds exactly the image's layers, read-only at virtiofsd;
- the two pods read the very same snapshots on the host: one per layer, bound in each share;
- a ``kill -9`` of the host auraed changes nothing of it: what the container wrote and read is
  there after the restart, and so is the layers' use;
- the image removed while both pods use it: the image is gone, its layers stay while a container
  reads them and are collected once the last is removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient
from auraed.pki import PkiPaths
from tests.integration.test_cri_containers import Node, eventually
from tests.integration.vm_pods_helpers import (
    in_share_namespace,
    leftovers_of_pod,
    module_vm_node,
    remove_every_pod,
)
from tests.support.cri import (
    BUSYBOX_IMAGE,
    cri_client,
    image_status,
    pod_config,
    publish,
    pull_image,
    remove_image,
    run_pod,
)
from tests.support.images import (
    MULTILAYER_ABSENT,
    MULTILAYER_PRESENT,
    BuiltImage,
    build_multilayer_layout,
)
from tests.support.registry import LocalRegistry

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONTAINERS = "aurae.containers.v0.ContainerService"
IMAGE = "registry.k8s.io/e2e-test-images/aurae-multilayer:1"
BOOT_TIMEOUT = 300.0
EXEC_TIMEOUT = 60
PRIVILEGED_POD = cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(privileged=True))
AS_ROOT_PRIVILEGED = cri.LinuxContainerConfig(
    security_context=cri.LinuxContainerSecurityContext(privileged=True, run_as_user=cri.Int64Value(0))
)
SHARE_COPY = "/tmp/share"
"""Where the privileged container mounts its pod's share again, from its virtio-fs tag."""


@dataclass
class RootfsPods:
    node: Node
    image: BuiltImage
    image_id: str
    first: str  # pod A: a privileged container as root
    second: str  # pod B: a container as the image's user
    reader: str  # pod A's container
    other: str  # pod B's container

    @property
    def shares(self) -> Path:
        return self.node.daemon.root / "run" / "pod-shares"

    @property
    def snapshots(self) -> Path:
        return self.node.daemon.root / "state" / "images" / "snapshots"

    def layer_snapshots(self) -> list[Path]:
        """The image's layers as the host's store keeps them, bottom first."""
        return [self.snapshots / layer.diff_id.removeprefix("sha256:") for layer in self.image.layers]

    async def run(self, container: str, script: str) -> list[str]:
        """``script`` in ``container`` (sh -c): its output's lines, stdout and stderr together."""
        reply = await self.node.exec_sync(container, ["sh", "-c", f"{script} 2>&1"], EXEC_TIMEOUT)
        return reply.stdout.decode(errors="replace").splitlines()


def bound_snapshots(shares: Path, pod_id: str) -> list[str]:
    """The snapshot directories (their names) bound in the pod's share, as the mountinfo of its
    mount namespace says: each mount's root in its filesystem, for mount points below the share."""
    served = f"{shares / pod_id / 'share'}/"
    found = []
    for line in in_share_namespace(shares / pod_id, "cat", "/proc/self/mountinfo").splitlines():
        fields = line.split()
        root, point = fields[3], fields[4]
        if point.startswith(served) and "/images/snapshots/" in root:
            found.append(root.rsplit("/", 1)[1])
    return found


async def create(
    node: Node, pod: tuple[str, cri.PodSandboxConfig], image_id: str, name: str,
    linux: cri.LinuxContainerConfig | None = None,
) -> str:  # fmt: skip
    """A container of the image running ``sleep`` in ``pod`` (its id and config), started."""
    pod_id, config = pod
    container = node.config(name, ["sleep", "3600"], linux=linux)
    container.image = cri.ImageSpec(image=image_id, user_specified_image=IMAGE)
    request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=config)
    container_id = str((await node.call("CreateContainer", request, BOOT_TIMEOUT)).container_id)
    await node.start(container_id)
    return container_id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pods(
    busybox_layout: BuiltImage, guest_image: Path, pki: PkiPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RootfsPods]:
    """Two vm pods, each running a container of the multilayer image (held by the module); at
    the end they are removed and nothing of them or of the daemon is left."""
    work = tmp_path_factory.mktemp("vm-rootfs")
    image = build_multilayer_layout(work / "layout")
    with LocalRegistry() as registry:
        publish(busybox_layout, registry, BUSYBOX_IMAGE)
        publish(image, registry, IMAGE)
        async with module_vm_node(
            work, "aurae-rootfs-", guest_image, pki, registry, "--vm-machine", "q35"
        ) as node:
            image_id = await pull_image(node.client, IMAGE)
            first_config = pod_config("rootfs-a", namespace="vm-rootfs", linux=PRIVILEGED_POD)
            second_config = pod_config("rootfs-b", namespace="vm-rootfs")
            first, second = await asyncio.wait_for(
                asyncio.gather(
                    run_pod(node.client, first_config, "vm"), run_pod(node.client, second_config, "vm")
                ),
                BOOT_TIMEOUT,
            )
            reader = await create(node, (first, first_config), image_id, "reader", AS_ROOT_PRIVILEGED)
            other = await create(node, (second, second_config), image_id, "other")
            yield RootfsPods(node, image, image_id, first, second, reader, other)
            await remove_every_pod(node)
            for pod_id in (first, second):
                assert leftovers_of_pod(node.daemon, node.network, pod_id) == {}


async def test_a_container_runs_from_the_hosts_snapshots(pods: RootfsPods) -> None:
    reader = pods.reader
    # The image's files, deletions and opaque directory as the image means them, read through
    # the share: the guest's overlay over virtiofs, whiteouts and the opaque mark included.
    files = [path for path, content in MULTILAYER_PRESENT.items() if isinstance(content, bytes) and content]
    lines = await pods.run(reader, f"cd / && cat {' '.join(files)}")
    assert lines == [line for path in files for line in MULTILAYER_PRESENT[path].decode().splitlines()]  # type: ignore[union-attr]
    absent = await pods.run(
        reader, " ".join(f"test -e /{path} && echo THERE {path};" for path in MULTILAYER_ABSENT)
    )
    assert absent == []
    assert await pods.run(reader, "ls /opt/app/lib; readlink /opt/app/current") == ["c.txt", "bin/run"]
    # The image's config came with it: its working directory and environment.
    assert await pods.run(reader, "pwd; echo $APP_MODE") == ["/opt/app", "test"]

    # Its root is an overlay over the share's layers, its upper layer in the guest (tmpfs).
    [root] = [line for line in await pods.run(reader, "cat /proc/self/mounts") if line.split()[1] == "/"]
    options = dict(o.split("=", 1) for o in root.split()[3].split(",") if "=" in o)
    lowers = options["lowerdir"].split(":")
    assert len(lowers) == len(pods.image.layers)
    assert all(lower.startswith("/run/aurae/share/") for lower in lowers), root
    assert options["upperdir"].startswith("/run/aurae/state/containers/"), root

    # What it writes is its own: the host's snapshots stay as they were.
    written = await pods.run(
        reader,
        "echo written > /etc/app.conf && rm /opt/app/data/keep.txt && echo new > /opt/app/lib/new.txt"
        " && cat /etc/app.conf && ls /opt/app/data && ls /opt/app/lib",
    )
    assert written == ["written", "c.txt", "new.txt"], written
    top = pods.layer_snapshots()[-1]
    assert (top / "etc" / "app.conf").read_text() == "mode=final\n"
    assert (pods.layer_snapshots()[1] / "opt" / "app" / "data" / "keep.txt").read_text() == "kept\n"
    assert not (top / "opt" / "app" / "lib" / "new.txt").exists()

    # The pod's share holds exactly its image's layers, and they are read-only where virtiofsd
    # serves them: root in a privileged container, the share mounted again, writes nothing.
    assert sorted(bound_snapshots(pods.shares, pods.first)) == sorted(p.name for p in pods.layer_snapshots())
    tried = await pods.run(
        reader,
        f"mkdir -p {SHARE_COPY} && mount -t virtiofs aurae-share {SHARE_COPY} && echo mounted; "
        f"for layer in {SHARE_COPY}/*/[0-9]*; do"
        "  test -d $layer/etc && { echo x > $layer/etc/app.conf && echo WROTE $layer; }; "
        "  touch $layer/planted && echo PLANTED $layer; "
        f"done; umount {SHARE_COPY}; true",
    )
    assert "mounted" in tried and not [line for line in tried if line.startswith(("WROTE", "PLANTED"))], tried
    assert not any((layer / "planted").exists() for layer in pods.layer_snapshots())

    # The guest holds nothing of the image: its own store is empty.
    async with pods.node.daemon.client() as aurae:
        in_guest = AuraeClient(aurae.channel, vm=f"pod-{pods.first[:16]}")
        listed = await in_guest.call(
            CONTAINERS, "ListImages", containers_pb.ContainerServiceListImagesRequest()
        )
        assert listed.images == []


async def test_two_pods_of_one_image_read_the_same_snapshots(pods: RootfsPods) -> None:
    # The image's user (app, from its /etc/passwd, read through the share) runs the second one.
    assert await pods.run(pods.other, "id -u; cat /home/app/owned.txt") == ["1000", "owned by app"]
    assert await pods.run(pods.other, "cat /etc/app.conf") == ["mode=final"]  # not pod A's write
    layers = sorted(p.name for p in pods.layer_snapshots())
    assert sorted(bound_snapshots(pods.shares, pods.first)) == layers
    assert sorted(bound_snapshots(pods.shares, pods.second)) == layers
    # One snapshot per layer on the host, whatever the pods: busybox's layer is the image's first.
    assert sorted(p.name for p in pods.snapshots.iterdir()) == layers


async def test_the_rootfs_survives_a_kill_9_of_the_host_auraed(pods: RootfsPods) -> None:
    node = pods.node
    node.daemon.kill9()
    await asyncio.sleep(1)
    node.daemon.start()
    await node.client.close()
    node.client = cri_client(node.daemon)
    assert await pods.run(pods.reader, "cat /etc/app.conf /opt/app/lib/new.txt") == ["written", "new"]
    assert await pods.run(pods.reader, "cat /opt/app/lib/c.txt") == ["the only file left in lib"]
    assert sorted(bound_snapshots(pods.shares, pods.first)) == sorted(p.name for p in pods.layer_snapshots())


async def test_an_image_removed_while_pods_use_it_keeps_its_layers_until_their_containers_are_gone(
    pods: RootfsPods,
) -> None:
    node = pods.node
    await remove_image(node.client, pods.image_id)
    assert await image_status(node.client, IMAGE) is None
    blobs = node.daemon.root / "state" / "images" / "blobs" / "sha256"
    assert not (blobs / pods.image.config_digest.removeprefix("sha256:")).exists()
    # Its layers stay: the restarted daemon knows both containers read them.
    assert all(layer.is_dir() for layer in pods.layer_snapshots())
    assert await pods.run(pods.other, "cat /opt/app/lib/c.txt") == ["the only file left in lib"]

    await node.stop(pods.other)
    await node.remove(pods.other)
    assert all(layer.is_dir() for layer in pods.layer_snapshots())  # the reader still reads them
    assert await pods.run(pods.reader, "cat /opt/app/lib/c.txt") == ["the only file left in lib"]

    await node.stop(pods.reader)
    await node.remove(pods.reader)
    busybox_layer = pods.layer_snapshots()[0]  # busybox's own, which its image still names

    async def collected() -> bool:
        return [layer.exists() for layer in pods.layer_snapshots()] == [True, False, False]

    await eventually(collected, 60)
    assert busybox_layer.is_dir()
    assert bound_snapshots(pods.shares, pods.first) == bound_snapshots(pods.shares, pods.second) == []
