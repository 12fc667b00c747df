"""Daemon configuration: documented defaults, overridden by a TOML file, then the environment, then flags.

Every setting is declared once in ``SETTINGS`` with its default and help text; the TOML keys, the
``AURAED_*`` environment variables and the ``--flags`` are all derived from that table, so
``auraed --help`` always shows the truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import math
import os
import re
import tomllib
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from auraed.errors import ConfigError
from auraed.names import MAX_WAIT_MS
from auraed.system.pod_namespaces import DEFAULT_POD_INIT
from auraed.system.userns import DEFAULT_USERNS_ROOTFS_DIR
from auraed.wire.channel import GUEST_PING_INTERVAL_MIN, MAX_KEEPALIVE_SECONDS

DEFAULT_CONFIG_FILE = Path("/etc/aurae/auraed.toml")
ENV_PREFIX = "AURAED_"
ROLES = ("host", "guest", "nested")
VM_MACHINES = ("microvm", "q35")  # QEMU's machine types (auraed/vms/qemu.py)
VM_TEMPLATE_MEMORY_MIB = 256
"""A growable guest template's memory by default: what a guest's own kernel and auraed take
before any container (auraed.vms.guests.GUEST_BASE_MIB), so that every vm pod can be its clone."""


@dataclasses.dataclass(frozen=True)
class AuthorizationPolicy:
    """Which client identities may call which methods.

    Patterns are shell-style globs on the full method path without the leading slash, e.g.
    ``aurae.cells.v0.CellService/*``. An identity (certificate CN or DNS SAN) listed in
    ``identities`` gets exactly its patterns; any other identity the CA signed gets ``default``.
    """

    default: tuple[str, ...] = ("*",)
    identities: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RegistryHost:
    """How to reach one registry, from ``[registries."<host>"]`` (containerd hosts.toml in spirit).

    ``mirrors`` are base URLs tried in order before the registry itself; ``insecure`` means plain
    HTTP; ``skip_verify`` HTTPS without certificate checks; ``ca_file`` a PEM bundle to trust.
    """

    mirrors: tuple[str, ...] = ()
    insecure: bool = False
    skip_verify: bool = False
    ca_file: str = ""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """Every daemon setting, with its default and the help text ``auraed --help`` shows."""

    role: str = field(
        default="",
        metadata=_help(
            "host, guest or nested; detected when empty (guest: PID 1 with auraed.role=guest on the "
            "kernel command line; nested: --nested; otherwise host)"
        ),
    )
    nested: bool = field(default=False, metadata=_help("run as a nested auraed inside a cell"))
    socket: Path = field(
        default=Path("/var/run/aurae/aurae.sock"), metadata=_help("unix socket serving the aurae API (mTLS)")
    )
    tcp_listen: str = field(
        default="", metadata=_help("also serve on this host:port (mTLS), e.g. [::1]:8080; off when empty")
    )
    keepalive_time: float = field(
        default=60.0,
        metadata=_help(
            "seconds a connection with calls open may stay silent before auraed pings the client, so "
            "that calls of a client gone without a word end; 0: never ping"
        ),
    )
    keepalive_timeout: float = field(
        default=20.0,
        metadata=_help("seconds a ping may go unanswered before the connection is dropped and its calls end"),
    )
    keepalive_client_min_interval: float = field(
        default=10.0,
        metadata=_help(
            "shortest interval at which clients may ping auraed while no data flows; a client "
            "pinging more often is disconnected (aer and the host ping every 30 s)"
        ),
    )
    ca_crt: Path = field(
        default=Path("/etc/aurae/pki/ca.crt"), metadata=_help("CA certificate clients must be signed by")
    )
    ca_key: Path = field(
        default=Path("/etc/aurae/pki/ca.key"),
        metadata=_help("CA key, used to issue each guest VM its certificate (host role only)"),
    )
    server_crt: Path = field(default=Path("/etc/aurae/pki/server.crt"), metadata=_help("server certificate"))
    server_key: Path = field(default=Path("/etc/aurae/pki/server.key"), metadata=_help("server private key"))
    check_server_credentials: bool = field(
        default=True,
        metadata=_help(
            "at start, shake hands with itself once in memory (a client trusting only ca_crt against "
            "server_crt and server_key) and refuse, naming the file, credentials grpc would take and "
            "then fail every client with. The host turns it off in the config it writes for each "
            "guest, whose credentials it has just issued from its own CA (under TCG the check was "
            "0.3-0.4 s of a clone's start)"
        ),
    )
    state_dir: Path = field(
        default=Path("/var/lib/aurae"), metadata=_help("persistent state (SQLite store, images)")
    )
    runtime_dir: Path = field(
        default=Path("/var/run/aurae"), metadata=_help("runtime files (executable logs, namespaces)")
    )
    cgroup_root: Path = field(
        default=Path("/sys/fs/cgroup"), metadata=_help("where the cgroup hierarchies are mounted")
    )
    cgroup_base: str = field(default="aurae", metadata=_help("cgroup under which every cell is created"))
    userns_rootfs_dir: Path = field(
        default=DEFAULT_USERNS_ROOTFS_DIR,
        metadata=_help(
            "where a container of a pod with its own user namespace (hostUsers: false) has its root "
            "filesystem bound and its idmapped volumes staged, made 0711: that namespace's root, "
            "another host uid, must be able to pass every directory above it (the state directory "
            "is owner-only)"
        ),
    )
    pod_init: Path = field(
        default=DEFAULT_POD_INIT,
        metadata=_help(
            "static program run, confined, as PID 1 of a pod's shared PID namespace (on the host "
            "and in guests): it must reap orphans and end on SIGTERM, as catatonit -P does"
        ),
    )
    stop_grace_period: float = field(
        default=10.0, metadata=_help("seconds between SIGTERM and SIGKILL when stopping (0 to 600)")
    )
    stop_executables_on_shutdown: bool = field(
        default=True, metadata=_help("stop every executable when auraed shuts down")
    )
    stop_containers_on_shutdown: bool = field(
        default=False,
        metadata=_help("stop every container when auraed shuts down (they outlive it otherwise)"),
    )
    free_cells_on_shutdown: bool = field(
        default=False, metadata=_help("free every cell when auraed shuts down")
    )
    copy_file_max_mib: int = field(
        default=16,
        metadata=_help(
            "largest file ContainerService.CopyFile writes below <state_dir>/files (MiB, 1 to 1024)"
        ),
    )
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))
    oci_runtime: str = field(
        default="",
        metadata=_help("OCI runtime binary; runc on cgroup v1/hybrid hosts and crun on v2 when empty"),
    )
    docker_config: Path = field(
        default=Path("/root/.docker/config.json"), metadata=_help("registry credentials in docker's format")
    )
    allow_device_nodes: bool = field(
        default=False, metadata=_help("create device nodes found in image layers (skipped otherwise)")
    )
    image_sync_fs: bool = field(
        default=True,
        metadata=_help(
            "flush each unpacked layer to disk (syncfs) before it is kept: after a power loss no kept "
            "layer holds empty files; off makes pulls faster on slow disks"
        ),
    )
    vm_address_pool: str = field(
        default="10.213.0.0/16",
        metadata=_help("private IPv4 pool for VM taps, cut into /30s; checked against every host route"),
    )
    vm_machine: str = field(
        default="microvm",
        metadata=_help(
            "QEMU machine type of VmService's VMs: microvm or q35 (q35 VMs can grow: VmService.Resize); "
            "vm pods' guests have their own, cri_vm_machine"
        ),
    )
    vm_max_vcpus: int = field(
        default=0,
        metadata=_help(
            "vCPUs a q35 VM can grow to (-smp maxcpus); 0: the host's online CPUs, as Kata's "
            "default_maxvcpus (a VM asking for more starts with room for no more)"
        ),
    )
    vm_max_memory_mib: int = field(
        default=0,
        metadata=_help(
            "memory in MiB a q35 VM can grow to (-m maxmem): address space, no RAM until plugged; "
            "0: the host's MemTotal, as Kata (the most a VM may be allocated anyway)"
        ),
    )
    vm_memory_slots: int = field(
        default=10,
        metadata=_help(
            "DIMM slots of a q35 VM (-m slots): each memory growth takes one (a template's clone "
            "grown to its size as it is restored, one); 1 to 255"
        ),
    )
    vm_template_memory_mib: int = field(
        default=VM_TEMPLATE_MEMORY_MIB,
        metadata=_help(
            "MiB a guest template boots with on q35: it is made with room up to vm_max_vcpus and "
            "vm_max_memory_mib, and each clone is grown by hotplug to its own size as it is "
            "restored, so one template per guest image and machine type serves every VM of at "
            "least this size (1 vCPU and these MiB); a smaller VM boots cold"
        ),
    )
    vm_debug_console: bool = field(
        default=False,
        metadata=_help(
            "give QEMU VMs a debug console: a second virtio-serial port on which the guest's PID 1 "
            "runs a shell (VmService.DebugShell, aer vm console NAME --shell); for VMs started after "
            "it is on, templates made then and their clones (a template made with it the other way "
            "is rebuilt first). Authorized by method like every call; each session is logged"
        ),
    )
    vm_tcg_cache_mib: int = field(
        default=0,
        metadata=_help(
            "without KVM: the most MiB of host memory each QEMU VM's TCG translation cache takes "
            "(-accel tcg,tb-size); 0 leaves QEMU's own, 1 GiB, which a VM fills as its guest runs "
            "code (~70 MB an idle guest here), none of it shared. Smaller: less memory per VM, more "
            "code translated again when the cache fills. No effect with KVM"
        ),
    )
    console_shell: bool = field(
        default=False,
        metadata=_help(
            "on a machine booted from the host image (auraed as PID 1, host role): a root shell on "
            "the machine's console when Enter is pressed there; off, the console shows the status "
            "screen only. Each session is logged (when and how long, never what is typed)"
        ),
    )
    vm_guest_port: int = field(default=8443, metadata=_help("port the guests' auraed listens on (mTLS)"))
    qemu_binary: str = field(default="qemu-system-x86_64", metadata=_help("QEMU system emulator"))
    virtiofsd_binary: str = field(
        default="/usr/lib/qemu/virtiofsd",
        metadata=_help("virtiofsd serving a vm pod's volumes to its guest (Debian's qemu-system-common)"),
    )
    cloud_hypervisor_binary: str = field(
        default="cloud-hypervisor", metadata=_help("cloud-hypervisor binary (used only when KVM works)")
    )
    guest_image: Path = field(
        default=Path("/var/lib/aurae/guest-image"),
        metadata=_help("directory with vmlinuz, initramfs.img and rootfs.img for guests (guest-image/build)"),
    )
    guest_ready_timeout: float = field(
        default=120.0,
        metadata=_help(
            "seconds a booting guest has to answer health SERVING; a clone has as long to take its "
            "identity, then as long again to serve"
        ),
    )
    guest_keepalive_time: float = field(
        default=30.0,
        metadata=_help(
            "seconds the host's connection to a guest with calls open may stay silent before the "
            "host pings the guest; a guest that stops answering (its VM frozen, its network cut) "
            "has its calls end UNAVAILABLE within guest_keepalive_time + guest_keepalive_timeout "
            f"(at least {GUEST_PING_INTERVAL_MIN:g}, how often a guest lets the host ping it)"
        ),
    )
    guest_keepalive_timeout: float = field(
        default=20.0,
        metadata=_help("seconds a guest may leave the host's ping unanswered before its calls end"),
    )
    log_buffer_lines: int = field(
        default=10000, metadata=_help("how many of auraed's own log lines Observe keeps")
    )
    cri: bool = field(
        default=True,
        metadata=_help("serve the Kubernetes CRI (runtime.v1) to a kubelet on cri_socket (host role only)"),
    )
    cri_socket: Path = field(
        default=Path("/run/aurae/cri.sock"),
        metadata=_help(
            "the kubelet's runtime endpoint: a plain unix socket (kubelets speak no TLS), mode 0600; "
            "its directory must not be writable by others"
        ),
    )
    cri_default_handler: str = field(
        default="auto",
        metadata=_help(
            "runtime handler of a pod that names no RuntimeClass: cell (pinned namespaces on the "
            "host), vm (a guest VM per pod), or auto (vm unless the pod asks for a host namespace "
            "or there is no guest image, then cell)"
        ),
    )
    cri_vm_vcpus: int = field(
        default=1, metadata=_help("vCPUs of a vm pod's guest when its pod gives no CPU limits")
    )
    cri_vm_memory_mib: int = field(
        default=768, metadata=_help("MiB of a vm pod's guest when its pod gives no memory limits")
    )
    cri_vm_vmm_overhead_mib: int = field(
        default=160,
        metadata=_help(
            "MiB a vm pod's VMM (QEMU and virtiofsd) takes beyond its guest's RAM; with the guest's "
            "own 256 MiB, the least overhead a vm pod's cgroup gets when the pod has a memory limit "
            "(Kata's RuntimeClass declares 160Mi)"
        ),
    )
    cri_vm_boot: str = field(
        default="template",
        metadata=_help(
            "how a vm pod's guest starts: template (cloned from the host's guest template, made "
            "in the background at daemon start and again when the guest image changes, grown to "
            "the pod's size by hotplug as it is restored, its virtio-fs plugged then; a pod that "
            "cannot be cloned, or whose template cannot be made, boots cold, logged) or cold "
            "(booted for the pod). Clones need cri_vm_machine = q35"
        ),
    )
    cri_vm_machine: str = field(
        default="q35",
        metadata=_help(
            "QEMU machine type of vm pods' guests: q35 (cloned from a template, their volumes' "
            "virtio-fs plugged after the restore, and grown by UpdatePodSandboxResources) or "
            "microvm (booted cold, never grown: it cannot hotplug)"
        ),
    )
    cri_profile_max_kib: int = field(
        default=1024,
        metadata=_help(
            "KiB: the largest Localhost seccomp profile CreateContainer reads (docker's default "
            "profile is about 20 KiB); a larger file is refused from its size, unread"
        ),
    )
    cri_file_timeout: float = field(
        default=10.0,
        metadata=_help(
            "seconds CreateContainer may spend on the host files its request names (a Localhost "
            "seccomp profile, host paths to mount, the log's path) before it fails with "
            "DEADLINE_EXCEEDED; they are looked at on a thread of their own, so a hung "
            "filesystem stalls no other call"
        ),
    )
    cri_streaming_address: str = field(
        default="127.0.0.1",
        metadata=_help(
            "loopback address the CRI's streaming server (Exec, Attach and PortForward URLs) listens "
            "on; its URLs are plain http with one-time tokens, as the kubelet's, so only a loopback "
            "address is accepted"
        ),
    )
    cri_streaming_port: int = field(
        default=0, metadata=_help("TCP port of the CRI's streaming server; 0 picks a free one at start")
    )
    cni_conf_dir: Path = field(
        default=Path("/etc/cni/net.d"),
        metadata=_help(
            "CNI network configs (*.conflist, *.conf, *.json); the first in lexical order is pods'"
        ),
    )
    cni_bin_dirs: str = field(
        default="/usr/lib/cni:/opt/cni/bin",
        metadata=_help("directories holding CNI plugin binaries, separated by ':' as in CNI_PATH"),
    )
    cni_plugin_timeout: float = field(
        default=60.0, metadata=_help("seconds one CNI plugin call (ADD, DEL, CHECK) may take")
    )
    metrics_listen: str = field(
        default="",
        metadata=_help(
            "serve Prometheus metrics over plain HTTP on this host:port (GET /metrics), e.g. "
            "127.0.0.1:9464; off when empty"
        ),
    )
    orka_scheduler: str = field(
        default="",
        metadata=_help(
            "join the orka scheduler at this host:port as its node agent and serve orka's "
            "WorkloadService on orka_listen; off when empty"
        ),
    )
    orka_listen: str = field(
        default="[::]:50052",
        metadata=_help(
            "host:port orka's WorkloadService listens on (mTLS, only for orka_scheduler_identity); "
            "its port is the one auraed gives the scheduler when it joins"
        ),
    )
    orka_scheduler_identity: str = field(
        default="orka-scheduler",
        metadata=_help(
            "the certificate identity (CN or DNS SAN, signed by ca_crt) that may call the "
            "WorkloadService: the scheduler's"
        ),
    )
    orka_plaintext: bool = field(
        default=False,
        metadata=_help(
            "serve the WorkloadService without TLS, so without authorization: whoever reaches "
            "orka_listen runs containers on this node (orka's scheduler speaks no TLS to its "
            "agents); warned about at every start"
        ),
    )
    orka_scheduler_ca: Path | None = field(
        default=None,
        metadata=_help(
            "CA certificate (PEM) the scheduler's certificate must be signed by: TLS to the "
            "scheduler when set, plain otherwise (orka's scheduler serves TLS unless started with "
            "--no-tls, with a certificate of its own: tls/scheduler.pem in its data_dir)"
        ),
    )
    orka_scheduler_server_name: str = field(
        default="",
        metadata=_help(
            "the name the scheduler's certificate is checked against; the host of orka_scheduler "
            "when empty (orka's own certificate names localhost)"
        ),
    )
    orka_join_retry_interval: float = field(
        default=5.0,
        metadata=_help(
            "seconds from the end of one attempt to join the orka scheduler to the start of the "
            "next, every time (at start, in the background, after the status stream broke)"
        ),
    )
    orka_join_attempts: int = field(
        default=3,
        metadata=_help(
            "failed attempts to join the scheduler at start after which orka_join_failure applies "
            "(as orka's agent counts its lifecycle_retries); replaces orka_join_retries, which "
            "counted the attempts after the first and is refused"
        ),
    )
    orka_join_failure: str = field(
        default="exit",
        metadata=_help(
            "when the scheduler could not be joined at start: exit (non-zero, saying why) or serve "
            "(serve locally and keep trying to join in the background)"
        ),
    )
    orka_status_interval: float = field(
        default=15.0,
        metadata=_help(
            "seconds between the NodeStatus samples streamed to the scheduler (the first at once)"
        ),
    )
    orka_workload_status_interval: float = field(
        default=1.0, metadata=_help("seconds between the WorkloadStatus messages of a Create's stream")
    )
    orka_workload_isolation: str = field(
        default="host",
        metadata=_help(
            "where an orka workload's container runs: host (a container on this host) or vm (a "
            "guest VM booted for each workload, from guest_image; host role only)"
        ),
    )
    orka_vm_vcpus: int = field(
        default=1, metadata=_help("vCPUs of a workload's guest VM when the workload gives no cpu limit")
    )
    orka_vm_memory_mib: int = field(
        default=768,
        metadata=_help("MiB of a workload's guest VM when the workload gives no memory limit"),
    )
    authorization: AuthorizationPolicy = dataclasses.field(default_factory=AuthorizationPolicy)
    registries: Mapping[str, RegistryHost] = dataclasses.field(default_factory=dict)
    config_file: Path | None = None


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: type
    default: Any
    help: str
    optional: bool = False  # None (off) when given empty


def _settings() -> tuple[Setting, ...]:
    kinds = {"str": str, "bool": bool, "Path": Path, "float": float, "int": int}
    settings = []
    for f in dataclasses.fields(DaemonConfig):
        if "help" not in f.metadata:
            continue
        kind, _, none = str(f.type).partition(" | ")
        settings.append(Setting(f.name, kinds[kind], f.default, f.metadata["help"], none == "None"))
    return tuple(settings)


SETTINGS = _settings()

# Settings replaced by one that counts differently: refused wherever given (the file, the
# environment, a flag), saying what to set instead, so that a number chosen for the old meaning
# never runs under the new one.
RETIRED_SETTINGS = {
    "orka_join_retries": (
        "replaced by orka_join_attempts, which counts every attempt, the first too: "
        "orka_join_retries = N is orka_join_attempts = N + 1"
    ),
}


# What a TOML value that is not a string may be, for each kind of setting: a string is read as
# the environment and flags are (text). Nothing else converts: a table is no path, 1.5 no count.
_TOML_TYPES: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float)}
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", Path: "a path"}
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _from_text(kind: type, text: str) -> Any:
    # Bytes that are not UTF-8, in the environment or on the command line, arrive as surrogates,
    # which are not printable either.
    if not text.isprintable():
        raise ValueError(f"not valid UTF-8 text without control characters: {text!r}")
    if kind is bool:
        word = text.strip().lower()
        if word not in _TRUE_WORDS + _FALSE_WORDS:
            raise ValueError(f"not a boolean: {text!r}")
        return word in _TRUE_WORDS
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"not {_KIND_NAMES[kind]}: {text!r}") from None
    return kind(text)


def _coerce(setting: Setting, value: Any, source: str) -> Any:
    """``value`` of ``setting`` from ``source``: text (environment, flags, a TOML string) or a TOML
    value, which must be of the setting's type. Numbers must be finite."""
    try:
        if setting.optional and value == "":
            return None
        if isinstance(value, str):
            result = _from_text(setting.kind, value)
        elif type(value) in _TOML_TYPES.get(setting.kind, ()):
            result = setting.kind(value)
        else:
            raise ValueError(f"must be {_KIND_NAMES[setting.kind]}, not {type(value).__name__} {value!r}")
        if isinstance(result, float) and not math.isfinite(result):
            raise ValueError(f"must be a finite number, not {value!r}")
        return result
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {setting.name}: {exc}") from None


def _parse_authorization(table: Any, source: str) -> AuthorizationPolicy:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [authorization] must be a table")

    def patterns(value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ConfigError(f"{source}: {where} must be a list of method patterns")
        return tuple(value)

    unknown = set(table) - {"default", "identities"}
    if unknown:
        raise ConfigError(f"{source}: [authorization] has unknown keys: {', '.join(sorted(unknown))}")
    identities = table.get("identities", {})
    if not isinstance(identities, dict):
        raise ConfigError(f"{source}: [authorization.identities] must be a table")
    return AuthorizationPolicy(
        default=patterns(table.get("default", ["*"]), "authorization.default"),
        identities={k: patterns(v, f"authorization.identities.{k}") for k, v in identities.items()},
    )


def _beside(config_file: Path, value: Any) -> Any:
    """A relative path in the file means one beside the file (as in containerd's and nginx's
    configurations), not in whatever directory the daemon was started from."""
    if isinstance(value, Path) and not value.is_absolute():
        return config_file.absolute().parent / value
    return value


def _parse_registries(table: Any, config_file: Path) -> dict[str, RegistryHost]:
    """``[registries."<host>"]`` tables, checked here so that a mistake stops the daemon at start
    rather than failing every pull later. Hosts are keyed as lookups spell them (lowercase)."""
    from auraed.references import ReferenceError, registry_name

    source = str(config_file)
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [registries] must be a table of registry hosts")
    hosts = {}
    for host, settings in table.items():
        where = f"{source}: [registries.{host!r}]"
        try:
            name = registry_name(host)
        except ReferenceError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if name in hosts:
            raise ConfigError(f"{where}: {name} is configured twice")
        if not isinstance(settings, dict):
            raise ConfigError(f"{where} must be a table")
        unknown = set(settings) - {"mirrors", "insecure", "skip_verify", "ca_file"}
        if unknown:
            raise ConfigError(f"{where} has unknown keys: {', '.join(sorted(unknown))}")
        mirrors = settings.get("mirrors", [])
        if not isinstance(mirrors, list) or not all(isinstance(m, str) for m in mirrors):
            raise ConfigError(f"{where} mirrors must be a list of URLs")
        for mirror in mirrors:
            problem = _mirror_problem(mirror)
            if problem:
                raise ConfigError(f"{where}: mirror {mirror!r} {problem}")
        flags = {key: settings.get(key, False) for key in ("insecure", "skip_verify")}
        if not all(isinstance(v, bool) for v in flags.values()) or not isinstance(
            settings.get("ca_file", ""), str
        ):
            raise ConfigError(f"{where}: insecure and skip_verify are booleans, ca_file a path")
        ca_file = _beside(config_file, Path(settings["ca_file"])) if settings.get("ca_file") else None
        if ca_file is not None and not ca_file.is_file():
            raise ConfigError(f"{where}: ca_file {ca_file} does not exist")
        hosts[name] = RegistryHost(
            tuple(mirrors), flags["insecure"], flags["skip_verify"], str(ca_file or "")
        )
    return hosts


def _mirror_problem(mirror: str) -> str:
    """Why a mirror URL cannot be used ("" if it can): http(s) or no scheme, a host, and no
    credentials (they would show in logs and errors; a mirror's come from docker's config.json)."""
    parts = urllib.parse.urlsplit(mirror if "://" in mirror else f"//{mirror}")
    if parts.scheme not in ("", "http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "names no host"
    if "@" in parts.netloc:
        return "must not carry credentials (put them in docker's config.json)"
    if parts.query or parts.fragment:
        return "must not have a query or fragment"
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        return f"has a bad port ({exc})"
    return ""


# Each of auraed's own log lines Observe keeps costs a few hundred bytes: a million is ~0.5 GB.
MAX_LOG_BUFFER_LINES = 1_000_000
MAX_GUEST_READY_TIMEOUT = 86400.0  # a day; a guest not serving by then never will
MAX_VM_VCPUS = 255  # the most a VM may have (vms/model.py MAX_VCPUS)
MAX_VM_MEMORY_SLOTS = 255  # QEMU's ACPI memory hotplug has 256
MAX_TCG_CACHE_MIB = 2048  # QEMU's largest code buffer on an x86-64 host (tcg/region.c)
MAX_PORT = 65535  # TCP ports are 16 bits; grpc takes a bigger one modulo 65536, listening elsewhere
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _tcp_listen_problem(address: str) -> str:
    """Why ``address`` is not host:port, [IPv6]:port or IPv4:port with a port 1-65535 ("" if it is).

    grpc is no judge: it takes an empty port for 443 and one out of range modulo 65536.
    """
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "expected host:port"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= MAX_PORT:
        return f"the port must be a number from 1 to {MAX_PORT}"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return "expected an IPv6 address between the brackets"
        return ""
    if ":" in host:
        return "an IPv6 address goes between brackets, e.g. [::1]:8080"
    if not _HOST_NAME.fullmatch(host):
        return "expected a host name or an IPv4 address before the port"
    return ""


CRI_HANDLER_CHOICES = ("cell", "vm", "auto")
CRI_VM_BOOT_CHOICES = ("cold", "template")
MAX_VM_VCPUS = 255
MAX_VM_MEMORY_MIB = 1024 * 1024
MIN_VM_MEMORY_MIB = 64  # a VM's least (vms/model.py MIN_MEMORY_MIB)
MAX_CRI_PROFILE_KIB = 64 * 1024  # a profile is parsed whole in memory
MAX_CRI_FILE_TIMEOUT = 600.0  # well past the kubelet's runtime-request-timeout (2 minutes)


def _validate_cri(config: DaemonConfig) -> None:
    if config.cri_default_handler not in CRI_HANDLER_CHOICES:
        raise ConfigError(
            f"cri_default_handler: must be one of {', '.join(CRI_HANDLER_CHOICES)}, "
            f"not {config.cri_default_handler!r}"
        )
    if config.cri_vm_boot not in CRI_VM_BOOT_CHOICES:
        raise ConfigError(
            f"cri_vm_boot: must be one of {', '.join(CRI_VM_BOOT_CHOICES)}, not {config.cri_vm_boot!r}"
        )
    if config.cri_vm_machine not in VM_MACHINES:
        raise ConfigError(
            f"cri_vm_machine: must be one of {', '.join(VM_MACHINES)}, not {config.cri_vm_machine!r}"
        )
    if not 1 <= config.cri_vm_vcpus <= MAX_VM_VCPUS:
        raise ConfigError(f"cri_vm_vcpus: must be 1 to {MAX_VM_VCPUS}")
    if not 64 <= config.cri_vm_memory_mib <= MAX_VM_MEMORY_MIB:
        raise ConfigError(f"cri_vm_memory_mib: must be 64 to {MAX_VM_MEMORY_MIB}")
    if not 0 <= config.cri_vm_vmm_overhead_mib <= MAX_VM_MEMORY_MIB:
        raise ConfigError(f"cri_vm_vmm_overhead_mib: must be 0 to {MAX_VM_MEMORY_MIB}")
    if not 1 <= config.cri_profile_max_kib <= MAX_CRI_PROFILE_KIB:
        raise ConfigError(f"cri_profile_max_kib: must be 1 to {MAX_CRI_PROFILE_KIB}")
    if not 0 < config.cri_file_timeout <= MAX_CRI_FILE_TIMEOUT:
        raise ConfigError(f"cri_file_timeout: must be above 0 and at most {MAX_CRI_FILE_TIMEOUT:g}")
    _validate_streaming(config)


MAX_COPY_FILE_MIB = 1024


def _validate_copy_file(config: DaemonConfig) -> None:
    if not 1 <= config.copy_file_max_mib <= MAX_COPY_FILE_MIB:
        raise ConfigError(f"copy_file_max_mib: must be 1 to {MAX_COPY_FILE_MIB}")


def _validate_streaming(config: DaemonConfig) -> None:
    try:
        address = ipaddress.ip_address(config.cri_streaming_address)
    except ValueError:
        raise ConfigError(
            f"cri_streaming_address: {config.cri_streaming_address!r} is not an IP address"
        ) from None
    if not address.is_loopback:
        # Plain HTTP guarded by tokens alone: on a reachable address anyone who sees a URL (a
        # kubelet's log, say) could take the session. TLS streaming is not built.
        raise ConfigError(
            f"cri_streaming_address: {address} is not a loopback address; the streaming server "
            "speaks plain http and is only served on loopback"
        )
    if not 0 <= config.cri_streaming_port <= MAX_PORT:
        raise ConfigError(f"cri_streaming_port: must be 0 to {MAX_PORT}")


def _validate(config: DaemonConfig) -> DaemonConfig:
    if config.role and config.role not in ROLES:
        raise ConfigError(f"role: must be one of {', '.join(ROLES)}, not {config.role!r}")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"log_level: unknown level {config.log_level!r}")
    if not 0 <= config.stop_grace_period <= MAX_WAIT_MS / 1000:
        # The bound a request's own grace period has: a longer default would outlast any Stop.
        raise ConfigError(f"stop_grace_period: must be 0 to {MAX_WAIT_MS // 1000} seconds")
    for name in ("keepalive_time", "keepalive_client_min_interval"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name}: must not be negative")
    if config.keepalive_timeout <= 0:
        raise ConfigError("keepalive_timeout: must be positive")
    for name in ("keepalive_time", "keepalive_timeout", "keepalive_client_min_interval"):
        if getattr(config, name) > MAX_KEEPALIVE_SECONDS:
            raise ConfigError(f"{name}: must be at most {MAX_KEEPALIVE_SECONDS:.0f} seconds")
    if not 0 < config.guest_ready_timeout <= MAX_GUEST_READY_TIMEOUT:
        raise ConfigError(
            f"guest_ready_timeout: must be more than 0 and at most {MAX_GUEST_READY_TIMEOUT:.0f} s"
        )
    if not GUEST_PING_INTERVAL_MIN <= config.guest_keepalive_time <= MAX_KEEPALIVE_SECONDS:
        raise ConfigError(
            f"guest_keepalive_time: must be {GUEST_PING_INTERVAL_MIN:g} to {MAX_KEEPALIVE_SECONDS:.0f} "
            f"seconds (a guest lets the host ping it every {GUEST_PING_INTERVAL_MIN:g} s at most)"
        )
    if not 0 < config.guest_keepalive_timeout <= MAX_KEEPALIVE_SECONDS:
        raise ConfigError(
            f"guest_keepalive_timeout: must be more than 0 and at most {MAX_KEEPALIVE_SECONDS:.0f} s"
        )
    if not 1 <= config.log_buffer_lines <= MAX_LOG_BUFFER_LINES:
        raise ConfigError(f"log_buffer_lines: must be 1 to {MAX_LOG_BUFFER_LINES}")
    if not 0 <= config.vm_max_vcpus <= MAX_VM_VCPUS:
        raise ConfigError(f"vm_max_vcpus: must be 0 (the host's CPUs) to {MAX_VM_VCPUS}")
    if config.vm_max_memory_mib < 0:
        raise ConfigError("vm_max_memory_mib: must be 0 (the host's MemTotal) or more")
    if not 1 <= config.vm_memory_slots <= MAX_VM_MEMORY_SLOTS:
        raise ConfigError(f"vm_memory_slots: must be 1 to {MAX_VM_MEMORY_SLOTS}")
    if not MIN_VM_MEMORY_MIB <= config.vm_template_memory_mib <= MAX_VM_MEMORY_MIB:
        raise ConfigError(f"vm_template_memory_mib: must be {MIN_VM_MEMORY_MIB} to {MAX_VM_MEMORY_MIB}")
    if not 0 <= config.vm_tcg_cache_mib <= MAX_TCG_CACHE_MIB:
        raise ConfigError(f"vm_tcg_cache_mib: must be 0 (QEMU's own size) to {MAX_TCG_CACHE_MIB}")
    if not 1 <= config.vm_guest_port <= MAX_PORT:
        raise ConfigError(f"vm_guest_port: must be a port from 1 to {MAX_PORT}")
    _validate_cri(config)
    _validate_copy_file(config)
    for name in ("tcp_listen", "metrics_listen", "orka_scheduler", "orka_listen"):
        address = getattr(config, name)
        problem = _tcp_listen_problem(address) if address else ""
        if problem:
            raise ConfigError(f"{name}: {problem}, got {address!r}")
    _validate_orka(config)
    return config


MAX_ORKA_INTERVAL = 86400.0  # a day: an interval longer than that is a mistake
MAX_ORKA_JOIN_ATTEMPTS = 1000
ORKA_JOIN_FAILURES = ("exit", "serve")
ORKA_WORKLOAD_ISOLATIONS = ("host", "vm")


def _validate_orka(config: DaemonConfig) -> None:
    for name in ("orka_join_retry_interval", "orka_status_interval", "orka_workload_status_interval"):
        if not 0 < getattr(config, name) <= MAX_ORKA_INTERVAL:
            raise ConfigError(f"{name}: must be more than 0 and at most {MAX_ORKA_INTERVAL:.0f} seconds")
    if not 1 <= config.orka_join_attempts <= MAX_ORKA_JOIN_ATTEMPTS:
        raise ConfigError(f"orka_join_attempts: must be 1 to {MAX_ORKA_JOIN_ATTEMPTS}")
    if config.orka_join_failure not in ORKA_JOIN_FAILURES:
        raise ConfigError(
            f"orka_join_failure: must be {' or '.join(ORKA_JOIN_FAILURES)}, not {config.orka_join_failure!r}"
        )
    if config.orka_workload_isolation not in ORKA_WORKLOAD_ISOLATIONS:
        raise ConfigError(
            f"orka_workload_isolation: must be {' or '.join(ORKA_WORKLOAD_ISOLATIONS)}, "
            f"not {config.orka_workload_isolation!r}"
        )
    if not 1 <= config.orka_vm_vcpus <= MAX_VM_VCPUS:
        raise ConfigError(f"orka_vm_vcpus: must be 1 to {MAX_VM_VCPUS}")
    if not 64 <= config.orka_vm_memory_mib <= MAX_VM_MEMORY_MIB:
        raise ConfigError(f"orka_vm_memory_mib: must be 64 to {MAX_VM_MEMORY_MIB}")
    if config.orka_scheduler and not config.orka_listen:
        raise ConfigError("orka_listen: the WorkloadService needs an address when orka_scheduler is set")
    if config.orka_scheduler and not config.orka_plaintext and not config.orka_scheduler_identity:
        raise ConfigError("orka_scheduler_identity: must name the scheduler's certificate identity")


# Built once per process, from SETTINGS alone: a template guest built it at its boot, so each of its
# clones, which loads its own configuration again as it resumes, does not build it again (it was
# most of a clone's 176 ms there under TCG). parse_args leaves a parser as it was.
@functools.cache
def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="auraed",
        description="The aurae daemon: cells, VMs, containers and the CRI over mTLS gRPC.",
        epilog=f"Each setting can also be set in the TOML file (same name) or as {ENV_PREFIX}<NAME> "
        "in the environment; flags win over the environment, which wins over the file.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML configuration file (default: {DEFAULT_CONFIG_FILE} when it exists)",
    )
    for setting in SETTINGS:
        flag = "--" + setting.name.replace("_", "-")
        if setting.kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{setting.help} (default: {setting.default})",
            )
        else:
            default = "off" if setting.default is None else setting.default
            parser.add_argument(flag, type=str, default=None, help=f"{setting.help} (default: {default})")
    for name in RETIRED_SETTINGS:  # known, so that load_config refuses them saying why
        parser.add_argument("--" + name.replace("_", "-"), type=str, default=None, help=argparse.SUPPRESS)
    return parser


def _refuse_retired(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    for name, why in RETIRED_SETTINGS.items():
        if getattr(args, name) is not None:
            raise ConfigError(f"--{name.replace('_', '-')}: {why}")
        if ENV_PREFIX + name.upper() in env:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}: {why}")


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Defaults, then the TOML file, then ``AURAED_*`` variables, then flags."""
    args = build_argument_parser().parse_args(argv)
    env = os.environ if environ is None else environ
    _refuse_retired(args, env)
    values: dict[str, Any] = {}
    authorization = AuthorizationPolicy()
    registries: dict[str, RegistryHost] = {}

    config_file: Path | None = args.config or (
        Path(env[ENV_PREFIX + "CONFIG"]) if ENV_PREFIX + "CONFIG" in env else None
    )
    if config_file is None and DEFAULT_CONFIG_FILE.exists():
        config_file = DEFAULT_CONFIG_FILE
    by_name = {s.name: s for s in SETTINGS}
    if config_file is not None:
        try:
            table = tomllib.loads(config_file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{config_file}: not UTF-8 text (byte {exc.start})") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{config_file}: {exc}") from exc
        for key, value in table.items():
            if key == "authorization":
                authorization = _parse_authorization(value, str(config_file))
            elif key == "registries":
                registries = _parse_registries(value, config_file)
            elif key in by_name:
                values[key] = _beside(config_file, _coerce(by_name[key], value, str(config_file)))
            elif key in RETIRED_SETTINGS:
                raise ConfigError(f"{config_file}: {key}: {RETIRED_SETTINGS[key]}")
            else:
                raise ConfigError(f"{config_file}: unknown setting {key!r}")
    for setting in SETTINGS:
        raw = env.get(ENV_PREFIX + setting.name.upper())
        if raw is not None:
            values[setting.name] = _coerce(setting, raw, ENV_PREFIX + setting.name.upper())
    for setting in SETTINGS:
        flag_value = getattr(args, setting.name)
        if flag_value is not None:
            values[setting.name] = _coerce(setting, flag_value, "--" + setting.name.replace("_", "-"))
    return _validate(
        DaemonConfig(**values, authorization=authorization, registries=registries, config_file=config_file)
    )
