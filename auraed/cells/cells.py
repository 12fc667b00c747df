"""Cells: allocation, freeing and the executables inside, persisted and recovered at start."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

from auraed.cells.errors import CellError
from auraed.cells.executables import ExecutableRecord, Executables, Placement, State
from auraed.cells.model import CellSpec, ExecutableSpec
from auraed.errors import ErrorKind
from auraed.names import parent_of
from auraed.observe.events import ObserveHub
from auraed.state.store import Store
from auraed.system import namespaces
from auraed.system.cgroupfs import CgroupError, Cgroupfs, CgroupLayout, parse_cpu_list
from auraed.system.supervisor import Supervisor
from auraed.system.tasks import run_to_end

log = logging.getLogger(__name__)

KIND = "cell"
CPUSET_FIELDS = (("cpus", "cpuset_cpus"), ("mems", "cpuset_mems"))  # request field, CgroupLimits name

CGROUP_ERROR_KINDS = {
    "invalid": ErrorKind.INVALID_ARGUMENT,
    "unsupported": ErrorKind.FAILED_PRECONDITION,
    "not_found": ErrorKind.NOT_FOUND,
    "busy": ErrorKind.FAILED_PRECONDITION,
    "os": ErrorKind.INTERNAL,
}


def cell_error(exc: CgroupError) -> CellError:
    return CellError(CGROUP_ERROR_KINDS.get(exc.kind, ErrorKind.INTERNAL), str(exc))


@dataclasses.dataclass
class CellRecord:
    spec: CellSpec
    # "allocating" until every kernel object exists; a record left so is torn down at start.
    state: str = "allocating"
    netns_path: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {"spec": self.spec.to_doc(), "state": self.state, "netns_path": self.netns_path}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> CellRecord:
        return cls(CellSpec.from_doc(doc["spec"]), doc["state"], doc.get("netns_path"))


class Cells:
    def __init__(
        self,
        store: Store,
        hub: ObserveHub,
        cgroups: Cgroupfs,
        *,
        runtime_dir: Path,
        default_grace_period: float,
        supervisor: Supervisor,
    ) -> None:
        self._store = store
        self._cgroups = cgroups
        self._netns_dir = runtime_dir / "netns"
        self.executables = Executables(store, hub, runtime_dir, supervisor)
        self._cells: dict[str, CellRecord] = {}
        self._default_grace = default_grace_period
        # One lifecycle change at a time: allocation, start and free touch the same tree. Never
        # held while waiting for executables to end (Free's grace period).
        self._lock = asyncio.Lock()
        self._freeing: set[str] = set()  # cells a Free is taking down: they take no new work

    @property
    def layout(self) -> CgroupLayout:
        return self._cgroups.layout

    def cgroup_path(self, name: str) -> str:
        return self._cgroups.cgroup_path(name)

    def get(self, name: str) -> CellRecord:
        record = self._cells.get(name)
        if record is None:
            raise CellError.not_found(f"cell {name}")
        return record

    def all(self) -> list[CellRecord]:
        return [self._cells[name] for name in sorted(self._cells)]

    def children(self, name: str | None) -> list[CellRecord]:
        return [r for n, r in sorted(self._cells.items()) if parent_of(n) == name]

    def grace(self, seconds: float | None) -> float:
        return self._default_grace if seconds is None else seconds

    # -- allocate / free -------------------------------------------------------------------

    async def allocate(self, spec: CellSpec) -> CellRecord:
        async with self._lock:
            self._check_allocatable(spec)
            record = CellRecord(spec)
            self._save(record)
            try:
                # A caller that leaves cannot stop the thread: wait for it, then undo what it made.
                await run_to_end(asyncio.to_thread(self._make, record))
                record.state = "ready"
                self._save(record)  # may fail too (a full disk): then nothing stays either
            except BaseException:
                await run_to_end(asyncio.to_thread(self._unmake, record))
                self._delete(record)
                raise
            log.info("allocated cell %s", spec.name)
            return record

    def _check_allocatable(self, spec: CellSpec) -> None:
        if spec.name in self._cells:
            raise CellError.already_exists(f"cell {spec.name}")
        parent = parent_of(spec.name)
        if parent is None:
            return
        self._check_usable(parent)
        if any(r.state in (State.RUNNING, State.STARTING) for r in self.executables.in_cell(parent)):
            raise CellError.precondition(
                f"cell {parent} runs executables; a cell holds either executables or child cells"
            )
        self._check_cpuset_within(spec, [self.get(parent), *self._ancestors(parent)])

    @staticmethod
    def _check_cpuset_within(spec: CellSpec, above: list[CellRecord]) -> None:
        """A cpuset must lie within the nearest one above it: the kernel refuses it otherwise,
        with a bare EPERM (or EINVAL) that would reach the caller as an internal error."""
        for field, attribute in CPUSET_FIELDS:
            wanted = getattr(spec.limits, attribute)
            bound_by = next((r for r in above if getattr(r.spec.limits, attribute)), None)
            if wanted is None or bound_by is None:
                continue
            bound = getattr(bound_by.spec.limits, attribute)
            if not parse_cpu_list(wanted) <= parse_cpu_list(bound):
                raise CellError.invalid(
                    f"cell.cpuset.{field}", f"{wanted!r} is not within cell {bound_by.spec.name}'s {bound!r}"
                )

    def _check_usable(self, name: str) -> CellRecord:
        """The cell, unless it is missing or being freed."""
        record = self.get(name)
        if name in self._freeing:
            raise CellError.precondition(f"cell {name} is being freed")
        return record

    def _make(self, record: CellRecord) -> None:
        try:
            self._cgroups.create(record.spec.name, record.spec.limits)
        except CgroupError as exc:
            raise cell_error(exc) from exc
        if record.spec.isolate_network:
            path = self._netns_dir / record.spec.name.replace("/", "_")
            self._netns_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            record.netns_path = str(path)
            namespaces.create_network_namespace(path)

    def _unmake(self, record: CellRecord) -> None:
        """Remove every kernel object of a cell; safe on half-made cells and repeatable."""
        if record.netns_path:
            namespaces.remove_network_namespace(Path(record.netns_path))
        try:
            if self._cgroups.exists(record.spec.name):
                self._cgroups.kill_all(record.spec.name)
            self._cgroups.remove(record.spec.name)
        except CgroupError as exc:
            raise cell_error(exc) from exc

    async def free(self, name: str, grace_period: float) -> None:
        """Stop the cell's executables and those of the cells below it, then remove them all.

        The grace period is waited out without the lock (other cells are served meanwhile); the
        cells are marked as being freed instead, so none takes new work. Once begun, a Free
        runs to its end even if its caller leaves.
        """
        async with self._lock:
            record = self._check_usable(name)
            # Children first: a cgroup directory can only be removed once it has none.
            doomed = [*self._subtree(name), record]
            names = {r.spec.name for r in doomed}
            self._freeing |= names
        try:
            await run_to_end(self._free_all(doomed, grace_period))
        finally:
            self._freeing -= names

    def _subtree(self, name: str) -> list[CellRecord]:
        below = [r for n, r in self._cells.items() if n.startswith(name + "/")]
        return sorted(below, key=lambda r: r.spec.name.count("/"), reverse=True)

    async def _free_all(self, doomed: list[CellRecord], grace_period: float) -> None:
        executables = [e for r in doomed for e in self.executables.in_cell(r.spec.name)]
        await asyncio.gather(*(self.executables.stop(e, grace_period) for e in executables))
        async with self._lock:
            for record in doomed:
                await self._remove(record)

    async def _remove(self, record: CellRecord) -> None:
        executables = self.executables.in_cell(record.spec.name)
        await asyncio.to_thread(self._unmake, record)
        for executable in executables:
            with contextlib.suppress(CellError):
                self.executables.forget(executable)
        self._delete(record)
        log.info("freed cell %s", record.spec.name)

    # -- executables -----------------------------------------------------------------------

    async def start(self, spec: ExecutableSpec) -> ExecutableRecord:
        async with self._lock:
            placement = self._placement(spec.cell_name)
            # Once launching began it ends with the executable recorded (or not started at
            # all), even if the caller leaves: cut short, it would run on unknown to auraed.
            return await run_to_end(self.executables.start(spec, placement))

    def _placement(self, cell_name: str) -> Placement:
        record = self._check_usable(cell_name)
        if self.children(cell_name):
            raise CellError.precondition(
                f"cell {cell_name} has child cells; a cell holds either executables or child cells"
            )
        # A cell is inside its ancestors' isolation: their pid and network isolation hold for it.
        lineage = [record, *self._ancestors(cell_name)]
        return Placement(
            cell=record.spec,
            cgroup_join_files=[str(p) for p in self._cgroups.join_files(cell_name)],
            oom_counter_file=str(self._cgroups.oom_counter_file(cell_name)),
            netns_path=next((r.netns_path for r in lineage if r.netns_path), None),
            isolate_process=any(r.spec.isolate_process for r in lineage),
        )

    def _ancestors(self, name: str) -> list[CellRecord]:
        """The cells above ``name``, nearest first."""
        found = []
        parent = parent_of(name)
        while parent is not None:
            found.append(self.get(parent))
            parent = parent_of(parent)
        return found

    async def stop(self, cell_name: str, executable_name: str, grace_period: float) -> ExecutableRecord:
        self.get(cell_name)
        record = self.executables.get(f"{cell_name}/{executable_name}")
        if record is None:
            raise CellError.not_found(f"executable {executable_name} in cell {cell_name}")
        if record.state not in (State.RUNNING, State.STARTING):
            raise CellError.precondition(f"executable {record.key} is not running ({record.state})")
        # To its end even if the caller leaves during the grace period: its SIGKILL must follow.
        return await run_to_end(self.executables.stop(record, grace_period))

    # -- persistence -----------------------------------------------------------------------

    def _save(self, record: CellRecord) -> None:
        self._store.put(KIND, record.spec.name, record.to_doc())  # first: it may fail (disk full)
        self._cells[record.spec.name] = record

    def _delete(self, record: CellRecord) -> None:
        self._store.delete(KIND, record.spec.name)
        self._cells.pop(record.spec.name, None)

    def recover(self) -> None:
        """Reload cells from the store, checked against the kernel; clean what is half-made or gone."""
        records = sorted(self._store.load(KIND, CellRecord.from_doc), key=lambda r: r.spec.name.count("/"))
        for record in records:
            name = record.spec.name
            parent = name.rpartition("/")[0]
            if record.state != "ready" or (parent and parent not in self._cells):
                log.warning(
                    "cell %s was being allocated when auraed stopped, or its parent is gone; removing it",
                    name,
                )
                self._unmake_quietly(record)
                self._store.delete(KIND, name)
            elif not self._cgroups.exists(name):
                # A reboot (a host booted from the host image keeps its store on its data disk):
                # the cell is an allocation the caller made, so its cgroup is made again. Its
                # executables' processes ended with the machine.
                if self._remake(record):
                    self._cells[name] = record
                else:
                    self._store.delete(KIND, name)
            else:
                self._cells[name] = record
        self.executables.recover(lambda cell: cell in self._cells)
        log.info("recovered %d cells and %d executables", len(self._cells), len(self.executables.running()))

    def _remake(self, record: CellRecord) -> bool:
        name = record.spec.name
        self._unmake_quietly(record)
        record.netns_path = None
        try:
            self._make(record)
            self._save(record)
        except (CellError, OSError) as exc:
            log.warning(
                "cell %s is gone from the kernel and cannot be made again (%s); forgetting it", name, exc
            )
            self._unmake_quietly(record)
            return False
        log.warning("cell %s was gone from the kernel (a reboot?): made it again", name)
        return True

    def _unmake_quietly(self, record: CellRecord) -> None:
        try:
            self._unmake(record)
        except CellError as exc:
            log.warning("could not fully remove cell %s: %s", record.spec.name, exc)

    async def shutdown(self, stop_executables: bool, free_cells: bool) -> None:
        if free_cells:
            for record in self.children(None):
                name = record.spec.name
                if name in self._freeing:
                    continue  # a Free under way takes it down (the server's stop grace waits)
                try:
                    await self.free(name, self._default_grace)
                except CellError as exc:  # one that cannot be freed must not keep the rest
                    log.error("shutdown: cannot free cell %s: %s", name, exc.message)
        elif stop_executables:
            running = self.executables.running()
            await asyncio.gather(*(self.executables.stop(r, self._default_grace) for r in running))
        await self.executables.close()
