"""The daemon's surface: discovery, health, reflection, its socket and its command line."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from auraed.api.aurae.discovery import v0 as discovery
from auraed.client import AuraeClient, ClientConfig, ClientError
from auraed.client.client import channel_for
from tests.conftest import DaemonFactory, DaemonProcess, wait_until

AURAE_SERVICES = {
    "aurae.cells.v0.CellService",
    "aurae.containers.v0.ContainerService",
    "aurae.discovery.v0.DiscoveryService",
    "aurae.observe.v0.ObserveService",
    "aurae.vms.v0.VmService",
}


async def test_discovery_reports_role_services_and_host(client: AuraeClient) -> None:
    reply = await client.call(
        "aurae.discovery.v0.DiscoveryService", "Discover", discovery.DiscoveryServiceDiscoverRequest()
    )
    assert reply.healthy
    assert reply.role == "host"
    assert set(reply.services) == AURAE_SERVICES
    caps = reply.capabilities
    # This machine: cgroup v1 hybrid; runc works there, crun refuses hybrid hosts.
    assert caps.cgroup_layout == discovery.CgroupLayout.HYBRID
    assert {"cpu", "memory", "pids", "cpuset"} <= set(caps.cgroup_controllers)
    runtimes = {r.name: r for r in caps.oci_runtimes}
    assert runtimes["runc"].usable and runtimes["runc"].version
    assert not runtimes["crun"].usable
    assert caps.qemu_present
    assert caps.kvm_present
    # Nested KVM does not work here: the probe must say so rather than trust /dev/kvm.
    assert not caps.kvm_usable and caps.kvm_detail
    assert caps.cpus >= 1 and caps.memory_bytes > 0


async def test_health_serving_for_every_service(client: AuraeClient) -> None:
    for service in ["", *AURAE_SERVICES]:
        assert await client.health(service) == "SERVING"
    with pytest.raises(ClientError) as error:
        await client.health("no.such.Service")
    assert error.value.code == "NOT_FOUND"


def test_reflection_lists_and_describes_every_service(daemon: DaemonProcess) -> None:
    config = daemon.client_config()
    credentials = grpc.ssl_channel_credentials(
        config.ca_crt.read_bytes(), config.client_key.read_bytes(), config.client_crt.read_bytes()
    )
    options = [
        ("grpc.ssl_target_name_override", config.server_name),
        ("grpc.default_authority", config.server_name),
    ]
    with grpc.secure_channel(config.address, credentials, options=options) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert AURAE_SERVICES | {"grpc.health.v1.Health"} <= services
        for name in AURAE_SERVICES:
            file = database.FindFileContainingSymbol(name)
            described = next(s for s in file.service if f"{file.package}.{s.name}" == name)
            assert described.method


def test_socket_is_owner_only(daemon: DaemonProcess) -> None:
    mode = daemon.socket.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_second_daemon_on_a_live_socket_or_state_is_refused(daemon: DaemonProcess, tmp_path: Path) -> None:
    same_state = subprocess.run(daemon.args, capture_output=True, text=True, timeout=60, check=False)
    assert same_state.returncode != 0
    assert "already running with the state directory" in same_state.stderr
    other_state = [
        *daemon.args,
        "--state-dir",
        str(tmp_path / "state"),
        "--runtime-dir",
        str(tmp_path / "run"),
    ]
    same_socket = subprocess.run(other_state, capture_output=True, text=True, timeout=60, check=False)
    assert same_socket.returncode != 0
    assert "already serving" in same_socket.stderr
    # The refused daemons touched nothing: the first still serves.
    assert daemon.socket.exists()


def test_stale_socket_is_replaced(daemon_factory: DaemonFactory) -> None:
    first = daemon_factory()
    first.kill9()  # leaves its socket file behind
    assert first.socket.exists()
    first.start()
    assert "removing stale socket" in first.log()


def test_help_shows_settings_and_defaults() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "auraed", "--help"], capture_output=True, text=True, check=True
    )
    for expected in (
        "--socket",
        "/var/run/aurae/aurae.sock",
        "--tcp-listen",
        "--state-dir",
        "/var/lib/aurae",
        "--runtime-dir",
        "--ca-crt",
        "AURAED_",
    ):
        assert expected in result.stdout


def test_bad_configuration_is_reported_without_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "auraed", "--role", "captain"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "role" in result.stderr and "Traceback" not in result.stderr


async def test_graceful_shutdown_marks_not_serving_and_removes_socket(daemon: DaemonProcess) -> None:
    async with daemon.client() as client:
        assert await client.health() == "SERVING"
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
    assert "auraed stopped" in daemon.log()


async def test_sighup_is_not_the_end(daemon: DaemonProcess) -> None:
    """A closed terminal or a service manager's "reload": the daemon says so and serves on."""
    assert daemon.process is not None
    daemon.process.send_signal(signal.SIGHUP)
    await wait_until(lambda: "received SIGHUP: ignored" in daemon.log())
    async with daemon.client() as client:
        assert await client.health() == "SERVING"
    assert daemon.stop() == 0


def test_client_reports_missing_certificate_files() -> None:
    # channel_for must fail with a clear error, not a traceback, when files are missing.

    with pytest.raises(ClientError) as error:
        channel_for(ClientConfig(Path("/nonexistent/ca"), Path("/x"), Path("/y"), "unix:/z"))
    assert "/nonexistent/ca" in error.value.message
