"""auraed as an orka node agent, against a scheduler of our own (tests/support/orka_scheduler.py,
a real gRPC server process speaking orka's scheduler.agent protos): join, retries, the exit or
serve choice, the status stream, re-joining (and correcting a scheduler's stale address), leaving."""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from auraed.api import node_agent as na
from auraed.api.aurae.discovery import v0 as discovery
from auraed.pki import certificate_pem, create_ca, issue_server_cert, write_pem_files
from auraed.system.node import read_memory
from tests.conftest import DaemonFactory, DaemonProcess
from tests.support.orka import SchedulerProcess, WorkloadClient, orka_scheduler_certificate
from tests.support.registry import free_port

INTERVAL = 0.3  # the retry and status intervals these daemons get: short, so the tests are
SLACK = 0.35  # what a 2-vCPU machine under load may add to an interval


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SchedulerProcess]:
    """Our scheduler's place (a port and an events file); each test starts it when it wants."""
    process = SchedulerProcess(free_port(), tmp_path / "scheduler-events.jsonl")
    yield process
    process.stop()


def agent_args(scheduler: SchedulerProcess, *more: str, port: int = 0) -> list[str]:
    return [
        "--orka-scheduler", scheduler.address,
        "--orka-listen", f"127.0.0.1:{port or free_port()}",
        "--orka-join-retry-interval", str(INTERVAL),
        "--orka-status-interval", str(INTERVAL),
        *more,
    ]  # fmt: skip


def log_times(daemon: DaemonProcess, pattern: str) -> list[float]:
    """When the daemon logged each line matching ``pattern`` (its log's asctime, to the ms)."""
    times = []
    for line in daemon.log().splitlines():
        if re.search(pattern, line):
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            times.append(stamp.timestamp())
    return times


def assert_spaced(times: list[float]) -> None:
    """Each of ``times`` INTERVAL after the one before, give or take the machine's load."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(INTERVAL - 0.05 <= gap <= INTERVAL + SLACK for gap in gaps), gaps


def wait_exit(daemon: DaemonProcess, timeout: float) -> int:
    assert daemon.process is not None
    return daemon.process.wait(timeout=timeout)


def test_joins_streams_its_status_and_leaves_on_sigterm(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess
) -> None:
    scheduler.start()
    port = free_port()
    daemon = daemon_factory(*agent_args(scheduler, port=port))
    join = scheduler.wait_for(lambda e: e["event"] == "join")
    assert join["code"] == "OK" and join["port"] == port
    node_id = join["id"]
    assert str(uuid.UUID(node_id)) == node_id

    deadline = time.monotonic() + 10
    while len(scheduler.events("status")) < 4:
        assert time.monotonic() < deadline, scheduler.events()
        time.sleep(0.05)
    statuses = scheduler.events("status")[:4]
    assert statuses[0]["t"] - join["t"] < SLACK, "the first sample goes at once"
    assert_spaced([status["t"] for status in statuses])
    memory = read_memory()
    for status in statuses:
        assert status["id"] == node_id
        assert status["total"] == memory.total  # MemTotal, in bytes
        assert 0 < status["free"] <= status["total"]
        assert 0.0 <= status["load"] <= 100.0

    assert daemon.stop() == 0
    leave = scheduler.wait_for(lambda e: e["event"] == "leave")
    assert leave["id"] == node_id
    assert "left the orka scheduler" in daemon.log()

    # The id is the node's, kept in its state store: the same after a restart.
    seen = len(scheduler.events())
    daemon.start()
    again = scheduler.wait_for(lambda e: e["event"] == "join", after=seen)
    assert again["id"] == node_id and again["code"] == "OK"


def rejoined(scheduler: SchedulerProcess, after: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The join answered ALREADY_EXISTS from index ``after`` on, and the one that followed it,
    after the node left: it must have left in between."""
    refused = scheduler.wait_for(lambda e: e["event"] == "join", after=after)
    assert refused["code"] == "ALREADY_EXISTS", refused
    at = scheduler.events().index(refused) + 1
    join = scheduler.wait_for(lambda e: e["event"] == "join" and e["code"] == "OK", after=at)
    between = scheduler.events()[at : scheduler.events().index(join)]
    assert [e["event"] for e in between] == ["leave"] and between[0]["id"] == refused["id"], between
    return refused, join


def test_rejoins_when_the_stream_breaks(daemon_factory: DaemonFactory, scheduler: SchedulerProcess) -> None:
    scheduler.start()
    port = free_port()
    daemon = daemon_factory(*agent_args(scheduler, port=port))
    node_id = scheduler.wait_for(lambda e: e["event"] == "status")["id"]

    # The scheduler restarts and forgets the node: the stream breaks, the node joins again.
    scheduler.kill()
    seen = len(scheduler.events())
    scheduler.start()
    rejoin = scheduler.wait_for(lambda e: e["event"] == "join", after=seen)
    assert rejoin["id"] == node_id and rejoin["code"] == "OK"
    scheduler.wait_for(lambda e: e["event"] == "status" and e["t"] > rejoin["t"], after=seen)

    # One that still knows the node, at an IP it no longer has, answers ALREADY_EXISTS and keeps
    # that address (as orka's does): the node leaves and joins again, once, and is known where
    # it is; status resumes.
    scheduler.kill()
    seen = len(scheduler.events())
    scheduler.start("--known", f"{node_id}=127.0.0.9:{port}")
    refused, rejoin = rejoined(scheduler, after=seen)
    assert refused["held"] == f"127.0.0.9:{port}" and rejoin["held"] == f"127.0.0.1:{port}"
    scheduler.wait_for(lambda e: e["event"] == "status" and e["t"] > rejoin["t"], after=seen)
    assert "leaving and joining again" in daemon.log()


async def test_a_node_back_on_another_port_is_called_there(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess
) -> None:
    """Killed (no LeaveCluster), the node comes back on another port: the scheduler held the old
    address and answers its join ALREADY_EXISTS; the node leaves and joins again, and the
    scheduler's record is where the WorkloadService serves now."""
    scheduler.start()
    old_port, new_port = free_port(), free_port()
    daemon = daemon_factory(*agent_args(scheduler, "--orka-plaintext", port=old_port))
    first = scheduler.wait_for(lambda e: e["event"] == "join")
    assert first["code"] == "OK" and first["held"] == f"127.0.0.1:{old_port}"
    daemon.kill9()

    seen = len(scheduler.events())
    daemon.args[daemon.args.index(f"127.0.0.1:{old_port}")] = f"127.0.0.1:{new_port}"
    daemon.start()
    refused, join = rejoined(scheduler, after=seen)
    assert refused["id"] == join["id"] == first["id"]
    assert refused["held"] == f"127.0.0.1:{old_port}" and refused["port"] == new_port
    assert join["held"] == f"127.0.0.1:{new_port}"
    assert len([e for e in scheduler.events()[seen:] if e["event"] == "join"]) == 2  # once
    scheduler.wait_for(lambda e: e["event"] == "status" and e["t"] > join["t"], after=seen)
    assert f"knows node {first['id']} already" in daemon.log()

    # Where the scheduler would call it, the node serves (an unknown instance is NOT_FOUND).
    client = WorkloadClient.connect(join["held"])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await client.signal("nothing-here", na.WorkloadSignalSignal.STOP, timeout=10)
        assert refusal.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        await client.close()


def test_join_retries_every_interval_while_the_scheduler_is_down_then_up(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess
) -> None:
    daemon = daemon_factory(*agent_args(scheduler, "--orka-join-attempts", "21"))
    time.sleep(3 * INTERVAL)  # a few attempts find nobody
    scheduler.start("--refuse-joins", "2")  # up, and refusing the first two
    joined = scheduler.wait_for(lambda e: e["event"] == "join" and e["code"] == "OK")
    attempts = [e["t"] for e in scheduler.events("join")]
    assert len(attempts) == 3
    assert_spaced(attempts)
    failed = log_times(daemon, r"cannot join the orka scheduler .*\(attempt \d+ of 21\)")
    assert len(failed) >= 4  # the ones that found it down, and the two refusals
    assert_spaced(failed)
    assert joined["t"] - failed[-1] <= INTERVAL + SLACK


def test_exits_non_zero_saying_why_after_three_failed_joins(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess
) -> None:
    """3 failed attempts by default, as orka's agent counts its lifecycle_retries (3)."""
    daemon = daemon_factory(*agent_args(scheduler))
    assert wait_exit(daemon, timeout=20) == 1
    failed = log_times(daemon, r"cannot join the orka scheduler .*\(attempt \d of 3\)")
    assert len(failed) == 3
    assert_spaced(failed)
    message = f"cannot join the orka scheduler at {scheduler.address}: 3 attempts over 0.6 s failed"
    assert message in daemon.log()
    assert "auraed stopped" in daemon.log()


async def test_keeps_serving_and_joins_later_when_so_configured(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess
) -> None:
    daemon = daemon_factory(
        *agent_args(scheduler, "--orka-join-attempts", "2", "--orka-join-failure", "serve")
    )
    failed = r"cannot join the orka scheduler at "
    deadline = time.monotonic() + 10
    while len(log_times(daemon, failed)) < 4:  # the 2 at start, then 2 in the background
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    assert "serving locally, and trying to join" in daemon.log()
    assert len(log_times(daemon, r"\(attempt \d of 2\)")) == 2
    # The interval is kept between all of them, the first in the background too.
    assert_spaced(log_times(daemon, failed)[:4])
    assert daemon.process is not None and daemon.process.poll() is None
    async with daemon.client() as client:  # the aurae API still serves
        request = discovery.DiscoveryServiceDiscoverRequest()
        reply = await client.call("aurae.discovery.v0.DiscoveryService", "Discover", request)
        assert reply.healthy
    scheduler.start()
    joined = scheduler.wait_for(lambda e: e["event"] == "join", timeout=10)
    assert joined["code"] == "OK"
    scheduler.wait_for(lambda e: e["event"] == "status")


def test_joins_over_tls_checking_the_schedulers_certificate(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess, tmp_path: Path
) -> None:
    # The scheduler's own CA and certificate, for localhost only (as orka's makes itself).
    ca = create_ca("orka scheduler CA")
    crt, key = write_pem_files(tmp_path, "scheduler", *issue_server_cert(ca, "localhost", [], []))
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "scheduler-ca.crt").write_bytes(certificate_pem(ca.cert))
    scheduler.start("--tls-cert", str(crt), "--tls-key", str(key))

    # The CA named relative to the config file, read beside it.
    config = tmp_path / "orka.toml"
    config.write_text(
        'orka_scheduler_ca = "pki/scheduler-ca.crt"\norka_scheduler_server_name = "localhost"\n'
    )
    daemon = daemon_factory(*agent_args(scheduler), "--config", str(config))
    join = scheduler.wait_for(lambda e: e["event"] == "join")
    assert join["code"] == "OK"
    scheduler.wait_for(lambda e: e["event"] == "status" and e["id"] == join["id"])
    assert daemon.stop() == 0
    scheduler.wait_for(lambda e: e["event"] == "leave")

    # Checked against the address's host (127.0.0.1), which the certificate does not name: no
    # handshake, no join, and the daemon exits saying so.
    seen = len(scheduler.events())
    refused = daemon_factory(
        *agent_args(scheduler, "--orka-join-attempts", "1"),
        "--orka-scheduler-ca", str(tmp_path / "pki" / "scheduler-ca.crt"),
    )  # fmt: skip
    assert wait_exit(refused, timeout=20) == 1
    assert "cannot join the orka scheduler" in refused.log() and "UNAVAILABLE" in refused.log()
    assert "does not name 127.0.0.1: set orka_scheduler_server_name" in refused.log()
    assert [e for e in scheduler.events()[seen:] if e["event"] == "join"] == []


def test_each_tls_choice_of_orkas_scheduler_and_what_the_node_is_told_to_set(
    daemon_factory: DaemonFactory, scheduler: SchedulerProcess, tmp_path: Path
) -> None:
    """orka's scheduler serves TLS by default, with a self-signed certificate for localhost that
    it makes itself; plain with --no-tls. A node set the other way says what to set."""
    crt, key = orka_scheduler_certificate(tmp_path / "orka")
    scheduler.start("--tls-cert", str(crt), "--tls-key", str(key))
    plain = daemon_factory(*agent_args(scheduler, "--orka-join-attempts", "1"))
    assert wait_exit(plain, timeout=20) == 1
    assert "perhaps the scheduler serves TLS, as orka's does unless started with --no-tls: set " \
        "orka_scheduler_ca" in plain.log()  # fmt: skip
    assert scheduler.events("join") == []

    # Its own certificate is what the node trusts, checked against the name it has.
    trusting = daemon_factory(
        *agent_args(scheduler),
        "--orka-scheduler-ca", str(crt), "--orka-scheduler-server-name", "localhost",
    )  # fmt: skip
    join = scheduler.wait_for(lambda e: e["event"] == "join")
    assert join["code"] == "OK"
    scheduler.wait_for(lambda e: e["event"] == "status" and e["id"] == join["id"])
    assert trusting.stop() == 0

    scheduler.stop()
    scheduler.start()  # as orka's with --no-tls
    seen = len(scheduler.events())
    speaking_tls = daemon_factory(
        *agent_args(scheduler, "--orka-join-attempts", "1"), "--orka-scheduler-ca", str(crt)
    )
    assert wait_exit(speaking_tls, timeout=20) == 1
    assert "the scheduler serves no TLS, as orka's started with --no-tls: leave orka_scheduler_ca unset" in (
        speaking_tls.log()
    )
    assert [e for e in scheduler.events()[seen:] if e["event"] == "join"] == []
