"""Pod networking through Debian's CNI plugins (bridge, host-local, portmap, loopback) into pinned
pod namespaces, on a private /24 checked against the host's addresses and routes
(tests.support.cni). Traffic goes only over the test's own bridge and loopback.

hostPort is reached from the host at 127.0.0.1 (portmap sets route_localnet on the bridge and
masquerades loopback sources), at the bridge's own address and at any other host address:
portmap's DNAT is in OUTPUT for every local destination.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from auraed.cni.cni import ADDED, KIND, Cni
from auraed.cni.errors import CniError
from auraed.cni.invoke import PluginRunner
from auraed.cni.model import DEFAULT_BIN_DIRS, PodNetwork, PortMapping
from auraed.errors import ErrorKind
from auraed.state.store import Store
from auraed.system.pod_namespaces import PodNamespaces
from tests.support.cni import (
    CniNetwork,
    cni_network,
    free_port,
    in_netns,
    listener_in,
    pod_namespaces,
    probe,
)

POD_PORT = 8080


@pytest.fixture
def network(tmp_path: Path) -> Iterator[CniNetwork]:
    with cni_network(tmp_path) as made:
        yield made


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "state" / "auraed.db")
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[PodNamespaces]:
    with pod_namespaces(tmp_path / "aurae-pod-a") as pinned:
        yield pinned


@pytest.fixture
async def cni(network: CniNetwork, store: Store) -> AsyncIterator[Cni]:
    made = Cni(store, network.settings())
    try:
        yield made
    finally:
        for attachment in made.attachments():  # a test that failed half-way
            await made.detach(attachment.sandbox_id, attachment.ifname)


def eth0_addresses(netns: str) -> list[str]:
    out = in_netns(netns, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
    return [line.split()[3] for line in out.stdout.splitlines()]


def other_host_address(network: CniNetwork) -> str | None:
    """An IPv4 address of the host that is neither loopback nor the test bridge's."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        device, address = line.split()[1], line.split()[3].split("/")[0]
        if device not in ("lo", network.bridge) and not address.startswith("127."):
            return address
    return None


async def test_status_is_ready_with_the_debian_plugins(network: CniNetwork, cni: Cni) -> None:
    network.write(network.conflist())
    status = cni.status()
    assert (status.ready, status.reason, status.message, status.network) == (True, "", "", network.name)


async def test_a_pod_gets_an_address_reachable_from_the_host_and_its_host_port(
    network: CniNetwork, cni: Cni, pod: PodNamespaces, store: Store
) -> None:
    network.write(network.conflist())
    host_port = free_port()
    assert pod.net
    request = PodNetwork(
        "sandbox-a",
        pod.net,
        pod_name="web",
        pod_namespace="default",
        pod_uid="uid-a",
        port_mappings=(PortMapping(host_port, POD_PORT),),
    )
    attachment = await cni.attach(request)
    assert attachment.state == ADDED and attachment.network.name == network.name
    [pod_ip] = attachment.pod_ips
    assert ipaddress.ip_address(pod_ip) in network.subnet
    assert eth0_addresses(pod.net) == [f"{pod_ip}/24"]
    assert network.allocations() == {pod_ip: "sandbox-a"}
    assert network.rules(), "bridge's masquerade and portmap's DNAT carry the network's name"
    assert store.get(KIND, "sandbox-a/eth0") == attachment.to_doc()

    with listener_in(pod.net, POD_PORT):
        assert probe(pod_ip, POD_PORT) == f"hello from {network.gateway}"
        assert probe("127.0.0.1", host_port) == f"hello from {network.gateway}"  # masqueraded
        assert probe(network.gateway, host_port) == f"hello from {network.gateway}"
        address = other_host_address(network)
        if address is not None:  # not masqueraded: the pod sees the host's own address
            assert probe(address, host_port) == f"hello from {address}"

    assert await cni.detach("sandbox-a") is True
    assert network.allocations() == {}
    assert network.rules() == []
    assert eth0_addresses(pod.net) == []
    assert cni.attachment("sandbox-a") is None
    assert await cni.detach("sandbox-a") is False  # nothing left to detach: still a success
    # The plugins' own DEL is idempotent too: all of them again, with the same result.
    runner = PluginRunner(DEFAULT_BIN_DIRS, 30)
    assert attachment.result is not None
    await runner.delete(attachment.network, attachment.runtime, attachment.result.raw)
    assert network.allocations() == {} and network.rules() == []


async def test_del_after_a_crash_uses_the_recorded_config_and_result(
    network: CniNetwork, store: Store, pod: PodNamespaces, tmp_path: Path
) -> None:
    conf = network.write(network.conflist())
    assert pod.net
    first = Cni(store, network.settings())
    attachment = await first.attach(
        PodNetwork("sandbox-b", pod.net, port_mappings=(PortMapping(free_port(), 80),))
    )
    store.close()  # auraed dies here; what it knew is only in the store
    conf.unlink()  # and the operator removed the network meanwhile

    reopened = Store(tmp_path / "state" / "auraed.db")
    try:
        second = Cni(reopened, network.settings())
        assert not second.status().ready
        [found] = second.attachments()
        assert (found.sandbox_id, found.pod_ips, found.network.name) == (
            "sandbox-b",
            attachment.pod_ips,
            network.name,
        )
        assert await second.detach("sandbox-b") is True
        assert network.allocations() == {} and network.rules() == []
        assert second.attachments() == []
    finally:
        reopened.close()


async def test_del_after_the_network_namespace_is_gone(network: CniNetwork, cni: Cni, tmp_path: Path) -> None:
    # Without ipMasq: Debian's bridge 1.1.1 finds the addresses whose masquerade rules it removes
    # on the pod's interface, so with the namespace gone those rules would stay. The CRI runs
    # DEL before it removes the namespace; this is the DEL of a pod whose namespace vanished.
    network.write(network.conflist(ip_masq=False))
    with pod_namespaces(tmp_path / "aurae-pod-gone") as pinned:
        assert pinned.net
        await cni.attach(PodNetwork("sandbox-c", pinned.net))
    assert await cni.detach("sandbox-c") is True
    assert network.allocations() == {} and network.rules() == []


@pytest.mark.parametrize("version", ["0.4.0", "1.0.0"])
async def test_check_passes_and_sees_a_broken_interface(
    network: CniNetwork, cni: Cni, pod: PodNamespaces, version: str
) -> None:
    # Without portmap: Debian's portmap 1.1.1 fails every CHECK where ip6tables has a nat table,
    # looking for IPv6 rules it never made (containernetworking/plugins#819, fixed in 1.2.0).
    network.write(network.conflist(version=version, portmap=False))
    assert pod.net
    attachment = await cni.attach(PodNetwork("sandbox-d", pod.net))
    await cni.check("sandbox-d")
    in_netns(pod.net, "ip", "addr", "flush", "dev", "eth0")
    with pytest.raises(CniError) as caught:
        await cni.check("sandbox-d")
    assert caught.value.message.startswith(f"CNI network {network.name}: plugin bridge CHECK failed: ")
    assert attachment.pod_ips[0] in caught.value.message
    assert await cni.detach("sandbox-d") is True
    assert network.allocations() == {}


async def test_check_needs_version_0_4_0(network: CniNetwork, cni: Cni, pod: PodNamespaces) -> None:
    network.write(network.conflist(version="0.3.1", portmap=False))
    assert pod.net
    attachment = await cni.attach(PodNetwork("sandbox-e", pod.net))
    assert attachment.pod_ips and attachment.result is not None
    with pytest.raises(CniError) as caught:
        await cni.check("sandbox-e")
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "configuration version 0.3.1 does not support the CHECK command" in caught.value.message
    with pytest.raises(CniError) as missing:
        await cni.check("no-such-sandbox")
    assert missing.value.kind is ErrorKind.NOT_FOUND
    assert await cni.detach("sandbox-e") is True
    assert network.allocations() == {}


async def test_a_0_4_0_list_chains_and_deletes_with_its_result(
    network: CniNetwork, cni: Cni, pod: PodNamespaces
) -> None:
    network.write(network.conflist(version="0.4.0"))
    assert pod.net
    attachment = await cni.attach(
        PodNetwork("sandbox-f", pod.net, port_mappings=(PortMapping(free_port(), 80),))
    )
    assert attachment.result is not None and attachment.result.cni_version == "0.4.0"
    assert attachment.result.raw["ips"][0]["version"] == "4"
    assert await cni.detach("sandbox-f") is True
    assert network.allocations() == {} and network.rules() == []


async def test_a_conf_file_is_a_network_of_one_plugin(
    network: CniNetwork, cni: Cni, pod: PodNamespaces
) -> None:
    single = {"cniVersion": "1.0.0", "name": network.name, **network.bridge_plugin()}
    network.write(single, "10-single.conf")
    network.write("{broken", "05-broken.conflist")
    assert cni.status().ready
    assert pod.net
    attachment = await cni.attach(PodNetwork("sandbox-g", pod.net))
    assert [p.type for p in attachment.network.plugins] == ["bridge"]
    assert eth0_addresses(pod.net) == [f"{attachment.pod_ips[0]}/24"]
    assert await cni.detach("sandbox-g") is True


async def test_a_failed_add_is_undone(
    network: CniNetwork, cni: Cni, pod: PodNamespaces, store: Store
) -> None:
    # tuning runs after bridge and host-local succeeded, and fails: their allocation is undone.
    bad = {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.no_such_setting": "1"}}
    network.write(network.conflist(extra=(bad,)))
    assert pod.net
    with pytest.raises(CniError) as caught:
        await cni.attach(PodNetwork("sandbox-h", pod.net, port_mappings=(PortMapping(free_port(), 80),)))
    assert caught.value.message.startswith(f"CNI network {network.name}: plugin tuning ADD failed: ")
    assert "no_such_setting" in caught.value.message
    assert network.allocations() == {} and network.rules() == []
    assert eth0_addresses(pod.net) == []
    assert store.list(KIND) == []


async def test_a_cancelled_add_is_undone(network: CniNetwork, cni: Cni, pod: PodNamespaces) -> None:
    network.write(network.conflist())
    assert pod.net
    attach = asyncio.ensure_future(cni.attach(PodNetwork("sandbox-i", pod.net)))
    await asyncio.sleep(0)  # the attach runs up to its first wait: on the ADD it just started
    assert cni.attachment("sandbox-i") is not None
    attach.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attach
    assert network.allocations() == {} and cni.attachments() == []


async def test_attaching_twice_is_refused(network: CniNetwork, cni: Cni, pod: PodNamespaces) -> None:
    network.write(network.conflist(portmap=False))
    assert pod.net
    await cni.attach(PodNetwork("sandbox-j", pod.net))
    with pytest.raises(CniError) as caught:
        await cni.attach(PodNetwork("sandbox-j", pod.net))
    assert caught.value.kind is ErrorKind.ALREADY_EXISTS
    assert len(network.allocations()) == 1


async def test_a_missing_plugin(network: CniNetwork, cni: Cni, pod: PodNamespaces, store: Store) -> None:
    doc = network.conflist()
    doc["plugins"].insert(1, {"type": "no-such-plugin"})
    source = network.write(doc)
    status = cni.status()
    assert (status.ready, status.reason) == (False, "NetworkPluginNotReady")
    dirs = ":".join(map(str, DEFAULT_BIN_DIRS))
    assert (
        status.message == f"CNI network {network.name} ({source}): plugin no-such-plugin not found in {dirs}"
    )
    assert pod.net
    with pytest.raises(CniError) as caught:
        await cni.attach(PodNetwork("sandbox-k", pod.net))
    assert caught.value.kind is ErrorKind.FAILED_PRECONDITION
    assert f"plugin 'no-such-plugin' not found in {dirs}" in caught.value.message
    assert network.allocations() == {} and store.list(KIND) == []


async def test_not_ready_without_a_valid_config(network: CniNetwork, cni: Cni, pod: PodNamespaces) -> None:
    status = cni.status()
    assert (status.ready, status.reason) == (False, "NetworkPluginNotReady")
    assert status.message == f"no CNI network config found in {network.conf_dir}"
    bad = network.write({**network.conflist(), "cniVersion": "0.2.0"})
    status = cni.status()
    assert not status.ready
    assert status.message == (
        f"no valid CNI network config in {network.conf_dir}: {bad}: cniVersion '0.2.0' is not supported "
        "(auraed speaks 0.3.0, 0.3.1, 0.4.0, 1.0.0)"
    )
    assert pod.net
    with pytest.raises(CniError) as caught:
        await cni.attach(PodNetwork("sandbox-l", pod.net))
    assert (caught.value.kind, caught.value.message) == (ErrorKind.FAILED_PRECONDITION, status.message)


async def test_a_plugin_that_hangs_is_killed_at_the_timeout(
    network: CniNetwork, store: Store, pod: PodNamespaces, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "hung-plugin-pid"
    hang = bin_dir / "hang"
    hang.write_text(f"#!/bin/sh\necho $$ > {marker}\nexec sleep 300\n")
    hang.chmod(0o755)
    network.write({"cniVersion": "1.0.0", "name": network.name, "plugins": [{"type": "hang"}]})
    cni = Cni(store, network.settings(bin_dirs=(bin_dir,), plugin_timeout=0.5))
    assert pod.net
    with pytest.raises(CniError) as caught:
        await cni.attach(PodNetwork("sandbox-m", pod.net))
    assert caught.value.kind is ErrorKind.DEADLINE_EXCEEDED
    assert caught.value.message == f"CNI plugin {hang} did not finish in 0.5s"
    assert not os.path.exists(f"/proc/{marker.read_text().strip()}")  # killed and reaped
    # The undo's DEL hung the same way: the record stays for a later DEL to retry.
    [left] = cni.attachments()
    assert left.result is None and left.state == "adding"
    assert json.loads(json.dumps(left.to_doc()))["netns"] == pod.net
    store.delete(KIND, left.key)
