"""``aer network``: the interfaces and routes of a machine auraed is the init of (a guest, with
``--vm NAME``; a machine booted on auraed)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from auraed.api.aurae.network import v0 as network_pb
from auraed.client.cli.arguments import add_command, add_group, unsigned
from auraed.client.cli.calls import NETWORK, CliError, call
from auraed.client.cli.output import console, print_json

ROUTE_WORDS = {"via": "gateway", "dev": "device", "src": "source"}


def route(text: str) -> network_pb.Route:
    """An argparse type for a route as ``ip route`` writes one: "DEST [via GW] [dev D] [src S]"."""
    words = text.split()
    if not words or len(words) % 2 == 0:
        raise argparse.ArgumentTypeError(f"not a route: {text!r} (DEST [via GW] [dev D] [src S])")
    fields = {"destination": words[0]}
    for word, value in zip(words[1::2], words[2::2], strict=True):
        if word not in ROUTE_WORDS:
            raise argparse.ArgumentTypeError(f"{word!r} in {text!r}: expected via, dev or src")
        fields[ROUTE_WORDS[word]] = value
    return network_pb.Route(**fields)


def route_text(value: network_pb.Route) -> str:
    parts = [value.destination]
    for word, field in ROUTE_WORDS.items():
        if getattr(value, field):
            parts += [word, getattr(value, field)]
    return " ".join(parts)


def _print_interfaces(interfaces: list[network_pb.Interface]) -> None:
    table = Table("NAME", "STATE", "MTU", "MAC", "ADDRESSES", box=None, header_style="bold")
    for i in interfaces:
        table.add_row(
            i.name, "up" if i.up else "down", str(i.mtu), i.mac or "-", " ".join(i.addresses) or "-"
        )
    console.print(table)


def cmd_network_ls(args: argparse.Namespace) -> int:
    reply = call(args, NETWORK, "ListInterfaces", network_pb.NetworkServiceListInterfacesRequest())
    if args.json:
        print_json(reply)
    else:
        _print_interfaces(reply.interfaces)
    return 0


def cmd_network_set(args: argparse.Namespace) -> int:
    if args.ip is None and args.mtu is None and args.up is None:
        raise CliError("network set: give --ip, --mtu, --up or --down")
    request = network_pb.NetworkServiceUpdateInterfaceRequest(
        name=args.name,
        replace_addresses=args.ip is not None,
        addresses=args.ip or [],
        mtu=args.mtu,
        up=args.up,
    )
    reply = call(args, NETWORK, "UpdateInterface", request)
    if args.json:
        print_json(reply)
    else:
        _print_interfaces([reply.interface])
    return 0


def _print_routes(routes: list[network_pb.Route]) -> None:
    for value in routes:
        console.print(route_text(value), highlight=False)


def cmd_network_routes(args: argparse.Namespace) -> int:
    reply = call(args, NETWORK, "ListRoutes", network_pb.NetworkServiceListRoutesRequest())
    if args.json:
        print_json(reply)
    else:
        _print_routes(reply.routes)
    return 0


def cmd_network_set_routes(args: argparse.Namespace) -> int:
    request = network_pb.NetworkServiceUpdateRoutesRequest(routes=args.route or [])
    reply = call(args, NETWORK, "UpdateRoutes", request)
    if args.json:
        print_json(reply)
    else:
        _print_routes(reply.routes)
    return 0


def add_commands(subparsers: Any) -> None:
    group = add_group(
        subparsers, "network", "interfaces and routes of a machine auraed is the init of (--vm NAME)"
    )
    add_command(group, "ls", cmd_network_ls, "the interfaces and their addresses")
    changed = add_command(group, "set", cmd_network_set, "change an interface: addresses, MTU, up or down")
    changed.add_argument("name", metavar="NAME", help="the interface, e.g. eth0")
    changed.add_argument(
        "--ip",
        action="append",
        metavar="CIDR",
        help="its addresses from now on, all of them (repeatable)",
    )
    changed.add_argument("--mtu", type=unsigned(16), metavar="N")
    state = changed.add_mutually_exclusive_group()
    state.add_argument("--up", dest="up", action="store_const", const=True, default=None)
    state.add_argument("--down", dest="up", action="store_const", const=False)
    add_command(group, "routes", cmd_network_routes, "the routes of the main table")
    routes = add_command(
        group, "set-routes", cmd_network_set_routes, "replace the routes (those of addresses stay)"
    )
    routes.add_argument(
        "--route",
        action="append",
        type=route,
        metavar="ROUTE",
        help='"DEST [via GW] [dev D] [src S]" (repeatable)',
    )
