"""The guest boot contract: the ``auraed.*`` words of the kernel command line and the config disk.

The host writes it (vms/vms.py puts the words on a VM's kernel command line, vms/guests.py adds
the config disk), the guest reads it (PID 1 in init/pid1.py, the role in init/roles.py). Kept
low and stdlib-only: PID 1 imports it before anything is mounted, under emulation in guests.
"""

from __future__ import annotations

from typing import NamedTuple

# The host adds a guest's config disk (vms/guests.py) after any disks the VM was given, so it is
# found by its virtio serial, not by its place (/dev/vdb is the first extra disk).
GUEST_CONFIG_SERIAL = "config"
GUEST_CONFIG_DISK = f"serial={GUEST_CONFIG_SERIAL}"
# A host directory shared with the guest over virtio-fs (a pod's volumes): its tag, named by
# ``auraed.share=``, and where the guest's PID 1 mounts it.
SHARE_TAG = "aurae-share"
SHARE_MOUNT = "/run/aurae/share"
# A template guest (``auraed.template=1``) has no config disk and no network on its command line:
# it does its imports, says so on this virtio-serial port, and waits there for the identity each
# of its clones is given (auraed/init/identity.py in the guest, auraed/vms/templates.py on the host).
IDENTITY_PORT = "org.aurae.identity"
# The debug console (the host's vm_debug_console): a virtio-serial port of this name, on which the
# guest's PID 1 runs a shell for the host's VmService.DebugShell, told by ``auraed.debug_console=1``.
# Both directions carry frames (``debug_frame``): a type byte, a 2-byte big-endian length, the
# payload. Host to guest: DEBUG_OPEN first in each session (a new shell: one that runs is hung up
# first, the host's end may have been closed and opened again between two looks), then
# DEBUG_INPUT (bytes for the shell's terminal) and DEBUG_SIZE (rows, columns: 2 bytes each).
# Guest to host: DEBUG_OUTPUT (what the terminal printed), DEBUG_EXIT (the shell ended: its
# status, 4 bytes signed; what comes after it until the next DEBUG_OPEN is dropped).
DEBUG_PORT = "org.aurae.debug"
DEBUG_INPUT, DEBUG_SIZE, DEBUG_OUTPUT, DEBUG_EXIT, DEBUG_OPEN = 0, 1, 2, 3, 4
DEBUG_FRAME_MAX = 65535


class BootArgs(NamedTuple):
    """The ``auraed.*`` words of the kernel command line."""

    role: str = ""
    hostname: str = ""
    ip: str = ""  # address/prefix
    gateway: str = ""
    iface: str = "eth0"
    config_disk: str = ""
    poweroff: bool = False
    share: str = ""  # a virtio-fs tag to mount at SHARE_MOUNT
    template: bool = False
    debug_console: bool = False  # run a shell on DEBUG_PORT

    @classmethod
    def parse(cls, cmdline: str) -> BootArgs:
        values: dict[str, str] = {}
        for word in cmdline.split():
            if word == "--":  # the rest belongs to init's argv
                break
            key, sep, value = word.partition("=")
            if key.startswith("auraed.") and sep:
                values[key.removeprefix("auraed.")] = value
        return cls(
            role=values.get("role", ""),
            hostname=values.get("hostname", ""),
            ip=values.get("ip", ""),
            gateway=values.get("gateway", ""),
            iface=values.get("iface", "") or "eth0",
            config_disk=values.get("config_disk", ""),
            poweroff=_flag(values.get("poweroff", "")),
            template=_flag(values.get("template", "")),
            share=values.get("share", ""),
            debug_console=_flag(values.get("debug_console", "")),
        )

    @property
    def guest(self) -> bool:
        return self.role == "guest"


def _flag(value: str) -> bool:
    return value.lower() in ("1", "yes", "on", "true")


def debug_frame(kind: int, payload: bytes) -> bytes:
    """One frame of the debug port's protocol (see DEBUG_PORT); payloads over DEBUG_FRAME_MAX split."""
    out = bytearray()
    for start in range(0, max(len(payload), 1), DEBUG_FRAME_MAX):
        chunk = payload[start : start + DEBUG_FRAME_MAX]
        out += bytes((kind,)) + len(chunk).to_bytes(2, "big") + chunk
    return bytes(out)


class DebugFrames:
    """Frames out of a byte stream, fed as it comes: ``feed`` returns the (kind, payload) complete."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= 3:
            size = int.from_bytes(self._buffer[1:3], "big")
            if len(self._buffer) < 3 + size:
                break
            frames.append((self._buffer[0], self._buffer[3 : 3 + size]))
            self._buffer = self._buffer[3 + size :]
        return frames
