"""Idmapped mounts: a path seen through a user namespace's id mappings (Linux 5.12's
``MOUNT_ATTR_IDMAP``), as containerd 2 and runc 1.2 show a pod with its own user namespace its
volumes and image layers.

Through such a mount a file's owner on disk is read as the namespace maps it: with a pod's
mappings (``0 <uid> <length>``, auraed.system.userns.IdMap) a file of the host's root is the pod
root's, and what the pod's root writes is stored as the host's root's. Nothing on disk changes;
the same directory stays shared, unmapped, everywhere else. The mount is cloned detached
(open_tree), mapped and given its attributes while nothing can see it (mount_setattr), then
attached (move_mount) at a mount point made for it: a directory, or an empty file for a file.

Not every filesystem takes an idmap: ext4, xfs, btrfs and tmpfs do on these kernels; ramfs, proc,
sysfs and overlayfs refuse (EINVAL): :class:`IdmapRefused`, naming the filesystem.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from auraed.system import mount_api
from auraed.system.mounts import mount_of

_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


class IdmapRefused(Exception):
    """The filesystem under ``source`` (its type ``fs_type``) takes no idmapped mount."""

    def __init__(self, source: str, fs_type: str) -> None:
        super().__init__(f"{source}: its filesystem ({fs_type}) cannot be idmapped")
        self.source = source
        self.fs_type = fs_type


def attach_idmapped_clone(
    source: str | os.PathLike[str],
    target: Path,
    userns_fd: int,
    *,
    recursive: bool = False,
    attributes: int = 0,
    mode: int = 0o700,
) -> None:
    """Attach at ``target`` (made here with ``mode``: a directory for a directory's tree, an empty
    file for a file's; it must not exist) a detached clone of the mount at ``source`` seen through
    the mappings of the user namespace ``userns_fd`` (an open ``/proc/<pid>/ns/user`` or a pin
    of it), with the MOUNT_ATTR_* ``attributes`` (read-only, nosuid, ...) set too.

    ``recursive``: the clone takes ``source``'s submounts (a ``rbind``), which keep their own
    owners: only the top mount is mapped, as runc 1.2's ``idmap`` option (not ``ridmap``) does,
    so a submount whose filesystem refuses an idmap does not fail the whole bind.
    IdmapRefused when ``source``'s filesystem takes no idmap; OSError for anything else."""
    tree = mount_api.clone_tree(source, recursive=recursive)
    try:
        idmap_tree(tree, source, userns_fd, attributes=attributes)
        if stat.S_ISDIR(os.fstat(tree).st_mode):
            target.mkdir(mode=mode)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
        place = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mount_api.attach(tree, place)
        finally:
            os.close(place)
    finally:
        os.close(tree)


def idmap_tree(
    tree: int,
    source: str | os.PathLike[str],
    userns_fd: int,
    *,
    recursive: bool = False,
    attributes: int = 0,
) -> None:
    """Map the detached ``tree`` (an open_tree clone of ``source``; every mount of it with
    ``recursive``) by the user namespace ``userns_fd``, with the MOUNT_ATTR_* ``attributes`` set
    too. IdmapRefused when a filesystem of it takes no idmap; OSError for anything else."""
    try:
        mount_api.set_mount_attributes(
            tree, set_flags=mount_api.MOUNT_ATTR_IDMAP | attributes, userns_fd=userns_fd, recursive=recursive
        )
    except OSError as exc:
        if exc.errno in _REFUSALS:
            raise IdmapRefused(os.fspath(source), _fs_type(source)) from exc
        raise


def _fs_type(source: str | os.PathLike[str]) -> str:
    """The type of the filesystem ``source`` is on, as mountinfo names it ("unknown" if none)."""
    try:
        return mount_of(os.path.realpath(source)).fs_type
    except LookupError:
        return "unknown"
