"""Typed, validated values for cells and executables, parsed from requests at the edge."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from auraed.api.aurae.cells import v0 as pb
from auraed.cells.errors import CellError
from auraed.names import validate_label, validate_path
from auraed.state.store import flat_doc
from auraed.system.cgroupfs import CgroupLimits, cpus_present, parse_cpu_list

MAX_CPU_WEIGHT = 10000
MIN_CPU_PERIOD_US, MAX_CPU_PERIOD_US = 1000, 1_000_000
MIN_CPU_QUOTA_US = 1000
MAX_CPU_QUOTA_US = 1 << 40
MIN_MEMORY_BYTES = 4096
MAX_MEMORY_BYTES = 1 << 62
MAX_PIDS = 4_194_304  # the kernel's PID_MAX_LIMIT
MAX_ARGS = 4096
MAX_ARG_BYTES = 128 * 1024
MAX_ENV = 4096
MAX_ID = 0xFFFFFFFE  # (uid_t)-1 means "unchanged" to the kernel
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclasses.dataclass(frozen=True)
class CellSpec:
    name: str
    limits: CgroupLimits
    isolate_process: bool
    isolate_network: bool

    @property
    def hostname(self) -> str:
        return self.name.rpartition("/")[2]

    def to_doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "limits": flat_doc(self.limits),
            "isolate_process": self.isolate_process,
            "isolate_network": self.isolate_network,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> CellSpec:
        return cls(doc["name"], CgroupLimits(**doc["limits"]), doc["isolate_process"], doc["isolate_network"])

    def to_message(self) -> pb.Cell:
        lim = self.limits
        return pb.Cell(
            name=self.name,
            cpu=pb.CpuController(weight=lim.cpu_weight, max=lim.cpu_max_us, period=lim.cpu_period_us),
            cpuset=pb.CpusetController(cpus=lim.cpuset_cpus, mems=lim.cpuset_mems),
            memory=pb.MemoryController(
                min=lim.memory_min, low=lim.memory_low, high=lim.memory_high, max=lim.memory_max
            ),
            pids=pb.PidsController(max=lim.pids_max),
            isolate_process=self.isolate_process,
            isolate_network=self.isolate_network,
        )


@dataclasses.dataclass(frozen=True)
class ExecutableSpec:
    cell_name: str
    name: str
    argv: tuple[str, ...]
    env: tuple[str, ...]
    cwd: str
    uid: int | None
    gid: int | None
    description: str

    @property
    def workload(self) -> str:
        return f"{self.cell_name}/{self.name}"

    def to_doc(self) -> dict[str, Any]:
        doc = flat_doc(self)
        doc["argv"], doc["env"] = list(self.argv), list(self.env)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ExecutableSpec:
        return cls(**{**doc, "argv": tuple(doc["argv"]), "env": tuple(doc["env"])})


def _in_range(value: int | None, field: str, low: int, high: int) -> int | None:
    if value is not None and not low <= value <= high:
        raise CellError.invalid(field, f"{value} is out of range {low}..{high}")
    return value


def _cpuset(value: str | None, field: str, present: Callable[[], set[int]]) -> str | None:
    if value is None:
        return None
    try:
        wanted = parse_cpu_list(value)
    except ValueError as exc:
        raise CellError.invalid(field, f"{value[:80]!r} is not a list like '0-1,3': {exc}") from exc
    if not wanted:
        raise CellError.invalid(field, "must name at least one")
    absent = sorted(wanted - present())  # read from sysfs only when asked: CPUs come and go
    if absent:
        raise CellError.invalid(field, f"{', '.join(map(str, absent[:8]))} not present on this machine")
    return value


def memory_nodes_present() -> set[int]:
    try:
        return parse_cpu_list(Path("/sys/devices/system/node/possible").read_text().strip())
    except (OSError, ValueError):
        return {0}


def _memory(message: pb.MemoryController | None) -> dict[str, int | None]:
    message = message or pb.MemoryController()
    values = {"min": message.min, "low": message.low, "high": message.high, "max": message.max}
    for key, value in values.items():
        _in_range(value, f"cell.memory.{key}", MIN_MEMORY_BYTES, MAX_MEMORY_BYTES)
    order = [(k, v) for k, v in values.items() if v is not None]
    for (lower, low_value), (upper, up_value) in itertools.pairwise(order):
        if low_value is not None and up_value is not None and low_value > up_value:
            raise CellError.invalid(
                f"cell.memory.{lower}", f"must not exceed memory.{upper} ({low_value} > {up_value})"
            )
    return values


def parse_cell(message: pb.Cell | None) -> CellSpec:
    if message is None:
        raise CellError.invalid("cell", "is required")
    name = validate_path(message.name, "cell.name")
    cpu = message.cpu or pb.CpuController()
    cpuset = message.cpuset or pb.CpusetController()
    pids = message.pids or pb.PidsController()
    memory = _memory(message.memory)
    limits = CgroupLimits(
        cpu_weight=_in_range(cpu.weight, "cell.cpu.weight", 1, MAX_CPU_WEIGHT),
        cpu_max_us=_in_range(cpu.max, "cell.cpu.max", MIN_CPU_QUOTA_US, MAX_CPU_QUOTA_US),
        cpu_period_us=_in_range(cpu.period, "cell.cpu.period", MIN_CPU_PERIOD_US, MAX_CPU_PERIOD_US),
        cpuset_cpus=_cpuset(cpuset.cpus, "cell.cpuset.cpus", cpus_present),
        cpuset_mems=_cpuset(cpuset.mems, "cell.cpuset.mems", memory_nodes_present),
        memory_min=memory["min"],
        memory_low=memory["low"],
        memory_high=memory["high"],
        memory_max=memory["max"],
        pids_max=_in_range(pids.max, "cell.pids.max", 1, MAX_PIDS),
    )
    return CellSpec(name, limits, bool(message.isolate_process), bool(message.isolate_network))


def _strings(values: list[str], field: str, limit: int) -> tuple[str, ...]:
    if len(values) > limit:
        raise CellError.invalid(field, f"more than {limit} entries")
    for index, value in enumerate(values):
        if "\0" in value:
            raise CellError.invalid(f"{field}[{index}]", "contains a NUL character")
        if len(value.encode()) > MAX_ARG_BYTES:
            raise CellError.invalid(f"{field}[{index}]", f"longer than {MAX_ARG_BYTES} bytes")
    return tuple(values)


def _env(values: list[str]) -> tuple[str, ...]:
    env = _strings(values, "executable.env", MAX_ENV)
    for index, entry in enumerate(env):
        key, sep, _ = entry.partition("=")
        if not sep or not key:
            raise CellError.invalid(f"executable.env[{index}]", f"{entry[:80]!r} is not KEY=value")
    if not any(entry.startswith("PATH=") for entry in env):
        env += (DEFAULT_PATH,)
    return env


def parse_executable(cell_name: str, message: pb.Executable | None) -> ExecutableSpec:
    if message is None:
        raise CellError.invalid("executable", "is required")
    name = validate_label(message.name, "executable.name")
    args = _strings(list(message.args), "executable.args", MAX_ARGS)
    if bool(args) == bool(message.shell_command):
        raise CellError.invalid("executable", "set exactly one of args and shell_command")
    if args and not args[0]:
        raise CellError.invalid("executable.args[0]", "the program must not be empty")
    if message.shell_command:
        args = ("/bin/sh", "-c", *_strings([message.shell_command], "executable.shell_command", 1))
    cwd = message.cwd or "/"
    if not os.path.isabs(cwd) or "\0" in cwd:
        raise CellError.invalid("executable.cwd", f"{cwd[:80]!r} is not an absolute path")
    return ExecutableSpec(
        cell_name=cell_name,
        name=name,
        argv=args,
        env=_env(list(message.env)),
        cwd=cwd,
        uid=_in_range(message.uid, "executable.uid", 0, MAX_ID),
        gid=_in_range(message.gid, "executable.gid", 0, MAX_ID),
        description=message.description[:1024],
    )
