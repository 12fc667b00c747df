"""Reading a long container log: ContainerService.Logs, and `aer container logs`, against reading
the CRI log file directly.

    .venv/bin/python bench/logs.py [--lines 200000] [--rounds 5] [--json-only]

One busybox container writes ``--lines`` lines of stdout (``line number <n>``, ~20 bytes) and
exits; then each round reads all of them back three ways, in an order that rotates from round
to round:

* ``auraed_stream`` - Logs (no follow) through the Python client in this process, counting the
                      lines: the daemon's reading, the messages and the client's decoding;
* ``aer``           - ``aer container logs NAME`` with its stdout to /dev/null: what a person
                      runs, Python's start-up (~0.3 s) and the printing included;
* ``file``          - the peer: ``sed`` stripping the CRI header (time, stream, tag) off each
                      record of the container's log file, stdout to /dev/null; what a reader on
                      the same machine with no daemon in between (the kubelet reading the file
                      for ``kubectl logs``) does at the least.

Every series must see every line (the stream's count is checked; aer's and sed's outputs are
counted by a first untimed run). No target in an issue: figures for context.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
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
)
from container_start import CONTAINERS, IMAGE, runc_bench

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, log_lines
from auraed.client.client import client_config_text

if TYPE_CHECKING:
    from tests.support.images import BuiltImage

SERIES = ("auraed_stream", "aer", "file")
NAME = "talker"
WAIT_TIMEOUT = 300.0
READ_TIMEOUT = 600.0
# Strips "<time> <stream> <F|P> " off each record of a CRI log.
CRI_HEADER = r"s/^[^ ]* [^ ]* [FP] //"


async def stream_count(client: AuraeClient) -> int:
    request = pb.ContainerServiceLogsRequest(container_id=NAME)
    count = 0
    async for reply in client.stream(CONTAINERS, "Logs", request, timeout=READ_TIMEOUT):
        count += len(log_lines(reply))
    return count


def aer_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "auraed.aer", "--config", str(config), "container", "logs", NAME]


def write_client_config(daemon: Daemon, path: Path) -> Path:
    config = daemon.client_config()
    path.write_text(client_config_text(config.ca_crt, config.client_crt, config.client_key, daemon.socket))
    return path


def lines_printed(command: list[str]) -> int:
    result = subprocess.run(command, stdout=subprocess.PIPE, check=True, timeout=READ_TIMEOUT)
    return result.stdout.count(b"\n")


def timed_to_null(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=True, timeout=READ_TIMEOUT)
    return time.perf_counter() - started


async def run(
    args: argparse.Namespace, root: Path, daemon: Daemon, image: BuiltImage
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {series: [] for series in SERIES}
    async with daemon.client() as client:
        request = pb.ContainerServiceImportImageLayoutRequest(
            path=str(image.layout), ref_name=image.ref_name, reference=IMAGE
        )
        await client.call(CONTAINERS, "ImportImageLayout", request)
        script = f"seq {args.lines} | sed 's/^/line number /'"
        config = pb.ContainerConfig(name=NAME, image=IMAGE, command=["sh", "-c", script])
        created = await client.call(
            CONTAINERS, "Create", pb.ContainerServiceCreateRequest(config=config, start=True)
        )
        log_path = created.status.log_path
        wait = pb.ContainerServiceWaitRequest(container_id=NAME)
        final = await client.call(CONTAINERS, "Wait", wait, timeout=WAIT_TIMEOUT)
        if final.status.exit_code != 0:
            raise RuntimeError(f"the writer exited with {final.status.exit_code}")
        aer = aer_command(write_client_config(daemon, root / "client.toml"))
        peer = ["sed", "-e", CRI_HEADER, log_path]
        for series, command in (("aer", aer), ("file", peer)):
            if (printed := await asyncio.to_thread(lines_printed, command)) != args.lines:
                raise RuntimeError(f"{series} printed {printed} lines, not {args.lines}")
        for round_ in range(args.rounds):
            order = SERIES[round_ % len(SERIES) :] + SERIES[: round_ % len(SERIES)]
            for series in order:
                if series == "auraed_stream":
                    started = time.perf_counter()
                    if (count := await stream_count(client)) != args.lines:
                        raise RuntimeError(f"Logs sent {count} lines, not {args.lines}")
                    results[series].append(time.perf_counter() - started)
                else:
                    command = aer if series == "aer" else peer
                    results[series].append(await asyncio.to_thread(timed_to_null, command))
        delete = pb.ContainerServiceDeleteRequest(container_id=NAME, force=True)
        await client.call(CONTAINERS, "Delete", delete)
    return results


def report(args: argparse.Namespace, results: dict[str, list[float]]) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "logs", "machine": machine_info(), "lines": args.lines}
    for series in SERIES:
        result[series] = summarize(results[series])
    file_p50 = result["file"]["p50_ms"]
    result["ratio_stream_over_file"] = ratio(result["auraed_stream"]["p50_ms"], file_p50)
    result["ratio_aer_over_file"] = ratio(result["aer"]["p50_ms"], file_p50)
    if not args.json_only:
        rows = [
            [
                series,
                result[series]["p50_ms"],
                result[series]["min_ms"],
                result[series]["max_ms"],
                round(args.lines / (result[series]["p50_ms"] / 1000)),
            ]
            for series in SERIES
        ]
        print_table(
            f"{args.lines} log lines read whole, {args.rounds} rounds (ms)",
            ["series", "p50", "min", "max", "lines/s at p50"],
            rows,
        )
        print_lines(
            [
                f"Logs stream {result['ratio_stream_over_file']}x and aer container logs "
                f"{result['ratio_aer_over_file']}x reading the log file with sed (no target)"
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lines", type=int, default=200_000, help="lines the container writes (default 200000)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.lines < 1 or args.rounds < 1:
        parser.error("--lines and --rounds must be positive")
    if os.geteuid() != 0:
        parser.exit(2, "logs: needs root (runc, mounts, cgroups)\n")

    exit_on_sigterm()
    with runc_bench("auraed-bench-logs-") as (root, daemon, image, _bare_base):
        results = asyncio.run(run(args, root, daemon, image))
    print_json(report(args, results))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
