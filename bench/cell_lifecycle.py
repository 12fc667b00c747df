"""Cell lifecycle: allocate a cell, start `sleep 30` in it, see it running, stop it, free the cell.

    .venv/bin/python bench/cell_lifecycle.py [--iterations 30] [--warmup 3] [--json-only]

Each iteration against a real auraed (mTLS over its unix socket, one channel):

    Allocate (memory limit 64 MiB) -> Start `sleep 30` -> List until it is listed RUNNING with the
    pid Start returned -> Stop (grace 2 s; sleep dies of the SIGTERM) -> Free

The peer does the same by hand, in this process, on the same cgroup v1 hierarchies auraed uses
(those auraed.system.cgroupfs.find_v1_mounts reports: cpu, cpuacct, cpuset, freezer, memory,
pids, and blkio once auraed drives it): mkdir the cgroup in each (cpuset.cpus/mems copied
from the parent, memory.limit_in_bytes written), Popen `sh -c 'echo $$ > .../cgroup.procs ...;
exec sleep 30'`, wait until /proc/<pid> shows `sleep` (so it has joined the cgroups and exec'd,
which is what auraed's Start waits for), check /proc/<pid>/cgroup, SIGTERM + wait, rmdir. That is
the least any runtime must do; what auraed adds (gRPC + mTLS, validation, SQLite records, a
supervising monitor process per executable, freeze-and-kill on free) is the overhead measured.

A third series drives auraed's own Cells class in this process (same SQLite store, monitors and
cgroupfs driver, no gRPC), splitting the daemon's time into RPC and cell logic. A fourth,
``bare_tasks``, is the peer joining the way auraed's cells do on v1: `echo 0 > .../tasks` moves
the writing thread only, and the kernel then skips the grace period described below; it is
reported beside the target's peer, not instead of it. The four series alternate, so load
changes on the machine hit them alike, and each iteration starts after ``--gap-ms`` (100) of
idle time: the kernel makes the first cgroup migration after a quiet spell
wait for an RCU grace period (milliseconds), and without the gap whichever series ran right
after another one's migration would skip that wait. References measured alone afterwards (an RPC
floor, interpreter start, monitor start and exit, cgroup attach after idle and back to back, the
cgroupfs driver) show where auraed's time goes.

Target (issue): auraed at most 2x the bare peer (p50 per iteration).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    CGROUP_ROOT,
    Daemon,
    exit_on_sigterm,
    machine_info,
    make_pki,
    print_json,
    print_lines,
    print_table,
    ratio,
    remove_cgroup_base,
    summarize,
    temp_dir,
    verdict,
    wait_exit,
)

from auraed.api.aurae.cells import v0 as pb
from auraed.cells.cells import Cells
from auraed.cells.executables import State
from auraed.cells.model import parse_cell, parse_executable
from auraed.client import AuraeClient
from auraed.observe.events import ObserveHub
from auraed.state.store import Store
from auraed.system import processes
from auraed.system.cgroupfs import Cgroupfs, CgroupLayout, CgroupLimits, detect_layout, find_v1_mounts
from auraed.system.monitor import MONITOR_PATH, monitor_command
from auraed.system.monitor_protocol import MonitorSpec
from auraed.system.supervisor import Supervisor

CELLS = "aurae.cells.v0.CellService"
MEMORY_MAX = 64 << 20
GRACE_MS = 2000
SEE_RUNNING_TIMEOUT = 10.0
TARGET_RATIO = 2.0
PHASES = ("allocate", "start", "see_running", "stop", "free")
REFERENCE_SAMPLES = 20


class Phases:
    """Wall-clock split of one iteration: ``mark(phase)`` ends ``phase`` and starts the next."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.durations[phase] = now - self._last
        self._last = now

    def finish(self) -> dict[str, float]:
        self.durations["total"] = self._last - self._start
        return self.durations


# ------------------------------------------------------------------------------ auraed


async def auraed_iteration(client: AuraeClient, name: str) -> dict[str, float]:
    phases = Phases()
    cell = pb.Cell(name=name, memory=pb.MemoryController(max=MEMORY_MAX))
    await client.call(CELLS, "Allocate", pb.CellServiceAllocateRequest(cell=cell))
    phases.mark("allocate")
    executable = pb.Executable(name="sleeper", args=["sleep", "30"])
    started = await client.call(
        CELLS, "Start", pb.CellServiceStartRequest(cell_name=name, executable=executable)
    )
    phases.mark("start")
    await see_running(client, name, started.pid)
    phases.mark("see_running")
    stopped = await client.call(
        CELLS,
        "Stop",
        pb.CellServiceStopRequest(cell_name=name, executable_name="sleeper", grace_period_ms=GRACE_MS),
    )
    phases.mark("stop")
    status = stopped.status
    if status.state != pb.ExecutableState.EXITED or status.signal != signal.SIGTERM:
        raise RuntimeError(f"sleep did not end by SIGTERM: {status}")
    await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name=name, grace_period_ms=GRACE_MS))
    phases.mark("free")
    return phases.finish()


async def see_running(client: AuraeClient, name: str, pid: int) -> None:
    deadline = time.monotonic() + SEE_RUNNING_TIMEOUT
    while True:
        listed = await client.call(CELLS, "List", pb.CellServiceListRequest())
        for node in listed.cells:
            if node.cell.name == name and any(
                e.pid == pid and e.state == pb.ExecutableState.RUNNING for e in node.executables
            ):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}/sleeper (pid {pid}) was not listed RUNNING in time")
        await asyncio.sleep(0.001)


# ------------------------------------------------------------------------------ auraed in-process


class InProcess:
    """auraed's own Cells, driven directly in this process: the daemon's cell logic without gRPC.

    Same store (SQLite), monitors and cgroupfs driver as the daemon; what the daemon adds on top
    is the RPC (mTLS, authorization, validation, betterproto2) and running beside grpc's threads.
    """

    def __init__(self, root: Path, base: str) -> None:
        self.store = Store(root / "state" / "auraed.db")
        hub = ObserveHub.create(1000)
        loop = asyncio.get_running_loop()
        hub.daemon_log.bind(loop)
        hub.signals.bind(loop)
        self.supervisor = Supervisor(root / "run")
        self.cells = Cells(
            self.store,
            hub,
            Cgroupfs(base=base),
            runtime_dir=root / "run",
            default_grace_period=GRACE_MS / 1000,
            supervisor=self.supervisor,
        )

    async def iteration(self, name: str) -> dict[str, float]:
        phases = Phases()
        await self.cells.allocate(parse_cell(pb.Cell(name=name, memory=pb.MemoryController(max=MEMORY_MAX))))
        phases.mark("allocate")
        executable = pb.Executable(name="sleeper", args=["sleep", "30"])
        record = await self.cells.start(parse_executable(name, executable))
        phases.mark("start")
        if record.state != State.RUNNING or not processes.is_alive(record.pid, record.ticks):
            raise RuntimeError(f"{name}/sleeper is not running: {record.state}")
        phases.mark("see_running")
        stopped = await self.cells.stop(name, "sleeper", GRACE_MS / 1000)
        phases.mark("stop")
        if stopped.signal != signal.SIGTERM:
            raise RuntimeError(f"sleep did not end by SIGTERM: {stopped.state} {stopped.signal}")
        await self.cells.free(name, GRACE_MS / 1000)
        phases.mark("free")
        return phases.finish()

    async def close(self) -> None:
        try:
            await self.cells.shutdown(stop_executables=True, free_cells=True)
        finally:
            self.supervisor.close()
            self.store.close()


# ------------------------------------------------------------------------------ the bare peer


class Bare:
    """Cells by hand: one directory per v1 hierarchy, a shell that joins them and execs sleep."""

    def __init__(self, base: str) -> None:
        mounts = find_v1_mounts(CGROUP_ROOT)
        self.hierarchies: list[Path] = list(dict.fromkeys(mounts.values()))
        self.cpuset = mounts.get("cpuset")
        self.memory = mounts.get("memory")
        self.base = base
        self.process: subprocess.Popen[bytes] | None = None
        for hierarchy in self.hierarchies:  # the base exists once, like auraed's
            self._mkdir(hierarchy / base)

    def _mkdir(self, directory: Path) -> None:
        directory.mkdir()
        if self.cpuset is not None and directory.is_relative_to(self.cpuset):
            for name in ("cpuset.cpus", "cpuset.mems"):
                (directory / name).write_text((directory.parent / name).read_text().strip())

    def iteration(self, name: str, join_through_tasks: bool = False) -> dict[str, float]:
        """``join_through_tasks``: the shell writes 0 to each v1 ``tasks`` file (moving its one
        thread, as auraed's cells do: the kernel skips the grace period), not $$ to cgroup.procs."""
        phases = Phases()
        dirs = [hierarchy / self.base / name for hierarchy in self.hierarchies]
        for directory in dirs:
            self._mkdir(directory)
        if self.memory is not None:
            (self.memory / self.base / name / "memory.limit_in_bytes").write_text(str(MEMORY_MAX))
        phases.mark("allocate")
        if join_through_tasks:
            joins = "".join(f"echo 0 > {shlex.quote(str(d / 'tasks'))}; " for d in dirs)
        else:
            joins = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}; " for d in dirs)
        self.process = subprocess.Popen(
            ["/bin/sh", "-c", joins + "exec sleep 30"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        pid = self.process.pid
        wait_for_exec(pid, "sleep")
        phases.mark("start")
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        if f"/{self.base}/{name}\n" not in cgroups:
            raise RuntimeError(f"pid {pid} is not in the cell's cgroups:\n{cgroups}")
        phases.mark("see_running")
        self.process.send_signal(signal.SIGTERM)
        wait_exit(self.process, GRACE_MS / 1000)
        self.process = None
        phases.mark("stop")
        for directory in dirs:
            directory.rmdir()
        phases.mark("free")
        return phases.finish()

    def attach_costs(self, count: int, idle: float) -> dict[str, list[float]]:
        """One write to cgroup.procs, after ``idle`` seconds without any and right after another.

        The kernel makes the first cgroup migration after a quiet spell wait for an RCU grace
        period (cgroup_threadgroup_rwsem switching to its slow mode); back-to-back ones do not.
        """
        directory = self.hierarchies[0] / self.base / "attach"
        self._mkdir(directory)
        cold: list[float] = []
        warm: list[float] = []
        self.process = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL)
        pid = str(self.process.pid)
        try:
            for _ in range(count):
                time.sleep(idle)
                cold.append(_timed_write(directory / "cgroup.procs", pid))
                warm.append(_timed_write(directory.parent / "cgroup.procs", pid))
        finally:
            self.process.kill()
            self.process.wait()
            self.process = None
            directory.rmdir()
        return {"cgroup_attach_after_idle": cold, "cgroup_attach_back_to_back": warm}

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        remove_cgroup_base(self.base)


def _timed_write(file: Path, value: str) -> float:
    start = time.perf_counter()
    file.write_text(value)
    return time.perf_counter() - start


def wait_for_exec(pid: int, command: str, timeout: float = 10.0) -> None:
    comm = Path(f"/proc/{pid}/comm")
    deadline = time.monotonic() + timeout
    while comm.read_text().strip() != command:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not exec {command} in time")
        time.sleep(0.0005)


# ------------------------------------------------------------------------------ references


def timed_runs(function: Callable[[], object], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return samples


def python_startup() -> list[float]:
    """How long `python -I -S -c pass` takes: the floor under every monitor auraed starts."""
    argv = [sys.executable, "-I", "-S", "-c", "pass"]
    return timed_runs(lambda: subprocess.run(argv, check=True), REFERENCE_SAMPLES)


def monitor_compile() -> list[float]:
    """Compiling monitor.py: run as a script, it is compiled on every start (scripts get no .pyc)."""
    source = Path(MONITOR_PATH).read_text()
    return timed_runs(lambda: compile(source, MONITOR_PATH, "exec"), REFERENCE_SAMPLES)


def monitor_costs(directory: Path, count: int) -> dict[str, list[float]]:
    """auraed's per-executable monitor run by hand (no cgroups, no daemon): its share of Start and Stop.

    ``monitor_report``: from spawning the monitor until it reports the pid of an exec'd `sleep 30`
    (what Start waits for); ``monitor_exit``: from SIGTERM to `sleep` until the monitor has written
    exit.json and exited (what Stop waits for).
    """
    reported: list[float] = []
    exited: list[float] = []
    env = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}"]
    for i in range(count):
        run_dir = directory / f"monitor-{i}"
        run_dir.mkdir(parents=True)
        spec = MonitorSpec(
            argv=["sleep", "30"],
            env=env,
            log_path=str(run_dir / "output.log"),
            exit_path=str(run_dir / "exit.json"),
        )
        spec_path = run_dir / "monitor.json"
        spec_path.write_text(spec.to_json())
        read_end, write_end = os.pipe()
        child: subprocess.Popen[bytes] | None = None
        try:
            start = time.perf_counter()
            with (run_dir / "monitor.log").open("ab") as log:
                child = subprocess.Popen(
                    monitor_command(str(spec_path), write_end),
                    pass_fds=[write_end],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            os.close(write_end)
            write_end = -1
            with os.fdopen(read_end, "rb") as sync:
                read_end = -1
                report = json.loads(sync.read())
            reported.append(time.perf_counter() - start)
            start = time.perf_counter()
            os.kill(int(report["pid"]), signal.SIGTERM)
            wait_exit(child, 10)
            exited.append(time.perf_counter() - start)
        finally:
            for fd in (read_end, write_end):
                if fd >= 0:
                    os.close(fd)
            if child is not None and child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    return {"monitor_report": reported, "monitor_exit": exited}


async def rpc_floor(client: AuraeClient, count: int) -> list[float]:
    """grpc.health.v1 Check to the same daemon: the cost of any one RPC (mTLS, authorization)."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await client.health()
        samples.append(time.perf_counter() - start)
    return samples


def driver_costs(base: str, count: int) -> dict[str, list[float]]:
    """auraed's own cgroupfs driver, called in-process: the kernel-side share of Allocate and Free."""
    cgroups = Cgroupfs(base=base)
    created: list[float] = []
    removed: list[float] = []
    for i in range(count):
        name = f"drv-{i}"
        start = time.perf_counter()
        cgroups.create(name, CgroupLimits(memory_max=MEMORY_MAX))
        created.append(time.perf_counter() - start)
        start = time.perf_counter()
        cgroups.kill_all(name)
        cgroups.remove(name)
        removed.append(time.perf_counter() - start)
    return {"create": created, "kill_all_and_remove": removed}


# ------------------------------------------------------------------------------ the run


Iterations = dict[str, list[dict[str, float]]]


async def run(
    args: argparse.Namespace, daemon: Daemon, bare: Bare, inprocess_root: Path, inprocess_base: str
) -> tuple[Iterations, list[float]]:
    results: Iterations = {"auraed": [], "bare": [], "auraed_inprocess": [], "bare_tasks": []}
    inprocess = InProcess(inprocess_root, inprocess_base)
    try:
        async with daemon.client() as client:
            for i in range(args.warmup + args.iterations):
                name = f"bench-{i}"
                gap = args.gap_ms / 1000
                await asyncio.sleep(gap)
                measured = {"auraed": await auraed_iteration(client, name)}
                await asyncio.sleep(gap)
                measured["bare"] = bare.iteration(name)
                await asyncio.sleep(gap)
                measured["auraed_inprocess"] = await inprocess.iteration(name)
                await asyncio.sleep(gap)
                measured["bare_tasks"] = bare.iteration(name, join_through_tasks=True)
                if i >= args.warmup:
                    for series, phases in measured.items():
                        results[series].append(phases)
            health = await rpc_floor(client, 100)
    finally:
        await inprocess.close()
    return results, health


def phase_stats(iterations: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {phase: summarize([it[phase] for it in iterations]) for phase in (*PHASES, "total")}


def report(
    args: argparse.Namespace, raw: Iterations, refs: dict[str, list[float]], hierarchies: list[str]
) -> dict[str, Any]:
    auraed, bare = phase_stats(raw["auraed"]), phase_stats(raw["bare"])
    inprocess = phase_stats(raw["auraed_inprocess"])
    bare_tasks = phase_stats(raw["bare_tasks"])
    reference = {name: summarize(values) for name, values in refs.items()}
    ratio_p50 = ratio(auraed["total"]["p50_ms"], bare["total"]["p50_ms"])
    passed = ratio_p50 <= TARGET_RATIO
    result: dict[str, Any] = {
        "benchmark": "cell_lifecycle",
        "machine": machine_info(),
        "iterations": args.iterations,
        "warmup": args.warmup,
        "gap_ms": args.gap_ms,
        "bare_hierarchies": hierarchies,
        "auraed": auraed,
        "bare": bare,
        "auraed_inprocess": inprocess,
        "bare_tasks": bare_tasks,
        "reference": reference,
        "ratio_p50_auraed_over_bare": ratio_p50,
        "ratio_mean_auraed_over_bare": ratio(auraed["total"]["mean_ms"], bare["total"]["mean_ms"]),
        "ratio_p50_auraed_over_bare_tasks": ratio(auraed["total"]["p50_ms"], bare_tasks["total"]["p50_ms"]),
        "target": {"ratio_p50_at_most": TARGET_RATIO, "result": verdict(passed)},
    }
    if not args.json_only:
        rows = [
            [
                phase,
                auraed[phase]["p50_ms"],
                auraed[phase]["mean_ms"],
                inprocess[phase]["p50_ms"],
                bare[phase]["p50_ms"],
                bare[phase]["mean_ms"],
                bare_tasks[phase]["p50_ms"],
            ]
            for phase in (*PHASES, "total")
        ]
        print_table(
            f"Cell lifecycle (ms), {args.iterations} iterations per series, {args.gap_ms} ms idle first",
            ["phase", "auraed p50", "auraed mean", "in-process p50", "bare p50", "bare mean", "tasks p50"],
            rows,
        )
        print_table(
            "References (ms)",
            ["measured alone", "p50", "p90", "n"],
            [[name, stats["p50_ms"], stats["p90_ms"], stats["n"]] for name, stats in reference.items()],
        )
        print_lines(
            [
                f"ratio auraed/bare: p50 {ratio_p50}x, mean {result['ratio_mean_auraed_over_bare']}x",
                f"ratio auraed/bare via tasks (not the target's peer): p50 "
                f"{result['ratio_p50_auraed_over_bare_tasks']}x",
                f"target auraed <= {TARGET_RATIO}x bare: {verdict(passed)}",
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=30, help="measured iterations (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations (default 3)")
    parser.add_argument(
        "--gap-ms",
        type=int,
        default=100,
        help="idle time before each iteration of each series (default 100; see the module docstring)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.gap_ms < 0:
        parser.error("--iterations must be positive, --warmup and --gap-ms not negative")
    if os.geteuid() != 0:
        parser.exit(2, "cell_lifecycle: needs root (it creates cgroups)\n")
    if detect_layout() is CgroupLayout.V2:
        parser.exit(2, "cell_lifecycle: the bare peer is written for cgroup v1/hybrid hosts\n")

    exit_on_sigterm()
    bare_base = f"aurae-bench-bare-{os.getpid()}"
    driver_base = f"aurae-bench-driver-{os.getpid()}"
    inprocess_base = f"aurae-bench-inprocess-{os.getpid()}"
    with temp_dir("auraed-bench-cells-") as root:
        daemon = Daemon(root / "daemon", make_pki(root))
        bare: Bare | None = None
        try:
            daemon.start()
            bare = Bare(bare_base)
            hierarchies = [h.name for h in bare.hierarchies]
            raw, health = asyncio.run(run(args, daemon, bare, root / "inprocess", inprocess_base))
            refs = {
                "rpc_health_check": health,
                "python_-I_-S_startup": python_startup(),
                "monitor_py_compile": monitor_compile(),
            }
            refs.update(monitor_costs(root / "monitors", REFERENCE_SAMPLES))
            refs.update(bare.attach_costs(REFERENCE_SAMPLES, max(args.gap_ms, 100) / 1000))
            refs.update(
                {f"cgroupfs_driver_{k}": v for k, v in driver_costs(driver_base, REFERENCE_SAMPLES).items()}
            )
        except Exception:
            with contextlib.suppress(Exception):
                sys.stderr.write(daemon.log()[-4000:])
            raise
        finally:
            try:
                daemon.cleanup()
            finally:
                if bare is not None:
                    bare.cleanup()
                remove_cgroup_base(bare_base)
                remove_cgroup_base(driver_base)
                remove_cgroup_base(inprocess_base)
    print_json(report(args, raw, refs, hierarchies))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
