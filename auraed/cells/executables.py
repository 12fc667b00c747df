"""Executables: processes auraed starts in cells, each supervised by a detached monitor.

The monitor (``auraed.system.monitor``) holds the executable's stdout/stderr, writes them to a
CRI-format log file and records the exit status, so an executable outlives a ``kill -9`` of
auraed and a restarted auraed can still report how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import signal as signals
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from auraed.cells.errors import CellError
from auraed.cells.model import CellSpec, ExecutableSpec
from auraed.errors import ErrorKind
from auraed.observe.events import ObserveHub, SignalEvent
from auraed.observe.logfile import LogSource
from auraed.state.store import Store, StoreError, flat_doc
from auraed.system import processes
from auraed.system.monitor_protocol import ExitRecord, MonitorSpec, read_exit_record
from auraed.system.supervisor import ORPHANED, MonitorStartError, Supervised, Supervisor

log = logging.getLogger(__name__)

KIND = "executable"
KILL_WAIT = 30.0  # seconds for a SIGKILLed executable's monitor to see it end and record it


class State:
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    UNKNOWN = "unknown"


@dataclasses.dataclass
class ExecutableRecord:
    spec: ExecutableSpec
    run_dir: str
    state: str = State.STARTING
    monitor_pid: int = 0
    monitor_ticks: int | None = None
    pid: int = 0
    ticks: int | None = None
    started_at: float = 0.0
    finished_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    # Set (and saved) before auraed SIGKILLs it after its grace period: that kill is not an OOM
    # kill, although the cell's OOM counter may have moved meanwhile (another process's).
    killed_by_us: bool = False

    @property
    def key(self) -> str:
        return self.spec.workload

    @property
    def log_path(self) -> Path:
        return Path(self.run_dir) / "output.log"

    @property
    def supervised(self) -> Supervised:
        return Supervised(self.monitor_pid, self.monitor_ticks, self.pid, self.ticks)

    @property
    def exit_path(self) -> Path:
        return Path(self.run_dir) / "exit.json"

    def to_doc(self) -> dict[str, Any]:
        doc = flat_doc(self)
        doc["spec"] = self.spec.to_doc()
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ExecutableRecord:
        return cls(**{**doc, "spec": ExecutableSpec.from_doc(doc["spec"])})


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an executable of a cell runs: the cgroup files to join and namespaces to use.

    ``isolate_process`` and ``netns_path`` are the cell's own or inherited from a cell above it.
    """

    cell: CellSpec
    cgroup_join_files: list[str]
    oom_counter_file: str | None
    netns_path: str | None
    isolate_process: bool


class Executables:
    def __init__(self, store: Store, hub: ObserveHub, runtime_dir: Path, supervisor: Supervisor) -> None:
        self._store = store
        self._hub = hub
        self._runtime_dir = runtime_dir / "executables"
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._supervisor = supervisor
        self._records: dict[str, ExecutableRecord] = {}

    # -- queries ---------------------------------------------------------------------------

    def get(self, workload: str) -> ExecutableRecord | None:
        return self._records.get(workload)

    def log_source(self, workload: str) -> LogSource | None:
        """Where ``workload``'s output is logged, for ObserveService; None if it is unknown."""
        record = self._records.get(workload)
        if record is None:
            return None
        return LogSource(record.log_path, lambda: record.state not in (State.RUNNING, State.STARTING))

    def in_cell(self, cell_name: str) -> list[ExecutableRecord]:
        return [r for r in self._records.values() if r.spec.cell_name == cell_name]

    def running(self) -> list[ExecutableRecord]:
        return [r for r in self._records.values() if r.state == State.RUNNING]

    # -- lifecycle -------------------------------------------------------------------------

    def _run_dir(self, spec: ExecutableSpec) -> Path:
        # "/" never appears in a DNS label and "_" never does either: the flattening is unambiguous.
        return self._runtime_dir / spec.cell_name.replace("/", "_") / spec.name

    async def start(self, spec: ExecutableSpec, placement: Placement) -> ExecutableRecord:
        existing = self._records.get(spec.workload)
        if existing is not None and existing.state in (State.RUNNING, State.STARTING):
            raise CellError.already_exists(f"executable {spec.workload}")
        run_dir = self._run_dir(spec)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(mode=0o700, parents=True)
        record = ExecutableRecord(spec=spec, run_dir=str(run_dir), started_at=time.time())
        # Written before the monitor exists, so a crash in between is found and cleaned at start.
        self._save(record)
        try:
            await self._spawn(record, placement)
        except BaseException:
            self._forget(record)
            raise
        record.state = State.RUNNING
        self._save(record)
        self._watch(record)
        log.info("started %s as pid %d: %s", spec.workload, record.pid, " ".join(spec.argv)[:200])
        return record

    async def _spawn(self, record: ExecutableRecord, placement: Placement) -> None:
        spec, cell, isolate = record.spec, placement.cell, placement.isolate_process
        monitor_spec = MonitorSpec(
            argv=list(spec.argv),
            env=list(spec.env),
            cwd=spec.cwd,
            uid=spec.uid,
            gid=spec.gid,
            cgroup_join_files=placement.cgroup_join_files,
            oom_counter_file=placement.oom_counter_file,
            log_path=str(record.log_path),
            exit_path=str(record.exit_path),
            new_pid_ns=isolate,
            new_mount_ns=isolate,
            new_uts_ns=isolate,
            new_ipc_ns=isolate,
            hostname=cell.hostname if isolate else None,
            netns_path=placement.netns_path,
        )
        try:
            supervised = await self._supervisor.launch(monitor_spec, Path(record.run_dir))
        except MonitorStartError as exc:
            kind = ErrorKind.UNAVAILABLE if exc.timed_out else ErrorKind.FAILED_PRECONDITION
            raise CellError(kind, f"cannot start {spec.workload}: {exc}") from None
        record.monitor_pid, record.monitor_ticks = supervised.monitor_pid, supervised.monitor_ticks
        record.pid, record.ticks = supervised.pid, supervised.ticks

    def _watch(self, record: ExecutableRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._await_exit(record), name=f"watch {record.key}")
        self._watchers[record.key] = task
        task.add_done_callback(
            lambda t: self._watchers.pop(record.key, None) if self._watchers.get(record.key) is t else None
        )

    async def _await_exit(self, record: ExecutableRecord) -> None:
        def orphaned() -> None:
            log.warning("%s: its monitor ended while it runs; %s", record.key, ORPHANED)

        self._finish(record, await self._supervisor.wait(record.supervised, record.exit_path, orphaned))

    def _finish(self, record: ExecutableRecord, exit_record: ExitRecord | None) -> None:
        """Record how the executable ended, from the monitor's exit record."""
        if exit_record is None:
            record.state = State.UNKNOWN
            log.warning("%s: its monitor ended without recording an exit status", record.key)
        else:
            record.state = State.EXITED
            record.exit_code = exit_record.exit_code
            record.signal = exit_record.signal
            record.oom_killed = exit_record.oom_killed and not record.killed_by_us
            record.finished_at = exit_record.finished_at
        if record.finished_at is None:
            record.finished_at = time.time()
        if record.signal is not None:
            self._hub.signals.publish(SignalEvent(record.signal, record.pid, record.key, "terminated"))
        if self._records.get(record.key) is record:
            self._save(record)
        log.info(
            "%s exited: code=%s signal=%s oom_killed=%s",
            record.key,
            record.exit_code,
            record.signal,
            record.oom_killed,
        )

    async def stop(self, record: ExecutableRecord, grace_period: float) -> ExecutableRecord:
        if record.state != State.RUNNING:
            return record
        watcher = self._watchers.get(record.key)
        self._signal(record, signals.SIGTERM)
        if watcher is not None:
            done, _ = await asyncio.wait({watcher}, timeout=grace_period)
            if not done:
                record.killed_by_us = True  # before the kill: its end is then not an OOM kill
                try:
                    self._save(record)
                except StoreError:  # a full disk must not spare the executable its SIGKILL
                    log.exception("%s: cannot save the record before SIGKILL; killing it anyway", record.key)
                self._signal(record, signals.SIGKILL)
                await asyncio.wait({watcher}, timeout=KILL_WAIT)
        return record

    def _signal(self, record: ExecutableRecord, signal: int) -> None:
        """Signal the executable's process group: it leads one (the monitor makes it a session
        leader), and what it started (a shell's commands) goes with it. Under an init of its own
        (isolate_process) the group is the init's, which passes the signal on."""
        if processes.send_signal(record.pid, signal, record.ticks, group=True):
            self._hub.signals.publish(SignalEvent(signal, record.pid, record.key, "sent"))

    def forget(self, record: ExecutableRecord) -> None:
        """Drop an executable that is no longer running, with its logs."""
        if record.state in (State.RUNNING, State.STARTING):
            raise CellError.precondition(f"executable {record.key} is still running")
        self._forget(record)

    def _forget(self, record: ExecutableRecord) -> None:
        self._store.delete(KIND, record.key)
        if self._records.get(record.key) is record:
            del self._records[record.key]
        shutil.rmtree(record.run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(record.run_dir).parent.rmdir()

    def _save(self, record: ExecutableRecord) -> None:
        self._store.put(KIND, record.key, record.to_doc())  # first: it may fail (disk full)
        self._records[record.key] = record

    # -- restart ---------------------------------------------------------------------------

    def recover(self, cell_exists: Callable[[str], bool]) -> None:
        """Rebuild the view from the store and the kernel after a start or a restart."""
        for record in self._store.load(KIND, ExecutableRecord.from_doc):
            if not cell_exists(record.spec.cell_name):
                self._forget(record)
                continue
            self._records[record.key] = record
            if record.state == State.STARTING:
                # Its monitor's pid was not known yet: it is found by what it writes to.
                killed = Supervisor.kill_unreported(Path(record.run_dir))
                log.warning(
                    "%s was being started when auraed stopped; dropping it (killed monitors %s)",
                    record.key,
                    killed,
                )
                self._forget(record)
            elif record.state == State.RUNNING:
                if Supervisor.alive(record.supervised):
                    log.info("found %s running as pid %d", record.key, record.pid)
                    self._watch(record)
                else:
                    self._finish(record, read_exit_record(record.exit_path))

    async def close(self) -> None:
        """Stop watching (the executables themselves keep running)."""
        for task in list(self._watchers.values()):
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
