"""``aer discovery`` and ``aer health``: who auraed is, what its machine can do, whether it serves."""

from __future__ import annotations

import argparse
from typing import Any

from auraed.api.aurae.discovery import v0 as discovery_pb
from auraed.client.cli.arguments import add_command
from auraed.client.cli.calls import DISCOVERY, call, call_timeout, session
from auraed.client.cli.output import kv_table, print_json, size_text


def _present(present: bool, path: str) -> str:
    return (path or "present") if present else "absent"


def _discovery_rows(reply: discovery_pb.DiscoveryServiceDiscoverResponse) -> list[tuple[str, str]]:
    caps = reply.capabilities or discovery_pb.HostCapabilities()
    runtimes = [
        f"{r.name} {r.version} {r.path}{'' if r.usable else ' (not usable)'}" for r in caps.oci_runtimes
    ]
    kvm = "usable" if caps.kvm_usable else ("present, " if caps.kvm_present else "absent, ") + "not usable"
    return [
        ("version", reply.version),
        ("role", reply.role),
        ("hostname", reply.hostname),
        ("healthy", "yes" if reply.healthy else "no"),
        ("services", "\n".join(reply.services)),
        ("kernel", caps.kernel_release),
        ("cpus", str(caps.cpus)),
        ("memory", size_text(caps.memory_bytes)),
        ("cgroup layout", caps.cgroup_layout.name),
        ("cgroup controllers", " ".join(caps.cgroup_controllers)),
        ("oci runtimes", "\n".join(runtimes) or "none"),
        ("kvm", f"{kvm}: {caps.kvm_detail}" if caps.kvm_detail else kvm),
        ("qemu", _present(caps.qemu_present, caps.qemu_path)),
        ("cloud-hypervisor", _present(caps.cloud_hypervisor_present, caps.cloud_hypervisor_path)),
    ]


def cmd_discovery(args: argparse.Namespace) -> int:
    reply = call(args, DISCOVERY, "Discover", discovery_pb.DiscoveryServiceDiscoverRequest())
    if args.json:
        print_json(reply)
    else:
        kv_table("auraed", _discovery_rows(reply))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    timeout = call_timeout(args)
    status = session(args, lambda client: client.health(args.service, timeout))
    if args.json:
        print_json({"service": args.service, "status": status})
    else:
        print(status)
    return 0 if status == "SERVING" else 1


def add_commands(subparsers: Any) -> None:
    add_command(subparsers, "discovery", cmd_discovery, "who auraed is and what the machine can do")
    health = add_command(subparsers, "health", cmd_health, "gRPC health status; exit 1 unless SERVING")
    health.add_argument(
        "service", nargs="?", default="", help="a service name; the server as a whole if omitted"
    )
