"""aurae.network.v0.NetworkService: the machine's interfaces and routes, where auraed is its init.

Requests are validated here into typed values (auraed.system.interfaces); the changes are made
there, over netlink.
"""

from __future__ import annotations

import asyncio
import logging

from auraed.api.aurae.network import v0 as pb
from auraed.errors import AuraeError
from auraed.server.system_service import not_machine_init
from auraed.system.interfaces import (
    Interface,
    InterfaceChange,
    Route,
    check_change,
    list_interfaces,
    list_routes,
    parse_address,
    parse_route,
    update_interface,
    update_routes,
)
from auraed.wire.handlers import Context

SERVICE_NAME = "aurae.network.v0.NetworkService"
MAX_ADDRESSES = 256
MAX_ROUTES = 4096

log = logging.getLogger(__name__)


def _interface_message(interface: Interface) -> pb.Interface:
    return pb.Interface(
        name=interface.name,
        index=interface.index,
        mac=interface.mac,
        mtu=interface.mtu,
        up=interface.up,
        addresses=list(interface.addresses),
    )


def _route_message(route: Route) -> pb.Route:
    return pb.Route(
        destination=route.destination, gateway=route.gateway, device=route.device, source=route.source
    )


class NetworkServicer:
    """``machine_init``: auraed is this machine's init (else every method is refused);
    ``netns``: the network namespace to act in (None: auraed's own)."""

    def __init__(self, machine_init: bool, netns: str | None = None) -> None:
        self._machine_init = machine_init
        self._netns = netns

    def _check(self, what: str) -> None:
        if not self._machine_init:
            raise not_machine_init(what)

    async def list_interfaces(
        self, request: pb.NetworkServiceListInterfacesRequest, context: Context
    ) -> pb.NetworkServiceListInterfacesResponse:
        self._check("ListInterfaces")
        found = await asyncio.to_thread(list_interfaces, self._netns)
        return pb.NetworkServiceListInterfacesResponse(interfaces=[_interface_message(i) for i in found])

    async def update_interface(
        self, request: pb.NetworkServiceUpdateInterfaceRequest, context: Context
    ) -> pb.NetworkServiceUpdateInterfaceResponse:
        self._check("UpdateInterface")
        if len(request.addresses) > MAX_ADDRESSES:
            raise AuraeError.invalid("addresses", f"at most {MAX_ADDRESSES}")
        if request.addresses and not request.replace_addresses:
            raise AuraeError.invalid("addresses", "are given only with replace_addresses")
        addresses = tuple(parse_address(a, f"addresses[{i}]") for i, a in enumerate(request.addresses))
        change = check_change(
            InterfaceChange(
                request.name,
                addresses=addresses if request.replace_addresses else None,
                mtu=request.mtu,
                up=request.up,
            )
        )
        log.info("updating interface %s: %s", change.name, change)
        changed = await asyncio.to_thread(update_interface, change, self._netns)
        return pb.NetworkServiceUpdateInterfaceResponse(interface=_interface_message(changed))

    async def list_routes(
        self, request: pb.NetworkServiceListRoutesRequest, context: Context
    ) -> pb.NetworkServiceListRoutesResponse:
        self._check("ListRoutes")
        found = await asyncio.to_thread(list_routes, self._netns)
        return pb.NetworkServiceListRoutesResponse(routes=[_route_message(r) for r in found])

    async def update_routes(
        self, request: pb.NetworkServiceUpdateRoutesRequest, context: Context
    ) -> pb.NetworkServiceUpdateRoutesResponse:
        self._check("UpdateRoutes")
        if len(request.routes) > MAX_ROUTES:
            raise AuraeError.invalid("routes", f"at most {MAX_ROUTES}")
        routes = [
            parse_route(Route(r.destination, r.gateway, r.device, r.source), f"routes[{i}]")
            for i, r in enumerate(request.routes)
        ]
        log.info("replacing the routes with %d given", len(routes))
        now = await asyncio.to_thread(update_routes, routes, self._netns)
        return pb.NetworkServiceUpdateRoutesResponse(routes=[_route_message(r) for r in now])
