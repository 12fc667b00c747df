"""Confine the calling thread before it spawns a program that must see nothing of the machine:
a pod's init (auraed.system.pod_namespaces), which a container sharing the pod's PID namespace
reaches through /proc/1 (root, cwd, fd, environ), with CAP_SYS_PTRACE or as a privileged
container in a guest.

:func:`confine_thread` gives the thread, and so the program it spawns next, what containerd's
pause container has and no more: its own mount namespace over an empty read-only root holding
only the program (bind-mounted read-only), no open descriptors, no capabilities (bounding,
ambient, inheritable, permitted and effective sets all empty), ``no_new_privs``, and an
unprivileged user and group with no supplementary groups.

Everything here changes the calling thread only, never the process: the unshares, prctl and
capset are per-thread in the kernel, and the ids are set by raw system calls (glibc's setresuid
and setgroups would change every thread of the daemon). So it must run on a short-lived thread
of its own (auraed.system.threads.in_new_thread), which dies with what it changed.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

from auraed.system import namespaces

CLONE_FILES = 0x00000400
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_LAST_CAP = Path("/proc/sys/kernel/cap_last_cap")

UNPRIVILEGED_ID = 65535
"""The user and group a confined program runs as: the kubelet's pause image's (``USER
65535:65535``), which no account of the host or the guest image uses."""

# System call numbers of the calls glibc does not wrap (pivot_root) or wraps for the whole
# process (setresuid, setresgid and setgroups signal every thread to change with the caller).
# clone for its CLONE_PARENT (auraed.system.userns_helper), which fork(2) has no way to ask.
_SYSCALLS = {
    "x86_64": {
        "pivot_root": 155, "capset": 126, "setgroups": 116, "setresuid": 117, "setresgid": 119, "clone": 56,
    },
    "aarch64": {
        "pivot_root": 41, "capset": 91, "setgroups": 159, "setresuid": 147, "setresgid": 149, "clone": 220,
    },
}  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def raw_syscall(name: str, *args: object) -> int:
    """The system call ``name`` (one of _SYSCALLS) made directly, for the calling thread alone;
    its result, OSError when it failed."""
    machine = os.uname().machine
    numbers = _SYSCALLS.get(machine)
    if numbers is None:
        raise OSError(f"confine: no system call numbers for {machine}")
    result = int(_syscall(ctypes.c_long(numbers[name]), *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return result


def _prctl_checked(option: int, arg: int = 0, arg2: int = 0) -> None:
    if _prctl(option, arg, arg2, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _empty_root(program: Path, name: str, mountpoint: Path) -> None:
    """Make a read-only tmpfs on ``mountpoint`` holding only ``program`` (bind-mounted read-only
    as ``/<name>``) the thread's root, and let go of the old root entirely, so that nothing
    above it is reachable through /proc/<pid>/root."""
    ro = namespaces.MS_RDONLY | namespaces.MS_NOSUID | namespaces.MS_NODEV
    namespaces.unshare(namespaces.CLONE_NEWNS)
    namespaces.mount(None, "/", None, namespaces.MS_REC | namespaces.MS_PRIVATE)
    nosuid_nodev = namespaces.MS_NOSUID | namespaces.MS_NODEV
    namespaces.mount("none", mountpoint, "tmpfs", nosuid_nodev, "size=16k,mode=0555")
    target = mountpoint / name
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o555))
    namespaces.mount(program, target, None, namespaces.MS_BIND)
    namespaces.mount(None, target, None, namespaces.MS_BIND | namespaces.MS_REMOUNT | ro)
    namespaces.mount(None, mountpoint, None, namespaces.MS_REMOUNT | ro)
    os.chdir(mountpoint)
    raw_syscall("pivot_root", b".", b".")  # the old root ends up stacked under the new one...
    namespaces.umount(".", namespaces.MNT_DETACH)  # ...and is let go of here
    os.chdir("/")


def _drop_privileges(last_cap: int, unprivileged_id: int) -> None:
    """No capabilities in any set, no way to gain one by an exec, an unprivileged id."""
    for cap in range(last_cap + 1):
        _prctl_checked(PR_CAPBSET_DROP, cap)
    _prctl_checked(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl_checked(PR_SET_NO_NEW_PRIVS, 1)
    raw_syscall("setgroups", ctypes.c_size_t(0), None)
    ids = [ctypes.c_uint(unprivileged_id)] * 3
    raw_syscall("setresgid", *ids)
    raw_syscall("setresuid", *ids)  # from root to another id: permitted and effective sets emptied
    header = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0))
    data = ctypes.create_string_buffer(bytes(24))  # two {effective, permitted, inheritable}: none
    raw_syscall("capset", header, data)


def confine_thread(program: Path, name: str, mountpoint: Path, unprivileged_id: int = UNPRIVILEGED_ID) -> str:
    """Confine the calling thread (see the module's docstring) for ``program`` to be spawned
    next as ``/<name>``, and return that path. ``mountpoint`` is any existing directory: the new
    root is mounted over it in the thread's own mount namespace only. ``unprivileged_id`` is the
    user and group taken (in a user namespace, one its mappings reach)."""
    if not program.is_file():
        raise FileNotFoundError(f"{program}: no such program")
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    last_cap = int(CAP_LAST_CAP.read_text())  # /proc is out of reach once the root is empty
    namespaces.unshare(CLONE_FILES)  # a descriptor table of the thread's own...
    os.closerange(0, os.sysconf("SC_OPEN_MAX"))  # ...emptied: the daemon's stay open
    _empty_root(program, name, mountpoint)
    _drop_privileges(last_cap, unprivileged_id)
    return "/" + name
