"""Building the CRI from the daemon's configuration and the subsystems it drives."""

from __future__ import annotations

import dataclasses

from auraed.cni.cni import Cni
from auraed.cni.model import CniSettings, parse_bin_dirs
from auraed.config import DaemonConfig
from auraed.containers.containers import Containers
from auraed.cri.cell import CellSandbox
from auraed.cri.container_rpcs import ContainerRpcs
from auraed.cri.containers import CriContainers
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.images import FsUsageCache, ImageServicer
from auraed.cri.info import InfoRpcs
from auraed.cri.metric_rpcs import MetricRpcs
from auraed.cri.metrics import PodMetricsSource
from auraed.cri.pod_rpcs import PodRpcs, status_message
from auraed.cri.pods import Pods
from auraed.cri.runtime import SERVICE_NAME as RUNTIME_SERVICE
from auraed.cri.runtime import RuntimeServicer
from auraed.cri.sandbox import SandboxController
from auraed.cri.unserved import Unserved
from auraed.images.images import Images
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs

PODS_DIR = "pods"
"""Below the runtime dir: one directory per cell pod (its pins, files and /dev/shm)."""


@dataclasses.dataclass
class Cri:
    """The CRI's servicers by service name, for the server to serve on the kubelet's socket."""

    servicers: dict[str, object]
    cni: Cni
    pods: Pods
    containers: CriContainers

    async def close(self) -> None:
        """Let runs in flight finish; pods keep running across a restart of auraed, so nothing
        is stopped."""
        await self.pods.close()
        await self.containers.close()


def cni_settings(config: DaemonConfig) -> CniSettings:
    return CniSettings(
        conf_dir=config.cni_conf_dir,
        bin_dirs=parse_bin_dirs(config.cni_bin_dirs),
        plugin_timeout=config.cni_plugin_timeout,
    )


async def build(
    config: DaemonConfig,
    store: Store,
    images: Images,
    cgroups: Cgroupfs,
    oci_runtime: str,
    *,
    containers: Containers,
) -> Cri:
    """The CRI with its pods and containers recovered: what a crash left half made is undone
    first."""
    cni = Cni(store, cni_settings(config))
    controllers: dict[str, SandboxController] = {
        "cell": CellSandbox(cni, cgroups, config.runtime_dir / PODS_DIR),
    }
    pods = Pods(store, controllers, lambda spec: config.cri_default_handler)
    pod_containers = CriContainers(store, pods, containers, cgroups)
    pods.containers = pod_containers
    # Containers first: a pod whose removal a crash interrupted removes its containers.
    await pod_containers.recover()
    await pods.recover()
    info = InfoRpcs(
        oci_runtime,
        cni.status,
        lambda: [(handler.name, handler.features) for handler in pods.handlers],
        config.cri_default_handler,
    )
    fs_usage = FsUsageCache(config.state_dir / "images")
    container_rpcs = ContainerRpcs(pod_containers, pods, status_message)
    pod_rpcs = PodRpcs(pods, container_rpcs.container_statuses)
    metric_rpcs = MetricRpcs(PodMetricsSource(pods, pod_containers, cgroups))
    return Cri(
        servicers={
            IMAGE_SERVICE: ImageServicer(images, fs_usage),
            RUNTIME_SERVICE: RuntimeServicer(info, pod_rpcs, container_rpcs, metric_rpcs, Unserved()),
        },
        cni=cni,
        pods=pods,
        containers=pod_containers,
    )
