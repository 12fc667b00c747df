"""A ``vm`` pod's shared directory: the host paths its containers mount (emptyDir, configMap,
secret, the service-account token: what the kubelet prepares on the host), made visible in the
pod's guest.

Each pod has one directory on the host (``<runtime dir>/pod-shares/<pod id>``), which its guest
mounts over virtio-fs at auraed.bootargs.SHARE_MOUNT (virtiofsd serves it; auraed.vms.qemu). For
each container, every host path it mounts is bind-mounted under that directory
(``<container key>/<n>``, read-only where asked) and the container in the guest bind-mounts
``SHARE_MOUNT/<container key>/<n>`` instead: the Kata agent's shared-directory model. The pod's
directory is a shared mount (bound on itself), so that binds made after virtiofsd started reach
it in its own mount namespace. virtiofsd runs with ``cache=none``: what the host changes (a
configMap's update) the guest reads at once.

Nothing here removes what a bind shows: a release unmounts first (each bind, deepest first), then
removes only the empty mount points it made, never following into a mount that stayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
from pathlib import Path

from auraed.bootargs import SHARE_MOUNT
from auraed.containers.request import Mount
from auraed.cri.errors import CriError
from auraed.errors import ErrorKind
from auraed.system import namespaces
from auraed.system.mounts import read_mounts

log = logging.getLogger(__name__)

MS_REMOUNT = 0x20
BIND_TYPES = ("", "bind", "rbind")


class PodShares:
    """The shared directories of the ``vm`` pods, under ``root``."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def directory(self, pod_id: str) -> Path:
        return self._root / pod_id

    def make(self, pod_id: str) -> Path:
        """The pod's shared directory, a shared mount bound on itself (idempotent)."""
        directory = self.directory(pod_id)
        directory.mkdir(parents=True, mode=0o700, exist_ok=True)
        if not _mounted(directory):
            namespaces.mount(directory, directory, None, namespaces.MS_BIND)
        namespaces.mount(None, directory, None, namespaces.MS_SHARED)
        return directory

    def bind(self, pod_id: str, key: str, mounts: tuple[Mount, ...]) -> tuple[Mount, ...]:
        """The container's mounts as the guest makes them: each host path bound under the pod's
        directory, at ``<key>/<n>``; mounts of no host path (tmpfs, ...) as they are. On failure
        what was bound for ``key`` is released."""
        directory = self.directory(pod_id)
        if not _mounted(directory):
            raise CriError.precondition(f"pod sandbox {pod_id[:13]} has no shared directory")
        guest = []
        try:
            for index, mount in enumerate(mounts):
                if mount.type not in BIND_TYPES:
                    guest.append(mount)
                    continue
                self._bind_one(Path(mount.source), directory / key / str(index), mount)
                guest.append(dataclasses.replace(mount, source=f"{SHARE_MOUNT}/{key}/{index}"))
        except BaseException:
            self.release(pod_id, key)
            raise
        return tuple(guest)

    @staticmethod
    def _bind_one(source: Path, target: Path, mount: Mount) -> None:
        target.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        if source.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.touch(exist_ok=True)
        recursive = namespaces.MS_REC if "bind" not in mount.options else 0  # rbind unless asked not
        try:
            namespaces.mount(source, target, None, namespaces.MS_BIND | recursive)
            if mount.read_only or "ro" in mount.options:
                namespaces.mount(None, target, None, namespaces.MS_BIND | MS_REMOUNT | namespaces.MS_RDONLY)
        except OSError as exc:
            raise CriError(
                ErrorKind.FAILED_PRECONDITION,
                f"cannot share {source} with the pod's guest: {exc.strerror or exc}",
            ) from None

    def release(self, pod_id: str, key: str) -> None:
        """Unmount what was bound for ``key``, then remove its (empty) mount points."""
        self._clear(self.directory(pod_id) / key)

    def remove(self, pod_id: str) -> None:
        """Release every container's binds, then the pod's directory itself."""
        directory = self.directory(pod_id)
        if not directory.exists():
            return
        self._clear(directory, keep_top=True)
        with contextlib.suppress(OSError):
            namespaces.umount(directory, namespaces.MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            directory.rmdir()

    @staticmethod
    def _clear(top: Path, keep_top: bool = False) -> None:
        prefix = str(top).rstrip("/") + "/"
        below = [e.mount_point for e in read_mounts() if e.mount_point.startswith(prefix)]
        for point in sorted(set(below), key=len, reverse=True):
            try:
                namespaces.umount(point, namespaces.MNT_DETACH)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT):
                    raise
        if not top.exists():
            return
        if any(e.mount_point.startswith(prefix) for e in read_mounts()):
            log.warning("%s still holds mounts: its mount points are left", top)
            return  # never walk into what a bind still shows
        for path, dirs, files in os.walk(top, topdown=False):
            for name in files:
                _remove_mount_point(Path(path) / name, file=True)
            for name in dirs:
                _remove_mount_point(Path(path) / name, file=False)
        if not keep_top:
            _remove_mount_point(top, file=False)


def _mounted(path: Path) -> bool:
    """Whether something is mounted on ``path`` (a bind of a directory on itself included, which
    os.path.ismount cannot tell: same device, same inode)."""
    return any(entry.mount_point == str(path) for entry in read_mounts())


def _remove_mount_point(path: Path, *, file: bool) -> None:
    """An empty file or directory we made as a mount point; anything else is left, said once."""
    try:
        if _mounted(path):
            raise OSError(errno.EBUSY, "still mounted")
        if file:
            if path.stat().st_size:
                raise OSError(errno.ENOTEMPTY, "not an empty mount point")
            path.unlink()
        else:
            path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("left %s in a pod's shared directory: %s", path, exc.strerror or exc)
