"""The config disk a guest boots with: its identity, its certificates and its daemon config.

The host's CA issues each guest its own server certificate (SAN = the guest's address and name);
the guest trusts only the host CA. Everything is packed into a read-only squashfs image the
guest's PID 1 mounts at /etc/aurae before it loads its configuration.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import subprocess
import tempfile
from pathlib import Path

from auraed.errors import AuraeError, ErrorKind
from auraed.pki import CertificateAuthority, certificate_pem, issue_server_cert, private_key_pem
from auraed.wire.channel import GUEST_PING_INTERVAL_MIN

GUEST_PORT = 8443
GUEST_CONFIG = """# Written by the host auraed for guest {hostname}.
role = "guest"
tcp_listen = "{address}:{port}"
socket = "/run/aurae/aurae.sock"
ca_crt = "/etc/aurae/pki/ca.crt"
server_crt = "/etc/aurae/pki/server.crt"
server_key = "/etc/aurae/pki/server.key"
# Issued by this host from its CA a moment ago: nothing for the guest to check at its start.
check_server_credentials = false
# The root is an overlay on tmpfs, and overlayfs refuses an upper dir on an overlay: container
# layers live on /run (a plain tmpfs) instead.
state_dir = "/run/aurae/state"
runtime_dir = "/run/aurae/run"
stop_containers_on_shutdown = true
# The host pings its connection to the guest as often as every {ping_interval:g} s (its
# guest_keepalive_time), to end its calls when the guest stops answering.
keepalive_client_min_interval = {ping_interval}

[authorization]
# Only the host that booted this guest may call it.
default = []
[authorization.identities]
"{host_identity}" = ["*"]
"""


@dataclasses.dataclass(frozen=True)
class GuestIdentity:
    hostname: str
    address: ipaddress.IPv4Interface  # the guest's address with its prefix
    gateway: ipaddress.IPv4Address  # the host end of the tap
    port: int = GUEST_PORT

    @property
    def endpoint(self) -> str:
        return f"{self.address.ip}:{self.port}"

    def kernel_args(self) -> str:
        """What PID 1 reads from the kernel command line."""
        return (
            f"auraed.role=guest auraed.hostname={self.hostname} auraed.ip={self.address.with_prefixlen} "
            f"auraed.gateway={self.gateway}"
        )

    @property
    def server_name(self) -> str:
        """A name the guest's certificate carries, for clients to verify it by."""
        return f"{self.hostname}.guest.aurae"


def config_files(identity: GuestIdentity, ca: CertificateAuthority, host_identity: str) -> dict[str, str]:
    """What a guest's config holds, by path under /etc/aurae: its daemon config, the host CA and
    its own server certificate and key, issued now."""
    cert, key = issue_server_cert(
        ca, identity.server_name, dns_names=[identity.server_name], ip_addresses=[str(identity.address.ip)]
    )
    return {
        "auraed.toml": GUEST_CONFIG.format(
            hostname=identity.hostname,
            address=identity.address.ip,
            port=identity.port,
            host_identity=host_identity,
            ping_interval=GUEST_PING_INTERVAL_MIN,
        ),
        "pki/ca.crt": certificate_pem(ca.cert).decode(),
        "pki/server.crt": certificate_pem(cert).decode(),
        "pki/server.key": private_key_pem(key).decode(),
    }


def template_config(port: int, host_identity: str) -> dict[str, str]:
    """A template guest's config (vms/templates.py): every guest's, with no address of anyone's
    and no certificate; a clone's own replaces it with its identity."""
    text = GUEST_CONFIG.format(
        hostname="a template",
        address="0.0.0.0",
        port=port,
        host_identity=host_identity,
        ping_interval=GUEST_PING_INTERVAL_MIN,
    )
    return {"auraed.toml": text}


def build_config_disk(
    output: Path, identity: GuestIdentity, ca: CertificateAuthority, host_identity: str
) -> Path:
    """Write the guest's config disk to ``output`` (a squashfs image) and return it."""
    with tempfile.TemporaryDirectory(prefix="aurae-guest-config-") as work:
        root = Path(work)
        for relative, content in config_files(identity, ca, host_identity).items():
            path = root / relative
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(content)
        # Created owner-only (the disk holds the guest's key), filled, then renamed over the old disk:
        # a VMM launched meanwhile opens a whole disk, never one another Start is writing.
        fd, staging = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
        os.close(fd)
        try:
            result = subprocess.run(
                ["mksquashfs", str(root), staging, "-quiet", "-noappend", "-all-root", "-comp", "gzip"],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise AuraeError(
                    ErrorKind.INTERNAL, f"cannot build the config disk {output}: {result.stderr.strip()}"
                )
            os.replace(staging, output)
        finally:
            Path(staging).unlink(missing_ok=True)
    return output
