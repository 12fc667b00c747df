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
        )

    @property
    def guest(self) -> bool:
        return self.role == "guest"


def _flag(value: str) -> bool:
    return value.lower() in ("1", "yes", "on", "true")
