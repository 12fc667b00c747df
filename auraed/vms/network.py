"""One tap device per VM and an address pair from a private pool, never overlapping the host's network.

The pool (a daemon setting, e.g. 10.213.0.0/16) must be private address space (RFC 1918, or
RFC 6598's 100.64.0.0/10): VM addresses are never public ones someone else owns. It is cut into
/30 blocks: block N is
``pool + 4 * N``; the host side of the tap gets its ``.1``, the guest its ``.2``. Taps are named
``atap<N>`` with the lowest N no link on the host (nor VM of ours) has. A block is used only
when no VM of ours holds it (persisted in the VM records; compared by network, not by index: the
pool may have changed since a VM got its block) and it overlaps no IPv4 address and no route the
host has, in any routing table, checked right before the block is taken. Default routes
(0.0.0.0/0) overlap everything and so are not held against a block, but their gateways are.

Nothing here touches an interface that is not one of ours (``atap<N>``) or adds a route: the only
route that appears is the kernel's connected /30 of the tap's address. The guest at the other end
of a tap is not trusted, so every tap is hardened before it comes up (``TAP_SYSCTLS``): with the
kernel's defaults an IPv6 router advertisement from a guest would give the host a default route
and addresses through the guest, and its ICMP redirects would rewrite the host's routes.

pyroute2 is used with a plain ``IPRoute()``; its network-namespace helpers fork and are not used.
pyroute2 0.9's synchronous IPRoute drives an asyncio loop of its own, so it cannot be created in a
thread whose event loop is running ("This event loop is already running"): async code calls these
functions through ``asyncio.to_thread``, and a call made on a loop's thread anyway is moved to a
short-lived worker thread (blocking that loop meanwhile).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from auraed.errors import ErrorKind
from auraed.vms.errors import VmError
from auraed.vms.model import NetInfo

log = logging.getLogger(__name__)

BLOCK_PREFIX = 30
TAP_PREFIX = "atap"
TAP_NAME = re.compile(r"^atap[0-9]{1,10}$")
IFNAMSIZ = 15

SYSCTL_NET = Path("/proc/sys/net")
# (family, setting, value) written for every tap before it is up; see the module's docstring.
# IPv6 is off on a tap altogether (guests are IPv4-only), accept_ra=0 holds should it be enabled.
# The IPv4 settings are per interface; for redirects the kernel also honours the host-wide
# ("all") value, which is the host's own to choose and left alone.
TAP_SYSCTLS = (
    ("ipv6", "accept_ra", "0"),
    ("ipv6", "accept_redirects", "0"),
    ("ipv6", "disable_ipv6", "1"),
    ("ipv4", "rp_filter", "1"),  # strict: drop what the guest sends from addresses not its own
    ("ipv4", "accept_redirects", "0"),
    ("ipv4", "send_redirects", "0"),
    ("ipv4", "accept_source_route", "0"),
)

# RFC 1918's private ranges and RFC 6598's shared address space (100.64.0.0/10, which VM and
# overlay networks often use): the only ones a VM pool may come from. (ipaddress's is_private also
# admits loopback, link-local, documentation and reserved ranges, none of them fit for VMs.)
PRIVATE_RANGES = tuple(
    ipaddress.IPv4Network(text) for text in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)

P = ParamSpec("P")
R = TypeVar("R")


def _off_loop(func: Callable[P, R]) -> Callable[P, R]:
    """Run ``func`` in a worker thread when the calling thread runs an event loop (see above)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        if not on_loop:
            return func(*args, **kwargs)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="netlink") as pool:
            return pool.submit(func, *args, **kwargs).result()

    return wrapper


@dataclasses.dataclass(frozen=True)
class HostNet:
    """A network the host already uses: an address's subnet or a route's destination."""

    network: ipaddress.IPv4Network
    what: str


@dataclasses.dataclass(frozen=True)
class Block:
    index: int
    network: ipaddress.IPv4Network

    @property
    def host_ip(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 1

    @property
    def guest_ip(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 2

    def net_info(self, tap: str) -> NetInfo:
        return NetInfo(
            index=self.index,
            tap=tap,
            host_ip=str(self.host_ip),
            guest_ip=str(self.guest_ip),
            prefixlen=BLOCK_PREFIX,
            mac=mac_for(self.guest_ip),
        )


def parse_pool(text: str) -> ipaddress.IPv4Network:
    try:
        pool = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise VmError(ErrorKind.INVALID_ARGUMENT, f"vm_address_pool: {text!r}: {exc}") from None
    if not isinstance(pool, ipaddress.IPv4Network):
        raise VmError(ErrorKind.INVALID_ARGUMENT, f"vm_address_pool: {text!r} is not an IPv4 network")
    if pool.prefixlen > BLOCK_PREFIX:
        raise VmError(ErrorKind.INVALID_ARGUMENT, f"vm_address_pool: {text!r} is smaller than one /30")
    if not any(pool.subnet_of(private) for private in PRIVATE_RANGES):
        ranges = ", ".join(map(str, PRIVATE_RANGES))
        raise VmError(
            ErrorKind.INVALID_ARGUMENT,
            f"vm_address_pool: {text!r} is not private address space: it must lie within one of {ranges}",
        )
    return pool


def block_count(pool: ipaddress.IPv4Network) -> int:
    return 1 << (BLOCK_PREFIX - pool.prefixlen)


def block(pool: ipaddress.IPv4Network, index: int) -> Block:
    if not 0 <= index < block_count(pool):
        raise ValueError(f"block {index} is outside {pool}")
    base = int(pool.network_address) + 4 * index
    return Block(index, ipaddress.IPv4Network((base, BLOCK_PREFIX)))


def block_of(net: NetInfo) -> ipaddress.IPv4Network:
    """The /30 a VM holds, from its addresses (its index means something only in its pool)."""
    return ipaddress.IPv4Network(f"{net.host_ip}/{net.prefixlen}", strict=False)


def mac_for(guest_ip: ipaddress.IPv4Address) -> str:
    """A locally administered unicast MAC derived from the guest's address (unique on the host)."""
    return "02:ae:" + ":".join(f"{b:02x}" for b in guest_ip.packed)


def _held(networks: Iterable[ipaddress.IPv4Network]) -> list[HostNet]:
    return [HostNet(network, f"held by a VM: {network}") for network in networks]


def conflicts(network: ipaddress.IPv4Network, host: Iterable[HostNet]) -> list[HostNet]:
    return [h for h in host if h.network.overlaps(network)]


def tap_name(taken: Collection[str]) -> str:
    """The first ``atap<N>`` that is neither a link on the host nor held by a VM."""
    index = 0
    while f"{TAP_PREFIX}{index}" in taken:
        index += 1
    return f"{TAP_PREFIX}{index}"


def choose_block(
    pool: ipaddress.IPv4Network, held: Collection[ipaddress.IPv4Network], host: list[HostNet]
) -> Block:
    """The first block no VM's network (``held``) and no host address or route touches.

    FAILED_PRECONDITION when the whole pool overlaps the host's network (a configuration
    mistake that freeing VMs will not fix), RESOURCE_EXHAUSTED when every block is taken.
    """
    pool_conflicts = conflicts(pool, host)
    held_here = [network for network in held if network.overlaps(pool)]
    # VMs hold /30s, aligned like every block of any pool: looked up in a set; anything else
    # (never made by this code) is compared by overlap.
    held_blocks = {network for network in held_here if network.prefixlen == BLOCK_PREFIX}
    held_other = _held(network for network in held_here if network.prefixlen != BLOCK_PREFIX)
    overlapping = 0
    first_conflict: HostNet | None = None
    for index in range(block_count(pool)):
        candidate = block(pool, index)
        if candidate.network in held_blocks or conflicts(candidate.network, held_other):
            continue
        hits = conflicts(candidate.network, pool_conflicts)
        if hits:
            overlapping += 1
            first_conflict = first_conflict or hits[0]
            continue
        return candidate
    total = block_count(pool)
    if overlapping == total:
        what = first_conflict.what if first_conflict else "?"
        raise VmError.precondition(
            f"address pool {pool} overlaps the host's network ({what}): no block of it can be used "
            "without breaking the host's routing; configure vm_address_pool to a range the host does "
            "not use"
        )
    detail = f"{len(held_here)} held by VMs"
    if overlapping:
        what = first_conflict.what if first_conflict else "?"
        detail += f", {overlapping} overlapping the host's addresses or routes (e.g. {what})"
    raise VmError.exhausted(f"address pool {pool} has no free /30 block ({total} in all: {detail})")


# -- the host's view, through pyroute2 --------------------------------------------------------


def _iproute() -> Any:
    from pyroute2 import IPRoute

    return IPRoute()


def _link_names(ipr: Any) -> dict[int, str]:
    return {link["index"]: str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()}


@_off_loop
def host_networks() -> list[HostNet]:
    """Every IPv4 address (with its subnet) and route (every table) on the host."""
    found: list[HostNet] = []
    with _iproute() as ipr:
        names = _link_names(ipr)
        for addr in ipr.get_addr(family=socket.AF_INET):
            prefixlen = int(addr["prefixlen"])
            dev = names.get(addr["index"], str(addr["index"]))
            for attr in ("IFA_LOCAL", "IFA_ADDRESS"):
                value = addr.get_attr(attr)
                if value:
                    network = ipaddress.IPv4Network(f"{value}/{prefixlen}", strict=False)
                    found.append(HostNet(network, f"address {value}/{prefixlen} on {dev}"))
        for route in ipr.get_routes(family=socket.AF_INET):
            table = route.get_attr("RTA_TABLE") or route["table"]
            dev = names.get(route.get_attr("RTA_OIF"), "?")
            gateway = route.get_attr("RTA_GATEWAY")
            if gateway:
                found.append(
                    HostNet(
                        ipaddress.IPv4Network(f"{gateway}/32"), f"gateway {gateway} dev {dev} table {table}"
                    )
                )
            dst_len = int(route["dst_len"])
            if dst_len == 0:
                continue  # a default route covers everything; its gateway was taken above
            dst = route.get_attr("RTA_DST")
            network = ipaddress.IPv4Network(f"{dst}/{dst_len}", strict=False)
            found.append(HostNet(network, f"route {network} dev {dev} table {table}"))
    return found


@_off_loop
def link_names() -> set[str]:
    with _iproute() as ipr:
        return set(_link_names(ipr).values())


def _check_ours(tap: str) -> None:
    # The one guard between this module and the host's own interfaces (eth0 above all).
    if not TAP_NAME.match(tap) or len(tap) > IFNAMSIZ:
        raise VmError.internal(f"refusing to touch interface {tap!r}: not a VM tap (atap<N>)")


@_off_loop
def pick(pool: ipaddress.IPv4Network, held: Collection[NetInfo], held_taps: Collection[str]) -> NetInfo:
    """A block and a tap name for a new VM, against the host as it is now and the VMs' ``held``."""
    block = choose_block(pool, [block_of(net) for net in held], host_networks())
    return block.net_info(free_tap_name(held_taps))


@_off_loop
def free_tap_name(held_taps: Collection[str]) -> str:
    """The first ``atap<N>`` that is neither a link on the host now nor in ``held_taps``."""
    return tap_name({*link_names(), *held_taps})


@_off_loop
def create_tap(net: NetInfo, owner: str) -> None:
    """Create the persistent tap (owned by root), give it the host address of its /30, bring it up.

    ``owner`` goes into the link's alias (ifalias): only a tap carrying it is ever removed for that
    owner, so a tap of the same name made by someone else (another daemon) is never touched. The
    block is checked against the host once more right before the address is added; on any failure
    the tap made here is removed again.
    """
    _check_ours(net.tap)
    network = ipaddress.IPv4Network(f"{net.host_ip}/{net.prefixlen}", strict=False)
    hits = conflicts(network, host_networks())
    if hits:
        raise VmError.precondition(
            f"{network} for {net.tap} now overlaps the host's network ({hits[0].what}); not adding it"
        )
    with _iproute() as ipr:
        if ipr.link_lookup(ifname=net.tap):
            raise TapNameTaken(net.tap)
        _add_persistent_tap(net.tap)
        try:
            index = _lookup(ipr, net.tap)
            ipr.link("set", index=index, ifalias=owner)
            harden_tap(net.tap)  # before it is up: nothing from the guest arrives earlier
            ipr.addr("add", index=index, address=net.host_ip, prefixlen=net.prefixlen)
            ipr.link("set", index=index, state="up")
        except BaseException:
            with contextlib.suppress(Exception):
                ipr.link("del", ifname=net.tap)
            raise
    log.info("created tap %s with %s/%d (guest %s)", net.tap, net.host_ip, net.prefixlen, net.guest_ip)


TUNSETIFF = 0x400454CA
TUNSETPERSIST, TUNSETOWNER, TUNSETGROUP = 0x400454CB, 0x400454CC, 0x400454CE
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR, IFF_TUN_EXCL = 0x0002, 0x1000, 0x4000, 0x8000


class TapNameTaken(VmError):
    """The picked tap name is a link on the host already: another process (another auraed)
    made it between ``pick`` and ``create_tap``. Nothing was made; pick another name."""

    def __init__(self, tap: str) -> None:
        super().__init__(ErrorKind.FAILED_PRECONDITION, f"a link named {tap} already exists on the host")
        self.tap = tap


def _add_persistent_tap(tap: str) -> None:
    """Create the persistent tap ``tap`` owned by root, atomically: TUNSETIFF with IFF_TUN_EXCL
    fails (EBUSY) when a tap of that name exists, where without it the call would attach to that
    tap -- someone else's, made since the name was checked -- and take it over."""
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", tap.encode(), IFF_TAP | IFF_TUN_EXCL))
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # a link of that name exists (IFF_TUN_EXCL)
                raise TapNameTaken(tap) from None
            raise
        fcntl.ioctl(fd, TUNSETOWNER, 0)
        fcntl.ioctl(fd, TUNSETGROUP, 0)
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def open_tap_in(netns: str, tap: str) -> int:
    """A descriptor of the persistent tap ``tap`` of the network namespace pinned at ``netns``,
    for a VMM to take (``-netdev tap,fd=N``): a tap is attached by name in the namespace of the
    thread asking, so it is opened from a short-lived thread that entered it. Close-on-exec."""
    import fcntl
    import struct

    from auraed.system.namespaces import enter_network_namespace
    from auraed.system.threads import in_new_thread

    def worker() -> int:
        enter_network_namespace(netns)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            request = struct.pack("16sH", tap.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
            fcntl.ioctl(fd, TUNSETIFF, request)
        except BaseException:
            os.close(fd)
            raise
        return fd

    try:
        return in_new_thread(worker)
    except OSError as exc:
        raise VmError.precondition(f"cannot open tap {tap} in {netns}: {exc.strerror or exc}") from None


def harden_tap(tap: str) -> None:
    """Write ``TAP_SYSCTLS`` for ``tap`` (in the calling thread's network namespace).

    IPv6 settings are skipped when the kernel has no IPv6 at all (no ipv6 directory): then there
    is nothing to accept. Any other failure is an error: a tap is not brought up half-hardened.
    """
    _check_ours(tap)
    for family, setting, value in TAP_SYSCTLS:
        if family == "ipv6" and not (SYSCTL_NET / family).is_dir():
            continue
        path = SYSCTL_NET / family / "conf" / tap / setting
        try:
            path.write_text(value)
        except OSError as exc:
            raise VmError.internal(f"cannot harden tap {tap}: {path}: {exc.strerror or exc}") from None


@_off_loop
def tap_owner(tap: str) -> str | None:
    """The alias (owner) of a tap; None when it does not exist."""
    _check_ours(tap)
    with _iproute() as ipr:
        found = ipr.link_lookup(ifname=tap)
        if not found:
            return None
        return str(ipr.get_links(found[0])[0].get_attr("IFLA_IFALIAS") or "")


def _lookup(ipr: Any, name: str) -> int:
    found = ipr.link_lookup(ifname=name)
    if not found:
        raise VmError.internal(f"tap {name} vanished right after it was created")
    return int(found[0])


@_off_loop
def tap_exists(tap: str) -> bool:
    _check_ours(tap)
    with _iproute() as ipr:
        return bool(ipr.link_lookup(ifname=tap))


@_off_loop
def tap_addresses(tap: str) -> list[str]:
    """The IPv4 addresses (with prefix) on a tap; empty when it does not exist."""
    _check_ours(tap)
    with _iproute() as ipr:
        found = ipr.link_lookup(ifname=tap)
        if not found:
            return []
        return [
            f"{a.get_attr('IFA_LOCAL') or a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"
            for a in ipr.get_addr(family=socket.AF_INET, index=found[0])
        ]


@_off_loop
def delete_tap(tap: str, owner: str | None = None) -> bool:
    """Remove a tap (and with it its address and connected route); False when it is gone or, with
    ``owner``, when it belongs to someone else (then it is left alone)."""
    _check_ours(tap)
    from pyroute2.netlink.exceptions import NetlinkError

    with _iproute() as ipr:
        found = ipr.link_lookup(ifname=tap)
        if not found:
            return False
        if owner is not None:
            alias = ipr.get_links(found[0])[0].get_attr("IFLA_IFALIAS") or ""
            if alias != owner:
                log.warning("not removing tap %s: it belongs to %r, not %r", tap, alias, owner)
                return False
        try:
            ipr.link("del", index=found[0])
        except NetlinkError as exc:
            if exc.code != errno.ENODEV:
                raise
            return False
    log.info("removed tap %s", tap)
    return True
