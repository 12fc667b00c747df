"""Pods as the CRI describes them, validated at the edge into typed values, and their records.

A kubelet's RunPodSandboxRequest becomes a :class:`PodSpec` here, every field checked and named
when wrong; the sandbox controllers and the pod store never see a wire message. A
:class:`PodRecord` is what the state store keeps of a pod: its spec, its state, and what its
controller made for it (namespace pins, cgroup, network result), so a restarted daemon finds it.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from auraed.api.runtime import v1 as cri
from auraed.containers.request import MAX_CFS_QUOTA_US, MAX_ID, SpecError, check_int
from auraed.cri.errors import CriError
from auraed.errors import ErrorKind
from auraed.system.userns import IdMap

MAX_LABELS = 256
MAX_LABEL_KEY = 253
MAX_LABEL_VALUE = 64 * 1024  # annotations carry JSON (kubectl's last-applied); keep them bounded
MAX_NAME = 253
MAX_DNS_ENTRIES = 32
MAX_PORT_MAPPINGS = 1024
MAX_SYSCTLS = 256
_SYSCTL_NAME = re.compile(r"[a-z0-9_]+([./][a-z0-9_-]+)*")
# RFC 1123 hostname labels, the form a kubelet sends (the pod's name or its spec.hostname).
_HOSTNAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
CPU_PERIOD_US = (1_000, 1_000_000)
CPU_QUOTA_US = (1_000, MAX_CFS_QUOTA_US)
"""What the kernel takes as a CFS period and quota (µs): a container's bounds, and a pod's."""
PROTOCOLS = {cri.Protocol.TCP: "tcp", cri.Protocol.UDP: "udp", cri.Protocol.SCTP: "sctp"}


class PodState(enum.Enum):
    READY = "ready"
    NOT_READY = "not_ready"


@dataclasses.dataclass(frozen=True)
class PodMetadata:
    name: str
    uid: str
    namespace: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class PortMapping:
    protocol: str  # "tcp", "udp" or "sctp", as CNI's portMappings capability spells them
    container_port: int
    host_port: int
    host_ip: str


@dataclasses.dataclass(frozen=True)
class DnsConfig:
    servers: tuple[str, ...] = ()
    searches: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def resolv_conf(self) -> str:
        """/etc/resolv.conf as the pod's containers see it."""
        lines = [f"nameserver {server}" for server in self.servers]
        if self.searches:
            lines.append("search " + " ".join(self.searches))
        if self.options:
            lines.append("options " + " ".join(self.options))
        return "".join(f"{line}\n" for line in lines)


@dataclasses.dataclass(frozen=True)
class PodResources:
    """A pod's overhead plus its containers' limits, as the kubelet sums them (0: none)."""

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit: int = 0

    def updated(self, update: PodResources) -> PodResources:
        """These resources with what ``update`` sets: a 0 in it leaves the value as it is, as
        UpdateContainerResources takes a 0 (Kubernetes never removes a pod's limit by a resize)."""
        changed = {
            f.name: getattr(update, f.name) for f in dataclasses.fields(update) if getattr(update, f.name)
        }
        return dataclasses.replace(self, **changed)


@dataclasses.dataclass(frozen=True)
class PodSpec:
    metadata: PodMetadata
    hostname: str
    log_directory: str
    dns: DnsConfig
    port_mappings: tuple[PortMapping, ...]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    cgroup_parent: str
    host_network: bool
    host_pid: bool
    host_ipc: bool
    shared_pid: bool  # the pod's containers share one PID namespace (NamespaceMode POD)
    sysctls: Mapping[str, str]
    overhead: PodResources
    resources: PodResources
    privileged: bool
    runtime_handler: str
    userns: IdMap | None = None  # a user namespace of its own (hostUsers: false), else the host's

    def to_doc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> PodSpec:
        return cls(
            **{
                **doc,
                "metadata": PodMetadata(**doc["metadata"]),
                "dns": DnsConfig(**{k: tuple(v) for k, v in doc["dns"].items()}),
                "port_mappings": tuple(PortMapping(**p) for p in doc["port_mappings"]),
                "overhead": PodResources(**doc["overhead"]),
                "resources": PodResources(**doc["resources"]),
                "userns": IdMap(**doc["userns"]) if doc.get("userns") else None,
            }
        )


@dataclasses.dataclass
class PodRecord:
    """One pod as the state store keeps it. ``sandbox`` is its controller's own state."""

    id: str
    spec: PodSpec
    state: PodState
    created_at: int  # nanoseconds since the epoch, as the CRI reports it
    ip: str = ""
    additional_ips: tuple[str, ...] = ()
    sandbox: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def handler(self) -> str:
        return self.spec.runtime_handler

    def to_doc(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.to_doc(),
            "state": self.state.value,
            "created_at": self.created_at,
            "ip": self.ip,
            "additional_ips": list(self.additional_ips),
            "sandbox": self.sandbox,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> PodRecord:
        return cls(
            id=doc["id"],
            spec=PodSpec.from_doc(doc["spec"]),
            state=PodState(doc["state"]),
            created_at=doc["created_at"],
            ip=doc.get("ip", ""),
            additional_ips=tuple(doc.get("additional_ips", ())),
            sandbox=dict(doc.get("sandbox", {})),
        )


# -- validation ------------------------------------------------------------------------------


def _text(value: str, field: str, limit: int = MAX_NAME, required: bool = False) -> str:
    if required and not value:
        raise CriError.invalid(field, "is required")
    if len(value) > limit:
        raise CriError.invalid(field, f"is longer than {limit} characters")
    if "\0" in value or "\n" in value:
        raise CriError.invalid(field, "holds a NUL or newline character")
    return value


def labels(values: Mapping[str, str], field: str) -> dict[str, str]:
    """Labels or annotations: bounded in number and size (their content is the kubelet's)."""
    if len(values) > MAX_LABELS:
        raise CriError.invalid(field, f"more than {MAX_LABELS} entries")
    for key, value in values.items():
        if not key or len(key) > MAX_LABEL_KEY:
            raise CriError.invalid(field, f"key {key[:60]!r} is empty or longer than {MAX_LABEL_KEY}")
        if len(value) > MAX_LABEL_VALUE:
            raise CriError.invalid(f"{field}[{key[:60]}]", f"is longer than {MAX_LABEL_VALUE} bytes")
    return dict(values)


def pod_metadata(metadata: cri.PodSandboxMetadata | None) -> PodMetadata:
    if metadata is None:
        raise CriError.invalid("config.metadata", "is required")
    return PodMetadata(
        name=_text(metadata.name, "config.metadata.name", required=True),
        uid=_text(metadata.uid, "config.metadata.uid", required=True),
        namespace=_text(metadata.namespace, "config.metadata.namespace", required=True),
        attempt=metadata.attempt,
    )


def dns_config(dns: cri.DnsConfig | None) -> DnsConfig:
    if dns is None:
        return DnsConfig()
    for field, values in (("servers", dns.servers), ("searches", dns.searches), ("options", dns.options)):
        if len(values) > MAX_DNS_ENTRIES:
            raise CriError.invalid(f"config.dns_config.{field}", f"more than {MAX_DNS_ENTRIES} entries")
        for value in values:
            if not value or any(c.isspace() for c in value) or len(value) > MAX_NAME:
                raise CriError.invalid(
                    f"config.dns_config.{field}", f"{value[:60]!r} is not a plausible entry"
                )
    for server in dns.servers:
        try:
            ipaddress.ip_address(server)
        except ValueError:
            raise CriError.invalid(
                "config.dns_config.servers", f"{server[:60]!r} is not an IP address"
            ) from None
    return DnsConfig(tuple(dns.servers), tuple(dns.searches), tuple(dns.options))


def port_mappings(values: list[cri.PortMapping]) -> tuple[PortMapping, ...]:
    if len(values) > MAX_PORT_MAPPINGS:
        raise CriError.invalid("config.port_mappings", f"more than {MAX_PORT_MAPPINGS} entries")
    mappings = []
    for index, mapping in enumerate(values):
        field = f"config.port_mappings[{index}]"
        if not 0 < mapping.container_port <= 65535:
            raise CriError.invalid(
                f"{field}.container_port", f"{mapping.container_port} is out of range 1..65535"
            )
        if not 0 <= mapping.host_port <= 65535:
            raise CriError.invalid(f"{field}.host_port", f"{mapping.host_port} is out of range 0..65535")
        if mapping.host_ip:
            try:
                ipaddress.ip_address(mapping.host_ip)
            except ValueError:
                raise CriError.invalid(
                    f"{field}.host_ip", f"{mapping.host_ip[:60]!r} is not an IP address"
                ) from None
        protocol = PROTOCOLS.get(mapping.protocol)
        if protocol is None:
            raise CriError.invalid(f"{field}.protocol", f"{mapping.protocol} is not TCP, UDP or SCTP")
        mappings.append(PortMapping(protocol, mapping.container_port, mapping.host_port, mapping.host_ip))
    return tuple(mappings)


def sysctls(values: Mapping[str, str]) -> dict[str, str]:
    if len(values) > MAX_SYSCTLS:
        raise CriError.invalid("config.linux.sysctls", f"more than {MAX_SYSCTLS} entries")
    for name, value in values.items():
        if not _SYSCTL_NAME.fullmatch(name) or ".." in name:
            raise CriError.invalid("config.linux.sysctls", f"{name[:60]!r} is not a sysctl name")
        if not value or "\n" in value or "\0" in value or len(value) > 4096:
            raise CriError.invalid(f"config.linux.sysctls[{name}]", "is not a plausible value")
    return dict(values)


def resources(value: cri.LinuxContainerResources | None, field: str) -> PodResources:
    """A pod's overhead or resources: the CPU and memory limits a pod cgroup takes (the kubelet
    sends no others for a pod), each 0 when not set; a set CPU period or quota in the kernel's
    range, as a container's."""
    if value is None:
        return PodResources()
    for name in ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes"):
        if getattr(value, name) < 0:
            raise CriError.invalid(f"{field}.{name}", "is negative")
    try:
        for name, low, high in (("cpu_period", *CPU_PERIOD_US), ("cpu_quota", *CPU_QUOTA_US)):
            if getattr(value, name):
                check_int(getattr(value, name), f"{field}.{name}", low, high)
    except SpecError as exc:
        raise CriError(ErrorKind.INVALID_ARGUMENT, exc.message) from None
    return PodResources(value.cpu_period, value.cpu_quota, value.cpu_shares, value.memory_limit_in_bytes)


def _namespace_modes(context: cri.LinuxSandboxSecurityContext | None) -> tuple[bool, bool, bool, bool]:
    """(host network, host PID, host IPC, shared PID) from the pod's namespace options."""
    options = context.namespace_options if context is not None else None
    if options is None:  # every mode unset is POD, as the proto's zero values say
        return False, False, False, True
    node, pod, container = cri.NamespaceMode.NODE, cri.NamespaceMode.POD, cri.NamespaceMode.CONTAINER
    for name in ("network", "ipc"):
        if getattr(options, name) not in (pod, node):
            raise CriError.invalid(
                f"config.linux.security_context.namespace_options.{name}", "must be POD or NODE for a pod"
            )
    if options.pid not in (pod, node, container):
        raise CriError.invalid(
            "config.linux.security_context.namespace_options.pid", "must be POD, CONTAINER or NODE for a pod"
        )
    return options.network == node, options.pid == node, options.ipc == node, options.pid == pod


USERNS_FIELD = "config.linux.security_context.namespace_options.userns_options"


def user_namespace(context: cri.LinuxSandboxSecurityContext | None) -> IdMap | None:
    """The pod's user namespace (``hostUsers: false``), from its namespace options: None for the
    host's (NODE, or none asked); INVALID_ARGUMENT for what the kubelet never sends and
    containerd refuses: a mode other than POD or NODE, anything but one mapping of each kind
    starting at container id 0, a mapping of the host's root, a pod with a host namespace."""
    options = context.namespace_options if context is not None else None
    userns = options.userns_options if options is not None else None
    if userns is None or userns.mode == cri.NamespaceMode.NODE:
        return None
    if userns.mode != cri.NamespaceMode.POD:
        raise CriError.invalid(f"{USERNS_FIELD}.mode", f"must be POD or NODE, not {userns.mode.name}")
    assert options is not None
    hosts = [name for name in ("network", "pid", "ipc") if getattr(options, name) == cri.NamespaceMode.NODE]
    if hosts:
        raise CriError.invalid(
            USERNS_FIELD, f"a pod with a user namespace cannot share the host's {hosts[0]}"
        )
    uid, uid_length = _id_mapping(userns.uids, "uids")
    gid, gid_length = _id_mapping(userns.gids, "gids")
    return IdMap(uid, uid_length, gid, gid_length)


def _id_mapping(mappings: list[cri.IdMapping], kind: str) -> tuple[int, int]:
    where = f"{USERNS_FIELD}.{kind}"
    if len(mappings) != 1:
        raise CriError.invalid(where, f"must be one mapping, not {len(mappings)}")
    mapping = mappings[0]
    if mapping.container_id != 0:
        raise CriError.invalid(where, "must map container id 0 (the container's root)")
    if mapping.length < 1 or mapping.host_id + mapping.length > MAX_ID + 1:
        raise CriError.invalid(where, f"length {mapping.length} from {mapping.host_id} is out of range")
    if mapping.host_id == 0:
        raise CriError.invalid(where, "must not map the host's root (host id 0)")
    return mapping.host_id, mapping.length


def pod_spec(config: cri.PodSandboxConfig | None, runtime_handler: str) -> PodSpec:
    """A RunPodSandbox request's config as a typed value; INVALID_ARGUMENT naming the field."""
    if config is None:
        raise CriError.invalid("config", "is required")
    linux = config.linux or cri.LinuxPodSandboxConfig()
    context = linux.security_context
    host_network, host_pid, host_ipc, shared_pid = _namespace_modes(context)
    userns = user_namespace(context)
    hostname = _text(config.hostname, "config.hostname", limit=MAX_NAME)
    if hostname and not _HOSTNAME.fullmatch(hostname):
        raise CriError.invalid("config.hostname", f"{hostname[:60]!r} is not a hostname")
    log_directory = _text(config.log_directory, "config.log_directory", limit=4096)
    if log_directory and not log_directory.startswith("/"):
        raise CriError.invalid("config.log_directory", "must be an absolute path")
    cgroup_parent = _text(linux.cgroup_parent, "config.linux.cgroup_parent", limit=4096)
    if ".." in cgroup_parent.split("/"):
        raise CriError.invalid("config.linux.cgroup_parent", "must not hold '..'")
    return PodSpec(
        metadata=pod_metadata(config.metadata),
        hostname=hostname,
        log_directory=log_directory,
        dns=dns_config(config.dns_config),
        port_mappings=port_mappings(config.port_mappings),
        labels=labels(config.labels, "config.labels"),
        annotations=labels(config.annotations, "config.annotations"),
        cgroup_parent=cgroup_parent,
        host_network=host_network,
        host_pid=host_pid,
        host_ipc=host_ipc,
        shared_pid=shared_pid,
        sysctls=sysctls(linux.sysctls),
        overhead=resources(linux.overhead, "config.linux.overhead"),
        resources=resources(linux.resources, "config.linux.resources"),
        privileged=bool(context and context.privileged),
        runtime_handler=_text(runtime_handler, "runtime_handler", limit=MAX_NAME),
        userns=userns,
    )


def plausible_id(value: str, field: str) -> str:
    """A pod's or container's id as a request names it (or a prefix of it): required, and no
    longer than a name, without NUL; INVALID_ARGUMENT naming ``field`` otherwise."""
    if not value:
        raise CriError.invalid(field, "is required")
    if len(value) > MAX_NAME or "\0" in value:
        raise CriError.invalid(field, "is not a plausible id")
    return value
