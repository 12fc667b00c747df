"""What ListPodSandboxMetrics reports, read from the host: a sample of every READY pod's cgroup and
of each of its running containers' cgroups, with the containers' writable layers.

A sample holds the cgroup files as the kernel has them (cgroup v2, or v1 read under v2's names
by auraed.system.cgroupfs); turning them into cAdvisor's metrics is auraed.cri.metric_rpcs'. A
reading the host cannot give (a controller that is not there, memory.peak before kernel 5.19, swap
without swap accounting) is None, and its metric is left out; a cgroup that is gone as it is read
(its container ended) gives no sample at all. Block I/O is what the kernel counts: all of it on
cgroup v2, on v1 only the I/O a blkio throttle rule applies to (none unless one is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from auraed.containers.model import State
from auraed.cri.container_host import CgroupUsage
from auraed.cri.containers import Container, CriContainers
from auraed.cri.model import PodRecord, PodState
from auraed.cri.pods import Pods
from auraed.errors import AuraeError
from auraed.system.cgroupfs import CgroupError, Cgroupfs, IoCounters
from auraed.system.fs_usage import FsUsage

T = TypeVar("T")
SYS_DEV_BLOCK = Path("/sys/dev/block")


@dataclasses.dataclass(frozen=True)
class CgroupSample:
    """One cgroup's readings at ``timestamp_ns``; ``id`` is its path as /proc/<pid>/cgroup names it."""

    id: str
    timestamp_ns: int
    cpu: Mapping[str, int]  # cpu.stat by v2's names: usage_usec, user_usec, nr_throttled, ...
    cpu_quota_us: int | None  # None: no quota
    cpu_period_us: int | None
    cpu_shares: int | None
    memory_usage: int | None
    memory_working_set: int | None
    memory_stat: Mapping[str, int]  # memory.stat by v2's names: anon, file, file_mapped, ...
    memory_peak: int | None
    memory_swap: int | None
    memory_limit: int | None  # None: no limit, or no memory controller
    oom_kills: int | None
    processes: int
    threads: int | None  # pids.current: the kernel counts tasks
    threads_max: int | None  # None: no limit, or no pids controller
    io: Mapping[str, IoCounters]  # by device: /dev/<name>, or major:minor when it has none


@dataclasses.dataclass(frozen=True)
class ContainerSample:
    container: Container
    cgroup: CgroupSample
    writable_root: Path
    writable: FsUsage


@dataclasses.dataclass(frozen=True)
class PodSample:
    pod: PodRecord
    cgroup: CgroupSample | None  # None: the pod's sandbox has no cgroup (any more)
    containers: tuple[ContainerSample, ...]  # its running containers


def _optional(read: Callable[[], T]) -> T | None:
    """What ``read`` reads, None where the host has no such file or controller."""
    try:
        return read()
    except CgroupError as exc:
        if exc.kind == "unsupported":
            return None
        raise


@functools.lru_cache(maxsize=256)
def device_name(device: str) -> str:
    """A block device's /dev name from its "major:minor" (cAdvisor's device label)."""
    with contextlib.suppress(OSError):
        for line in (SYS_DEV_BLOCK / device / "uevent").read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "DEVNAME" and value:
                return f"/dev/{value}"
    return device


def sample_cgroup(cgroups: Cgroupfs, path: str) -> CgroupSample | None:
    """The cgroup's readings (blocking: run it in a worker thread); None when it is gone."""
    try:
        if not cgroups.exists(path):
            return None
        quota, period = _optional(lambda: cgroups.cpu_max(path)) or (None, None)
        io = _optional(lambda: cgroups.io_stat(path)) or {}
        return CgroupSample(
            id=cgroups.cgroup_path(path),
            timestamp_ns=time.time_ns(),
            cpu=_optional(lambda: cgroups.cpu_stat(path)) or {},
            cpu_quota_us=quota,
            cpu_period_us=period,
            cpu_shares=_optional(lambda: cgroups.cpu_shares(path)),
            memory_usage=_optional(lambda: cgroups.memory_current(path)),
            memory_working_set=_optional(lambda: cgroups.memory_working_set(path)),
            memory_stat=_optional(lambda: cgroups.memory_stat(path)) or {},
            memory_peak=_optional(lambda: cgroups.memory_peak(path)),
            memory_swap=_optional(lambda: cgroups.memory_swap(path)),
            memory_limit=_optional(lambda: cgroups.memory_max(path)),
            oom_kills=_optional(lambda: cgroups.oom_kill_count(path)),
            processes=cgroups.process_count(path),
            threads=_optional(lambda: cgroups.pids_current(path)),
            threads_max=_optional(lambda: cgroups.pids_max(path)),
            io={device_name(device): counters for device, counters in io.items()},
        )
    except CgroupError:
        return None  # removed as it was read (the container ended, the pod went)


def guest_sample(usage: CgroupUsage, cgroup_id: str) -> CgroupSample:
    """A guest container's readings as its guest reports them (auraed.cri.guest_containers): CPU
    time, memory and processes; what a guest does not report is left out. ``cgroup_id`` names
    it below its pod's cgroup on the host, where its VM runs."""
    return CgroupSample(
        id=cgroup_id,
        timestamp_ns=usage.timestamp_ns,
        cpu={"usage_usec": usage.cpu_ns // 1000},
        cpu_quota_us=None,
        cpu_period_us=None,
        cpu_shares=None,
        memory_usage=usage.memory_usage,
        memory_working_set=usage.memory_working_set,
        memory_stat={},
        memory_peak=None,
        memory_swap=None,
        memory_limit=None,
        oom_kills=None,
        processes=usage.processes,
        threads=None,
        threads_max=None,
        io={},
    )


class PodMetricsSource:
    """Samples of the READY pods, as ListPodSandboxMetrics reports them."""

    def __init__(self, pods: Pods, containers: CriContainers, cgroups: Cgroupfs) -> None:
        self._pods = pods
        self._containers = containers
        self._cgroups = cgroups

    async def samples(self) -> list[PodSample]:
        running: dict[str, list[Container]] = {}
        for container in self._containers.all():
            if container.host.state == State.RUNNING:
                running.setdefault(container.record.pod_id, []).append(container)
        ready = [pod for pod in self._pods.all() if pod.state is PodState.READY]
        return [await self._sample(pod, running.get(pod.id, [])) for pod in ready]

    async def _sample(self, pod: PodRecord, running: list[Container]) -> PodSample:
        """The pod's cgroup on the host (a vm pod's holds its whole VM), its containers' on the
        host, or as their guest reports them."""
        pod_cgroup = None
        with contextlib.suppress(AuraeError):  # a sandbox the pod lost has no cgroup to read
            pod_cgroup = self._pods.controller(pod).container_sandbox(pod).cgroup_parent
        on_host = [c for c in running if self._containers.cgroup(c) is not None]
        paths = [path for c in on_host if (path := self._containers.cgroup(c)) is not None]
        pod_sample, samples = await asyncio.to_thread(self._read, pod_cgroup, paths)
        in_guest = [c for c in running if self._containers.cgroup(c) is None]
        samples += [await self._guest_sample(pod_sample, c) for c in in_guest]
        containers = []
        for container, sample in zip([*on_host, *in_guest], samples, strict=True):
            if sample is not None:
                root, writable = await self._containers.writable(container)
                containers.append(ContainerSample(container, sample, root, writable))
        return PodSample(pod, pod_sample, tuple(containers))

    async def _guest_sample(self, pod: CgroupSample | None, container: Container) -> CgroupSample | None:
        usage = (await self._containers.usage(container, of_many=True)).cgroup
        if usage is None:
            return None  # ended as it was read
        where = pod.id if pod is not None else ""
        return guest_sample(usage, f"{where}/guest/{container.host.id}")

    def _read(
        self, pod_cgroup: str | None, paths: list[str]
    ) -> tuple[CgroupSample | None, list[CgroupSample | None]]:
        """A pod's cgroup and its containers' in one worker thread."""
        pod = sample_cgroup(self._cgroups, pod_cgroup) if pod_cgroup is not None else None
        return pod, [sample_cgroup(self._cgroups, path) for path in paths]
