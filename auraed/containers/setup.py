"""Building the image and container subsystems from the daemon's configuration."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from auraed.config import DaemonConfig
from auraed.containers.containers import Containers
from auraed.containers.oci_cli import runtime_for
from auraed.images.content import ContentStore
from auraed.images.images import Images
from auraed.observe.logfile import LogWatch
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs, CgroupLayout
from auraed.system.supervisor import Supervisor

log = logging.getLogger(__name__)


def runtime_binary(config: DaemonConfig, layout: CgroupLayout) -> str:
    """The configured runtime, else the one that works on this cgroup layout (crun refuses v1/hybrid)."""
    name = config.oci_runtime or ("crun" if layout is CgroupLayout.V2 else "runc")
    found = shutil.which(name)
    if found is None:
        log.warning("OCI runtime %s not found: containers cannot be created until it is installed", name)
        return name
    return found


def registry_factory(config: DaemonConfig) -> object:
    def make() -> object:
        from auraed.images.registry import RegistryClient, RegistryHostConfig

        hosts = [
            RegistryHostConfig(
                host,
                mirrors=settings.mirrors,
                insecure=settings.insecure,
                skip_verify=settings.skip_verify,
                ca_file=Path(settings.ca_file) if settings.ca_file else None,
            )
            for host, settings in config.registries.items()
        ]
        return RegistryClient(hosts, docker_config=config.docker_config)

    return make


def build(
    config: DaemonConfig, store: Store, cgroups: Cgroupfs, supervisor: Supervisor, log_watch: LogWatch
) -> tuple[Images, Containers]:
    images = Images(
        store,
        ContentStore(config.state_dir / "images", sync_fs=config.image_sync_fs),
        registry_factory(config),  # type: ignore[arg-type]
        allow_device_nodes=config.allow_device_nodes,
    )
    runtime = runtime_for(
        runtime_binary(config, cgroups.layout),
        config.runtime_dir / "runtime",
        scratch_dir=config.runtime_dir / "exec",
    )
    containers = Containers(
        store,
        images,
        cgroups,
        runtime,
        supervisor,
        root=config.state_dir / "containers",
        sockets_dir=config.runtime_dir / "consoles",
        default_stop_timeout=config.stop_grace_period,
        log_watch=log_watch,
    )
    return images, containers
