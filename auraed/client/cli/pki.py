"""``aer pki``: a development PKI for auraed's mTLS (a CA, server and client certificates)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from auraed.client.cli.arguments import add_command, add_group, ip_address
from auraed.client.cli.calls import CliError
from auraed.client.cli.output import console, kv_table, print_json
from auraed.client.client import DEFAULT_SOCKET, client_config_text
from auraed.pki import PkiPaths, ensure_dev_pki, issue_client_cert, load_ca, write_pem_files
from auraed.pki.certs import (
    CA_STEM,
    DEFAULT_CLIENT_NAMES,
    DEFAULT_SERVER_IPS,
    DEFAULT_SERVER_NAMES,
    SERVER_STEM,
)


def _pki_summary(paths: PkiPaths, config: Path) -> dict[str, Any]:
    clients = {name: {"crt": str(crt), "key": str(key)} for name, (crt, key) in paths.clients.items()}
    return {
        "ca_crt": str(paths.ca_crt),
        "ca_key": str(paths.ca_key),
        "server_crt": str(paths.server_crt),
        "server_key": str(paths.server_key),
        "clients": clients,
        "config": str(config),
    }


def cmd_pki_init(args: argparse.Namespace) -> int:
    directory = args.dir.expanduser().resolve()
    clients = list(dict.fromkeys(args.client or DEFAULT_CLIENT_NAMES))
    try:
        paths = ensure_dev_pki(
            directory,
            server_names=list(dict.fromkeys([*DEFAULT_SERVER_NAMES, *(args.server_name or [])])),
            server_ips=list(dict.fromkeys([*DEFAULT_SERVER_IPS, *(args.server_ip or [])])),
            client_names=clients,
        )
    except ValueError as exc:  # a client name that cannot be a file name
        raise CliError(str(exc)) from None
    config = directory / "config"
    crt, key = paths.clients[clients[0]]
    config.write_text(
        "# aer client config, written by `aer pki init`\n"
        + client_config_text(paths.ca_crt, crt, key, args.socket)
    )
    summary = _pki_summary(paths, config)
    if args.json:
        print_json(summary)
        return 0
    rows = [(k, v) for k, v in summary.items() if k != "clients"]
    rows += [
        (f"client {name}", f"{files['crt']}\n{files['key']}") for name, files in summary["clients"].items()
    ]
    kv_table(f"dev PKI in {directory}", rows)
    flags = {
        "--socket": args.socket,
        "--ca-crt": paths.ca_crt,
        "--server-crt": paths.server_crt,
        "--server-key": paths.server_key,
    }
    command = shlex.join(["auraed", *(f"{flag}={value}" for flag, value in flags.items())])
    console.print(
        f"Start auraed with:\n  {command}\n"
        f"and point aer at it:\n  export AURAE_CONFIG={shlex.quote(str(config))}",
        markup=False,
        soft_wrap=True,
    )
    return 0


def cmd_pki_client(args: argparse.Namespace) -> int:
    directory = args.dir.expanduser().resolve()
    if args.name in (CA_STEM, SERVER_STEM):
        raise CliError(f"client name {args.name!r} would overwrite the CA or server files")
    if (directory / f"{args.name}.crt").exists():
        raise CliError(f"{directory / args.name}.crt already exists; remove it to issue a new one")
    ca = load_ca(directory)
    try:
        cert, key = issue_client_cert(ca, args.name)
        crt_path, key_path = write_pem_files(directory, args.name, cert, key)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json({"name": args.name, "crt": str(crt_path), "key": str(key_path)})
    else:
        kv_table(f"client {args.name}", [("crt", str(crt_path)), ("key", str(key_path))])
    return 0


def add_commands(subparsers: Any) -> None:
    pki = add_group(subparsers, "pki", "a development PKI for auraed's mTLS")
    init = add_command(pki, "init", cmd_pki_init, "create (or keep) a dev CA, server and client certificates")
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument("--server-name", action="append", metavar="NAME", help="extra DNS name of the server")
    init.add_argument("--server-ip", action="append", type=ip_address, metavar="IP", help="extra server IP")
    init.add_argument("--client", action="append", metavar="NAME", help="client certificate to issue")
    init.add_argument(
        "--socket", default=DEFAULT_SOCKET, help=f"socket in the config (default {DEFAULT_SOCKET})"
    )
    client = add_command(pki, "client", cmd_pki_client, "issue another client certificate from the CA in DIR")
    client.add_argument("dir", type=Path, metavar="DIR")
    client.add_argument("name", metavar="NAME")
