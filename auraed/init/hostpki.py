"""The host image's PKI, made on first boot and kept on the data disk (auraed/init/host.py).

Run by the daemon PID 1 starts, before the Daemon is built: the CA, a server certificate naming the
host's names and current addresses (reissued when they change; the CA is kept), and one client
certificate (``aurae-admin``) with an ``aer`` configuration beside it in the client directory. A
client configuration that was never shown is printed on the console once, as a shell script an
operator saves and runs in an empty directory, with the CA's SHA-256 fingerprint to check it by.
An operator's own CA is used when ``ca.crt`` and ``ca.key`` are put in the TLS directory first.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from auraed.init.host import HostProfile, ca_fingerprint, console, interface_addresses
from auraed.pki import ensure_client_cert, ensure_dev_pki, load_ca

log = logging.getLogger("auraed.pid1")

CLIENT_NAME = "aurae-admin"
SHOWN_MARKER = ".shown-on-console"
BEGIN = "----- BEGIN AURAE CLIENT CONFIG -----"
END = "----- END AURAE CLIENT CONFIG -----"


def client_config_text(address: str, server_name: str) -> str:
    return (
        "# aer's configuration for this host (written by auraed on its first boot)\n"
        "[auth]\n"
        'ca_crt = "ca.crt"\n'
        f'client_crt = "{CLIENT_NAME}.crt"\n'
        f'client_key = "{CLIENT_NAME}.key"\n'
        "[system]\n"
        f'address = "{address}"\n'
        f'server_name = "{server_name}"\n'
    )


def ensure(profile: HostProfile) -> tuple[str, bool]:
    """Make or reuse the PKI and the client configuration: (CA fingerprint, shown now)."""
    import time

    started = time.monotonic()
    fingerprint, shown = _ensure(profile)
    console(f"aurae-host: PKI {'made' if shown else 'checked'} in {time.monotonic() - started:.2f} s")
    return fingerprint, shown


def _ensure(profile: HostProfile) -> tuple[str, bool]:
    hostname = socket.gethostname()
    addresses = [address for _, address, _ in interface_addresses()]
    tls = Path(profile.tls_dir)
    ensure_dev_pki(
        tls, server_names=(hostname, "localhost"), server_ips=("127.0.0.1", *addresses), client_names=()
    )
    ca = load_ca(tls)
    client = Path(profile.client_dir)
    crt, key = ensure_client_cert(ca, client, CLIENT_NAME)
    ca_pem = (tls / "ca.crt").read_bytes()
    (client / "ca.crt").write_bytes(ca_pem)
    address = f"{addresses[0]}:{profile.api_port}" if addresses else f"{hostname}:{profile.api_port}"
    config = client_config_text(address, hostname)
    (client / "config").write_text(config)
    fingerprint = ca_fingerprint(ca_pem)
    marker = client / SHOWN_MARKER
    if marker.exists():
        log.info("host PKI reused: CA SHA-256 %s", fingerprint)
        return fingerprint, False
    files = {
        "ca.crt": ca_pem.decode(),
        crt.name: crt.read_text(),
        key.name: key.read_text(),
        "config": config,
    }
    console(bundle(files, fingerprint))
    marker.write_text("")
    os.sync()
    return fingerprint, True


def bundle(files: dict[str, str], fingerprint: str) -> str:
    """The client configuration as a shell script that writes its files into the current directory."""
    lines = [
        BEGIN,
        "# Shown once, at this host's first boot. Save the lines between the markers as a file and",
        "# run it with sh in an empty directory, then: aer --config ./config discovery",
        f"# CA SHA-256 fingerprint: {fingerprint}",
        "umask 077",
    ]
    for name, text in files.items():
        lines += [f"cat > {name} <<'AURAE-EOF'", text.rstrip("\n"), "AURAE-EOF"]
    lines.append(END)
    return "\n".join(lines)
