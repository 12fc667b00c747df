"""Concurrent containers: 20 busybox containers created, started and waited for at once.

    .venv/bin/python bench/concurrent_containers.py [--containers 20] [--rounds 3] [--json-only]

Each round, against one real auraed (one mTLS channel), ``asyncio.gather`` of ``containers`` tasks,
each Create -> Start -> Wait of a container running ``echo <n>``. Every container must exit 0 and
have logged exactly ``<n>`` (checked with Logs afterwards, untimed); all are deleted after the
round. Reported: the round's wall time, and per container its Create, Start and Wait times and
its total (Create sent -> Wait returned), p50 over the round and over all rounds.

For context (no target), measured in the same rounds:

* ``auraed_sequential`` - the same containers one after another: what concurrency buys;
* ``bare_concurrent``   - the same number of ``runc run`` at once, each of a bundle holding the
  config.json auraed wrote for its warm-up container (root path, cgroupsPath, args changed) over
  its own overlay mount of auraed's layer snapshot, from the mount until runc exits: what the
  machine (2 vCPU) does without auraed's RPCs, records, monitors and two-step create/start.

The series alternate their order from round to round. CPU time per round (until the last
container is done; clean-up not counted) is read from /proc/<auraed>/stat (the daemon, and its
reaped children: monitors, runc, the containers) and os.times() (this process: the client, or the
bare runs' parent, and its reaped children: the bare runc runs); on 2 vCPU a concurrent round is
CPU-bound, so CPU per container is what sets its wall time.

Target (issue): all containers succeed; figures reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import (
    Daemon,
    exit_on_sigterm,
    machine_info,
    print_json,
    print_lines,
    print_table,
    ratio,
    summarize,
    verdict,
)
from container_start import (
    CONTAINERS,
    IMAGE,
    RUNC,
    runc_bench,
    runc_delete,
    source_state,
)

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, log_lines
from auraed.containers.rootfs import mount_rootfs, unmount_rootfs
from auraed.images.content import remove_tree

if TYPE_CHECKING:
    from tests.support.images import BuiltImage

WAIT_TIMEOUT = 120.0
SERIES = ("auraed_concurrent", "auraed_sequential", "bare_concurrent")
TAGS = {"auraed_concurrent": "c", "auraed_sequential": "s", "bare_concurrent": "b"}


# ------------------------------------------------------------------------------ auraed


async def one_container(client: AuraeClient, name: str, n: int) -> dict[str, float]:
    """Create -> Start -> Wait of a container running ``echo n``; times in seconds."""
    clock = time.perf_counter
    t0 = clock()
    config = pb.ContainerConfig(name=name, image=IMAGE, command=["echo", str(n)])
    await client.call(CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=config))
    t1 = clock()
    await client.call(CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id=name))
    t2 = clock()
    reply = await client.call(
        CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id=name), timeout=WAIT_TIMEOUT
    )
    t3 = clock()
    if reply.status.exit_code != 0:
        raise RuntimeError(f"{name} exited with {reply.status.exit_code} ({reply.status.reason})")
    return {"create": t1 - t0, "start": t2 - t1, "wait": t3 - t2, "total": t3 - t0, "end": t3}


async def warm_up(client: AuraeClient) -> dict[str, Any]:
    """Run one container alone; the config.json auraed wrote for it."""
    config = pb.ContainerConfig(name="first", image=IMAGE, command=["echo", "0"])
    created = await client.call(CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=config))
    bundle_config = Path(created.status.log_path).parent / "bundle" / "config.json"
    spec: dict[str, Any] = json.loads(await asyncio.to_thread(bundle_config.read_text))
    await client.call(CONTAINERS, "Start", pb.ContainerServiceStartRequest(container_id="first"))
    await client.call(CONTAINERS, "Wait", pb.ContainerServiceWaitRequest(container_id="first"))
    await check_and_delete(client, {"first": 0})
    return spec


async def check_and_delete(client: AuraeClient, names: dict[str, int]) -> None:
    for name, n in names.items():
        request = pb.ContainerServiceLogsRequest(container_id=name)
        replies = client.stream(CONTAINERS, "Logs", request, timeout=30)
        lines = [line.line async for reply in replies for line in log_lines(reply)]
        if lines != [str(n)]:
            raise RuntimeError(f"{name} logged {lines!r}, not [{str(n)!r}]")
        await client.call(
            CONTAINERS, "Delete", pb.ContainerServiceDeleteRequest(container_id=name, force=True)
        )


async def delete_all(client: AuraeClient) -> None:
    """Remove whatever containers are left (after a failure)."""
    with contextlib.suppress(Exception):
        listed = await client.call(CONTAINERS, "List", pb.ContainerServiceListRequest())
        for status in listed.containers:
            with contextlib.suppress(Exception):
                await client.call(
                    CONTAINERS,
                    "Delete",
                    pb.ContainerServiceDeleteRequest(container_id=status.id, force=True),
                )


async def auraed_round(
    client: AuraeClient, tag: str, count: int, concurrent: bool, snapshot: Callable[[], Any]
) -> dict[str, Any]:
    """One round; ``snapshot()`` (CPU accounting) is taken when the last Wait returned."""
    names = {f"{tag}-{n}": n for n in range(count)}
    start = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(one_container(client, name, n) for name, n in names.items()))
    else:
        results = [await one_container(client, name, n) for name, n in names.items()]
    wall = time.perf_counter() - start
    taken = snapshot()
    await check_and_delete(client, names)
    return {
        "wall": wall,
        "containers": results,
        "last_done_after": max(r["end"] for r in results) - start,
        "snapshot": taken,
    }


# ------------------------------------------------------------------------------ the bare peer


class BareConcurrent:
    """``count`` x (overlay mount + ``runc run``) at once, each with its own bundle."""

    def __init__(self, root: Path, lowers: list[Path], config: dict[str, Any], cgroup_base: str) -> None:
        self.root = root
        self.state = root / "runc"
        self.state.mkdir(parents=True)
        self.lowers = lowers
        self.config = config
        self.cgroup_base = cgroup_base

    def _bundle(self, container_id: str, n: int) -> Path:
        directory = self.root / container_id
        bundle = directory / "bundle"
        bundle.mkdir(parents=True)
        config = copy.deepcopy(self.config)
        config["root"]["path"] = "rootfs"
        config["process"]["args"] = ["echo", str(n)]
        config["hostname"] = container_id
        config["linux"]["cgroupsPath"] = f"/{self.cgroup_base}/{container_id}"
        (bundle / "config.json").write_text(json.dumps(config))
        return bundle

    def _mount(self, container_id: str) -> None:
        directory = self.root / container_id
        mount_rootfs(self.lowers, directory / "upper", directory / "work", directory / "bundle" / "rootfs")

    async def one(self, container_id: str, n: int) -> dict[str, float]:
        bundle = await asyncio.to_thread(self._bundle, container_id, n)
        clock = time.perf_counter
        t0 = clock()
        await asyncio.to_thread(self._mount, container_id)
        process = await asyncio.create_subprocess_exec(
            RUNC, "--root", str(self.state), "run", "--bundle", str(bundle), container_id,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), WAIT_TIMEOUT)
        t1 = clock()
        if process.returncode != 0 or out != f"{n}\n".encode():
            raise RuntimeError(f"runc run {container_id}: exit {process.returncode}, {out!r}, {err[-500:]!r}")
        return {"total": t1 - t0, "end": t1}

    async def round(self, tag: str, count: int, snapshot: Callable[[], Any]) -> dict[str, Any]:
        """One round; ``snapshot()`` (CPU accounting) is taken when the last runc run exited."""
        ids = {f"{tag}-{n}": n for n in range(count)}
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(self.one(container_id, n) for container_id, n in ids.items()))
            wall = time.perf_counter() - start
            taken = snapshot()
        finally:
            await asyncio.to_thread(self._cleanup, list(ids))
        return {
            "snapshot": taken,
            "wall": wall,
            "containers": results,
            "last_done_after": max(r["end"] for r in results) - start,
        }

    def _cleanup(self, ids: list[str]) -> None:
        for container_id in ids:
            runc_delete(self.state, container_id)
            directory = self.root / container_id
            with contextlib.suppress(Exception):
                unmount_rootfs(directory / "bundle" / "rootfs")
            remove_tree(directory)


# ------------------------------------------------------------------------------ CPU accounting


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(daemon_pid: int) -> dict[str, float]:
    """CPU used so far by the daemon, by its reaped children (monitors, and through them runc and
    the containers), by this process, and by this process's reaped children (bare runc runs).
    Taken before a round and when its last container is done (clean-up is not counted)."""
    fields = Path(f"/proc/{daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(v) / TICKS for v in fields[11:15])
    own = os.times()
    return {
        "daemon": utime + stime,
        "daemon_children": cutime + cstime,
        "bench": own.user + own.system,
        "bench_children": own.children_user + own.children_system,
    }


def cpu_used(before: dict[str, float], after: dict[str, float], series: str) -> dict[str, float]:
    """CPU seconds a round cost, by who spent it. auraed: the daemon, its children (monitors, runc,
    the containers) and this process (the client). Bare: the runc runs (and the containers) and
    this process (their parent)."""
    keys = ("bench_children",) if series == "bare_concurrent" else ("daemon", "daemon_children")
    used = {key: after[key] - before[key] for key in (*keys, "bench")}
    used["total"] = sum(used.values())
    return used


# ------------------------------------------------------------------------------ the run


async def run(
    args: argparse.Namespace, root: Path, daemon: Daemon, image: BuiltImage, bare_base: str
) -> dict[str, list[dict[str, Any]]]:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SERIES}
    assert daemon.process is not None
    daemon_pid = daemon.process.pid
    async with daemon.client() as client:
        try:
            request = pb.ContainerServiceImportImageLayoutRequest(
                path=str(image.layout), ref_name=image.ref_name, reference=IMAGE
            )
            await client.call(CONTAINERS, "ImportImageLayout", request)
            # Warm-up: one container alone (its config.json is the bare bundles'), then a round each.
            config = await warm_up(client)
            snapshots = daemon.root / "state" / "images" / "snapshots"
            lowers = [snapshots / layer.diff_id.split(":", 1)[1] for layer in reversed(image.layers)]
            bare = BareConcurrent(root / "bare", lowers, config, bare_base)
            await auraed_round(client, "warm", args.containers, True, lambda: None)
            await bare.round("warm", args.containers, lambda: None)
            for r in range(args.rounds):
                for series in SERIES[r % len(SERIES) :] + SERIES[: r % len(SERIES)]:
                    await asyncio.sleep(args.gap_ms / 1000)
                    tag = f"r{r}-{TAGS[series]}"
                    snapshot = functools.partial(cpu_seconds, daemon_pid)
                    before = snapshot()
                    if series == "bare_concurrent":
                        measured = await bare.round(tag, args.containers, snapshot)
                    else:
                        concurrent = series == "auraed_concurrent"
                        measured = await auraed_round(client, tag, args.containers, concurrent, snapshot)
                    measured["cpu_s"] = cpu_used(before, measured.pop("snapshot"), series)
                    rounds[series].append(measured)
        except BaseException:
            await delete_all(client)
            raise
    return rounds


def report(args: argparse.Namespace, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "concurrent_containers",
        "machine": machine_info(),
        "source": source_state(),
        "containers": args.containers,
        "rounds": args.rounds,
        "gap_ms": args.gap_ms,
    }
    table: list[list[object]] = []
    for series, data in rounds.items():
        walls = [r["wall"] for r in data]
        cpus = [r["cpu_s"]["total"] for r in data]
        who = [k for k in data[0]["cpu_s"] if k != "total"]
        per_container = [c for r in data for c in r["containers"]]
        phases = [k for k in per_container[0] if k != "end"]
        result[series] = {
            "wall_s_per_round": [round(w, 3) for w in walls],
            "wall": summarize(walls),
            "per_container": {phase: summarize([c[phase] for c in per_container]) for phase in phases},
            "cpu_s_per_round": [round(c, 3) for c in cpus],
            "cpu_ms_per_container": round(sum(cpus) / len(cpus) / args.containers * 1000, 1),
            "cpu_ms_per_container_by": {
                key: round(sum(r["cpu_s"][key] for r in data) / len(data) / args.containers * 1000, 1)
                for key in who
            },
            "cpu_busy_fraction_of_2_vcpu": round(sum(cpus) / sum(walls) / (os.cpu_count() or 1), 2),
            "per_container_p50_ms_per_round": [
                summarize([c["total"] for c in r["containers"]])["p50_ms"] for r in data
            ],
        }
        table.append(
            [
                series,
                " / ".join(f"{w:.2f}" for w in walls),
                result[series]["cpu_ms_per_container"],
                result[series]["per_container"]["total"]["p50_ms"],
                result[series]["per_container"]["total"]["max_ms"],
                *(
                    result[series]["per_container"][phase]["p50_ms"] if phase in phases else "-"
                    for phase in ("create", "start", "wait")
                ),
            ]
        )
    concurrent, sequential, bare = (result[s]["wall"]["p50_ms"] for s in SERIES)
    result["speedup_concurrent_over_sequential"] = ratio(sequential, concurrent)
    result["ratio_wall_auraed_over_bare_concurrent"] = ratio(concurrent, bare)
    result["all_succeeded"] = True  # any failure raised before this point
    result["target"] = {"all_succeed": True, "result": verdict(True)}
    if not args.json_only:
        print_table(
            f"{args.containers} containers (echo <n>), {args.rounds} rounds: wall per round (s), "
            "per container (ms)",
            [
                "series",
                "wall s per round",
                "CPU ms/ctr",
                "p50 total",
                "max total",
                "p50 create",
                "p50 start",
                "p50 wait",
            ],
            table,
        )
        print_lines(
            [
                f"auraed concurrent wall p50 {concurrent / 1000:.2f} s: "
                f"{result['speedup_concurrent_over_sequential']}x faster than one after another, "
                f"{result['ratio_wall_auraed_over_bare_concurrent']}x bare concurrent runc run",
                "CPU ms per container, by who spent it: "
                + "; ".join(
                    f"{series} "
                    + ", ".join(f"{k} {v}" for k, v in result[series]["cpu_ms_per_container_by"].items())
                    for series in SERIES
                ),
                f"all {args.containers * args.rounds} containers per series exited 0 "
                "with the right line: PASS",
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--containers", type=int, default=20, help="containers per round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--gap-ms", type=int, default=500, help="idle time before each round (default 500)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.containers < 1 or args.rounds < 1 or args.gap_ms < 0:
        parser.error("--containers and --rounds must be positive, --gap-ms not negative")
    if os.geteuid() != 0:
        parser.exit(2, "concurrent_containers: needs root (runc, mounts, cgroups)\n")

    exit_on_sigterm()
    with runc_bench("auraed-bench-concurrent-") as (root, daemon, image, bare_base):
        rounds = asyncio.run(run(args, root, daemon, image, bare_base))
    print_json(report(args, rounds))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
