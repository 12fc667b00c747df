"""Container start: Create + Start of a busybox container running `echo ready`, until its first line.

    .venv/bin/python bench/container_start.py [--iterations 20] [--warmup 3] [--json-only]

Each iteration runs six series, in an order that rotates from one iteration to the next, each
after ``--gap-ms`` (100) of idle time, so load changes on the machine and the kernel's cgroup
quirks (see cell_lifecycle.py) hit them alike:

* ``auraed_poll``   - Create (rootfs and bundle; ``runc create`` under the monitor runs after
                      its reply), Start (releases the init at its exec fifo), then Logs (no
                      follow) every millisecond until the line is there: the moment a client
                      can first read it;
* ``auraed_follow`` - Create, open a following Logs stream, Start, until the line arrives on the
                      stream (timed when it arrives, which may be before Start's reply:
                      ``first_line_after_start`` is then negative);
* ``auraed_oneshot``- one Create with ``start`` set (what ``aer container run`` sends: one RPC
                      fewer; ``runc run --detach`` under the monitor), then Logs polled as in
                      ``auraed_poll``;
* ``bare_run``      - the peer: mount an overlay over auraed's own layer snapshot (what auraed's
                      Create mounts), then ``runc run`` of a bundle holding the exact config.json
                      auraed wrote for its first warm-up container (root path and cgroupsPath
                      changed), from the mount until "ready" arrives on runc's stdout pipe;
* ``bare_split``    - the same with ``runc create`` + ``runc start`` as two commands (auraed runs
                      the first and does what the second does itself);
* ``bare_monitor``  - auraed minus the daemon: the mount, auraed's own monitor (through its
                      Supervisor, in this process) running ``runc run --detach``, until the line
                      is in the monitor's CRI log file (looked at every millisecond from the
                      launch on: stdout is logged while runc still runs).

Both sides run the same runc (1.1), the same rootfs (overlayfs over the same snapshot) and the
same OCI config (namespaces incl. a new network namespace, seccomp, masked paths, cgroup); the
difference is auraed's own work: two RPCs (mTLS), validation, SQLite records, a Python monitor
per container that runs runc and copies the output into a CRI log file, and
reading the log back through Logs.

Where auraed's time goes: the client times each call; the daemon's side is read off the files it
writes (bundle/config.json after the mount and spec, monitor.json just before the monitor is
spawned, container.pid when ``runc create`` or ``run --detach`` is about done) and the CRI timestamp the
monitor gives the line. References measured alone afterwards: an RPC floor (health check) and Python start-up.

Target (issue): auraed at most 1.3x bare ``runc run`` (p50, first line available).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from common import (
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

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, log_lines
from auraed.containers.rootfs import mount_rootfs, unmount_rootfs
from auraed.observe.logfile import POLL_LONGEST as LOGS_FOLLOW_POLL_INTERVAL
from auraed.observe.logfile import read_tail
from auraed.system import namespaces
from auraed.system.monitor_protocol import MonitorSpec
from auraed.system.supervisor import Supervisor

if TYPE_CHECKING:
    from tests.support.images import BuiltImage

CONTAINERS = "aurae.containers.v0.ContainerService"
REPO = Path(__file__).resolve().parents[1]
IMAGE = "bench/busybox:1"
LINE = "ready"
TARGET_RATIO = 1.3
RUNC = shutil.which("runc") or "runc"
LINE_TIMEOUT = 20.0
POLL_INTERVAL = 0.001
SERIES = ("auraed_poll", "auraed_follow", "auraed_oneshot", "bare_run", "bare_split", "bare_monitor")
REFERENCE_SAMPLES = 20


def source_state() -> dict[str, Any]:
    """The commit measured and the daemon's files modified on top of it (other work in progress)."""

    def git(*argv: str) -> str:
        result = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=False)
        return result.stdout

    modified = [line[3:] for line in git("status", "--porcelain", "--", "auraed").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "modified": modified}


def tests_support() -> None:
    """Make ``tests.support`` importable: scripts run with bench/ (not the repository) on sys.path."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def build_image(directory: Path) -> BuiltImage:
    tests_support()
    from tests.support.images import build_busybox_layout

    return build_busybox_layout(directory)


# ------------------------------------------------------------------------------ auraed


class Auraed:
    """Containers through a real daemon; every iteration leaves nothing behind (Wait + Delete)."""

    def __init__(self, client: AuraeClient) -> None:
        self.client = client
        self.config_json: dict[str, Any] | None = None  # auraed's bundle config, from the first container

    async def _create(self, name: str, start: bool) -> pb.ContainerStatus:
        config = pb.ContainerConfig(name=name, image=IMAGE, command=["echo", LINE])
        request = pb.ContainerServiceCreateRequest(config=config, start=start)
        reply = await self.client.call(CONTAINERS, "Create", request)
        status: pb.ContainerStatus = reply.status
        return status

    async def _start(self, name: str) -> None:
        await self.client.call(CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id=name))

    async def _poll_first_line(self, name: str) -> Any:
        deadline = time.monotonic() + LINE_TIMEOUT
        request = pb.ContainerServiceLogsRequest(container_id=name)
        while True:
            item = await first_line(self.client.stream(CONTAINERS, "Logs", request, timeout=LINE_TIMEOUT))
            if item is not None:
                return item
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no output in {LINE_TIMEOUT:.0f} s")
            await asyncio.sleep(POLL_INTERVAL)

    async def _follow_first_line(self, name: str) -> tuple[Any, float, float]:
        """The first line and when it arrived (perf_counter, wall clock): it may come before
        Start's reply, and the iteration only looks at it after that."""
        request = pb.ContainerServiceLogsRequest(container_id=name, follow=True)
        item = await first_line(self.client.stream(CONTAINERS, "Logs", request, timeout=LINE_TIMEOUT))
        if item is not None:
            return item, time.perf_counter(), time.time()
        raise RuntimeError(f"{name}: the log stream ended without a line")

    async def iteration(self, name: str, follow: bool, oneshot: bool = False) -> dict[str, float]:
        """Create + Start, or with ``oneshot`` one Create that starts (``runc run --detach``)."""
        clock, wall = time.perf_counter, time.time
        t0, w0 = clock(), wall()
        status = await self._create(name, start=oneshot)
        t1 = clock()
        follower = asyncio.ensure_future(self._follow_first_line(name)) if follow else None
        try:
            if not oneshot:
                await self._start(name)
            t2, w2 = clock(), wall()
            if follower is not None:
                item, t3, w3 = await follower
            else:
                item = await self._poll_first_line(name)
                t3, w3 = clock(), wall()
        finally:
            if follower is not None and not follower.done():
                follower.cancel()
                with contextlib.suppress(BaseException):
                    await follower
        if item.line != LINE or item.stream != "stdout":
            raise RuntimeError(f"{name}: first line {item.line!r} on {item.stream}, not {LINE!r} on stdout")
        directory = Path(status.log_path).parent
        files = await asyncio.to_thread(file_times, directory)
        if self.config_json is None:
            self.config_json = json.loads(
                await asyncio.to_thread((directory / "bundle" / "config.json").read_text)
            )
        await self._finish(name)
        logged = item.timestamp
        return {
            "total": t3 - t0,
            "create_rpc": t1 - t0,
            "start_rpc": t2 - t1,
            "first_line_after_start": t3 - t2,
            # The daemon's side, from the files it writes (wall clock):
            "create_until_bundle_written": files["bundle"] - w0,
            "bundle_until_monitor_spawn": files["monitor"] - files["bundle"],
            "monitor_spawn_until_pid_file": files["pid"] - files["monitor"],
            "pid_file_until_start_reply": w2 - files["pid"],
            "start_reply_until_line_logged": logged - w2,
            "line_logged_until_client_has_it": w3 - logged,
        }

    async def _finish(self, name: str) -> None:
        reply = await self.client.call(
            CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id=name), timeout=30
        )
        if reply.status.exit_code != 0:
            raise RuntimeError(f"{name} exited with {reply.status.exit_code}")
        await self.client.call(
            CONTAINERS, "Delete", pb.ContainerServiceDeleteRequest(container_id=name, force=True)
        )


async def first_line(stream: AsyncIterator[Any]) -> Any:
    """The first line (a LogLine) of a Logs stream (None if it ends without one); the call is then
    cancelled."""
    generator = cast(AsyncGenerator[Any, None], stream)  # AuraeClient.stream is an async generator
    try:
        async for reply in generator:
            if lines := log_lines(reply):
                return lines[0]
        return None
    finally:
        await generator.aclose()


def file_times(directory: Path) -> dict[str, float]:
    """Modification times (wall clock, seconds) of the files auraed writes for a container, in order."""
    return {
        "bundle": (directory / "bundle" / "config.json").stat().st_mtime_ns / 1e9,
        "monitor": (directory / "monitor.json").stat().st_mtime_ns / 1e9,
        "pid": (directory / "container.pid").stat().st_mtime_ns / 1e9,
    }


# ------------------------------------------------------------------------------ the bare peer


class Bare:
    """runc by hand on one bundle: auraed's config.json, an overlay over auraed's snapshot."""

    def __init__(self, root: Path, lowers: list[Path], config: dict[str, Any], cgroup_base: str) -> None:
        self.root = root
        self.state = root / "runc"  # runc --root: its own, apart from the daemon's
        self.bundle = root / "bundle"
        self.rootfs = self.bundle / "rootfs"
        self.lowers = lowers
        self.cgroup_base = cgroup_base
        self.config = copy.deepcopy(config)
        self.config["root"]["path"] = "rootfs"  # relative to the bundle
        self.bundle.mkdir(parents=True)
        self.state.mkdir()
        self.running: str | None = None

    def _prepare(self, container_id: str) -> None:
        self.config["linux"]["cgroupsPath"] = f"/{self.cgroup_base}/{container_id}"
        self.config["hostname"] = container_id
        (self.bundle / "config.json").write_text(json.dumps(self.config, indent=1))
        for name in ("upper", "work"):
            shutil.rmtree(self.root / name, ignore_errors=True)

    def _mount(self) -> None:
        mount_rootfs(self.lowers, self.root / "upper", self.root / "work", self.rootfs)

    def run(self, container_id: str) -> dict[str, float]:
        """Mount, ``runc run``, until the line is on runc's stdout; then wait, unmount."""
        self._prepare(container_id)
        clock = time.perf_counter
        t0 = clock()
        self._mount()
        t1 = clock()
        with (self.root / "runc.log").open("ab") as errors:
            process = subprocess.Popen(
                [RUNC, "--root", str(self.state), "run", "--bundle", str(self.bundle), container_id],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                start_new_session=True,
            )
        self.running = container_id
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            t2 = clock()
            rest = process.stdout.read()
            code = wait_exit(process, LINE_TIMEOUT)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        check_output(container_id, line + rest, code)
        self._cleanup(container_id)
        return {"total": t2 - t0, "mount": t1 - t0, "runc_run_until_line": t2 - t1}

    def split(self, container_id: str) -> dict[str, float]:
        """Mount, ``runc create`` (stdout: a pipe), ``runc start``, until the line is on the pipe."""
        self._prepare(container_id)
        read_end, write_end = os.pipe()
        clock = time.perf_counter
        base = [RUNC, "--root", str(self.state)]
        try:
            t0 = clock()
            self._mount()
            t1 = clock()
            with (self.root / "runc.log").open("ab") as errors:
                create = subprocess.Popen(
                    [*base, "create", "--bundle", str(self.bundle), "--pid-file", str(self.root / "pid"),
                     container_id],
                    stdin=subprocess.DEVNULL,
                    stdout=write_end,
                    stderr=errors,
                    start_new_session=True,
                )  # fmt: skip
                self.running = container_id
                os.close(write_end)
                write_end = -1
                if wait_exit(create, LINE_TIMEOUT) != 0:
                    raise RuntimeError(f"runc create {container_id} failed: see {self.root / 'runc.log'}")
                t2 = clock()
                subprocess.run([*base, "start", container_id], stdin=subprocess.DEVNULL, stderr=errors,
                               check=True, timeout=LINE_TIMEOUT)  # fmt: skip
            t3 = clock()
            with os.fdopen(read_end, "rb") as output:
                read_end = -1
                line = output.readline()
                t4 = clock()
                rest = output.read()  # until the container (its only writer) has exited
        finally:
            for fd in (read_end, write_end):
                if fd >= 0:
                    os.close(fd)
        check_output(container_id, line + rest, 0)
        self._cleanup(container_id)
        return {
            "total": t4 - t0,
            "mount": t1 - t0,
            "runc_create": t2 - t1,
            "runc_start": t3 - t2,
            "line_after_start": t4 - t3,
        }

    async def monitored(self, container_id: str, supervisor: Supervisor) -> dict[str, float]:
        """As auraed does it, minus the daemon: mount, auraed's monitor running ``runc run --detach``
        (through auraed's Supervisor, in this process), until the line is in the CRI log."""
        await asyncio.to_thread(self._prepare, container_id)
        run_dir = self.root / "monitor" / container_id
        run_dir.mkdir(parents=True)
        pid_file = run_dir / "container.pid"
        spec = MonitorSpec(
            argv=[RUNC, "--root", str(self.state), "run", "--detach", "--bundle", str(self.bundle),
                  "--pid-file", str(pid_file), container_id],
            log_path=str(run_dir / "container.log"),
            exit_path=str(run_dir / "exit.json"),
            subreaper=True,
            pid_file=str(pid_file),
            runtime_starts=True,
        )  # fmt: skip
        clock = time.perf_counter
        t0 = clock()
        await asyncio.to_thread(self._mount)
        t1 = clock()
        # The monitor logs stdout while runc still runs: look for the line meanwhile.
        logged = asyncio.ensure_future(logged_lines(run_dir / "container.log"))
        try:
            supervised = await supervisor.launch(spec, run_dir)
        except BaseException:
            logged.cancel()
            raise
        self.running = container_id
        t2 = clock()
        lines, t3 = await logged
        exit_record = await supervisor.wait(supervised, run_dir / "exit.json")
        if lines != [LINE] or exit_record is None or exit_record.exit_code != 0:
            raise RuntimeError(f"{container_id}: logged {lines!r}, exit {exit_record!r}")
        await asyncio.to_thread(self._cleanup, container_id)
        return {
            "total": t3 - t0,
            "mount": t1 - t0,
            "monitor_until_line_logged": t3 - t1,
            "monitor_until_report": t2 - t1,
        }

    def _cleanup(self, container_id: str) -> None:
        runc_delete(self.state, container_id)
        self.running = None
        unmount_rootfs(self.rootfs)

    def cleanup(self) -> None:
        if self.running is not None:
            runc_delete(self.state, self.running)
        with contextlib.suppress(Exception):
            unmount_rootfs(self.rootfs)
        remove_cgroup_base(self.cgroup_base)


async def logged_lines(log: Path) -> tuple[list[str], float]:
    """The lines of a CRI log file, as soon as it holds one complete line (looked at every ms),
    and when they were seen (perf_counter)."""
    deadline = time.monotonic() + LINE_TIMEOUT
    while True:
        lines, _, _ = await asyncio.to_thread(read_tail, log, frozenset({"stdout", "stderr"}), 100)
        if lines:
            return [line.content for line in lines], time.perf_counter()
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing logged in {log} in {LINE_TIMEOUT:.0f} s")
        await asyncio.sleep(POLL_INTERVAL)


def check_output(container_id: str, output: bytes, code: int) -> None:
    if output != f"{LINE}\n".encode() or code != 0:
        raise RuntimeError(f"{container_id}: runc printed {output[:200]!r} and exited {code}")


def runc_delete(state: Path, container_id: str) -> None:
    subprocess.run(
        [RUNC, "--root", str(state), "delete", "--force", container_id],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
        timeout=30,
    )


# ------------------------------------------------------------------------------ clean-up


def runc_leftovers(state: Path) -> None:
    """``runc delete --force`` whatever a runc state directory still knows (after a failure)."""
    if not state.is_dir():
        return
    for entry in state.iterdir():
        if entry.is_dir():
            runc_delete(state, entry.name)


def unmount_below(root: Path) -> None:
    """Unmount (lazily if busy) every mount at or below ``root``, deepest first."""
    prefix = os.fspath(root) + "/"
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    for point in sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True):
        with contextlib.suppress(OSError):
            namespaces.umount(point, namespaces.MNT_DETACH)


# ------------------------------------------------------------------------------ references


def timed_runs(function: Callable[[], object], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return samples


def python_startup() -> list[float]:
    """``python -I -S -c pass``: the floor under the monitor auraed spawns for every container."""
    argv = [sys.executable, "-I", "-S", "-c", "pass"]
    return timed_runs(lambda: subprocess.run(argv, check=True), REFERENCE_SAMPLES)


async def rpc_floor(client: AuraeClient, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await client.health()
        samples.append(time.perf_counter() - start)
    return samples


# ------------------------------------------------------------------------------ the run


Iterations = dict[str, list[dict[str, float]]]


async def run(
    args: argparse.Namespace, root: Path, daemon: Daemon, image: BuiltImage, bare_base: str
) -> tuple[Iterations, dict[str, list[float]]]:
    results: Iterations = {name: [] for name in SERIES}
    async with daemon.client() as client:
        request = pb.ContainerServiceImportImageLayoutRequest(
            path=str(image.layout), ref_name=image.ref_name, reference=IMAGE
        )
        await client.call(CONTAINERS, "ImportImageLayout", request)
        auraed = Auraed(client)
        await auraed.iteration("first", follow=False)  # its config.json becomes the bare bundle's
        assert auraed.config_json is not None
        snapshots = daemon.root / "state" / "images" / "snapshots"
        lowers = [snapshots / layer.diff_id.split(":", 1)[1] for layer in reversed(image.layers)]
        if not all(lower.is_dir() for lower in lowers):
            raise RuntimeError(f"auraed's layer snapshots are not where expected: {lowers}")
        bare = Bare(root / "bare", lowers, auraed.config_json, bare_base)
        supervisor = Supervisor(root / "bare-monitor")
        try:
            for i in range(args.warmup + args.iterations):
                measured: dict[str, dict[str, float]] = {}
                for series in SERIES[i % len(SERIES) :] + SERIES[: i % len(SERIES)]:
                    await asyncio.sleep(args.gap_ms / 1000)
                    name = f"{series.replace('_', '-')}-{i}"
                    if series == "auraed_poll":
                        measured[series] = await auraed.iteration(name, follow=False)
                    elif series == "auraed_follow":
                        measured[series] = await auraed.iteration(name, follow=True)
                    elif series == "auraed_oneshot":
                        measured[series] = await auraed.iteration(name, follow=False, oneshot=True)
                    elif series == "bare_run":
                        measured[series] = bare.run(name)
                    elif series == "bare_split":
                        measured[series] = bare.split(name)
                    else:
                        measured[series] = await bare.monitored(name, supervisor)
                if i >= args.warmup:
                    for series, phases in measured.items():
                        results[series].append(phases)
        finally:
            supervisor.close()
            bare.cleanup()
        refs = {"rpc_health_check": await rpc_floor(client, 100)}
    refs["python_-I_-S_startup"] = python_startup()
    return results, refs


def phase_stats(iterations: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {phase: summarize([it[phase] for it in iterations]) for phase in iterations[0]}


def report(args: argparse.Namespace, raw: Iterations, refs: dict[str, list[float]]) -> dict[str, Any]:
    stats = {series: phase_stats(raw[series]) for series in SERIES}
    reference = {name: summarize(values) for name, values in refs.items()}
    bare = stats["bare_run"]["total"]
    ratios = {
        series: {
            "p50": ratio(stats[series]["total"]["p50_ms"], bare["p50_ms"]),
            "mean": ratio(stats[series]["total"]["mean_ms"], bare["mean_ms"]),
        }
        for series in ("auraed_poll", "auraed_follow", "auraed_oneshot", "bare_split", "bare_monitor")
    }
    judged = ("auraed_poll", "auraed_follow", "auraed_oneshot")
    passed = {series: ratios[series]["p50"] <= TARGET_RATIO for series in judged}
    result: dict[str, Any] = {
        "benchmark": "container_start",
        "machine": machine_info(),
        "source": source_state(),
        "iterations": args.iterations,
        "warmup": args.warmup,
        "gap_ms": args.gap_ms,
        "peer": "runc run of auraed's own config.json, rootfs: overlay over auraed's layer snapshot",
        **stats,
        "reference": reference,
        "logs_follow_poll_interval_s": LOGS_FOLLOW_POLL_INTERVAL,
        "ratio_over_bare_run": ratios,
        "target": {
            "ratio_p50_at_most": TARGET_RATIO,
            "result_poll": verdict(passed["auraed_poll"]),
            "result_follow": verdict(passed["auraed_follow"]),
            "result_oneshot": verdict(passed["auraed_oneshot"]),
        },
    }
    if not args.json_only:
        print_table(
            f"Create + Start until the first line (ms), {args.iterations} iterations per series",
            ["series", "p50", "mean", "p90", "min", "max", "ratio p50", "ratio mean"],
            [
                [
                    series,
                    stats[series]["total"]["p50_ms"],
                    stats[series]["total"]["mean_ms"],
                    stats[series]["total"]["p90_ms"],
                    stats[series]["total"]["min_ms"],
                    stats[series]["total"]["max_ms"],
                    ratios.get(series, {"p50": 1.0})["p50"],
                    ratios.get(series, {"mean": 1.0})["mean"],
                ]
                for series in SERIES
            ],
        )
        rows = []
        for series in SERIES:
            for phase, values in stats[series].items():
                if phase != "total":
                    rows.append([f"{series}: {phase}", values["p50_ms"], values["mean_ms"], values["p90_ms"]])
        rows += [[f"alone: {name}", s["p50_ms"], s["mean_ms"], s["p90_ms"]] for name, s in reference.items()]
        print_table("Where the time goes (ms)", ["phase", "p50", "mean", "p90"], rows)
        print_lines(
            [
                f"ratio auraed/bare runc run (p50): poll {ratios['auraed_poll']['p50']}x, "
                f"follow {ratios['auraed_follow']['p50']}x, oneshot {ratios['auraed_oneshot']['p50']}x; "
                f"bare create+start {ratios['bare_split']['p50']}x",
                f"target <= {TARGET_RATIO}x: poll {verdict(passed['auraed_poll'])}, "
                f"follow {verdict(passed['auraed_follow'])}, oneshot {verdict(passed['auraed_oneshot'])}",
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=20, help="measured iterations (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations (default 3)")
    parser.add_argument(
        "--gap-ms", type=int, default=100, help="idle time before each series' run (default 100)"
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.gap_ms < 0:
        parser.error("--iterations must be positive, --warmup and --gap-ms not negative")
    if os.geteuid() != 0:
        parser.exit(2, "container_start: needs root (runc, mounts, cgroups)\n")

    exit_on_sigterm()
    with runc_bench("auraed-bench-start-") as (root, daemon, image, bare_base):
        raw, refs = asyncio.run(run(args, root, daemon, image, bare_base))
    print_json(report(args, raw, refs))


@contextlib.contextmanager
def runc_bench(prefix: str) -> Iterator[tuple[Path, Daemon, BuiltImage, str]]:
    """A temp dir, a started daemon, the busybox image and a cgroup base name for bare runc.

    On the way out, also after a failure (whose daemon log tail goes to stderr): the daemon
    stops, and whatever runc state, mounts and cgroups either side left are removed.
    """
    bare_base = f"aurae-bench-bare-{os.getpid()}"
    with temp_dir(prefix) as root:
        daemon = Daemon(root / "daemon", make_pki(root))
        try:
            image = build_image(root / "image")
            daemon.start()
            yield root, daemon, image, bare_base
        except Exception:
            with contextlib.suppress(Exception):
                sys.stderr.write(daemon.log()[-4000:])
            raise
        finally:
            try:
                daemon.cleanup()
            finally:
                runc_leftovers(daemon.root / "run" / "runtime")
                runc_leftovers(root / "bare" / "runc")
                unmount_below(root)
                remove_cgroup_base(bare_base)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
