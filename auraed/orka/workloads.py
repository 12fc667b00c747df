"""orka's workloads as host containers: the domain behind its WorkloadService.

A workload is one container, created through the container domain (auraed.containers) from an
image pulled through the image store (its mirrors, insecure hosts and docker credentials apply).
Its container is named ``orka-<hash of the instance id>``, so that any id the scheduler sends is
taken, and carries the id in the label ``orka.instance-id``. What the domain does not keep is a
record of kind ``orka_workload`` per instance: its container's id once made, and whether a
Signal removed it, so that a repeated Signal is a success, also after a restart, while an id
never seen is NOT_FOUND.

Preparing (the pull, then the container's creation and start) runs in a task of its own, so a
scheduler whose Create stream breaks leaves its workload running; a Signal that arrives first
cancels it. Status is read from the container's record and cgroup, never kept twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hashlib
import logging
import signal as signals
import time
from collections.abc import AsyncIterator
from typing import Any

from auraed.containers.containers import Containers
from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord, State
from auraed.containers.request import ContainerRequest, Resources
from auraed.errors import AuraeError, ErrorKind
from auraed.images.content import tree_size
from auraed.images.images import Images
from auraed.images.model import ImageRecord
from auraed.state.store import Store
from auraed.system.tasks import run_to_end

log = logging.getLogger(__name__)

KIND = "orka_workload"
INSTANCE_LABEL = "orka.instance-id"
MIB = 1024 * 1024
CPU_PERIOD_US = 100_000  # the CFS period a CPU limit's quota is taken over
DISK_USAGE_TTL = 10.0  # seconds: what a container wrote is walked at most this often
# Records of removed workloads kept (for repeated Signals); past this many the oldest go.
MAX_REMOVED_KEPT = 1024


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
    """A container name for any instance id: a DNS label, never shaped like a container id."""
    return "orka-" + hashlib.sha256(instance_id.encode()).hexdigest()[:24]


def exit_message(record: ContainerRecord) -> str:
    if record.state == State.UNKNOWN:
        return record.reason or "its process ended unrecorded"
    if record.oom_killed:
        return "killed: out of memory (OOMKilled)"
    if record.signal:
        try:
            name = signals.Signals(record.signal).name
        except ValueError:
            name = "a real-time signal"
        return f"killed by signal {record.signal} ({name})"
    reason = f": {record.reason}" if record.reason else ""
    return f"exited with code {record.exit_code}{reason}"


class Workload:
    """One instance: what its preparation reached, and how a stream of it sees the container."""

    def __init__(self, spec: WorkloadSpec, container_id: str = "", removed: bool = False) -> None:
        self.spec = spec
        self.container_id = container_id
        self.removed = removed
        self.failure = ""  # why it never ran (a pull error, a refused container)
        self.stage = f"pulling {spec.image}"  # what its preparation does first
        self.preparing: asyncio.Task[None] | None = None
        self.signalled = ""  # "STOP" or "KILL" once a Signal came
        self.ended = ""  # how its container ended, kept when a Signal removes the container
        self.changed = asyncio.Event()  # set at each change a stream must not wait to report
        self.removing = asyncio.Lock()
        self._disk: tuple[float, int] | None = None  # (when measured, bytes)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    def touch(self) -> None:
        self.changed.set()

    def to_doc(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "image": self.spec.image,
            "container_id": self.container_id,
            "removed": self.removed,
            "saved_at": time.time(),
        }


class Workloads:
    def __init__(self, store: Store, images: Images, containers: Containers) -> None:
        self._store = store
        self._images = images
        self._containers = containers
        self._workloads: dict[str, Workload] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    def recover(self) -> None:
        """The workloads of earlier runs, from their records; those whose container is gone
        (removed by hand) are forgotten, removed ones kept for their repeated Signals."""
        for key, doc in self._store.list(KIND):
            spec = WorkloadSpec(instance_id=doc["instance_id"], image=doc.get("image", ""))
            workload = Workload(spec, doc.get("container_id", ""), bool(doc.get("removed")))
            if not workload.removed and not workload.container_id:
                # Made, but auraed ended before it recorded the container: found by its label.
                made = self._containers.all({INSTANCE_LABEL: spec.instance_id})
                workload.container_id = made[0].id if made else ""
            if not workload.removed and self._container(workload) is None:
                self._store.delete(KIND, key)
                continue
            self._workloads[spec.instance_id] = workload
        log.info("recovered %d orka workloads", sum(1 for w in self._workloads.values() if not w.removed))

    # -- lookup ----------------------------------------------------------------------------

    def get(self, instance_id: str) -> Workload:
        workload = self._workloads.get(instance_id)
        if workload is None:
            raise OrkaError.not_found(f"workload instance {instance_id[:200]!r}")
        return workload

    def _container(self, workload: Workload) -> ContainerRecord | None:
        if not workload.container_id:
            return None
        with contextlib.suppress(ContainerError):
            return self._containers.get(workload.container_id)
        return None

    def _save(self, workload: Workload) -> None:
        self._store.put(KIND, workload.instance_id, workload.to_doc())

    # -- create ----------------------------------------------------------------------------

    async def create(self, spec: WorkloadSpec) -> Workload:
        """Begin preparing the workload (pull, create, start); ALREADY_EXISTS for a known one.

        A removed workload's id may be used again."""
        async with self._lock:
            if self._closed:
                raise OrkaError(ErrorKind.UNAVAILABLE, "auraed is shutting down")
            known = self._workloads.get(spec.instance_id)
            if known is not None and not known.removed:
                raise OrkaError.already_exists(f"workload instance {spec.instance_id[:200]!r}")
            workload = Workload(spec)
            self._workloads[spec.instance_id] = workload
            self._save(workload)
        workload.preparing = asyncio.get_running_loop().create_task(
            self._prepare(workload), name=f"orka workload {spec.instance_id[:60]}"
        )
        return workload

    async def _prepare(self, workload: Workload) -> None:
        spec = workload.spec
        try:
            image = await self._pull(spec.image)
            workload.stage = "creating its container"  # "... failed: why", should it fail
            workload.touch()
            request = ContainerRequest(
                name=container_name(spec.instance_id), env=spec.env, resources=spec.resources()
            )
            labels = {INSTANCE_LABEL: spec.instance_id}
            record = await self._containers.create(request, image, labels, start=True)
            workload.container_id = record.id
            self._save(workload)
            log.info("orka workload %s runs as container %s", spec.instance_id, record.id)
        except AuraeError as exc:
            workload.failure = f"{workload.stage} failed: {exc.message}"
            log.info("orka workload %s did not start: %s", spec.instance_id, exc.message)
        except asyncio.CancelledError:
            workload.failure = f"Signal {workload.signalled or 'STOP'} before it ran"
            raise
        finally:
            workload.touch()

    async def _pull(self, reference: str) -> str:
        """Pull ``reference`` (its mirrors and credentials as configured); the name to create from."""
        pulled = False
        async for event in self._images.pull(reference):  # to its end: it then lets go of the store
            pulled = pulled or isinstance(event, ImageRecord)
        if pulled:
            return reference  # as the scheduler named it: the container's image shows it
        raise OrkaError(ErrorKind.INTERNAL, f"the pull of {reference} ended without an image")

    # -- status ----------------------------------------------------------------------------

    async def statuses(self, workload: Workload, interval: float) -> AsyncIterator[Status]:
        """The workload's status now, then every ``interval`` seconds (or as it changes) until it
        has terminated, which is the last one."""
        sample: tuple[float, int] | None = None  # (when, the cgroup's CPU microseconds)
        while True:
            workload.changed.clear()
            status, sample = await self._status(workload, sample)
            yield status
            if status.phase is Phase.TERMINATED:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(workload.changed.wait(), interval)

    async def _status(
        self, workload: Workload, sample: tuple[float, int] | None
    ) -> tuple[Status, tuple[float, int] | None]:
        record = self._container(workload)
        if record is None:
            preparing = workload.preparing is not None and not workload.preparing.done()
            if preparing:
                return Status(Phase.WAITING, workload.stage), sample
            return Status(Phase.TERMINATED, workload.ended or workload.failure or "removed"), sample
        if record.state == State.RUNNING and not workload.removed:
            usage, sample = await self._usage(workload, record, sample)
            return Status(Phase.RUNNING, None, usage), sample
        if record.alive:  # created, not yet started
            return Status(Phase.WAITING, workload.stage), sample
        return Status(
            Phase.TERMINATED, self._ended(workload, record), await self._disk_only(workload, record)
        ), sample

    @staticmethod
    def _ended(workload: Workload, record: ContainerRecord) -> str:
        message = exit_message(record)
        return f"Signal {workload.signalled}: {message}" if workload.signalled else message

    async def _usage(
        self, workload: Workload, record: ContainerRecord, sample: tuple[float, int] | None
    ) -> tuple[Usage, tuple[float, int] | None]:
        try:
            stats = await asyncio.to_thread(self._containers.stats, record)
        except ContainerError:  # it ended as it was read
            return await self._disk_only(workload, record), sample
        now, cpu_usec = time.monotonic(), stats["cpu_usage_usec"]
        if sample is None:  # the first: over its life so far, its runtime's start included
            wall = max(time.time() - record.created_at, 1e-3)
            millicores = cpu_usec / wall / 1000
        else:
            wall = max(now - sample[0], 1e-3)
            millicores = (cpu_usec - sample[1]) / wall / 1000
        usage = Usage(
            cpu_millicores=_int32(round(max(millicores, 0.0))),
            memory_mib=_int32(-(-stats["memory_current"] // MIB)),  # rounded up: what is used shows
            disk_mib=await self._disk_mib(workload, record),
        )
        return usage, (now, cpu_usec)

    async def _disk_only(self, workload: Workload, record: ContainerRecord) -> Usage:
        return Usage(disk_mib=await self._disk_mib(workload, record))

    async def _disk_mib(self, workload: Workload, record: ContainerRecord) -> int:
        """What the container wrote to its root filesystem, walked at most every DISK_USAGE_TTL."""
        now = time.monotonic()
        if workload._disk is None or now - workload._disk[0] >= DISK_USAGE_TTL:
            size = await asyncio.to_thread(tree_size, self._containers.written(record))
            workload._disk = (now, size)
        return _int32(workload._disk[1] // MIB)

    # -- signal ----------------------------------------------------------------------------

    async def signal(self, instance_id: str, kill: bool) -> None:
        """STOP (``kill`` False): the image's stop signal, SIGKILL after the grace period; KILL:
        SIGKILL. Then the container is removed. Runs to its end when the caller leaves; a
        repeated signal is a success (a KILL during a STOP's grace brings the SIGKILL forward)."""
        workload = self.get(instance_id)
        if workload.removed:
            return
        await run_to_end(self._signal(workload, kill))

    async def _signal(self, workload: Workload, kill: bool) -> None:
        if workload.signalled != "KILL":  # a STOP after a KILL does not make it gentler
            workload.signalled = "KILL" if kill else "STOP"
        preparing = workload.preparing
        if preparing is not None and not preparing.done():
            preparing.cancel()  # a pull is abandoned; a container being made is undone
            await asyncio.wait({preparing})
        record = self._container(workload)
        if record is not None and record.alive:
            await self._containers.stop(record, 0.0 if kill else None)
        async with workload.removing:
            if workload.removed:
                return
            record = self._container(workload)
            if record is not None:
                if not record.alive:  # a STOP whose SIGKILL did not take (UNAVAILABLE) is not here
                    workload.ended = self._ended(workload, record)
                await self._containers.delete(record, force=True, keep_logs=False)
            workload.removed = True
            self._save(workload)
            self._forget_old_removed()
        log.info("orka workload %s removed (Signal %s)", workload.instance_id, workload.signalled)
        workload.touch()

    def _forget_old_removed(self) -> None:
        removed = [w for w in self._workloads.values() if w.removed]
        for workload in removed[: max(0, len(removed) - MAX_REMOVED_KEPT)]:
            del self._workloads[workload.instance_id]
            self._store.delete(KIND, workload.instance_id)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Preparations under way are cut short (their containers undone); running workloads stay,
        as every container outlives auraed unless it is configured to stop them."""
        async with self._lock:
            self._closed = True
        preparing = [w.preparing for w in self._workloads.values() if w.preparing and not w.preparing.done()]
        for task in preparing:
            task.cancel()
        await asyncio.gather(*preparing, return_exceptions=True)


def _int32(value: int) -> int:
    return min(value, (1 << 31) - 1)
