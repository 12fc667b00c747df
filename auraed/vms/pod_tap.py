"""A VM's NIC joined to a pod's network: a tap beside the CNI interface in the pod's network
namespace, each one's ingress redirected to the other's egress by traffic control (Kata's
``tcfilter`` model).

Whatever the CNI plugins made (a veth on a bridge, a macvlan, ...) stays as they made it, with its
address; the guest takes the interface's MAC and address, and every frame passes between the two
untouched, so to the network the guest is the pod. The namespace's own stack never sees a frame
of the interface (its ingress is all redirected), so the pod's address is the guest's alone.
Nothing here touches the host's namespace: both links are in the pod's, made and removed with it.

pyroute2 runs on a short-lived thread that entered the namespace (netlink sockets belong to the
namespace they were opened in); its synchronous IPRoute cannot run on a thread with an event
loop, which a new thread never has.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from auraed.system.namespaces import enter_network_namespace
from auraed.system.threads import in_new_thread
from auraed.vms.errors import VmError

ETH_P_ALL = 0x0003
INGRESS = 0xFFFF0000
FLOW_ID = 0x1  # a u32 filter must name a class; on ingress none is used
"""The ingress qdisc's handle (``ffff:``), the parent of its filters."""


@dataclasses.dataclass(frozen=True)
class PodNic:
    """What the guest's NIC takes from the pod's interface."""

    mac: str
    mtu: int


def _index(ipr: Any, name: str) -> int:
    found = ipr.link_lookup(ifname=name)
    if not found:
        raise VmError.precondition(f"no link {name} in the pod's network namespace")
    return int(found[0])


def _redirect(ipr: Any, source: int, target: int) -> None:
    """Every frame arriving on ``source`` leaves by ``target``."""
    ipr.tc("add", "ingress", source, INGRESS)
    # u32 matching nothing in particular: the matchall classifier is not in every kernel (not in
    # these machines'), u32 is in all that have traffic control.
    ipr.tc(
        "add-filter",
        "u32",
        source,
        parent=INGRESS,
        protocol=ETH_P_ALL,
        keys=["0x0/0x0+0"],
        target=FLOW_ID,
        action={"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": target},
    )


def join_tap(netns: str, ifname: str, tap: str) -> PodNic:
    """Make the persistent tap ``tap`` in the namespace pinned at ``netns`` and join it to
    ``ifname`` both ways; the interface's MAC and MTU for the guest. On failure nothing is left."""
    from pyroute2 import IPRoute

    def worker() -> PodNic:
        enter_network_namespace(netns)
        with IPRoute() as ipr:
            interface = _index(ipr, ifname)
            link = ipr.get_links(interface)[0]
            nic = PodNic(mac=str(link.get_attr("IFLA_ADDRESS")), mtu=int(link.get_attr("IFLA_MTU")))
            ipr.link("add", ifname=tap, kind="tuntap", mode="tap", uid=0, gid=0)
            try:
                tap_index = _index(ipr, tap)
                ipr.link("set", index=tap_index, mtu=nic.mtu)
                _redirect(ipr, interface, tap_index)
                _redirect(ipr, tap_index, interface)
                ipr.link("set", index=tap_index, state="up")
            except BaseException:
                _remove(ipr, tap, interface)
                raise
        return nic

    try:
        return in_new_thread(worker)
    except OSError as exc:
        raise VmError.precondition(f"cannot join a tap to {ifname} in {netns}: {exc}") from None


def _remove(ipr: Any, tap: str, interface: int | None) -> None:
    for index in ipr.link_lookup(ifname=tap):
        ipr.link("del", index=index)
    if interface is not None:
        try:
            ipr.tc("del", "ingress", interface, INGRESS)
        except Exception as exc:  # no ingress qdisc (never added): nothing to undo
            if getattr(exc, "code", None) not in (2, 22):  # ENOENT, EINVAL
                raise


def unjoin_tap(netns: str, ifname: str, tap: str) -> None:
    """Undo join_tap (the namespace going takes both anyway); a namespace gone is nothing to do."""
    from pyroute2 import IPRoute

    if not os.path.exists(netns):
        return

    def worker() -> None:
        enter_network_namespace(netns)
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=ifname)
            _remove(ipr, tap, int(found[0]) if found else None)

    in_new_thread(worker)
