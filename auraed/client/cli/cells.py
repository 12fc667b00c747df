"""``aer cell``: cells (cgroups, optionally their own namespaces) and the executables in them."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import betterproto2
from rich.text import Text
from rich.tree import Tree

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.client.cli.arguments import add_command, add_group, grace_ms, message_if_any, size, unsigned
from auraed.client.cli.calls import CELLS, call, grace_slack
from auraed.client.cli.output import console, outcome_of, print_json, report, size_text


def cmd_cell_allocate(args: argparse.Namespace) -> int:
    cell = cells_pb.Cell(
        name=args.name,
        cpu=message_if_any(
            cells_pb.CpuController, weight=args.cpu_weight, max=args.cpu_max, period=args.cpu_period
        ),
        cpuset=message_if_any(cells_pb.CpusetController, cpus=args.cpuset_cpus, mems=args.cpuset_mems),
        memory=message_if_any(
            cells_pb.MemoryController,
            min=args.memory_min,
            low=args.memory_low,
            high=args.memory_high,
            max=args.memory_max,
        ),
        pids=message_if_any(cells_pb.PidsController, max=args.pids_max),
        isolate_process=args.isolate_process,
        isolate_network=args.isolate_network,
    )
    reply = call(args, CELLS, "Allocate", cells_pb.CellServiceAllocateRequest(cell=cell))
    report(args, reply, f"allocated cell {reply.cell_name} (cgroup {reply.cgroup_path})")
    return 0


def cmd_cell_free(args: argparse.Namespace) -> int:
    request = cells_pb.CellServiceFreeRequest(cell_name=args.name, grace_period_ms=args.grace)
    waiting = f"freeing cell {args.name}"
    reply = call(args, CELLS, "Free", request, slack_ms=grace_slack(args.grace), waiting=waiting)
    report(args, reply, f"freed cell {args.name}")
    return 0


def cmd_cell_start(args: argparse.Namespace) -> int:
    executable = cells_pb.Executable(
        name=args.executable,
        args=args.args,
        shell_command=args.shell or "",
        env=args.env or [],
        cwd=args.cwd or "",
        uid=args.uid,
        gid=args.gid,
        description=args.description or "",
    )
    request = cells_pb.CellServiceStartRequest(cell_name=args.cell, executable=executable)
    reply = call(args, CELLS, "Start", request)
    report(args, reply, f"started {args.cell}/{args.executable} (pid {reply.pid})")
    return 0


def cmd_cell_stop(args: argparse.Namespace) -> int:
    request = cells_pb.CellServiceStopRequest(
        cell_name=args.cell, executable_name=args.executable, grace_period_ms=args.grace
    )
    waiting = f"stopping {args.cell}/{args.executable}"
    reply = call(args, CELLS, "Stop", request, slack_ms=grace_slack(args.grace), waiting=waiting)
    status = reply.status or cells_pb.ExecutableStatus()
    report(args, reply, f"stopped {args.cell}/{args.executable}: {outcome_of(status)[0]}")
    return 0


def _limits(cell: cells_pb.Cell) -> str:
    parts = []
    for label, controller in (
        ("cpu", cell.cpu),
        ("cpuset", cell.cpuset),
        ("memory", cell.memory),
        ("pids", cell.pids),
    ):
        limits = controller.to_dict(output_format=betterproto2.OutputFormat.PYTHON) if controller else {}
        parts += [f"{label}.{k}={size_text(v) if label == 'memory' else v}" for k, v in limits.items()]
    isolated = [
        kind for kind, on in (("process", cell.isolate_process), ("network", cell.isolate_network)) if on
    ]
    return " ".join(parts + ([f"isolate={','.join(isolated)}"] if isolated else []))


def _executable_label(status: cells_pb.ExecutableStatus) -> Text:
    outcome, style = outcome_of(status)
    return Text.assemble(
        (status.name, "bold"),
        f"  pid {status.pid}  ",
        (outcome, style),
        ("  " + shlex.join(status.args), "dim"),
    )


def _add_cell(parent: Tree, node: cells_pb.CellGraphNode) -> None:
    cell = node.cell or cells_pb.Cell()
    branch = parent.add(Text.assemble((cell.name, "bold cyan"), ("  " + _limits(cell), "dim")))
    for status in node.executables:
        branch.add(_executable_label(status))
    for child in node.children:
        _add_cell(branch, child)


def cmd_cell_list(args: argparse.Namespace) -> int:
    reply = call(args, CELLS, "List", cells_pb.CellServiceListRequest())
    if args.json:
        print_json(reply)
        return 0
    tree = Tree(Text("cells", style="bold"))
    for node in reply.cells:
        _add_cell(tree, node)
    console.print(tree if reply.cells else "no cells")
    return 0


def add_commands(subparsers: Any) -> None:
    cell = add_group(subparsers, "cell", "allocate, free and list cells; start and stop executables")
    allocate = add_command(cell, "allocate", cmd_cell_allocate, "create a cell")
    allocate.add_argument("name", metavar="NAME", help='cell name, e.g. "web" or "web/api"')
    allocate.add_argument("--cpu-weight", type=unsigned(64), metavar="N", help="relative CPU share, 1..10000")
    allocate.add_argument("--cpu-max", type=unsigned(64), metavar="US", help="CPU time per period (µs)")
    allocate.add_argument("--cpu-period", type=unsigned(64), metavar="US", help="CPU period (µs)")
    allocate.add_argument("--cpuset-cpus", metavar="LIST", help='CPUs, e.g. "0-1,3"')
    allocate.add_argument("--cpuset-mems", metavar="LIST", help="memory nodes")
    for limit in ("min", "low", "high", "max"):
        allocate.add_argument(f"--memory-{limit}", type=size, metavar="SIZE", help="bytes or 64M, 1G, 512Ki")
    allocate.add_argument("--pids-max", type=unsigned(64), metavar="N", help="maximum number of tasks")
    allocate.add_argument("--isolate-process", action="store_true", help="own pid/mount/uts/ipc namespaces")
    allocate.add_argument("--isolate-network", action="store_true", help="own network namespace")

    free = add_command(cell, "free", cmd_cell_free, "stop everything in a cell and remove it")
    free.add_argument("name", metavar="NAME")
    free.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="time between SIGTERM and SIGKILL")

    start = add_command(cell, "start", cmd_cell_start, "start an executable in a cell")
    start.add_argument("cell", metavar="CELL")
    start.add_argument("executable", metavar="EXE_NAME")
    start.add_argument("args", nargs="*", metavar="ARGS", help="program and arguments, after --")
    start.add_argument("--shell", metavar="CMD", help="run CMD with /bin/sh -c instead of ARGS")
    start.add_argument("--env", action="append", metavar="K=V", help="environment variable (repeatable)")
    start.add_argument("--cwd", metavar="DIR")
    start.add_argument("--uid", type=unsigned(32), metavar="N")
    start.add_argument("--gid", type=unsigned(32), metavar="N")
    start.add_argument("--description", metavar="TEXT")

    stop = add_command(cell, "stop", cmd_cell_stop, "stop an executable: SIGTERM, then SIGKILL")
    stop.add_argument("cell", metavar="CELL")
    stop.add_argument("executable", metavar="EXE_NAME")
    stop.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="time between SIGTERM and SIGKILL")

    add_command(cell, "list", cmd_cell_list, "the tree of cells and their executables")
