"""A small cgroupfs driver for cgroup v2 and v1/hybrid hosts, writing the kernel files directly.

Stdlib only: it runs inside lean guest images. All cgroups live under ``<hierarchy>/<base>``;
on v2 there is one hierarchy (the unified mount), on v1/hybrid one per mounted controller
(cpu and cpuacct may share a mount, which then counts once).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

DEFAULT_ROOT = Path("/sys/fs/cgroup")
DEFAULT_MOUNTINFO = Path("/proc/self/mountinfo")
DEFAULT_CPU_PERIOD_US = 100_000

# Controllers we drive. v1 adds cpuacct (usage) and freezer (race-free kill_all).
V2_CONTROLLERS = ("cpu", "cpuset", "io", "memory", "pids")
V1_CONTROLLERS = ("blkio", "cpu", "cpuacct", "cpuset", "freezer", "memory", "pids")

# Largest CPU/NUMA index accepted in a list; bounds memory use for hostile input like "0-999999999".
MAX_CPU_INDEX = 65_535

ErrorKind = Literal["invalid", "unsupported", "not_found", "busy", "os"]

_NAME_RE = re.compile(r"[A-Za-z0-9_@:+=-][A-Za-z0-9_.@:+=-]{0,254}")
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")

_ERRNO_KINDS: dict[int, ErrorKind] = {
    errno.EINVAL: "invalid",
    errno.ERANGE: "invalid",
    errno.EOVERFLOW: "invalid",
    errno.ENOENT: "not_found",
    errno.ESRCH: "not_found",
    errno.EBUSY: "busy",
    errno.ENOTEMPTY: "busy",
    errno.EEXIST: "busy",
    errno.EOPNOTSUPP: "unsupported",
}


class CgroupLayout(enum.Enum):
    V1 = "v1"
    HYBRID = "hybrid"
    V2 = "v2"


class CgroupError(Exception):
    """A cgroup operation failed; ``kind`` lets callers map it to a gRPC status code."""

    def __init__(self, kind: ErrorKind, message: str, file: Path | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.file = file


def _os_error(action: str, file: Path, exc: OSError) -> CgroupError:
    kind = _ERRNO_KINDS.get(exc.errno or 0, "os")
    reason = exc.strerror or str(exc)
    return CgroupError(kind, f"cannot {action} {file}: {reason}", file)


@dataclass(frozen=True)
class CgroupLimits:
    """Resource limits; ``None`` leaves the kernel's current value untouched."""

    cpu_weight: int | None = None
    cpu_max_us: int | None = None
    cpu_period_us: int | None = None
    cpuset_cpus: str | None = None
    cpuset_mems: str | None = None
    memory_min: int | None = None
    memory_low: int | None = None
    memory_high: int | None = None
    memory_max: int | None = None
    pids_max: int | None = None


class IoCounters(NamedTuple):
    """Block I/O on one device: bytes and operations, read and written."""

    read_bytes: int
    write_bytes: int
    reads: int
    writes: int


_V1_MEMORY_STAT = {
    "total_rss": "anon",
    "total_cache": "file",
    "total_mapped_file": "file_mapped",
    "total_active_file": "active_file",
    "total_inactive_file": "inactive_file",
    "total_active_anon": "active_anon",
    "total_inactive_anon": "inactive_anon",
    "total_pgfault": "pgfault",
    "total_pgmajfault": "pgmajfault",
}
"""v1 memory.stat's hierarchical counters by the names v2's memory.stat gives the same counts."""


class CgroupDirOps(Protocol):
    """How cgroup directories are made and removed; tests inject a fake that adds interface files."""

    def mkdir(self, path: Path) -> None: ...

    def rmdir(self, path: Path) -> None: ...


class KernelDirOps:
    """Real cgroupfs: the kernel populates and tears down the interface files itself."""

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)


class _LimitWrite(NamedTuple):
    controller: str
    filename: str
    value: str


# ---------------------------------------------------------------------------- small helpers


def parse_cpu_list(s: str) -> set[int]:
    """Parse a kernel cpu/node list such as "0-2,4"; "" is the empty set."""
    text = s.strip()
    if not text:
        return set()
    out: set[int] = set()
    for part in text.split(","):
        match = _RANGE_RE.fullmatch(part)
        if match is None:
            raise ValueError(f"malformed cpu list {s!r}: bad element {part!r}")
        low = int(match[1])
        high = low if match[2] is None else int(match[2])
        if high < low or high > MAX_CPU_INDEX:
            raise ValueError(f"malformed cpu list {s!r}: bad range {part!r}")
        out.update(range(low, high + 1))
    return out


def format_cpu_list(cpus: set[int]) -> str:
    """Inverse of parse_cpu_list, collapsing runs into ranges."""
    ranges: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def cpus_present(sysfs_cpu: Path = Path("/sys/devices/system/cpu")) -> set[int]:
    """CPUs the kernel knows about ("present", else "online")."""
    for name in ("present", "online"):
        with contextlib.suppress(FileNotFoundError):
            return parse_cpu_list((sysfs_cpu / name).read_text())
    raise CgroupError("not_found", f"no present/online cpu list under {sysfs_cpu}", sysfs_cpu / "present")


def cpu_weight_to_shares(weight: int) -> int:
    """Map v2 cpu.weight [1, 10000] onto v1 cpu.shares [2, 262144] (the runc/systemd formula)."""
    if not 1 <= weight <= 10_000:
        raise CgroupError("invalid", f"cpu_weight must be within 1..10000, got {weight}")
    return 2 + ((weight - 1) * 262_142) // 9_999


def parse_flat_keyed(text: str) -> dict[str, int]:
    """Parse "key value" lines (memory.events, cpu.stat, ...); non-integer values are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def read_oom_kill_count(counter_file: Path) -> int:
    """Read "oom_kill" from memory.events (v2) or memory.oom_control (v1); for lean watcher processes."""
    return parse_flat_keyed(_read(counter_file)).get("oom_kill", 0)


def _v2_io_stat(text: str) -> dict[str, IoCounters]:
    """io.stat's "<major:minor> rbytes=.. wbytes=.. rios=.. wios=.. ..." lines by device."""
    found: dict[str, IoCounters] = {}
    for line in text.splitlines():
        device, *fields = line.split() or [""]
        if not device:
            continue
        keyed = dict(field.split("=", 1) for field in fields if "=" in field)
        counts = (int(keyed.get(key, 0)) for key in ("rbytes", "wbytes", "rios", "wios"))
        found[device] = IoCounters(*counts)
    return found


def _read(file: Path) -> str:
    try:
        return file.read_text()
    except OSError as exc:
        raise _os_error("read", file, exc) from exc


def _write(file: Path, value: str) -> None:
    # One write(2) per value: cgroupfs parses each write separately. No O_CREAT, so a missing
    # interface file is reported instead of silently created; O_TRUNC keeps fake trees exact.
    data = value.encode()
    try:
        fd = os.open(file, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    except OSError as exc:
        raise _os_error(f"open for writing {value!r}", file, exc) from exc
    try:
        written = os.write(fd, data)
    except OSError as exc:
        raise _os_error(f"write {value!r} to", file, exc) from exc
    finally:
        os.close(fd)
    if written != len(data):
        raise CgroupError("os", f"short write of {value!r} to {file}", file)


def _read_pids(procs_file: Path) -> list[int]:
    return [int(line) for line in _read(procs_file).split()]


def _child_dirs(directory: Path) -> list[str]:
    """Names of the child cgroups; scandir's d_type spares a stat per interface file."""
    with os.scandir(directory) as entries:
        return [e.name for e in entries if e.is_dir(follow_symlinks=False)]


def _split_path(path: str) -> list[str]:
    """Validate a cgroup path relative to the base; "" is the base itself."""
    if path == "":
        return []
    parts = path.split("/")
    for part in parts:
        if not _NAME_RE.fullmatch(part):
            raise CgroupError("invalid", f"invalid cgroup path {path!r}: bad component {part!r}")
    return parts


# ---------------------------------------------------------------------------- layout discovery


def _unescape_mount(field: str) -> str:
    return _MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


def _v1_mounts_from_mountinfo(root: Path, mountinfo: Path) -> dict[str, Path]:
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return {}
    mounts: dict[str, Path] = {}
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, super_fields = left.split(), right.split()
        if not sep or len(fields) < 5 or len(super_fields) < 3 or super_fields[0] != "cgroup":
            continue
        mount_point = Path(_unescape_mount(fields[4]))
        if mount_point.parent != root:
            continue  # another cgroup tree (e.g. a container's); only hierarchies under our root count
        for controller in super_fields[2].split(","):
            if controller in V1_CONTROLLERS:
                mounts.setdefault(controller, mount_point)
    return mounts


def _hierarchy_dirs(root: Path) -> list[Path]:
    """Every v1 hierarchy directory under root, whatever its controllers, and links to them."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [entry for entry in entries if (entry / "cgroup.procs").is_file()]


def _v1_mounts_from_dirs(root: Path) -> dict[str, Path]:
    # Fallback when mountinfo has nothing under root (fake trees, odd chroots): a directory is a
    # hierarchy when it holds cgroup.procs; "cpu,cpuacct" names and cpu -> cpu,cpuacct links both work.
    mounts: dict[str, Path] = {}
    for entry in _hierarchy_dirs(root):
        for controller in entry.name.split(","):
            if controller in V1_CONTROLLERS:
                mounts.setdefault(controller, entry.resolve())
    return mounts


def find_v1_mounts(root: Path = DEFAULT_ROOT, mountinfo: Path = DEFAULT_MOUNTINFO) -> dict[str, Path]:
    """Controller -> hierarchy directory for the v1 controllers we use (co-mounted ones share a dir)."""
    return _v1_mounts_from_mountinfo(root, mountinfo) or _v1_mounts_from_dirs(root)


def detect_layout(root: Path = DEFAULT_ROOT, mountinfo: Path = DEFAULT_MOUNTINFO) -> CgroupLayout:
    """V2 if root is a cgroup2 mount, HYBRID if v1 hierarchies plus root/unified, else V1."""
    if (root / "cgroup.controllers").is_file():
        return CgroupLayout.V2
    if not find_v1_mounts(root, mountinfo):
        raise CgroupError("unsupported", f"no cgroup v1 or v2 filesystem found at {root}", root)
    if (root / "unified" / "cgroup.controllers").is_file():
        return CgroupLayout.HYBRID
    return CgroupLayout.V1


# ---------------------------------------------------------------------------- limits


def _validate_limits(limits: CgroupLimits) -> None:
    if limits.cpu_weight is not None:
        cpu_weight_to_shares(limits.cpu_weight)  # raises on out-of-range
    if limits.cpu_max_us is not None and limits.cpu_max_us < 1_000:
        raise CgroupError("invalid", f"cpu_max_us must be >= 1000, got {limits.cpu_max_us}")
    if limits.cpu_period_us is not None and not 1_000 <= limits.cpu_period_us <= 1_000_000:
        raise CgroupError(
            "invalid", f"cpu_period_us must be within 1000..1000000, got {limits.cpu_period_us}"
        )
    for name, cpus in (("cpuset_cpus", limits.cpuset_cpus), ("cpuset_mems", limits.cpuset_mems)):
        if cpus is None:
            continue
        try:
            parsed = parse_cpu_list(cpus)
        except ValueError as exc:
            raise CgroupError("invalid", f"{name}: {exc}") from exc
        if not parsed:
            raise CgroupError("invalid", f"{name} must not be empty (use None to inherit)")
    for name, amount in _amount_fields(limits):
        if amount is not None and amount < 0:
            raise CgroupError("invalid", f"{name} must be >= 0, got {amount}")


def _amount_fields(limits: CgroupLimits) -> list[tuple[str, int | None]]:
    return [
        ("memory_min", limits.memory_min),
        ("memory_low", limits.memory_low),
        ("memory_high", limits.memory_high),
        ("memory_max", limits.memory_max),
        ("pids_max", limits.pids_max),
    ]


def _fields_by_controller(limits: CgroupLimits) -> dict[str, list[tuple[str, object]]]:
    return {
        "cpu": [
            ("cpu_weight", limits.cpu_weight),
            ("cpu_max_us", limits.cpu_max_us),
            ("cpu_period_us", limits.cpu_period_us),
        ],
        "cpuset": [("cpuset_cpus", limits.cpuset_cpus), ("cpuset_mems", limits.cpuset_mems)],
        "memory": [
            ("memory_min", limits.memory_min),
            ("memory_low", limits.memory_low),
            ("memory_high", limits.memory_high),
            ("memory_max", limits.memory_max),
        ],
        "pids": [("pids_max", limits.pids_max)],
    }


def _cpuset_writes(limits: CgroupLimits) -> list[_LimitWrite]:
    out: list[_LimitWrite] = []
    if limits.cpuset_cpus is not None:
        out.append(_LimitWrite("cpuset", "cpuset.cpus", limits.cpuset_cpus))
    if limits.cpuset_mems is not None:
        out.append(_LimitWrite("cpuset", "cpuset.mems", limits.cpuset_mems))
    return out


def _v1_writes(limits: CgroupLimits) -> list[_LimitWrite]:
    out = _cpuset_writes(limits)
    if limits.cpu_weight is not None:
        out.append(_LimitWrite("cpu", "cpu.shares", str(cpu_weight_to_shares(limits.cpu_weight))))
    # Period before quota: the kernel checks quota against the period currently set.
    if limits.cpu_period_us is not None or limits.cpu_max_us is not None:
        period = limits.cpu_period_us or DEFAULT_CPU_PERIOD_US
        out.append(_LimitWrite("cpu", "cpu.cfs_period_us", str(period)))
    if limits.cpu_max_us is not None:
        out.append(_LimitWrite("cpu", "cpu.cfs_quota_us", str(limits.cpu_max_us)))
    if limits.memory_max is not None:
        out.append(_LimitWrite("memory", "memory.limit_in_bytes", str(limits.memory_max)))
    if limits.pids_max is not None:
        out.append(_LimitWrite("pids", "pids.max", str(limits.pids_max)))
    return out


def _v2_writes(limits: CgroupLimits, current_quota: str) -> list[_LimitWrite]:
    out = _cpuset_writes(limits)
    if limits.cpu_weight is not None:
        out.append(_LimitWrite("cpu", "cpu.weight", str(limits.cpu_weight)))
    if limits.cpu_max_us is not None or limits.cpu_period_us is not None:
        # cpu.max always takes "<quota> <period>"; a period-only update keeps the current quota.
        quota = current_quota if limits.cpu_max_us is None else str(limits.cpu_max_us)
        period = limits.cpu_period_us or DEFAULT_CPU_PERIOD_US
        out.append(_LimitWrite("cpu", "cpu.max", f"{quota} {period}"))
    memory = (
        ("memory.min", limits.memory_min),
        ("memory.low", limits.memory_low),
        ("memory.high", limits.memory_high),
        ("memory.max", limits.memory_max),
    )
    out.extend(_LimitWrite("memory", name, str(value)) for name, value in memory if value is not None)
    if limits.pids_max is not None:
        out.append(_LimitWrite("pids", "pids.max", str(limits.pids_max)))
    return out


# ---------------------------------------------------------------------------- the driver


class Cgroupfs:
    """Cgroups below ``<root>/<hierarchy>/<base>``; paths given to methods are relative to base."""

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        layout: CgroupLayout | None = None,
        base: str = "aurae",
        *,
        mountinfo: Path = DEFAULT_MOUNTINFO,
        dir_ops: CgroupDirOps | None = None,
    ) -> None:
        if not _split_path(base):
            raise CgroupError("invalid", "cgroup base must not be empty")
        self.root = root
        self.base = base
        self.layout: CgroupLayout = layout or detect_layout(root, mountinfo)
        self._ops: CgroupDirOps = dir_ops or KernelDirOps()
        self._v1_mounts: dict[str, Path] = {} if self.is_v2 else find_v1_mounts(root, mountinfo)
        if not self.is_v2 and not self._v1_mounts:
            raise CgroupError("unsupported", f"no cgroup v1 hierarchy found under {root}", root)
        # One entry per distinct hierarchy, so co-mounted cpu,cpuacct is created/removed once.
        self._hierarchies: list[Path] = (
            [root] if self.is_v2 else list(dict.fromkeys(self._v1_mounts.values()))
        )

    @property
    def is_v2(self) -> bool:
        return self.layout is CgroupLayout.V2

    # -- paths

    def cgroup_dirs(self, path: str) -> list[Path]:
        """The cgroup's directory in every hierarchy we use (one on v2)."""
        parts = _split_path(path)
        return [hierarchy.joinpath(self.base, *parts) for hierarchy in self._hierarchies]

    def _dir_for(self, controller: str, path: str) -> Path:
        parts = _split_path(path)
        hierarchy = self.root if self.is_v2 else self._v1_mounts[controller]
        return hierarchy.joinpath(self.base, *parts)

    def cgroup_path(self, path: str) -> str:
        """The path as listed in /proc/<pid>/cgroup, e.g. "/aurae/web/api"."""
        return "/" + "/".join([self.base, *_split_path(path)])

    def procs_files(self, path: str) -> list[Path]:
        return [d / "cgroup.procs" for d in self.cgroup_dirs(path)]

    def join_files(self, path: str) -> list[Path]:
        """The files a new process writes "0" to, between fork and exec, to join the cgroup.

        v1: ``tasks``, not ``cgroup.procs``. A thread moving itself lets the kernel skip the
        global cgroup_threadgroup_rwsem, whose write side first waits for an RCU grace period
        (5-8 ms here after an idle spell); a freshly forked child has one thread, so the whole
        process moves. v2 domain cgroups take whole processes only: ``cgroup.procs``.
        """
        name = "cgroup.procs" if self.is_v2 else "tasks"
        return [d / name for d in self.cgroup_dirs(path)]

    # -- queries

    def controllers(self) -> list[str]:
        if not self.is_v2:
            return sorted(self._v1_mounts)
        available = _read(self.root / "cgroup.controllers").split()
        return sorted(set(available) & set(V2_CONTROLLERS))

    def exists(self, path: str) -> bool:
        return any(d.is_dir() for d in self.cgroup_dirs(path))

    def list_children(self, path: str) -> list[str]:
        dirs = self.cgroup_dirs(path)
        if not any(d.is_dir() for d in dirs):
            if path == "":
                return []  # the base is created on demand, so it may legitimately be absent
            raise CgroupError("not_found", f"cgroup {self.cgroup_path(path)} does not exist", dirs[0])
        return sorted({name for d in dirs if d.is_dir() for name in _child_dirs(d)})

    def pids(self, path: str) -> list[int]:
        """Processes directly in the cgroup (union over v1 hierarchies; normally identical)."""
        found: set[int] = set()
        for procs in self.procs_files(path):
            found.update(_read_pids(procs))
        return sorted(found)

    def oom_counter_path(self, path: str) -> Path:
        """Where the OOM-kill counter of a cgroup lives, whether or not the cgroup exists yet."""
        name = "memory.events" if self.is_v2 else "memory.oom_control"
        return self._dir_for("memory", path) / name

    def oom_counter_file(self, path: str) -> Path:
        name = "memory.events" if self.is_v2 else "memory.oom_control"
        return self._controller_file("memory", path, name)

    def oom_kill_count(self, path: str) -> int:
        return read_oom_kill_count(self.oom_counter_file(path))

    def memory_current(self, path: str) -> int:
        name = "memory.current" if self.is_v2 else "memory.usage_in_bytes"
        return int(_read(self._controller_file("memory", path, name)))

    def memory_max(self, path: str) -> int | None:
        """The memory limit in bytes; None when unlimited."""
        name = "memory.max" if self.is_v2 else "memory.limit_in_bytes"
        value = _read(self._controller_file("memory", path, name)).strip()
        # v1 reports "unlimited" as a huge page-rounded number.
        return None if value == "max" or int(value) >= 1 << 62 else int(value)

    def memory_working_set(self, path: str) -> int:
        """Memory in use less what the kernel can reclaim at once (inactive page cache), as the
        kubelet and cAdvisor count a workload's memory."""
        usage = self.memory_current(path)
        stat = parse_flat_keyed(_read(self._controller_file("memory", path, "memory.stat")))
        inactive = stat.get("inactive_file" if self.is_v2 else "total_inactive_file", 0)
        return max(usage - inactive, 0)

    def pids_current(self, path: str) -> int:
        return int(_read(self._controller_file("pids", path, "pids.current")))

    def pids_max(self, path: str) -> int | None:
        value = _read(self._controller_file("pids", path, "pids.max")).strip()
        return None if value == "max" else int(value)

    def io_bytes(self, path: str) -> tuple[int, int]:
        """Bytes read and written by the cgroup's processes on block devices; (0, 0) when unknown."""
        try:
            devices = self.io_stat(path).values()
        except CgroupError:
            return 0, 0
        return sum(d.read_bytes for d in devices), sum(d.write_bytes for d in devices)

    def io_stat(self, path: str) -> dict[str, IoCounters]:
        """Block I/O of the cgroup and its descendants by device ("major:minor"): v2 io.stat, v1
        the recursive blkio throttle counters (which count every I/O, limited or not)."""
        if self.is_v2:
            return _v2_io_stat(_read(self._controller_file("io", path, "io.stat")))
        try:
            return self._v1_io_stat(path, "_recursive")
        except CgroupError as exc:
            if exc.kind != "unsupported":
                raise
            return self._v1_io_stat(path, "")  # an older kernel's, of the cgroup's own processes

    def _v1_io_stat(self, path: str, suffix: str) -> dict[str, IoCounters]:
        bytes_done = self._v1_blkio(path, f"blkio.throttle.io_service_bytes{suffix}")
        operations = self._v1_blkio(path, f"blkio.throttle.io_serviced{suffix}")
        return {
            device: IoCounters(*bytes_done.get(device, (0, 0)), *operations.get(device, (0, 0)))
            for device in bytes_done.keys() | operations.keys()
        }

    def _v1_blkio(self, path: str, name: str) -> dict[str, tuple[int, int]]:
        """A v1 blkio file's "<major:minor> Read|Write <n>" lines as (read, write) by device."""
        found: dict[str, tuple[int, int]] = {}
        for line in _read(self._controller_file("blkio", path, name)).splitlines():
            parts = line.split()
            if len(parts) != 3 or parts[1] not in ("Read", "Write"):
                continue  # the Sync, Async, Discard and Total lines, and the file's own Total
            read, write = found.get(parts[0], (0, 0))
            value = int(parts[2])
            found[parts[0]] = (read + value, write) if parts[1] == "Read" else (read, write + value)
        return found

    def memory_stat(self, path: str) -> dict[str, int]:
        """memory.stat of the cgroup and its descendants, by v2's names; v1's hierarchical
        ``total_*`` counters are given those names (``total_rss`` is ``anon``, ``total_cache``
        is ``file``, ``total_mapped_file`` is ``file_mapped``, ...)."""
        stat = parse_flat_keyed(_read(self._controller_file("memory", path, "memory.stat")))
        if self.is_v2:
            return stat
        return {v2: stat[v1] for v1, v2 in _V1_MEMORY_STAT.items() if v1 in stat}

    def memory_peak(self, path: str) -> int | None:
        """The most memory the cgroup has used (v2 memory.peak, kernel 5.19 on; v1
        memory.max_usage_in_bytes); None where the kernel does not say."""
        name = "memory.peak" if self.is_v2 else "memory.max_usage_in_bytes"
        return self._optional_int("memory", path, name)

    def memory_swap(self, path: str) -> int | None:
        """Swap the cgroup uses, in bytes; None without swap accounting."""
        if self.is_v2:
            return self._optional_int("memory", path, "memory.swap.current")
        with_swap = self._optional_int("memory", path, "memory.memsw.usage_in_bytes")
        return None if with_swap is None else max(with_swap - self.memory_current(path), 0)

    def cpu_max(self, path: str) -> tuple[int | None, int]:
        """The CFS quota (None: none) and period of the cgroup, in µs."""
        if self.is_v2:
            quota, _, period = _read(self._controller_file("cpu", path, "cpu.max")).partition(" ")
            return (None if quota == "max" else int(quota)), int(period or DEFAULT_CPU_PERIOD_US)
        quota_us = int(_read(self._controller_file("cpu", path, "cpu.cfs_quota_us")))
        period_us = int(_read(self._controller_file("cpu", path, "cpu.cfs_period_us")))
        return (None if quota_us < 0 else quota_us), period_us

    def cpu_shares(self, path: str) -> int:
        """The cgroup's CPU shares: v1 cpu.shares, or v2 cpu.weight in shares."""
        if self.is_v2:
            return cpu_weight_to_shares(int(_read(self._controller_file("cpu", path, "cpu.weight"))))
        return int(_read(self._controller_file("cpu", path, "cpu.shares")))

    def process_count(self, path: str) -> int:
        """Processes in the cgroup and its descendants."""
        return len(self._subtree_pids(path))

    def _optional_int(self, controller: str, path: str, name: str) -> int | None:
        try:
            return int(_read(self._controller_file(controller, path, name)))
        except CgroupError as exc:
            if exc.kind == "unsupported":  # the file, or its controller, is not there
                return None
            raise

    def cpu_stat(self, path: str) -> dict[str, int]:
        """v2 cpu.stat as is; v1 normalised to the v2 names and units (usec)."""
        if self.is_v2:
            return parse_flat_keyed(_read(self._controller_file("cpu", path, "cpu.stat")))
        raw = parse_flat_keyed(_read(self._controller_file("cpu", path, "cpu.stat")))
        stat: dict[str, int] = {
            key: raw[key] for key in ("nr_periods", "nr_throttled", "nr_bursts") if key in raw
        }
        for ns_key, us_key in (("throttled_time", "throttled_usec"), ("burst_time", "burst_usec")):
            if ns_key in raw:
                stat[us_key] = raw[ns_key] // 1000
        stat.update(self._v1_cpuacct_usage(path))
        return stat

    def _v1_cpuacct_usage(self, path: str) -> dict[str, int]:
        if "cpuacct" not in self._v1_mounts:
            return {}
        usage: dict[str, int] = {}
        for filename, key in (
            ("cpuacct.usage", "usage_usec"),
            ("cpuacct.usage_user", "user_usec"),
            ("cpuacct.usage_sys", "system_usec"),
        ):
            file = self._dir_for("cpuacct", path) / filename
            if file.exists():
                usage[key] = int(_read(file)) // 1000
        return usage

    def _controller_file(self, controller: str, path: str, filename: str) -> Path:
        if controller not in self.controllers():
            raise CgroupError("unsupported", f"{controller} controller is not available ({filename})")
        file = self._dir_for(controller, path) / filename
        if not file.parent.is_dir():
            raise CgroupError("not_found", f"cgroup {self.cgroup_path(path)} does not exist", file.parent)
        if not file.exists():
            raise CgroupError("unsupported", f"cgroup file {file} is missing (controller not enabled?)", file)
        return file

    # -- create / update

    def create(self, path: str, limits: CgroupLimits) -> None:
        """Create the cgroup (and the base on demand) and apply limits; all-or-nothing."""
        parts = _split_path(path)
        if not parts:
            raise CgroupError("invalid", "cannot create the base itself; give a path below it")
        self._check_limits(limits)
        if self.exists(path):
            raise CgroupError(
                "busy", f"cgroup {self.cgroup_path(path)} already exists", self.cgroup_dirs(path)[0]
            )
        created: list[Path] = []
        try:
            for hierarchy in self._hierarchies:
                self._create_in(hierarchy, parts, created)
            self._apply_limits(path, limits)
        except BaseException:
            self._rollback(created)
            raise

    def update(self, path: str, limits: CgroupLimits) -> None:
        """Apply the non-None limits to an existing cgroup (not atomic: earlier writes stay)."""
        _split_path(path)
        self._check_limits(limits)
        if not self.exists(path):
            raise CgroupError("not_found", f"cgroup {self.cgroup_path(path)} does not exist")
        self._apply_limits(path, limits)

    def _check_limits(self, limits: CgroupLimits) -> None:
        _validate_limits(limits)
        if not self.is_v2:
            v2_only = (
                ("memory_min", limits.memory_min),
                ("memory_low", limits.memory_low),
                ("memory_high", limits.memory_high),
            )
            for name, amount in v2_only:
                if amount is not None:
                    raise CgroupError(
                        "unsupported", f"{name} needs cgroup v2; this host is {self.layout.value}"
                    )
        usable = set(self.controllers())
        for controller, named_values in _fields_by_controller(limits).items():
            for name, value in named_values:
                if value is not None and controller not in usable:
                    raise CgroupError(
                        "unsupported", f"{name} needs the {controller} controller (not available)"
                    )

    def _create_in(self, hierarchy: Path, parts: list[str], created: list[Path]) -> None:
        base_dir = hierarchy / self.base
        self._ensure_dirs(hierarchy, base_dir, created)
        target = base_dir.joinpath(*parts)
        if not target.parent.is_dir():
            raise CgroupError(
                "not_found", f"parent cgroup of {self.cgroup_path('/'.join(parts))} does not exist"
            )
        if self.is_v2:
            self._enable_subtree_controllers(hierarchy, target.parent)
        self._mkdir(target, created)

    def _ensure_dirs(self, hierarchy: Path, directory: Path, created: list[Path]) -> None:
        """mkdir -p from the hierarchy root, enabling v2 controllers on the way down."""
        missing: list[Path] = []
        current = directory
        while current != hierarchy and not current.is_dir():
            missing.append(current)
            current = current.parent
        for d in reversed(missing):
            if self.is_v2:
                self._enable_subtree_controllers(hierarchy, d.parent)
            self._mkdir(d, created, exist_ok=True)

    def _mkdir(self, directory: Path, created: list[Path], exist_ok: bool = False) -> None:
        try:
            self._ops.mkdir(directory)
        except FileExistsError:
            if exist_ok:
                return  # a concurrent create made the base first; it is not ours to roll back
            raise CgroupError("busy", f"cgroup {directory} already exists", directory) from None
        except OSError as exc:
            raise _os_error("create cgroup", directory, exc) from exc
        created.append(directory)
        if self._is_v1_cpuset(directory):
            self._copy_parent_cpuset(directory)

    def _is_v1_cpuset(self, directory: Path) -> bool:
        cpuset_mount = self._v1_mounts.get("cpuset")
        return cpuset_mount is not None and directory.is_relative_to(cpuset_mount)

    @staticmethod
    def _copy_parent_cpuset(directory: Path) -> None:
        # v1 cpuset children start with empty cpus/mems, and no process may join until both are set.
        for name in ("cpuset.cpus", "cpuset.mems"):
            value = _read(directory.parent / name).strip()
            if value:
                _write(directory / name, value)

    def _enable_subtree_controllers(self, hierarchy: Path, directory: Path) -> None:
        """Enable our controllers in subtree_control of every dir from the root down to directory."""
        chain = [directory, *directory.parents]
        for d in reversed(chain[: chain.index(hierarchy) + 1]):
            available = set(_read(d / "cgroup.controllers").split()) & set(V2_CONTROLLERS)
            enabled = set(_read(d / "cgroup.subtree_control").split())
            missing = sorted(available - enabled)
            if missing:
                _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))

    def _apply_limits(self, path: str, limits: CgroupLimits) -> None:
        if self.is_v2:
            writes = _v2_writes(limits, self._v2_current_quota(path, limits))
        else:
            writes = _v1_writes(limits)
        for write in writes:
            file = self._dir_for(write.controller, path) / write.filename
            if not file.exists():
                raise CgroupError(
                    "unsupported", f"cgroup file {file} is missing (controller not enabled?)", file
                )
            _write(file, write.value)

    def _v2_current_quota(self, path: str, limits: CgroupLimits) -> str:
        if limits.cpu_max_us is not None or limits.cpu_period_us is None:
            return "max"  # unused: the quota is given, or cpu.max is not written at all
        return _read(self._dir_for("cpu", path) / "cpu.max").split()[0]

    def _rollback(self, created: list[Path]) -> None:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                self._ops.rmdir(directory)

    # -- processes

    def add_process(self, path: str, pid: int) -> None:
        """Move pid into the cgroup in every hierarchy (a failure midway leaves it partly moved)."""
        for procs in self.procs_files(path):
            _write(procs, str(pid))

    def kill_all(self, path: str, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup and its descendants and wait until it is empty."""
        _split_path(path)
        if not self.exists(path):
            return
        kill_file = self.cgroup_dirs(path)[0] / "cgroup.kill"
        if self.is_v2 and kill_file.exists():
            _write(kill_file, "1")  # atomic, even against concurrent forks
        elif not self._subtree_pids(path):
            return  # empty stays empty: only auraed moves processes in
        else:
            with self._frozen(path):
                self._signal_subtree(path)
        self._wait_empty(path, timeout)

    def _subtree_pids(self, path: str) -> set[int]:
        found: set[int] = set()
        for top in self.cgroup_dirs(path):
            for directory, _subdirs, _files in os.walk(top):
                with contextlib.suppress(CgroupError):  # a cgroup may vanish while we walk
                    found.update(_read_pids(Path(directory) / "cgroup.procs"))
        return found

    def _signal_subtree(self, path: str) -> None:
        for pid in self._subtree_pids(path) - {os.getpid()}:  # never kill ourselves
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _wait_empty(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = self._subtree_pids(path)
            if not remaining:
                return
            if time.monotonic() >= deadline:
                raise CgroupError(
                    "busy", f"processes {sorted(remaining)} survived kill in {self.cgroup_path(path)}"
                )
            self._signal_subtree(path)  # catches children forked before the freeze took hold
            time.sleep(0.01)

    @contextlib.contextmanager
    def _frozen(self, path: str) -> Iterator[None]:
        """Freeze the subtree so nothing forks while we kill; a no-op without a freezer."""
        if self.is_v2:
            file, frozen, thawed = self.cgroup_dirs(path)[0] / "cgroup.freeze", "1", "0"
        elif "freezer" in self._v1_mounts:
            file, frozen, thawed = self._dir_for("freezer", path) / "freezer.state", "FROZEN", "THAWED"
        else:
            yield
            return
        if not file.exists():
            yield
            return
        _write(file, frozen)
        try:
            self._wait_frozen(path, file)
            yield
        finally:
            _write(file, thawed)  # killed tasks only die once thawed

    def _wait_frozen(self, path: str, state_file: Path, timeout: float = 1.0) -> None:
        # Best effort: a task in uninterruptible sleep can hold the freeze off; we kill anyway.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_v2:
                events = parse_flat_keyed(_read(state_file.parent / "cgroup.events"))
                if events.get("frozen") == 1:
                    return
            elif _read(state_file).strip() == "FROZEN":
                return
            time.sleep(0.005)

    # -- removal

    def remove(self, path: str) -> None:
        """rmdir in every hierarchy; idempotent; busy if processes or child cgroups remain."""
        dirs = [d for d in self.cgroup_dirs(path) if d.is_dir()]
        for d in dirs:  # check all first so a busy cgroup is not left half-removed
            self._check_removable(d)
        for d in dirs:
            try:
                self._ops.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _os_error("remove cgroup", d, exc) from exc

    def prune(self, path: str) -> None:
        """rmdir ``path`` (below the base; "" is the base) where nothing uses it any more, in every
        hierarchy mounted under root, also those we never write to: an OCI runtime makes a
        container's parent cgroups in all of them (devices, net_cls, ...) and leaves them there.
        A cgroup still in use (processes, children) stays: the kernel refuses the rmdir."""
        parts = _split_path(path)
        hierarchies = (
            [self.root] if self.is_v2 else dict.fromkeys(d.resolve() for d in _hierarchy_dirs(self.root))
        )
        for hierarchy in hierarchies:
            with contextlib.suppress(OSError):  # absent, or busy
                self._ops.rmdir(hierarchy.joinpath(self.base, *parts))

    def remove_tree(self, path: str) -> None:
        """Remove the cgroup and all descendants, deepest first (processes must be gone)."""
        if not self.exists(path):
            return
        for child in self.list_children(path):
            self.remove_tree(f"{path}/{child}" if path else child)
        self.remove(path)

    def _check_removable(self, directory: Path) -> None:
        children = sorted(_child_dirs(directory))
        if children:
            raise CgroupError("busy", f"cgroup {directory} still has child cgroups {children}", directory)
        procs = _read_pids(directory / "cgroup.procs")
        if procs:
            raise CgroupError("busy", f"cgroup {directory} still has processes {procs}", directory)
