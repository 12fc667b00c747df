"""Container root filesystems: a snapshotter mounts one over the image's layer snapshots.

The :class:`Snapshotter` interface is what containers ask for (containerd's snapshotter, for the
one writable snapshot a container gets over its image's committed layers); :class:`OverlaySnapshotter`
is overlayfs over the layers the image store keeps (auraed.images.content.LayerSnapshots).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol

from auraed.containers.errors import ContainerError
from auraed.errors import ErrorKind
from auraed.images.content import LayerSnapshots
from auraed.images.model import ImageRecord
from auraed.system import namespaces

# The kernel takes mount options in one page; each lower layer costs its path length.
MAX_MOUNT_DATA = 4095


class Snapshotter(Protocol):
    """A container's root filesystem from its image's layers."""

    def mount(self, image: ImageRecord, writable: Path, target: Path) -> None:
        """Mount at ``target`` the image's layers under a writable layer kept in ``writable``
        (the container's own directory: what the container writes lasts as long as it does)."""
        ...

    def unmount(self, target: Path) -> None:
        """Unmount if mounted; never hangs on a stray process."""
        ...

    def is_mounted(self, target: Path) -> bool: ...

    def written(self, writable: Path) -> Path:
        """Where, in ``writable``, what the container wrote to its root filesystem is kept."""
        ...


class OverlaySnapshotter:
    """overlayfs: the image's layer snapshots as lower dirs, ``writable/upper`` (with its
    ``writable/work``) as the upper one."""

    def __init__(self, layers: LayerSnapshots) -> None:
        self._layers = layers

    def mount(self, image: ImageRecord, writable: Path, target: Path) -> None:
        lowers = [
            self._layers.snapshot_path(layer.diff_id) for layer in reversed(image.layers)
        ]  # topmost first
        mount_rootfs(lowers, self.written(writable), writable / "work", target)

    def unmount(self, target: Path) -> None:
        unmount_rootfs(target)

    def written(self, writable: Path) -> Path:
        return writable / "upper"

    def is_mounted(self, target: Path) -> bool:
        return is_mounted(target)


def is_mounted(target: Path) -> bool:
    # A rootfs is always its own overlay mount, with a device of its own: two lstat calls tell,
    # where reading /proc/self/mountinfo grows with every mount on the host (Start runs this on
    # the event loop).
    return os.path.ismount(target)


def mount_rootfs(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount ``lowers`` (topmost first) with a writable upper layer at ``target``."""
    for directory in (upper, work, target):
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    data = f"lowerdir={':'.join(map(os.fspath, lowers))},upperdir={upper},workdir={work}"
    if len(data) > MAX_MOUNT_DATA:
        raise ContainerError(
            ErrorKind.FAILED_PRECONDITION,
            f"the image has too many layers ({len(lowers)}) for one overlay mount",
        )
    try:
        namespaces.mount("overlay", target, "overlay", 0, data)
    except OSError as exc:
        raise ContainerError(
            ErrorKind.INTERNAL, f"cannot mount the root filesystem at {target}: {exc}"
        ) from exc


def unmount_rootfs(target: Path) -> None:
    """Unmount if mounted; a busy mount is detached so deletion never hangs on a stray process."""
    if not is_mounted(target):
        return
    try:
        namespaces.umount(target)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise ContainerError(ErrorKind.INTERNAL, f"cannot unmount {target}: {exc}") from exc
        namespaces.umount(target, namespaces.MNT_DETACH)
