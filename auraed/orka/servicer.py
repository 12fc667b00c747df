"""orka's node_agent.WorkloadService over gRPC: Workload messages checked into WorkloadSpecs.

What orka leaves unsaid is read so (README.md, "orka"): cpu limits in millicores, memory in MiB,
a disk limit refused (overlayfs without project quotas cannot hold one); usage reported in the
same units. Every bad field is INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from auraed.api import node_agent as pb
from auraed.containers.request import MAX_CFS_QUOTA_US, MIN_MEMORY_BYTES, SpecError, check_text, env_entry
from auraed.errors import ErrorKind
from auraed.orka.model import CPU_PERIOD_US, MIB, OrkaError, Status, WorkloadSpec
from auraed.orka.workloads import Workloads
from auraed.references import ReferenceError, parse_reference
from auraed.wire.handlers import Context

SERVICE_NAME = "node_agent.WorkloadService"
MAX_INSTANCE_ID = 253
MAX_ENVIRONMENT = 4096
MIN_CPU_MILLICORES = 10  # a CFS quota below 1 ms per 100 ms period is refused by the kernel
MAX_CPU_MILLICORES = MAX_CFS_QUOTA_US * 1000 // CPU_PERIOD_US
MIN_MEMORY_MIB = -(-MIN_MEMORY_BYTES // MIB)
MAX_INT32 = (1 << 31) - 1


def _instance_id(value: str) -> str:
    if not value:
        raise OrkaError.invalid("instance_id", "is required")
    if len(value) > MAX_INSTANCE_ID or not value.isprintable():
        raise OrkaError.invalid("instance_id", f"at most {MAX_INSTANCE_ID} printable characters")
    return value


def _image(value: str) -> str:
    if not value:
        raise OrkaError.invalid("image", "is required")
    try:
        parse_reference(value)
    except ReferenceError as exc:
        raise OrkaError.invalid("image", str(exc)) from None
    return value


def _environment(values: list[str]) -> tuple[str, ...]:
    if len(values) > MAX_ENVIRONMENT:
        raise OrkaError.invalid("environment", f"more than {MAX_ENVIRONMENT} entries")
    try:
        for index, entry in enumerate(values):
            env_entry(check_text(entry, f"environment[{index}]"), f"environment[{index}]")
    except SpecError as exc:
        raise OrkaError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None
    return tuple(values)


def _limit(value: int | None, field: str, low: int, high: int, unit: str) -> int | None:
    if value is None:
        return None
    if not low <= value <= high:
        raise OrkaError.invalid(f"resource_limits.{field}", f"{value} is outside {low}..{high} ({unit})")
    return value


def workload_spec(workload: pb.Workload) -> WorkloadSpec:
    if workload.type != pb.WorkloadType.CONTAINER:
        raise OrkaError.invalid("type", f"{int(workload.type)} is not a type this node runs (CONTAINER)")
    limits = workload.resource_limits or pb.WorkloadResources()
    if limits.disk is not None:
        raise OrkaError.invalid(
            "resource_limits.disk",
            "disk limits are not supported (overlayfs has no quota without project quotas)",
        )
    return WorkloadSpec(
        instance_id=_instance_id(workload.instance_id),
        image=_image(workload.image),
        env=_environment(list(workload.environment)),
        cpu_millicores=_limit(limits.cpu, "cpu", MIN_CPU_MILLICORES, MAX_CPU_MILLICORES, "millicores"),
        memory_mib=_limit(limits.memory, "memory", MIN_MEMORY_MIB, MAX_INT32, "MiB"),
    )


def status_message(instance_id: str, status: Status) -> pb.WorkloadStatus:
    return pb.WorkloadStatus(
        instance_id=instance_id,
        status=pb.WorkloadStatusStatus(code=status.phase.value, message=status.message),
        resource_usage=pb.WorkloadStatusResources(
            cpu=status.usage.cpu_millicores, memory=status.usage.memory_mib, disk=status.usage.disk_mib
        ),
    )


class WorkloadServicer:
    def __init__(self, workloads: Workloads, status_interval: float) -> None:
        self._workloads = workloads
        self._interval = status_interval

    async def create(self, request: pb.Workload, context: Context) -> AsyncIterator[pb.WorkloadStatus]:
        workload = await self._workloads.create(workload_spec(request))
        async for status in self._workloads.statuses(workload, self._interval):
            yield status_message(workload.instance_id, status)

    async def signal(self, request: pb.WorkloadSignal, context: Context) -> pb.Empty:
        if request.signal not in (pb.WorkloadSignalSignal.STOP, pb.WorkloadSignalSignal.KILL):
            raise OrkaError.invalid("signal", f"{int(request.signal)} is neither STOP nor KILL")
        instance_id = _instance_id(request.instance_id)
        await self._workloads.signal(instance_id, kill=request.signal == pb.WorkloadSignalSignal.KILL)
        return pb.Empty()
