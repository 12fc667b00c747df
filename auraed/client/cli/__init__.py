"""``aer``: the command line for auraed, built on :class:`auraed.client.AuraeClient`.

Tables and trees are for people; ``--json`` prints the proto3 JSON mapping of each response (field
names as in the .proto, unset fields as ``null``, 64-bit integers as strings), or one JSON object
per line for streams. Every failure is one line on stderr, ``aer: <GRPC_CODE>: <detail>`` for
errors the server reported, ``aer: <message>`` for local ones, and a non-zero exit status.

The parser is built here from the commands of each service (one module each: discovery, cells,
observe, system, images, containers and container_exec, vms, pki); what they share is in
arguments (argument types, the parser's building blocks), calls (sessions, deadlines, Ctrl-C,
CliError) and output (tables, JSON, the spinner).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from auraed.client.cli import cells, containers, discovery, images, network, observe, pki, system, vms
from auraed.client.cli.arguments import add_global_options
from auraed.client.cli.calls import EXIT_INTERRUPTED, CliError
from auraed.client.client import ClientError
from auraed.pki import PkiError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aer", description="Command line for auraed.")
    add_global_options(parser, suppress=False)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for service in (discovery, cells, observe, system, network, images, containers, vms, pki):
        service.add_commands(subparsers)
    return parser


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
