"""``aer``: the command line for auraed, built on :class:`auraed.client.AuraeClient`.

Tables and trees are for people; ``--json`` prints the proto3 JSON mapping of each response (field
names as in the .proto, unset fields as ``null``, 64-bit integers as strings), or one JSON object
per line for streams. Every failure is one line on stderr, ``aer: <GRPC_CODE>: <detail>`` for
errors the server reported, ``aer: <message>`` for local ones, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import betterproto2
from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.discovery import v0 as discovery_pb
from auraed.api.aurae.observe import v0 as observe_pb
from auraed.client.client import AuraeClient, ClientConfig, ClientError, load_client_config
from auraed.pki import PkiError, PkiPaths, ensure_dev_pki, issue_client_cert, load_ca, write_pem_files
from auraed.pki.certs import (
    CA_STEM,
    DEFAULT_CLIENT_NAMES,
    DEFAULT_SERVER_IPS,
    DEFAULT_SERVER_NAMES,
    SERVER_STEM,
)

CELLS = "aurae.cells.v0.CellService"
OBSERVE = "aurae.observe.v0.ObserveService"
DISCOVERY = "aurae.discovery.v0.DiscoveryService"
DEFAULT_TIMEOUT = 30.0
DEFAULT_SOCKET = "/var/run/aurae/aurae.sock"
EXIT_INTERRUPTED = 130

T = TypeVar("T")
M = TypeVar("M", bound=betterproto2.Message)

console = Console(markup=False, highlight=False)  # styles come from Text objects


class CliError(Exception):
    """A local problem (bad input, missing config): printed as it is, without a gRPC code."""


# --------------------------------------------------------------------------- argument types


def _in_range(value: int, bits: int, text: str) -> int:
    if not 0 <= value < 1 << bits:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (0..{(1 << bits) - 1})")
    return value


def unsigned(bits: int) -> Callable[[str], int]:
    """An argparse type for a non-negative integer that fits ``bits`` bits."""

    def parse_unsigned(text: str) -> int:
        try:
            return _in_range(int(text), bits, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None

    return parse_unsigned


SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
SIZE_PATTERN = re.compile(r"(\d+)\s*(?:([kmgtp])i?)?b?", re.IGNORECASE)


def size(text: str) -> int:
    """Bytes, or a number with a binary K, M, G, T or P suffix: 64M, 1G, 512Ki, 64MiB."""
    match = SIZE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a suffix as in 64M, 1G, 512Ki")
    return _in_range(int(match[1]) * SIZE_UNITS[(match[2] or "").lower()], 64, text)


def seconds(text: str) -> float:
    """A non-negative, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is out of range")
    return value


def grace_ms(text: str) -> int:
    """Seconds (may be fractional) as whole milliseconds, for a uint32 field."""
    milliseconds = round(seconds(text) * 1000)
    if milliseconds >= 1 << 32:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is out of range")
    return milliseconds


def ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


# --------------------------------------------------------------------------- calling auraed


def _config(args: argparse.Namespace) -> ClientConfig:
    try:
        return load_client_config(args.config, args.address)
    except ClientError as exc:
        raise CliError(exc.message) from None


def _timeout(args: argparse.Namespace, follow: bool = False, slack_ms: int | None = None) -> float | None:
    """--timeout when given; otherwise none for streams that follow, a default (plus grace) for the rest."""
    if args.timeout is not None:
        return float(args.timeout)
    return None if follow else DEFAULT_TIMEOUT + (slack_ms or 0) / 1000


def _session(args: argparse.Namespace, body: Callable[[AuraeClient], Awaitable[T]]) -> T:
    """Connect as the client config says, run ``body`` with the client, and close the channel."""
    config = _config(args)

    async def run() -> T:
        try:
            client = AuraeClient.connect(config)
        except ClientError as exc:  # unreadable certificate or key: a local problem
            raise CliError(exc.message) from None
        async with client:
            return await body(client)

    return asyncio.run(run())


def _call(
    args: argparse.Namespace,
    service: str,
    method: str,
    request: betterproto2.Message,
    slack_ms: int | None = None,
) -> Any:
    timeout = _timeout(args, slack_ms=slack_ms)
    return _session(args, lambda client: client.call(service, method, request, timeout))


def _stream(
    args: argparse.Namespace,
    method: str,
    request: betterproto2.Message,
    follow: bool,
    show: Callable[[Any], tuple[betterproto2.Message, str]],
) -> None:
    """Print each reply of an Observe stream as it comes: ``show`` gives its message and its text line."""
    timeout = _timeout(args, follow)

    async def body(client: AuraeClient) -> None:
        async for reply in client.stream(OBSERVE, method, request, timeout):
            message, line = show(reply)
            print(json.dumps(_as_dict(message)) if args.json else line, flush=True)

    _session(args, body)


# --------------------------------------------------------------------------- output


def _as_dict(message: betterproto2.Message) -> dict[str, Any]:
    return message.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)


def _print_json(value: betterproto2.Message | dict[str, Any]) -> None:
    data = value if isinstance(value, dict) else _as_dict(value)
    print(json.dumps(data, indent=2))


def _report(args: argparse.Namespace, reply: betterproto2.Message, text: str) -> None:
    if args.json:
        _print_json(reply)
    else:
        console.print(text)


def _kv_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)


def _size(n: int) -> str:
    """Exact in the largest binary unit that divides it (1536Mi), else rounded (23.5Gi)."""
    units = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))
    exact = next(
        (f"{n // unit}{suffix}" for suffix, unit in units if n % unit == 0 and 0 < n // unit < 10000), None
    )
    near = next(((suffix, unit) for suffix, unit in units if n >= unit), None)
    return exact or (f"{n / near[1]:.1f}{near[0]}" if near else str(n))


def _time(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="milliseconds")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --------------------------------------------------------------------------- discovery, health


def _present(present: bool, path: str) -> str:
    return (path or "present") if present else "absent"


def _discovery_rows(reply: discovery_pb.DiscoveryServiceDiscoverResponse) -> list[tuple[str, str]]:
    caps = reply.capabilities or discovery_pb.HostCapabilities()
    runtimes = [
        f"{r.name} {r.version} {r.path}{'' if r.usable else ' (not usable)'}" for r in caps.oci_runtimes
    ]
    kvm = "usable" if caps.kvm_usable else ("present, " if caps.kvm_present else "absent, ") + "not usable"
    return [
        ("version", reply.version),
        ("role", reply.role),
        ("hostname", reply.hostname),
        ("healthy", "yes" if reply.healthy else "no"),
        ("services", "\n".join(reply.services)),
        ("kernel", caps.kernel_release),
        ("cpus", str(caps.cpus)),
        ("memory", _size(caps.memory_bytes)),
        ("cgroup layout", caps.cgroup_layout.name),
        ("cgroup controllers", " ".join(caps.cgroup_controllers)),
        ("oci runtimes", "\n".join(runtimes) or "none"),
        ("kvm", f"{kvm}: {caps.kvm_detail}" if caps.kvm_detail else kvm),
        ("qemu", _present(caps.qemu_present, caps.qemu_path)),
        ("cloud-hypervisor", _present(caps.cloud_hypervisor_present, caps.cloud_hypervisor_path)),
    ]


def cmd_discovery(args: argparse.Namespace) -> int:
    reply = _call(args, DISCOVERY, "Discover", discovery_pb.DiscoveryServiceDiscoverRequest())
    if args.json:
        _print_json(reply)
    else:
        _kv_table("auraed", _discovery_rows(reply))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    timeout = _timeout(args)
    status = _session(args, lambda client: client.health(args.service, timeout))
    if args.json:
        _print_json({"service": args.service, "status": status})
    else:
        print(status)
    return 0 if status == "SERVING" else 1


# --------------------------------------------------------------------------- cells


def _controller(cls: Callable[..., M], **limits: Any) -> M | None:
    given = {key: value for key, value in limits.items() if value is not None}
    return cls(**given) if given else None


def cmd_cell_allocate(args: argparse.Namespace) -> int:
    cell = cells_pb.Cell(
        name=args.name,
        cpu=_controller(
            cells_pb.CpuController, weight=args.cpu_weight, max=args.cpu_max, period=args.cpu_period
        ),
        cpuset=_controller(cells_pb.CpusetController, cpus=args.cpuset_cpus, mems=args.cpuset_mems),
        memory=_controller(
            cells_pb.MemoryController,
            min=args.memory_min,
            low=args.memory_low,
            high=args.memory_high,
            max=args.memory_max,
        ),
        pids=_controller(cells_pb.PidsController, max=args.pids_max),
        isolate_process=args.isolate_process,
        isolate_network=args.isolate_network,
    )
    reply = _call(args, CELLS, "Allocate", cells_pb.CellServiceAllocateRequest(cell=cell))
    _report(args, reply, f"allocated cell {reply.cell_name} (cgroup {reply.cgroup_path})")
    return 0


def cmd_cell_free(args: argparse.Namespace) -> int:
    request = cells_pb.CellServiceFreeRequest(cell_name=args.name, grace_period_ms=args.grace)
    reply = _call(args, CELLS, "Free", request, slack_ms=args.grace)
    _report(args, reply, f"freed cell {args.name}")
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
    reply = _call(args, CELLS, "Start", request)
    _report(args, reply, f"started {args.cell}/{args.executable} (pid {reply.pid})")
    return 0


def cmd_cell_stop(args: argparse.Namespace) -> int:
    request = cells_pb.CellServiceStopRequest(
        cell_name=args.cell, executable_name=args.executable, grace_period_ms=args.grace
    )
    reply = _call(args, CELLS, "Stop", request, slack_ms=args.grace)
    status = reply.status or cells_pb.ExecutableStatus()
    _report(args, reply, f"stopped {args.cell}/{args.executable}: {_outcome(status)[0]}")
    return 0


def _outcome(status: cells_pb.ExecutableStatus) -> tuple[str, str]:
    """How an executable is doing, and the style to show it in."""
    details = []
    if status.exit_code is not None:
        details.append(f"code {status.exit_code}")
    if status.signal is not None:
        details.append(_signal_name(status.signal))
    if status.oom_killed:
        details.append("OOM killed")
    state = status.state.name
    text = f"{state} ({', '.join(details)})" if details else state
    clean = status.exit_code == 0 and not status.oom_killed
    style = {"RUNNING": "green", "EXITED": "blue" if clean else "red"}.get(state, "yellow")
    return text, style


def _limits(cell: cells_pb.Cell) -> str:
    parts = []
    for label, controller in (
        ("cpu", cell.cpu),
        ("cpuset", cell.cpuset),
        ("memory", cell.memory),
        ("pids", cell.pids),
    ):
        limits = controller.to_dict(output_format=betterproto2.OutputFormat.PYTHON) if controller else {}
        parts += [f"{label}.{k}={_size(v) if label == 'memory' else v}" for k, v in limits.items()]
    isolated = [
        kind for kind, on in (("process", cell.isolate_process), ("network", cell.isolate_network)) if on
    ]
    return " ".join(parts + ([f"isolate={','.join(isolated)}"] if isolated else []))


def _executable_label(status: cells_pb.ExecutableStatus) -> Text:
    outcome, style = _outcome(status)
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
    reply = _call(args, CELLS, "List", cells_pb.CellServiceListRequest())
    if args.json:
        _print_json(reply)
        return 0
    tree = Tree(Text("cells", style="bold"))
    for node in reply.cells:
        _add_cell(tree, node)
    console.print(tree if reply.cells else "no cells")
    return 0


# --------------------------------------------------------------------------- observe


def cmd_observe_logs(args: argparse.Namespace) -> int:
    channel = observe_pb.LogChannelType.UNSPECIFIED
    if args.stdout or args.stderr:
        channel = observe_pb.LogChannelType.STDOUT if args.stdout else observe_pb.LogChannelType.STDERR
    request = observe_pb.ObserveServiceGetSubProcessStreamRequest(
        cell_name=args.cell,
        executable_name=args.executable,
        channel_type=channel,
        follow=args.follow,
        tail=args.tail,
    )
    _stream(args, "GetSubProcessStream", request, args.follow, lambda reply: (reply.item, reply.item.line))
    return 0


def cmd_observe_daemon(args: argparse.Namespace) -> int:
    request = observe_pb.ObserveServiceGetAuraeDaemonLogStreamRequest(follow=args.follow, tail=args.tail)

    def show(reply: Any) -> tuple[betterproto2.Message, str]:
        item = reply.item
        return item, f"{_time(item.timestamp)} {item.level:<7} {item.line}"

    _stream(args, "GetAuraeDaemonLogStream", request, args.follow, show)
    return 0


def cmd_observe_signals(args: argparse.Namespace) -> int:
    request = observe_pb.ObserveServiceGetPosixSignalsStreamRequest(
        workload=args.workload or "", include_past=args.past
    )

    def show(reply: Any) -> tuple[betterproto2.Message, str]:
        sig = reply.signal
        return sig, f"{_time(sig.timestamp)} {sig.workload} pid {sig.process_id} {sig.signal_name} {sig.how}"

    _stream(args, "GetPosixSignalsStream", request, True, show)
    return 0


# --------------------------------------------------------------------------- pki


def _client_config_text(ca_crt: Path, client_crt: Path, client_key: Path, socket: str) -> str:
    def quoted(value: object) -> str:  # a JSON string is a valid TOML basic string
        return json.dumps(str(value))

    return (
        "# aer client config, written by `aer pki init`\n"
        f"[auth]\nca_crt = {quoted(ca_crt)}\n"
        f"client_crt = {quoted(client_crt)}\nclient_key = {quoted(client_key)}\n\n"
        f"[system]\nsocket = {quoted(socket)}\n"
    )


def _pki_summary(paths: PkiPaths, config: Path) -> dict[str, Any]:
    clients = {name: {"crt": str(crt), "key": str(key)} for name, (crt, key) in paths.clients.items()}
    return {
        "ca_crt": str(paths.ca_crt),
        "ca_key": str(paths.ca_key),
        "server_crt": str(paths.server_crt),
        "server_key": str(paths.server_key),
        "clients": clients,
        "config": str(config),
    }


def cmd_pki_init(args: argparse.Namespace) -> int:
    directory = args.dir.expanduser().resolve()
    clients = list(dict.fromkeys(args.client or DEFAULT_CLIENT_NAMES))
    try:
        paths = ensure_dev_pki(
            directory,
            server_names=list(dict.fromkeys([*DEFAULT_SERVER_NAMES, *(args.server_name or [])])),
            server_ips=list(dict.fromkeys([*DEFAULT_SERVER_IPS, *(args.server_ip or [])])),
            client_names=clients,
        )
    except ValueError as exc:  # a client name that cannot be a file name
        raise CliError(str(exc)) from None
    config = directory / "config"
    crt, key = paths.clients[clients[0]]
    config.write_text(_client_config_text(paths.ca_crt, crt, key, args.socket))
    summary = _pki_summary(paths, config)
    if args.json:
        _print_json(summary)
        return 0
    rows = [(k, v) for k, v in summary.items() if k != "clients"]
    rows += [
        (f"client {name}", f"{files['crt']}\n{files['key']}") for name, files in summary["clients"].items()
    ]
    _kv_table(f"dev PKI in {directory}", rows)
    flags = {
        "--socket": args.socket,
        "--ca-crt": paths.ca_crt,
        "--server-crt": paths.server_crt,
        "--server-key": paths.server_key,
    }
    command = shlex.join(["auraed", *(f"{flag}={value}" for flag, value in flags.items())])
    console.print(
        f"Start auraed with:\n  {command}\n"
        f"and point aer at it:\n  export AURAE_CONFIG={shlex.quote(str(config))}",
        markup=False,
        soft_wrap=True,
    )
    return 0


def cmd_pki_client(args: argparse.Namespace) -> int:
    directory = args.dir.expanduser().resolve()
    if args.name in (CA_STEM, SERVER_STEM):
        raise CliError(f"client name {args.name!r} would overwrite the CA or server files")
    if (directory / f"{args.name}.crt").exists():
        raise CliError(f"{directory / args.name}.crt already exists; remove it to issue a new one")
    ca = load_ca(directory)
    try:
        cert, key = issue_client_cert(ca, args.name)
        crt_path, key_path = write_pem_files(directory, args.name, cert, key)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        _print_json({"name": args.name, "crt": str(crt_path), "key": str(key_path)})
    else:
        _kv_table(f"client {args.name}", [("crt", str(crt_path)), ("key", str(key_path))])
    return 0


# --------------------------------------------------------------------------- parser


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every command takes, before or after the command's name.

    Subcommands repeat them with SUPPRESS defaults so that they only override the top level when given.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global options")
    group.add_argument(
        "--config",
        type=Path,
        default=default(None),
        metavar="PATH",
        help="client config (default: $AURAE_CONFIG, ~/.aurae/config, /etc/aurae/config)",
    )
    group.add_argument(
        "--address", default=default(None), metavar="ADDR", help="auraed address: unix:/path or host:port"
    )
    group.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    group.add_argument(
        "--timeout", type=seconds, default=default(None), metavar="SECONDS", help="deadline of each call"
    )


def _command(
    subparsers: Any, name: str, handler: Callable[[argparse.Namespace], int], help_text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text, description=help_text)
    _global_options(parser, suppress=True)
    parser.set_defaults(handler=handler)
    return parser


def _group(subparsers: Any, name: str, help_text: str) -> Any:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def _add_cell_commands(subparsers: Any) -> None:
    cell = _group(subparsers, "cell", "allocate, free and list cells; start and stop executables")
    allocate = _command(cell, "allocate", cmd_cell_allocate, "create a cell")
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

    free = _command(cell, "free", cmd_cell_free, "stop everything in a cell and remove it")
    free.add_argument("name", metavar="NAME")
    free.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="time between SIGTERM and SIGKILL")

    start = _command(cell, "start", cmd_cell_start, "start an executable in a cell")
    start.add_argument("cell", metavar="CELL")
    start.add_argument("executable", metavar="EXE_NAME")
    start.add_argument("args", nargs="*", metavar="ARGS", help="program and arguments, after --")
    start.add_argument("--shell", metavar="CMD", help="run CMD with /bin/sh -c instead of ARGS")
    start.add_argument("--env", action="append", metavar="K=V", help="environment variable (repeatable)")
    start.add_argument("--cwd", metavar="DIR")
    start.add_argument("--uid", type=unsigned(32), metavar="N")
    start.add_argument("--gid", type=unsigned(32), metavar="N")
    start.add_argument("--description", metavar="TEXT")

    stop = _command(cell, "stop", cmd_cell_stop, "stop an executable: SIGTERM, then SIGKILL")
    stop.add_argument("cell", metavar="CELL")
    stop.add_argument("executable", metavar="EXE_NAME")
    stop.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="time between SIGTERM and SIGKILL")

    _command(cell, "list", cmd_cell_list, "the tree of cells and their executables")


def _add_observe_commands(subparsers: Any) -> None:
    observe = _group(subparsers, "observe", "logs and signals, as streams")
    logs = _command(observe, "logs", cmd_observe_logs, "output of an executable")
    logs.add_argument("cell", metavar="CELL")
    logs.add_argument("executable", metavar="EXE_NAME")
    channel = logs.add_mutually_exclusive_group()
    channel.add_argument("--stdout", action="store_true", help="only stdout")
    channel.add_argument("--stderr", action="store_true", help="only stderr")
    daemon = _command(observe, "daemon", cmd_observe_daemon, "auraed's own log")
    for parser in (logs, daemon):
        parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
        parser.add_argument("--tail", type=unsigned(32), metavar="N", help="start with the last N lines")
    signals = _command(observe, "signals", cmd_observe_signals, "signals delivered to executables (live)")
    signals.add_argument("--workload", metavar="CELL/EXE", help="only this executable")
    signals.add_argument("--past", action="store_true", help="first the signals recorded so far")


def _add_pki_commands(subparsers: Any) -> None:
    pki = _group(subparsers, "pki", "a development PKI for auraed's mTLS")
    init = _command(pki, "init", cmd_pki_init, "create (or keep) a dev CA, server and client certificates")
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument("--server-name", action="append", metavar="NAME", help="extra DNS name of the server")
    init.add_argument("--server-ip", action="append", type=ip_address, metavar="IP", help="extra server IP")
    init.add_argument("--client", action="append", metavar="NAME", help="client certificate to issue")
    init.add_argument(
        "--socket", default=DEFAULT_SOCKET, help=f"socket in the config (default {DEFAULT_SOCKET})"
    )
    client = _command(pki, "client", cmd_pki_client, "issue another client certificate from the CA in DIR")
    client.add_argument("dir", type=Path, metavar="DIR")
    client.add_argument("name", metavar="NAME")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aer", description="Command line for auraed.")
    _global_options(parser, suppress=False)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(subparsers, "discovery", cmd_discovery, "who auraed is and what the machine can do")
    health = _command(subparsers, "health", cmd_health, "gRPC health status; exit 1 unless SERVING")
    health.add_argument(
        "service", nargs="?", default="", help="a service name; the server as a whole if omitted"
    )
    _add_cell_commands(subparsers)
    _add_observe_commands(subparsers)
    _add_pki_commands(subparsers)
    return parser


# --------------------------------------------------------------------------- main


def _fail(message: str) -> int:
    print(f"aer: {' '.join(message.split())}", file=sys.stderr)
    return 1


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; all that follows the first ``--`` is the program of ``cell start``.

    argparse alone would drop ``-- ARGS`` that come after an option (``--env K=V -- prog``).
    """
    parser, argv = build_parser(), list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:at])
    if at < len(argv):
        if not hasattr(args, "args"):
            parser.error("unexpected arguments after --")
        args.args = [*args.args, *argv[at + 1 :]]
    return args


def run(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.handler(args))
    except ClientError as exc:
        return _fail(f"{exc.code}: {exc.message}")
    except (CliError, PkiError) as exc:
        return _fail(str(exc))
    except BrokenPipeError:  # e.g. `aer observe logs ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
