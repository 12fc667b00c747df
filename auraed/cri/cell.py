"""The ``cell`` runtime handler: a pod is a sandbox of pinned namespaces in a pod cgroup on the
host, with no infra or pause process.

What a cell pod is made of, in the order it is made (and undone in reverse):

- the pod cgroup: ``<cgroup_base>/<cgroup_parent>`` when the kubelet gives one (its cgroupfs
  path, ``/kubepods/burstable/pod<uid>``), else ``<cgroup_base>/_pods/<pod id>``, with the pod's
  resources plus its overhead as limits. Attempts of one pod share their parent, and so the
  cgroup: the last of them to go removes it, and its ancestors where nothing else uses them.
- its directory ``<runtime_dir>/pods/<pod id>/``, holding
  - ``ns/``: the pinned namespaces (auraed.system.pod_namespaces): network unless the pod is on
    the host's network, IPC unless it uses the host's IPC, UTS unless the host's network (such a
    pod has the host's name), PID when its containers share one that is not the host's, with
    ``aurae-pod-init`` as PID 1, moved into a child of the pod cgroup, ``_init-<pod id>``. The
    hostname and sysctls are set in them; a sysctl whose namespace the pod shares with the host is
    refused before anything is made.
  - ``hostname``, ``resolv.conf``, ``hosts``: the files its containers bind-mount over /etc's.
    The hostname is the pod's, else the host's, as containerd writes it; resolv.conf comes from
    the pod's DNS config, else it is a copy of the host's (containerd's choice); hosts has the
    localhost lines and the pod's IP with its hostname, or is a copy of the host's for a pod on
    the host's network.
  - ``shm/``: a tmpfs of SHM_SIZE, the pod's shared /dev/shm (containerd's), unless host IPC.
- its CNI attachment (auraed.cni), unless it is on the host's network, with its hostPorts.

The plan (:class:`CellLayout`) is recorded in ``pod.sandbox["cell"]`` and saved before anything
is made, and every removal step is idempotent, so a pod whose run failed, was cut short or was
interrupted by a crash is removed completely from its record. Stop detaches the network only:
the pod stays, NOT_READY, with its namespaces, until it is removed. Nothing needs stopping when
auraed stops: pods outlive it, and are checked when it starts again.

:meth:`CellSandbox.container_join` says what a container of the pod joins, and
:meth:`CellSandbox.container_sandbox` says it as the host container domain takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from auraed.cells.cells import CGROUP_ERROR_KINDS
from auraed.cni.cni import Cni
from auraed.cni.errors import CniError
from auraed.cni.model import PodNetwork
from auraed.cni.model import PortMapping as CniPortMapping
from auraed.containers.sandbox import SandboxContext, SharedNamespaces, UserNamespace
from auraed.cri.errors import CriError
from auraed.cri.model import PodRecord, PodResources, PodSpec, PodState
from auraed.cri.sandbox import HandlerFeatures
from auraed.errors import ErrorKind
from auraed.system import namespaces
from auraed.system.cgroupfs import DEFAULT_CPU_PERIOD_US, CgroupError, Cgroupfs, CgroupLimits
from auraed.system.netns_dial import open_localhost_in
from auraed.system.pod_namespaces import (
    DEFAULT_POD_INIT,
    IPC,
    NET,
    PID,
    PIN_NAMES,
    USER,
    UTS,
    NamespaceError,
    PodNamespaces,
    PodNamespaceSpec,
    create_pod_namespaces,
    remove_pod_namespaces,
    sysctl_namespace,
)
from auraed.system.tasks import run_to_end
from auraed.system.userns import IdMap

log = logging.getLogger(__name__)

NAME = "cell"
SANDBOX_KEY = "cell"
"""The key of the cell's layout in ``pod.sandbox``."""
NAMESPACES_KEY = "namespaces"
"""The key of the pinned namespaces (paths, init) in ``pod.sandbox``, once they exist."""
PODS_CGROUP = "_pods"
"""Parent of the cgroups of pods the kubelet gives no cgroup parent ("_" is in no cell's name)."""
INIT_CGROUP = "_init-"
"""Prefix of the pod cgroup's child that holds a pod's ``aurae-pod-init``, named with the pod's id
(attempts share the pod cgroup), as containerd's pause container has its own cgroup below the
pod's: on cgroup v2 a cgroup with a process of its own cannot give its children controllers, so
the pod cgroup itself holds none ("_": no container id starts with it)."""
SHM_SIZE = 64 * 1024 * 1024
"""Bytes of a pod's shared /dev/shm, containerd's defaultShmSize."""
HOST_RESOLV_CONF = Path("/etc/resolv.conf")
HOST_HOSTS = Path("/etc/hosts")
NS_DIR, SHM_DIR = "ns", "shm"
HOSTNAME_FILE, RESOLV_CONF_FILE, HOSTS_FILE = "hostname", "resolv.conf", "hosts"
LOCALHOST_LINES = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "fe00::0\tip6-mcastprefix\n"
    "fe00::1\tip6-allnodes\n"
    "fe00::2\tip6-allrouters\n"
)
"""The kubelet's own /etc/hosts head for pods not on the host's network."""
MAX_CPU_SHARES = 262_144
MIN_CPU_SHARES = 2
# The pins' names (the kernel's) and the OCI runtime spec's names of the same namespaces.
OCI_NAMESPACES = {NET: "network", IPC: "ipc", UTS: "uts", PID: "pid", USER: "user"}
_NAMESPACE_NAMES = {NET: "network", IPC: "IPC", UTS: "UTS"}
# What a CNI model field holds, as the kubelet's request names it.
_CNI_FIELDS = {
    "pod_name": "config.metadata.name",
    "pod_namespace": "config.metadata.namespace",
    "pod_uid": "config.metadata.uid",
}


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Where a cell pod's parts are (recorded before any is made)."""

    directory: str
    cgroup: str  # relative to the daemon's cgroup base
    own_namespaces: tuple[str, ...]  # the pins: of NET, IPC, UTS, PID, USER
    network: bool  # attached through CNI
    own_shm: bool
    hostname: str  # the pod's, else the host's at the time the pod ran

    @property
    def namespace_dir(self) -> Path:
        return Path(self.directory) / NS_DIR

    def pin(self, kind: str) -> Path:
        return self.namespace_dir / kind

    @property
    def shm(self) -> Path:
        return Path(self.directory) / SHM_DIR if self.own_shm else Path("/dev/shm")

    @property
    def hostname_file(self) -> Path:
        return Path(self.directory) / HOSTNAME_FILE

    @property
    def resolv_conf(self) -> Path:
        return Path(self.directory) / RESOLV_CONF_FILE

    @property
    def hosts(self) -> Path:
        return Path(self.directory) / HOSTS_FILE

    def to_doc(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "own_namespaces": list(self.own_namespaces)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CellLayout:
        return cls(
            directory=str(doc["directory"]),
            cgroup=str(doc["cgroup"]),
            own_namespaces=tuple(doc["own_namespaces"]),
            network=bool(doc["network"]),
            own_shm=bool(doc["own_shm"]),
            hostname=str(doc["hostname"]),
        )


@dataclasses.dataclass(frozen=True)
class PodJoin:
    """What a container of a cell pod joins, for the OCI spec the container part writes.

    - ``namespaces``: the pod's own namespaces, by their OCI names (``network``, ``ipc``, ``uts``,
      ``pid``), each the path of its pin to join.
    - ``host_namespaces``: the OCI names of those the pod shares with the host (the container
      takes the host's: no entry in the spec). A kind in neither (``pid`` of a pod whose
      containers each have their own) is new for each container.
    - ``hostname``: the pod's, already set in its UTS namespace; ``hostname_file``,
      ``resolv_conf`` and ``hosts``: the files to bind-mount on /etc/hostname, /etc/resolv.conf
      and /etc/hosts; ``shm``: the directory to bind-mount on /dev/shm (the pod's tmpfs, or the
      host's /dev/shm for a pod with the host's IPC).
    - ``cgroup_parent``: the pod cgroup, relative to the daemon's cgroup base (as Cgroupfs names
      it); a container's cgroup goes below it.
    - ``userns``: the mappings of the pod's user namespace, where it has one of its own.
    """

    namespaces: Mapping[str, str]
    host_namespaces: frozenset[str]
    hostname: str
    hostname_file: Path
    resolv_conf: Path
    hosts: Path
    shm: Path
    cgroup_parent: str
    userns: IdMap | None = None  # the mappings of the pod's own user namespace (joined as "user")


# -- validation: everything a pod asks that the host cannot give, before anything is made ----


def host_namespaces(spec: PodSpec) -> set[str]:
    """The namespaces (NET, IPC, UTS, PID) the pod shares with the host."""
    shared = set()
    if spec.host_network:
        shared |= {NET, UTS}  # the kubelet names a host-network pod after the host
    if spec.host_ipc:
        shared.add(IPC)
    if spec.host_pid:
        shared.add(PID)
    return shared


def own_namespaces(spec: PodSpec) -> tuple[str, ...]:
    """The namespaces the pod gets pinned of its own, in the order of PIN_NAMES."""
    wanted = {NET, IPC, UTS} | ({PID} if spec.shared_pid else set()) | ({USER} if spec.userns else set())
    return tuple(kind for kind in PIN_NAMES if kind in wanted - host_namespaces(spec))


def check_sysctls(spec: PodSpec, own: tuple[str, ...]) -> None:
    """INVALID_ARGUMENT for a sysctl that is not namespaced, or whose namespace the pod shares
    with the host (writing it would change the host's)."""
    for name in spec.sysctls:
        field = f"config.linux.sysctls[{name}]"
        try:
            kind = sysctl_namespace(name)
        except NamespaceError:
            raise CriError.invalid(
                field,
                "is not namespaced (only net.*, kernel.shm*, kernel.msg*, kernel.sem, fs.mqueue.* "
                "and kernel.domainname are)",
            ) from None
        if kind not in own:
            raise CriError.invalid(
                field, f"needs the pod's own {_NAMESPACE_NAMES[kind]} namespace; the pod shares the host's"
            )


def init_cgroup(pod_cgroup: str, pod_id: str) -> str:
    """Where a pod's ``aurae-pod-init`` runs: its own child of the pod cgroup (INIT_CGROUP)."""
    return f"{pod_cgroup}/{INIT_CGROUP}{pod_id[:16]}"


def pod_cgroup(spec: PodSpec, pod_id: str, cgroups: Cgroupfs) -> str:
    """The pod cgroup's path below the base (see the module's docstring); INVALID_ARGUMENT for a
    parent this runtime cannot make."""
    parent = spec.cgroup_parent.strip("/")
    field = "config.linux.cgroup_parent"
    if not parent:
        return f"{PODS_CGROUP}/{pod_id}"
    if parent.endswith(".slice") or ".slice/" in parent:
        raise CriError.invalid(
            field,
            f"{spec.cgroup_parent!r} is a systemd slice; this runtime's cgroup driver is cgroupfs "
            "(RuntimeConfig), so the kubelet's cgroupDriver must be cgroupfs",
        )
    if parent.startswith("_"):
        raise CriError.invalid(field, f"{spec.cgroup_parent!r}: names starting with '_' are auraed's own")
    try:
        cgroups.cgroup_dirs(parent)  # checks every part of the path
    except CgroupError as exc:
        raise CriError.invalid(field, str(exc)) from None
    return parent


def cpu_weight(shares: int) -> int:
    """cgroup v2's cpu.weight for v1 cpu.shares (the kubelet's and runc's conversion)."""
    shares = min(max(shares, MIN_CPU_SHARES), MAX_CPU_SHARES)
    return 1 + ((shares - MIN_CPU_SHARES) * 9_999) // (MAX_CPU_SHARES - MIN_CPU_SHARES)


def pod_limits(resources: PodResources, overhead: PodResources) -> CgroupLimits:
    """The pod cgroup's limits: its resources plus its overhead, where the resources set one (a
    pod whose containers have no limit has none; the overhead alone is no limit of its own)."""
    memory = resources.memory_limit + overhead.memory_limit if resources.memory_limit else None
    period = resources.cpu_period or DEFAULT_CPU_PERIOD_US
    quota = None
    if resources.cpu_quota:
        extra = overhead.cpu_quota * period // (overhead.cpu_period or DEFAULT_CPU_PERIOD_US)
        quota = resources.cpu_quota + extra
    shares = resources.cpu_shares + overhead.cpu_shares if resources.cpu_shares else 0
    return CgroupLimits(
        cpu_weight=cpu_weight(shares) if shares else None,
        cpu_max_us=quota,
        cpu_period_us=period if quota is not None or resources.cpu_period else None,
        memory_max=memory,
    )


def pod_network(pod: PodRecord, netns: Path) -> PodNetwork:
    """What the pod asks of CNI: CNI_ARGS from its metadata, its hostPorts (a mapping without a
    host port is the container's port only, which needs nothing of CNI)."""
    spec = pod.spec
    meta = spec.metadata
    try:
        mappings = tuple(
            CniPortMapping(m.host_port, m.container_port, m.protocol, m.host_ip)
            for m in spec.port_mappings
            if m.host_port
        )
        return PodNetwork(
            pod.id,
            str(netns),
            pod_name=meta.name,
            pod_namespace=meta.namespace,
            pod_uid=meta.uid,
            port_mappings=mappings,
        )
    except CniError as exc:
        field, _, problem = exc.message.partition(": ")
        raise CriError(exc.kind, f"{_CNI_FIELDS.get(field, 'config.' + field)}: {problem}") from None


def _namespace_error(exc: NamespaceError) -> CriError:
    """The error in the request's terms: a sysctl the kernel refused names its field."""
    if exc.kind is not ErrorKind.INVALID_ARGUMENT:
        return CriError(exc.kind, exc.message)
    field, _, problem = exc.message.partition(": ")
    if field.startswith("sysctls."):
        field = f"config.linux.sysctls[{field.removeprefix('sysctls.')}]"
    else:
        field = f"config.{field}"
    return CriError(exc.kind, f"{field}: {problem}")


def _cgroup_error(exc: CgroupError) -> CriError:
    return CriError(CGROUP_ERROR_KINDS.get(exc.kind, ErrorKind.INTERNAL), str(exc))


def _unmount(path: Path) -> None:
    """Detach the mount on ``path``; nothing mounted there (or no ``path``) is fine."""
    try:
        namespaces.umount(path, namespaces.MNT_DETACH)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):
            raise


def _write_file(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o644)  # containers read it as whatever user they run as


def _copy_host_file(source: Path, target: Path) -> None:
    try:
        text = source.read_text()
    except FileNotFoundError:
        text = ""  # a host without one: the pod has an empty one, as its containers would
    _write_file(target, text)


def hosts_file(layout: CellLayout, ips: tuple[str, ...]) -> str:
    lines = [LOCALHOST_LINES, *(f"{ip}\t{layout.hostname}\n" for ip in ips)]
    return "".join(lines)


class CellSandbox:
    """The ``cell`` handler's SandboxController (see the module's docstring)."""

    name = NAME
    stop_ends_containers = False

    def __init__(
        self,
        cni: Cni,
        cgroups: Cgroupfs,
        pods_dir: Path,
        *,
        host_resolv_conf: Path = HOST_RESOLV_CONF,
        host_hosts: Path = HOST_HOSTS,
        pod_init: Path = DEFAULT_POD_INIT,
        features: HandlerFeatures | None = None,
    ) -> None:
        # Its containers are the host's own: what the OCI runtime can do (auraed.cri.setup).
        self.features = features or HandlerFeatures()
        self._cni = cni
        self._pod_init = pod_init
        self._cgroups = cgroups
        self._pods_dir = pods_dir
        self._host_resolv_conf = host_resolv_conf
        self._host_hosts = host_hosts
        # Pod cgroup -> the pods in it, and the lock of both it and the cgroups it names: making
        # a pod's cgroup and removing it (with its ancestors) never overlap, and whether a pod
        # is the last in its cgroup is decided under the same lock.
        self._cgroup_users: dict[str, set[str]] = {}
        self._cgroup_tree = threading.Lock()

    # -- what a container joins ------------------------------------------------------------

    def layout(self, pod: PodRecord) -> CellLayout | None:
        doc = pod.sandbox.get(SANDBOX_KEY)
        return None if doc is None else CellLayout.from_doc(doc)

    def container_join(self, pod: PodRecord) -> PodJoin:
        """What a container of ``pod`` joins; FAILED_PRECONDITION for a pod not made (yet)."""
        layout = self.layout(pod)
        if layout is None or "step" in pod.sandbox:
            raise CriError.precondition(f"pod sandbox {pod.id} is not made (yet)")
        return PodJoin(
            namespaces={OCI_NAMESPACES[kind]: str(layout.pin(kind)) for kind in layout.own_namespaces},
            host_namespaces=frozenset(OCI_NAMESPACES[kind] for kind in host_namespaces(pod.spec)),
            hostname=layout.hostname,
            hostname_file=layout.hostname_file,
            resolv_conf=layout.resolv_conf,
            hosts=layout.hosts,
            shm=layout.shm,
            cgroup_parent=layout.cgroup,
            userns=pod.spec.userns if USER in layout.own_namespaces else None,
        )

    def container_sandbox(self, pod: PodRecord) -> SandboxContext:
        """:meth:`container_join` as the host container domain takes it: the host's namespaces
        left out of the spec, so the container stays in the runtime's (the network's is the
        request's ``host_network``)."""
        join = self.container_join(pod)
        paths = {kind: Path(path) for kind, path in join.namespaces.items()}
        return SandboxContext(
            sandbox_id=pod.id,
            cgroup_parent=join.cgroup_parent,
            namespaces=SharedNamespaces(
                network=paths.get("network"),
                ipc=paths.get("ipc"),
                uts=paths.get("uts"),
                pid=paths.get("pid"),
                host=join.host_namespaces - {OCI_NAMESPACES[NET]},
                user=None if join.userns is None else UserNamespace(paths["user"], join.userns),
            ),
            resolv_conf=join.resolv_conf,
            hosts=join.hosts,
            hostname_file=join.hostname_file,
            shm=join.shm,
        )

    def network_namespace(self, pod: PodRecord) -> Path | None:
        """The pin of the pod's network namespace (also while it is being made); None for a pod
        on the host's network or one with nothing made yet."""
        layout = self.layout(pod)
        return layout.pin(NET) if layout is not None and NET in layout.own_namespaces else None

    async def dial(self, pod: PodRecord, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """``port`` on localhost in the pod's network namespace (the host's for host network)."""
        return await open_localhost_in(self.network_namespace(pod), port)

    # -- run -------------------------------------------------------------------------------

    def _plan(
        self, pod: PodRecord, overhead: PodResources | None
    ) -> tuple[CellLayout, CgroupLimits, PodNetwork | None]:
        spec = pod.spec
        own = own_namespaces(spec)
        check_sysctls(spec, own)
        layout = CellLayout(
            directory=str(self._pods_dir / pod.id),
            cgroup=pod_cgroup(spec, pod.id, self._cgroups),
            own_namespaces=own,
            network=not spec.host_network,
            own_shm=not spec.host_ipc,
            hostname=spec.hostname or socket.gethostname(),
        )
        network = pod_network(pod, layout.pin(NET)) if layout.network else None
        return layout, pod_limits(spec.resources, overhead or spec.overhead), network

    def check(self, spec: PodSpec) -> None:
        """Every pod can be a cell: what a request asks is checked as its parts are planned."""

    async def run(
        self, pod: PodRecord, save: Callable[[PodRecord], None], *, overhead: PodResources | None = None
    ) -> None:
        """The pod's host side; its cgroup's limits are its resources plus ``overhead`` (the
        pod's own when None: a vm pod's handler gives what its VM needs)."""
        layout, limits, network = self._plan(pod, overhead)
        pod.sandbox[SANDBOX_KEY] = layout.to_doc()
        save(pod)  # before anything is made: whatever follows is found and undone after a crash
        try:
            pinned = await run_to_end(asyncio.to_thread(self._make, pod, layout, limits))
            if pinned is not None:
                pod.sandbox[NAMESPACES_KEY] = pinned.to_doc()
            ips: tuple[str, ...] = ()
            if network is not None:
                save(pod)
                attachment = await self._cni.attach(network)
                ips = tuple(attachment.pod_ips)
                pod.ip, pod.additional_ips = (ips[0], ips[1:]) if ips else ("", ())
            await run_to_end(asyncio.to_thread(self._write_hosts, layout, ips))
        except BaseException:
            await run_to_end(self._undo(pod))
            raise

    def _make(self, pod: PodRecord, layout: CellLayout, limits: CgroupLimits) -> PodNamespaces | None:
        """The host side of a pod (all but its network), in a worker thread."""
        spec = pod.spec
        self._make_cgroup(pod.id, layout.cgroup, limits)
        directory = Path(layout.directory)
        directory.mkdir(mode=0o755, parents=True)
        pinned = None
        if layout.own_namespaces:
            own = set(layout.own_namespaces)
            request = PodNamespaceSpec(
                network=NET in own,
                ipc=IPC in own,
                uts=UTS in own,
                pid=PID in own,
                hostname=spec.hostname if UTS in own else "",
                sysctls=spec.sysctls,
                userns=spec.userns if USER in own else None,
            )
            try:
                pinned = create_pod_namespaces(layout.namespace_dir, request, self._pod_init)
            except NamespaceError as exc:
                raise _namespace_error(exc) from None
            if pinned.init_pid is not None:
                init = init_cgroup(layout.cgroup, pod.id)
                self._cgroup_call(self._cgroups.create, init, CgroupLimits())
                self._cgroup_call(self._cgroups.add_process, init, pinned.init_pid)
        if layout.own_shm:
            layout.shm.mkdir(mode=0o755)
            flags = namespaces.MS_NOEXEC | namespaces.MS_NOSUID | namespaces.MS_NODEV
            namespaces.mount("shm", layout.shm, "tmpfs", flags, f"mode=1777,size={SHM_SIZE}")
        _write_file(layout.hostname_file, layout.hostname + "\n")
        resolv_conf = spec.dns.resolv_conf()
        if resolv_conf:
            _write_file(layout.resolv_conf, resolv_conf)
        else:
            _copy_host_file(self._host_resolv_conf, layout.resolv_conf)
        return pinned

    def _write_hosts(self, layout: CellLayout, ips: tuple[str, ...]) -> None:
        if layout.network:
            _write_file(layout.hosts, hosts_file(layout, ips))
        else:
            _copy_host_file(self._host_hosts, layout.hosts)

    @staticmethod
    def _cgroup_call(call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except CgroupError as exc:
            raise _cgroup_error(exc) from None

    def _make_cgroup(self, pod_id: str, path: str, limits: CgroupLimits) -> None:
        """The pod cgroup and its missing ancestors; one that exists (another attempt of the pod
        made it) takes this pod's limits."""
        cgroups = self._cgroups
        parts = path.split("/")
        with self._cgroup_tree:
            self._cgroup_users.setdefault(path, set()).add(pod_id)
            for depth in range(1, len(parts)):
                ancestor = "/".join(parts[:depth])
                if not cgroups.exists(ancestor):
                    self._cgroup_call(cgroups.create, ancestor, CgroupLimits())
            if cgroups.exists(path):
                self._cgroup_call(cgroups.update, path, limits)
            else:
                self._cgroup_call(cgroups.create, path, limits)

    async def make_child_cgroup(self, pod: PodRecord, name: str) -> tuple[str, ...]:
        """A cgroup below the pod's for what runs the pod beside its containers (a vm pod's
        VMM), so the pod cgroup counts it; its ``cgroup.procs`` files to start processes in. It
        goes with the pod cgroup."""
        layout = self.layout(pod)
        if layout is None:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not made")
        path = f"{layout.cgroup}/{name}"

        def make() -> tuple[str, ...]:
            with self._cgroup_tree:  # not while the last attempt of the pod removes the parent
                if not self._cgroups.exists(path):
                    self._cgroup_call(self._cgroups.create, path, CgroupLimits())
            return tuple(str(f) for f in self._cgroups.procs_files(path))

        return await run_to_end(asyncio.to_thread(make))

    # -- resize ----------------------------------------------------------------------------

    async def update_resources(self, pod: PodRecord, overhead: PodResources, resources: PodResources) -> None:
        """The pod cgroup's limits from the new resources plus overhead, as at its run."""
        layout = self.layout(pod)
        if layout is None:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not made")
        limits = pod_limits(resources, overhead)
        await run_to_end(asyncio.to_thread(self._update_cgroup, layout.cgroup, limits))

    def _update_cgroup(self, path: str, limits: CgroupLimits) -> None:
        with self._cgroup_tree:  # not while the last attempt of the pod removes it
            self._cgroup_call(self._cgroups.update, path, limits)

    async def _undo(self, pod: PodRecord) -> None:
        """Remove what a failed run made; never raises (the run's own error is the one to tell).
        What stays is removed with the pod's record, at the next start at the latest."""
        try:
            await self.remove(pod)
        except Exception:
            log.exception("could not undo the pod sandbox %s", pod.id[:13])

    # -- stop, remove ----------------------------------------------------------------------

    async def stop(self, pod: PodRecord) -> None:
        """Release the pod's network (CNI DEL); its namespaces stay until it is removed."""
        await self._cni.detach(pod.id)
        pod.ip, pod.additional_ips = "", ()

    async def remove(self, pod: PodRecord) -> None:
        # DEL first: the bridge plugin finds its masquerade rules by the addresses in the netns.
        await self.stop(pod)
        layout = self.layout(pod)
        if layout is None:
            return  # saved before anything was made: nothing was
        await run_to_end(asyncio.to_thread(self._remove_host_side, pod.id, layout))

    def _remove_host_side(self, pod_id: str, layout: CellLayout) -> None:
        directory = Path(layout.directory)
        if layout.own_shm:
            _unmount(layout.shm)
        try:
            remove_pod_namespaces(layout.namespace_dir)  # the init first: it is in the cgroup
        except NamespaceError as exc:
            raise _namespace_error(exc) from None
        for file in (layout.hostname_file, layout.resolv_conf, layout.hosts):
            file.unlink(missing_ok=True)
        for empty in (directory / SHM_DIR, directory):
            with contextlib.suppress(FileNotFoundError):
                empty.rmdir()
        self._leave_cgroup(pod_id, layout.cgroup)

    def _leave_cgroup(self, pod_id: str, path: str) -> None:
        """Take the pod out of its cgroup's users; the last one out removes the cgroup in every
        hierarchy (an OCI runtime makes it in all of them for the pod's containers), then its
        ancestors that nothing else uses."""
        cgroups = self._cgroups
        parts = path.split("/")
        with self._cgroup_tree:
            init = init_cgroup(path, pod_id)
            if cgroups.exists(init):  # its init is gone with its namespaces
                self._cgroup_call(cgroups.remove_tree, init)
            users = self._cgroup_users.get(path, set())
            users.discard(pod_id)
            if users:
                return
            self._cgroup_users.pop(path, None)
            self._cgroup_call(cgroups.kill_all, path)  # nothing of the pod may outlive it
            self._cgroup_call(cgroups.remove_tree, path)  # with what ran beside its containers
            for depth in range(len(parts), 0, -1):
                cgroups.prune("/".join(parts[:depth]))

    # -- start -----------------------------------------------------------------------------

    async def recover(self, pod: PodRecord) -> None:
        """Take the pod back; a READY pod whose pins, cgroup or network are gone (a reboot, an
        operator) is NOT_READY from now on, for the kubelet to replace."""
        layout = self.layout(pod)
        if layout is None:
            return
        with self._cgroup_tree:  # at start: nothing else holds it
            self._cgroup_users.setdefault(layout.cgroup, set()).add(pod.id)
        if pod.state is not PodState.READY:
            return
        missing = await asyncio.to_thread(self._missing_host_side, layout)
        if layout.network:
            attachment = self._cni.attachment(pod.id)
            if attachment is None or attachment.result is None:
                missing.append("its network attachment")
            else:
                ips = tuple(attachment.pod_ips)
                pod.ip, pod.additional_ips = (ips[0], ips[1:]) if ips else ("", ())
        if missing:
            log.warning("pod %s lost %s: it is not ready any more", pod.id[:13], ", ".join(missing))
            pod.state = PodState.NOT_READY

    def _missing_host_side(self, layout: CellLayout) -> list[str]:
        missing = [
            f"the pin of its {kind} namespace"
            for kind in layout.own_namespaces
            if not os.path.ismount(layout.pin(kind))
        ]
        if not self._cgroups.exists(layout.cgroup):
            missing.append(f"its cgroup {self._cgroups.cgroup_path(layout.cgroup)}")
        return missing
