"""The runtime's own RPCs: Version, Status, RuntimeConfig and UpdateRuntimeConfig.

Status tells a kubelet whether pods can run (RuntimeReady: the OCI runtime is installed) and get
a network (NetworkReady: a valid CNI network whose plugins are all present), each false with a
reason when not, and lists the runtime handlers. The default handler is listed under the empty
name too, as kubelets and critest look features up by the handler a pod names ("" when none).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Sequence

import auraed
from auraed.api.runtime import v1 as cri
from auraed.cni.cni import NetworkStatus
from auraed.cri.errors import CriError
from auraed.cri.sandbox import HandlerFeatures
from auraed.wire.handlers import Context

log = logging.getLogger(__name__)

RUNTIME_NAME = "auraed"
RUNTIME_API_VERSION = "v1"
MAX_POD_CIDR = 256


def _handler(name: str, features: HandlerFeatures) -> cri.RuntimeHandler:
    return cri.RuntimeHandler(
        name=name,
        features=cri.RuntimeHandlerFeatures(
            recursive_read_only_mounts=features.recursive_read_only_mounts,
            user_namespaces=features.user_namespaces,
        ),
    )


class InfoRpcs:
    """Version, Status, RuntimeConfig and UpdateRuntimeConfig of runtime.v1.RuntimeService."""

    def __init__(
        self,
        oci_runtime: str,
        network_status: Callable[[], NetworkStatus],
        handlers: Callable[[], Sequence[tuple[str, HandlerFeatures]]],
        default_handler: str,
    ) -> None:
        self._oci_runtime = oci_runtime
        self._network_status = network_status
        self._handlers = handlers
        self._default_handler = default_handler
        self.pod_cidr = ""  # as the kubelet last pushed it; informational (CNI configs own addresses)

    async def version(self, request: cri.VersionRequest, context: Context) -> cri.VersionResponse:
        return cri.VersionResponse(
            version="0.1.0",  # the version of the kubelet's runtime API this answers (the CRI's own)
            runtime_name=RUNTIME_NAME,
            runtime_version=auraed.__version__,
            runtime_api_version=RUNTIME_API_VERSION,
        )

    def _runtime_condition(self) -> cri.RuntimeCondition:
        if shutil.which(self._oci_runtime) is None:
            return cri.RuntimeCondition(
                type="RuntimeReady",
                status=False,
                reason="OciRuntimeNotFound",
                message=f"the OCI runtime {self._oci_runtime} is not installed",
            )
        return cri.RuntimeCondition(type="RuntimeReady", status=True)

    def _network_condition(self) -> cri.RuntimeCondition:
        network = self._network_status()
        return cri.RuntimeCondition(
            type="NetworkReady", status=network.ready, reason=network.reason, message=network.message
        )

    async def status(self, request: cri.StatusRequest, context: Context) -> cri.StatusResponse:
        handlers = list(self._handlers())
        listed = [_handler(name, features) for name, features in handlers]
        default = _default_features(dict(handlers), self._default_handler)
        if default is not None:
            listed.insert(0, _handler("", default))
        info = {}
        if request.verbose:
            info["config"] = json.dumps(
                {"defaultRuntimeHandler": self._default_handler, "ociRuntime": self._oci_runtime}
            )
        return cri.StatusResponse(
            status=cri.RuntimeStatus(conditions=[self._runtime_condition(), self._network_condition()]),
            info=info,
            runtime_handlers=listed,
            # Both handlers build the process's groups themselves (auraed.cri.security).
            features=cri.RuntimeFeatures(supplemental_groups_policy=True),
        )

    async def runtime_config(
        self, request: cri.RuntimeConfigRequest, context: Context
    ) -> cri.RuntimeConfigResponse:
        return cri.RuntimeConfigResponse(
            linux=cri.LinuxRuntimeConfiguration(cgroup_driver=cri.CgroupDriver.CGROUPFS)
        )

    async def update_runtime_config(
        self, request: cri.UpdateRuntimeConfigRequest, context: Context
    ) -> cri.UpdateRuntimeConfigResponse:
        network = request.runtime_config.network_config if request.runtime_config else None
        cidr = network.pod_cidr if network else ""
        if len(cidr) > MAX_POD_CIDR or "\0" in cidr:
            raise CriError.invalid("runtime_config.network_config.pod_cidr", "is not a plausible CIDR")
        if cidr:
            import ipaddress

            for part in cidr.split(","):
                try:
                    ipaddress.ip_network(part.strip(), strict=False)
                except ValueError:
                    raise CriError.invalid(
                        "runtime_config.network_config.pod_cidr", f"{part.strip()[:60]!r} is not a CIDR"
                    ) from None
            if cidr != self.pod_cidr:
                log.info("the kubelet set the pod CIDR to %s", cidr)
        self.pod_cidr = cidr
        return cri.UpdateRuntimeConfigResponse()


def _default_features(handlers: dict[str, HandlerFeatures], default: str) -> HandlerFeatures | None:
    """The features of the handler a pod naming none gets; with ``auto`` (a vm or a cell, by
    the pod) only what both offer."""
    if default != "auto":
        return handlers.get(default)
    chosen = [features for name, features in handlers.items() if name in ("cell", "vm")]
    if not chosen:
        return None
    return HandlerFeatures(
        **{
            field.name: all(getattr(features, field.name) for features in chosen)
            for field in dataclasses.fields(HandlerFeatures)
        }
    )
