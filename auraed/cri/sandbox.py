"""The seam between the CRI and what a pod is: one sandbox controller per runtime handler.

The CRI's pod RPCs are the same whatever a pod is made of; a runtime handler (the pod's
RuntimeClass) decides that. ``cell`` makes a pod of pinned namespaces and a pod cgroup on the host;
``vm`` (a later handler) of a guest VM. Each implements :class:`SandboxController`, so no RPC
branches on the handler.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Protocol

from auraed.containers.sandbox import SandboxContext
from auraed.cri.model import PodRecord, PodResources, PodSpec


@dataclasses.dataclass(frozen=True)
class HandlerFeatures:
    """What Status reports of a handler (the CRI's RuntimeHandlerFeatures)."""

    recursive_read_only_mounts: bool = False
    user_namespaces: bool = False


class SandboxController(Protocol):
    """Makes, stops and removes the sandbox of the pods of one runtime handler.

    Every method is idempotent: a kubelet retries, and a daemon restarted in the middle of one
    runs it again. What a controller made is kept in ``pod.sandbox`` (saved by the caller after
    each call, and by ``run`` through its ``save`` as it goes), so a restarted daemon can undo it.
    """

    name: str
    features: HandlerFeatures
    stop_ends_containers: bool
    """Whether ``stop`` ends every container of the pod with it (a guest VM's): then a pod whose
    containers could not be stopped (their guest does not answer) is stopped all the same."""

    def check(self, spec: PodSpec) -> None:
        """Refuse (INVALID_ARGUMENT, naming the option) a pod this handler cannot make, before
        anything of it is made or saved."""

    async def run(self, pod: PodRecord, save: Callable[[PodRecord], None]) -> None:
        """Make the pod's sandbox and its network; on failure, undo all of it, then raise.

        ``save(pod)`` writes the record as it is: called before each thing is made, so that a
        daemon killed in the middle finds, at start, what to undo."""

    async def stop(self, pod: PodRecord) -> None:
        """Release the pod's network (its containers are stopped already); the sandbox stays."""

    async def remove(self, pod: PodRecord) -> None:
        """Remove everything the pod's sandbox holds (after ``stop``)."""

    async def update_resources(self, pod: PodRecord, overhead: PodResources, resources: PodResources) -> None:
        """Apply a READY pod's new overhead and resources (whole, not a change) to its sandbox;
        the caller keeps them in the pod's record once this returns."""

    async def recover(self, pod: PodRecord) -> None:
        """At start: make the in-memory state of a pod found in the store (it may be gone)."""

    def container_sandbox(self, pod: PodRecord) -> SandboxContext:
        """Where a container of the pod lives and what it shares with the pod's others: the pod's
        cgroup parent, namespaces, /etc files, /dev/shm (of a READY pod)."""

    async def dial(self, pod: PodRecord, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``port`` on the pod's localhost (PortForward); OSError when
        nothing answers there, CriError when the pod is not made."""
