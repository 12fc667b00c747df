"""The machine's interfaces and routes over netlink, in a network namespace of the test's own
(a veth pair, both ends there; nothing reaches the host's)."""

from __future__ import annotations

import subprocess

import pytest

from auraed.errors import ErrorKind
from auraed.system.interfaces import (
    InterfaceChange,
    NetworkError,
    Route,
    check_change,
    list_interfaces,
    list_routes,
    parse_address,
    parse_route,
    update_interface,
    update_routes,
)

# Documentation and unique-local ranges, only ever inside the test's namespace.
FIRST, SECOND = "198.51.100.5/24", "198.51.100.6/24"
ULA = "fd00:a::5/64"


@pytest.fixture
def dummy(netns: str) -> str:
    # No dummy driver in these kernels: a veth pair with both ends in the namespace, the peer up
    # so that d0 has a carrier once it is up.
    subprocess.run(["ip", "-n", netns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True)
    subprocess.run(["ip", "-n", netns, "link", "set", "d1", "up"], check=True)
    return f"/run/netns/{netns}"


def test_an_interfaces_addresses_mtu_and_state_change(dummy: str) -> None:
    before = {i.name: i for i in list_interfaces(dummy)}
    assert set(before) == {"lo", "d0", "d1"} and not before["d0"].up and before["d0"].addresses == ()
    change = InterfaceChange(
        "d0", addresses=(parse_address(FIRST, "a"), parse_address(ULA, "a")), mtu=1400, up=True
    )
    changed = update_interface(check_change(change), dummy)
    assert (changed.mtu, changed.up) == (1400, True)
    assert FIRST in changed.addresses and ULA in changed.addresses
    # Replacing: the new one added, the old ones gone; what is not named stays as it is.
    replaced = update_interface(InterfaceChange("d0", addresses=(parse_address(SECOND, "a"),)), dummy)
    assert replaced.addresses == (SECOND,) and (replaced.mtu, replaced.up) == (1400, True)
    with pytest.raises(NetworkError) as missing:
        update_interface(InterfaceChange("nope0", up=True), dummy)
    assert missing.value.kind is ErrorKind.NOT_FOUND


def test_routes_are_replaced_but_those_of_addresses_stay(dummy: str) -> None:
    update_interface(InterfaceChange("d0", addresses=(parse_address(FIRST, "a"),), up=True), dummy)
    wanted = [
        Route("default", gateway="198.51.100.1"),
        Route("203.0.113.0/24", device="d0"),
        Route("192.0.2.128/25", gateway="198.51.100.1", device="d0", source="198.51.100.5"),
    ]
    routes = update_routes([parse_route(r, "routes") for r in wanted], dummy)
    assert Route("198.51.100.0/24", device="d0", source="198.51.100.5") in routes  # the address's own
    assert Route("default", gateway="198.51.100.1", device="d0") in routes
    assert Route("203.0.113.0/24", device="d0") in routes
    assert Route("192.0.2.128/25", gateway="198.51.100.1", device="d0", source="198.51.100.5") in routes
    assert list_routes(dummy) == routes
    assert update_routes(routes, dummy) == routes  # what ListRoutes gives, given back: no change
    only = update_routes([Route("203.0.113.0/24", device="d0")], dummy)
    assert Route("default", gateway="198.51.100.1", device="d0") not in only
    assert Route("203.0.113.0/24", device="d0") in only
    with pytest.raises(NetworkError) as unreachable:  # the kernel's refusal, as INVALID_ARGUMENT
        update_routes([Route("default", gateway="10.255.0.1")], dummy)
    assert unreachable.value.kind is ErrorKind.INVALID_ARGUMENT


def test_bad_requests_are_refused_by_name() -> None:
    for bad, field in (("10.0.0.5", "needs its prefix"), ("10.0.0.300/24", "not an address")):
        with pytest.raises(NetworkError, match=field):
            parse_address(bad, "addresses")
    for route, named in (
        (Route("10.0.0.1/8"), "destination"),
        (Route("default"), "gateway, a device"),
        (Route("default", gateway="x"), "gateway"),
        (Route("default", device="a/b"), "device"),
    ):
        with pytest.raises(NetworkError, match=named):
            parse_route(route, "routes[0]")
    with pytest.raises(NetworkError, match="mtu"):
        check_change(InterfaceChange("eth0", mtu=10))
