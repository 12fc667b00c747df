"""IPv4 interface and default-route configuration through the classic ioctls (stdlib only).

PID 1 of a guest configures exactly one address and one default route. pyroute2 costs 2-3 s of
import under TCG and spawning ``ip`` needs iproute2 in the image, so this uses the socket ioctls
that ifconfig/route use: SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFBRDADDR, SIOCSIFFLAGS, SIOCADDRT.
They act on the network namespace of the calling thread.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import socket
import struct
import time

SIOCADDRT = 0x890B
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
SIOCSIFBRDADDR = 0x891A
SIOCSIFNETMASK = 0x891C
SIOCSIFHWADDR = 0x8924
ARPHRD_ETHER = 1

IFF_UP = 0x1
RTF_UP = 0x1
RTF_GATEWAY = 0x2


class NetconfError(Exception):
    """A step of the configuration failed; the message names the step and the interface."""


def parse_cidr(text: str) -> tuple[str, int]:
    """``"10.0.0.2/30"`` -> (address, prefix); ValueError when it is not an IPv4 address/prefix."""
    address, _, prefix_text = text.partition("/")
    check_address(address)
    if prefix_text and not (prefix_text.isascii() and prefix_text.isdigit()):
        raise ValueError(f"not a prefix length: /{prefix_text}")
    prefix = int(prefix_text) if prefix_text else 32
    if not 0 <= prefix <= 32:
        raise ValueError(f"prefix out of range: /{prefix}")
    return address, prefix


def check_address(address: str) -> str:
    """``address`` if it is a dotted-quad IPv4 address (no inet_aton shorthands), else ValueError."""
    parts = address.split(".")
    if len(parts) != 4 or not all(
        p.isascii() and p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts
    ):
        raise ValueError(f"not a dotted IPv4 address: {address!r}")
    return address


def netmask(prefix: int) -> str:
    return socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF))


def broadcast(address: str, prefix: int) -> str:
    (value,) = struct.unpack("!I", socket.inet_aton(address))
    host_bits = (1 << (32 - prefix)) - 1
    return socket.inet_ntoa(struct.pack("!I", value | host_bits))


def _sockaddr_in(address: str) -> bytes:
    """struct sockaddr_in (16 bytes): family in host order, port 0, address, zero padding."""
    return struct.pack("=H2x4s8x", socket.AF_INET, socket.inet_aton(address))


def _ifreq(name: str, payload: bytes) -> bytes:
    """struct ifreq: IFNAMSIZ name, then a 24-byte union."""
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


class _Sockaddr(ctypes.Structure):
    _fields_ = [("data", ctypes.c_ubyte * 16)]


class _Rtentry(ctypes.Structure):
    """struct rtentry from <net/route.h>; ctypes lays it out (and pads it) like the C compiler."""

    _fields_ = [
        ("rt_pad1", ctypes.c_ulong),
        ("rt_dst", _Sockaddr),
        ("rt_gateway", _Sockaddr),
        ("rt_genmask", _Sockaddr),
        ("rt_flags", ctypes.c_ushort),
        ("rt_pad2", ctypes.c_short),
        ("rt_pad3", ctypes.c_ulong),
        ("rt_pad4", ctypes.c_void_p),
        ("rt_metric", ctypes.c_short),
        ("rt_dev", ctypes.c_char_p),
        ("rt_mtu", ctypes.c_ulong),
        ("rt_window", ctypes.c_ulong),
        ("rt_irtt", ctypes.c_ushort),
    ]


def _sockaddr(address: str) -> _Sockaddr:
    return _Sockaddr.from_buffer_copy(_sockaddr_in(address))


def wait_for_interface(name: str, timeout: float) -> bool:
    """True once ``name`` exists (drivers such as virtio_net may still be probing at boot)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.if_nametoindex(name)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def set_up(sock: socket.socket, name: str) -> None:
    flags = struct.unpack_from("16sH", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, _ifreq(name, b"")))[1]
    if not flags & IFF_UP:
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags | IFF_UP)))


def set_mac(name: str, mac: str) -> None:
    """Give ``name`` the Ethernet address ``mac`` ("52:54:00:12:34:56"); virtio_net passes it to
    the device, which then receives for it (a clone of a template takes its own this way)."""
    raw = bytes(int(part, 16) for part in mac.split(":"))
    if len(raw) != 6:
        raise ValueError(f"{mac!r} is not an Ethernet address")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), SIOCSIFHWADDR, _ifreq(name, struct.pack("=H6s", ARPHRD_ETHER, raw)))


def configure_interface(name: str, address: str, prefix: int) -> None:
    """Give ``name`` the address/prefix (replacing its primary IPv4 address) and bring it up.

    Address and mask are set before the link goes up, so the kernel never installs the classful
    prefix route SIOCSIFADDR alone implies.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fd = sock.fileno()
        for request, value, what in (
            (SIOCSIFADDR, address, "address"),
            (SIOCSIFNETMASK, netmask(prefix), "netmask"),
            (SIOCSIFBRDADDR, broadcast(address, prefix), "broadcast"),
        ):
            try:
                fcntl.ioctl(fd, request, _ifreq(name, _sockaddr_in(value)))
            except OSError as exc:
                raise NetconfError(f"{name}: cannot set {what} {value}: {exc.strerror}") from exc
        try:
            set_up(sock, name)
        except OSError as exc:
            raise NetconfError(f"{name}: cannot bring it up: {exc.strerror}") from exc


def add_default_route(gateway: str, device: str | None = None) -> bool:
    """``default via gateway [dev device]``; False when a default route already exists."""
    entry = _Rtentry()
    entry.rt_dst = _sockaddr("0.0.0.0")
    entry.rt_genmask = _sockaddr("0.0.0.0")
    entry.rt_gateway = _sockaddr(gateway)
    entry.rt_flags = RTF_UP | RTF_GATEWAY
    dev = device.encode() if device else None
    entry.rt_dev = dev  # the kernel copies the name during the call; ``dev`` outlives it
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            fcntl.ioctl(sock.fileno(), SIOCADDRT, entry)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise NetconfError(f"default route via {gateway}: {exc.strerror}") from exc
    return True
