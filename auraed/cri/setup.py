"""Building the CRI from the daemon's configuration and the subsystems it drives."""

from __future__ import annotations

import dataclasses

from auraed.config import DaemonConfig
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.images import FsUsageCache, ImageServicer
from auraed.images.images import Images


@dataclasses.dataclass
class Cri:
    """The CRI's servicers by service name, for the server to serve on the kubelet's socket."""

    servicers: dict[str, object]

    async def close(self) -> None:
        pass


def build(config: DaemonConfig, images: Images) -> Cri:
    fs_usage = FsUsageCache(config.state_dir / "images")
    return Cri(servicers={IMAGE_SERVICE: ImageServicer(images, fs_usage)})
