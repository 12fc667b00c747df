"""Container root filesystems: overlayfs over the image's layer snapshots."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from auraed.containers.errors import ContainerError
from auraed.errors import ErrorKind
from auraed.system import namespaces

# The kernel takes mount options in one page; each lower layer costs its path length.
MAX_MOUNT_DATA = 4095


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
