"""``aer``: the command line for auraed, built on :class:`auraed.client.AuraeClient`.

Tables and trees are for people; ``--json`` prints the proto3 JSON mapping of each response (field
names as in the .proto, unset fields as ``null``, 64-bit integers as strings), or one JSON object
per line for streams. Every failure is one line on stderr, ``aer: <GRPC_CODE>: <detail>`` for
errors the server reported, ``aer: <message>`` for local ones, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import shlex
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import betterproto2
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.containers import v0 as containers_pb
from auraed.api.aurae.discovery import v0 as discovery_pb
from auraed.api.aurae.observe import v0 as observe_pb
from auraed.api.aurae.system import v0 as system_pb
from auraed.api.aurae.vms import v0 as vms_pb
from auraed.client.client import (
    DEFAULT_SOCKET,
    AuraeClient,
    ClientConfig,
    ClientError,
    client_config_text,
    load_client_config,
    log_lines,
)
from auraed.names import MAX_WAIT_MS
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
CONTAINERS = "aurae.containers.v0.ContainerService"
VMS = "aurae.vms.v0.VmService"
SYSTEM = "aurae.system.v0.SystemService"
DEFAULT_TIMEOUT = 30.0
EXIT_INTERRUPTED = 130
EXIT_INTERRUPT_GRACE = 3.0  # seconds Ctrl-C leaves for tearing down before the process just ends
STDIN_CHUNK = 1 << 16

T = TypeVar("T")
M = TypeVar("M", bound=betterproto2.Message)

console = Console(markup=False, highlight=False)  # styles come from Text objects
status_console = Console(stderr=True, markup=False, highlight=False)  # spinners of long calls


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


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def command_line(text: str) -> list[str]:
    """A command split as sh would: ``--entrypoint "sh -c 'echo hi'"``."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # an unclosed quote, a trailing backslash
        raise argparse.ArgumentTypeError(f"cannot split {text!r} as sh would: {exc}") from None


def env_var(text: str) -> str:
    key_value(text)
    return text


def bind_mount(text: str) -> containers_pb.Mount:
    """SRC:DST[:ro|rw], a bind mount; a relative SRC is made absolute here."""
    parts = text.split(":")
    mode = parts.pop() if len(parts) == 3 and parts[2] in ("ro", "rw") else "rw"
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected SRC:DST[:ro], not {text!r}")
    source = str(Path(parts[0]).expanduser().absolute())
    return containers_pb.Mount(source=source, destination=parts[1], read_only=mode == "ro")


SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def since(text: str) -> float:
    """Seconds ago ("90", "10m", "2h", "1d"), or a Unix time when a plain number past 1e9."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not seconds ago (90, 10m, 2h, 1d) or a Unix time: {text!r}")
    value = float(match[1])
    if not match[2] and value >= 1e9:
        return value
    return time.time() - value * SINCE_UNITS[match[2]]


# --------------------------------------------------------------------------- calling auraed


def _config(args: argparse.Namespace) -> ClientConfig:
    try:
        return load_client_config(args.config, args.address)
    except ClientError as exc:
        raise CliError(exc.message) from None


def _timeout(args: argparse.Namespace, open_ended: bool = False, slack_ms: int | None = None) -> float | None:
    """--timeout when given; otherwise a default (plus grace) for a call, and none for one that
    takes as long as it takes: a stream that follows, or prints a log of any length as it
    comes (a deadline cut a long one short with DEADLINE_EXCEEDED), a wait, an exec, an image
    imported or sent to a guest."""
    if args.timeout is not None:
        return float(args.timeout)
    return None if open_ended else DEFAULT_TIMEOUT + (slack_ms or 0) / 1000


def _session(args: argparse.Namespace, body: Callable[[AuraeClient], Awaitable[T]]) -> T:
    """Connect as the client config says, run ``body`` with the client, and close the channel."""
    config = _config(args)

    async def run() -> T:
        try:
            client = AuraeClient.connect(config, vm=getattr(args, "vm", None) or "")
        except ClientError as exc:  # unreadable certificate or key: a local problem
            raise CliError(exc.message) from None
        with _ends_soon_after_interrupt():
            async with client:
                return await body(client)

    return asyncio.run(run())


@contextlib.contextmanager
def _ends_soon_after_interrupt() -> Iterator[None]:
    """Ctrl-C cancels the command through asyncio's own handler, chained here; should the tear-down
    after it hang (seen once in CI, cause unknown, not reproduced in 240 tries), the process still
    ends with EXIT_INTERRUPTED, EXIT_INTERRUPT_GRACE seconds later."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield  # ignored, not Python's, or not ours to change (only the main thread may)
        return

    def on_interrupt(signum: int, frame: Any) -> None:
        deadline = threading.Timer(EXIT_INTERRUPT_GRACE, _end_interrupted)
        deadline.daemon = True
        deadline.start()
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _end_interrupted() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_INTERRUPTED)


def _call(
    args: argparse.Namespace,
    service: str,
    method: str,
    request: betterproto2.Message,
    *,
    slack_ms: int | None = None,
    waiting: str = "",
    open_ended: bool = False,
) -> Any:
    """One unary call; ``waiting`` is shown while it runs (see :func:`_waiting`). ``open_ended``:
    no default deadline, for a call whose length grows with its data (an image of any size)."""
    timeout = _timeout(args, open_ended=open_ended, slack_ms=slack_ms)
    with _waiting(args, waiting):
        return _session(args, lambda client: client.call(service, method, request, timeout))


@contextlib.contextmanager
def _waiting(args: argparse.Namespace, text: str) -> Iterator[None]:
    """``text`` with a spinner on stderr while a call that may take long runs (a guest boots for
    seconds under emulation, a stop waits out its grace period), so a person at a terminal sees
    what it waits for. Gone once the call ends; never with --json, or when stderr is not a terminal."""
    if not text or args.json or not status_console.is_terminal:
        yield
        return
    with status_console.status(text):
        yield


def _stream(
    args: argparse.Namespace,
    method: str,
    request: betterproto2.Message,
    show: Callable[[Any], tuple[betterproto2.Message, str]],
) -> None:
    """Print each reply of an Observe stream as it comes: ``show`` gives its message and its text line."""
    timeout = _timeout(args, open_ended=True)

    async def body(client: AuraeClient) -> None:
        async for reply in client.stream(OBSERVE, method, request, timeout):
            _emit(args, *show(reply))

    _session(args, body)


# --------------------------------------------------------------------------- output


def _as_dict(message: betterproto2.Message) -> dict[str, Any]:
    return message.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)


def _emit(
    args: argparse.Namespace,
    message: betterproto2.Message,
    line: str,
    file: IO[str] | None = None,
    flush: bool = True,
) -> None:
    """One item of a stream: its JSON on one line of stdout with --json, else ``line`` on ``file``."""
    if args.json:
        print(json.dumps(_as_dict(message)), flush=flush)
    else:
        print(line, file=file or sys.stdout, flush=flush)


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


def _age(timestamp: float) -> str:
    if not timestamp:
        return "-"
    elapsed = max(0.0, time.time() - timestamp)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if elapsed >= length:
            return f"{int(elapsed // length)}{unit} ago"
    return f"{int(elapsed)}s ago"


def _short_id(digest: str) -> str:
    return digest.partition(":")[2][:12] if ":" in digest else digest[:12]


def _lines(values: Sequence[str]) -> str:
    return "\n".join(values) or "-"


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


def cmd_system_shutdown(args: argparse.Namespace) -> int:
    reply = _call(args, SYSTEM, "Shutdown", system_pb.SystemServiceShutdownRequest(reason=args.reason))
    then = {"poweroff": "then powers the machine off", "exit": "then exits"}.get(reply.then, reply.then)
    _report(args, reply, f"auraed is shutting down; it {then}")
    return 0


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


def _grace_slack(grace_ms: int | None) -> int:
    """What a stop's deadline adds for its grace period: without one given, the daemon's
    stop_grace_period, which may be up to MAX_WAIT_MS (the call failed at DEFAULT_TIMEOUT while
    the stop went on)."""
    return MAX_WAIT_MS if grace_ms is None else grace_ms


def cmd_cell_free(args: argparse.Namespace) -> int:
    request = cells_pb.CellServiceFreeRequest(cell_name=args.name, grace_period_ms=args.grace)
    waiting = f"freeing cell {args.name}"
    reply = _call(args, CELLS, "Free", request, slack_ms=_grace_slack(args.grace), waiting=waiting)
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
    waiting = f"stopping {args.cell}/{args.executable}"
    reply = _call(args, CELLS, "Stop", request, slack_ms=_grace_slack(args.grace), waiting=waiting)
    status = reply.status or cells_pb.ExecutableStatus()
    _report(args, reply, f"stopped {args.cell}/{args.executable}: {_outcome(status)[0]}")
    return 0


Status = cells_pb.ExecutableStatus | containers_pb.ContainerStatus


def _ending(status: Status) -> str:
    """How it ended: exit code, signal, OOM kill; empty while it has not."""
    details = []
    if status.exit_code is not None:
        details.append(f"code {status.exit_code}")
    if status.signal is not None:
        details.append(_signal_name(status.signal))
    if status.oom_killed:
        details.append("OOM killed")
    return ", ".join(details)


def _outcome(status: Status) -> tuple[str, str]:
    """How an executable or a container is doing, and the style to show it in."""
    details = _ending(status)
    state = status.state.name
    text = f"{state} ({details})" if details else state
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
    _stream(args, "GetSubProcessStream", request, lambda reply: (reply.item, reply.item.line))
    return 0


def cmd_observe_daemon(args: argparse.Namespace) -> int:
    request = observe_pb.ObserveServiceGetAuraeDaemonLogStreamRequest(follow=args.follow, tail=args.tail)

    def show(reply: Any) -> tuple[betterproto2.Message, str]:
        item = reply.item
        return item, f"{_time(item.timestamp)} {item.level:<7} {item.line}"

    _stream(args, "GetAuraeDaemonLogStream", request, show)
    return 0


def cmd_observe_signals(args: argparse.Namespace) -> int:
    request = observe_pb.ObserveServiceGetPosixSignalsStreamRequest(
        workload=args.workload or "", include_past=args.past
    )

    def show(reply: Any) -> tuple[betterproto2.Message, str]:
        sig = reply.signal
        return sig, f"{_time(sig.timestamp)} {sig.workload} pid {sig.process_id} {sig.signal_name} {sig.how}"

    _stream(args, "GetPosixSignalsStream", request, show)
    return 0


# --------------------------------------------------------------------------- images


def _image_summary(verb: str, image: containers_pb.Image) -> str:
    return f"{verb} {image.id}" + (f" as {', '.join(image.references)}" if image.references else "")


def _progress_line(progress: containers_pb.PullProgress) -> str:
    overall = f"{_size(progress.done)}/{_size(progress.total)}"
    if progress.digest:
        layer = f"{_size(progress.layer_done)}/{_size(progress.layer_total)}"
        return f"{progress.phase} {_short_id(progress.digest)} {layer} (total {overall})"
    return f"{progress.phase} (total {overall})" if progress.total else progress.phase


class _PullBars:
    """Rich progress bars for a pull: one per layer, and the whole."""

    def __init__(self, bars: Progress) -> None:
        self.bars = bars
        self.total = bars.add_task("total", total=None)
        self.layers: dict[str, TaskID] = {}
        self.sizes: dict[TaskID, int] = {}

    def show(self, progress: containers_pb.PullProgress) -> None:
        if progress.digest:
            task = self.layers.get(progress.digest)
            if task is None:
                task = self.layers[progress.digest] = self.bars.add_task("", total=None)
            self.sizes[task] = progress.layer_total
            self.bars.update(
                task,
                description=f"{_short_id(progress.digest)} {progress.phase}",
                completed=progress.layer_done,
                total=progress.layer_total or None,
            )
        if progress.phase == "done":  # layer messages are sampled: the last one may be missing
            for digest, task in self.layers.items():
                self.bars.update(task, description=f"{_short_id(digest)} done", completed=self.sizes[task])
        self.bars.update(
            self.total,
            description=f"total {progress.phase}",
            completed=progress.done,
            total=progress.total or None,
        )


def cmd_image_pull(args: argparse.Namespace) -> int:
    auth = None
    if args.username is not None or args.password_stdin:
        if args.username is None or not args.password_stdin:
            raise CliError("--username and --password-stdin go together")
        password = sys.stdin.read().rstrip("\r\n") if sys.stdin is not None else ""  # None: closed
        if not password:
            raise CliError("--password-stdin: no password on stdin")
        auth = containers_pb.RegistryAuth(username=args.username, password=password)
    elif args.registry_token:
        auth = containers_pb.RegistryAuth(registry_token=args.registry_token)
    request = containers_pb.ContainerServicePullImageRequest(reference=args.reference, auth=auth)
    timeout = _timeout(args, open_ended=True)
    bars = (
        None
        if args.json or not console.is_terminal
        else Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), console=console
        )
    )

    async def body(client: AuraeClient) -> containers_pb.Image | None:
        image, view = None, _PullBars(bars) if bars else None
        async for reply in client.stream(CONTAINERS, "PullImage", request, timeout):
            image = reply.image or image
            if args.json:
                _emit(args, reply, "")
            elif reply.progress is not None and view is not None:
                view.show(reply.progress)
            elif reply.progress is not None:
                print(_progress_line(reply.progress), flush=True)
        return image

    with bars if bars is not None else contextlib.nullcontext():
        image = _session(args, body)
    if image is None:
        raise CliError(f"the pull of {args.reference} ended without an image")
    if not args.json:
        console.print(_image_summary("pulled", image))
    return 0


def cmd_image_import(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceImportImageLayoutRequest(
        path=str(Path(args.path).expanduser().absolute()),
        ref_name=args.ref_name or "",
        reference=args.reference or "",
    )
    waiting = f"importing {request.path}"
    reply = _call(args, CONTAINERS, "ImportImageLayout", request, waiting=waiting, open_ended=True)
    _report(args, reply, _image_summary("imported", reply.image))
    return 0


def cmd_image_list(args: argparse.Namespace) -> int:
    reply = _call(args, CONTAINERS, "ListImages", containers_pb.ContainerServiceListImagesRequest())
    if args.json:
        _print_json(reply)
        return 0
    table = Table("REFERENCES", "ID", "SIZE", "LAYERS", "CREATED", box=None, header_style="bold")
    for image in reply.images:
        table.add_row(
            Text("\n".join(image.references) or "<none>", style="cyan"),
            _short_id(image.id),
            _size(image.size),
            str(len(image.layers)),
            _age(image.created_at),
        )
    console.print(table if reply.images else "no images")
    return 0


def _image_rows(image: containers_pb.Image) -> list[tuple[str, str]]:
    config = image.config or containers_pb.ImageConfig()
    return [
        ("id", image.id),
        ("references", _lines(image.references)),
        ("repo digests", _lines(image.repo_digests)),
        ("manifest digest", image.manifest_digest),
        ("size", f"{_size(image.size)} ({image.size} bytes)"),
        ("platform", f"{image.os}/{image.architecture}"),
        ("created", _time(image.created_at) if image.created_at else "-"),
        ("layers", _lines(image.layers)),
        ("entrypoint", shlex.join(config.entrypoint) or "-"),
        ("cmd", shlex.join(config.cmd) or "-"),
        ("env", _lines(config.env)),
        ("working dir", config.working_dir or "-"),
        ("user", config.user or "-"),
        ("stop signal", config.stop_signal or "-"),
        ("volumes", _lines(config.volumes)),
        ("exposed ports", _lines(config.exposed_ports)),
        ("labels", _lines([f"{k}={v}" for k, v in sorted(config.labels.items())])),
    ]


def cmd_image_inspect(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceImageStatusRequest(image=args.image)
    image = _call(args, CONTAINERS, "ImageStatus", request).image or containers_pb.Image()
    if args.json:
        _print_json(image)
    else:
        _kv_table(f"image {args.image}", _image_rows(image))
    return 0


def cmd_image_remove(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceRemoveImageRequest(image=args.image)
    reply = _call(args, CONTAINERS, "RemoveImage", request)
    if reply.collection_deferred:
        _report(args, reply, f"removed {args.image}; its space is freed once the pulls under way end")
    else:
        _report(args, reply, f"removed {args.image}, freed {_size(reply.freed_bytes)}")
    return 0


# --------------------------------------------------------------------------- containers


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
        resources=_controller(
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
    outcome = _outcome(status)[0]
    pid = f", pid {status.pid}" if status.state == containers_pb.ContainerState.RUNNING else ""
    return f"{verb} {status.name} ({_short_id(status.id)}): {outcome}{pid}"


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
    reply = _call(
        args, CONTAINERS, method, request, slack_ms=slack_ms, waiting=waiting, open_ended=open_ended
    )
    _report(args, reply, _status_line(verb, reply.status or containers_pb.ContainerStatus()))
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
        args, "Stop", request, "stopped", slack_ms=_grace_slack(args.grace), waiting=waiting
    )


def cmd_container_kill(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceKillRequest(container_id=args.name, signal=args.signal)
    reply = _call(args, CONTAINERS, "Kill", request)
    _report(args, reply, f"sent {args.signal} to {args.name}")
    return 0


def cmd_container_remove(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceDeleteRequest(
        container_id=args.name, force=args.force, keep_logs=args.keep_logs
    )
    reply = _call(args, CONTAINERS, "Delete", request)
    _report(args, reply, f"removed {args.name}")
    return 0


def cmd_container_wait(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceWaitRequest(container_id=args.name)
    timeout = _timeout(args, open_ended=True)
    reply = _session(args, lambda client: client.call(CONTAINERS, "Wait", request, timeout))
    status = reply.status or containers_pb.ContainerStatus()
    _report(args, reply, str(_exit_code(status)))
    return 0


def _container_rows(status: containers_pb.ContainerStatus) -> list[tuple[str, str]]:
    def when(timestamp: float | None) -> str:
        return _time(timestamp) if timestamp else "-"

    return [
        ("id", status.id),
        ("name", status.name),
        ("image", status.image),
        ("image id", status.image_id),
        ("state", _outcome(status)[0]),
        ("pid", str(status.pid) if status.pid else "-"),
        ("exit code", "-" if status.exit_code is None else str(status.exit_code)),
        ("signal", "-" if status.signal is None else _signal_name(status.signal)),
        ("oom killed", "yes" if status.oom_killed else "no"),
        ("reason", status.reason or "-"),
        ("created", when(status.created_at)),
        ("started", when(status.started_at)),
        ("finished", when(status.finished_at)),
        ("labels", _lines([f"{k}={v}" for k, v in sorted(status.labels.items())])),
        ("log", status.log_path or "-"),
    ]


def cmd_container_inspect(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceStatusRequest(container_id=args.name)
    status = _call(args, CONTAINERS, "Status", request).status or containers_pb.ContainerStatus()
    if args.json:
        _print_json(status)
    else:
        _kv_table(f"container {args.name}", _container_rows(status))
    return 0


def cmd_container_list(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceListRequest(labels=dict(args.label or []))
    reply = _call(args, CONTAINERS, "List", request)
    if args.json:
        _print_json(reply)
        return 0
    table = Table("NAME", "ID", "IMAGE", "STATE", "PID", "EXIT", "CREATED", box=None, header_style="bold")
    for status in reply.containers:
        style = _outcome(status)[1]
        table.add_row(
            Text(status.name, style="bold"),
            _short_id(status.id),
            status.image,
            Text(status.state.name, style=style),
            str(status.pid) if status.pid else "-",
            Text(_ending(status) or "-", style=style),
            _age(status.created_at),
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
    async for reply in client.stream(CONTAINERS, "Logs", request, _timeout(args, open_ended=True)):
        for line in log_lines(reply):
            file = sys.stderr if line.stream == "stderr" and not args.json else sys.stdout
            if file is not last:
                last.flush()
                last = file
            _emit(args, line, line.line, file, flush=False)
        last.flush()


def cmd_container_logs(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceLogsRequest(
        container_id=args.name,
        follow=args.follow,
        since=args.since,
        tail=args.tail,
        stream="stdout" if args.stdout else "stderr" if args.stderr else "",
    )
    _session(args, lambda client: _print_logs(args, client, request))
    return 0


def cmd_container_run(args: argparse.Namespace) -> int:
    """Create and start (one call), print the logs until it exits; exit as it did. ``--rm`` deletes
    it in any case."""
    create = containers_pb.ContainerServiceCreateRequest(config=_container_config(args), start=True)
    timeout = _timeout(args)
    # In a VM, Create first sends the guest the image: no default deadline (see cmd_container_create).
    create_timeout = _timeout(args, open_ended=bool(args.vm))
    where = f" in VM {args.vm}" if args.vm else ""

    async def body(client: AuraeClient) -> containers_pb.ContainerStatus:
        with _waiting(args, f"starting container {args.name}{where}"):
            await client.call(CONTAINERS, "Create", create, create_timeout)
        try:
            follow = containers_pb.ContainerServiceLogsRequest(container_id=args.name, follow=True)
            await _print_logs(args, client, follow)
            wait = containers_pb.ContainerServiceWaitRequest(container_id=args.name)
            reply = await client.call(CONTAINERS, "Wait", wait, _timeout(args, open_ended=True))
        finally:
            if args.rm:
                delete = containers_pb.ContainerServiceDeleteRequest(container_id=args.name, force=True)
                await client.call(CONTAINERS, "Delete", delete, timeout)
        if args.json:
            _emit(args, reply, "")
        return reply.status or containers_pb.ContainerStatus()

    return _exit_code(_session(args, body))


def cmd_container_stats(args: argparse.Namespace) -> int:
    reply = _call(
        args, CONTAINERS, "Stats", containers_pb.ContainerServiceStatsRequest(container_id=args.name)
    )
    if args.json:
        _print_json(reply)
        return 0

    def limited(current: str, limit: int, text: str) -> str:
        return f"{current} / {text if limit else 'no limit'}"

    _kv_table(
        f"container {args.name}",
        [
            ("cpu", f"{reply.cpu_usage_usec / 1e6:.3f}s"),
            ("cpu throttled", f"{reply.cpu_throttled_usec / 1e6:.3f}s"),
            ("memory", limited(_size(reply.memory_current), reply.memory_max, _size(reply.memory_max))),
            ("pids", limited(str(reply.pids_current), reply.pids_max, str(reply.pids_max))),
            ("io read", _size(reply.io_read_bytes)),
            ("io written", _size(reply.io_write_bytes)),
            ("at", _time(reply.timestamp)),
        ],
    )
    return 0


# --------------------------------------------------------------------------- exec

ExecRequest = containers_pb.ContainerServiceExecRequest


def _terminal_size() -> containers_pb.TerminalSize | None:
    for stream in (sys.stdin, sys.stdout):
        try:
            columns, rows = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError, AttributeError):
            continue
        return containers_pb.TerminalSize(rows=rows, columns=columns)
    return None


def _forward_stdin(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[ExecRequest | None]
) -> Callable[[], object]:
    """Send what comes on stdin, then the end of it; returns how to stop."""
    if sys.stdin is None:  # closed (`aer ... <&-`): an input that has ended
        queue.put_nowait(ExecRequest(close_stdin=True))
        return lambda: None
    fd = sys.stdin.fileno()

    def deliver(data: bytes) -> None:
        queue.put_nowait(ExecRequest(stdin=data) if data else ExecRequest(close_stdin=True))

    def read() -> bytes:
        try:
            return os.read(fd, STDIN_CHUNK)
        except OSError:  # e.g. EIO once a terminal hangs up: the end of input
            return b""

    def readable() -> None:
        data = read()
        if not data:
            loop.remove_reader(fd)
        deliver(data)

    try:
        loop.add_reader(fd, readable)
        return lambda: loop.remove_reader(fd)
    except OSError:  # a regular file or /dev/null: epoll cannot watch it, a thread reads it instead
        pass

    def pump() -> None:
        while True:
            data = read()
            try:
                loop.call_soon_threadsafe(deliver, data)
            except RuntimeError:  # the loop is closed: exec is over
                return
            if not data:
                return

    threading.Thread(target=pump, name="aer-stdin", daemon=True).start()
    return lambda: None


def _write(stream: IO[str], data: bytes) -> None:
    stream.buffer.write(data)  # type: ignore[attr-defined]
    stream.flush()


async def _exec(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    queue: asyncio.Queue[ExecRequest | None] = asyncio.Queue()
    size = _terminal_size() if args.tty else None
    start = containers_pb.ExecStart(
        container_id=args.name, command=args.args, tty=args.tty, stdin=args.interactive, size=size
    )
    stop_reading: Callable[[], object] = _forward_stdin(loop, queue) if args.interactive else lambda: None
    if not args.interactive and not args.tty:
        queue.put_nowait(None)  # nothing more to send: the process's stdin ends now

    async def requests() -> AsyncIterator[ExecRequest]:
        yield ExecRequest(start=start)
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        new = _terminal_size()
        if new is not None:
            queue.put_nowait(ExecRequest(resize=new))

    ended_by: list[int] = []

    def terminate(signum: int) -> None:  # a Python exit, so that the terminal is restored
        ended_by.append(signum)
        if task is not None:
            task.cancel()

    handlers: dict[int, tuple[Callable[..., None], tuple[int, ...]]] = {
        signal.SIGTERM: (terminate, (signal.SIGTERM,)),
        signal.SIGHUP: (terminate, (signal.SIGHUP,)),
    }
    if size is not None:
        handlers[signal.SIGWINCH] = (resized, ())
    for signum, (handler, arguments) in handlers.items():
        loop.add_signal_handler(signum, handler, *arguments)
    code: int | None = None
    try:
        async for reply in client.duplex(CONTAINERS, "Exec", requests(), _timeout(args, open_ended=True)):
            if reply.stdout:
                _write(sys.stdout, reply.stdout)
            if reply.stderr:
                _write(sys.stderr, reply.stderr)
            if reply.exit_code is not None:
                code = reply.exit_code
    except asyncio.CancelledError:
        if not ended_by:
            raise
        return 128 + ended_by[0]
    finally:
        stop_reading()
        queue.put_nowait(None)
        for signum in handlers:
            loop.remove_signal_handler(signum)
    if code is None:
        raise CliError("exec ended without an exit code")
    return code


def cmd_container_exec(args: argparse.Namespace) -> int:
    if not args.args:
        raise CliError("container exec: give the command after --")
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    saved = termios.tcgetattr(fd) if args.tty and args.interactive and os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)  # keys, ^C included, go to the container's terminal
        return _session(args, lambda client: _exec(args, client))
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


# --------------------------------------------------------------------------- pki


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
    config.write_text(
        "# aer client config, written by `aer pki init`\n"
        + client_config_text(paths.ca_crt, crt, key, args.socket)
    )
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


def _global_options(parser: argparse.ArgumentParser, suppress: bool, deadline: bool = True) -> None:
    """The options every command takes, before or after the command's name.

    Subcommands repeat them with SUPPRESS defaults so that they only override the top level when given.
    Without ``deadline`` the command has its own --timeout (``container stop``); the deadline of
    its call is then only given before the command's name.
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
        "--vm",
        default=default(None),
        metavar="NAME",
        help="run container and image commands in this VM's guest (the host sends it the image: a "
        "create or run then has no default deadline; --timeout bounds it)",
    )
    if deadline:
        group.add_argument(
            "--timeout", type=seconds, default=default(None), metavar="SECONDS", help="deadline of each call"
        )


def _command(
    subparsers: Any,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
    deadline: bool = True,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text, description=help_text)
    _global_options(parser, suppress=True, deadline=deadline)
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


def _add_system_commands(subparsers: Any) -> None:
    system = _group(subparsers, "system", "the daemon itself (and the machine, where auraed is its init)")
    shutdown = _command(
        system,
        "shutdown",
        cmd_system_shutdown,
        "stop auraed gracefully, as SIGTERM does; where it is PID 1, the machine then powers off",
    )
    shutdown.add_argument("--reason", default="", metavar="TEXT", help="why, for the daemon's log")


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


def _add_image_commands(subparsers: Any) -> None:
    image = _group(subparsers, "image", "pull, import, list, inspect and remove OCI images")
    pull = _command(image, "pull", cmd_image_pull, "pull an image from a registry, showing progress")
    pull.add_argument("reference", metavar="REF", help='e.g. "busybox" or "registry.example:5000/app:1.0"')
    credentials = pull.add_mutually_exclusive_group()
    credentials.add_argument("--username", metavar="U", help="registry user; the password comes on stdin")
    credentials.add_argument("--registry-token", metavar="T", help="a bearer token for the registry")
    pull.add_argument("--password-stdin", action="store_true", help="read the password from stdin")

    load = _command(image, "import", cmd_image_import, "import an OCI image layout (directory or tar)")
    load.add_argument("path", metavar="PATH", help="on the daemon's machine; made absolute here")
    load.add_argument("--ref-name", metavar="NAME", help="which image of the layout (its ref name)")
    load.add_argument("--reference", metavar="REF", help="the name to store it as (default: the ref name)")

    _command(image, "ls", cmd_image_list, "the stored images")
    inspect = _command(image, "inspect", cmd_image_inspect, "everything about one image")
    inspect.add_argument("image", metavar="IMAGE", help="a reference, image id or repo digest")
    remove = _command(image, "rm", cmd_image_remove, "remove an image and collect what nothing else uses")
    remove.add_argument("image", metavar="IMAGE", help="a reference, image id or repo digest")


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


def _add_container_commands(subparsers: Any) -> None:
    container = _group(subparsers, "container", "create, run, exec into and remove containers")
    create = _command(container, "create", cmd_container_create, "create a container (not started)")
    _container_options(create)
    run = _command(container, "run", cmd_container_run, "create, start, print its logs; exit as it does")
    _container_options(run)
    run.add_argument("--rm", action="store_true", help="remove it once it exits")

    start = _command(container, "start", cmd_container_start, "start a created container")
    stop = _command(container, "stop", cmd_container_stop, "its stop signal, then SIGKILL", deadline=False)
    stop.add_argument(
        "--timeout",
        "-t",
        dest="grace",
        type=grace_ms,
        metavar="SECONDS",
        help="before SIGKILL (default: the daemon's stop_grace_period); the call's deadline goes first: "
        "aer --timeout S container stop",
    )
    kill = _command(container, "kill", cmd_container_kill, "send a signal")
    kill.add_argument("--signal", "-s", default="SIGKILL", metavar="SIG", help="name or number (SIGKILL)")
    remove = _command(container, "rm", cmd_container_remove, "remove a container that is not running")
    remove.add_argument("--force", "-f", action="store_true", help="kill it first if it runs")
    remove.add_argument("--keep-logs", action="store_true", help="leave its log file")
    wait = _command(container, "wait", cmd_container_wait, "wait for the end; print the exit code")
    inspect = _command(container, "inspect", cmd_container_inspect, "the status of a container")
    stats = _command(container, "stats", cmd_container_stats, "CPU, memory, pids and I/O of a container")
    logs = _command(container, "logs", cmd_container_logs, "the output of a container")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until it exits")
    logs.add_argument("--tail", type=unsigned(32), metavar="N", help="start with the last N lines")
    logs.add_argument("--since", type=since, metavar="WHEN", help="seconds ago (90, 10m, 2h) or a Unix time")
    channel = logs.add_mutually_exclusive_group()
    channel.add_argument("--stdout", action="store_true", help="only stdout")
    channel.add_argument("--stderr", action="store_true", help="only stderr")
    execute = _command(container, "exec", cmd_container_exec, "run a command in a running container")
    execute.add_argument("-i", "--interactive", action="store_true", help="send stdin")
    execute.add_argument("-t", "--tty", action="store_true", help="on a terminal (raw mode locally with -i)")
    for parser in (start, stop, kill, remove, wait, inspect, stats, logs, execute):
        parser.add_argument("name", metavar="NAME", help="the container's name or id")
    execute.add_argument("args", nargs="*", metavar="CMD", help="after --: the command and its arguments")

    listing = _command(container, "ls", cmd_container_list, "the containers")
    listing.add_argument("--label", "-l", action="append", type=key_value, metavar="K=V", help="only these")


# --------------------------------------------------------------------------- vms

VM_START_SLACK_MS = 300_000  # a guest booting under emulation takes a while to answer


def _vm_line(status: Any) -> str:
    state = vms_pb.VmState(status.state).name
    where = f" at {status.address}" if status.address else ""
    reason = f" ({status.reason})" if status.reason else ""
    return f"{status.vm.name}: {state}{where}{reason}"


def cmd_vm_allocate(args: argparse.Namespace) -> int:
    vm = vms_pb.VirtualMachine(
        name=args.name,
        vcpus=args.vcpus,
        memory_mib=args.memory,
        kernel=_absolute(args.kernel),
        initramfs=_absolute(args.initramfs),
        root_disk=_absolute(args.root_disk),
        kernel_args=args.kernel_arg or [],
        network=args.network or args.guest,
        role="guest" if args.guest else (args.role or ""),
    )
    reply = _call(args, VMS, "Allocate", vms_pb.VmServiceAllocateRequest(vm=vm))
    _report(args, reply, f"allocated {_vm_line(reply.status)}")
    return 0


def _absolute(path: str | None) -> str:
    return str(Path(path).absolute()) if path else ""


def cmd_vm_start(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceStartRequest(name=args.name, wait_for_console=args.wait_for_console or "")
    waiting = f"starting VM {args.name}" + (
        f" until {args.wait_for_console!r} is on its console" if args.wait_for_console else ""
    )
    reply = _call(args, VMS, "Start", request, slack_ms=VM_START_SLACK_MS, waiting=waiting)
    ready = f", ready in {reply.console_ready_ms / 1000:.1f} s" if reply.console_ready_ms else ""
    _report(args, reply, f"started {_vm_line(reply.status)}{ready}")
    return 0


def cmd_vm_stop(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceStopRequest(name=args.name, timeout_ms=args.grace)
    waiting = f"stopping VM {args.name}"
    reply = _call(args, VMS, "Stop", request, slack_ms=_grace_slack(args.grace), waiting=waiting)
    _report(args, reply, f"stopped {_vm_line(reply.status)}")
    return 0


def cmd_vm_free(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceFreeRequest(name=args.name, timeout_ms=args.grace)
    waiting = f"freeing VM {args.name}"  # a running one is stopped first
    reply = _call(args, VMS, "Free", request, slack_ms=_grace_slack(args.grace), waiting=waiting)
    _report(args, reply, f"freed VM {args.name}")
    return 0


def cmd_vm_list(args: argparse.Namespace) -> int:
    reply = _call(args, VMS, "List", vms_pb.VmServiceListRequest())
    if args.json:
        _print_json(reply)
        return 0
    table = Table("NAME", "STATE", "BACKEND", "ADDRESS", "PID", "TAP", box=None, header_style="bold")
    for status in reply.vms:
        table.add_row(
            status.vm.name,
            vms_pb.VmState(status.state).name,
            f"{status.backend}/{status.accelerator}",
            status.address or "-",
            str(status.pid or "-"),
            status.tap or "-",
        )
    console.print(table if reply.vms else "no VMs")
    return 0


def cmd_vm_console(args: argparse.Namespace) -> int:
    request = vms_pb.VmServiceGetConsoleRequest(name=args.name, tail=args.tail, follow=args.follow)
    timeout = _timeout(args, open_ended=True)

    async def body(client: AuraeClient) -> None:
        async for reply in client.stream(VMS, "GetConsole", request, timeout):
            _emit(args, reply, reply.line)

    _session(args, body)
    return 0


def _add_vm_commands(subparsers: Any) -> None:
    vm = _group(subparsers, "vm", "virtual machines: guests with their own auraed, or any kernel")
    allocate = _command(vm, "allocate", cmd_vm_allocate, "define a VM (and its tap and addresses)")
    allocate.add_argument("name", metavar="NAME")
    allocate.add_argument("--guest", action="store_true", help="boot the guest image with auraed as PID 1")
    allocate.add_argument("--vcpus", type=unsigned(32), default=0, help="virtual CPUs (default 1)")
    allocate.add_argument(
        "--memory", type=unsigned(64), default=0, metavar="MIB", help="memory in MiB (default 512)"
    )
    allocate.add_argument("--kernel", help="kernel image (the guest image's with --guest)")
    allocate.add_argument("--initramfs")
    allocate.add_argument("--root-disk", help="read-only root disk image")
    allocate.add_argument("--kernel-arg", action="append", metavar="ARG", help="extra kernel argument")
    allocate.add_argument("--network", action="store_true", help="a tap and an address pair")
    allocate.add_argument("--role", help="auraed role passed on the kernel command line")
    start = _command(vm, "start", cmd_vm_start, "boot a VM; a guest is ready once its auraed serves")
    start.add_argument("name", metavar="NAME")
    start.add_argument("--wait-for-console", metavar="TEXT", help="return once TEXT is on the console")
    stop = _command(
        vm, "stop", cmd_vm_stop, "power off (ACPI), forced after the grace period", deadline=False
    )
    stop.add_argument("name", metavar="NAME")
    stop.add_argument(
        "--grace", type=grace_ms, metavar="SECONDS", help="to power off before the VMM is ended"
    )
    free = _command(vm, "free", cmd_vm_free, "stop a VM and remove its tap, files and record")
    free.add_argument("name", metavar="NAME")
    free.add_argument("--grace", type=grace_ms, metavar="SECONDS", help="to power off, if running")
    _command(vm, "ls", cmd_vm_list, "the VMs, with state read from their VMM")
    console_ = _command(vm, "console", cmd_vm_console, "the serial console")
    console_.add_argument("name", metavar="NAME")
    console_.add_argument("-f", "--follow", action="store_true")
    console_.add_argument("--tail", type=unsigned(32), default=None, metavar="N")


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
    _add_system_commands(subparsers)
    _add_image_commands(subparsers)
    _add_container_commands(subparsers)
    _add_vm_commands(subparsers)
    _add_pki_commands(subparsers)
    return parser


# --------------------------------------------------------------------------- main


def _fail(message: str) -> int:
    print(f"aer: {' '.join(message.split())}", file=sys.stderr)
    return 1


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; all that follows the first ``--`` is the program of ``cell start``,
    ``container create``, ``run`` or ``exec``.

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
