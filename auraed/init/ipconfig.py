"""The kernel's ``ip=`` boot argument (Documentation/admin-guide/nfs/nfsroot.rst), read by PID 1.

``ip=<client-ip>:<server-ip>:<gw-ip>:<netmask>:<hostname>:<device>:<autoconf>:<dns0-ip>:<dns1-ip>``,
or one word: ``dhcp`` (also ``on``, ``any``, ``both``, ``bootp``) or ``off``/``none``. The kernel's
own autoconfiguration (CONFIG_IP_PNP) is off in Debian's kernels and would run before the
initramfs loads virtio_net anyway, so auraed applies the argument itself: the same syntax
initramfs-tools and dracut read. A static address needs a netmask (dotted or a prefix length,
default /24 as initramfs-tools has it); autoconf ``dhcp`` with a client-ip is refused, not guessed.
Stdlib only: PID 1 reads it before anything else is imported.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

DHCP_WORDS = ("dhcp", "on", "any", "both", "bootp", "dhcp4")
OFF_WORDS = ("off", "none")


class IpConfig(NamedTuple):
    """What ``ip=`` asks for: ``mode`` is "static", "dhcp" or "off"."""

    mode: str
    address: str = ""
    prefix: int = 0
    gateway: str = ""
    hostname: str = ""
    device: str = ""  # empty: the first link with carrier
    dns: tuple[str, ...] = ()


def _address(text: str, what: str) -> str:
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        raise ValueError(f"ip=: {what} {text!r} is not an IPv4 address") from None


def _prefix(text: str) -> int:
    if not text:
        return 24
    if text.isascii() and text.isdigit():
        prefix = int(text)
        if 0 < prefix <= 32:
            return prefix
        raise ValueError(f"ip=: prefix length {text} is not 1 to 32")
    try:
        return ipaddress.IPv4Network(f"0.0.0.0/{text}").prefixlen
    except ValueError:
        raise ValueError(f"ip=: netmask {text!r} is neither dotted nor a prefix length") from None


def parse(value: str) -> IpConfig:
    """``value`` is what follows ``ip=``; ValueError says what is wrong with it."""
    word = value.strip().lower()
    if word in DHCP_WORDS or word == "":
        return IpConfig("dhcp")
    if word in OFF_WORDS:
        return IpConfig("off")
    fields = (value.split(":") + [""] * 10)[:10]
    client, _server, gateway, netmask, hostname, device, autoconf, dns0, dns1, _ntp = fields
    dns = tuple(_address(d, "dns server") for d in (dns0, dns1) if d)
    if not client:
        if autoconf.lower() in OFF_WORDS:
            return IpConfig("off", hostname=hostname, device=device)
        return IpConfig("dhcp", hostname=hostname, device=device, dns=dns)
    if autoconf and autoconf.lower() not in OFF_WORDS:
        raise ValueError(f"ip=: autoconf {autoconf!r} with a static address {client}: give one or the other")
    return IpConfig(
        "static",
        address=_address(client, "address"),
        prefix=_prefix(netmask),
        gateway=_address(gateway, "gateway") if gateway else "",
        hostname=hostname,
        device=device,
        dns=dns,
    )


def from_cmdline(cmdline: str) -> IpConfig | None:
    """The last ``ip=`` of the kernel command line (before ``--``), None when it has none."""
    found = None
    for word in cmdline.split():
        if word == "--":
            break
        if word.startswith("ip="):
            found = word[3:]
    return None if found is None else parse(found)
