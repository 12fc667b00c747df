"""orka workloads as containers on this host, made through the container domain.

Status is read from the container's record and cgroup at each message, never kept twice: CPU in
millicores over the last interval (the first over its life), memory rounded up to MiB, and what it
wrote to its root filesystem, walked at most every DISK_USAGE_TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from auraed.containers.containers import Containers
from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord, State
from auraed.containers.request import ContainerRequest
from auraed.images.content import tree_size
from auraed.orka.model import (
    INSTANCE_LABEL,
    MIB,
    Phase,
    Sample,
    Status,
    Usage,
    Workload,
    WorkloadSpec,
    exit_message,
    int32,
    usage_numbers,
)

log = logging.getLogger(__name__)

DISK_USAGE_TTL = 10.0  # seconds: what a container wrote is walked at most this often


def record_ending(record: ContainerRecord) -> str:
    return exit_message(
        unknown=record.state == State.UNKNOWN,
        reason=record.reason,
        oom_killed=record.oom_killed,
        signal=record.signal,
        exit_code=record.exit_code,
    )


class HostRunner:
    def __init__(self, containers: Containers) -> None:
        self._containers = containers

    def check(self, spec: WorkloadSpec) -> None:
        pass  # the servicer's checks are the host's

    def _container(self, workload: Workload) -> ContainerRecord | None:
        if not workload.container_id:
            return None
        with contextlib.suppress(ContainerError):
            return self._containers.get(workload.container_id)
        return None

    async def run(self, workload: Workload, image: str, save: Callable[[Workload], None]) -> None:
        spec = workload.spec
        workload.at("creating its container")
        request = ContainerRequest(name=workload.name, env=spec.env, resources=spec.resources())
        labels = {INSTANCE_LABEL: spec.instance_id}
        record = await self._containers.create(request, image, labels, start=True)
        workload.container_id = record.id
        save(workload)
        log.info("orka workload %s runs as container %s", spec.instance_id, record.id)

    async def status(self, workload: Workload, sample: Sample) -> tuple[Status, Sample]:
        record = self._container(workload)
        if record is None:  # removed by hand
            return Status(Phase.TERMINATED, workload.ended or "removed"), sample
        if record.state == State.RUNNING and not workload.removed:
            return await self._usage(workload, record, sample)
        if record.alive:  # created, not yet started
            return Status(Phase.WAITING, workload.stage), sample
        ending = workload.ended_with(record_ending(record))
        return Status(Phase.TERMINATED, ending, await self._disk_only(workload, record)), sample

    async def _usage(
        self, workload: Workload, record: ContainerRecord, sample: Sample
    ) -> tuple[Status, Sample]:
        try:
            stats = await asyncio.to_thread(self._containers.stats, record)
        except ContainerError:  # it ended as it was read
            return Status(Phase.RUNNING, None, await self._disk_only(workload, record)), sample
        now, cpu_usec = time.monotonic(), stats["cpu_usage_usec"]
        if sample is None:  # the first: over its life so far, its runtime's start included
            cpu, wall = cpu_usec, time.time() - record.created_at
        else:
            cpu, wall = cpu_usec - sample[1], now - sample[0]
        millicores, memory_mib = usage_numbers(cpu, wall, stats["memory_current"])
        usage = Usage(millicores, memory_mib, await self._disk_mib(workload, record))
        return Status(Phase.RUNNING, None, usage), (now, cpu_usec)

    async def _disk_only(self, workload: Workload, record: ContainerRecord) -> Usage:
        return Usage(disk_mib=await self._disk_mib(workload, record))

    async def _disk_mib(self, workload: Workload, record: ContainerRecord) -> int:
        """What the container wrote to its root filesystem, walked at most every DISK_USAGE_TTL."""
        now = time.monotonic()
        if workload.disk is None or now - workload.disk[0] >= DISK_USAGE_TTL:
            size = await asyncio.to_thread(tree_size, self._containers.written(record))
            workload.disk = (now, size)
        return int32(workload.disk[1] // MIB)

    async def stop(self, workload: Workload, kill: bool) -> None:
        record = self._container(workload)
        if record is not None and record.alive:
            await self._containers.stop(record, 0.0 if kill else None)

    async def remove(self, workload: Workload) -> None:
        record = self._container(workload)
        if record is None:
            return
        if not record.alive:  # a STOP whose SIGKILL did not take (UNAVAILABLE) is not here
            workload.ended = workload.ended_with(record_ending(record))
        await self._containers.delete(record, force=True, keep_logs=False)

    async def recover(self, workload: Workload) -> bool:
        if not workload.container_id:
            # Made, but auraed ended before it recorded the container: found by its label.
            made = self._containers.all({INSTANCE_LABEL: workload.instance_id})
            workload.container_id = made[0].id if made else ""
        return self._container(workload) is not None
