"""Building the CRI from the daemon's configuration and the subsystems it drives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from auraed.cni.cni import Cni
from auraed.cni.model import CniSettings, parse_bin_dirs
from auraed.config import DaemonConfig
from auraed.containers.containers import Containers
from auraed.cri.cell import CellSandbox
from auraed.cri.container_host import ContainerHost, LocalHost
from auraed.cri.container_rpcs import ContainerRpcs
from auraed.cri.containers import CriContainers
from auraed.cri.guest_containers import GuestContainers
from auraed.cri.images import FS_USAGE_TTL, ImageServicer
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.info import InfoRpcs
from auraed.cri.metric_rpcs import MetricRpcs
from auraed.cri.metrics import PodMetricsSource
from auraed.cri.model import PodSpec
from auraed.cri.pod_rpcs import PodRpcs, status_message
from auraed.cri.pod_share import PodShares
from auraed.cri.pods import Pods
from auraed.cri.runtime import SERVICE_NAME as RUNTIME_SERVICE
from auraed.cri.runtime import RuntimeServicer
from auraed.cri.sandbox import HandlerFeatures, SandboxController
from auraed.cri.sessions import CriSessions
from auraed.cri.streaming.config import StreamingConfig
from auraed.cri.streaming.server import StreamingServer
from auraed.cri.streaming_rpcs import StreamingRpcs
from auraed.cri.unserved import Unserved
from auraed.cri.vm import VmSandbox, VmSizing, host_namespaces_asked, pod_vm_name, vm_name
from auraed.cri.vm_template import PodTemplate
from auraed.images.images import Images
from auraed.observe.logfile import LogWatch
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs
from auraed.system.fs_usage import FsUsageCache
from auraed.system.tasks import OwnThreads
from auraed.vms.guests import Guests
from auraed.vms.model import VmRecord

PODS_DIR = "pods"
"""Below the runtime dir: one directory per cell pod (its pins, files and /dev/shm)."""
POD_SHARES_DIR = "pod-shares"
"""Below the runtime dir: one directory per vm pod, shared with its guest (its volumes)."""
MAX_STUCK_FILE_READS = 64
"""CreateContainers whose files are still being read past their deadline (a hung filesystem)
before others are refused at once: each holds a thread that cannot be stopped."""
GUEST_CONTAINERS_DIR = "cri/guest-containers"
"""Below the state dir: one directory per container of a vm pod (its log, when the pod names no
log directory)."""


@dataclasses.dataclass
class Cri:
    """The CRI's servicers by service name, for the server to serve on the kubelet's socket."""

    servicers: dict[str, object]
    cni: Cni
    pods: Pods
    containers: CriContainers
    streaming: StreamingServer
    template: PodTemplate | None = None  # vm pods' guest template, kept ready

    async def close(self) -> None:
        """Let runs in flight finish; pods keep running across a restart of auraed, so nothing
        is stopped but the streaming sessions (their exec'd processes are killed) and the making
        of vm pods' template."""
        if self.template is not None:
            await self.template.close()
        await self.streaming.close()
        await self.pods.close()
        await self.containers.close()


def default_handler(setting: str, guests: Guests | None) -> Callable[[PodSpec], str]:
    """The handler of a pod that names none: the setting's, or with ``auto`` a guest unless the
    pod asks for a host namespace (system pods: kube-proxy, a CNI daemon), which runs as a cell,
    as does every pod on a node with no guest image to boot."""
    if setting == "auto":

        def choose(spec: PodSpec) -> str:
            if host_namespaces_asked(spec) or guests is None or not guests.has_image():
                return "cell"
            return "vm"

        return choose
    return lambda spec: setting


def _guest_ended(pods: Pods, vm: VmRecord) -> None:
    for pod in pods.all():
        if pod.handler == "vm" and vm_name(pod) == vm.name:
            pods.sandbox_lost(pod, f"its guest VM {vm.name} is {vm.state_with_reason()}")


def streaming_config(config: DaemonConfig) -> StreamingConfig:
    return StreamingConfig(bind_address=config.cri_streaming_address, port=config.cri_streaming_port)


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
    guests: Guests | None = None,
    log_watch: LogWatch | None = None,
) -> Cri:
    """The CRI with its pods and containers recovered: what a crash left half made is undone
    first. Without ``guests`` there is no ``vm`` handler."""
    cni = Cni(store, cni_settings(config))
    cell_features = HandlerFeatures(
        recursive_read_only_mounts=await containers.makes_recursive_read_only(), user_namespaces=True
    )
    cell = CellSandbox(
        cni, cgroups, config.runtime_dir / PODS_DIR, pod_init=config.pod_init, features=cell_features
    )
    controllers: dict[str, SandboxController] = {"cell": cell}
    hosts: dict[str, ContainerHost] = {"cell": LocalHost(containers, cgroups)}
    template = None
    if guests is not None:
        sizing = VmSizing(
            vcpus=config.cri_vm_vcpus,
            memory_mib=config.cri_vm_memory_mib,
            vmm_overhead_mib=config.cri_vm_vmm_overhead_mib,
            machine=config.cri_vm_machine,
        )
        shares = PodShares(config.runtime_dir / POD_SHARES_DIR)
        vm = VmSandbox(cell, cni, guests, sizing, shares, from_template=config.cri_vm_boot == "template")
        controllers["vm"] = vm
        template = PodTemplate(guests, vm.template_spec, log_watch)
        root = config.state_dir / GUEST_CONTAINERS_DIR
        hosts["vm"] = GuestContainers(store, guests, images, root, vm_of=pod_vm_name, shares=shares)
    pods = Pods(store, controllers, default_handler(config.cri_default_handler, guests))
    if guests is not None:
        guests.vms.when_ended(lambda vm: _guest_ended(pods, vm))
    pod_containers = CriContainers(store, pods, hosts, cgroups)
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
    fs_usage = FsUsageCache(config.state_dir / "images", FS_USAGE_TTL)
    container_rpcs = ContainerRpcs(
        pod_containers,
        pods,
        status_message,
        files=OwnThreads(config.cri_file_timeout, MAX_STUCK_FILE_READS),
        profile_max_bytes=config.cri_profile_max_kib * 1024,
    )
    pod_rpcs = PodRpcs(pods, container_rpcs.container_statuses)
    metric_rpcs = MetricRpcs(PodMetricsSource(pods, pod_containers, cgroups))
    sessions = CriSessions(pod_containers, pods, log_watch)
    streaming = StreamingServer(sessions, streaming_config(config))
    await streaming.start()
    if template is not None:
        template.start()  # in the background: the node's first pod should not pay its boot
    return Cri(
        servicers={
            IMAGE_SERVICE: ImageServicer(images, fs_usage),
            RUNTIME_SERVICE: RuntimeServicer(
                info,
                pod_rpcs,
                container_rpcs,
                metric_rpcs,
                StreamingRpcs(streaming, sessions, pods),
                Unserved(),
            ),
        },
        cni=cni,
        pods=pods,
        containers=pod_containers,
        streaming=streaming,
        template=template,
    )
