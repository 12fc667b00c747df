"""``aer system``: the daemon itself."""

from __future__ import annotations

import argparse
from typing import Any

from auraed.api.aurae.system import v0 as system_pb
from auraed.client.cli.arguments import add_command, add_group
from auraed.client.cli.calls import SYSTEM, call
from auraed.client.cli.output import report


def cmd_system_shutdown(args: argparse.Namespace) -> int:
    request = system_pb.SystemServiceShutdownRequest(reason=args.reason, reboot=args.reboot)
    reply = call(args, SYSTEM, "Shutdown", request)
    then = {
        "poweroff": "then powers the machine off",
        "reboot": "then reboots the machine",
        "exit": "then exits",
    }.get(reply.then, reply.then)
    report(args, reply, f"auraed is shutting down; it {then}")
    return 0


def add_commands(subparsers: Any) -> None:
    system = add_group(subparsers, "system", "the daemon itself (and the machine, where auraed is its init)")
    shutdown = add_command(
        system,
        "shutdown",
        cmd_system_shutdown,
        "stop auraed gracefully, as SIGTERM does; where it is PID 1, the machine then powers off",
    )
    shutdown.add_argument("--reason", default="", metavar="TEXT", help="why, for the daemon's log")
    shutdown.add_argument(
        "--reboot",
        action="store_true",
        help="reboot the machine instead (a machine booted from the host image)",
    )
