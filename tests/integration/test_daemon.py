"""The daemon's surface: discovery, health, reflection, its socket and its command line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from auraed.api.aurae.cells import v0 as cells
from auraed.api.aurae.discovery import v0 as discovery
from auraed.api.aurae.system import v0 as system
from auraed.client import AuraeClient, ClientConfig, ClientError
from auraed.client.client import channel_for, client_config_text
from auraed.pki import PkiPaths
from tests.conftest import DaemonFactory, DaemonProcess, remove_daemon_leftovers, start_refused, wait_until

CELLS = "aurae.cells.v0.CellService"
SYSTEM = "aurae.system.v0.SystemService"
LATE_ATTEMPTS = 5  # calls made while the daemon stops, 0.1 s apart: within its 2 s grace

AURAE_SERVICES = {
    "aurae.cells.v0.CellService",
    "aurae.containers.v0.ContainerService",
    "aurae.discovery.v0.DiscoveryService",
    "aurae.observe.v0.ObserveService",
    "aurae.network.v0.NetworkService",
    "aurae.system.v0.SystemService",
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


@pytest.mark.parametrize("disposition", ["default", "ignore"])
async def test_sigint_stops_the_daemon_unless_it_started_ignoring_it(pki: PkiPaths, disposition: str) -> None:
    """Ctrl-C is a graceful stop. A script's background job (``auraed &``) starts with SIGINT
    ignored, so that a Ctrl-C meant for the script leaves the daemon to the script's clean-up,
    which still needs it: such a daemon ignores SIGINT, as Python itself does."""
    daemon = DaemonProcess(Path(tempfile.mkdtemp(prefix="aurae-int-", dir="/tmp")), pki, [])
    # env execs auraed in its own process: the pid, and so the signals, are the daemon's.
    daemon.args = ["env", f"--{disposition}-signal=INT", *daemon.args]
    try:
        daemon.start()
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGINT)
        if disposition == "default":
            assert daemon.process.wait(timeout=30) == 0
            assert "received SIGINT: shutting down" in daemon.log()
            return
        # Signals reach the loop in the order they came: SIGHUP's line follows SIGINT's, if any.
        daemon.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "received SIGHUP: ignored" in daemon.log())
        assert "received SIGINT" not in daemon.log()
        async with daemon.client() as client:
            assert await client.health() == "SERVING"
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        remove_daemon_leftovers(daemon)


def test_client_reports_missing_certificate_files() -> None:
    # channel_for must fail with a clear error, not a traceback, when files are missing.

    with pytest.raises(ClientError) as error:
        channel_for(ClientConfig(Path("/nonexistent/ca"), Path("/x"), Path("/y"), "unix:/z"))
    assert "/nonexistent/ca" in error.value.message


async def _start_in(client: AuraeClient, cell: str, name: str, command: str) -> None:
    executable = cells.Executable(name=name, shell_command=command)
    await client.call(CELLS, "Start", cells.CellServiceStartRequest(cell_name=cell, executable=executable))


def _pids_under(cgroup_base: str) -> set[int]:
    """Every process in any cgroup below ``cgroup_base``, in every v1 hierarchy."""
    pids: set[int] = set()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        base = hierarchy / cgroup_base
        if base.is_dir():
            for procs in base.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(pid) for pid in procs.read_text().split())
    return pids


async def test_shutdown_refuses_new_calls_before_stopping_anything(daemon: DaemonProcess) -> None:
    """Calls that arrive while the daemon stops are refused (UNAVAILABLE), so nothing started
    then outlives it: its executables stopped, none is left in its cells."""
    assert daemon.process is not None
    async with daemon.client() as client:
        await client.call(CELLS, "Allocate", cells.CellServiceAllocateRequest(cell=cells.Cell(name="late")))
        # Ignores SIGTERM: stopping it takes the daemon's whole grace period (2 s in tests).
        await _start_in(client, "late", "stubborn", "trap '' TERM; while :; do sleep 1; done")
        daemon.process.send_signal(signal.SIGTERM)
        await wait_until(lambda: "received SIGTERM" in daemon.log())
        outcomes = []
        for attempt in range(LATE_ATTEMPTS):
            try:
                await _start_in(client, "late", f"late{attempt}", "exec sleep 300")
                outcomes.append("started")
            except ClientError as exc:
                outcomes.append(exc.code)
            await asyncio.sleep(0.1)
    assert daemon.process.wait(timeout=30) == 0
    assert outcomes == ["UNAVAILABLE"] * LATE_ATTEMPTS
    assert not _pids_under(daemon.cgroup_base)


@pytest.mark.parametrize(
    ("which", "mode", "refusal"),
    [
        ("state", 0o777, "is open to others"),
        ("state", 0o755, "is open to others"),
        ("state", 0o1733, "is open to others"),
        ("socket", 0o777, "is writable by others"),
        ("socket", 0o1733, "is writable by others"),
        ("socket", 0o775, "is writable by others"),
    ],
)
def test_directories_open_to_others_are_refused(pki: PkiPaths, which: str, mode: int, refusal: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="aurae-dirs-", dir="/tmp"))
    directory = root / which
    directory.mkdir()
    directory.chmod(mode)
    flags = ["--state-dir", str(directory)] if which == "state" else ["--socket", str(directory / "a.sock")]
    said = start_refused(DaemonProcess(root, pki, flags))
    what = "state directory" if which == "state" else "socket's directory"
    assert f"the {what} {directory} {refusal} (mode {mode & 0o7777:04o})" in said
    assert "Traceback" not in said


def test_a_socket_may_live_in_a_shared_directory_others_only_read(daemon_factory: DaemonFactory) -> None:
    """Like /run: the socket itself is owner-only, its directory need not be."""
    shared = Path(tempfile.mkdtemp(prefix="aurae-shared-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        daemon = daemon_factory("--socket", str(shared / "aurae.sock"))
        assert stat.S_IMODE((shared / "aurae.sock").stat().st_mode) & 0o077 == 0
        assert daemon.stop() == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_directories_the_daemon_makes_are_owner_only(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    for directory in (daemon.root / "state", daemon.root / "run", daemon.socket.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_the_guests_layout_is_made_owner_only(daemon_factory: DaemonFactory) -> None:
    """A guest's directories share a parent no one made (/run/aurae): made for the state
    directory, it is then the socket's directory, and must pass as one."""
    made = Path(tempfile.mkdtemp(prefix="aurae-guest-layout-", dir="/tmp"))
    shared = made / "run-aurae" / "below"
    try:
        daemon = daemon_factory(
            "--socket",
            str(shared / "aurae.sock"),
            "--state-dir",
            str(shared / "state"),
            "--runtime-dir",
            str(shared / "run"),
        )
        for directory in (made / "run-aurae", shared, shared / "state", shared / "run"):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
        assert daemon.stop() == 0
    finally:
        shutil.rmtree(made, ignore_errors=True)


async def test_the_shutdown_rpc_stops_the_daemon_gracefully(daemon: DaemonProcess) -> None:
    assert daemon.process is not None
    async with daemon.client() as client:
        with pytest.raises(ClientError) as error:
            await client.call(SYSTEM, "Shutdown", system.SystemServiceShutdownRequest(reason="x" * 257))
        assert error.value.code == "INVALID_ARGUMENT" and "reason" in error.value.message
        assert await client.health() == "SERVING"  # a refused Shutdown stops nothing
        request = system.SystemServiceShutdownRequest(reason="maintenance")
        reply = await client.call(SYSTEM, "Shutdown", request)
    assert reply.then == "exit"
    assert daemon.process.wait(timeout=30) == 0
    log = daemon.log()
    assert "Shutdown called by aurae-client: maintenance: stopping" in log and "auraed stopped" in log
    assert not daemon.socket.exists()


async def test_a_daemon_that_is_not_the_machine_s_init_neither_reseeds_nor_sets_the_clock(
    daemon: DaemonProcess,
) -> None:
    async with daemon.client() as client:
        with pytest.raises(ClientError) as error:
            await client.call(SYSTEM, "ReseedRandom", system.SystemServiceReseedRandomRequest(entropy=b"x"))
        assert error.value.code == "INVALID_ARGUMENT" and "entropy" in error.value.message
        for method, request in (
            ("ReseedRandom", system.SystemServiceReseedRandomRequest(entropy=bytes(64))),
            ("SetTime", system.SystemServiceSetTimeRequest(unix_ns=1)),
            ("OnlineCpuMem", system.SystemServiceOnlineCpuMemRequest()),
        ):
            with pytest.raises(ClientError) as error:
                await client.call(SYSTEM, method, request)
            assert error.value.code == "FAILED_PRECONDITION" and "machine's init" in error.value.message


def test_aer_system_shutdown(daemon: DaemonProcess) -> None:
    assert daemon.process is not None
    config = daemon.client_config()
    client_config = daemon.root / "aer.toml"
    client_config.write_text(
        client_config_text(config.ca_crt, config.client_crt, config.client_key, daemon.socket)
    )
    aer = [sys.executable, "-m", "auraed.aer", "--config", str(client_config), "system", "shutdown"]
    result = subprocess.run(
        [*aer, "--reason", "from aer"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "auraed is shutting down; it then exits" in result.stdout
    assert daemon.process.wait(timeout=30) == 0
    assert "Shutdown called by aurae-client: from aer" in daemon.log()


async def test_signals_while_starting_are_handled(pki: PkiPaths) -> None:
    """A SIGHUP while the daemon starts is ignored, a SIGTERM is a graceful stop once started:
    neither takes its default action (the end of the process, on the spot)."""
    daemon = DaemonProcess(Path(tempfile.mkdtemp(prefix="aurae-sig-", dir="/tmp")), pki, [])
    log = daemon.log_path.open("ab")
    try:
        daemon.process = subprocess.Popen(daemon.args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        await wait_until(lambda: "auraed starting as" in daemon.log())
        daemon.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "serving on unix:" in daemon.log(), timeout=30)
        assert daemon.process.poll() is None
        assert "received SIGHUP: ignored" in daemon.log()
        assert daemon.stop() == 0
    finally:
        log.close()
        daemon.stop()
        remove_daemon_leftovers(daemon)


# auraed as PID 1 of new namespaces (tests/integration/test_pid1.py): it exits where a machine's
# init would power off.
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--ipc", "--kill-child"]


async def test_the_shutdown_rpc_to_pid1_ends_it_as_its_power_off_would(
    pki: PkiPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = Path(tempfile.mkdtemp(prefix="aurae-p1-", dir="/tmp"))
    (made / "pid1-root").mkdir()
    os.mkfifo(made / "power-button")  # a button no one presses, instead of the host's
    monkeypatch.setenv("AURAED_PID1_ROOT", str(made / "pid1-root"))
    monkeypatch.setenv("AURAED_PID1_POWER_BUTTON", str(made / "power-button"))
    (made / "d").mkdir()
    daemon = DaemonProcess(made / "d", pki, [])
    daemon.args = [*UNSHARE, *daemon.args]
    try:
        daemon.start()
        assert daemon.process is not None
        async with daemon.client() as client:
            request = system.SystemServiceShutdownRequest(reason="from the host")
            reply = await client.call(SYSTEM, "Shutdown", request)
        assert reply.then == "exit"  # PID 1 of a pid namespace; a guest's would be "poweroff"
        assert await asyncio.to_thread(daemon.process.wait, 60) == 0
        log = daemon.log()
        why = "Shutdown called by aurae-client: from the host"
        assert f"{why}: stopping auraed, then exiting" in log
        assert f"auraed ended (status 0, {why}): exiting" in log
    finally:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.process.kill()  # --kill-child takes the namespace down with it
            daemon.process.wait(timeout=30)
        remove_daemon_leftovers(daemon)
        shutil.rmtree(made, ignore_errors=True)
