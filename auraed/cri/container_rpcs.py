"""The container RPCs of runtime.v1.RuntimeService over the CRI container domain: lifecycle,
lists, status, resources, logs, ExecSync, stats (containers' and pods') and container events.

Requests become typed values here (auraed.cri.container_config); replies are built from the
domain's records. A container's status follows containerd's conventions where the CRI is silent:
reason ``Completed`` for exit 0, ``Error`` for another code, ``OOMKilled`` when the cgroup's OOM
killer ended it, ``StartError`` (exit 128) when it never ran; ``image`` the image as the user
named it, ``image_ref`` and ``image_id`` its id; ``log_path`` the absolute path of the log file.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping

from auraed.api.runtime import v1 as cri
from auraed.containers.model import ContainerRecord, ProcessUser, State
from auraed.cri.container_config import ContainerSpec, CriMount, container_spec, resources
from auraed.cri.container_host import CgroupUsage
from auraed.cri.containers import (
    Container,
    ContainerEvent,
    ContainerFilter,
    ContainerUsage,
    CriContainerRecord,
    CriContainers,
    EventType,
    PodUsage,
)
from auraed.cri.errors import CriError
from auraed.cri.model import PodRecord, labels, plausible_id
from auraed.cri.pods import Pods
from auraed.errors import ErrorKind
from auraed.system.tasks import OwnThreads, StuckThreads
from auraed.wire.handlers import Context

STATES = {
    State.CREATING: cri.ContainerState.CONTAINER_CREATED,
    State.CREATED: cri.ContainerState.CONTAINER_CREATED,
    State.RUNNING: cri.ContainerState.CONTAINER_RUNNING,
    State.EXITED: cri.ContainerState.CONTAINER_EXITED,
    State.UNKNOWN: cri.ContainerState.CONTAINER_UNKNOWN,
}
HOST_STATES = {
    state: frozenset(host for host, shown in STATES.items() if shown == state) for state in cri.ContainerState
}
EVENT_TYPES = {
    EventType.CREATED: cri.ContainerEventType.CONTAINER_CREATED_EVENT,
    EventType.STARTED: cri.ContainerEventType.CONTAINER_STARTED_EVENT,
    EventType.STOPPED: cri.ContainerEventType.CONTAINER_STOPPED_EVENT,
    EventType.DELETED: cri.ContainerEventType.CONTAINER_DELETED_EVENT,
}
START_ERROR_EXIT_CODE = 128
"""The exit code of a container that never ran (its start failed), as containerd reports it."""
MAX_EXEC_TIMEOUT = 365 * 24 * 3600  # seconds; anything longer is a mistake, not a probe

PodStatus = Callable[[PodRecord], cri.PodSandboxStatus]
"""A pod's PodSandboxStatus, as the pod RPCs report it (events carry it; None: they do not)."""


# -- typed values -> messages ------------------------------------------------------------------


def metadata(record: CriContainerRecord) -> cri.ContainerMetadata:
    return cri.ContainerMetadata(name=record.name, attempt=record.attempt)


def image_spec(record: CriContainerRecord) -> cri.ImageSpec:
    return cri.ImageSpec(
        image=record.image.shown,
        annotations=dict(record.image.annotations),
        user_specified_image=record.image.user_specified_image,
    )


def mount_message(mount: CriMount) -> cri.Mount:
    return cri.Mount(
        container_path=mount.container_path,
        host_path=mount.host_path,
        readonly=mount.readonly,
        selinux_relabel=mount.selinux_relabel,
        propagation=cri.MountPropagation(mount.propagation),
        recursive_read_only=mount.recursive_read_only,
        image=cri.ImageSpec(image=mount.image) if mount.image else None,
        image_sub_path=mount.image_sub_path,
    )


def exit_code(host: ContainerRecord) -> int:
    if host.exit_code is not None:
        return host.exit_code
    if host.signal is not None:
        return 128 + host.signal
    return START_ERROR_EXIT_CODE if host.state == State.EXITED else 0


def reason_and_message(host: ContainerRecord) -> tuple[str, str]:
    """(reason, message) of ContainerStatus: a CamelCase word, and what happened in words."""
    message = "" if host.reason == "OOMKilled" else host.reason
    if host.state != State.EXITED:
        return "", message
    if host.oom_killed:
        return "OOMKilled", message
    if host.exit_code is None and host.signal is None:
        return "StartError", message
    return ("Completed" if exit_code(host) == 0 else "Error"), message


def _ns(seconds: float | None) -> int:
    return round(seconds * 1e9) if seconds else 0


def status_message(container: Container) -> cri.ContainerStatus:
    record, host = container.record, container.host
    reason, message = reason_and_message(host)
    return cri.ContainerStatus(
        id=record.id,
        metadata=metadata(record),
        state=STATES[host.state],
        created_at=record.created_ns,
        started_at=_ns(host.started_at),
        finished_at=_ns(host.finished_at) if host.state == State.EXITED else 0,
        exit_code=exit_code(host) if host.state == State.EXITED else 0,
        image=image_spec(record),
        image_ref=record.image_id,
        reason=reason,
        message=message,
        labels=dict(record.labels),
        annotations=dict(record.annotations),
        mounts=[mount_message(mount) for mount in record.mounts],
        log_path=record.log_path,
        image_id=record.image_id,
        user=_user(host.user),
    )


def _user(user: ProcessUser | None) -> cri.ContainerUser | None:
    """The ids the container's process runs with, from its spec as containerd reports them: its
    supplementary groups, the primary group first among them."""
    if user is None:
        return None
    groups = list(user.additional_gids)
    return cri.ContainerUser(
        linux=cri.LinuxContainerUser(uid=user.uid, gid=user.gid, supplemental_groups=groups)
    )


def listed(container: Container) -> cri.Container:
    record = container.record
    return cri.Container(
        id=record.id,
        pod_sandbox_id=record.pod_id,
        metadata=metadata(record),
        image=image_spec(record),
        image_ref=record.image_id,
        state=STATES[container.host.state],
        created_at=record.created_ns,
        labels=dict(record.labels),
        annotations=dict(record.annotations),
        image_id=record.image_id,
    )


def _uint(value: int) -> cri.UInt64Value:
    return cri.UInt64Value(value=max(value, 0))


def stats_message(usage: ContainerUsage) -> cri.ContainerStats:
    record = usage.container.record
    stats = cri.ContainerStats(
        attributes=cri.ContainerAttributes(
            id=record.id,
            metadata=metadata(record),
            labels=dict(record.labels),
            annotations=dict(record.annotations),
        ),
        writable_layer=cri.FilesystemUsage(
            timestamp=usage.writable.timestamp_ns,
            fs_id=cri.FilesystemIdentifier(mountpoint=str(usage.writable_root)),
            used_bytes=_uint(usage.writable.used_bytes),
            inodes_used=_uint(usage.writable.inodes_used),
        ),
    )
    if usage.cgroup is not None:
        stats.cpu, stats.memory = _cpu(usage.cgroup), _memory(usage.cgroup)
    return stats


def _cpu(cgroup: CgroupUsage) -> cri.CpuUsage:
    return cri.CpuUsage(timestamp=cgroup.timestamp_ns, usage_core_nano_seconds=_uint(cgroup.cpu_ns))


def _memory(cgroup: CgroupUsage) -> cri.MemoryUsage:
    return cri.MemoryUsage(
        timestamp=cgroup.timestamp_ns,
        working_set_bytes=_uint(cgroup.memory_working_set),
        usage_bytes=_uint(cgroup.memory_usage),
    )


def pod_attributes(pod: PodRecord) -> cri.PodSandboxAttributes:
    meta = pod.spec.metadata
    return cri.PodSandboxAttributes(
        id=pod.id,
        metadata=cri.PodSandboxMetadata(
            name=meta.name, uid=meta.uid, namespace=meta.namespace, attempt=meta.attempt
        ),
        labels=dict(pod.spec.labels),
        annotations=dict(pod.spec.annotations),
    )


def pod_stats_message(usage: PodUsage) -> cri.PodSandboxStats:
    linux = cri.LinuxPodSandboxStats(containers=[stats_message(c) for c in usage.containers])
    if usage.cgroup is not None:
        linux.cpu, linux.memory = _cpu(usage.cgroup), _memory(usage.cgroup)
        linux.process = cri.ProcessUsage(
            timestamp=usage.cgroup.timestamp_ns, process_count=_uint(usage.cgroup.processes)
        )
    return cri.PodSandboxStats(attributes=pod_attributes(usage.pod), linux=linux)


# -- messages -> typed values ------------------------------------------------------------------


def container_filter(request_filter: cri.ContainerFilter | None) -> ContainerFilter:
    if request_filter is None:
        return ContainerFilter()
    state = request_filter.state
    return ContainerFilter(
        id=request_filter.id,
        states=HOST_STATES[state.state] if state is not None else None,
        pod_id=request_filter.pod_sandbox_id,
        labels=labels(request_filter.label_selector, "filter.label_selector"),
    )


def stats_filter(request_filter: cri.ContainerStatsFilter | None) -> ContainerFilter:
    if request_filter is None:
        return ContainerFilter()
    return ContainerFilter(
        id=request_filter.id,
        pod_id=request_filter.pod_sandbox_id,
        labels=labels(request_filter.label_selector, "filter.label_selector"),
    )


def _selected(
    pod: PodRecord, request_filter: cri.PodSandboxStatsFilter | None, selector: Mapping[str, str]
) -> bool:
    if request_filter is None:
        return True
    if request_filter.id and not pod.id.startswith(request_filter.id):
        return False
    return all(pod.spec.labels.get(key) == value for key, value in selector.items())


class ContainerRpcs:
    """The container RPCs of runtime.v1.RuntimeService (one part of the RuntimeServicer)."""

    def __init__(
        self,
        containers: CriContainers,
        pods: Pods,
        pod_status: PodStatus | None,
        *,
        files: OwnThreads,
        profile_max_bytes: int,
    ) -> None:
        self._containers = containers
        self._pods = pods
        self._pod_status = pod_status
        self._files = files  # where CreateContainer looks at the files its request names
        self._profile_max_bytes = profile_max_bytes

    # -- lifecycle ---------------------------------------------------------------------------

    async def create_container(
        self, request: cri.CreateContainerRequest, context: Context
    ) -> cri.CreateContainerResponse:
        pod = self._pods.get(plausible_id(request.pod_sandbox_id, "pod_sandbox_id"))
        spec = await self._checked_config(request.config, pod)
        container = await self._containers.create(pod, spec)
        return cri.CreateContainerResponse(container_id=container.record.id)

    async def _checked_config(self, config: cri.ContainerConfig | None, pod: PodRecord) -> ContainerSpec:
        """The request's config checked, its files (seccomp profile, host paths, log path) looked
        at on a thread of its own within the configured deadline: a path on a hung filesystem
        fails this call alone, and no other call waits for it."""
        features = self._pods.controller(pod).features
        try:
            return await self._files.run(
                lambda: container_spec(
                    config,
                    pod.spec,
                    recursive_read_only=features.recursive_read_only_mounts,
                    profile_max_bytes=self._profile_max_bytes,
                ),
                f"CreateContainer in {pod.id[:13]}",
            )
        except TimeoutError:
            raise CriError(
                ErrorKind.DEADLINE_EXCEEDED,
                f"config: the files it names (seccomp profile, host paths, log path) were not read "
                f"in {self._files.timeout:g}s; is a filesystem hung?",
            ) from None
        except StuckThreads as exc:
            raise CriError(
                ErrorKind.UNAVAILABLE, f"config: its files are not looked at now: {exc} (a hung filesystem?)"
            ) from None

    async def start_container(
        self, request: cri.StartContainerRequest, context: Context
    ) -> cri.StartContainerResponse:
        await self._containers.start(plausible_id(request.container_id, "container_id"))
        return cri.StartContainerResponse()

    async def stop_container(
        self, request: cri.StopContainerRequest, context: Context
    ) -> cri.StopContainerResponse:
        container_id = plausible_id(request.container_id, "container_id")
        await self._containers.stop(container_id, max(request.timeout, 0))
        return cri.StopContainerResponse()

    async def remove_container(
        self, request: cri.RemoveContainerRequest, context: Context
    ) -> cri.RemoveContainerResponse:
        await self._containers.remove(plausible_id(request.container_id, "container_id"))
        return cri.RemoveContainerResponse()

    # -- lists and status --------------------------------------------------------------------

    def _listed(self, request_filter: cri.ContainerFilter | None) -> list[cri.Container]:
        return [listed(c) for c in self._containers.all(container_filter(request_filter))]

    async def list_containers(
        self, request: cri.ListContainersRequest, context: Context
    ) -> cri.ListContainersResponse:
        return cri.ListContainersResponse(containers=self._listed(request.filter))

    async def stream_containers(
        self, request: cri.StreamContainersRequest, context: Context
    ) -> AsyncIterator[cri.StreamContainersResponse]:
        yield cri.StreamContainersResponse(containers=self._listed(request.filter))

    async def container_status(
        self, request: cri.ContainerStatusRequest, context: Context
    ) -> cri.ContainerStatusResponse:
        container = self._containers.get(plausible_id(request.container_id, "container_id"))
        info: dict[str, str] = {}
        if request.verbose:
            info["info"] = json.dumps(
                {
                    "sandboxID": container.record.pod_id,
                    "pid": container.host.pid if container.host.state == State.RUNNING else 0,
                    "name": container.host.name,
                    "image": container.record.image_id,
                    "logPath": container.record.log_path,
                    "runtimeSpec": await self._containers.runtime_spec(container),
                }
            )
        return cri.ContainerStatusResponse(status=status_message(container), info=info)

    def container_statuses(self, pod_id: str) -> list[cri.ContainerStatus]:
        """The statuses of a pod's containers (PodSandboxStatus's containers_statuses)."""
        return [status_message(c) for c in self._containers.in_pod(pod_id)]

    # -- in a running container ----------------------------------------------------------------

    async def update_container_resources(
        self, request: cri.UpdateContainerResourcesRequest, context: Context
    ) -> cri.UpdateContainerResourcesResponse:
        limits = resources(request.linux, "linux")
        await self._containers.update_resources(plausible_id(request.container_id, "container_id"), limits)
        return cri.UpdateContainerResourcesResponse()

    async def reopen_container_log(
        self, request: cri.ReopenContainerLogRequest, context: Context
    ) -> cri.ReopenContainerLogResponse:
        await self._containers.reopen_log(plausible_id(request.container_id, "container_id"))
        return cri.ReopenContainerLogResponse()

    async def exec_sync(self, request: cri.ExecSyncRequest, context: Context) -> cri.ExecSyncResponse:
        if not request.cmd:
            raise CriError.invalid("cmd", "is required")
        if not 0 <= request.timeout <= MAX_EXEC_TIMEOUT:
            raise CriError.invalid("timeout", f"must be 0 (none) to {MAX_EXEC_TIMEOUT} seconds")
        result = await self._containers.exec_sync(
            plausible_id(request.container_id, "container_id"), list(request.cmd), request.timeout or None
        )
        return cri.ExecSyncResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)

    # -- stats -------------------------------------------------------------------------------

    async def container_stats(
        self, request: cri.ContainerStatsRequest, context: Context
    ) -> cri.ContainerStatsResponse:
        container = self._containers.get(plausible_id(request.container_id, "container_id"))
        return cri.ContainerStatsResponse(stats=stats_message(await self._containers.usage(container)))

    async def _stats(self, request_filter: cri.ContainerStatsFilter | None) -> list[cri.ContainerStats]:
        return [stats_message(u) for u in await self._containers.usages(stats_filter(request_filter))]

    async def list_container_stats(
        self, request: cri.ListContainerStatsRequest, context: Context
    ) -> cri.ListContainerStatsResponse:
        return cri.ListContainerStatsResponse(stats=await self._stats(request.filter))

    async def stream_container_stats(
        self, request: cri.StreamContainerStatsRequest, context: Context
    ) -> AsyncIterator[cri.StreamContainerStatsResponse]:
        yield cri.StreamContainerStatsResponse(container_stats=await self._stats(request.filter))

    async def pod_sandbox_stats(
        self, request: cri.PodSandboxStatsRequest, context: Context
    ) -> cri.PodSandboxStatsResponse:
        pod = self._pods.get(plausible_id(request.pod_sandbox_id, "pod_sandbox_id"))
        return cri.PodSandboxStatsResponse(stats=pod_stats_message(await self._containers.pod_usage(pod)))

    async def _pod_stats(self, request_filter: cri.PodSandboxStatsFilter | None) -> list[cri.PodSandboxStats]:
        selector = labels(request_filter.label_selector, "filter.label_selector") if request_filter else {}
        pods = [pod for pod in self._pods.all() if _selected(pod, request_filter, selector)]
        return [pod_stats_message(await self._containers.pod_usage(pod, of_many=True)) for pod in pods]

    async def list_pod_sandbox_stats(
        self, request: cri.ListPodSandboxStatsRequest, context: Context
    ) -> cri.ListPodSandboxStatsResponse:
        return cri.ListPodSandboxStatsResponse(stats=await self._pod_stats(request.filter))

    async def stream_pod_sandbox_stats(
        self, request: cri.StreamPodSandboxStatsRequest, context: Context
    ) -> AsyncIterator[cri.StreamPodSandboxStatsResponse]:
        yield cri.StreamPodSandboxStatsResponse(pod_sandbox_stats=await self._pod_stats(request.filter))

    # -- events ------------------------------------------------------------------------------

    def _event_message(self, event: ContainerEvent) -> cri.ContainerEventResponse:
        pod = self._pods.find(event.pod_id)
        return cri.ContainerEventResponse(
            container_id=event.container_id,
            container_event_type=EVENT_TYPES[event.type],
            created_at=event.created_ns,
            pod_sandbox_status=self._pod_status(pod) if pod is not None and self._pod_status else None,
            containers_statuses=self.container_statuses(event.pod_id),
        )

    async def get_container_events(
        self, request: cri.GetEventsRequest, context: Context
    ) -> AsyncIterator[cri.ContainerEventResponse]:
        async for event in self._containers.events.subscribe():
            yield self._event_message(event)
