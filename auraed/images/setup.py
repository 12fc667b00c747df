"""Building the image subsystem from the daemon's configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from auraed.config import DaemonConfig
from auraed.images.content import LocalStore
from auraed.images.images import Images
from auraed.metrics.sink import NO_METRICS, MetricsSink
from auraed.state.store import Store

if TYPE_CHECKING:
    from auraed.images.registry import RegistryClient


def registry_factory(config: DaemonConfig) -> Callable[[], RegistryClient]:
    """The registry client, made on first use: the HTTP stack costs ~5 MiB and ~1 s under
    emulation, and guests never pull."""

    def make() -> RegistryClient:
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


def build(config: DaemonConfig, store: Store, metrics: MetricsSink = NO_METRICS) -> Images:
    """Images over the local store under ``state_dir/images`` (its blobs and its layer snapshots)."""
    local = LocalStore(config.state_dir / "images", sync_fs=config.image_sync_fs)
    return Images(
        store,
        local,
        local,
        registry_factory(config),
        allow_device_nodes=config.allow_device_nodes,
        metrics=metrics,
    )
