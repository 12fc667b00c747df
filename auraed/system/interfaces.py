"""The machine's interfaces and routes, read and changed over netlink (pyroute2): what
NetworkService serves where auraed is the machine's init (the Kata agent's UpdateInterface and
UpdateRoutes).

Every call runs on a short-lived thread of its own: pyroute2's synchronous IPRoute cannot run on
a thread with an event loop, and a test (or a caller) may name a network namespace to work in,
which only that thread enters. pyroute2 is imported on the first call: a guest's auraed serves
long before anything changes its network, and the import costs seconds under TCG.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from auraed.errors import AuraeError, ErrorKind
from auraed.system.namespaces import enter_network_namespace
from auraed.system.threads import in_new_thread

T = TypeVar("T")

MAIN_TABLE = 254
RTPROT_KERNEL = 2  # a route the kernel made for an address
RT_SCOPE_LINK = 253
MIN_MTU, MAX_MTU = 68, 65535
Address = ipaddress.IPv4Interface | ipaddress.IPv6Interface


@dataclasses.dataclass(frozen=True)
class Interface:
    name: str
    index: int
    mac: str
    mtu: int
    up: bool
    addresses: tuple[str, ...]  # CIDR


@dataclasses.dataclass(frozen=True)
class Route:
    destination: str  # a CIDR or "default"
    gateway: str = ""
    device: str = ""
    source: str = ""


@dataclasses.dataclass(frozen=True)
class InterfaceChange:
    """What UpdateInterface changes; None: left as it is."""

    name: str
    addresses: tuple[Address, ...] | None = None
    mtu: int | None = None
    up: bool | None = None


class NetworkError(AuraeError):
    """A network change that cannot be made; ``kind`` says why."""


def parse_address(text: str, field: str) -> Address:
    try:
        address = ipaddress.ip_interface(text)
    except ValueError:
        raise NetworkError.invalid(field, f"{text!r} is not an address with a prefix (10.0.0.5/24)") from None
    if "/" not in text:
        raise NetworkError.invalid(field, f"{text!r} needs its prefix length (10.0.0.5/24)")
    return address


def parse_route(route: Route, field: str) -> Route:
    """``route`` checked: a CIDR or "default" destination, addresses where given, a gateway or a device."""
    if route.destination != "default":
        try:
            ipaddress.ip_network(route.destination, strict=True)
        except ValueError:
            raise NetworkError.invalid(
                f"{field}.destination", f"{route.destination!r} is not a network (10.96.0.0/12) or default"
            ) from None
    for value, name in ((route.gateway, "gateway"), (route.source, "source")):
        if value:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise NetworkError.invalid(f"{field}.{name}", f"{value!r} is not an address") from None
    if not route.gateway and not route.device:
        raise NetworkError.invalid(field, "give a gateway, a device or both")
    if route.device and not _plausible_name(route.device):
        raise NetworkError.invalid(f"{field}.device", f"{route.device!r} is not an interface name")
    return route


def check_change(change: InterfaceChange) -> InterfaceChange:
    if not _plausible_name(change.name):
        raise NetworkError.invalid("name", f"{change.name!r} is not an interface name")
    if change.mtu is not None and not MIN_MTU <= change.mtu <= MAX_MTU:
        raise NetworkError.invalid("mtu", f"must be {MIN_MTU} to {MAX_MTU}")
    return change


def _plausible_name(name: str) -> bool:
    return 0 < len(name) < 16 and "/" not in name and not any(c.isspace() for c in name)


# -- netlink ---------------------------------------------------------------------------------


def _in_namespace(netns: str | None, work: Callable[[Any], T]) -> T:
    """``work(ipr)`` on a new thread, in ``netns`` when given; netlink errors as NetworkErrors."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    def worker() -> T:
        if netns is not None:
            enter_network_namespace(netns)
        with IPRoute() as ipr:
            return work(ipr)

    try:
        return in_new_thread(worker)
    except NetlinkError as exc:
        raise NetworkError(ErrorKind.INVALID_ARGUMENT, f"the kernel refused: {exc.args[-1]}") from None


def _interface(ipr: Any, link: Any) -> Interface:
    index = int(link["index"])
    addresses = tuple(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}" for a in ipr.get_addr(index=index))
    flags = int(link["flags"])
    return Interface(
        name=str(link.get_attr("IFLA_IFNAME")),
        index=index,
        mac=str(link.get_attr("IFLA_ADDRESS") or ""),
        mtu=int(link.get_attr("IFLA_MTU") or 0),
        up=bool(flags & 1),  # IFF_UP
        addresses=addresses,
    )


def list_interfaces(netns: str | None = None) -> list[Interface]:
    return _in_namespace(
        netns, lambda ipr: sorted((_interface(ipr, link) for link in ipr.get_links()), key=lambda i: i.index)
    )


def update_interface(change: InterfaceChange, netns: str | None = None) -> Interface:
    """Apply ``change``: addresses replaced (those kept untouched), MTU, up or down."""

    def work(ipr: Any) -> Interface:
        found = ipr.link_lookup(ifname=change.name)
        if not found:
            raise NetworkError.not_found(f"interface {change.name}")
        index = int(found[0])
        if change.mtu is not None:
            ipr.link("set", index=index, mtu=change.mtu)
        if change.addresses is not None:
            wanted = {str(a) for a in change.addresses}
            current = {f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}": a for a in ipr.get_addr(index=index)}
            # The old ones go first: deleting a subnet's primary address also deletes the
            # secondaries of that subnet, a new one among them had it been added before.
            for text, old in current.items():
                if text not in wanted:
                    ipr.addr(
                        "del", index=index, address=old.get_attr("IFA_ADDRESS"), prefixlen=old["prefixlen"]
                    )
            for address in change.addresses:
                if str(address) not in current:
                    ipr.addr("add", index=index, address=str(address.ip), prefixlen=address.network.prefixlen)
        if change.up is not None:
            ipr.link("set", index=index, state="up" if change.up else "down")
        return _interface(ipr, ipr.get_links(index)[0])

    return _in_namespace(netns, work)


def _route(ipr: Any, message: Any, names: dict[int, str]) -> Route:
    destination = message.get_attr("RTA_DST")
    destination = f"{destination}/{message['dst_len']}" if destination else "default"
    return Route(
        destination=destination,
        gateway=str(message.get_attr("RTA_GATEWAY") or ""),
        device=names.get(int(message.get_attr("RTA_OIF") or 0), ""),
        source=str(message.get_attr("RTA_PREFSRC") or ""),
    )


def _main_routes(ipr: Any) -> list[Any]:
    return [
        r
        for family in (socket.AF_INET, socket.AF_INET6)
        for r in ipr.get_routes(family=family, table=MAIN_TABLE)
        if r.get_attr("RTA_TABLE") in (None, MAIN_TABLE) and r["type"] == 1  # unicast
    ]


def _names(ipr: Any) -> dict[int, str]:
    return {int(link["index"]): str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()}


def list_routes(netns: str | None = None) -> list[Route]:
    return _in_namespace(netns, lambda ipr: [_route(ipr, r, _names(ipr)) for r in _main_routes(ipr)])


def update_routes(routes: list[Route], netns: str | None = None) -> list[Route]:
    """The main table's routes replaced by ``routes`` (those the kernel made for addresses stay)."""

    def work(ipr: Any) -> list[Route]:
        names = _names(ipr)
        indexes = {name: index for index, name in names.items()}
        for route in routes:
            if route.device and route.device not in indexes:
                raise NetworkError.not_found(f"interface {route.device}")
        for old in _main_routes(ipr):
            if old["proto"] != RTPROT_KERNEL:
                ipr.route("del", **_route_fields(_route(ipr, old, names), indexes))
        # Those of addresses stayed: a list read from ListRoutes, given back, names them too.
        kept = {_route(ipr, r, names) for r in _main_routes(ipr)}
        for route in routes:
            if route not in kept:
                ipr.route("add", **_route_fields(route, indexes))
        return [_route(ipr, r, _names(ipr)) for r in _main_routes(ipr)]

    return _in_namespace(netns, work)


def _route_fields(route: Route, indexes: dict[str, int]) -> dict[str, Any]:
    six = ":" in route.destination or ":" in route.gateway
    fields: dict[str, Any] = {
        "dst": ("::/0" if six else "0.0.0.0/0") if route.destination == "default" else route.destination,
        "family": socket.AF_INET6 if six else socket.AF_INET,
        "table": MAIN_TABLE,
    }
    if route.gateway:
        fields["gateway"] = route.gateway
    else:
        fields["scope"] = RT_SCOPE_LINK
    if route.device:
        fields["oif"] = indexes[route.device]
    if route.source:
        fields["prefsrc"] = route.source
    return fields
