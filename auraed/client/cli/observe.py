"""``aer observe``: executables' logs, auraed's own log and the signals delivered, as streams."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import betterproto2

from auraed.api.aurae.observe import v0 as observe_pb
from auraed.client.cli.arguments import add_command, add_group, unsigned
from auraed.client.cli.calls import OBSERVE, call_timeout, session
from auraed.client.cli.output import emit, time_text
from auraed.client.client import AuraeClient


def _stream(
    args: argparse.Namespace,
    method: str,
    request: betterproto2.Message,
    show: Callable[[Any], tuple[betterproto2.Message, str]],
) -> None:
    """Print each reply of an Observe stream as it comes: ``show`` gives its message and its text line."""
    timeout = call_timeout(args, open_ended=True)

    async def body(client: AuraeClient) -> None:
        async for reply in client.stream(OBSERVE, method, request, timeout):
            emit(args, *show(reply))

    session(args, body)


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
        return item, f"{time_text(item.timestamp)} {item.level:<7} {item.line}"

    _stream(args, "GetAuraeDaemonLogStream", request, show)
    return 0


def cmd_observe_signals(args: argparse.Namespace) -> int:
    request = observe_pb.ObserveServiceGetPosixSignalsStreamRequest(
        workload=args.workload or "", include_past=args.past
    )

    def show(reply: Any) -> tuple[betterproto2.Message, str]:
        sig = reply.signal
        return (
            sig,
            f"{time_text(sig.timestamp)} {sig.workload} pid {sig.process_id} {sig.signal_name} {sig.how}",
        )

    _stream(args, "GetPosixSignalsStream", request, show)
    return 0


def add_commands(subparsers: Any) -> None:
    observe = add_group(subparsers, "observe", "logs and signals, as streams")
    logs = add_command(observe, "logs", cmd_observe_logs, "output of an executable")
    logs.add_argument("cell", metavar="CELL")
    logs.add_argument("executable", metavar="EXE_NAME")
    channel = logs.add_mutually_exclusive_group()
    channel.add_argument("--stdout", action="store_true", help="only stdout")
    channel.add_argument("--stderr", action="store_true", help="only stderr")
    daemon = add_command(observe, "daemon", cmd_observe_daemon, "auraed's own log")
    for parser in (logs, daemon):
        parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
        parser.add_argument("--tail", type=unsigned(32), metavar="N", help="start with the last N lines")
    signals = add_command(observe, "signals", cmd_observe_signals, "signals delivered to executables (live)")
    signals.add_argument("--workload", metavar="CELL/EXE", help="only this executable")
    signals.add_argument("--past", action="store_true", help="first the signals recorded so far")
