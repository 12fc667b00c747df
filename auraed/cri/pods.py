"""Pods (CRI pod sandboxes): their records, lifecycle and lookups, whatever their handler.

A pod's record is saved before anything is made for it and after each step, so a daemon killed
at any point finds the pod again at start: a pod whose run did not finish is undone, one whose
removal did not finish is removed, the others are recovered by their controller.

A pod is named by its metadata (name, uid, namespace, attempt) as well as by its id: a second
RunPodSandbox of the same metadata gets the pod that exists, or waits for the run in flight and
gets its pod, as critest's uniqueness specs ask. A run goes on when its caller leaves (a kubelet's
deadline): it finishes into the one pod a retry then finds, or fails and leaves nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from auraed.cri.errors import CriError
from auraed.cri.model import PodMetadata, PodRecord, PodResources, PodSpec, PodState
from auraed.cri.sandbox import SandboxController
from auraed.errors import AuraeError, ErrorKind
from auraed.state.store import Store
from auraed.system.tasks import run_to_end

log = logging.getLogger(__name__)

KIND = "cri_pod"
ID_BYTES = 32  # 64 hex digits, as containerd's and CRI-O's ids
MIN_PREFIX = 6  # the shortest id prefix a lookup takes (crictl shows 13)
# Steps a record is saved in before the step runs: found at start, the step is finished or undone.
RUNNING_STEP = "running"
REMOVING_STEP = "removing"


class PodContainers(Protocol):
    """What the pods need of the pod's containers (the CRI container domain provides it)."""

    async def stop_pod_containers(self, pod: PodRecord) -> None: ...

    async def remove_pod_containers(self, pod: PodRecord) -> None: ...


class Pods:
    def __init__(
        self,
        store: Store,
        controllers: Mapping[str, SandboxController],
        default_handler: Callable[[PodSpec], str],
    ) -> None:
        self._store = store
        self._controllers = dict(controllers)
        self._default_handler = default_handler
        self._records: dict[str, PodRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._running: dict[PodMetadata, asyncio.Future[PodRecord]] = {}  # runs in flight
        # Pods whose sandbox the runtime is stopping: its end then is asked for, not a loss.
        self._stopping: set[str] = set()
        self.containers: PodContainers | None = None  # set once the container domain exists

    # -- lookups -----------------------------------------------------------------------------

    @property
    def handlers(self) -> list[SandboxController]:
        return list(self._controllers.values())

    def find(self, pod_id: str) -> PodRecord | None:
        """The pod with id ``pod_id`` or the one id starting with it; None when there is none."""
        record = self._records.get(pod_id)
        if record is not None or len(pod_id) < MIN_PREFIX:
            return record
        matches = [r for r in self._records.values() if r.id.startswith(pod_id)]
        if len(matches) > 1:
            raise CriError.invalid("pod_sandbox_id", f"{pod_id} is the start of {len(matches)} pods' ids")
        return matches[0] if matches else None

    def get(self, pod_id: str) -> PodRecord:
        if not pod_id:
            raise CriError.invalid("pod_sandbox_id", "is required")
        record = self.find(pod_id)
        if record is None:
            raise CriError.not_found(f"pod sandbox {pod_id[:100]}")
        return record

    def all(self) -> list[PodRecord]:
        return sorted(self._records.values(), key=lambda r: r.created_at)

    def by_metadata(self, metadata: PodMetadata) -> PodRecord | None:
        """The pod of ``metadata``, if one exists that is neither being made nor removed."""
        for record in self._records.values():
            if record.spec.metadata == metadata and "step" not in record.sandbox:
                return record
        return None

    def controller(self, pod: PodRecord) -> SandboxController:
        return self._controllers[pod.handler]

    def _lock(self, pod_id: str) -> asyncio.Lock:
        return self._locks.setdefault(pod_id, asyncio.Lock())

    def save(self, pod: PodRecord) -> None:
        self._store.put(KIND, pod.id, pod.to_doc())

    def sandbox_lost(self, pod: PodRecord, why: str) -> None:
        """The pod's sandbox ended under it (a guest VM died): a READY pod is NOT_READY from now
        on, and the kubelet stops and removes it as any other. A sandbox ending while the
        runtime stops it (StopPodSandbox, RemovePodSandbox) is no loss: it is not warned of."""
        if pod.id in self._stopping:
            log.debug("pod %s: its sandbox ended as it was stopped: %s", pod.id[:13], why)
            return
        if pod.state is PodState.READY and pod.id in self._records:
            log.warning("pod %s lost its sandbox: %s", pod.id[:13], why)
            pod.state = PodState.NOT_READY
            self.save(pod)

    # -- lifecycle ---------------------------------------------------------------------------

    def resolve_handler(self, spec: PodSpec) -> PodSpec:
        """The spec with its handler named: the request's, else the configured default's choice."""
        handler = spec.runtime_handler or self._default_handler(spec)
        if handler not in self._controllers:
            known = ", ".join(sorted(self._controllers))
            raise CriError.invalid(
                "runtime_handler", f"{handler!r} is not a handler of this runtime ({known})"
            )
        self._controllers[handler].check(spec)
        return dataclasses.replace(spec, runtime_handler=handler)

    async def run(self, spec: PodSpec) -> PodRecord:
        """The pod of ``spec``'s metadata: the one that exists, the one a run in flight makes, or
        a new one. The run goes on if the caller leaves (see the module's docstring)."""
        spec = self.resolve_handler(spec)
        running = self._running.get(spec.metadata)
        if running is None:
            existing = self.by_metadata(spec.metadata)
            if existing is not None:
                return existing
            running = asyncio.ensure_future(self._run(spec))
            running.add_done_callback(_retrieved)
            self._running[spec.metadata] = running
        return await asyncio.shield(running)

    async def _run(self, spec: PodSpec) -> PodRecord:
        try:
            return await self._make(spec)
        except Exception as exc:  # the caller may have left: say it here too
            meta = spec.metadata
            log.warning("pod %s/%s (attempt %d) did not run: %s",
                        meta.namespace, meta.name, meta.attempt, exc)  # fmt: skip
            raise
        finally:
            self._running.pop(spec.metadata, None)

    async def _make(self, spec: PodSpec) -> PodRecord:
        pod = PodRecord(
            id=secrets.token_hex(ID_BYTES),
            spec=spec,
            state=PodState.NOT_READY,
            created_at=time.time_ns(),
            sandbox={"step": RUNNING_STEP},
        )
        async with self._lock(pod.id):
            # Saved before anything exists: a crash from here on is undone at start.
            self.save(pod)
            self._records[pod.id] = pod
            controller = self.controller(pod)
            try:
                await controller.run(pod, self.save)
            except BaseException:
                await self._forget(pod, controller)
                raise
            pod.sandbox.pop("step", None)
            pod.state = PodState.READY
            self.save(pod)
        log.info(
            "pod %s/%s (%s) runs as %s, ip %s",
            spec.metadata.namespace,
            spec.metadata.name,
            pod.id[:13],
            spec.runtime_handler,
            pod.ip or "-",
        )
        return pod

    async def _forget(self, pod: PodRecord, controller: SandboxController) -> None:
        """Undo a pod whose run failed or was cut short; never raises (the first error matters)."""
        try:
            await asyncio.shield(self._undo(pod, controller))
        except Exception:
            log.exception("could not undo pod %s; it is removed at the next start", pod.id[:13])

    async def _undo(self, pod: PodRecord, controller: SandboxController) -> None:
        await controller.stop(pod)
        await controller.remove(pod)
        self._store.delete(KIND, pod.id)
        self._records.pop(pod.id, None)

    async def stop(self, pod_id: str) -> None:
        """Stop the pod's containers and release its network. A pod that is gone is stopped."""
        if pod_id == "":
            raise CriError.invalid("pod_sandbox_id", "is required")
        pod = self.find(pod_id)
        if pod is None:
            return
        async with self._lock(pod.id):
            controller = self.controller(pod)
            await self._stop_containers(pod, controller)
            await self._stop_sandbox(pod, controller)
            pod.state = PodState.NOT_READY
            self.save(pod)

    async def _stop_sandbox(self, pod: PodRecord, controller: SandboxController) -> None:
        """The controller's stop, with the sandbox's end during it expected (sandbox_lost)."""
        self._stopping.add(pod.id)
        try:
            await controller.stop(pod)
        finally:
            self._stopping.discard(pod.id)

    async def _stop_containers(self, pod: PodRecord, controller: SandboxController) -> None:
        """The pod's containers stopped; where the sandbox's stop ends them anyway (a guest VM's),
        a failure to (a guest that does not answer) does not keep the pod from stopping."""
        if self.containers is None:
            return
        try:
            await self.containers.stop_pod_containers(pod)
        except AuraeError as exc:
            if not controller.stop_ends_containers:
                raise
            log.warning("pod %s: its containers were not stopped (%s); they end with its sandbox",
                        pod.id[:13], exc.message)  # fmt: skip

    async def update_resources(self, pod_id: str, overhead: PodResources, resources: PodResources) -> None:
        """A resize: what the update sets of the pod's overhead and resources (0: unchanged)
        applied to its sandbox, then kept in its record. The pod must be READY."""
        pod = self.get(pod_id)
        async with self._lock(pod.id):
            if pod.state is not PodState.READY or pod.id not in self._records:
                raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not ready")
            spec = pod.spec
            spec = dataclasses.replace(
                spec, overhead=spec.overhead.updated(overhead), resources=spec.resources.updated(resources)
            )
            # To its end if the kubelet gives up: the record says what the sandbox has.
            await run_to_end(self._resize(pod, spec))
        log.info("pod %s (%s) resized to %s plus overhead %s",
                 spec.metadata.name, pod.id[:13], spec.resources, spec.overhead)  # fmt: skip

    async def _resize(self, pod: PodRecord, spec: PodSpec) -> None:
        await self.controller(pod).update_resources(pod, spec.overhead, spec.resources)
        pod.spec = spec
        self.save(pod)

    async def remove(self, pod_id: str) -> None:
        """Remove the pod, its containers and everything made for it. A pod that is gone is removed."""
        if pod_id == "":
            raise CriError.invalid("pod_sandbox_id", "is required")
        pod = self.find(pod_id)
        if pod is None:
            return
        async with self._lock(pod.id):
            if pod.id not in self._records:  # removed while this call waited
                return
            pod.sandbox["step"] = REMOVING_STEP
            pod.state = PodState.NOT_READY
            self.save(pod)
            # Runs to its end if the kubelet gives up: a half-removed pod is no use to anyone.
            await asyncio.shield(self._remove(pod))
        self._locks.pop(pod.id, None)

    async def _remove(self, pod: PodRecord) -> None:
        controller = self.controller(pod)
        if controller.stop_ends_containers:
            # Its containers end with it first (stopped already when the kubelet stopped the
            # pod): then they are removed on the host alone, whether or not their guest answers.
            await self._stop_containers(pod, controller)
            await self._stop_sandbox(pod, controller)
        if self.containers is not None:
            await self.containers.remove_pod_containers(pod)
        await self._undo(pod, controller)
        log.info("pod %s (%s) removed", pod.spec.metadata.name, pod.id[:13])

    # -- start -------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Find every pod the store holds; finish what a crash interrupted. The pods that live
        are taken back first, so that undoing the others never takes what they share (the
        cgroup of another attempt of the same pod)."""
        interrupted = []
        for pod in self._load():
            self._records[pod.id] = pod
            if pod.sandbox.get("step") in (RUNNING_STEP, REMOVING_STEP):
                interrupted.append(pod)
                continue
            try:
                await self.controller(pod).recover(pod)
                self.save(pod)
            except Exception as exc:
                _log_unrecovered(pod, exc)
        for pod in interrupted:
            what = "run" if pod.sandbox["step"] == RUNNING_STEP else "removal"
            log.info("pod %s: finishing its interrupted %s", pod.id[:13], what)
            try:
                await self._remove(pod)
            except Exception as exc:
                _log_unrecovered(pod, exc)
        log.info("recovered %d pods", len(self._records))

    def _load(self) -> list[PodRecord]:
        """The store's pods of configured handlers; an unreadable record is dropped."""
        found = []
        for pod_id, doc in self._store.list(KIND):
            try:
                pod = PodRecord.from_doc(doc)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("pod record %s is unreadable (%s); dropped", pod_id[:13], exc)
                self._store.delete(KIND, pod_id)
                continue
            if pod.handler not in self._controllers:
                log.error("pod %s has handler %r, not configured; kept as it is", pod_id[:13], pod.handler)
                continue
            found.append(pod)
        return found

    async def close(self) -> None:
        """Let the runs in flight finish (their pods outlive the daemon, as every pod does)."""
        if self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)


def _log_unrecovered(pod: PodRecord, exc: Exception) -> None:
    kind = exc.kind if isinstance(exc, AuraeError) else ErrorKind.INTERNAL
    log.error("pod %s could not be recovered (%s): %s", pod.id[:13], kind.value, exc)


def _retrieved(run: asyncio.Future[PodRecord]) -> None:
    """Take a run's outcome, so that a failed run whose callers all left is not reported as an
    exception nobody retrieved (its error went to the log and to any caller still waiting)."""
    if not run.cancelled():
        run.exception()
