"""The pod RPCs of runtime.v1.RuntimeService: RunPodSandbox, StopPodSandbox, RemovePodSandbox,
PodSandboxStatus, ListPodSandbox and StreamPodSandboxes, over the pods domain.

Requests are validated into a PodSpec (auraed.cri.model) at the edge; what a pod is made of is
its handler's business (auraed.cri.sandbox), so nothing here depends on the handler.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from auraed.api.runtime import v1 as cri
from auraed.cri.errors import CriError
from auraed.cri.model import MAX_NAME, PodRecord, PodResources, PodState, labels, pod_spec, resources
from auraed.cri.pods import Pods
from auraed.wire.handlers import Context

ContainerStatuses = Callable[[str], list[cri.ContainerStatus]]
"""The statuses of a pod's containers, by the pod's id (the container RPCs report them)."""

STATES = {
    PodState.READY: cri.PodSandboxState.SANDBOX_READY,
    PodState.NOT_READY: cri.PodSandboxState.SANDBOX_NOTREADY,
}


def _pod_id(value: str) -> str:
    if len(value) > MAX_NAME or "\0" in value:
        raise CriError.invalid("pod_sandbox_id", "is not a plausible pod sandbox id")
    return value


def _metadata(pod: PodRecord) -> cri.PodSandboxMetadata:
    meta = pod.spec.metadata
    return cri.PodSandboxMetadata(
        name=meta.name, uid=meta.uid, namespace=meta.namespace, attempt=meta.attempt
    )


def _namespace_options(pod: PodRecord) -> cri.NamespaceOption:
    spec = pod.spec
    node, shared, own = cri.NamespaceMode.NODE, cri.NamespaceMode.POD, cri.NamespaceMode.CONTAINER
    pid = node if spec.host_pid else shared if spec.shared_pid else own
    userns = spec.userns
    return cri.NamespaceOption(
        network=node if spec.host_network else shared,
        pid=pid,
        ipc=node if spec.host_ipc else shared,
        userns_options=None
        if userns is None
        else cri.UserNamespace(
            mode=shared,
            uids=[cri.IdMapping(host_id=userns.uid, container_id=0, length=userns.uid_length)],
            gids=[cri.IdMapping(host_id=userns.gid, container_id=0, length=userns.gid_length)],
        ),
    )


def _listed(pod: PodRecord) -> cri.PodSandbox:
    return cri.PodSandbox(
        id=pod.id,
        metadata=_metadata(pod),
        state=STATES[pod.state],
        created_at=pod.created_at,
        labels=dict(pod.spec.labels),
        annotations=dict(pod.spec.annotations),
        runtime_handler=pod.handler,
    )


def status_message(pod: PodRecord) -> cri.PodSandboxStatus:
    """A pod's PodSandboxStatus (its containers' events carry it too)."""
    return cri.PodSandboxStatus(
        id=pod.id,
        metadata=_metadata(pod),
        state=STATES[pod.state],
        created_at=pod.created_at,
        network=cri.PodSandboxNetworkStatus(
            ip=pod.ip, additional_ips=[cri.PodIp(ip=ip) for ip in pod.additional_ips]
        ),
        linux=cri.LinuxPodSandboxStatus(namespaces=cri.Namespace(options=_namespace_options(pod))),
        labels=dict(pod.spec.labels),
        annotations=dict(pod.spec.annotations),
        runtime_handler=pod.handler,
    )


def _container_resources(value: PodResources) -> dict[str, Any]:
    """A ContainerResources message as containerd's verbose info has it (Go's JSON of it)."""
    return {
        "linux": {
            "cpu_period": value.cpu_period,
            "cpu_quota": value.cpu_quota,
            "cpu_shares": value.cpu_shares,
            "memory_limit_in_bytes": value.memory_limit,
        }
    }


def _verbose_info(pod: PodRecord) -> dict[str, str]:
    """PodSandboxStatus's verbose ``info``: the pod as this runtime holds it, as JSON under
    "info" (containerd's key), for crictl inspectp and for operators; with the pod's overhead and
    resources as applied (UpdatePodSandboxResources changes them) where containerd has them."""
    return {
        "info": json.dumps(
            {
                "id": pod.id,
                "runtimeHandler": pod.handler,
                "state": pod.state.value,
                "createdAt": pod.created_at,
                "ips": [ip for ip in (pod.ip, *pod.additional_ips) if ip],
                "config": pod.spec.to_doc(),
                "sandbox": pod.sandbox,
                "overhead": _container_resources(pod.spec.overhead),
                "resources": _container_resources(pod.spec.resources),
            }
        )
    }


def _matches(
    pod: PodRecord, request_filter: cri.PodSandboxFilter | None, selector: Mapping[str, str]
) -> bool:
    if request_filter is None:
        return True
    if request_filter.id and not pod.id.startswith(request_filter.id):
        return False
    if request_filter.state is not None and STATES[pod.state] != request_filter.state.state:
        return False
    return all(pod.spec.labels.get(key) == value for key, value in selector.items())


class PodRpcs:
    """RunPodSandbox, StopPodSandbox, RemovePodSandbox, PodSandboxStatus, ListPodSandbox and
    StreamPodSandboxes."""

    def __init__(self, pods: Pods, container_statuses: ContainerStatuses) -> None:
        self._pods = pods
        self._container_statuses = container_statuses

    async def run_pod_sandbox(
        self, request: cri.RunPodSandboxRequest, context: Context
    ) -> cri.RunPodSandboxResponse:
        pod = await self._pods.run(pod_spec(request.config, request.runtime_handler))
        return cri.RunPodSandboxResponse(pod_sandbox_id=pod.id)

    async def stop_pod_sandbox(
        self, request: cri.StopPodSandboxRequest, context: Context
    ) -> cri.StopPodSandboxResponse:
        await self._pods.stop(_pod_id(request.pod_sandbox_id))
        return cri.StopPodSandboxResponse()

    async def remove_pod_sandbox(
        self, request: cri.RemovePodSandboxRequest, context: Context
    ) -> cri.RemovePodSandboxResponse:
        await self._pods.remove(_pod_id(request.pod_sandbox_id))
        return cri.RemovePodSandboxResponse()

    async def pod_sandbox_status(
        self, request: cri.PodSandboxStatusRequest, context: Context
    ) -> cri.PodSandboxStatusResponse:
        pod = self._pods.get(_pod_id(request.pod_sandbox_id))
        # A kubelet with the Evented PLEG takes the containers from here whenever the timestamp
        # is set (as CRI-O sets both with its pod events): never one without the other.
        timestamp = time.time_ns()
        return cri.PodSandboxStatusResponse(
            status=status_message(pod),
            info=_verbose_info(pod) if request.verbose else {},
            containers_statuses=self._container_statuses(pod.id),
            timestamp=timestamp,
        )

    async def update_pod_sandbox_resources(
        self, request: cri.UpdatePodSandboxResourcesRequest, context: Context
    ) -> cri.UpdatePodSandboxResourcesResponse:
        overhead = resources(request.overhead, "overhead")
        limits = resources(request.resources, "resources")
        await self._pods.update_resources(_pod_id(request.pod_sandbox_id), overhead, limits)
        return cri.UpdatePodSandboxResourcesResponse()

    def _listed(self, request_filter: cri.PodSandboxFilter | None) -> list[cri.PodSandbox]:
        selector: Mapping[str, str] = {}
        if request_filter is not None:
            _pod_id(request_filter.id)
            selector = labels(request_filter.label_selector, "filter.label_selector")
        return [_listed(pod) for pod in self._pods.all() if _matches(pod, request_filter, selector)]

    async def list_pod_sandbox(
        self, request: cri.ListPodSandboxRequest, context: Context
    ) -> cri.ListPodSandboxResponse:
        return cri.ListPodSandboxResponse(items=self._listed(request.filter))

    async def stream_pod_sandboxes(
        self, request: cri.StreamPodSandboxesRequest, context: Context
    ) -> AsyncIterator[cri.StreamPodSandboxesResponse]:
        yield cri.StreamPodSandboxesResponse(pod_sandboxes=self._listed(request.filter))
