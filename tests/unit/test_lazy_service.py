"""LazyService: a service's handlers made at its first call (the daemon's reflection)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from auraed.server.rpc import LazyService


@dataclass
class _Call:
    method: str


def test_a_lazy_service_makes_its_handlers_at_its_first_call_and_only_once() -> None:
    made: list[int] = []
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    def make() -> list[grpc.GenericRpcHandler]:
        made.append(1)
        return [grpc.method_handlers_generic_handler("pkg.Service", {"Echo": echo})]

    lazy = LazyService("pkg.Service", make)
    assert lazy.service(_Call("/pkg.Other/Echo")) is None
    assert lazy.service(_Call("/pkg.ServiceToo/Echo")) is None  # a prefix of another name is not it
    assert made == []
    assert lazy.service(_Call("/pkg.Service/Echo")) is echo
    assert lazy.service(_Call("/pkg.Service/Missing")) is None
    assert lazy.service(_Call("/pkg.Service/Echo")) is echo
    assert made == [1]
