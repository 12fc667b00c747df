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
  reads them and are collected once the last is removed;
- an image volume (KEP-4639) in a vm pod: another image's layers, shared as the rootfs's are,
  mounted read-only by the guest, its sub path resolved inside the image; removed while mounted,
  the image's layers stay until the container is gone.
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
from tests.integration.test_cri_containers import (
    USERNS_HOST_ID,
    USERNS_LENGTH,
    Node,
    cri_error,
    eventually,
    mapping,
    userns_pod,
)
from tests.integration.vm_pods_helpers import (
    in_share_namespace,
    leftovers_of_pod,
    module_vm_node,
    remove_every_pod,
    veths_on,
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
    Entry,
    File,
    Symlink,
    build_layout,
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
VOLUME_IMAGE = "registry.k8s.io/e2e-test-images/aurae-volume:1"
VOLUME_FILES: dict[str, Entry] = {
    "data/hello.txt": b"hello from the volume image\n",
    "data/run.sh": File(b"#!/bin/sh\necho ran\n", 0o755),
    "data/sub/inner.txt": b"inner\n",
    "escape": Symlink("/"),  # absolute: resolved inside the image, never the guest's /
    "etc-link": Symlink("/etc"),
    "climb": Symlink("../../../../etc"),  # up past the image's root: stays at it
}
VOLUME_CHANGES: dict[str, Entry] = {"etc/marker": b"the volume image's etc\n"}


@dataclass
class RootfsPods:
    node: Node
    image: BuiltImage
    image_id: str
    first: str  # pod A: a privileged container as root
    second: str  # pod B: a container as the image's user
    reader: str  # pod A's container
    other: str  # pod B's container
    volume: BuiltImage  # an image that pod B's last container mounts as a volume

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
    volume = build_layout(work / "volume-layout", [VOLUME_FILES, VOLUME_CHANGES])
    with LocalRegistry() as registry:
        publish(busybox_layout, registry, BUSYBOX_IMAGE)
        publish(image, registry, IMAGE)
        publish(volume, registry, VOLUME_IMAGE)
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
            yield RootfsPods(node, image, image_id, first, second, reader, other, volume)
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


async def test_a_pod_with_hostusers_false_runs_in_a_user_namespace_in_its_guest(
    pods: RootfsPods, tmp_path: Path
) -> None:
    """A vm pod with a user namespace of its own (issue 34): the share's binds are idmapped on the
    host by the pod's mappings, the guest runs the container in a user namespace of the same
    mappings. Inside it is root and owns its image's files; the guest sees it run as the mapped
    id; a writable volume takes its files as the host's root's (the idmap's way back). A second
    pod, with other mappings and no shared PID namespace, has its container's own PID namespace
    made inside its user namespace, and its sysctls set."""
    node = pods.node
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "host.txt").write_text("the host's\n")
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=[mapping()], gids=[mapping()])
    config = userns_pod("userns-vm", userns)
    other_id = 2 * USERNS_HOST_ID
    other_userns = cri.UserNamespace(
        mode=cri.NamespaceMode.POD, uids=[mapping(host_id=other_id)], gids=[mapping(host_id=other_id)]
    )
    other_config = userns_pod("userns-vm-own-pid", other_userns, pid=cri.NamespaceMode.CONTAINER)
    assert other_config.linux is not None
    other_config.linux.sysctls = {"kernel.shm_rmid_forced": "1", "net.ipv4.ip_unprivileged_port_start": "80"}
    veths = veths_on(node.network.bridge)
    pod_id, other_pod = await asyncio.wait_for(
        asyncio.gather(run_pod(node.client, config, "vm"), run_pod(node.client, other_config, "vm")),
        BOOT_TIMEOUT,
    )
    own_pid = cri.NamespaceOption(pid=cri.NamespaceMode.CONTAINER, userns_options=other_userns)
    alone = await node.run(
        other_pod,
        node.config(
            "own-pid", ["sleep", "3600"],
            linux=cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(
                namespace_options=own_pid, run_as_user=cri.Int64Value(0)
            )),
        ),
    )  # fmt: skip
    seen = await pods.run(alone, "id -u; cat /proc/self/uid_map; cat /proc/1/cmdline | tr '\\0' ' '")
    # The pod's sysctls: an IPC one in its user namespace's IPC namespace, a network one in the guest's.
    sysctls = "/proc/sys/kernel/shm_rmid_forced /proc/sys/net/ipv4/ip_unprivileged_port_start"
    assert await pods.run(alone, f"cat {sysctls}") == ["1", "80"]
    assert [line.split() for line in seen] == [
        ["0"],
        ["0", str(other_id), str(USERNS_LENGTH)],
        ["sleep", "3600"],
    ]
    context = cri.LinuxContainerSecurityContext(
        namespace_options=cri.NamespaceOption(userns_options=userns), run_as_user=cri.Int64Value(0)
    )
    container = node.config(
        "mapped", ["sleep", "3600"], linux=cri.LinuxContainerConfig(security_context=context),
        mounts=[
            cri.Mount(container_path="/vol", host_path=str(volume)),
            cri.Mount(container_path="/img", image=cri.ImageSpec(image=IMAGE), readonly=True),
        ],
    )  # fmt: skip
    container.image = cri.ImageSpec(image=pods.image_id, user_specified_image=IMAGE)
    request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=container, sandbox_config=config)
    mapped = str((await node.call("CreateContainer", request, BOOT_TIMEOUT)).container_id)
    await node.start(mapped)

    maps = await pods.run(mapped, "cat /proc/self/uid_map /proc/self/gid_map")
    assert [line.split() for line in maps] == [["0", str(USERNS_HOST_ID), str(USERNS_LENGTH)]] * 2, maps
    # Root inside, owning the image's files (the app user's stay the app user's); it writes its
    # rootfs (new files, and copies up of the image's).
    assert await pods.run(
        mapped,
        "id -u; stat -c %u /bin/busybox /home/app/owned.txt; touch /written && stat -c %u /written; "
        "echo mine > /etc/app.conf && cat /etc/app.conf",
    ) == ["0", "0", "1000", "0", "mine"]
    # An image volume's layers are mapped by the host as the rootfs's.
    assert await pods.run(mapped, "stat -c %u /img/bin/busybox /img/home/app/owned.txt") == ["0", "1000"]
    # The volume: the host's root's file is root's inside, and what root writes is the host's root's.
    assert await pods.run(mapped, "stat -c %u /vol/host.txt; echo guest > /vol/from-guest && echo ok") == [
        "0",
        "ok",
    ]
    assert (volume / "from-guest").read_text() == "guest\n" and (volume / "from-guest").stat().st_uid == 0
    # The guest's view: the container's processes run as the mapped id, not as its root.
    async with node.daemon.client() as aurae:
        in_guest = AuraeClient(aurae.channel, vm=f"pod-{pod_id[:16]}")
        listed = await in_guest.call(
            CONTAINERS,
            "ListProcesses",
            containers_pb.ContainerServiceListProcessesRequest(container_id=mapped),
        )
    assert listed.processes and {p.uid for p in listed.processes} == {USERNS_HOST_ID}, listed
    # A volume of a filesystem the kernel cannot idmap (sysfs) is refused saying so; nothing of
    # it is left in the share.
    bound = bound_snapshots(pods.shares, pod_id)
    sysfs = cri.Mount(container_path="/k", host_path="/sys/kernel/mm", readonly=True)
    container.metadata = cri.ContainerMetadata(name="unmappable")
    container.mounts = [sysfs]
    error = await cri_error(node.call("CreateContainer", request, BOOT_TIMEOUT))
    assert error.code == "FAILED_PRECONDITION" and "cannot be idmapped" in error.message, error
    assert bound_snapshots(pods.shares, pod_id) == bound
    for pod in (pod_id, other_pod):
        await node.stop_pod(pod)
        await node.remove_pod(pod)
    for pod in (pod_id, other_pod):  # nothing of them left (the module's pods keep their veths)
        left = leftovers_of_pod(node.daemon, node.network, pod)
        assert left.pop("veths", veths) == veths and left == {}, left


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


# -- image volumes (KEP-4639) -------------------------------------------------------------------


def image_volume(path: str, sub_path: str = "", image: str = VOLUME_IMAGE) -> cri.Mount:
    return cri.Mount(
        container_path=path, image=cri.ImageSpec(image=image), image_sub_path=sub_path, readonly=True
    )


async def create_in_second_pod(pods: RootfsPods, name: str, mounts: list[cri.Mount]) -> str:
    """A busybox container running ``sleep`` in pod B with ``mounts`` (not started)."""
    config = pods.node.config(name, ["sleep", "3600"], mounts=mounts)
    request = cri.CreateContainerRequest(pod_sandbox_id=pods.second, config=config)
    return str((await pods.node.call("CreateContainer", request, BOOT_TIMEOUT)).container_id)


def volume_snapshots(pods: RootfsPods) -> list[Path]:
    return [pods.snapshots / layer.diff_id.removeprefix("sha256:") for layer in pods.volume.layers]


async def test_an_image_volume_in_a_vm_pod_is_the_images_files_read_only(pods: RootfsPods) -> None:
    """As on a cell (test_cri_containers.test_image_volumes): the image's files, read-only and
    not executable, a sub path resolved inside the image (an absolute symlink, or one climbing
    past its root, lands in the image); an image not pulled or a sub path out of it refused."""
    node = pods.node
    not_pulled = await cri_error(create_in_second_pod(pods, "not-pulled", [image_volume("/v")]))
    assert not_pulled.code == "NOT_FOUND" and "source" in not_pulled.message, not_pulled

    await pull_image(node.client, VOLUME_IMAGE)
    volumes = [
        image_volume("/volume"),
        image_volume("/sub", "data/sub"),
        image_volume("/escape", "escape"),
        image_volume("/etc-link", "etc-link"),
        image_volume("/climb", "climb"),
        image_volume("/busybox", image=BUSYBOX_IMAGE),  # one layer: a bind in the guest, not an overlay
    ]
    container = await create_in_second_pod(pods, "volumes", volumes)
    await node.start(container)
    assert (
        await pods.run(
            container,
            "cat /volume/data/hello.txt /sub/inner.txt /escape/data/hello.txt /etc-link/marker /climb/marker",
        )
        == ["hello from the volume image", "inner", "hello from the volume image"]
        + ["the volume image's etc"] * 2
    )
    assert await pods.run(container, "ls /etc-link; ls /climb") == ["marker", "marker"]
    assert await pods.run(container, "test -x /busybox/bin/busybox && echo there") == ["there"]
    refused = await pods.run(container, "touch /volume/new 2>&1 || echo refused")
    assert refused[-1] == "refused" and "Read-only file system" in refused[0], refused
    for program in ("/volume/data/run.sh", "/busybox/bin/busybox true"):
        not_executable = await pods.run(container, f"{program} 2>&1 || echo refused")
        assert not_executable[-1] == "refused" and "Permission denied" in not_executable[0], not_executable
    refused = await pods.run(container, "touch /busybox/new 2>&1 || echo refused")
    assert refused[-1] == "refused" and "Read-only file system" in refused[0], refused
    # The guest's mount: an overlay of the share's layers (no upper), nosuid,nodev,noexec.
    [mount] = [
        line.split() for line in await pods.run(container, "cat /proc/self/mounts") if " /volume " in line
    ]
    options = mount[3].split(",")
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(options) and not [
        o for o in options if "upperdir" in o
    ], mount
    lowers = next(o for o in options if o.startswith("lowerdir=")).removeprefix("lowerdir=").split(":")
    assert len(lowers) == 2 and all(lower.startswith("/run/aurae/share/") for lower in lowers), mount
    # The share holds the volume image's layers too, bound for this container.
    bound = bound_snapshots(pods.shares, pods.second)
    assert {p.name for p in volume_snapshots(pods)} | {pods.layer_snapshots()[0].name} <= set(bound), bound

    status = await node.status(container)
    assert [
        (m.container_path, m.image.image if m.image else "", m.image_sub_path) for m in status.mounts
    ] == [(v.container_path, v.image.image if v.image else "", v.image_sub_path) for v in volumes]

    for bad, field in (
        (image_volume("/x", "no/such/dir"), "sub_path"),
        (image_volume("/x", "../.."), "image_sub_path"),
    ):
        error = await cri_error(create_in_second_pod(pods, f"bad-{field}", [bad]))
        assert error.code == "INVALID_ARGUMENT" and field in error.message, error
    assert sorted(bound_snapshots(pods.shares, pods.second)) == sorted(bound)  # nothing left of those


async def test_an_image_volume_removed_while_mounted_keeps_its_layers_until_the_container_is_gone(
    pods: RootfsPods,
) -> None:
    node = pods.node
    [container] = [c.id for c in await node.containers() if c.metadata.name == "volumes"]
    await remove_image(node.client, VOLUME_IMAGE)
    assert await image_status(node.client, VOLUME_IMAGE) is None
    assert all(layer.is_dir() for layer in volume_snapshots(pods))
    assert await pods.run(container, "cat /volume/data/hello.txt /etc-link/marker") == [
        "hello from the volume image",
        "the volume image's etc",
    ]
    await node.stop(container)
    await node.remove(container)

    async def collected() -> bool:
        return not any(layer.exists() for layer in volume_snapshots(pods))

    await eventually(collected, 60)
    # Nothing of the volume image is bound any more (pod B's other containers keep their own).
    bound = set(bound_snapshots(pods.shares, pods.second))
    assert not bound & {layer.name for layer in volume_snapshots(pods)}, bound
