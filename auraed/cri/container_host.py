"""Where a CRI container runs: the seam between the CRI's containers and what holds them.

A ``cell`` pod's containers are the host's own (auraed.containers, through :class:`LocalHost`);
a ``vm`` pod's are in its guest VM (auraed.cri.guest_containers). Both give the CRI the same
record of a container (a ContainerRecord: its state, exit, times, log path) and the same
operations, so that no CRI RPC branches on the handler. Each CRI container record names the
handler whose host holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from auraed.containers.attach import attach_input
from auraed.containers.containers import Containers, spec_error
from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord
from auraed.containers.oci_spec import exec_process
from auraed.containers.request import ContainerRequest, Resources, SpecError
from auraed.containers.sandbox import SandboxContext, in_pid_namespace_of
from auraed.system.cgroupfs import CgroupError, Cgroupfs
from auraed.system.fs_usage import FsUsage, measure

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CgroupUsage:
    timestamp_ns: int
    cpu_ns: int
    memory_working_set: int
    memory_usage: int
    processes: int


class ProcessHandle(Protocol):
    """A process exec'd in a container: its output, input, terminal and exit (an ExecSession on
    the host, a guest's Exec stream for a guest's container)."""

    def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """(stream, data) as the process writes them, "stdout" or "stderr", to its end."""

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    def resize(self, rows: int, cols: int) -> None: ...

    async def wait(self) -> int:
        """The exit code, 128 + signal number when killed by a signal."""

    async def kill(self) -> None: ...

    async def close(self) -> None:
        """Kill the process if it still runs and free what the session holds."""


class AttachInput(Protocol):
    """A running container's input, held for one attach (auraed.containers.attach on the host,
    the guest's Attach stream for a guest's container)."""

    @property
    def closes_stdin(self) -> bool:
        """Whether the end of the input closes the container's stdin (stdin_once)."""

    async def write(self, data: bytes) -> None: ...

    def resize(self, rows: int, cols: int) -> None: ...

    async def end(self) -> None:
        """The client's input ended (the container's stdin closes where ``closes_stdin``)."""

    def close(self) -> None: ...


class ContainerHost(Protocol):
    """What holds the containers of one runtime handler's pods. Errors are AuraeErrors; a
    container the host does not know is ContainerError NOT_FOUND from ``get``."""

    def get(self, container_id: str) -> ContainerRecord: ...

    def all(self) -> list[ContainerRecord]: ...

    def place(self, pod_id: str) -> str:
        """Where the containers of pod ``pod_id`` run, for their errors ("" for the host itself,
        " in guest VM <name>" for a guest, which may be the one not answering)."""

    async def create(
        self, request: ContainerRequest, image: str, labels: dict[str, str], *, sandbox: SandboxContext,
        log_path: Path | None, pid_of: ContainerRecord | None = None,
    ) -> ContainerRecord:  # fmt: skip
        """The container in ``sandbox``; with ``pid_of``, in that running container's PID
        namespace (one of the same host) instead of the sandbox's."""

    async def start(self, record: ContainerRecord) -> ContainerRecord: ...

    async def stop(self, record: ContainerRecord, timeout: float | None) -> ContainerRecord: ...

    async def delete(self, record: ContainerRecord, force: bool, keep_logs: bool) -> None: ...

    async def wait(self, record: ContainerRecord) -> ContainerRecord:
        """Until the container's process ended (ContainerError when it was deleted first)."""

    async def exec(
        self, record: ContainerRecord, command: list[str], *, tty: bool, stdin: bool
    ) -> ProcessHandle: ...

    async def attach_input(self, record: ContainerRecord) -> AttachInput | None:
        """The running container's input for one attach; None when it has none open (created
        without stdin or a terminal, or a stdin_once attach closed it)."""

    async def reopen_log(self, record: ContainerRecord) -> None: ...

    async def update_resources(self, record: ContainerRecord, resources: Resources) -> None: ...

    async def usage(self, record: ContainerRecord) -> CgroupUsage | None:
        """CPU, memory and processes of a running container; None once it has none."""

    async def writable(self, record: ContainerRecord) -> tuple[Path, FsUsage]:
        """The container's writable layer (where what it wrote to its root filesystem is, on the
        machine that holds it) and what it uses."""

    async def recover(self, keep: Callable[[str], bool]) -> None:
        """At start: remove the pods' containers that ``keep`` refuses (their CRI record was never
        saved: a CreateContainer cut short)."""

    async def close(self) -> None: ...


def cgroup_usage(cgroups: Cgroupfs, path: str) -> CgroupUsage | None:
    """Usage of the cgroup at ``path`` (below the cgroup base); None when it is not there."""
    try:
        if not cgroups.exists(path):
            return None
        return CgroupUsage(
            timestamp_ns=time.time_ns(),
            cpu_ns=cgroups.cpu_stat(path).get("usage_usec", 0) * 1000,
            memory_working_set=cgroups.memory_working_set(path),
            memory_usage=cgroups.memory_current(path),
            processes=cgroups.pids_current(path),
        )
    except CgroupError:
        return None  # removed as it was read (the container ended)


class LocalHost:
    """The host's own containers (auraed.containers), for ``cell`` pods."""

    def __init__(self, containers: Containers, cgroups: Cgroupfs) -> None:
        self.containers = containers
        self._cgroups = cgroups

    def get(self, container_id: str) -> ContainerRecord:
        return self.containers.get(container_id)

    def all(self) -> list[ContainerRecord]:
        return self.containers.all()

    def place(self, pod_id: str) -> str:
        return ""  # the host's own: an error names no other machine

    async def create(
        self, request: ContainerRequest, image: str, labels: dict[str, str], *, sandbox: SandboxContext,
        log_path: Path | None, pid_of: ContainerRecord | None = None,
    ) -> ContainerRecord:  # fmt: skip
        if pid_of is not None:
            sandbox = in_pid_namespace_of(sandbox, pid_of.pid)
        return await self.containers.create(request, image, labels, sandbox=sandbox, log_path=log_path)

    async def start(self, record: ContainerRecord) -> ContainerRecord:
        return await self.containers.start(record)

    async def stop(self, record: ContainerRecord, timeout: float | None) -> ContainerRecord:
        return await self.containers.stop(record, timeout)

    async def delete(self, record: ContainerRecord, force: bool, keep_logs: bool) -> None:
        await self.containers.delete(record, force=force, keep_logs=keep_logs)

    async def wait(self, record: ContainerRecord) -> ContainerRecord:
        return await self.containers.wait(record)

    async def exec(
        self, record: ContainerRecord, command: list[str], *, tty: bool, stdin: bool
    ) -> ProcessHandle:
        """``command`` with the container's process defaults (user, env, cwd)."""
        try:
            process = exec_process(self.containers.process_defaults(record), command, (), "")
        except SpecError as exc:
            raise spec_error(exc) from None
        return await self.containers.exec(record, process, tty, stdin=stdin, size=None)

    async def attach_input(self, record: ContainerRecord) -> AttachInput | None:
        return attach_input(self.containers, record)

    async def reopen_log(self, record: ContainerRecord) -> None:
        await self.containers.reopen_log(record)

    async def update_resources(self, record: ContainerRecord, resources: Resources) -> None:
        await self.containers.update_resources(record, resources)

    async def usage(self, record: ContainerRecord) -> CgroupUsage | None:
        return await asyncio.to_thread(cgroup_usage, self._cgroups, self.containers.cgroup(record))

    async def writable(self, record: ContainerRecord) -> tuple[Path, FsUsage]:
        root = self.containers.written(record)
        return root, await asyncio.to_thread(measure, root)

    async def recover(self, keep: Callable[[str], bool]) -> None:
        # Only the CRI puts host containers in sandboxes (host-local ones have none).
        for record in self.containers.all():
            if record.sandbox_id and not keep(record.id):
                log.warning(
                    "container %s of pod %s has no CRI record; removing it",
                    record.id[:13],
                    record.sandbox_id[:13],
                )
                with contextlib.suppress(ContainerError):
                    await self.containers.delete(record, force=True, keep_logs=False)

    async def close(self) -> None:
        """The host's containers are closed by the daemon, which owns them."""
