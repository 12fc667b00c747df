"""Linux namespace primitives, and the other system calls Python 3.11 lacks (syncfs, fallocate's
hole punching), through ctypes on libc (Python 3.11 has no os.unshare/os.setns).

Stdlib only and lean at import (ctypes + os): the per-executable monitor imports this module only when
an executable asks for namespaces. socket/fcntl/struct/threading are imported inside the functions
that need them.
"""

# Lean on purpose (imported by the monitor): no contextlib for try/except/pass.
# ruff: noqa: SIM105

from __future__ import annotations

import ctypes
import os

from auraed.system.mounts import THREAD_MOUNTINFO, read_mounts
from auraed.system.threads import in_new_thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_SLAVE = 0x80000
MS_SHARED = 0x100000

MNT_DETACH = 0x2

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

# dlopen(NULL): the symbols already loaded into the interpreter, libc included (glibc or musl).
_libc = ctypes.CDLL(None, use_errno=True)

_unshare = _libc.unshare
_unshare.argtypes = [ctypes.c_int]
_unshare.restype = ctypes.c_int

_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_setns.restype = ctypes.c_int

_mount = _libc.mount
_mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_mount.restype = ctypes.c_int

_umount2 = _libc.umount2
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_umount2.restype = ctypes.c_int

_sethostname = _libc.sethostname
_sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_sethostname.restype = ctypes.c_int

_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

_syncfs = _libc.syncfs
_syncfs.argtypes = [ctypes.c_int]
_syncfs.restype = ctypes.c_int

_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int

FALLOC_FL_KEEP_SIZE = 0x01  # linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
PR_SET_NAME = 15
TASK_COMM_LEN = 16  # /proc/PID/comm holds 15 bytes and a NUL


def _raise(call: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{call}: {os.strerror(err)}")


def _b(value: str | os.PathLike[str] | bytes | None) -> bytes | None:
    if value is None:
        return None
    return os.fsencode(value)


def unshare(flags: int) -> None:
    """unshare(2) for the calling thread (CLONE_NEWNET/NEWUTS/NEWIPC/NEWNS) or its future children
    (CLONE_NEWPID)."""
    if _unshare(flags) != 0:
        _raise(f"unshare({flags:#x})")


def setns(fd: int, nstype: int = 0) -> None:
    """setns(2): move the calling thread into the namespace that ``fd`` refers to."""
    if _setns(fd, nstype) != 0:
        _raise(f"setns({fd}, {nstype:#x})")


def mount(
    source: str | os.PathLike[str] | None,
    target: str | os.PathLike[str],
    fstype: str | None = None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    if _mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        _raise(f"mount {source} on {os.fspath(target)} ({fstype}, {flags:#x})")


def umount(target: str | os.PathLike[str], flags: int = 0) -> None:
    if _umount2(_b(target), flags) != 0:
        _raise(f"umount {os.fspath(target)}")


def sethostname(name: str) -> None:
    raw = name.encode()
    if _sethostname(raw, len(raw)) != 0:
        _raise(f"sethostname {name!r}")


def syncfs(fd: int) -> None:
    """Write out everything cached for the filesystem holding ``fd``."""
    if _syncfs(fd) != 0:
        _raise("syncfs")


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes at ``offset`` of the file, keeping its size (they read as zeros)."""
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        _raise("fallocate")


def set_child_subreaper(enabled: bool = True) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphaned descendants are reparented to this process, not init."""
    if _prctl(PR_SET_CHILD_SUBREAPER, 1 if enabled else 0, 0, 0, 0) != 0:
        _raise("prctl(PR_SET_CHILD_SUBREAPER)")


def set_process_name(name: str) -> None:
    """prctl(PR_SET_NAME): what ps and /proc/PID/comm show (truncated to 15 bytes)."""
    raw = ctypes.create_string_buffer(name.encode()[: TASK_COMM_LEN - 1])
    if _prctl(PR_SET_NAME, ctypes.addressof(raw), 0, 0, 0) != 0:
        _raise("prctl(PR_SET_NAME)")


def is_child_subreaper() -> bool:
    value = ctypes.c_int(0)
    if _prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(value), 0, 0, 0) != 0:
        _raise("prctl(PR_GET_CHILD_SUBREAPER)")
    return bool(value.value)


def bring_loopback_up() -> None:
    """Set IFF_UP on "lo" of the calling thread's network namespace (ioctl, no `ip`, no netlink)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH22x", b"lo", 0)  # struct ifreq: name[16] + 24-byte union
        res = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, ifreq)
        flags = struct.unpack_from("16sH", res)[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def pin_namespace(source: str, target: str | os.PathLike[str]) -> None:
    """Bind-mount the namespace file ``source`` (``/proc/<id>/ns/<kind>``) on a new empty file
    ``target``: the namespace then lives, with no process in it, until unpin_namespace.

    The bind mount is made in the caller's mount namespace, so every process of the host sees
    it. ``target`` must not exist (FileExistsError); it is removed again if the mount fails.
    """
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    try:
        mount(source, target, None, MS_BIND)
    except BaseException:
        try:
            os.unlink(target)
        except OSError:
            pass
        raise


def thread_namespace(kind: str) -> str:
    """The calling thread's own namespace file of ``kind`` (net, ipc, uts, pid_for_children...):
    after unshare in a thread, /proc/self/ns would name the main thread's."""
    import threading

    return f"/proc/self/task/{threading.get_native_id()}/ns/{kind}"


def create_network_namespace(path: str | os.PathLike[str]) -> None:
    """Create a new network namespace with lo up, pinned by a bind mount on ``path``.

    Runs in a dedicated short-lived thread: unshare(CLONE_NEWNET) changes only the calling thread,
    so it must never happen on the caller's thread or a pool thread that is reused afterwards. The
    namespace outlives the thread and is released by remove_network_namespace. ``path`` must not
    exist (FileExistsError); errors from the thread are raised in the caller.
    """
    target = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)

    def worker() -> None:
        unshare(CLONE_NEWNET)
        bring_loopback_up()
        pin_namespace(thread_namespace("net"), target)

    in_new_thread(worker)


def enter_network_namespace(path: str | os.PathLike[str]) -> None:
    """Move the calling thread into the network namespace pinned at ``path``: only ever on a
    short-lived thread of its own (in_new_thread), which the namespace then dies with."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, CLONE_NEWNET)
    finally:
        os.close(fd)


def socket_in_network_namespace(path: str | os.PathLike[str], family: int, kind: int) -> socket.socket:
    """A new socket of the network namespace pinned at ``path``: made on a short-lived thread
    that enters the namespace, so that neither the caller's thread nor a pool's is moved. A
    socket belongs to the namespace it was made in for its whole life, whichever thread uses it."""
    import socket

    def worker() -> socket.socket:
        enter_network_namespace(path)
        return socket.socket(family, kind)

    return in_new_thread(worker)


def create_mount_namespace(path: str | os.PathLike[str], set_up: Callable[[], None]) -> None:
    """Create a new mount namespace, a copy of the caller's with every mount in it private
    (nothing mounted on either side later reaches the other) but for its namespace pins, set up
    by ``set_up`` on the thread that made it, and pinned by a bind mount on ``path`` (see
    pin_namespace): it then lives, with no process in it, until unpin_namespace. Nothing is
    pinned when ``set_up`` fails.

    The copies of the caller's pins (nsfs mounts: a pod's network namespace, another such mount
    namespace) are detached: a private copy is not unmounted with its original, and would keep
    that namespace, and what lives in it, until this one ends.

    The pin's mount must not be shared with another mount namespace: Linux refuses to copy a
    mount namespace's file by propagation (EINVAL), lest a namespace pin itself. Runs on a
    short-lived thread of its own (in_new_thread), which the namespace outlives."""
    target = os.fspath(path)

    def worker() -> int:
        unshare(CLONE_NEWNS)  # a filesystem context of the thread's own (CLONE_FS) with it
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        _drop_namespace_pins()
        set_up()
        return os.open(thread_namespace("mnt"), os.O_RDONLY | os.O_CLOEXEC)

    namespace = in_new_thread(worker)
    try:
        pin_namespace(f"/proc/self/fd/{namespace}", target)
    finally:
        os.close(namespace)


def _drop_namespace_pins() -> None:
    """The calling thread's mount namespace's nsfs mounts detached, the last made first."""
    for entry in reversed(read_mounts(THREAD_MOUNTINFO)):
        if entry.fs_type == "nsfs":
            try:
                umount(entry.mount_point, MNT_DETACH)
            except OSError:
                pass  # gone with one detached before it


def enter_mount_namespace(path: str | os.PathLike[str]) -> None:
    """Move the calling thread into the mount namespace pinned at ``path``: only ever on a
    short-lived thread of its own (in_new_thread). The thread first takes a filesystem context
    (root, cwd) of its own: setns refuses a mount namespace to a thread sharing it (EINVAL)."""
    unshare(CLONE_FS)
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, CLONE_NEWNS)
    finally:
        os.close(fd)


def in_mount_namespace(path: str | os.PathLike[str], work: Callable[[], T]) -> T:
    """``work()`` run in the mount namespace pinned at ``path``, on a short-lived thread that
    enters it (neither the caller's thread nor a pool's is moved); what it raises is raised here.
    Descriptors are the process's: what ``work`` opens or is given stays usable on any thread."""

    def worker() -> T:
        enter_mount_namespace(path)
        return work()

    return in_new_thread(worker)


def remove_network_namespace(path: str | os.PathLike[str]) -> None:
    """Release a network namespace made by create_network_namespace (see unpin_namespace)."""
    unpin_namespace(path)


def unpin_namespace(path: str | os.PathLike[str]) -> None:
    """Unmount (lazily) and delete a namespace file made by pin_namespace; idempotent.

    The namespace itself disappears once no process is inside it and nothing else pins it.
    """
    import errno

    target = os.fspath(path)
    try:
        umount(target, MNT_DETACH)
    except OSError as exc:
        # EINVAL: not a mount point (already unmounted); ENOENT: gone.
        if exc.errno not in (errno.EINVAL, errno.ENOENT):
            raise
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass
