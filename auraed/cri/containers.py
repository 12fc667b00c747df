"""CRI containers: a pod's containers, each a host container (auraed.containers) in its pod's
sandbox, and the CRI's record of it.

The host container holds the process, its states, exit and log; the CRI record (kind
``cri_container`` in the state store, keyed by the host container's id, which is the CRI's id
too) holds what only the CRI knows: the pod, the metadata, labels and annotations, the image as
the kubelet named it, the log path, the mounts as asked. A record is saved once its host
container exists; a host container of a sandbox whose record was never saved (auraed killed in
between) is removed at start.

Events (GetContainerEvents) go to every subscriber: created, started, stopped (the process
ended, however: a Stop, an OOM kill, its own exit) and deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord, State
from auraed.containers.request import Resources
from auraed.containers.sandbox import SandboxContext
from auraed.cri.container_config import ContainerSpec, CriMount, ImageAsked
from auraed.cri.container_host import AttachInput, CgroupUsage, ContainerHost, ProcessHandle, cgroup_usage
from auraed.cri.errors import CriError
from auraed.cri.model import PodRecord, PodState
from auraed.cri.pods import MIN_PREFIX, Pods
from auraed.cri.security import NamespaceScope
from auraed.errors import AuraeError, ErrorKind
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs
from auraed.system.fs_usage import FsUsage

log = logging.getLogger(__name__)

KIND = "cri_container"
EXEC_OUTPUT_MAX = 8 * 1024 * 1024
"""Bytes of each of an ExecSync's stdout and stderr kept, so that the reply fits the 16 MiB a
kubelet's client receives (containerd keeps 16 MiB of each, a reply the kubelet can refuse); the
rest is read and dropped, so the process never blocks on a full pipe."""
EVENT_BACKLOG = 1024
"""Events held for a GetContainerEvents subscriber that reads slowly; one further behind has
its stream ended (a kubelet then subscribes again and relists)."""
POD_STOP_GRACE = 0.0
"""StopPodSandbox kills what still runs at once, as containerd does: the kubelet has stopped each
container with its own grace period before."""
WRITABLE_USAGE_TTL = 10.0
"""Seconds a container's writable layer usage is reused for (a kubelet asks every few seconds)."""


class EventType(enum.Enum):
    CREATED = "created"
    STARTED = "started"
    STOPPED = "stopped"
    DELETED = "deleted"


@dataclasses.dataclass(frozen=True)
class ContainerEvent:
    container_id: str
    pod_id: str
    type: EventType
    created_ns: int


@dataclasses.dataclass
class CriContainerRecord:
    """What the CRI keeps of a container; the rest is its host container's."""

    id: str
    pod_id: str
    name: str
    attempt: int
    labels: dict[str, str]
    annotations: dict[str, str]
    image: ImageAsked
    image_id: str
    log_path: str  # absolute
    mounts: tuple[CriMount, ...]
    created_ns: int
    handler: str = "cell"  # whose ContainerHost holds it: its pod's runtime handler

    def to_doc(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pod_id": self.pod_id,
            "name": self.name,
            "attempt": self.attempt,
            "labels": self.labels,
            "annotations": self.annotations,
            "image": dataclasses.asdict(self.image),
            "image_id": self.image_id,
            "log_path": self.log_path,
            "mounts": [mount.to_doc() for mount in self.mounts],
            "created_ns": self.created_ns,
            "handler": self.handler,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> CriContainerRecord:
        return cls(
            **{
                **doc,
                "image": ImageAsked(**doc["image"]),
                "mounts": tuple(CriMount.from_doc(m) for m in doc["mounts"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class Container:
    """A CRI container as reported: its record and its host container's current state."""

    record: CriContainerRecord
    host: ContainerRecord


@dataclasses.dataclass(frozen=True)
class ContainerFilter:
    """ListContainers' and ListContainerStats' filter; empty fields match everything."""

    id: str = ""
    states: frozenset[str] | None = None  # host states (auraed.containers.model.State)
    pod_id: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ContainerUsage:
    container: Container
    cgroup: CgroupUsage | None  # None: no process (created, exited)
    writable: FsUsage
    writable_root: Path


@dataclasses.dataclass(frozen=True)
class PodUsage:
    pod: PodRecord
    cgroup: CgroupUsage | None
    containers: tuple[ContainerUsage, ...]


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


_FELL_BEHIND, _CLOSED = "fell behind", "closed"  # why a subscriber's stream ends


class ContainerEvents:
    """Container events to every subscriber, each with a backlog of its own."""

    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[ContainerEvent | str]] = set()

    def publish(self, event: ContainerEvent) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self._end(queue, _FELL_BEHIND)

    def _end(self, queue: asyncio.Queue[ContainerEvent | str], why: str) -> None:
        """The subscriber's stream ends once it has read what comes before ``why``."""
        self._subscribers.discard(queue)
        if queue.full():
            queue.get_nowait()  # room for the end: a stream that ends has lost events anyway
        queue.put_nowait(why)

    async def subscribe(self) -> AsyncIterator[ContainerEvent]:
        """Every event from now on, until the caller stops or close(); RESOURCE_EXHAUSTED when
        it falls EVENT_BACKLOG behind."""
        queue: asyncio.Queue[ContainerEvent | str] = asyncio.Queue(EVENT_BACKLOG)
        self._subscribers.add(queue)
        try:
            while isinstance(event := await queue.get(), ContainerEvent):
                yield event
        finally:
            self._subscribers.discard(queue)
        if event == _FELL_BEHIND:
            raise CriError(
                ErrorKind.RESOURCE_EXHAUSTED, f"the events stream fell {EVENT_BACKLOG} events behind"
            )

    def close(self) -> None:
        for queue in list(self._subscribers):
            self._end(queue, _CLOSED)


def _ns(seconds: float | None) -> int:
    return round(seconds * 1e9) if seconds else 0


class CriContainers:
    """The pods' containers (the PodContainers of auraed.cri.pods), each held by the
    ContainerHost of its pod's runtime handler (``hosts``, by handler name)."""

    def __init__(
        self, store: Store, pods: Pods, hosts: Mapping[str, ContainerHost], cgroups: Cgroupfs
    ) -> None:
        self._store = store
        self._pods = pods
        self._hosts = dict(hosts)
        self._cgroups = cgroups
        self._records: dict[str, CriContainerRecord] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._writable: dict[str, tuple[float, Path, FsUsage]] = {}  # id: (when, layer, usage)
        self.events = ContainerEvents()

    # -- lookups -----------------------------------------------------------------------------

    def find(self, container_id: str) -> CriContainerRecord | None:
        """The container with id ``container_id`` or the one id starting with it; None if none."""
        record = self._records.get(container_id)
        if record is not None or len(container_id) < MIN_PREFIX:
            return record
        matches = [r for r in self._records.values() if r.id.startswith(container_id)]
        if len(matches) > 1:
            raise CriError.invalid(
                "container_id", f"{container_id} is the start of {len(matches)} containers' ids"
            )
        return matches[0] if matches else None

    def get(self, container_id: str) -> Container:
        if not container_id:
            raise CriError.invalid("container_id", "is required")
        record = self.find(container_id)
        container = self._container(record) if record is not None else None
        if container is None:
            raise CriError.not_found(f"container {container_id[:100]}")
        return container

    def _host(self, record: CriContainerRecord) -> ContainerHost:
        return self._hosts[record.handler]

    def _container(self, record: CriContainerRecord) -> Container | None:
        try:
            return Container(record, self._host(record).get(record.id))
        except ContainerError:
            return None  # removed meanwhile

    def all(self, wanted: ContainerFilter | None = None) -> list[Container]:
        wanted = wanted or ContainerFilter()
        if wanted.id:
            found = self.find(wanted.id)
            records = [found] if found is not None else []
        else:
            records = sorted(self._records.values(), key=lambda r: r.created_ns)
        listed = []
        for record in records:
            container = self._container(record)
            if container is None or (wanted.pod_id and not record.pod_id.startswith(wanted.pod_id)):
                continue
            if wanted.states is not None and container.host.state not in wanted.states:
                continue
            if any(record.labels.get(key) != value for key, value in wanted.labels.items()):
                continue
            listed.append(container)
        return listed

    def in_pod(self, pod_id: str) -> list[Container]:
        return [c for c in self.all() if c.record.pod_id == pod_id]

    # -- lifecycle ---------------------------------------------------------------------------

    def _pid_namespace(self, spec: ContainerSpec, sandbox: SandboxContext) -> Path | None:
        """The PID namespace the container joins: the pod's (shared, or the host's for a pod of
        the host's), none (a new one of its own, or another container's: see _pid_target)."""
        if spec.namespaces.pid in (NamespaceScope.CONTAINER, NamespaceScope.TARGET):
            return None
        return sandbox.namespaces.pid

    def _pid_target(self, spec: ContainerSpec, pod: PodRecord) -> ContainerRecord | None:
        """The running container of the pod whose PID namespace the container joins (TARGET)."""
        if spec.namespaces.pid is not NamespaceScope.TARGET:
            return None
        target = self.find(spec.namespaces.pid_target)
        host = self._container(target) if target is not None else None
        if target is None or host is None or target.pod_id != pod.id or not host.host.pid:
            target_id = spec.namespaces.pid_target[:100]
            raise CriError.not_found(f"target container {target_id} (running, in this pod)")
        return host.host

    async def create(self, pod: PodRecord, spec: ContainerSpec) -> Container:
        """A container in ``pod`` (which must be READY), in the pod's sandbox."""
        if pod.state is not PodState.READY:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not ready")
        controller = self._pods.controller(pod)
        sandbox = dataclasses.replace(controller.container_sandbox(pod), sandbox_id=pod.id)
        sandbox = dataclasses.replace(
            sandbox,
            namespaces=dataclasses.replace(sandbox.namespaces, pid=self._pid_namespace(spec, sandbox)),
        )
        holder = self._hosts[controller.name]
        host = await holder.create(
            spec.request, spec.image.image, dict(spec.labels), sandbox=sandbox, log_path=spec.log_path,
            pid_of=self._pid_target(spec, pod),
        )  # fmt: skip
        record = CriContainerRecord(
            id=host.id,
            pod_id=pod.id,
            name=spec.name,
            attempt=spec.attempt,
            labels=dict(spec.labels),
            annotations=dict(spec.annotations),
            image=spec.image,
            image_id=host.image_id,
            log_path=str(host.log_path),
            mounts=spec.mounts,
            created_ns=_ns(host.created_at),
            handler=controller.name,
        )
        try:
            self._save(record)
            # A StopPodSandbox or RemovePodSandbox while this ran missed this container.
            if self._pods.find(pod.id) is not pod or pod.state is not PodState.READY:
                raise CriError.precondition(
                    f"pod sandbox {pod.id[:13]} stopped while the container was created"
                )
        except BaseException:
            await asyncio.shield(self._forget(record, host))
            raise
        self._publish(record, EventType.CREATED)
        log.info("container %s (%s) created in pod %s", spec.name, host.id[:13], pod.id[:13])
        return Container(record, host)

    async def _forget(self, record: CriContainerRecord, host: ContainerRecord) -> None:
        try:
            await self._host(record).delete(host, force=True, keep_logs=False)
        except AuraeError as exc:
            log.warning("container %s could not be removed: %s", host.id[:13], exc)
        self._drop(record)

    async def start(self, container_id: str) -> Container:
        container = self.get(container_id)
        await self._host(container.record).start(container.host)
        self._publish(container.record, EventType.STARTED)
        self._watch(container)
        return container

    async def stop(self, container_id: str, timeout: float) -> None:
        """The stop signal, SIGKILL after ``timeout`` seconds. A container that is gone, or no
        longer runs, is stopped."""
        record = self.find(container_id) if container_id else None
        container = self._container(record) if record is not None else None
        if container is None:
            if not container_id:
                raise CriError.invalid("container_id", "is required")
            return
        await self._host(container.record).stop(container.host, timeout)

    async def remove(self, container_id: str) -> None:
        """Remove the container, killing it if it runs. A container that is gone is removed."""
        if not container_id:
            raise CriError.invalid("container_id", "is required")
        record = self.find(container_id)
        if record is None:
            return
        container = self._container(record)
        if container is not None:
            await self._host(record).delete(container.host, force=True, keep_logs=False)
        if record.id in self._records:
            self._drop(record)
            self._publish(record, EventType.DELETED)
            log.info("container %s (%s) removed", record.name, record.id[:13])

    # -- the pod's hooks (auraed.cri.pods.PodContainers) --------------------------------------

    async def stop_pod_containers(self, pod: PodRecord) -> None:
        await _all(self._host(c.record).stop(c.host, POD_STOP_GRACE) for c in self.in_pod(pod.id))

    async def remove_pod_containers(self, pod: PodRecord) -> None:
        ids = [record.id for record in self._records.values() if record.pod_id == pod.id]
        await _all(self.remove(container_id) for container_id in ids)

    # -- in a running container ----------------------------------------------------------------

    async def wait(self, container: Container) -> None:
        """Until the container's process ends (or it is removed)."""
        with contextlib.suppress(ContainerError):
            await self._host(container.record).wait(container.host)

    def running(self, container_id: str, what: str) -> Container:
        """The container, FAILED_PRECONDITION unless it runs (``what``: the refused action)."""
        container = self.get(container_id)
        if container.host.state != State.RUNNING:
            raise CriError.precondition(
                f"container {container.record.id[:13]} is {container.host.state}: cannot {what}"
            )
        return container

    async def exec(self, container_id: str, command: list[str], *, tty: bool, stdin: bool) -> ProcessHandle:
        """Start ``command`` in the running container with the container's process defaults
        (user, env, cwd); the caller closes the session."""
        container = self.running(container_id, "exec")
        return await self._host(container.record).exec(container.host, command, tty=tty, stdin=stdin)

    async def attach_input(self, container: Container) -> AttachInput | None:
        """The running container's input for one attach; None when it has none open."""
        return await self._host(container.record).attach_input(container.host)

    async def exec_sync(self, container_id: str, command: list[str], timeout: float | None) -> ExecResult:
        """Run ``command`` in the container to its end, or kill it after ``timeout`` seconds
        (None: no limit) and raise DEADLINE_EXCEEDED. A non-zero exit is a result, not an error."""
        session = await self.exec(container_id, command, tty=False, stdin=False)
        try:
            async with asyncio.timeout(timeout):
                stdout, stderr = await _collect(session, EXEC_OUTPUT_MAX)
                exit_code = await session.wait()
        except TimeoutError:
            await session.kill()
            raise CriError(
                ErrorKind.DEADLINE_EXCEEDED,
                f"command {command[0][:100]!r} timed out after {timeout:g}s{self._where(container_id)}",
            ) from None
        finally:
            await session.close()  # kills it too when the caller went away
        return ExecResult(exit_code, stdout, stderr)

    def _where(self, container_id: str) -> str:
        """Where the container runs, for its errors (its host's ``place``)."""
        record = self.find(container_id)
        return "" if record is None else self._host(record).place(record.pod_id)

    async def reopen_log(self, container_id: str) -> None:
        container = self.running(container_id, "reopen its log")
        await self._host(container.record).reopen_log(container.host)

    async def update_resources(self, container_id: str, resources: Resources) -> None:
        container = self.get(container_id)
        await self._host(container.record).update_resources(container.host, resources)

    async def runtime_spec(self, container: Container) -> dict[str, Any] | None:
        """The container's OCI runtime spec (its bundle's config.json), None when unreadable."""

        def read() -> dict[str, Any] | None:
            try:
                spec: dict[str, Any] = json.loads((container.host.bundle / "config.json").read_text())
            except (OSError, ValueError):
                return None
            return spec

        return await asyncio.to_thread(read)

    # -- stats -------------------------------------------------------------------------------

    def cgroup(self, container: Container) -> str | None:
        """The container's cgroup on the host, relative to the cgroup base (it exists while it
        runs); None for a container in a guest, whose cgroup is the guest's."""
        if container.record.handler != "cell":
            return None
        return f"{container.host.cgroup_parent}/{container.host.id}"

    async def writable(self, container: Container) -> tuple[Path, FsUsage]:
        """The container's writable layer and what it uses (measured at most every
        WRITABLE_USAGE_TTL seconds)."""
        host = container.host
        now = time.monotonic()
        cached = self._writable.get(host.id)
        if cached is None or now - cached[0] >= WRITABLE_USAGE_TTL:
            root, usage = await self._host(container.record).writable(host)
            cached = (now, root, usage)
            if container.record.id in self._records:  # not removed while it was measured
                self._writable[host.id] = cached
        return cached[1], cached[2]

    async def usage(self, container: Container, *, of_many: bool = False) -> ContainerUsage:
        """The container's usage; a host that cannot be reached for it (a guest that does not
        answer) is UNAVAILABLE, or with ``of_many`` (a listing of many containers, which one
        stuck guest must not blind) a warning and no figures for this one."""
        cgroup = None
        if container.host.state == State.RUNNING:
            try:
                cgroup = await self._host(container.record).usage(container.host)
            except AuraeError as exc:
                if not of_many:
                    raise
                log.warning("no usage of container %s: %s", container.record.id[:13], exc.message)
        root, writable = await self.writable(container)
        return ContainerUsage(container, cgroup, writable, root)

    async def usages(self, wanted: ContainerFilter | None = None) -> list[ContainerUsage]:
        return [await self.usage(c, of_many=True) for c in self.all(wanted)]

    async def pod_usage(self, pod: PodRecord, *, of_many: bool = False) -> PodUsage:
        cgroup = None
        with contextlib.suppress(AuraeError):  # a pod whose sandbox is gone has no cgroup to read
            parent = self._pods.controller(pod).container_sandbox(pod).cgroup_parent
            cgroup = await asyncio.to_thread(cgroup_usage, self._cgroups, parent)
        running = [c for c in self.in_pod(pod.id) if c.host.state == State.RUNNING]
        containers = [await self.usage(c, of_many=of_many) for c in running]
        return PodUsage(pod, cgroup, tuple(containers))

    # -- records and restart -----------------------------------------------------------------

    def _save(self, record: CriContainerRecord) -> None:
        self._store.put(KIND, record.id, record.to_doc())
        self._records[record.id] = record

    def _drop(self, record: CriContainerRecord) -> None:
        self._store.delete(KIND, record.id)
        self._records.pop(record.id, None)
        self._writable.pop(record.id, None)
        watcher = self._watchers.pop(record.id, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()

    def _publish(self, record: CriContainerRecord, kind: EventType) -> None:
        self.events.publish(ContainerEvent(record.id, record.pod_id, kind, time.time_ns()))

    def _watch(self, container: Container) -> None:
        """Until the container's process ends: then its STOPPED event."""
        record = container.record

        async def watch() -> None:
            try:
                await self._host(record).wait(container.host)
            except ContainerError:
                return  # removed before it ran
            finally:
                self._watchers.pop(record.id, None)
            if record.id in self._records:
                self._publish(record, EventType.STOPPED)

        earlier = self._watchers.pop(record.id, None)
        if earlier is not None:
            earlier.cancel()
        self._watchers[record.id] = asyncio.get_running_loop().create_task(
            watch(), name=f"cri watch {record.id}"
        )

    async def recover(self) -> None:
        """At start, after the host's containers: every record whose host container is still
        there; host containers of a sandbox without a record (a Create cut short) removed."""
        for record in self._store.load(KIND, CriContainerRecord.from_doc):
            self._records[record.id] = record
            container = self._container(record)
            if container is None:
                log.info("container %s is gone; its record is dropped", record.id[:13])
                self._drop(record)
            elif container.host.state == State.RUNNING:
                self._watch(container)
        # Only the CRI puts containers in sandboxes: one without a record is a Create's.
        for holder in self._hosts.values():
            await holder.recover(lambda container_id: container_id in self._records)
        log.info("recovered %d CRI containers", len(self._records))

    async def close(self) -> None:
        self.events.close()
        for task in list(self._watchers.values()):
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        for holder in self._hosts.values():
            await holder.close()


async def _all(calls: Iterable[Any]) -> None:
    """Run every call; then raise the first failure, if any."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _collect(session: ProcessHandle, limit: int) -> tuple[bytes, bytes]:
    """stdout and stderr to their end, each cut at ``limit`` bytes."""
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    async for stream, data in session.output():
        buffer = kept[stream]
        if len(buffer) < limit:
            buffer += data[: limit - len(buffer)]
    return bytes(kept["stdout"]), bytes(kept["stderr"])
