"""A plugin's ADD result, typed: interfaces, IPs, routes and DNS.

Results of spec 0.3.0 to 1.0.0 share one shape (0.3.x/0.4.0 add a ``version`` to each IP, which
1.0.0 dropped). The JSON object is kept as it came (``raw``): it is what the next plugin gets as
``prevResult`` and what DEL and CHECK get from the cache, byte for byte what the plugins wrote.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from typing import Any

from auraed.cni.config import SUPPORTED_VERSIONS

IpInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclasses.dataclass(frozen=True)
class CniInterface:
    name: str
    mac: str = ""
    sandbox: str = ""  # the netns path for an interface in the pod; empty on the host


@dataclasses.dataclass(frozen=True)
class CniIp:
    address: IpInterface  # with its prefix, e.g. 10.22.0.5/24
    gateway: IpAddress | None = None
    interface: int | None = None  # index into the result's interfaces


@dataclasses.dataclass(frozen=True)
class CniRoute:
    dst: IpNetwork
    gw: IpAddress | None = None


@dataclasses.dataclass(frozen=True)
class CniDns:
    nameservers: tuple[str, ...] = ()
    domain: str = ""
    search: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CniResult:
    cni_version: str
    interfaces: tuple[CniInterface, ...]
    ips: tuple[CniIp, ...]
    routes: tuple[CniRoute, ...]
    dns: CniDns
    raw: Mapping[str, Any] = dataclasses.field(compare=False)

    def pod_ips(self, ifname: str) -> list[str]:
        """The addresses of the pod's interface ``ifname``, IPv4 first (the CRI's primary pod IP
        is the first), as containerd selects them: those whose interface is ``ifname`` inside
        the sandbox, or that name no interface at all."""
        chosen = []
        for ip in self.ips:
            if ip.interface is not None:
                if not 0 <= ip.interface < len(self.interfaces):
                    continue
                iface = self.interfaces[ip.interface]
                if iface.name != ifname or not iface.sandbox:
                    continue
            chosen.append(ip.address)
        return [str(address.ip) for address in sorted(chosen, key=lambda a: a.version)]


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    value = doc.get(key, [])
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list")
    return value


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    return value


def _text(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def _strings(doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}.{key} must be a list of strings")
    return tuple(value)


def _address(text: Any, where: str) -> IpAddress | None:
    if text in (None, ""):
        return None
    try:
        return ipaddress.ip_address(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {text!r} is not an IP address") from None


def _interface(doc: Mapping[str, Any], index: int) -> CniInterface:
    where = f"interfaces[{index}]"
    name = _text(doc, "name", where)
    if not name:
        raise ValueError(f"{where}.name is missing")
    return CniInterface(name, _text(doc, "mac", where), _text(doc, "sandbox", where))


def _ip(doc: Mapping[str, Any], index: int) -> CniIp:
    where = f"ips[{index}]"
    try:
        address = ipaddress.ip_interface(_text(doc, "address", where))
    except ValueError:
        raise ValueError(f"{where}.address {doc.get('address')!r} is not an address/prefix") from None
    interface = doc.get("interface")
    if interface is not None and (not isinstance(interface, int) or isinstance(interface, bool)):
        raise ValueError(f"{where}.interface must be an index")
    return CniIp(address, _address(doc.get("gateway"), f"{where}.gateway"), interface)


def _route(doc: Mapping[str, Any], index: int) -> CniRoute:
    where = f"routes[{index}]"
    try:
        dst = ipaddress.ip_network(_text(doc, "dst", where), strict=False)
    except ValueError:
        raise ValueError(f"{where}.dst {doc.get('dst')!r} is not a network") from None
    return CniRoute(dst, _address(doc.get("gw"), f"{where}.gw"))


def parse_result(doc: Any, conf_version: str) -> CniResult:
    """A plugin's result object; ValueError naming what is wrong. A result without a
    ``cniVersion`` is of the configuration's version (libcni's fixupResultVersion)."""
    result = _obj(doc, "the result")
    version = result.get("cniVersion") or conf_version
    if version not in SUPPORTED_VERSIONS:
        spoken = ", ".join(SUPPORTED_VERSIONS)
        raise ValueError(f"result version {version!r} is not one auraed reads ({spoken})")
    dns = _obj(result.get("dns") or {}, "dns")
    return CniResult(
        cni_version=version,
        interfaces=tuple(_interface(_obj(d, "iface"), i) for i, d in enumerate(_list(result, "interfaces"))),
        ips=tuple(_ip(_obj(d, "ip"), i) for i, d in enumerate(_list(result, "ips"))),
        routes=tuple(_route(_obj(d, "route"), i) for i, d in enumerate(_list(result, "routes"))),
        dns=CniDns(
            _strings(dns, "nameservers", "dns"),
            _text(dns, "domain", "dns"),
            _strings(dns, "search", "dns"),
            _strings(dns, "options", "dns"),
        ),
        raw=result,
    )
