"""Shared PID namespaces for containers that ask for one by a group name (ContainerConfig's
``shared_pid``): in a pod's guest VM, the pod's containers when the pod shares its PID namespace.

A group's namespace is made for its first container, with the minimal init that a PID namespace
needs to outlive its processes (auraed.system.pod_namespaces: it reaps the orphans of the group's
containers), pinned under ``<runtime dir>/pid-groups/<group>``; it is removed with the group's
last container. It is never the machine's own: a container sharing auraed's PID namespace could
read what auraed holds through /proc/1 (a guest's keys).
"""

from __future__ import annotations

from pathlib import Path

from auraed.containers.errors import ContainerError
from auraed.containers.sandbox import SandboxContext, SharedNamespaces
from auraed.names import validate_label
from auraed.system.pod_namespaces import (
    DEFAULT_POD_INIT,
    NamespaceError,
    PodNamespaceSpec,
    create_pod_namespaces,
    remove_pod_namespaces,
)

GROUP_PREFIX = "pid-group:"
"""A group's containers' sandbox_id: the prefix and the group's name."""
PID_ONLY = PodNamespaceSpec(network=False, ipc=False, uts=False, pid=True)


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

    def release(self, sandbox_id: str, in_use: bool) -> None:
        """After a container of a group is deleted: the group's namespace goes with its last one."""
        if not sandbox_id.startswith(GROUP_PREFIX) or in_use:
            return
        directory = self._root / sandbox_id.removeprefix(GROUP_PREFIX)
        if directory.exists():
            remove_pod_namespaces(directory)
