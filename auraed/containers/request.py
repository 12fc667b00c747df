"""What a client asks of a container: the typed request, and the checks of the values in it.

A :class:`ContainerRequest` is built from a wire message by the caller (the ContainerService
servicer) and checked as its runtime spec is built (auraed.containers.oci_spec): a bad value raises
:class:`SpecError` naming the field ("security.capabilities_add[0]: CAP_FOO is not a capability")
before a runtime ever sees it. The checks here are those of single values: text, paths, numbers in
their ranges, signals, hostnames and sysctls.
"""

from __future__ import annotations

import posixpath
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from auraed.containers.runtime import DELETE_TIMEOUT
from auraed.system.supervisor import START_TIMEOUT

# Docker's floor: below it the runtime's own init process is OOM-killed before the container starts.
MIN_MEMORY_BYTES = 6 * 1024 * 1024
MAX_INT64 = (1 << 63) - 1
MAX_UINT64 = (1 << 64) - 1
MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "no change" to the kernel
# include/linux/threads.h PID_MAX_LIMIT on 64-bit kernels: pids.max refuses more (EINVAL).
PID_MAX_LIMIT = 4 * 1024 * 1024
# kernel/sched/core.c max_cfs_runtime: MAX_BW = 2^(64 - BW_SHIFT 20) - 1 µs; cpu.max and
# cpu.cfs_quota_us refuse a larger quota (EINVAL).
MAX_CFS_QUOTA_US = (1 << 44) - 1
# kernel/sched/sched.h MIN_SHARES and MAX_SHARES: v1 cpu.shares (v2 cpu.weight is derived from it).
MIN_CPU_SHARES = 2
MAX_CPU_SHARES = 262_144
UNLIMITED = -1
"""A memory + swap limit of -1: swap without a limit (the OCI spec's and the kernel's word)."""
# Every hook runs inside a runtime command auraed waits for at most this long: create, start and
# poststart hooks within the monitor's START_TIMEOUT, poststop hooks within `delete`'s
# DELETE_TIMEOUT. A longer hook timeout could never fire: auraed would give up on the runtime first.
MAX_HOOK_TIMEOUT_SECONDS = int(min(START_TIMEOUT, DELETE_TIMEOUT))
HOST_NAME_MAX = 64

# Sysctls that live in a namespace the container owns (runc's list); net.* needs its own netns.
_IPC_SYSCTLS = frozenset(
    {
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
    }
)
_SYSCTL_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[A-Za-z0-9_@:+-]+)+")
_HOSTNAME_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_SIGRT = re.compile(r"RTMIN\+([0-9]{1,2})|RTMAX-([0-9]{1,2})")

SpecErrorKind = Literal["invalid", "not_found", "unsupported"]


class SpecError(Exception):
    """A request or image that cannot become a runtime spec; the message names the field."""

    def __init__(self, kind: SpecErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: SpecErrorKind = kind
        self.message = message


# ------------------------------------------------------------------------------- typed request


@dataclass(frozen=True)
class Mount:
    destination: str
    source: str = ""
    # "bind" (also when empty) or a filesystem type such as "tmpfs"; IMAGE_MOUNT: an image's
    # files, read-only (``source`` names the image as Create's image is named; ``sub_path`` a
    # directory of it to mount instead of its root).
    type: str = ""
    options: tuple[str, ...] = ()
    read_only: bool = False
    sub_path: str = ""
    # IMAGE_MOUNT of an image this machine does not store but reads where another machine shares
    # it (a vm pod's guest: its host's snapshots): its layers' directories, the bottom one first,
    # ``source`` its id. Empty: the store's image.
    image_layers: tuple[str, ...] = ()


IMAGE_MOUNT = "image"
"""The type of a Mount of an image's files (Kubernetes' image volumes, KEP-4639)."""


@dataclass(frozen=True)
class Resources:
    cpu_weight: int | None = None  # cgroup v2 cpu.weight, 1..10000
    cpu_max: int | None = None  # quota in µs per period
    cpu_period: int | None = None  # µs
    cpuset_cpus: str | None = None
    cpuset_mems: str | None = None
    memory_max: int | None = None  # bytes
    pids_max: int | None = None
    cpu_shares: int | None = None  # cgroup v1 cpu.shares, 2..262144 (instead of cpu_weight)
    # Memory plus swap, bytes (v1 memory.memsw.limit_in_bytes); at least memory_max, or UNLIMITED.
    memory_swap: int | None = None


@dataclass(frozen=True)
class Security:
    capabilities_add: tuple[str, ...] = ()
    capabilities_drop: tuple[str, ...] = ()
    no_new_privileges: bool = False
    read_only_rootfs: bool = False
    # Replace the defaults when non-empty (see exact_paths).
    masked_paths: tuple[str, ...] = ()
    readonly_paths: tuple[str, ...] = ()
    # "name", "uid", "uid:gid" or "name:group"; the image's User when empty.
    user: str = ""
    additional_gids: tuple[int, ...] = ()
    # The groups are the primary group and additional_gids alone: the user's memberships in the
    # image's /etc/group are not added (Kubernetes' SupplementalGroupsPolicy Strict).
    strict_groups: bool = False
    # "default" (also when empty), "unconfined", or the path of an OCI seccomp JSON on this machine.
    seccomp_profile: str = ""
    oom_score_adj: int | None = None
    # Every capability auraed holds (capabilities_add and _drop are not used), every host device,
    # no seccomp filter, no masked or read-only paths, /sys and /sys/fs/cgroup writable.
    privileged: bool = False
    # An OCI seccomp section (the spec's linux.seccomp) to use as it is, instead of seccomp_profile.
    seccomp: Mapping[str, Any] | None = None
    # masked_paths and readonly_paths are exactly the paths, empty meaning none (the CRI's
    # meaning); without it an empty list means the defaults (the aurae API's).
    exact_paths: bool = False


@dataclass(frozen=True)
class Rlimit:
    type: str  # "RLIMIT_NOFILE", "nofile", ...
    soft: int
    hard: int


@dataclass(frozen=True)
class Hook:
    path: str
    # Arguments after the program: the spec's argv is [path, *args].
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout_seconds: int | None = None


@dataclass(frozen=True)
class Hooks:
    create_runtime: tuple[Hook, ...] = ()
    create_container: tuple[Hook, ...] = ()
    start_container: tuple[Hook, ...] = ()
    poststart: tuple[Hook, ...] = ()
    poststop: tuple[Hook, ...] = ()


@dataclass(frozen=True)
class ContainerRequest:
    """The typed equivalent of the API's ContainerConfig (without image and labels)."""

    name: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    hostname: str = ""
    mounts: tuple[Mount, ...] = ()
    resources: Resources = field(default_factory=Resources)
    security: Security = field(default_factory=Security)
    rlimits: tuple[Rlimit, ...] = ()
    sysctls: Mapping[str, str] = field(default_factory=dict)
    hooks: Hooks = field(default_factory=Hooks)
    tty: bool = False
    stdin: bool = False  # its stdin stays open for attaching (else /dev/null, or the terminal)
    stdin_once: bool = False  # stdin is closed when the first attach to it ends
    stop_signal: str = ""
    host_network: bool = False


# ------------------------------------------------------------------------------------- checks


def check_text(value: str, where: str, *, allow_empty: bool = True) -> str:
    """``value`` if the runtime can take it: a string, no NUL, valid UTF-8 (not empty unless allowed)."""
    if not isinstance(value, str):
        raise SpecError("invalid", f"{where}: must be a string")
    if "\0" in value:
        raise SpecError("invalid", f"{where}: contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError("invalid", f"{where}: is not valid UTF-8") from None
    if not allow_empty and not value:
        raise SpecError("invalid", f"{where}: must not be empty")
    return value


def quoted(value: str) -> str:
    """``value`` for a message: quoted, cut at 80 characters."""
    return repr(value if len(value) <= 80 else value[:77] + "...")


def check_path(value: str, where: str, *, allow_root: bool = True) -> str:
    """An absolute path without "..", normalised."""
    check_text(value, where, allow_empty=False)
    if not value.startswith("/"):
        raise SpecError("invalid", f"{where}: {quoted(value)} is not an absolute path")
    if ".." in value.split("/"):
        raise SpecError("invalid", f"{where}: {quoted(value)} must not contain '..'")
    clean = posixpath.normpath(value)
    clean = "/" + clean.lstrip("/")
    if clean == "/" and not allow_root:
        raise SpecError("invalid", f"{where}: must not be /")
    return clean


def env_entry(entry: str, where: str) -> tuple[str, str]:
    """(key, value) of a KEY=VALUE entry."""
    check_text(entry, where)
    key, sep, value = entry.partition("=")
    if not sep or not key:
        raise SpecError("invalid", f"{where}: {quoted(entry)} is not KEY=VALUE")
    return key, value


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts "²" and other Unicode digits."""
    return text.isascii() and text.isdigit()


def check_int(value: object, where: str, low: int, high: int) -> int:
    """An integer (a bool is not one) in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError("invalid", f"{where}: must be an integer")
    if not low <= value <= high:
        raise SpecError("invalid", f"{where}: {value} is outside {low}..{high}")
    return value


def parse_signal(value: str, where: str) -> int:
    """A signal number from "SIGINT", "INT", "int", "2" or "SIGRTMIN+3"."""
    check_text(value, where, allow_empty=False)
    text = value.strip().upper()
    if is_decimal(text) and len(text) <= 3:
        number = int(text)
    else:
        name = text.removeprefix("SIG")
        rt = _SIGRT.fullmatch(name)
        if rt is not None:
            number = signal.SIGRTMIN + int(rt[1]) if rt[1] is not None else signal.SIGRTMAX - int(rt[2])
        else:
            try:
                number = int(signal.Signals["SIG" + name])
            except KeyError:
                raise SpecError("invalid", f"{where}: {quoted(value)} is not a signal") from None
    if not 1 <= number <= signal.SIGRTMAX:
        raise SpecError("invalid", f"{where}: {quoted(value)} is not a signal")
    return number


def check_hostname(name: str, where: str) -> str:
    """``name`` if it is a valid hostname (dot-separated labels, at most HOST_NAME_MAX long)."""
    check_text(name, where)
    if len(name) > HOST_NAME_MAX or not all(_HOSTNAME_LABEL.fullmatch(p) for p in name.split(".")):
        raise SpecError("invalid", f"{where}: {quoted(name)} is not a valid hostname")
    return name


def check_sysctls(sysctls: Mapping[str, str], field_name: str, own_netns: bool) -> dict[str, str]:
    """The sysctls, each one a namespaced sysctl (net.* only with the container's own network
    namespace); errors name ``field_name``."""
    out: dict[str, str] = {}
    for key in sorted(sysctls):
        value = sysctls[key]
        where = f"{field_name}[{quoted(key)}]"
        check_text(key, where)
        check_text(value, where)
        name = key
        if not _SYSCTL_NAME.fullmatch(name) or len(name) > 255:
            raise SpecError("invalid", f"{where}: not a sysctl name")
        if "\n" in value:
            raise SpecError("invalid", f"{where}: the value contains a newline")
        if name.startswith("net."):
            if not own_netns:
                raise SpecError(
                    "invalid", f"{where}: a net.* sysctl needs the container's own network namespace"
                )
        elif name == "kernel.hostname":
            raise SpecError("invalid", f"{where}: set the hostname field instead")
        elif not (name in _IPC_SYSCTLS or name.startswith("fs.mqueue.") or name == "kernel.domainname"):
            raise SpecError("unsupported", f"{where}: not a namespaced sysctl; it would change the host")
        out[name] = value
    return out
