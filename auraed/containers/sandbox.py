"""Where a container lives and what it shares: the seam a sandbox (a pod) creates containers through.

A sandbox owns what its containers share: a cgroup parent, namespaces pinned at paths, the files
behind /etc/resolv.conf, /etc/hosts and /etc/hostname, a /dev/shm, namespaced sysctls. It makes
and removes them; it hands each of its containers a :class:`SandboxContext` at Create, and
Containers puts the container's cgroup under the parent while its spec joins and mounts what the
context names. A host-local container (ContainerService's Create) gets :data:`HOST_LOCAL`: a cgroup
of its own under ``_containers``, namespaces, hostname and /dev/shm of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from auraed.system.userns import IdMap

CGROUP_PARENT = "_containers"
"""Below the cgroup base, the parent of host-local containers' cgroups ("_" never appears in a
cell name, so the two never meet)."""


@dataclass(frozen=True)
class UserNamespace:
    """A sandbox's own user namespace, joined at ``path`` (its other namespaces are owned by it),
    and its mappings: the container's spec carries them, and its root filesystem is mounted
    mapped (auraed.containers.rootfs)."""

    path: Path
    idmap: IdMap


@dataclass(frozen=True)
class SharedNamespaces:
    """Namespaces a container joins, each by a path (a pinned bind mount or ``/proc/<pid>/ns/<type>``,
    the OCI spec's ``linux.namespaces[].path``); None: a new one of its own, unless its kind
    (``ipc``, ``uts``, ``pid``) is in ``host``: then the container stays in the runtime's own, the
    host's, left out of the spec as containerd leaves it (a path such as /proc/1/ns/ipc fails
    where auraed is not in PID 1's namespaces or may not open them). A pod on the host's network
    says so by the request's ``host_network``."""

    network: Path | None = None
    ipc: Path | None = None
    uts: Path | None = None
    pid: Path | None = None
    host: frozenset[str] = frozenset()
    user: UserNamespace | None = None


@dataclass(frozen=True)
class SandboxContext:
    """Where a container lives and what it shares with the other containers of its sandbox.

    ``sandbox_id`` names the owner in the container's record ("": none). ``cgroup_parent`` is a
    cgroup path below the cgroup base; the container's cgroup is ``<cgroup_parent>/<id>``, and the
    parent is the sandbox's to remove. ``hostname`` is what a new UTS namespace gets (None: the
    request's, else its name); a joined UTS namespace keeps its own, so the two do not go together.
    ``resolv_conf``, ``hosts`` and ``hostname_file`` are host files bind-mounted at /etc/resolv.conf,
    /etc/hosts and /etc/hostname (read-only with a read-only rootfs, as containerd does); ``shm`` a
    host path bind-mounted at /dev/shm instead of the container's own tmpfs. A mount of the
    request's own at one of those places wins. ``sysctls`` go with the request's, which win by key.
    """

    sandbox_id: str = ""
    cgroup_parent: str = CGROUP_PARENT
    namespaces: SharedNamespaces = SharedNamespaces()
    hostname: str | None = None
    resolv_conf: Path | None = None
    hosts: Path | None = None
    hostname_file: Path | None = None
    shm: Path | None = None
    sysctls: Mapping[str, str] = field(default_factory=dict)


HOST_LOCAL = SandboxContext()
"""A container on its own: what every container got before sandboxes."""


def in_pid_namespace_of(sandbox: SandboxContext, pid: int) -> SandboxContext:
    """``sandbox`` with the PID namespace of the process ``pid`` (another container's init)."""
    return replace(sandbox, namespaces=replace(sandbox.namespaces, pid=Path(f"/proc/{pid}/ns/pid")))
