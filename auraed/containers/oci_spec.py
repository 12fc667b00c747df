"""Build an OCI runtime spec (a bundle's config.json, as a dict) from an image and a request.

The request (auraed.containers.request) is checked as its spec is built, together with the image's
config and what the host allows: a bad value raises :class:`SpecError` naming the field.

Decisions worth knowing:

* Command (Docker semantics): ``command`` replaces the image's Entrypoint *and* drops its Cmd;
  ``args`` replaces Cmd. Nothing to run at all is an error.
* Env: the image's, then the request's, overriding by key in place. PATH is added when missing,
  TERM=xterm when a terminal is asked for.
* User: the request's, else the image's User, resolved in the image's /etc/passwd and /etc/group
  (never following a symlink out of the root filesystem); the supplementary groups are the
  primary group (as containerd and CRI-O set them, so that dropping the primary group by a setgid
  program cannot shed a restriction made through it), the user's memberships in /etc/group
  (unless ``strict_groups``) and ``additional_gids``.
* Working directory: created (owned by the user) when the image lacks it, by :func:`build_spec`.
* Capabilities: the usual 14 defaults; "ALL" and names with or without ``CAP_``, any case.
  ``ALL`` means every capability auraed itself holds; adding one auraed lacks is "unsupported"
  (runc would fail on it). Drops apply before adds, except that add ALL minus explicit drops wins.
* oom_score_adj: the request's (0 by default), never below auraed's own, because without
  CAP_SYS_RESOURCE a lower value makes the runtime fail.
* rlimits: RLIMIT_NOFILE 1024/1024 by default (runc's default spec); a hard limit above auraed's
  own is "unsupported" unless auraed holds CAP_SYS_RESOURCE.
* Image Volumes: with a writable root filesystem they stay part of the container's writable layer
  (the image's content there is kept, the data lives as long as the container). With a read-only
  root filesystem each one gets an empty tmpfs so that it stays writable, as does /tmp. A request
  mount at the same destination always wins.
* Mounts: runc's defaults (/proc, /dev and what lives in it, /sys, /sys/fs/cgroup); a request mount
  replaces the default at its own destination only, and the list goes parents before children.
* Namespaces: pid, ipc, uts, mount, cgroup (runc 1.1 supports it on v1 too) and network (a new
  one, or the host's with ``host_network``); the container's sandbox may give a network, ipc, uts
  and pid namespace to join (auraed.containers.sandbox).
* Hostname: the request's, else its name; its sandbox's when it names one. A container joining its
  sandbox's UTS namespace gets none set: the namespace keeps its own.
* Sandbox files: the sandbox's resolv.conf, hosts and hostname files and /dev/shm are bind mounts,
  which a request mount at the same destination replaces, as it replaces the defaults.
* Seccomp: see :func:`default_seccomp_profile`: allow by default, deny a list of dangerous
  syscalls with EPERM (clone3 with ENOSYS so that libc falls back to clone, which is filtered).
  A request may instead give a whole OCI seccomp section (``security.seccomp``).
* Privileged (``security.privileged``, as Docker and containerd mean it): every capability auraed
  holds, every device node of the host's /dev and access to all devices, no seccomp filter, no
  masked or read-only paths, /sys and /sys/fs/cgroup writable.
* Mount propagation: a bind mount's own ("rshared", "rslave" among its options; "rprivate" when
  none is given) needs the root's to carry it: a shared bind mount makes the root rshared, so
  that what the container mounts below it reaches the host, and a slave one makes it rslave
  (``linux.rootfsPropagation``, as containerd sets it).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import stat
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auraed.containers.request import (
    MAX_CFS_QUOTA_US,
    MAX_CPU_SHARES,
    MAX_HOOK_TIMEOUT_SECONDS,
    MAX_ID,
    MAX_INT64,
    MAX_UINT64,
    MIN_CPU_SHARES,
    MIN_MEMORY_BYTES,
    PID_MAX_LIMIT,
    UNLIMITED,
    ContainerRequest,
    Hooks,
    Mount,
    Resources,
    Security,
    SpecError,
    check_hostname,
    check_int,
    check_path,
    check_sysctls,
    check_text,
    env_entry,
    is_decimal,
    parse_signal,
    quoted,
)
from auraed.containers.sandbox import HOST_LOCAL, SandboxContext, SharedNamespaces
from auraed.system.cgroupfs import CgroupError, cpu_weight_to_shares, format_cpu_list, parse_cpu_list
from auraed.system.request_files import FileTooLarge, NotRegularFile, read_regular

OCI_VERSION = "1.0.2"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_NOFILE = 1024
DEFAULT_CPU_PERIOD_US = 100_000
ONLINE_CPUS = Path("/sys/devices/system/cpu/online")
ONLINE_MEMORY_NODES = Path("/sys/devices/system/node/online")
HOST_DEV = Path("/dev")
# Directories of /dev whose contents a privileged container does not get from the host (runc's
# and containerd's list): it has pts, shm and mqueue of its own, fd is /proc/self/fd.
_PRIVATE_DEV_DIRS = frozenset({"pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"})
# /etc/passwd and /etc/group larger than this are refused rather than read into memory.
MAX_ID_FILE_BYTES = 4 * 1024 * 1024
MAX_SECCOMP_PROFILE_BYTES = 1024 * 1024
"""The largest seccomp profile file a request names (docker's default profile is ~20 KiB)."""
_MAX_SYMLINKS = 40


# ------------------------------------------------------------------------------------ constants

# Index = capability number (linux/capability.h).
ALL_CAPABILITIES: tuple[str, ...] = tuple(
    f"CAP_{name}"
    for name in (
        "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
        "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
        "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
        "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
        "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
        "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
    )
)  # fmt: skip
_CAP_INDEX = {name: index for index, name in enumerate(ALL_CAPABILITIES)}

DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip

DEFAULT_MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
)

DEFAULT_READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

# (type, major, minor) allowed read/write/mknod; every other device is denied.
_DEFAULT_DEVICES: tuple[tuple[str, int | None, int | None, str], ...] = (
    ("c", None, None, "m"),  # mknod of any char device (CAP_MKNOD is a default capability) ...
    ("b", None, None, "m"),  # ... and block device; opening them stays denied
    ("c", 1, 3, "rwm"),  # /dev/null
    ("c", 1, 5, "rwm"),  # /dev/zero
    ("c", 1, 7, "rwm"),  # /dev/full
    ("c", 1, 8, "rwm"),  # /dev/random
    ("c", 1, 9, "rwm"),  # /dev/urandom
    ("c", 5, 0, "rwm"),  # /dev/tty
    ("c", 5, 1, "rwm"),  # /dev/console
    ("c", 5, 2, "rwm"),  # /dev/ptmx
    ("c", 136, None, "rwm"),  # /dev/pts/*
)

RLIMITS: dict[str, int] = {
    "RLIMIT_CPU": 0, "RLIMIT_FSIZE": 1, "RLIMIT_DATA": 2, "RLIMIT_STACK": 3, "RLIMIT_CORE": 4,
    "RLIMIT_RSS": 5, "RLIMIT_NPROC": 6, "RLIMIT_NOFILE": 7, "RLIMIT_MEMLOCK": 8, "RLIMIT_AS": 9,
    "RLIMIT_LOCKS": 10, "RLIMIT_SIGPENDING": 11, "RLIMIT_MSGQUEUE": 12, "RLIMIT_NICE": 13,
    "RLIMIT_RTPRIO": 14, "RLIMIT_RTTIME": 15,
}  # fmt: skip


# Mount types a request may ask for; "bind" is the default.
MOUNT_TYPES = frozenset(
    {"bind", "tmpfs", "ramfs", "mqueue", "devpts", "sysfs", "proc", "cgroup", "cgroup2", "overlay"}
)
# Files under /proc a request may mount over (what runc itself allows, e.g. for lxcfs).
_PROC_MOUNT_ALLOWED = frozenset(
    {
        "/proc/cpuinfo",
        "/proc/diskstats",
        "/proc/meminfo",
        "/proc/stat",
        "/proc/swaps",
        "/proc/uptime",
        "/proc/loadavg",
        "/proc/slabinfo",
        "/proc/net/dev",
        "/proc/sys/kernel/ns_last_pid",
    }
)
_PROPAGATION = frozenset({"private", "rprivate", "shared", "rshared", "slave", "rslave"})


# ---------------------------------------------------------------------- image and host facts


@dataclass(frozen=True)
class ImageRuntimeConfig:
    """The parts of an OCI image config that shape how a container runs."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    stop_signal: str = ""
    volumes: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HostFacts:
    """What auraed itself may hand on to a container; :meth:`probe` reads it from /proc."""

    oom_score_adj: int = 0
    # Capabilities auraed holds (permitted and in its bounding set).
    capabilities: frozenset[str] = frozenset(ALL_CAPABILITIES)
    # Hard limits by RLIMIT name; absent means unlimited.
    rlimit_hard: Mapping[str, int] = field(default_factory=dict)
    # Whether auraed may raise hard rlimits (CAP_SYS_RESOURCE).
    can_raise_rlimits: bool = True
    machine: str = "x86_64"
    # CPUs and memory nodes a cpuset may name; None: read from the machine when a cpuset asks
    # (not in probe: ~0.2 ms of sysfs on every Create's path, for the few that set a cpuset).
    online_cpus: frozenset[int] | None = None
    online_memory_nodes: frozenset[int] | None = None

    def cpus_online(self) -> frozenset[int] | None:
        """The CPUs a cpuset may name; None when they cannot be known (then not checked)."""
        return self.online_cpus if self.online_cpus is not None else read_index_list(ONLINE_CPUS)

    def memory_nodes_online(self) -> frozenset[int] | None:
        """The memory nodes a cpuset may name; None when they cannot be known (then not checked)."""
        if self.online_memory_nodes is not None:
            return self.online_memory_nodes
        # A kernel without CONFIG_NUMA has no node directory in sysfs, and one node: 0.
        return read_index_list(ONLINE_MEMORY_NODES, missing=frozenset({0}))

    @classmethod
    def probe(cls) -> HostFacts:
        caps = _read_capabilities()
        hard: dict[str, int] = {}
        for name, number in RLIMITS.items():
            try:
                limit = resource.getrlimit(number)[1]
            except (ValueError, OSError):
                continue
            if limit != resource.RLIM_INFINITY and limit >= 0:
                hard[name] = limit
        return cls(
            oom_score_adj=read_oom_score_adj(),
            capabilities=caps,
            rlimit_hard=hard,
            can_raise_rlimits="CAP_SYS_RESOURCE" in caps,
            machine=os.uname().machine,
        )


def read_index_list(path: Path, missing: frozenset[int] | None = None) -> frozenset[int] | None:
    """A kernel CPU or node list file ("0-3,5"); ``missing`` when there is no such file, None
    when it cannot be read."""
    try:
        return frozenset(parse_cpu_list(path.read_text()))
    except FileNotFoundError:
        return missing
    except (OSError, ValueError):
        return None


def read_oom_score_adj(path: Path = Path("/proc/self/oom_score_adj")) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _read_capabilities(status: Path = Path("/proc/self/status")) -> frozenset[str]:
    masks: dict[str, int] = {}
    try:
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("CapPrm", "CapBnd"):
                masks[key] = int(value.strip(), 16)
    except (OSError, ValueError):
        return frozenset(ALL_CAPABILITIES)
    mask = masks.get("CapPrm", 0) & masks.get("CapBnd", 0)
    return frozenset(name for index, name in enumerate(ALL_CAPABILITIES) if mask >> index & 1)


# -------------------------------------------------------------------------------- image config


def _refuse(lenient: bool, where: str, problem: str) -> None:
    """A bad image config value: an error when strict, left out when lenient."""
    if not lenient:
        raise SpecError("invalid", f"{where}: {problem}")


def _valid_utf8(text: str) -> str:
    """``text`` as protobuf can carry it: JSON may hold lone surrogates ("\\ud800"); they become "?"."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _json_strings(value: object, where: str, lenient: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        _refuse(lenient, where, "must be a list of strings")
    return tuple(item for item in value if isinstance(item, str)) if isinstance(value, list) else ()


def _json_keys(value: object, where: str, lenient: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, dict | list):
        keys = list(value)
    else:
        _refuse(lenient, where, "must be an object or a list")
        keys = []
    if not all(isinstance(key, str) for key in keys):
        _refuse(lenient, where, "keys must be strings")
    return tuple(key for key in keys if isinstance(key, str))


def _json_string(value: object, where: str, lenient: bool) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        _refuse(lenient, where, "must be a string")
        return ""
    return value


def _json_labels(value: object, where: str, lenient: bool) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        _refuse(lenient, where, "must map strings to strings")
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def image_runtime_config(config_json: Mapping[str, Any], *, lenient: bool = False) -> ImageRuntimeConfig:
    """Parse an OCI/Docker image config (the whole document, or just its "config" object).

    Strict by default, as a container is made from it: a value of the wrong type, or an Env
    entry that is not KEY=VALUE, raises SpecError naming the field. ``lenient`` is for describing
    a stored image (ListImages, ImageStatus): nothing raises, values of the wrong type are left
    out, Env entries are kept as the image has them and every string is made valid UTF-8. One
    odd image must not break every listing; Create still refuses it, naming the field.
    """
    if not isinstance(config_json, Mapping):
        _refuse(lenient, "image config", "must be a JSON object")
        config_json = {}
    inner: object = config_json.get("config", config_json)
    if inner is None:
        inner = {}
    if not isinstance(inner, Mapping):
        _refuse(lenient, "image config.config", "must be a JSON object")
        inner = {}
    labels = _json_labels(inner.get("Labels"), "image config.Labels", lenient)
    env = _json_strings(inner.get("Env"), "image config.Env", lenient)
    if not lenient:
        for index, entry in enumerate(env):
            env_entry(entry, f"image config.Env[{index}]")
    config = ImageRuntimeConfig(
        entrypoint=_json_strings(inner.get("Entrypoint"), "image config.Entrypoint", lenient),
        cmd=_json_strings(inner.get("Cmd"), "image config.Cmd", lenient),
        env=env,
        working_dir=_json_string(inner.get("WorkingDir"), "image config.WorkingDir", lenient),
        user=_json_string(inner.get("User"), "image config.User", lenient),
        stop_signal=_json_string(inner.get("StopSignal"), "image config.StopSignal", lenient),
        volumes=_json_keys(inner.get("Volumes"), "image config.Volumes", lenient),
        exposed_ports=_json_keys(inner.get("ExposedPorts"), "image config.ExposedPorts", lenient),
        labels=labels,
    )
    return _with_valid_utf8(config) if lenient else config


def _with_valid_utf8(config: ImageRuntimeConfig) -> ImageRuntimeConfig:
    def each(values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(map(_valid_utf8, values))

    return ImageRuntimeConfig(
        entrypoint=each(config.entrypoint),
        cmd=each(config.cmd),
        env=each(config.env),
        working_dir=_valid_utf8(config.working_dir),
        user=_valid_utf8(config.user),
        stop_signal=_valid_utf8(config.stop_signal),
        volumes=each(config.volumes),
        exposed_ports=each(config.exposed_ports),
        labels={_valid_utf8(k): _valid_utf8(v) for k, v in config.labels.items()},
    )


# -------------------------------------------------------------------------------- stop signal


def stop_signal(image: ImageRuntimeConfig, request: ContainerRequest) -> int:
    """The request's stop signal, else the image's StopSignal, else SIGTERM."""
    if request.stop_signal:
        return parse_signal(request.stop_signal, "stop_signal")
    if image.stop_signal:
        return parse_signal(image.stop_signal, "image config.StopSignal")
    return int(signal.SIGTERM)


# ----------------------------------------------------------------- files inside the rootfs


def _open_in_root(root_fd: int, path: str, mkdir_owner: tuple[int, int] | None = None) -> int:
    """An O_PATH fd for ``path`` resolved as if ``root_fd`` were "/": symlinks (absolute or with
    "..") never lead out of it. Missing components raise FileNotFoundError, or are created as
    directories owned by ``mkdir_owner``. The caller closes the fd."""
    parts = deque(part for part in path.split("/") if part not in ("", "."))
    stack = [os.dup(root_fd)]
    links = 0
    try:
        while parts:
            name = parts.popleft()
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, dir_fd=stack[-1])
            except FileNotFoundError:
                if mkdir_owner is None:
                    raise
                os.mkdir(name, 0o755, dir_fd=stack[-1])
                os.chown(name, *mkdir_owner, dir_fd=stack[-1], follow_symlinks=False)
                fd = os.open(name, flags | os.O_DIRECTORY, dir_fd=stack[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                try:
                    target = os.readlink("", dir_fd=fd)
                finally:
                    os.close(fd)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                parts.extendleft(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            if parts and not stat.S_ISDIR(mode):
                os.close(fd)
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            stack.append(fd)
        return os.dup(stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def _open_root(rootfs: Path, where: str) -> int:
    try:
        return os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SpecError("not_found", f"{where}: the root filesystem {rootfs} does not exist") from None
    except OSError as exc:
        raise SpecError("invalid", f"{where}: cannot open the root filesystem {rootfs}: {exc}") from None


def read_file_in_root(rootfs: Path, path: str, where: str, limit: int = MAX_ID_FILE_BYTES) -> str | None:
    """The text of a regular file inside ``rootfs`` (symlinks resolved within it); None if missing."""
    root_fd = _open_root(rootfs, where)
    try:
        try:
            path_fd = _open_in_root(root_fd, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(path_fd)
            if not stat.S_ISREG(st.st_mode):
                raise SpecError("invalid", f"{where}: {path} in the image is not a regular file")
            if st.st_size > limit:
                raise SpecError("invalid", f"{where}: {path} in the image is larger than {limit} bytes")
            # Reopening through /proc/self/fd reads exactly the file resolved above.
            fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(path_fd)
        with os.fdopen(fd, "rb") as file:
            data = file.read(limit + 1)
        if len(data) > limit:
            raise SpecError("invalid", f"{where}: {path} in the image is larger than {limit} bytes")
        return data.decode("utf-8", errors="replace")
    except OSError as exc:
        raise SpecError("invalid", f"{where}: cannot read {path} in the image: {exc.strerror}") from None
    finally:
        os.close(root_fd)


def ensure_working_dir(rootfs: Path, cwd: str, uid: int, gid: int, *, where: str = "working_dir") -> None:
    """Create ``cwd`` inside ``rootfs`` when missing, each new directory owned by ``uid:gid``.

    Symlinks are resolved within ``rootfs``, so the directory is never created outside it."""
    cwd = check_path(cwd, where)
    root_fd = _open_root(rootfs, where)
    try:
        fd = _open_in_root(root_fd, cwd, mkdir_owner=(uid, gid))
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise SpecError(
                    "invalid", f"{where}: {quoted(cwd)} exists in the image and is not a directory"
                )
        finally:
            os.close(fd)
    except NotADirectoryError:
        raise SpecError("invalid", f"{where}: a component of {quoted(cwd)} is not a directory") from None
    except OSError as exc:
        raise SpecError("invalid", f"{where}: cannot create {quoted(cwd)}: {exc.strerror}") from None
    finally:
        os.close(root_fd)


# ----------------------------------------------------------------------------------- users


@dataclass(frozen=True)
class _Passwd:
    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class _Group:
    name: str
    gid: int
    members: tuple[str, ...]


def _parse_id(text: str) -> int | None:
    if not is_decimal(text) or len(text) > 10:
        return None
    value = int(text)
    return value if value <= MAX_ID else None


def _parse_passwd(text: str) -> list[_Passwd]:
    out: list[_Passwd] = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 4 or line.startswith("#"):
            continue
        uid, gid = _parse_id(fields[2]), _parse_id(fields[3])
        if fields[0] and uid is not None and gid is not None:
            out.append(_Passwd(fields[0], uid, gid))
    return out


def _parse_group(text: str) -> list[_Group]:
    out: list[_Group] = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 3 or line.startswith("#"):
            continue
        gid = _parse_id(fields[2])
        members = tuple(m for m in fields[3].split(",") if m) if len(fields) > 3 else ()
        if fields[0] and gid is not None:
            out.append(_Group(fields[0], gid, members))
    return out


def resolve_user(rootfs: Path, user: str, *, where: str = "user") -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary gids) for "name", "uid", "uid:gid", "name:group" ("" is root),
    looked up in the image's /etc/passwd and /etc/group."""
    check_text(user, where)
    user_part, sep, group_part = user.strip().partition(":")
    if sep and not group_part:
        raise SpecError("invalid", f"{where}: {quoted(user)} has an empty group")
    if not user_part:
        if sep:
            raise SpecError("invalid", f"{where}: {quoted(user)} has an empty user")
        user_part = "0"
    passwd_text = read_file_in_root(rootfs, "/etc/passwd", where)
    passwd = _parse_passwd(passwd_text or "")
    entry: _Passwd | None
    if is_decimal(user_part):
        uid = _parse_id(user_part)
        if uid is None:
            raise SpecError("invalid", f"{where}: uid {quoted(user_part)} is out of range")
        entry = next((p for p in passwd if p.uid == uid), None)
    else:
        entry = next((p for p in passwd if p.name == user_part), None)
        if entry is None:
            raise SpecError(
                "not_found", f"{where}: user {quoted(user_part)} not found in the image's /etc/passwd"
            )
        uid = entry.uid
    gid = entry.gid if entry is not None else 0

    groups: list[_Group] | None = None
    if group_part or entry is not None:
        groups = _parse_group(read_file_in_root(rootfs, "/etc/group", where) or "")
    if group_part:
        assert groups is not None
        if is_decimal(group_part):
            parsed = _parse_id(group_part)
            if parsed is None:
                raise SpecError("invalid", f"{where}: gid {quoted(group_part)} is out of range")
            gid = parsed
        else:
            found = next((g for g in groups if g.name == group_part), None)
            if found is None:
                raise SpecError(
                    "not_found", f"{where}: group {quoted(group_part)} not found in the image's /etc/group"
                )
            gid = found.gid
    supplementary: list[int] = []
    if entry is not None and groups is not None:
        supplementary = sorted({g.gid for g in groups if entry.name in g.members and g.gid != gid})
    return uid, gid, supplementary


def process_user(uid: int, gid: int, groups: Sequence[int]) -> dict[str, Any]:
    """The spec's ``process.user``: the primary group first among the supplementary groups, then
    ``groups`` in order, each once."""
    return {"uid": uid, "gid": gid, "additionalGids": list(dict.fromkeys((gid, *groups)))}


# --------------------------------------------------------------------------------- capabilities


def capability_name(raw: str, where: str) -> str:
    """Normalise "net_admin" / "CAP_NET_ADMIN" / "ALL"; anything else is invalid."""
    check_text(raw, where)
    name = raw.strip().upper()
    if name in ("ALL", "CAP_ALL"):
        return "ALL"
    if not name.startswith("CAP_"):
        name = "CAP_" + name
    if name not in _CAP_INDEX:
        raise SpecError("invalid", f"{where}: {quoted(raw)} is not a capability")
    return name


def compute_capabilities(security: Security, available: frozenset[str]) -> list[str]:
    if security.privileged:
        return sorted(available, key=_CAP_INDEX.__getitem__)
    adds = [
        (capability_name(raw, f"security.capabilities_add[{i}]"), i)
        for i, raw in enumerate(security.capabilities_add)
    ]
    drops = {
        capability_name(raw, f"security.capabilities_drop[{i}]")
        for i, raw in enumerate(security.capabilities_drop)
    }
    for name, index in adds:
        if name != "ALL" and name not in available:
            raise SpecError(
                "unsupported",
                f"security.capabilities_add[{index}]: {name} is not available to auraed on this machine",
            )
    add_names = {name for name, _ in adds}
    if "ALL" in add_names:
        caps = set(available) - drops
    else:
        caps = set() if "ALL" in drops else set(DEFAULT_CAPABILITIES) - drops
        caps |= add_names
    return sorted(caps & available, key=_CAP_INDEX.__getitem__)


# ----------------------------------------------------------------------------------- seccomp

_EPERM = errno.EPERM
_ENOSYS = errno.ENOSYS
_CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

_MOUNT_AND_NAMESPACE_SYSCALLS = (
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "unshare", "setns", "swapon", "swapoff", "quotactl", "quotactl_fd",
    "lookup_dcookie", "fanotify_init",
)  # fmt: skip

# (syscalls denied with EPERM, capabilities any one of which lifts the denial)
_SECCOMP_DENY: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    # Kernel modules and kexec: loading code into the host kernel.
    (("init_module", "finit_module", "delete_module", "create_module"), ("CAP_SYS_MODULE",)),
    (("kexec_load", "kexec_file_load", "reboot"), ("CAP_SYS_BOOT",)),
    # Mounts and namespaces: the usual first step of an escape; user namespaces expose a large
    # kernel surface to otherwise unprivileged code.
    (_MOUNT_AND_NAMESPACE_SYSCALLS, ("CAP_SYS_ADMIN",)),
    (("bpf",), ("CAP_SYS_ADMIN", "CAP_BPF")),
    (("perf_event_open",), ("CAP_SYS_ADMIN", "CAP_PERFMON")),
    (("open_by_handle_at",), ("CAP_DAC_READ_SEARCH",)),
    (("acct",), ("CAP_SYS_PACCT",)),
    (
        ("settimeofday", "stime", "clock_settime", "clock_settime64", "clock_adjtime", "clock_adjtime64"),
        ("CAP_SYS_TIME",),
    ),
    (("iopl", "ioperm"), ("CAP_SYS_RAWIO",)),
    (("syslog",), ("CAP_SYSLOG",)),
    (("userfaultfd",), ("CAP_SYS_PTRACE",)),
    # Not namespaced (keyrings) or a frequent source of kernel bugs (io_uring), or obsolete.
    (("keyctl", "add_key", "request_key"), ()),
    (("io_uring_setup", "io_uring_enter", "io_uring_register"), ()),
    (("vm86", "vm86old", "nfsservctl", "uselib", "get_kernel_syms", "query_module"), ()),
)


def seccomp_architectures(machine: str) -> list[str]:
    if machine in ("x86_64", "amd64"):
        return ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    if machine in ("aarch64", "arm64"):
        return ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]
    return []


def default_seccomp_profile(
    capabilities: Iterable[str] | None = None, machine: str | None = None
) -> dict[str, Any]:
    """auraed's default seccomp profile, for a container holding ``capabilities`` (the defaults
    when None).

    An allowlist (Docker's approach) must track every new syscall of every libc; this is a
    denylist instead: everything is allowed except syscalls that reach host-global kernel state
    or a large attack surface, which fail with EPERM. Most of them need a capability the
    container does not hold anyway; the filter is the second wall, and is lifted for a syscall
    when the container was granted the capability it exists for (as Docker does).
    clone(2) with a namespace flag is denied like unshare(2). clone3(2) passes its flags in
    memory a filter cannot read, so it fails with ENOSYS, which makes glibc (2.34+) and musl fall
    back to clone(2); EPERM would make them fail outright. ptrace and personality stay allowed:
    Linux 4.8+ no longer lets ptrace bypass seccomp, and personality flags are cleared on exec
    of set-uid programs.
    """
    caps = set(DEFAULT_CAPABILITIES if capabilities is None else capabilities)
    syscalls: list[dict[str, Any]] = []
    for names, lifted_by in _SECCOMP_DENY:
        if caps.intersection(lifted_by):
            continue
        syscalls.append({"names": list(names), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM})
    if "CAP_SYS_ADMIN" not in caps:
        syscalls.extend(
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": _EPERM,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
            for flag in _CLONE_NAMESPACE_FLAGS
        )
        syscalls.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS})
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": seccomp_architectures(machine if machine is not None else os.uname().machine),
        "syscalls": syscalls,
    }


def _seccomp(security: Security, capabilities: list[str], machine: str) -> dict[str, Any] | None:
    """The spec's linux.seccomp: none for a privileged container, else the request's section, else
    the profile it names."""
    if security.privileged:
        return None
    if security.seccomp is not None:
        return _checked_seccomp(security.seccomp, "security.seccomp", "the section")
    profile = security.seccomp_profile
    where = "security.seccomp_profile"
    check_text(profile, where)
    if profile in ("", "default"):
        return default_seccomp_profile(capabilities, machine)
    if profile == "unconfined":
        return None
    path = Path(check_path(profile, where))
    try:
        data = read_regular(path, MAX_SECCOMP_PROFILE_BYTES)  # a FIFO or /dev/zero: refused
    except FileNotFoundError:
        raise SpecError("not_found", f"{where}: {quoted(profile)} does not exist") from None
    except (NotRegularFile, FileTooLarge) as exc:
        raise SpecError("invalid", f"{where}: {exc.strerror}") from None
    except OSError as exc:
        raise SpecError("invalid", f"{where}: cannot read {quoted(profile)}: {exc.strerror}") from None
    try:
        loaded = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError("invalid", f"{where}: {quoted(profile)} is not JSON: {exc}") from None
    return _checked_seccomp(loaded, where, quoted(profile))


def _checked_seccomp(section: object, where: str, what: str) -> dict[str, Any]:
    """``section`` if it has the shape of an OCI seccomp section; the runtime checks the rest."""
    if not isinstance(section, Mapping) or not isinstance(section.get("defaultAction"), str):
        raise SpecError("invalid", f"{where}: {what} is not an OCI seccomp profile (no defaultAction)")
    return dict(section)


# ----------------------------------------------------------------------------------- process


def process_args(image: ImageRuntimeConfig, request: ContainerRequest) -> list[str]:
    """Entrypoint + Cmd with Docker's override rules."""
    if request.command:
        args = [*request.command, *request.args]
    else:
        args = [*image.entrypoint, *(request.args or image.cmd)]
    for index, arg in enumerate(request.command):
        check_text(arg, f"command[{index}]")
    for index, arg in enumerate(request.args):
        check_text(arg, f"args[{index}]")
    if not args:
        raise SpecError("invalid", "command: no command: neither the request nor the image names one")
    if not args[0]:
        raise SpecError("invalid", "command: the program to run is an empty string")
    for arg in args:
        check_text(arg, "image config.Entrypoint/Cmd")
    return args


def process_env(image: ImageRuntimeConfig, request: ContainerRequest) -> list[str]:
    merged = _env_by_key(image.env, "image config.Env")
    merged.update(_env_by_key(request.env, "env"))
    merged.setdefault("PATH", DEFAULT_PATH)
    if request.tty:
        merged.setdefault("TERM", "xterm")
    return [f"{key}={value}" for key, value in merged.items()]


def _env_by_key(entries: Sequence[str], where: str) -> dict[str, str]:
    """KEY=VALUE entries by key, in order; a later entry overrides an earlier one in place."""
    return dict(env_entry(entry, f"{where}[{index}]") for index, entry in enumerate(entries))


def exec_process(
    defaults: Mapping[str, Any], command: Sequence[str], env: Sequence[str], working_dir: str
) -> dict[str, Any]:
    """The OCI process for an Exec: the container's own (``defaults``), running ``command``, its
    env extended by ``env`` (overriding by key, as Create's env does), in ``working_dir`` when
    given. Checked as Create checks its fields, which are named as ExecStart's ("start.env[0]")."""
    if not command:
        raise SpecError("invalid", "start.command: is required")
    for index, arg in enumerate(command):
        check_text(arg, f"start.command[{index}]")
    if not command[0]:
        raise SpecError("invalid", "start.command[0]: the program to run is an empty string")
    process = dict(defaults)
    process["args"] = list(command)
    if env:
        merged = _env_by_key(process.get("env", ()), "the container's env")
        merged.update(_env_by_key(env, "start.env"))
        process["env"] = [f"{key}={value}" for key, value in merged.items()]
    if working_dir:
        process["cwd"] = check_path(working_dir, "start.working_dir")
    return process


def _rlimits(request: ContainerRequest, host: HostFacts) -> list[dict[str, Any]]:
    limits: dict[str, tuple[int, int, str]] = {}
    default_hard = DEFAULT_NOFILE
    if not host.can_raise_rlimits:
        default_hard = min(default_hard, host.rlimit_hard.get("RLIMIT_NOFILE", default_hard))
    limits["RLIMIT_NOFILE"] = (default_hard, default_hard, "")
    for index, limit in enumerate(request.rlimits):
        where = f"rlimits[{index}]"
        raw = check_text(limit.type, f"{where}.type", allow_empty=False)
        name = raw.strip().upper()
        if not name.startswith("RLIMIT_"):
            name = "RLIMIT_" + name
        if name not in RLIMITS:
            raise SpecError("invalid", f"{where}.type: {quoted(raw)} is not an rlimit")
        soft = check_int(limit.soft, f"{where}.soft", 0, MAX_UINT64)
        hard = check_int(limit.hard, f"{where}.hard", 0, MAX_UINT64)
        if soft > hard:
            raise SpecError("invalid", f"{where}: soft limit {soft} is above the hard limit {hard}")
        own = host.rlimit_hard.get(name)
        if own is not None and hard > own and not host.can_raise_rlimits:
            raise SpecError(
                "unsupported",
                f"{where}: hard limit {hard} for {name} is above auraed's own ({own}) and auraed "
                "lacks CAP_SYS_RESOURCE to raise it",
            )
        limits[name] = (soft, hard, where)
    return [{"type": name, "hard": hard, "soft": soft} for name, (soft, hard, _) in limits.items()]


def _hostname(request: ContainerRequest, sandbox: SandboxContext) -> str | None:
    """The hostname the container's UTS namespace gets; None for one joined or the host's, which
    keep their own."""
    if "uts" in sandbox.namespaces.host:
        if request.hostname or sandbox.hostname is not None or sandbox.namespaces.uts is not None:
            raise SpecError(
                "invalid", "hostname: a container in the host's UTS namespace keeps the host's name"
            )
        return None
    if sandbox.hostname is None and sandbox.namespaces.uts is None:
        where = "hostname" if request.hostname else "name"
        name = check_text(request.hostname or request.name, where)
        if not name:
            raise SpecError("invalid", "hostname: empty, and so is name")
        return check_hostname(name, where)
    if request.hostname:
        raise SpecError("invalid", "hostname: the container's sandbox names its host")
    if sandbox.hostname is None:
        return None
    if sandbox.namespaces.uts is not None:
        raise SpecError("invalid", "sandbox.hostname: a joined UTS namespace keeps its own hostname")
    return check_hostname(sandbox.hostname, "sandbox.hostname")


def _namespaces(request: ContainerRequest, shared: SharedNamespaces) -> list[dict[str, str]]:
    """The container's own namespaces, or those of its sandbox it joins by path; no network
    namespace at all with ``host_network``."""
    if request.host_network and shared.network is not None:
        raise SpecError(
            "invalid", "host_network: the container cannot both share the host's and join a network namespace"
        )
    joined = {"pid": shared.pid, "ipc": shared.ipc, "uts": shared.uts, "network": shared.network}
    if shared.user is not None:  # first: the others are owned by it (runc joins in this order)
        joined["user"] = shared.user.path
    unknown = shared.host - {"pid", "ipc", "uts"}
    if unknown:
        raise SpecError(
            "invalid", f"sandbox.namespaces.host: {', '.join(sorted(unknown))} cannot be the host's"
        )
    namespaces: list[dict[str, str]] = []
    for kind in ("user", "pid", "ipc", "uts", "mount", "cgroup", "network"):
        if kind == "user" and shared.user is None:
            continue
        path = joined.get(kind)
        if path is not None and kind in shared.host:
            raise SpecError("invalid", f"sandbox.namespaces.{kind}: both the host's and joined by path")
        if path is not None:
            where = f"sandbox.namespaces.{kind}"
            namespaces.append({"type": kind, "path": check_path(os.fspath(path), where)})
        elif kind not in shared.host and (kind != "network" or not request.host_network):
            namespaces.append({"type": kind})
    return namespaces


# ------------------------------------------------------------------------------------- mounts


def _default_mounts(writable_sys: bool = False) -> list[dict[str, Any]]:
    read_only = [] if writable_sys else ["ro"]
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", *read_only],
        },
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": ["nosuid", "noexec", "nodev", "relatime", *read_only],
        },
    ]


def _tmpfs(destination: str, mode: str) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", f"mode={mode}"],
    }


def _sandbox_mounts(sandbox: SandboxContext, read_only_rootfs: bool) -> list[dict[str, Any]]:
    """Bind mounts of what the sandbox shares: its /etc files (read-only with a read-only rootfs,
    as containerd mounts them) and its /dev/shm (as the tmpfs it replaces: nosuid, noexec, nodev)."""
    etc_options = ["rbind", "rprivate", *(["ro"] if read_only_rootfs else [])]
    shared = (
        ("/etc/resolv.conf", sandbox.resolv_conf, "sandbox.resolv_conf", etc_options),
        ("/etc/hosts", sandbox.hosts, "sandbox.hosts", etc_options),
        ("/etc/hostname", sandbox.hostname_file, "sandbox.hostname_file", etc_options),
        ("/dev/shm", sandbox.shm, "sandbox.shm", ["rbind", "rprivate", "nosuid", "noexec", "nodev"]),
    )
    mounts: list[dict[str, Any]] = []
    for destination, source, where, options in shared:
        if source is None:
            continue
        path = check_path(os.fspath(source), where)
        if not os.path.lexists(path):
            raise SpecError("not_found", f"{where}: {path} does not exist")
        mounts.append({"destination": destination, "type": "bind", "source": path, "options": list(options)})
    return mounts


def _request_mount(mount: Mount, where: str) -> dict[str, Any]:
    destination = check_path(mount.destination, f"{where}.destination", allow_root=False)
    if destination == "/proc" or (
        destination.startswith("/proc/") and destination not in _PROC_MOUNT_ALLOWED
    ):
        raise SpecError("invalid", f"{where}.destination: cannot mount over {destination}")
    kind = check_text(mount.type, f"{where}.type").strip().lower() or "bind"
    if kind not in MOUNT_TYPES:
        raise SpecError("unsupported", f"{where}.type: {quoted(mount.type)} is not a supported mount type")
    options: list[str] = []
    for index, option in enumerate(mount.options):
        check_text(option, f"{where}.options[{index}]", allow_empty=False)
        if "," in option:
            raise SpecError("invalid", f"{where}.options[{index}]: {quoted(option)} contains a comma")
        options.append(option)
    if kind == "bind":
        source = check_path(mount.source, f"{where}.source")
        if not os.path.lexists(source):
            raise SpecError("not_found", f"{where}.source: {source} does not exist")
        if "bind" not in options and "rbind" not in options:
            options.insert(0, "rbind")
        if not _PROPAGATION.intersection(options):
            options.append("rprivate")
    else:
        source = check_text(mount.source, f"{where}.source") or kind
    if mount.read_only and "ro" not in options:
        options.append("ro")
    return {"destination": destination, "type": kind, "source": source, "options": options}


def _mounts(
    image: ImageRuntimeConfig, request: ContainerRequest, sandbox: SandboxContext
) -> list[dict[str, Any]]:
    extra: list[dict[str, Any]] = []
    taken: set[str] = set()
    for index, mount in enumerate(request.mounts):
        spec_mount = _request_mount(mount, f"mounts[{index}]")
        if spec_mount["destination"] in taken:
            raise SpecError(
                "invalid", f"mounts[{index}].destination: {spec_mount['destination']} is mounted twice"
            )
        taken.add(spec_mount["destination"])
        extra.append(spec_mount)
    if request.security.read_only_rootfs:
        for index, volume in enumerate(image.volumes):
            destination = check_path(volume, f"image config.Volumes[{index}]", allow_root=False)
            if destination not in taken:
                taken.add(destination)
                extra.append(_tmpfs(destination, "755"))
        if "/tmp" not in taken:
            taken.add("/tmp")
            extra.append(_tmpfs("/tmp", "1777"))
    # The sandbox's mounts replace the defaults at their destinations (its /dev/shm the tmpfs),
    # and a request mount replaces either at its destination only. The whole list is ordered
    # parents before children (a stable sort by depth), so that no mount hides a later one: a
    # tmpfs asked for at /dev still gets /dev/pts, /dev/shm and /dev/mqueue mounted on it.
    shared = _sandbox_mounts(sandbox, request.security.read_only_rootfs)
    replaced = {m["destination"] for m in shared}
    defaults = [
        m for m in _default_mounts(request.security.privileged) if m["destination"] not in replaced
    ] + shared
    defaults = [m for m in defaults if m["destination"] not in taken]
    return sorted(defaults + extra, key=lambda m: _path_depth(m["destination"]))


def _rootfs_propagation(mounts: Sequence[Mount]) -> str | None:
    """The root's propagation the request's bind mounts need (None: the runtime's default)."""
    wanted = {option for m in mounts if m.type.strip().lower() in ("", "bind") for option in m.options}
    if wanted & {"shared", "rshared"}:
        return "rshared"
    if wanted & {"slave", "rslave"}:
        return "rslave"
    return None


def _path_depth(path: str) -> int:
    return len(path.rstrip("/").split("/"))


# -------------------------------------------------------------------------------------- linux


def _resources(resources: Resources, host: HostFacts, all_devices: bool) -> dict[str, Any]:
    out = resource_limits(resources, host)
    if all_devices:
        out["devices"] = [{"allow": True, "access": "rwm"}]
    else:
        out["devices"] = [{"allow": False, "access": "rwm"}] + [
            _device_rule(kind, major, minor, access) for kind, major, minor, access in _DEFAULT_DEVICES
        ]
    return out


def resource_limits(resources: Resources, host: HostFacts | None = None) -> dict[str, Any]:
    """The spec's ``linux.resources`` for the limits asked for, devices aside: also what an OCI
    runtime's ``update --resources`` takes for a container that runs."""
    if host is None:
        host = HostFacts.probe()
    out: dict[str, Any] = {}
    cpu = _cpu_limits(resources, host)
    if cpu:
        out["cpu"] = cpu
    memory = _memory_limits(resources)
    if memory:
        out["memory"] = memory
    if resources.pids_max is not None:
        out["pids"] = {"limit": check_int(resources.pids_max, "resources.pids_max", 1, PID_MAX_LIMIT)}
    return out


def _cpu_limits(resources: Resources, host: HostFacts) -> dict[str, Any]:
    cpu: dict[str, Any] = {}
    if resources.cpu_weight is not None and resources.cpu_shares is not None:
        raise SpecError("invalid", "resources.cpu_shares: give cpu_weight or cpu_shares, not both")
    if resources.cpu_weight is not None:
        weight = check_int(resources.cpu_weight, "resources.cpu_weight", 1, 10_000)
        try:
            cpu["shares"] = cpu_weight_to_shares(weight)
        except CgroupError as exc:  # pragma: no cover - the range is checked above
            raise SpecError("invalid", f"resources.cpu_weight: {exc}") from None
    if resources.cpu_shares is not None:
        cpu["shares"] = check_int(
            resources.cpu_shares, "resources.cpu_shares", MIN_CPU_SHARES, MAX_CPU_SHARES
        )
    if resources.cpu_period is not None:
        cpu["period"] = check_int(resources.cpu_period, "resources.cpu_period", 1_000, 1_000_000)
    if resources.cpu_max is not None:
        cpu["quota"] = check_int(resources.cpu_max, "resources.cpu_max", 1_000, MAX_CFS_QUOTA_US)
        cpu.setdefault("period", DEFAULT_CPU_PERIOD_US)
    for key, value, where, online in (
        ("cpus", resources.cpuset_cpus, "resources.cpuset_cpus", host.cpus_online),
        ("mems", resources.cpuset_mems, "resources.cpuset_mems", host.memory_nodes_online),
    ):
        if value is not None:
            cpu[key] = _cpuset(value, where, online)
    return cpu


def _memory_limits(resources: Resources) -> dict[str, Any]:
    memory: dict[str, Any] = {}
    if resources.memory_max is not None:
        memory["limit"] = check_int(resources.memory_max, "resources.memory_max", MIN_MEMORY_BYTES, MAX_INT64)
    if resources.memory_swap is not None:
        # The kernel takes memory + swap only above a memory limit (v1 refuses memsw below it).
        if resources.memory_max is None:
            raise SpecError("invalid", "resources.memory_swap: needs resources.memory_max")
        if resources.memory_swap != UNLIMITED:
            check_int(resources.memory_swap, "resources.memory_swap", resources.memory_max, MAX_INT64)
        memory["swap"] = resources.memory_swap
    return memory


def host_devices(root: Path = HOST_DEV) -> list[dict[str, Any]]:
    """The device nodes under ``root`` (the host's /dev) as the spec's linux.devices, for a
    privileged container: what containerd hands one. Symlinks, fifos, sockets, /dev/console
    and the directories the container has of its own are left out."""
    devices: list[dict[str, Any]] = []
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except OSError:
            continue  # gone, or unreadable: not a device to hand on
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if entry.name not in _PRIVATE_DEV_DIRS:
                    pending.append(Path(entry.path))
                continue
            kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
            if kind is None or (directory == root and entry.name == "console"):
                continue
            devices.append(
                {
                    "path": "/dev/" + os.path.relpath(entry.path, root),
                    "type": kind,
                    "major": os.major(st.st_rdev),
                    "minor": os.minor(st.st_rdev),
                    "fileMode": stat.S_IMODE(st.st_mode),
                    "uid": st.st_uid,
                    "gid": st.st_gid,
                }
            )
    return sorted(devices, key=lambda device: device["path"])


def _cpuset(value: str, where: str, online_now: Callable[[], frozenset[int] | None]) -> str:
    """A cpuset list, every CPU or memory node in it online (when that can be known): the
    kernel refuses others only when the runtime writes the cgroup, at Start."""
    check_text(value, where)
    try:
        parsed = parse_cpu_list(value)
    except ValueError as exc:
        raise SpecError("invalid", f"{where}: {exc}") from None
    if not parsed:
        raise SpecError("invalid", f"{where}: must not be empty")
    online = online_now()
    if online is not None and not parsed <= online:
        raise SpecError(
            "invalid",
            f"{where}: {format_cpu_list(parsed - online)} not online on this machine (online: "
            f"{format_cpu_list(set(online))})",
        )
    return value.strip()


def _device_rule(kind: str, major: int | None, minor: int | None, access: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"allow": True, "type": kind}
    if major is not None:
        rule["major"] = major
    if minor is not None:
        rule["minor"] = minor
    rule["access"] = access
    return rule


def _hooks(hooks: Hooks) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for phase, spec_key, entries in (
        ("create_runtime", "createRuntime", hooks.create_runtime),
        ("create_container", "createContainer", hooks.create_container),
        ("start_container", "startContainer", hooks.start_container),
        ("poststart", "poststart", hooks.poststart),
        ("poststop", "poststop", hooks.poststop),
    ):
        converted: list[dict[str, Any]] = []
        for index, hook in enumerate(entries):
            where = f"hooks.{phase}[{index}]"
            path = hook.path
            check_text(path, f"{where}.path", allow_empty=False)
            if not path.startswith("/"):
                raise SpecError("invalid", f"{where}.path: {quoted(path)} is not an absolute path")
            entry: dict[str, Any] = {"path": path}
            for i, arg in enumerate(hook.args):
                check_text(arg, f"{where}.args[{i}]")
            entry["args"] = [path, *hook.args]
            if hook.env:
                entry["env"] = [
                    f"{k}={v}" for k, v in (env_entry(e, f"{where}.env[{i}]") for i, e in enumerate(hook.env))
                ]
            if hook.timeout_seconds is not None:
                entry["timeout"] = check_int(
                    hook.timeout_seconds, f"{where}.timeout_seconds", 1, MAX_HOOK_TIMEOUT_SECONDS
                )
            converted.append(entry)
        if converted:
            out[spec_key] = converted
    return out


def _paths(paths: Sequence[str], defaults: tuple[str, ...], where: str, security: Security) -> list[str]:
    if security.privileged:
        return []
    if not paths:
        return [] if security.exact_paths else list(defaults)
    return [check_path(p, f"{where}[{i}]", allow_root=False) for i, p in enumerate(paths)]


# -------------------------------------------------------------------------------------- spec


def build_spec(
    image: ImageRuntimeConfig,
    request: ContainerRequest,
    rootfs: Path,
    cgroups_path: str,
    *,
    sandbox: SandboxContext = HOST_LOCAL,
    auraed_oom_score_adj: int | None = None,
    host: HostFacts | None = None,
) -> dict[str, Any]:
    """The config.json for ``request`` over ``image`` unpacked at ``rootfs``.

    Reads the image's /etc/passwd and /etc/group and, once everything is validated, creates the
    working directory inside ``rootfs`` when the image lacks it. ``host`` defaults to :meth:`HostFacts.probe`;
    ``auraed_oom_score_adj`` overrides its oom_score_adj. ``sandbox`` is what the container
    shares with the others of its sandbox: namespaces to join, files to mount, sysctls.
    """
    if host is None:
        host = HostFacts.probe()
    own_oom = host.oom_score_adj if auraed_oom_score_adj is None else auraed_oom_score_adj
    security = request.security

    # Fail early on a bad stop signal, though the spec has no place for it.
    stop_signal(image, request)
    args = process_args(image, request)
    env = process_env(image, request)

    user_where = "security.user" if security.user else "image config.User"
    uid, gid, image_groups = resolve_user(rootfs, security.user or image.user, where=user_where)
    for index, extra_gid in enumerate(security.additional_gids):
        check_int(extra_gid, f"security.additional_gids[{index}]", 0, MAX_ID)
    groups = [*([] if security.strict_groups else image_groups), *security.additional_gids]

    if request.working_dir:
        cwd = check_path(request.working_dir, "working_dir")
    elif image.working_dir:
        raw = check_text(image.working_dir, "image config.WorkingDir")
        cwd = check_path("/" + raw.lstrip("/") if raw else "/", "image config.WorkingDir")
    else:
        cwd = "/"

    capabilities = compute_capabilities(security, host.capabilities)
    if security.oom_score_adj is not None:
        requested_oom = check_int(security.oom_score_adj, "security.oom_score_adj", -1000, 1000)
    else:
        requested_oom = 0
    hostname = _hostname(request, sandbox)
    namespaces = _namespaces(request, sandbox.namespaces)

    check_text(cgroups_path, "cgroups_path", allow_empty=False)
    linux: dict[str, Any] = {
        "namespaces": namespaces,
        "cgroupsPath": cgroups_path,
        "resources": _resources(request.resources, host, all_devices=security.privileged),
        "maskedPaths": _paths(security.masked_paths, DEFAULT_MASKED_PATHS, "security.masked_paths", security),
        "readonlyPaths": _paths(
            security.readonly_paths, DEFAULT_READONLY_PATHS, "security.readonly_paths", security
        ),
        # In the sandbox's own user namespace: its mappings (runc checks them against it).
        **(sandbox.namespaces.user.idmap.oci_mappings() if sandbox.namespaces.user else {}),
    }
    if security.privileged:
        linux["devices"] = host_devices()
    own_netns = not request.host_network
    sysctls = {
        **check_sysctls(sandbox.sysctls, "sandbox.sysctls", own_netns),
        **check_sysctls(request.sysctls, "sysctls", own_netns),
    }
    if sysctls:
        linux["sysctl"] = sysctls
    seccomp = _seccomp(security, capabilities, host.machine)
    if seccomp is not None:
        linux["seccomp"] = seccomp

    process: dict[str, Any] = {
        "terminal": bool(request.tty),
        "user": process_user(uid, gid, groups),
        "args": args,
        "env": env,
        "cwd": cwd,
        "capabilities": {
            "bounding": list(capabilities),
            "effective": list(capabilities),
            "permitted": list(capabilities),
            "inheritable": [],
            "ambient": [],
        },
        "rlimits": _rlimits(request, host),
        "noNewPrivileges": bool(security.no_new_privileges),
        "oomScoreAdj": max(requested_oom, own_oom),
    }
    spec: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": process,
        "root": {"path": os.fspath(rootfs.absolute()), "readonly": bool(security.read_only_rootfs)},
        **({} if hostname is None else {"hostname": hostname}),
        "mounts": _mounts(image, request, sandbox),
        "linux": linux,
    }
    propagation = _rootfs_propagation(request.mounts)
    if propagation is not None:
        linux["rootfsPropagation"] = propagation
    hooks = _hooks(request.hooks)
    if hooks:
        spec["hooks"] = hooks
    # Last, so that a request refused above leaves the root filesystem untouched.
    ensure_working_dir(
        rootfs, cwd, uid, gid, where="working_dir" if request.working_dir else "image config.WorkingDir"
    )
    return spec
