"""aer's output: tables and trees for people, the proto3 JSON mapping with --json (see
auraed.client.cli), a spinner while a long call runs, and the texts of sizes, times and states."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

import betterproto2
from rich.console import Console
from rich.table import Table
from rich.text import Text

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.containers import v0 as containers_pb

console = Console(markup=False, highlight=False)  # styles come from Text objects
status_console = Console(stderr=True, markup=False, highlight=False)  # spinners of long calls


@contextlib.contextmanager
def spinner(args: argparse.Namespace, text: str) -> Iterator[None]:
    """``text`` with a spinner on stderr while a call that may take long runs (a guest boots for
    seconds under emulation, a stop waits out its grace period), so a person at a terminal sees
    what it waits for. Gone once the call ends; never with --json, or when stderr is not a terminal."""
    if not text or args.json or not status_console.is_terminal:
        yield
        return
    with status_console.status(text):
        yield


def as_dict(message: betterproto2.Message) -> dict[str, Any]:
    return message.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)


def emit(
    args: argparse.Namespace,
    message: betterproto2.Message,
    line: str,
    file: IO[str] | None = None,
    flush: bool = True,
) -> None:
    """One item of a stream: its JSON on one line of stdout with --json, else ``line`` on ``file``."""
    if args.json:
        print(json.dumps(as_dict(message)), flush=flush)
    else:
        print(line, file=file or sys.stdout, flush=flush)


def print_json(value: betterproto2.Message | dict[str, Any]) -> None:
    data = value if isinstance(value, dict) else as_dict(value)
    print(json.dumps(data, indent=2))


def report(args: argparse.Namespace, reply: betterproto2.Message, text: str) -> None:
    if args.json:
        print_json(reply)
    else:
        console.print(text)


def kv_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)


def size_text(n: int) -> str:
    """Exact in the largest binary unit that divides it (1536Mi), else rounded (23.5Gi)."""
    units = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))
    exact = next(
        (f"{n // unit}{suffix}" for suffix, unit in units if n % unit == 0 and 0 < n // unit < 10000), None
    )
    near = next(((suffix, unit) for suffix, unit in units if n >= unit), None)
    return exact or (f"{n / near[1]:.1f}{near[0]}" if near else str(n))


def time_text(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="milliseconds")


def age_text(timestamp: float) -> str:
    if not timestamp:
        return "-"
    elapsed = max(0.0, time.time() - timestamp)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if elapsed >= length:
            return f"{int(elapsed // length)}{unit} ago"
    return f"{int(elapsed)}s ago"


def short_id(digest: str) -> str:
    return digest.partition(":")[2][:12] if ":" in digest else digest[:12]


def lines_text(values: Sequence[str]) -> str:
    return "\n".join(values) or "-"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


Status = cells_pb.ExecutableStatus | containers_pb.ContainerStatus


def ending_of(status: Status) -> str:
    """How it ended: exit code, signal, OOM kill; empty while it has not."""
    details = []
    if status.exit_code is not None:
        details.append(f"code {status.exit_code}")
    if status.signal is not None:
        details.append(signal_name(status.signal))
    if status.oom_killed:
        details.append("OOM killed")
    return ", ".join(details)


def outcome_of(status: Status) -> tuple[str, str]:
    """How an executable or a container is doing, and the style to show it in."""
    details = ending_of(status)
    state = status.state.name
    text = f"{state} ({details})" if details else state
    clean = status.exit_code == 0 and not status.oom_killed
    style = {"RUNNING": "green", "EXITED": "blue" if clean else "red"}.get(state, "yellow")
    return text, style
