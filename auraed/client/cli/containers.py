"""``aer container``: creating, running, stopping, inspecting and removing containers, and their
logs (``exec`` is auraed.client.cli.container_exec)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import betterproto2
from rich.table import Table
from rich.text import Text

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.client.cli.arguments import (
    add_command,
    add_group,
    bind_mount,
    command_line,
    env_var,
    grace_ms,
    key_value,
    message_if_any,
    octal_mode,
    since,
    size,
    unsigned,
)
from auraed.client.cli.calls import CONTAINERS, CliError, call, call_timeout, grace_slack, session
from auraed.client.cli.container_exec import cmd_container_exec
from auraed.client.cli.output import (
    age_text,
    console,
    emit,
    ending_of,
    kv_table,
    lines_text,
    outcome_of,
    print_json,
    report,
    short_id,
    signal_name,
    size_text,
    spinner,
    time_text,
)
from auraed.client.client import AuraeClient, log_lines


def _container_config(args: argparse.Namespace) -> containers_pb.ContainerConfig:
    security = containers_pb.Security(
        capabilities_add=args.cap_add or [],
        capabilities_drop=args.cap_drop or [],
        read_only_rootfs=args.read_only,
        user=args.user or "",
    )
    return containers_pb.ContainerConfig(
        name=args.name,
        image=args.image,
        command=args.entrypoint or [],
        args=args.args,
        env=args.env or [],
        working_dir=args.workdir or "",
        mounts=args.mount or [],
        resources=message_if_any(
            containers_pb.Resources, memory_max=args.memory, pids_max=args.pids, cpu_max=args.cpu_max
        ),
        security=security if security != containers_pb.Security() else None,
        tty=args.tty,
        labels=dict(args.label or []),
        stop_signal=args.stop_signal or "",
        host_network=args.host_network,
    )


def _exit_code(status: containers_pb.ContainerStatus) -> int:
    """The container's exit code as a shell gives it: 128 + the signal when killed by one."""
    if status.exit_code is not None:
        return status.exit_code
    return 128 + status.signal if status.signal is not None else 1


def _status_line(verb: str, status: containers_pb.ContainerStatus) -> str:
    outcome = outcome_of(status)[0]
    pid = f", pid {status.pid}" if status.state == containers_pb.ContainerState.RUNNING else ""
    return f"{verb} {status.name} ({short_id(status.id)}): {outcome}{pid}"


def _container_call(
    args: argparse.Namespace,
    method: str,
    request: betterproto2.Message,
    verb: str,
    *,
    slack_ms: int | None = None,
    waiting: str = "",
    open_ended: bool = False,
) -> int:
    """A call whose reply carries the container's status (Create, Start, Stop)."""
    reply = call(args, CONTAINERS, method, request, slack_ms=slack_ms, waiting=waiting, open_ended=open_ended)
    report(args, reply, _status_line(verb, reply.status or containers_pb.ContainerStatus()))
    return 0


def cmd_container_create(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceCreateRequest(config=_container_config(args))
    if not args.vm:
        return _container_call(args, "Create", request, "created")
    # The host first sends the guest the image's missing blobs: as long as the image's size makes it.
    waiting = f"sending the image to VM {args.vm} and creating container {args.name}"
    return _container_call(args, "Create", request, "created", waiting=waiting, open_ended=True)


def cmd_container_start(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceStartRequest(container_id=args.name)
    return _container_call(args, "Start", request, "started")


def cmd_container_stop(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceStopRequest(container_id=args.name, timeout_ms=args.grace)
    after = "the daemon's grace period" if args.grace is None else f"{args.grace / 1000:g} s"
    waiting = f"stopping container {args.name} (SIGKILL after {after})"
    return _container_call(
        args, "Stop", request, "stopped", slack_ms=grace_slack(args.grace), waiting=waiting
    )


def cmd_container_kill(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceKillRequest(container_id=args.name, signal=args.signal)
    reply = call(args, CONTAINERS, "Kill", request)
    report(args, reply, f"sent {args.signal} to {args.name}")
    return 0


def cmd_container_remove(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceDeleteRequest(
        container_id=args.name, force=args.force, keep_logs=args.keep_logs
    )
    reply = call(args, CONTAINERS, "Delete", request)
    report(args, reply, f"removed {args.name}")
    return 0


def cmd_container_wait(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceWaitRequest(container_id=args.name)
    timeout = call_timeout(args, open_ended=True)
    reply = session(args, lambda client: client.call(CONTAINERS, "Wait", request, timeout))
    status = reply.status or containers_pb.ContainerStatus()
    report(args, reply, str(_exit_code(status)))
    return 0


def _container_rows(status: containers_pb.ContainerStatus) -> list[tuple[str, str]]:
    def when(timestamp: float | None) -> str:
        return time_text(timestamp) if timestamp else "-"

    return [
        ("id", status.id),
        ("name", status.name),
        ("image", status.image),
        ("image id", status.image_id),
        ("state", outcome_of(status)[0]),
        ("pid", str(status.pid) if status.pid else "-"),
        ("exit code", "-" if status.exit_code is None else str(status.exit_code)),
        ("signal", "-" if status.signal is None else signal_name(status.signal)),
        ("oom killed", "yes" if status.oom_killed else "no"),
        ("reason", status.reason or "-"),
        ("created", when(status.created_at)),
        ("started", when(status.started_at)),
        ("finished", when(status.finished_at)),
        ("labels", lines_text([f"{k}={v}" for k, v in sorted(status.labels.items())])),
        ("log", status.log_path or "-"),
    ]


def cmd_container_inspect(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceStatusRequest(container_id=args.name)
    status = call(args, CONTAINERS, "Status", request).status or containers_pb.ContainerStatus()
    if args.json:
        print_json(status)
    else:
        kv_table(f"container {args.name}", _container_rows(status))
    return 0


def cmd_container_list(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceListRequest(labels=dict(args.label or []))
    reply = call(args, CONTAINERS, "List", request)
    if args.json:
        print_json(reply)
        return 0
    table = Table("NAME", "ID", "IMAGE", "STATE", "PID", "EXIT", "CREATED", box=None, header_style="bold")
    for status in reply.containers:
        style = outcome_of(status)[1]
        table.add_row(
            Text(status.name, style="bold"),
            short_id(status.id),
            status.image,
            Text(status.state.name, style=style),
            str(status.pid) if status.pid else "-",
            Text(ending_of(status) or "-", style=style),
            age_text(status.created_at),
        )
    console.print(table if reply.containers else "no containers")
    return 0


async def _print_logs(
    args: argparse.Namespace, client: AuraeClient, request: containers_pb.ContainerServiceLogsRequest
) -> None:
    """Each log line as it comes: stdout lines on stdout, stderr lines on stderr (with --json, one
    object a line on stdout). Written out once a message, which may carry many lines, and where
    the stream changes: both may go to one file, in the order they were logged."""
    last = sys.stdout
    async for reply in client.stream(CONTAINERS, "Logs", request, call_timeout(args, open_ended=True)):
        for line in log_lines(reply):
            file = sys.stderr if line.stream == "stderr" and not args.json else sys.stdout
            if file is not last:
                last.flush()
                last = file
            emit(args, line, line.line, file, flush=False)
        last.flush()


def cmd_container_logs(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceLogsRequest(
        container_id=args.name,
        follow=args.follow,
        since=args.since,
        tail=args.tail,
        stream="stdout" if args.stdout else "stderr" if args.stderr else "",
    )
    session(args, lambda client: _print_logs(args, client, request))
    return 0


def cmd_container_run(args: argparse.Namespace) -> int:
    """Create and start (one call), print the logs until it exits; exit as it did. ``--rm`` deletes
    it in any case."""
    create = containers_pb.ContainerServiceCreateRequest(config=_container_config(args), start=True)
    timeout = call_timeout(args)
    # In a VM, Create first sends the guest the image: no default deadline (see cmd_container_create).
    create_timeout = call_timeout(args, open_ended=bool(args.vm))
    where = f" in VM {args.vm}" if args.vm else ""

    async def body(client: AuraeClient) -> containers_pb.ContainerStatus:
        with spinner(args, f"starting container {args.name}{where}"):
            await client.call(CONTAINERS, "Create", create, create_timeout)
        try:
            follow = containers_pb.ContainerServiceLogsRequest(container_id=args.name, follow=True)
            await _print_logs(args, client, follow)
            wait = containers_pb.ContainerServiceWaitRequest(container_id=args.name)
            reply = await client.call(CONTAINERS, "Wait", wait, call_timeout(args, open_ended=True))
        finally:
            if args.rm:
                delete = containers_pb.ContainerServiceDeleteRequest(container_id=args.name, force=True)
                await client.call(CONTAINERS, "Delete", delete, timeout)
        if args.json:
            emit(args, reply, "")
        return reply.status or containers_pb.ContainerStatus()

    return _exit_code(session(args, body))


def cmd_container_stats(args: argparse.Namespace) -> int:
    reply = call(
        args, CONTAINERS, "Stats", containers_pb.ContainerServiceStatsRequest(container_id=args.name)
    )
    if args.json:
        print_json(reply)
        return 0

    def limited(current: str, limit: int, text: str) -> str:
        return f"{current} / {text if limit else 'no limit'}"

    kv_table(
        f"container {args.name}",
        [
            ("cpu", f"{reply.cpu_usage_usec / 1e6:.3f}s"),
            ("cpu throttled", f"{reply.cpu_throttled_usec / 1e6:.3f}s"),
            (
                "memory",
                limited(size_text(reply.memory_current), reply.memory_max, size_text(reply.memory_max)),
            ),
            ("pids", limited(str(reply.pids_current), reply.pids_max, str(reply.pids_max))),
            ("io read", size_text(reply.io_read_bytes)),
            ("io written", size_text(reply.io_write_bytes)),
            ("at", time_text(reply.timestamp)),
        ],
    )
    return 0


def cmd_container_top(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceListProcessesRequest(container_id=args.name)
    reply = call(args, CONTAINERS, "ListProcesses", request)
    if args.json:
        print_json(reply)
        return 0
    table = Table("PID", "PPID", "STATE", "COMMAND", box=None, header_style="bold")
    for process in reply.processes:
        table.add_row(str(process.pid), str(process.ppid), process.state, " ".join(process.args) or "-")
    console.print(table)
    return 0


COPY_CHUNK = 1 << 20
"""Bytes per CopyFile message: well under gRPC's 4 MiB message limit."""


def cmd_container_copy_file(args: argparse.Namespace) -> int:
    source: Path = args.source
    if not source.is_file():
        raise CliError(f"copy-file: {source} is not a file")
    mode = args.mode if args.mode is not None else source.stat().st_mode & 0o777
    with source.open("rb") as file:

        async def requests() -> AsyncIterator[containers_pb.ContainerServiceCopyFileRequest]:
            message = containers_pb.ContainerServiceCopyFileRequest(
                path=args.path, mode=mode, uid=args.uid, gid=args.gid
            )
            while chunk := await asyncio.to_thread(file.read, COPY_CHUNK):
                message.data = chunk
                yield message
                message = containers_pb.ContainerServiceCopyFileRequest()
            if message.path:  # an empty file: the first message alone
                yield message

        async def body(client: AuraeClient) -> Any:
            return await client.upload(CONTAINERS, "CopyFile", requests(), call_timeout(args))

        reply = session(args, body)
    report(args, reply, f"copied {source} to {reply.path} ({size_text(reply.size)})")
    return 0


def _container_options(parser: argparse.ArgumentParser) -> None:
    """What ``container create`` and ``container run`` take."""
    parser.add_argument("name", metavar="NAME", help="a DNS label, unique on the daemon")
    parser.add_argument("image", metavar="IMAGE", help="a reference, image id or repo digest")
    parser.add_argument("args", nargs="*", metavar="CMD", help="after --: replaces the image's Cmd")
    parser.add_argument(
        "--entrypoint", type=command_line, metavar="CMD", help="replaces the image's Entrypoint (split as sh)"
    )
    parser.add_argument("--env", "-e", action="append", type=env_var, metavar="K=V", help="(repeatable)")
    parser.add_argument("--workdir", "-w", metavar="DIR", help="working directory (created if missing)")
    parser.add_argument("--user", "-u", metavar="U", help="name, uid, uid:gid or name:group")
    parser.add_argument("--memory", "-m", type=size, metavar="SIZE", help="memory limit: 64M, 1G, ...")
    parser.add_argument("--pids", type=unsigned(64), metavar="N", help="maximum number of tasks")
    parser.add_argument("--cpu-max", type=unsigned(64), metavar="US", help="CPU time (µs) per 100 ms")
    parser.add_argument("--read-only", action="store_true", help="read-only root filesystem")
    parser.add_argument("--cap-add", action="append", metavar="CAP", help="add a capability (repeatable)")
    parser.add_argument("--cap-drop", action="append", metavar="CAP", help="drop a capability, or ALL")
    parser.add_argument(
        "--mount", "-v", action="append", type=bind_mount, metavar="SRC:DST[:ro]", help="bind mount"
    )
    parser.add_argument("--tty", "-t", action="store_true", help="run on a terminal (stdout+stderr merged)")
    parser.add_argument("--label", "-l", action="append", type=key_value, metavar="K=V", help="(repeatable)")
    parser.add_argument("--host-network", action="store_true", help="the host's network namespace")
    parser.add_argument("--stop-signal", metavar="SIG", help="what stop sends first (default SIGTERM)")


def add_commands(subparsers: Any) -> None:
    container = add_group(subparsers, "container", "create, run, exec into and remove containers")
    create = add_command(container, "create", cmd_container_create, "create a container (not started)")
    _container_options(create)
    run = add_command(container, "run", cmd_container_run, "create, start, print its logs; exit as it does")
    _container_options(run)
    run.add_argument("--rm", action="store_true", help="remove it once it exits")

    start = add_command(container, "start", cmd_container_start, "start a created container")
    stop = add_command(container, "stop", cmd_container_stop, "its stop signal, then SIGKILL", deadline=False)
    stop.add_argument(
        "--timeout",
        "-t",
        dest="grace",
        type=grace_ms,
        metavar="SECONDS",
        help="before SIGKILL (default: the daemon's stop_grace_period); the call's deadline goes first: "
        "aer --timeout S container stop",
    )
    kill = add_command(container, "kill", cmd_container_kill, "send a signal")
    kill.add_argument("--signal", "-s", default="SIGKILL", metavar="SIG", help="name or number (SIGKILL)")
    remove = add_command(container, "rm", cmd_container_remove, "remove a container that is not running")
    remove.add_argument("--force", "-f", action="store_true", help="kill it first if it runs")
    remove.add_argument("--keep-logs", action="store_true", help="leave its log file")
    wait = add_command(container, "wait", cmd_container_wait, "wait for the end; print the exit code")
    inspect = add_command(container, "inspect", cmd_container_inspect, "the status of a container")
    stats = add_command(container, "stats", cmd_container_stats, "CPU, memory, pids and I/O of a container")
    logs = add_command(container, "logs", cmd_container_logs, "the output of a container")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until it exits")
    logs.add_argument("--tail", type=unsigned(32), metavar="N", help="start with the last N lines")
    logs.add_argument("--since", type=since, metavar="WHEN", help="seconds ago (90, 10m, 2h) or a Unix time")
    channel = logs.add_mutually_exclusive_group()
    channel.add_argument("--stdout", action="store_true", help="only stdout")
    channel.add_argument("--stderr", action="store_true", help="only stderr")
    execute = add_command(container, "exec", cmd_container_exec, "run a command in a running container")
    execute.add_argument("-i", "--interactive", action="store_true", help="send stdin")
    execute.add_argument("-t", "--tty", action="store_true", help="on a terminal (raw mode locally with -i)")
    top = add_command(container, "top", cmd_container_top, "the processes of a running container")
    copy_file = add_command(
        container, "copy-file", cmd_container_copy_file,
        "write a local file below the daemon's files directory (for a container to mount)",
    )  # fmt: skip
    copy_file.add_argument("source", type=Path, metavar="SRC", help="a local file")
    copy_file.add_argument("path", metavar="PATH", help="where, relative to <state dir>/files on the daemon")
    copy_file.add_argument("--mode", type=octal_mode, metavar="MODE", help="e.g. 0644 (default: SRC's)")
    copy_file.add_argument("--uid", type=unsigned(32), metavar="UID", help="owner (default: the daemon's)")
    copy_file.add_argument("--gid", type=unsigned(32), metavar="GID", help="group (default: the daemon's)")
    for parser in (start, stop, kill, remove, wait, inspect, stats, logs, execute, top):
        parser.add_argument("name", metavar="NAME", help="the container's name or id")
    execute.add_argument("args", nargs="*", metavar="CMD", help="after --: the command and its arguments")

    listing = add_command(container, "ls", cmd_container_list, "the containers")
    listing.add_argument("--label", "-l", action="append", type=key_value, metavar="K=V", help="only these")
