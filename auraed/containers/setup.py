"""Building the container subsystem from the daemon's configuration, over the daemon's images."""

from __future__ import annotations

import logging
import shutil

from auraed.config import DaemonConfig
from auraed.containers.containers import Containers
from auraed.containers.oci_cli import runtime_for
from auraed.containers.pid_groups import PidGroups
from auraed.containers.rootfs import OverlaySnapshotter
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


def build(
    config: DaemonConfig,
    store: Store,
    images: Images,
    *,
    cgroups: Cgroupfs,
    supervisor: Supervisor,
    log_watch: LogWatch,
    machine_sysctls: bool = False,
) -> Containers:
    runtime = runtime_for(
        runtime_binary(config, cgroups.layout),
        config.runtime_dir / "runtime",
        scratch_dir=config.runtime_dir / "exec",
    )
    return Containers(
        store,
        images,
        snapshotter=OverlaySnapshotter(images.snapshots),
        cgroups=cgroups,
        runtime=runtime,
        supervisor=supervisor,
        root=config.state_dir / "containers",
        sockets_dir=config.runtime_dir / "consoles",
        pid_groups=PidGroups(config.runtime_dir / "pid-groups", config.pod_init),
        userns_rootfs_dir=config.userns_rootfs_dir,
        machine_sysctls=machine_sysctls,
        default_stop_timeout=config.stop_grace_period,
        log_watch=log_watch,
    )
