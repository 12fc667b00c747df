"""Linux's file-descriptor mount API and openat2(2), which Python 3.11 lacks, through ctypes on
libc's syscall(2): mounts made from a detached copy set up before it appears anywhere, and paths
resolved beneath a directory without following a single link.

Why descriptors: a mount made by path (mount(2), umount2(2)) resolves its path when it runs, and
follows every symlink on the way; a tree another party can write to could aim it anywhere. Here a
mount is cloned (open_tree), changed while detached (mount_setattr: read-only before any mount
propagation copies it), and attached (move_mount) at a descriptor resolved beforehand with
openat2's ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``. Linux 5.12 or later (mount_setattr).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
from pathlib import Path

from auraed.system.mounts import MOUNTINFO, read_mounts
from auraed.system.namespaces import MNT_DETACH, umount

log = logging.getLogger(__name__)

# The syscall numbers from 424 on are the same on every architecture (one table).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_OPENAT2 = 437
_SYS_MOUNT_SETATTR = 442

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 0x1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_IDMAP = 0x100000

# Propagation types as mount(2) and mount_setattr(2) name them.
MS_PRIVATE = 0x40000
MS_SLAVE = 0x80000
MS_SHARED = 0x100000

RESOLVE_NO_XDEV = 0x1
RESOLVE_NO_MAGICLINKS = 0x2
RESOLVE_NO_SYMLINKS = 0x4
RESOLVE_BENEATH = 0x8
RESOLVE_IN_ROOT = 0x10

_MOUNT_ATTR = struct.Struct("=QQQQ")  # struct mount_attr: attr_set, attr_clr, propagation, userns_fd
_OPEN_HOW = struct.Struct("=QQQ")  # struct open_how: flags, mode, resolve

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _call(name: str, number: int, *args: object) -> int:
    result = int(_syscall(number, *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return result


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2): ``path`` opened relative to ``dir_fd`` under the ``resolve`` restrictions; a
    new descriptor, close-on-exec."""
    how = ctypes.create_string_buffer(_OPEN_HOW.pack(flags | os.O_CLOEXEC, mode, resolve), _OPEN_HOW.size)
    size = ctypes.c_size_t(_OPEN_HOW.size)
    return _call(f"openat2 {path}", _SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path), how, size)


def open_beneath(dir_fd: int, path: str, flags: int = os.O_PATH, *, into_mounts: bool = True) -> int:
    """``path`` (relative) below ``dir_fd``, never leaving it and following no link, symlinks and
    /proc's magic links alike (ELOOP on one; EXDEV on ``..`` out of it). ``into_mounts`` False:
    nor crossing into a mount (EXDEV), so that what is opened is the directory's own dentry."""
    resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
    if not into_mounts:
        resolve |= RESOLVE_NO_XDEV
    return openat2(dir_fd, path, flags | os.O_NOFOLLOW, resolve)


def resolve_in_root(root: str | os.PathLike[str], path: str) -> str:
    """``path`` resolved as if ``root`` were ``/`` (RESOLVE_IN_ROOT: ``..`` and absolute symlinks
    stop at it, as securejoin does for containerd's subpaths), no magic links followed; the
    absolute host path of what it names (which must exist)."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = openat2(root_fd, path.lstrip("/") or ".", os.O_PATH, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root_fd)
    try:
        return os.readlink(fd_path(found))
    finally:
        os.close(found)


def clone_tree(source: str | os.PathLike[str] | int, *, recursive: bool) -> int:
    """open_tree(OPEN_TREE_CLONE): a detached copy of the mount at ``source`` (a bind mount not
    yet attached anywhere; with its submounts when ``recursive``), as a descriptor. ``source`` is
    a path, resolved as mount(2) resolves a bind's source (symlinks followed), or a descriptor."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    if isinstance(source, int):
        return _call(
            "open_tree", _SYS_OPEN_TREE, ctypes.c_int(source), b"", ctypes.c_uint(flags | AT_EMPTY_PATH)
        )
    path = os.fsencode(source)
    return _call(
        f"open_tree {os.fsdecode(path)}", _SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), path, ctypes.c_uint(flags)
    )


def set_mount_attributes(
    fd: int,
    *,
    set_flags: int = 0,
    clear_flags: int = 0,
    propagation: int = 0,
    recursive: bool = False,
    userns_fd: int = 0,
) -> None:
    """mount_setattr(2) on the mount ``fd`` holds (detached ones included): MOUNT_ATTR_* flags set
    and cleared, a propagation type (MS_PRIVATE, MS_SLAVE, MS_SHARED; 0 leaves it); on every
    mount of its tree when ``recursive``. With MOUNT_ATTR_IDMAP, ``userns_fd`` is the user
    namespace whose mappings the mount takes (a detached mount only, not mapped yet)."""
    attr = ctypes.create_string_buffer(
        _MOUNT_ATTR.pack(set_flags, clear_flags, propagation, userns_fd), _MOUNT_ATTR.size
    )
    flags = ctypes.c_uint(AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0))
    size = ctypes.c_size_t(_MOUNT_ATTR.size)
    _call("mount_setattr", _SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", flags, attr, size)


def attach(tree_fd: int, target_fd: int) -> None:
    """move_mount(2): the detached tree ``tree_fd`` mounted on what ``target_fd`` (an O_PATH
    descriptor: a directory for a directory's tree, a file for a file's) is. Propagation then
    copies it, with its attributes, to the target's peers and slaves."""
    flags = ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)
    _call("move_mount", _SYS_MOVE_MOUNT, ctypes.c_int(tree_fd), b"", ctypes.c_int(target_fd), b"", flags)


def fd_path(fd: int) -> str:
    """What mount(2) and umount2(2) take for the object ``fd`` holds: its /proc magic link, which
    they follow to the descriptor's own mount and dentry, whatever its path is now."""
    return f"/proc/self/fd/{fd}"


def detach(fd: int) -> bool:
    """Lazily unmount (MNT_DETACH, its submounts with it) the mount whose root ``fd`` holds, named
    by the descriptor (/proc/self/fd), never by a path. False when ``fd`` holds no mount's root."""
    try:
        umount(fd_path(fd), MNT_DETACH)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def mounts_below(top: Path, mountinfo: Path = MOUNTINFO) -> list[str]:
    """The mount points at ``top`` and below it, shallowest first, each as often as something
    is mounted there; in the namespace ``mountinfo`` shows (a thread's own after it entered one:
    mounts.THREAD_MOUNTINFO)."""
    prefix = f"{top}/"
    found = [
        e.mount_point
        for e in read_mounts(mountinfo)
        if e.mount_point == str(top) or e.mount_point.startswith(prefix)
    ]
    return sorted(found, key=lambda point: point.count("/"))


def detach_all(dir_fd: int, directory: Path, name: str, mountinfo: Path = MOUNTINFO) -> bool:
    """Detach every mount at ``name`` in ``directory`` and below it, each reached from
    ``dir_fd`` without following a link; the shallowest first (its submounts go with it).
    False, logged, when some could not be: then nothing there may be deleted."""
    for point in mounts_below(directory / name, mountinfo):
        try:
            fd = open_beneath(dir_fd, os.path.relpath(point, directory))
        except FileNotFoundError:
            continue  # gone with a shallower one
        except OSError as exc:
            log.warning("cannot reach the mount at %s: %s", point, exc.strerror or exc)
            continue
        try:
            detach(fd)
        finally:
            os.close(fd)
    left = mounts_below(directory / name, mountinfo)
    if left:
        log.warning(
            "%s still holds mounts (%s): its mount points are left", directory / name, ", ".join(left)
        )
    return not left
