"""orka's workloads: the domain behind its WorkloadService.

A workload is one container, made from an image pulled through the image store (its mirrors,
insecure hosts and docker credentials apply), by a runner: on this host (orka/host.py) or in a
guest VM booted for it (orka/guest.py), as ``orka_workload_isolation`` says when it is created.
Its container (and VM) is named ``orka-<hash of the instance id>``, so that any id the scheduler
sends is taken, and carries the id in the label ``orka.instance-id``. What the domains do not keep
is a record of kind ``orka_workload`` per instance: where it runs, its container's id once made,
and whether a Signal removed it, so that a repeated Signal is a success, also after a restart,
while an id never seen is NOT_FOUND.

Preparing (the pull, then what the runner makes) runs in a task of its own, so a scheduler whose
Create stream breaks leaves its workload running; a Signal that arrives first cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

from auraed.errors import AuraeError, ErrorKind
from auraed.images.images import Images
from auraed.images.model import ImageRecord
from auraed.orka.model import HOST, OrkaError, Phase, Runner, Sample, Status, Workload, WorkloadSpec
from auraed.state.store import Store
from auraed.system.tasks import run_to_end

log = logging.getLogger(__name__)

KIND = "orka_workload"
# Records of removed workloads kept (for repeated Signals); past this many the oldest go.
MAX_REMOVED_KEPT = 1024


class Workloads:
    """``runners`` by isolation (host, vm); new workloads go to ``isolation``'s."""

    def __init__(
        self, store: Store, images: Images, runners: Mapping[str, Runner], isolation: str = HOST
    ) -> None:
        if isolation not in runners:
            raise OrkaError(ErrorKind.INTERNAL, f"no runner for orka_workload_isolation {isolation!r}")
        self._store = store
        self._images = images
        self._runners = dict(runners)
        self._isolation = isolation
        self._workloads: dict[str, Workload] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    async def recover(self) -> None:
        """The workloads of earlier runs, from their records; those whose container (or VM) is
        gone are forgotten, half-made ones undone, removed ones kept for their repeated Signals."""
        for key, doc in self._store.list(KIND):
            spec = WorkloadSpec(instance_id=doc["instance_id"], image=doc.get("image", ""))
            isolation = doc.get("isolation", HOST)
            workload = Workload(spec, isolation, doc.get("container_id", ""), bool(doc.get("removed")))
            if not workload.removed:
                runner = self._runners.get(isolation)
                if runner is None:
                    log.warning(
                        "orka workload %s ran with isolation %s, which this auraed has not: forgotten",
                        spec.instance_id, isolation,
                    )  # fmt: skip
                if runner is None or not await runner.recover(workload):
                    self._store.delete(KIND, key)
                    continue
            self._workloads[spec.instance_id] = workload
        log.info("recovered %d orka workloads", sum(1 for w in self._workloads.values() if not w.removed))

    # -- lookup ----------------------------------------------------------------------------

    def get(self, instance_id: str) -> Workload:
        workload = self._workloads.get(instance_id)
        if workload is None:
            raise OrkaError.not_found(f"workload instance {instance_id[:200]!r}")
        return workload

    def _save(self, workload: Workload) -> None:
        self._store.put(KIND, workload.instance_id, workload.to_doc())

    def _runner(self, workload: Workload) -> Runner:
        return self._runners[workload.isolation]

    # -- create ----------------------------------------------------------------------------

    async def create(self, spec: WorkloadSpec) -> Workload:
        """Begin preparing the workload (pull, then its runner's); ALREADY_EXISTS for a known one.

        A removed workload's id may be used again."""
        self._runners[self._isolation].check(spec)
        async with self._lock:
            if self._closed:
                raise OrkaError(ErrorKind.UNAVAILABLE, "auraed is shutting down")
            known = self._workloads.get(spec.instance_id)
            if known is not None and not known.removed:
                raise OrkaError.already_exists(f"workload instance {spec.instance_id[:200]!r}")
            workload = Workload(spec, self._isolation)
            self._workloads[spec.instance_id] = workload
            self._save(workload)
        workload.preparing = asyncio.get_running_loop().create_task(
            self._prepare(workload), name=f"orka workload {spec.instance_id[:60]}"
        )
        return workload

    async def _prepare(self, workload: Workload) -> None:
        spec = workload.spec
        try:
            image = await self._pull(spec.image)
            await self._runner(workload).run(workload, image, self._save)
        except AuraeError as exc:
            workload.failure = f"{workload.stage} failed: {exc.message}"
            log.info("orka workload %s did not start: %s", spec.instance_id, exc.message)
        except asyncio.CancelledError:
            workload.failure = f"Signal {workload.signalled or 'STOP'} before it ran"
            raise
        finally:
            workload.touch()

    async def _pull(self, reference: str) -> str:
        """Pull ``reference`` (its mirrors and credentials as configured); the name to create from."""
        pulled = False
        async for event in self._images.pull(reference):  # to its end: it then lets go of the store
            pulled = pulled or isinstance(event, ImageRecord)
        if pulled:
            return reference  # as the scheduler named it: the container's image shows it
        raise OrkaError(ErrorKind.INTERNAL, f"the pull of {reference} ended without an image")

    # -- status ----------------------------------------------------------------------------

    async def statuses(self, workload: Workload, interval: float) -> AsyncIterator[Status]:
        """The workload's status now, then every ``interval`` seconds (or as it changes) until it
        has terminated, which is the last one."""
        sample: Sample = None
        while True:
            workload.changed.clear()
            status, sample = await self._status(workload, sample)
            yield status
            if status.phase is Phase.TERMINATED:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(workload.changed.wait(), interval)

    async def _status(self, workload: Workload, sample: Sample) -> tuple[Status, Sample]:
        if workload.removed or not workload.container_id:
            preparing = workload.preparing is not None and not workload.preparing.done()
            if preparing and not workload.removed:
                return Status(Phase.WAITING, workload.stage), sample
            return Status(Phase.TERMINATED, workload.ended or workload.failure or "removed"), sample
        return await self._runner(workload).status(workload, sample)

    # -- signal ----------------------------------------------------------------------------

    async def signal(self, instance_id: str, kill: bool) -> None:
        """STOP (``kill`` False): the image's stop signal, SIGKILL after the grace period; KILL:
        SIGKILL. Then what it made is removed. Runs to its end when the caller leaves; a
        repeated signal is a success (a KILL during a STOP's grace brings the SIGKILL forward)."""
        workload = self.get(instance_id)
        if workload.removed:
            return
        await run_to_end(self._signal(workload, kill))

    async def _signal(self, workload: Workload, kill: bool) -> None:
        if workload.signalled != "KILL":  # a STOP after a KILL does not make it gentler
            workload.signalled = "KILL" if kill else "STOP"
        preparing = workload.preparing
        if preparing is not None and not preparing.done():
            preparing.cancel()  # a pull is abandoned; what was being made is undone
            await asyncio.wait({preparing})
        runner = self._runner(workload)
        await runner.stop(workload, kill)
        async with workload.removing:
            if workload.removed:
                return
            await runner.remove(workload)
            workload.removed = True
            self._save(workload)
            self._forget_old_removed()
        log.info("orka workload %s removed (Signal %s)", workload.instance_id, workload.signalled)
        workload.touch()

    def _forget_old_removed(self) -> None:
        removed = [w for w in self._workloads.values() if w.removed]
        for workload in removed[: max(0, len(removed) - MAX_REMOVED_KEPT)]:
            del self._workloads[workload.instance_id]
            self._store.delete(KIND, workload.instance_id)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Preparations under way are cut short (what they made undone); running workloads stay,
        as every container (and VM) outlives auraed unless it is configured to stop them."""
        async with self._lock:
            self._closed = True
        preparing = [w.preparing for w in self._workloads.values() if w.preparing and not w.preparing.done()]
        for task in preparing:
            task.cancel()
        await asyncio.gather(*preparing, return_exceptions=True)
