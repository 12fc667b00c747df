"""A ``vm`` pod's share holds against its own guest (issue 33's second and third attacks), with a
real QEMU guest (TCG here) and real virtiofsd.

One pod is booted for the module; the attacker is a privileged container in it (root in the
guest, every capability there, no seccomp), which is what a privileged pod gets:

- a read-only volume (a directory, a single file, a recursive read-only one with a mount below
  it) remounted read-write inside the guest stays read-only: virtiofsd serves it read-only, so
  no write reaches the host;
- the pod's share, mounted again from its virtio-fs tag, takes no file, directory or symlink
  (only a writable volume in it is writable);
- whatever the guest left in a writable volume and tried in the share, RemovePodSandbox succeeds
  and leaves nothing of the pod, and the volume's own content stays the host's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from auraed.api.runtime import v1 as cri
from auraed.bootargs import SHARE_TAG
from auraed.pki import PkiPaths
from tests.integration.test_cri_containers import Node, cri_error
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.integration.vm_pods_helpers import leftovers_of_pod, module_vm_node
from tests.support.cri import pod_config, run_pod
from tests.support.registry import LocalRegistry

pytestmark = pytest.mark.asyncio(loop_scope="module")
mirror = busybox_mirror  # the registry fixture, used by name

BOOT_TIMEOUT = 300.0
EXEC_TIMEOUT = 60
PRIVILEGED_POD = cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(privileged=True))
PRIVILEGED = cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(privileged=True))
SHARE_COPY = "/tmp/share"
"""Where the attacker mounts the pod's share again, from its virtio-fs tag."""


@dataclass
class Volumes:
    """The host paths the attacker mounts: read-only ones it must not write, a writable one."""

    read_only: Path  # a directory, readonly
    read_only_file: Path  # a single file, readonly
    recursive: Path  # readonly and recursive_read_only, with a tmpfs mounted below it
    writable: Path
    non_recursive: Path  # readonly only, with a tmpfs mounted below it (writable: critest)

    @property
    def below_recursive(self) -> Path:
        return self.recursive / "below"

    @property
    def below_non_recursive(self) -> Path:
        return self.non_recursive / "tmpfs"

    def make(self) -> None:
        for directory in (self.read_only, self.recursive, self.below_recursive, self.writable):
            directory.mkdir(parents=True)
        self.below_non_recursive.mkdir(parents=True)
        (self.read_only / "keep.txt").write_text("keep\n")
        self.read_only_file.write_text("the host's\n")
        for below in (self.below_recursive, self.below_non_recursive):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "below", str(below)], check=True)
        (self.below_recursive / "keep.txt").write_text("keep\n")

    def unmount(self) -> None:
        for below in (self.below_recursive, self.below_non_recursive):
            subprocess.run(["umount", "-l", str(below)], capture_output=True, check=False)

    def mounts(self) -> list[cri.Mount]:
        return [
            cri.Mount(container_path="/ro", host_path=str(self.read_only), readonly=True),
            cri.Mount(container_path="/ro-file", host_path=str(self.read_only_file), readonly=True),
            cri.Mount(
                container_path="/rro", host_path=str(self.recursive), readonly=True, recursive_read_only=True
            ),
            cri.Mount(container_path="/rw", host_path=str(self.writable)),
            cri.Mount(container_path="/nrro", host_path=str(self.non_recursive), readonly=True),
        ]


@dataclass
class SharedPod:
    node: Node
    pod_id: str
    attacker: str
    volumes: Volumes

    @property
    def share(self) -> Path:
        return self.node.daemon.root / "run" / "pod-shares" / self.pod_id

    async def run(self, script: str) -> list[str]:
        """``script`` in the attacker (sh -c): its output's lines, stdout and stderr together."""
        reply = await self.node.exec_sync(self.attacker, ["sh", "-c", f"{script} 2>&1"], EXEC_TIMEOUT)
        return reply.stdout.decode(errors="replace").splitlines()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_pod(
    mirror: LocalRegistry, guest_image: Path, pki: PkiPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SharedPod]:
    """A vm pod with a privileged container mounting every one of the volumes (held by the module:
    a guest's boot costs seconds of TCG); at the end nothing of the daemon is left."""
    work = tmp_path_factory.mktemp("vm-share")
    volumes = Volumes(work / "ro", work / "ro-file", work / "rro", work / "rw", work / "nrro")
    volumes.make()
    try:
        async with module_vm_node(work, "aurae-share-", guest_image, pki, mirror) as node:
            config = pod_config("share-attack", namespace="vm-share", linux=PRIVILEGED_POD)
            pod_id = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
            container = node.config("attacker", ["sleep", "3600"], linux=PRIVILEGED, mounts=volumes.mounts())
            request = cri.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container, sandbox_config=config
            )
            attacker = (await node.call("CreateContainer", request, BOOT_TIMEOUT)).container_id
            await node.start(attacker)
            yield SharedPod(node, pod_id, attacker, volumes)
    finally:
        volumes.unmount()


async def test_a_read_only_volume_stays_read_only_when_the_guest_remounts_it(shared_pod: SharedPod) -> None:
    volumes = shared_pod.volumes
    lines = await shared_pod.run(
        "for target in /ro /rro /rro/below; do "
        "  echo x > $target/written && echo WRITTEN $target; "
        "done; "
        "for target in /ro /ro-file /rro; do "
        "  mount -o remount,rw $target && echo REMOUNTED $target; "
        "done; "
        "for target in /ro /rro /rro/below; do "
        "  echo x > $target/written && echo WRITTEN $target after a remount; "
        "done; "
        "echo pwned > /ro-file && echo WRITTEN /ro-file; "
        "true"
    )
    # The guest's own mounts, its kernel's to change: the remounts succeed, and change nothing.
    assert [line for line in lines if line.startswith("REMOUNTED")] == [
        "REMOUNTED /ro", "REMOUNTED /ro-file", "REMOUNTED /rro",
    ], lines  # fmt: skip
    assert [line for line in lines if line.startswith("WRITTEN")] == [], lines
    assert sorted(p.name for p in volumes.read_only.iterdir()) == ["keep.txt"]
    assert volumes.read_only_file.read_text() == "the host's\n"
    assert sorted(p.name for p in volumes.recursive.iterdir()) == ["below"]
    assert sorted(p.name for p in volumes.below_recursive.iterdir()) == ["keep.txt"]
    # Reading still works, through the same mounts.
    assert await shared_pod.run("cat /ro/keep.txt /ro-file /rro/below/keep.txt") == [
        "keep", "the host's", "keep",
    ]  # fmt: skip


async def test_a_read_only_volumes_writable_submount_stays_writable(shared_pod: SharedPod) -> None:
    """critest's "should support non-recursive readonly mounts" across the VM boundary: a tmpfs
    mounted on the host below a read-only (not recursive read-only) volume is writable in the
    container, the volume itself is not (virtiofsd serves its top mount read-only)."""
    volumes = shared_pod.volumes
    lines = await shared_pod.run("touch /nrro/tmpfs/file && echo BELOW; touch /nrro/top && echo TOP; true")
    assert "BELOW" in lines and "TOP" not in lines, lines
    assert (volumes.below_non_recursive / "file").exists() and not (volumes.non_recursive / "top").exists()


def host_mounts() -> list[tuple[str, str, str]]:
    """The host's mounts (this process's namespace, the daemon's): (mount point, type, source)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, filesystem = line.partition(" - ")
        kind, source = filesystem.split(" ")[:2]
        found.append((fields.split(" ")[4], kind, source))
    return found


async def test_the_host_holds_no_mount_of_the_pods_volumes(shared_pod: SharedPod) -> None:
    """The share's mounts are in the pod's own mount namespace: on the host only its pin (a
    bind of the namespace's file) is below the pod's share directory, and each tmpfs below a
    volume is mounted once, the host's own."""
    share, volumes = shared_pod.share, shared_pod.volumes
    mounts = host_mounts()
    assert [(point, kind) for point, kind, _ in mounts if point.startswith(f"{share}/")] == [
        (f"{share}/mnt", "nsfs")
    ]
    below = sorted(point for point, kind, source in mounts if (kind, source) == ("tmpfs", "below"))
    assert below == sorted([str(volumes.below_recursive), str(volumes.below_non_recursive)])


async def test_the_host_removes_its_mount_below_a_volume_while_the_pod_lives(shared_pod: SharedPod) -> None:
    """critest's readonly specs' clean-up: the host unmounts the tmpfs it mounted below a volume
    a running container holds, then removes the mount point. With the share's copy in the
    host's namespace the rmdir failed (EBUSY); in the pod's own Linux detaches it."""
    volumes = shared_pod.volumes
    assert (await shared_pod.run("touch /nrro/tmpfs/before && echo BEFORE")) == ["BEFORE"]
    subprocess.run(["umount", str(volumes.below_non_recursive)], check=True)
    volumes.below_non_recursive.rmdir()
    assert not volumes.below_non_recursive.exists()
    # The container goes on; the directory is gone from the volume it sees too.
    assert await shared_pod.run("ls /nrro; cat /ro/keep.txt") == ["keep"]


async def test_bidirectional_propagation_is_refused_at_the_vm_boundary(shared_pod: SharedPod) -> None:
    """critest's "mount with 'rshared'" asks that a mount the container makes reach the host: a
    guest's mounts never do, so CreateContainer says so (docs: the specs a VM boundary refuses)."""
    node = shared_pod.node
    source = shared_pod.volumes.writable.parent / "rshared"  # as critest makes it: a shared mount
    source.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(source)], check=True)
    try:
        subprocess.run(["mount", "--make-rshared", str(source)], check=True)
        volume = cri.Mount(
            container_path="/shared",
            host_path=str(source),
            propagation=cri.MountPropagation.PROPAGATION_BIDIRECTIONAL,
        )
        config = node.config("rshared", ["sleep", "60"], linux=PRIVILEGED, mounts=[volume])
        request = cri.CreateContainerRequest(pod_sandbox_id=shared_pod.pod_id, config=config)
        error = await cri_error(node.call("CreateContainer", request, EXEC_TIMEOUT))
    finally:
        subprocess.run(["umount", "-l", str(source)], check=True)
    assert error.code == "INVALID_ARGUMENT" and "VM boundary" in error.message, error


def planted(share: Path) -> list[str]:
    """What PLANT leaves in the pod's share on the host when it can: its names at the top of the
    share's directories and in each container's directory (never inside a volume), symlinks not
    followed."""
    tops = [
        top for top in (share, share / "share", share / "points") if top.is_dir() and not top.is_symlink()
    ]
    keys = [key for top in tops for key in top.iterdir() if key.is_dir() and not key.is_symlink()]
    candidates = [top / name for top in tops for name in ("planted", "escape", "made")]
    return [str(path) for path in (*candidates, *(key / "escape" for key in keys)) if os.path.lexists(path)]


PLANT = (
    f"mkdir -p {SHARE_COPY} && mount -t virtiofs {SHARE_TAG} {SHARE_COPY} && echo mounted; "
    f"echo planted > {SHARE_COPY}/planted && echo PLANTED a file; "
    f"ln -s / {SHARE_COPY}/escape && echo PLANTED a symlink; "
    f"mkdir {SHARE_COPY}/made && echo PLANTED a directory; "
    f"for key in {SHARE_COPY}/*/; do ln -s / $key/escape && echo PLANTED a symlink in $key; done; "
    f"umount {SHARE_COPY}; true"
)
"""What a guest tries on its pod's share: mount it again, then plant a file, a symlink out and a
directory at its top and a symlink in each container's directory."""


async def test_the_guest_cannot_write_into_its_pods_share(shared_pod: SharedPod) -> None:
    lines = await shared_pod.run(PLANT)
    assert "mounted" in lines, lines  # the guest's own device: it may mount it
    assert [line for line in lines if line.startswith("PLANTED")] == [], lines
    assert planted(shared_pod.share) == []


async def test_a_privileged_container_reaches_nothing_of_the_guest_through_the_pods_init(
    shared_pod: SharedPod,
) -> None:
    """Issue 33's first attack with a privileged container (every capability in the guest, no
    seccomp): the pod shares its PID namespace, and its PID 1 is the pod's init, whose root, cwd,
    descriptors and environment hold nothing of the guest's (its agent's key was readable there)."""
    lines = await shared_pod.run(
        "cat /proc/1/comm; ls -A /proc/1/root/; readlink /proc/1/cwd; ls /proc/1/fd;"
        " wc -c < /proc/1/environ; cat /proc/1/root/etc/aurae/pki/server.key;"
        " nsenter -t 1 -m ls -A / || echo no-nsenter"
    )
    assert lines[:5] == ["aurae-pod-init", "aurae-pod-init", "/", "0", "0"], lines
    assert not any("PRIVATE KEY" in line for line in lines), lines
    # Entering its mount namespace (the attacker may: it is privileged) finds the same empty root.
    assert lines[-1] in ("aurae-pod-init", "no-nsenter"), lines


async def test_the_pod_is_removed_whatever_its_guest_left(shared_pod: SharedPod) -> None:
    volumes, node = shared_pod.volumes, shared_pod.node
    lines = await shared_pod.run(
        "ln -s / /rw/escape && ln -s /etc/passwd /rw/passwd && mkdir /rw/made && "
        "echo data > /rw/made/file && echo left; " + PLANT
    )
    assert "left" in lines, lines
    await node.stop_pod(shared_pod.pod_id)
    await node.remove_pod(shared_pod.pod_id)
    assert leftovers_of_pod(node.daemon, node.network, shared_pod.pod_id) == {}
    # Its namespace's pin went with it, and the pins' own mount with the node's last share.
    assert not shared_pod.share.parent.exists()
    assert [point for point, _, _ in host_mounts() if point.startswith(str(shared_pod.share.parent))] == []
    log = node.daemon.log()
    assert "in a pod's share" not in log and "still holds mounts" not in log
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    assert not [line for line in mounts if str(shared_pod.share) in line], mounts
    # The writable volume is the host's (the kubelet's to remove): its content stays, as it was.
    assert sorted(p.name for p in volumes.writable.iterdir()) == ["escape", "made", "passwd"]
    assert os.readlink(volumes.writable / "escape") == "/"
    assert (volumes.writable / "made" / "file").read_text() == "data\n"
    assert sorted(p.name for p in volumes.read_only.iterdir()) == ["keep.txt"]
