"""Building the CRI from the daemon's configuration and the subsystems it drives."""

from __future__ import annotations

import dataclasses

import grpc

from auraed.config import DaemonConfig
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.images import FsUsageCache, ImageServicer
from auraed.images.images import Images
from auraed.server.rpc import generic_handler


@dataclasses.dataclass
class Cri:
    """The CRI's services, ready to serve on the kubelet's socket."""

    handlers: list[grpc.GenericRpcHandler]

    async def close(self) -> None:
        pass


def build(config: DaemonConfig, images: Images) -> Cri:
    fs_usage = FsUsageCache(config.state_dir / "images")
    return Cri(handlers=[generic_handler(IMAGE_SERVICE, ImageServicer(images, fs_usage))])
