"""cAdvisor's metrics of a cgroup sample: what a host cannot read is left out, seconds are whole
and never go back, a limit that is not set is 0, and every metric has its descriptor."""

from __future__ import annotations

import dataclasses

from auraed.api.runtime import v1 as cri
from auraed.cri.metric_rpcs import LABEL_KEYS, cgroup_metrics, descriptors
from auraed.cri.metrics import CgroupSample
from auraed.system.cgroupfs import IoCounters

LABELS = ("c", "/aurae/_pods/p/c", "busybox", "id", "ns", "pod")
FULL = CgroupSample(
    id="/aurae/_pods/p/c",
    timestamp_ns=1_700_000_000_123_456_789,
    cpu={"usage_usec": 2_999_999, "user_usec": 1_000_000, "system_usec": 5, "nr_periods": 7},
    cpu_quota_us=50_000,
    cpu_period_us=100_000,
    cpu_shares=1024,
    memory_usage=4096,
    memory_working_set=2048,
    memory_stat={"anon": 1024, "file": 512},
    memory_peak=8192,
    memory_swap=0,
    memory_limit=None,
    oom_kills=1,
    processes=2,
    threads=3,
    threads_max=None,
    io={"/dev/vda": IoCounters(10, 20, 1, 2)},
)


def by_name(metrics: list[cri.Metric]) -> dict[str, int]:
    return {m.name: m.value.value for m in metrics if m.value is not None}


def test_every_metric_has_its_descriptor_and_labels() -> None:
    known = {d.name: d for d in descriptors()}
    metrics = cgroup_metrics(FULL, LABELS)
    for metric in metrics:
        assert len(metric.label_values) == len(known[metric.name].label_keys), metric.name
        assert metric.timestamp == FULL.timestamp_ns
    assert all(list(d.label_keys[: len(LABEL_KEYS)]) == list(LABEL_KEYS) for d in known.values())
    devices = {m.label_values[-1] for m in metrics if m.name.startswith("container_fs_")}
    assert devices == {"/dev/vda"}


def test_values_as_cadvisor_gives_them() -> None:
    found = by_name(cgroup_metrics(FULL, LABELS))
    assert found["container_cpu_usage_seconds_total"] == 2  # whole seconds, rounded down
    assert found["container_cpu_user_seconds_total"] == 1
    assert found["container_memory_rss"] == 1024 and found["container_memory_cache"] == 512
    assert found["container_spec_memory_limit_bytes"] == 0  # no limit
    assert found["container_threads_max"] == 0  # no limit
    assert found["container_spec_cpu_quota"] == 50_000
    assert found["container_last_seen"] == 1_700_000_000
    assert found["container_fs_writes_bytes_total"] == 20 and found["container_fs_reads_total"] == 1


def test_what_the_host_cannot_read_is_left_out() -> None:
    sparse = dataclasses.replace(
        FULL,
        cpu={},
        cpu_quota_us=None,
        memory_usage=None,
        memory_peak=None,
        memory_swap=None,
        threads=None,
        io={},
    )
    found = by_name(cgroup_metrics(sparse, LABELS))
    for absent in (
        "container_cpu_usage_seconds_total",
        "container_spec_cpu_quota",  # no quota: cAdvisor gives none
        "container_memory_usage_bytes",
        "container_spec_memory_limit_bytes",  # no memory controller: no limit to tell
        "container_memory_max_usage_bytes",
        "container_memory_swap",
        "container_threads",
        "container_threads_max",
        "container_fs_reads_bytes_total",
    ):
        assert absent not in found
    assert found["container_processes"] == 2 and found["container_memory_working_set_bytes"] == 2048
