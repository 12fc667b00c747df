"""Typed, validated values for pod networking: the settings, and what a pod asks of CNI."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

from auraed.cni.errors import CniError

DEFAULT_CONF_DIR = Path("/etc/cni/net.d")
DEFAULT_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
"""Debian's containernetworking-plugins install to /usr/lib/cni; upstream's tarball and most
distributions' to /opt/cni/bin."""
DEFAULT_PLUGIN_TIMEOUT = 60.0
"""Seconds one plugin invocation may take (host-local and portmap take milliseconds; a dhcp
plugin waiting for a lease takes seconds)."""
DEFAULT_IFNAME = "eth0"

MAX_PORT = 65535
PROTOCOLS = ("tcp", "udp", "sctp")
IFNAMSIZ = 15

# libcni's utils.ValidateContainerID: the id also names host-local's allocation files.
_CONTAINER_ID = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$")


@dataclasses.dataclass(frozen=True)
class CniSettings:
    """Where networks and plugins are, and how long a plugin may take (see the defaults)."""

    conf_dir: Path = DEFAULT_CONF_DIR
    bin_dirs: tuple[Path, ...] = DEFAULT_BIN_DIRS
    plugin_timeout: float = DEFAULT_PLUGIN_TIMEOUT


def parse_bin_dirs(text: str) -> tuple[Path, ...]:
    """Bin dirs written as PATH is (``/usr/lib/cni:/opt/cni/bin``), as a setting holds them."""
    dirs = tuple(Path(part) for part in text.split(":") if part)
    if not dirs or not all(d.is_absolute() for d in dirs):
        raise CniError.invalid("cni_bin_dirs", f"{text!r} must be absolute directories separated by ':'")
    return dirs


def check_ifname(name: str, field: str = "ifname") -> None:
    """libcni's ValidateInterfaceName: what the kernel takes as a link name."""
    if not name or len(name) > IFNAMSIZ:
        raise CniError.invalid(field, f"{name!r} must be 1 to {IFNAMSIZ} characters")
    if name in (".", "..") or any(c in name for c in "/:") or any(c.isspace() for c in name):
        raise CniError.invalid(field, f"{name!r} is not a valid interface name")


def _check_arg(field: str, value: str) -> None:
    # CNI_ARGS is "K=V;K=V": a value with either separator would forge another argument.
    if any(c in value for c in ";=") or not value.isprintable():
        raise CniError.invalid(field, f"{value!r} must not contain ';', '=' or control characters")


def _check_ip(field: str, text: str) -> None:
    if text:
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise CniError.invalid(field, f"{text!r} is not an IP address") from None


@dataclasses.dataclass(frozen=True)
class PortMapping:
    """A hostPort: ``host_ip:host_port`` on the host forwarded to ``container_port`` in the pod
    (the portmap plugin's ``portMappings`` capability). An empty ``host_ip`` means every host
    address."""

    host_port: int
    container_port: int
    protocol: str = "tcp"
    host_ip: str = ""

    def __post_init__(self) -> None:
        for name in ("host_port", "container_port"):
            if not 1 <= getattr(self, name) <= MAX_PORT:
                raise CniError.invalid(f"port_mappings.{name}", f"must be 1 to {MAX_PORT}")
        if self.protocol not in PROTOCOLS:
            raise CniError.invalid("port_mappings.protocol", f"{self.protocol!r} is not one of {PROTOCOLS}")
        _check_ip("port_mappings.host_ip", self.host_ip)

    def to_capability(self) -> dict[str, Any]:
        mapping: dict[str, Any] = {
            "hostPort": self.host_port,
            "containerPort": self.container_port,
            "protocol": self.protocol,
        }
        if self.host_ip:
            mapping["hostIP"] = self.host_ip
        return mapping


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """Traffic shaping for the bandwidth plugin: rates in bits per second, bursts in bits;
    0 leaves a direction unshaped."""

    ingress_rate: int = 0
    ingress_burst: int = 0
    egress_rate: int = 0
    egress_burst: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise CniError.invalid(f"bandwidth.{field.name}", "must not be negative")

    def to_capability(self) -> dict[str, Any]:
        return {
            "ingressRate": self.ingress_rate,
            "ingressBurst": self.ingress_burst,
            "egressRate": self.egress_rate,
            "egressBurst": self.egress_burst,
        }


@dataclasses.dataclass(frozen=True)
class IpRange:
    """One range for host-local's ``ipRanges`` capability (a pod CIDR given at run time)."""

    subnet: str
    range_start: str = ""
    range_end: str = ""
    gateway: str = ""

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_network(self.subnet, strict=False)
        except ValueError:
            raise CniError.invalid("ip_ranges.subnet", f"{self.subnet!r} is not a network") from None
        for name in ("range_start", "range_end", "gateway"):
            _check_ip(f"ip_ranges.{name}", getattr(self, name))

    def to_capability(self) -> dict[str, Any]:
        keys = {
            "subnet": self.subnet,
            "rangeStart": self.range_start,
            "rangeEnd": self.range_end,
            "gateway": self.gateway,
        }
        return {key: value for key, value in keys.items() if value}


@dataclasses.dataclass(frozen=True)
class PodNetwork:
    """What one pod sandbox asks of the network: its id (CNI_CONTAINERID), its network namespace
    (CNI_NETNS), the interface to make there, the Kubernetes names plugins may read from
    CNI_ARGS, and the capability arguments."""

    sandbox_id: str
    netns: str
    ifname: str = DEFAULT_IFNAME
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    port_mappings: tuple[PortMapping, ...] = ()
    bandwidth: Bandwidth | None = None
    ip_ranges: tuple[tuple[IpRange, ...], ...] = ()

    def __post_init__(self) -> None:
        if not _CONTAINER_ID.match(self.sandbox_id):
            raise CniError.invalid(
                "sandbox_id", f"{self.sandbox_id!r} must be letters, digits, '_', '.' and '-' (not first)"
            )
        if not self.netns.startswith("/"):
            raise CniError.invalid("netns", f"{self.netns!r} must be an absolute path")
        check_ifname(self.ifname)
        for name in ("pod_name", "pod_namespace", "pod_uid"):
            _check_arg(name, getattr(self, name))

    def cni_args(self) -> tuple[tuple[str, str], ...]:
        """CNI_ARGS as containerd sends them: IgnoreUnknown=1 first, so that a plugin that does
        not know the Kubernetes keys takes them anyway."""
        return (
            ("IgnoreUnknown", "1"),
            ("K8S_POD_NAMESPACE", self.pod_namespace),
            ("K8S_POD_NAME", self.pod_name),
            ("K8S_POD_INFRA_CONTAINER_ID", self.sandbox_id),
            ("K8S_POD_UID", self.pod_uid),
        )

    def capability_args(self) -> dict[str, Any]:
        """The runtime's capability arguments; each plugin gets only those it declares."""
        args: dict[str, Any] = {}
        if self.port_mappings:
            args["portMappings"] = [mapping.to_capability() for mapping in self.port_mappings]
        if self.bandwidth is not None:
            args["bandwidth"] = self.bandwidth.to_capability()
        if self.ip_ranges:
            args["ipRanges"] = [[r.to_capability() for r in ranges] for ranges in self.ip_ranges]
        return args
