"""Shared PID namespaces for containers that ask for one by a group name (ContainerConfig's
``shared_pid``): in a pod's guest VM, the pod's containers when the pod shares its PID namespace.
A group of a user namespace (ContainerConfig's ``user_namespace``: a vm pod with ``hostUsers:
false``) is that namespace and the IPC namespace it owns, with the PID namespace too when its
containers share one: made as a cell pod's are (the user namespace helper: every namespace of
the group owned by the pod's user namespace, so that root in a container has power over its IPC
and PID namespaces, and mounts /proc and mqueue there).

A group's namespace is made for its first container, with the minimal init that a PID namespace
needs to outlive its processes (auraed.system.pod_namespaces: it reaps the orphans of the group's
containers), pinned under ``<runtime dir>/pid-groups/<group>``; it is removed with the group's
last container. It is never the machine's own: a container sharing auraed's PID namespace could
read what auraed holds through /proc/1 (a guest's keys).
"""

from __future__ import annotations

from pathlib import Path

from auraed.containers.errors import ContainerError
from auraed.containers.sandbox import SandboxContext, SharedNamespaces, UserNamespace
from auraed.names import validate_label
from auraed.system.pod_namespaces import (
    DEFAULT_POD_INIT,
    NamespaceError,
    PodNamespaceSpec,
    create_pod_namespaces,
    remove_pod_namespaces,
)
from auraed.system.userns import IdMap

GROUP_PREFIX = "pid-group:"
"""A group's containers' sandbox_id: the prefix and the group's name."""
PID_ONLY = PodNamespaceSpec(network=False, ipc=False, uts=False, pid=True)
USERNS_GROUP = "_userns"
"""The group of a pod's user namespace (a guest holds one pod); no DNS label, so never a
``shared_pid`` group's name."""
IDMAP_RECORD = "idmap"
"""In a user namespace's group: its mappings, as /proc/<pid>/uid_map and gid_map were written."""


class PidGroups:
    """The groups' namespaces, under ``root``."""

    def __init__(self, root: Path, init_program: Path = DEFAULT_POD_INIT) -> None:
        self._root = root
        self._init_program = init_program

    def sandbox(self, group: str) -> SandboxContext:
        """A container of ``group``: the group's PID namespace, made if it is not there yet."""
        validate_label(group, "config.shared_pid")
        directory = self._root / group
        pin = directory / "pid"
        if not pin.exists():
            try:
                made = create_pod_namespaces(directory, PID_ONLY, self._init_program)
            except NamespaceError as exc:
                raise ContainerError(exc.kind, f"config.shared_pid: {exc.message}") from None
            pin = Path(str(made.pid))
        return SandboxContext(sandbox_id=GROUP_PREFIX + group, namespaces=SharedNamespaces(pid=pin))

    def user_sandbox(self, idmap: IdMap, share_pid: bool) -> SandboxContext:
        """A container of the pod's user namespace (``idmap``): it, the IPC namespace it owns and,
        with ``share_pid``, its PID namespace; made if not there yet. Its containers must agree
        (a guest holds one pod): a container asking for other mappings, or for a PID namespace
        the group has not (or the reverse), is refused."""
        directory = self._root / USERNS_GROUP
        spec = PodNamespaceSpec(network=False, ipc=True, uts=False, pid=share_pid, userns=idmap)
        if not (directory / "user").exists():
            try:
                create_pod_namespaces(directory, spec, self._init_program)
            except NamespaceError as exc:
                raise ContainerError(exc.kind, f"config.user_namespace: {exc.message}") from None
            (directory / IDMAP_RECORD).write_text("".join(idmap.lines()))
        _check_same_group(directory, idmap, share_pid)
        pid = directory / "pid" if share_pid else None
        user = UserNamespace(directory / "user", idmap)
        return SandboxContext(
            sandbox_id=GROUP_PREFIX + USERNS_GROUP,
            namespaces=SharedNamespaces(pid=pid, ipc=directory / "ipc", user=user),
        )

    def release(self, sandbox_id: str, in_use: bool) -> None:
        """After a container of a group is deleted: the group's namespace goes with its last one."""
        if not sandbox_id.startswith(GROUP_PREFIX) or in_use:
            return
        directory = self._root / sandbox_id.removeprefix(GROUP_PREFIX)
        if directory.exists():
            (directory / IDMAP_RECORD).unlink(missing_ok=True)
            remove_pod_namespaces(directory)


def _check_same_group(directory: Path, idmap: IdMap, share_pid: bool) -> None:
    """The group at ``directory`` was made for ``idmap``, with a PID namespace exactly when
    ``share_pid``."""
    try:
        made = (directory / IDMAP_RECORD).read_text()
    except FileNotFoundError:
        made = ""  # cut short by a crash as it was made: its containers must go first
    if made != "".join(idmap.lines()):
        raise ContainerError.precondition(
            f"config.user_namespace: the pod's user namespace maps {made!r}, not {''.join(idmap.lines())!r}"
        )
    if (directory / "pid").exists() != share_pid:
        had = "a" if not share_pid else "no"
        raise ContainerError.precondition(
            f"config.shared_pid: the pod's user namespace was made with {had} shared PID namespace"
        )
