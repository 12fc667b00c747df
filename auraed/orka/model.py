"""orka workloads as values: the checked request, a workload's state, its status, and the runner a
workload's container runs through (on the host, or in a guest VM of its own)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import signal as signals
import time
from collections.abc import Callable
from typing import Any, Protocol

from auraed.containers.request import Resources
from auraed.errors import AuraeError

INSTANCE_LABEL = "orka.instance-id"
MIB = 1024 * 1024
CPU_PERIOD_US = 100_000  # the CFS period a CPU limit's quota is taken over
HOST, VM = "host", "vm"  # where a workload's container runs (orka_workload_isolation)

Sample = tuple[float, int] | None
"""A usage stream's last CPU reading: (when, the container's CPU microseconds); None at first."""


class OrkaError(AuraeError):
    """A workload request that cannot be carried out; ``kind`` says why."""


class Phase(enum.Enum):
    """orka's WorkloadStatus.Status.StatusCode, by value."""

    WAITING = 0
    RUNNING = 1
    TERMINATED = 2


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A validated Workload (auraed.orka.servicer checks the message into one)."""

    instance_id: str
    image: str
    env: tuple[str, ...] = ()
    cpu_millicores: int | None = None
    memory_mib: int | None = None

    def resources(self) -> Resources:
        return Resources(
            cpu_max=self.cpu_millicores * CPU_PERIOD_US // 1000 if self.cpu_millicores else None,
            cpu_period=CPU_PERIOD_US if self.cpu_millicores else None,
            memory_max=self.memory_mib * MIB if self.memory_mib else None,
        )


@dataclasses.dataclass(frozen=True)
class Usage:
    """cpu in millicores (over the last interval), memory and disk in MiB."""

    cpu_millicores: int = 0
    memory_mib: int = 0
    disk_mib: int = 0


@dataclasses.dataclass(frozen=True)
class Status:
    phase: Phase
    message: str | None = None
    usage: Usage = Usage()


def container_name(instance_id: str) -> str:
    """A container (and guest VM) name for any instance id: a DNS label, never shaped like a
    container id."""
    return "orka-" + hashlib.sha256(instance_id.encode()).hexdigest()[:24]


def exit_message(
    *, unknown: bool, reason: str, oom_killed: bool, signal: int | None, exit_code: int | None
) -> str:
    """How a container ended, from its record's (or its guest's status') fields."""
    if unknown:
        return reason or "its process ended unrecorded"
    if oom_killed:
        return "killed: out of memory (OOMKilled)"
    if signal:
        try:
            name = signals.Signals(signal).name
        except ValueError:
            name = "a real-time signal"
        return f"killed by signal {signal} ({name})"
    reason = f": {reason}" if reason else ""
    return f"exited with code {exit_code}{reason}"


def usage_numbers(cpu_usec: int, wall: float, memory_bytes: int) -> tuple[int, int]:
    """(millicores over ``wall`` seconds, MiB rounded up: what is used shows), held to int32."""
    millicores = round(max(cpu_usec / max(wall, 1e-3) / 1000, 0.0))
    return int32(millicores), int32(-(-memory_bytes // MIB))


def int32(value: int) -> int:
    return min(value, (1 << 31) - 1)


class Workload:
    """One instance: what its preparation reached, and how a stream of it sees the container."""

    def __init__(
        self, spec: WorkloadSpec, isolation: str = HOST, container_id: str = "", removed: bool = False
    ) -> None:
        self.spec = spec
        self.isolation = isolation
        self.container_id = container_id
        self.removed = removed
        self.failure = ""  # why it never ran (a pull error, a refused container)
        self.stage = f"pulling {spec.image}"  # what its preparation does first
        self.preparing: asyncio.Task[None] | None = None
        self.signalled = ""  # "STOP" or "KILL" once a Signal came
        self.ended = ""  # how its container ended, kept when a Signal removes the container
        self.changed = asyncio.Event()  # set at each change a stream must not wait to report
        self.removing = asyncio.Lock()
        self.disk: tuple[float, int] | None = None  # (when measured, bytes): the host's runner's

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def name(self) -> str:
        """Its container's name, and its guest VM's."""
        return container_name(self.instance_id)

    def touch(self) -> None:
        self.changed.set()

    def at(self, stage: str) -> None:
        """Its preparation is at ``stage`` ("... failed: why", should it fail there)."""
        self.stage = stage
        self.touch()

    def ended_with(self, message: str) -> str:
        """``message`` (how its container ended), saying which Signal ended it."""
        return f"Signal {self.signalled}: {message}" if self.signalled else message

    def to_doc(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "image": self.spec.image,
            "isolation": self.isolation,
            "container_id": self.container_id,
            "removed": self.removed,
            "saved_at": time.time(),
        }


class Runner(Protocol):
    """Where workloads' containers run: makes, reads, stops and removes them.

    Workloads keeps the records, the preparing tasks and the Signals' order; a runner only does
    what differs between the host and a guest VM.
    """

    def check(self, spec: WorkloadSpec) -> None:
        """Refuse (INVALID_ARGUMENT, naming the field) what this runner cannot run."""

    async def run(self, workload: Workload, image: str, save: Callable[[Workload], None]) -> None:
        """Make and start the container from the pulled ``image``, setting ``container_id`` (and
        saving the workload once it is set). Fails with an AuraeError; what it made on the way
        is undone, a cancellation included."""

    async def status(self, workload: Workload, sample: Sample) -> tuple[Status, Sample]:
        """The status of a workload whose container was made."""

    async def stop(self, workload: Workload, kill: bool) -> None:
        """STOP: its stop signal, SIGKILL after the grace period; KILL: SIGKILL at once."""

    async def remove(self, workload: Workload) -> None:
        """Remove all it made (its container, its VM), setting ``ended`` where it had ended."""

    async def recover(self, workload: Workload) -> bool:
        """Whether a workload of an earlier run (not removed) still exists; one half made is
        undone and answers False."""
