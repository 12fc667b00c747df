"""Building the CRI from the daemon's configuration and the subsystems it drives."""

from __future__ import annotations

import dataclasses

from auraed.cni.cni import Cni
from auraed.cni.model import CniSettings, parse_bin_dirs
from auraed.config import DaemonConfig
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.images import FsUsageCache, ImageServicer
from auraed.cri.info import InfoRpcs
from auraed.cri.runtime import SERVICE_NAME as RUNTIME_SERVICE
from auraed.cri.runtime import RuntimeServicer
from auraed.cri.sandbox import HandlerFeatures
from auraed.cri.unserved import Unserved
from auraed.images.images import Images
from auraed.state.store import Store


@dataclasses.dataclass
class Cri:
    """The CRI's servicers by service name, for the server to serve on the kubelet's socket."""

    servicers: dict[str, object]
    cni: Cni

    async def close(self) -> None:
        pass


def cni_settings(config: DaemonConfig) -> CniSettings:
    return CniSettings(
        conf_dir=config.cni_conf_dir,
        bin_dirs=parse_bin_dirs(config.cni_bin_dirs),
        plugin_timeout=config.cni_plugin_timeout,
    )


def build(config: DaemonConfig, store: Store, images: Images, oci_runtime: str) -> Cri:
    cni = Cni(store, cni_settings(config))
    handlers = [("cell", HandlerFeatures())]
    info = InfoRpcs(oci_runtime, cni.status, lambda: handlers, config.cri_default_handler)
    fs_usage = FsUsageCache(config.state_dir / "images")
    return Cri(
        servicers={
            IMAGE_SERVICE: ImageServicer(images, fs_usage),
            RUNTIME_SERVICE: RuntimeServicer(info, Unserved()),
        },
        cni=cni,
    )
