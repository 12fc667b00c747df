"""ListMetricDescriptors, ListPodSandboxMetrics and StreamPodSandboxMetrics of runtime.v1: the
cAdvisor metrics a kubelet serves on /metrics/cadvisor when it takes pod and container stats from
the runtime (feature gate PodAndContainerStatsFromCRI), read from the pods' and containers'
cgroups (auraed.cri.metrics).

The kubelet makes one Prometheus descriptor of each MetricDescriptor, once, and drops every metric
whose name it has no descriptor for or whose label values do not match its label keys in number:
every metric here has a descriptor, with cAdvisor's labels (``container``, ``id``, ``image``,
``name``, ``namespace``, ``pod``) and the few a metric adds (``device``). As cAdvisor labels
them, a pod's own cgroup has an empty ``container``, ``image`` and ``name``, and ``id`` is the
cgroup's path; a container's ``name`` is its id. The CRI's values are whole numbers: seconds are
whole seconds (rounded down, so a counter never goes back), as containerd reports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

from auraed.api.runtime import v1 as cri
from auraed.cri.metrics import CgroupSample, ContainerSample, PodMetricsSource, PodSample
from auraed.system.cgroupfs import IoCounters
from auraed.wire.handlers import Context

LABEL_KEYS = ("container", "id", "image", "name", "namespace", "pod")
COUNTER, GAUGE = cri.MetricType.COUNTER, cri.MetricType.GAUGE
NS_PER_S = 1_000_000_000
US_PER_S = 1_000_000


@dataclasses.dataclass(frozen=True)
class Kind:
    """A metric as its descriptor says it: name, help, type, and labels besides LABEL_KEYS."""

    name: str
    help: str
    type: cri.MetricType
    extra_labels: tuple[str, ...] = ()

    def descriptor(self) -> cri.MetricDescriptor:
        return cri.MetricDescriptor(
            name=self.name, help=self.help, label_keys=[*LABEL_KEYS, *self.extra_labels]
        )


def _seconds(usec: int | None) -> int | None:
    return None if usec is None else usec // US_PER_S


def _unlimited_as_zero(limit: int | None, controller_read: object) -> int | None:
    """A limit as cAdvisor gives it: 0 for none, nothing where the controller is missing."""
    return None if controller_read is None else (limit or 0)


CgroupRead = Callable[[CgroupSample], int | None]
CGROUP_METRICS: tuple[tuple[Kind, CgroupRead], ...] = (
    (
        Kind("container_cpu_usage_seconds_total", "Cumulative cpu time consumed in seconds.", COUNTER),
        lambda s: _seconds(s.cpu.get("usage_usec")),
    ),
    (
        Kind("container_cpu_user_seconds_total", "Cumulative user cpu time consumed in seconds.", COUNTER),
        lambda s: _seconds(s.cpu.get("user_usec")),
    ),
    (
        Kind(
            "container_cpu_system_seconds_total", "Cumulative system cpu time consumed in seconds.", COUNTER
        ),
        lambda s: _seconds(s.cpu.get("system_usec")),
    ),
    (
        Kind("container_cpu_cfs_periods_total", "Number of elapsed enforcement period intervals.", COUNTER),
        lambda s: s.cpu.get("nr_periods"),
    ),
    (
        Kind("container_cpu_cfs_throttled_periods_total", "Number of throttled period intervals.", COUNTER),
        lambda s: s.cpu.get("nr_throttled"),
    ),
    (
        Kind(
            "container_cpu_cfs_throttled_seconds_total",
            "Total time duration the container has been throttled.",
            COUNTER,
        ),
        lambda s: _seconds(s.cpu.get("throttled_usec")),
    ),
    (
        Kind(
            "container_memory_usage_bytes",
            "Current memory usage in bytes, including all memory regardless of when it was accessed",
            GAUGE,
        ),
        lambda s: s.memory_usage,
    ),
    (
        Kind("container_memory_working_set_bytes", "Current working set in bytes.", GAUGE),
        lambda s: s.memory_working_set,
    ),
    (Kind("container_memory_rss", "Size of RSS in bytes.", GAUGE), lambda s: s.memory_stat.get("anon")),
    (
        Kind("container_memory_cache", "Number of bytes of page cache memory.", GAUGE),
        lambda s: s.memory_stat.get("file"),
    ),
    (
        Kind("container_memory_mapped_file", "Size of memory mapped files in bytes.", GAUGE),
        lambda s: s.memory_stat.get("file_mapped"),
    ),
    (
        Kind("container_memory_total_active_file_bytes", "Current total active file in bytes.", GAUGE),
        lambda s: s.memory_stat.get("active_file"),
    ),
    (
        Kind("container_memory_total_inactive_file_bytes", "Current total inactive file in bytes.", GAUGE),
        lambda s: s.memory_stat.get("inactive_file"),
    ),
    (Kind("container_memory_swap", "Container swap usage in bytes.", GAUGE), lambda s: s.memory_swap),
    (
        Kind("container_memory_max_usage_bytes", "Maximum memory usage recorded in bytes", GAUGE),
        lambda s: s.memory_peak,
    ),
    (
        Kind(
            "container_oom_events_total", "Count of out of memory events observed for the container", COUNTER
        ),
        lambda s: s.oom_kills,
    ),
    (
        Kind("container_processes", "Number of processes running inside the container.", GAUGE),
        lambda s: s.processes,
    ),
    (
        Kind("container_threads", "Number of threads running inside the container", GAUGE),
        lambda s: s.threads,
    ),
    (
        Kind(
            "container_threads_max",
            "Maximum number of threads allowed inside the container, infinity if value is zero",
            GAUGE,
        ),
        lambda s: _unlimited_as_zero(s.threads_max, s.threads),
    ),
    (
        Kind("container_spec_memory_limit_bytes", "Memory limit for the container.", GAUGE),
        lambda s: _unlimited_as_zero(s.memory_limit, s.memory_usage),
    ),
    (Kind("container_spec_cpu_period", "CPU period of the container.", GAUGE), lambda s: s.cpu_period_us),
    (Kind("container_spec_cpu_quota", "CPU quota of the container.", GAUGE), lambda s: s.cpu_quota_us),
    (Kind("container_spec_cpu_shares", "CPU share of the container.", GAUGE), lambda s: s.cpu_shares),
    (
        Kind("container_last_seen", "Last time a container was seen by the exporter", GAUGE),
        lambda s: s.timestamp_ns // NS_PER_S,
    ),
)
"""Of every cgroup sampled, a pod's or a container's; a reading that is None is left out."""

DEVICE = ("device",)
IO_METRICS: tuple[tuple[Kind, Callable[[IoCounters], int]], ...] = (
    (
        Kind("container_fs_reads_bytes_total", "Cumulative count of bytes read", COUNTER, DEVICE),
        lambda io: io.read_bytes,
    ),
    (
        Kind("container_fs_writes_bytes_total", "Cumulative count of bytes written", COUNTER, DEVICE),
        lambda io: io.write_bytes,
    ),
    (
        Kind("container_fs_reads_total", "Cumulative count of reads completed", COUNTER, DEVICE),
        lambda io: io.reads,
    ),
    (
        Kind("container_fs_writes_total", "Cumulative count of writes completed", COUNTER, DEVICE),
        lambda io: io.writes,
    ),
)
"""Of every cgroup sampled, one of each per block device it did I/O on."""

START_TIME = Kind(
    "container_start_time_seconds", "Start time of the container since unix epoch in seconds.", GAUGE
)
FS_USAGE = Kind(
    "container_fs_usage_bytes",
    "Number of bytes that are consumed by the container on this filesystem.",
    GAUGE,
    DEVICE,
)
"""The container's writable layer; its ``device`` is the layer's directory."""

KINDS = (*(kind for kind, _ in CGROUP_METRICS), *(kind for kind, _ in IO_METRICS), START_TIME, FS_USAGE)


def descriptors() -> list[cri.MetricDescriptor]:
    return [kind.descriptor() for kind in KINDS]


def _metric(kind: Kind, timestamp_ns: int, labels: tuple[str, ...], value: int) -> cri.Metric:
    return cri.Metric(
        name=kind.name,
        timestamp=timestamp_ns,
        metric_type=kind.type,
        label_values=list(labels),
        value=cri.UInt64Value(value=max(value, 0)),
    )


def _labels(**values: str) -> tuple[str, ...]:
    return tuple(values[key] for key in LABEL_KEYS)


def cgroup_metrics(sample: CgroupSample, labels: tuple[str, ...]) -> list[cri.Metric]:
    at = sample.timestamp_ns
    metrics = [
        _metric(kind, at, labels, value)
        for kind, read in CGROUP_METRICS
        if (value := read(sample)) is not None
    ]
    for device, counters in sorted(sample.io.items()):
        metrics += [_metric(kind, at, (*labels, device), read(counters)) for kind, read in IO_METRICS]
    return metrics


def container_metrics(pod: PodSample, sample: ContainerSample) -> cri.ContainerMetrics:
    record, host = sample.container.record, sample.container.host
    meta = pod.pod.spec.metadata
    labels = _labels(
        container=record.name,
        id=sample.cgroup.id,
        image=record.image.shown,
        name=record.id,
        namespace=meta.namespace,
        pod=meta.name,
    )
    metrics = cgroup_metrics(sample.cgroup, labels)
    if host.started_at:
        metrics.append(_metric(START_TIME, sample.cgroup.timestamp_ns, labels, int(host.started_at)))
    used = sample.writable
    metrics.append(
        _metric(FS_USAGE, used.timestamp_ns, (*labels, str(sample.writable_root)), used.used_bytes)
    )
    return cri.ContainerMetrics(container_id=record.id, metrics=metrics)


def pod_metrics(sample: PodSample) -> cri.PodSandboxMetrics:
    meta = sample.pod.spec.metadata
    metrics = []
    if sample.cgroup is not None:
        labels = _labels(
            container="", id=sample.cgroup.id, image="", name="", namespace=meta.namespace, pod=meta.name
        )
        metrics = cgroup_metrics(sample.cgroup, labels)
    return cri.PodSandboxMetrics(
        pod_sandbox_id=sample.pod.id,
        metrics=metrics,
        container_metrics=[container_metrics(sample, container) for container in sample.containers],
    )


class MetricRpcs:
    """ListMetricDescriptors, ListPodSandboxMetrics, StreamPodSandboxMetrics (one part of the
    RuntimeServicer). Their requests carry nothing."""

    def __init__(self, source: PodMetricsSource) -> None:
        self._source = source

    async def list_metric_descriptors(
        self, request: cri.ListMetricDescriptorsRequest, context: Context
    ) -> cri.ListMetricDescriptorsResponse:
        return cri.ListMetricDescriptorsResponse(descriptors=descriptors())

    async def _pod_metrics(self) -> list[cri.PodSandboxMetrics]:
        return [pod_metrics(sample) for sample in await self._source.samples()]

    async def list_pod_sandbox_metrics(
        self, request: cri.ListPodSandboxMetricsRequest, context: Context
    ) -> cri.ListPodSandboxMetricsResponse:
        return cri.ListPodSandboxMetricsResponse(pod_metrics=await self._pod_metrics())

    async def stream_pod_sandbox_metrics(
        self, request: cri.StreamPodSandboxMetricsRequest, context: Context
    ) -> AsyncIterator[cri.StreamPodSandboxMetricsResponse]:
        yield cri.StreamPodSandboxMetricsResponse(pod_sandbox_metrics=await self._pod_metrics())
