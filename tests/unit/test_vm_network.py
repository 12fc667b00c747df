"""The address pool: /30 blocks, never overlapping the host's addresses and routes, never reused."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest

from auraed.errors import ErrorKind
from auraed.vms import network
from auraed.vms.errors import VmError
from auraed.vms.network import HostNet, block, block_count, choose_block, conflicts, parse_pool

POOL = ipaddress.IPv4Network("10.213.0.0/16")


def net(text: str, what: str = "") -> HostNet:
    return HostNet(ipaddress.IPv4Network(text), what or text)


def test_blocks() -> None:
    assert block_count(POOL) == 16384
    first = block(POOL, 0)
    assert (str(first.network), str(first.host_ip), str(first.guest_ip)) == (
        "10.213.0.0/30",
        "10.213.0.1",
        "10.213.0.2",
    )
    fifth = block(POOL, 5)
    assert str(fifth.network) == "10.213.0.20/30"
    assert (str(fifth.host_ip), str(fifth.guest_ip)) == ("10.213.0.21", "10.213.0.22")
    last = block(POOL, 16383)
    assert str(last.network) == "10.213.255.252/30"
    info = last.net_info("atap7")
    assert (info.tap, info.prefixlen, info.netmask, info.mac) == (
        "atap7",
        30,
        "255.255.255.252",
        "02:ae:0a:d5:ff:fe",
    )
    with pytest.raises(ValueError):
        block(POOL, 16384)


def test_parse_pool() -> None:
    assert parse_pool("10.213.0.0/16") == POOL
    assert block_count(parse_pool("10.0.0.0/30")) == 1
    for bad in ("10.213.0.1/16", "fd00::/64", "10.0.0.0/31", "nonsense", ""):
        with pytest.raises(VmError) as caught:
            parse_pool(bad)
        assert caught.value.kind is ErrorKind.INVALID_ARGUMENT


def test_a_pool_must_be_private_address_space() -> None:
    # RFC 1918, and RFC 6598's shared space, which VM and overlay networks often use.
    for private in ("10.0.0.0/8", "172.16.0.0/12", "172.31.255.0/24", "192.168.7.0/24", "100.64.0.0/10"):
        assert parse_pool(private) == ipaddress.IPv4Network(private)
    # Public space (someone else's), and ranges that are not private for VMs even where ipaddress
    # calls them private: documentation, loopback, link-local, reserved; and pools straddling the
    # edge of a private range.
    for public in (
        "8.8.8.0/24",
        "198.51.100.0/24",
        "127.0.0.0/16",
        "169.254.0.0/16",
        "100.0.0.0/8",
        "240.0.0.0/24",
        "172.0.0.0/8",
        "10.0.0.0/7",
        "192.168.0.0/15",
        "0.0.0.0/0",
    ):
        with pytest.raises(VmError) as caught:
            parse_pool(public)
        assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
        assert "private" in caught.value.message and public in caught.value.message


def test_blocks_are_held_by_network_across_a_pool_change() -> None:
    # A VM got 10.213.0.20/30, block 5 of the pool 10.213.0.0/16. The pool is then changed to
    # 10.213.0.16/28, where that /30 is block 1 and block 5 does not exist.
    old = block(POOL, 5).network
    pool = ipaddress.IPv4Network("10.213.0.16/28")
    assert block(pool, 1).network == old
    held = {old, block(POOL, 4).network}  # 10.213.0.16/30: block 0 of the new pool too
    assert choose_block(pool, held=held, host=[]).network == ipaddress.IPv4Network("10.213.0.24/30")
    # Blocks outside the pool hold nothing in it; a pool whose every block is held is exhausted.
    assert choose_block(pool, held={ipaddress.IPv4Network("10.9.0.0/30")}, host=[]).index == 0
    with pytest.raises(VmError) as caught:
        choose_block(ipaddress.IPv4Network("10.213.0.20/30"), held=held, host=[])
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "1 held" in caught.value.message


def test_choose_skips_held_and_overlapping_blocks() -> None:
    host = [
        net("192.0.2.0/24", "route 192.0.2.0/24 dev eth0"),
        net("10.213.0.4/32", "address 10.213.0.4/32 on lo"),
    ]
    chosen = choose_block(POOL, held={block(POOL, 0).network}, host=host)
    assert chosen.index == 2  # 0 held, 1 (10.213.0.4/30) overlaps the host's address
    assert choose_block(POOL, held=set(), host=[]).index == 0
    # A host route covering part of the pool: the blocks inside it are skipped.
    assert choose_block(POOL, held=set(), host=[net("10.213.0.0/24")]).index == 64


def test_tap_names() -> None:
    assert network.tap_name(set()) == "atap0"
    assert network.tap_name({"eth0", "atap0", "atap1", "atap3"}) == "atap2"
    assert len(network.tap_name({f"atap{i}" for i in range(100000)})) <= network.IFNAMSIZ


def test_exhausted_pool() -> None:
    pool = ipaddress.IPv4Network("10.213.7.0/29")
    with pytest.raises(VmError) as caught:
        choose_block(pool, held={block(pool, 0).network, block(pool, 1).network}, host=[])
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "10.213.7.0/29" in caught.value.message and "2 held" in caught.value.message
    with pytest.raises(VmError) as caught:
        choose_block(
            pool, held={block(pool, 0).network}, host=[net("10.213.7.4/30", "route 10.213.7.4/30 dev atap9")]
        )
    assert caught.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "atap9" in caught.value.message


def test_pool_overlapping_the_host_is_refused() -> None:
    with pytest.raises(VmError) as caught:
        choose_block(
            ipaddress.IPv4Network("192.0.2.0/24"), held=set(), host=[net("192.0.2.0/24", "route via eth0")]
        )
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "route via eth0" in caught.value.message


def test_conflicts() -> None:
    host = [net("10.0.0.0/8"), net("192.0.2.1/32")]
    assert conflicts(ipaddress.IPv4Network("10.1.2.0/30"), host) == [host[0]]
    assert conflicts(ipaddress.IPv4Network("192.0.2.0/30"), host) == [host[1]]
    assert conflicts(ipaddress.IPv4Network("172.16.0.0/30"), host) == []


def test_host_networks_sees_every_address_and_route_but_not_the_default() -> None:
    found = network.host_networks()
    routes = subprocess.run(
        ["ip", "-4", "-o", "route", "show", "table", "all"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    addresses = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    networks = {h.network for h in found}
    assert ipaddress.IPv4Network("0.0.0.0/0") not in networks
    for line in addresses:
        cidr = line.split()[3]
        assert ipaddress.IPv4Network(cidr, strict=False) in networks, line
    for line in routes:
        words = line.split()
        destination = words[1] if words[0] in ("local", "broadcast", "unicast", "multicast") else words[0]
        if destination == "default":
            if "via" in words:
                gateway = words[words.index("via") + 1]
                assert ipaddress.IPv4Network(f"{gateway}/32") in networks, line
            continue
        assert ipaddress.IPv4Network(destination, strict=False) in networks, line


def _host_state() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    return links, addresses


def test_only_our_taps_are_ever_touched() -> None:
    before = _host_state()
    for name in ("eth0", "lo", "atap", "atap1x", "tap0", "atap12345678901"):
        with pytest.raises(VmError) as caught:
            network.delete_tap(name)
        assert caught.value.kind is ErrorKind.INTERNAL
        with pytest.raises(VmError):
            network.tap_exists(name)
    assert _host_state() == before
