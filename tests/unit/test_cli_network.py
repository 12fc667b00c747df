"""``aer network``'s route syntax (ip route's words) both ways."""

from __future__ import annotations

import argparse

import pytest

from auraed.api.aurae.network import v0 as network_pb
from auraed.client.cli.network import route, route_text


def test_a_route_is_read_and_written_as_ip_route_does() -> None:
    for text in (
        "default via 10.0.0.1",
        "10.96.0.0/12 dev eth0",
        "default via 10.0.0.1 dev eth0 src 10.0.0.5",
    ):
        assert route_text(route(text)) == text
    assert route("10.1.0.0/16 src 10.0.0.5 dev eth0") == network_pb.Route(
        destination="10.1.0.0/16", device="eth0", source="10.0.0.5"
    )
    for bad in ("", "default via", "default gw 10.0.0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            route(bad)
