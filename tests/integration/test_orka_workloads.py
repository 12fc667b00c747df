"""orka's WorkloadService on a real node: images pulled through a mirror, real runc containers,
their status streams, Signal STOP and KILL, bad inputs, authorization, and the metrics endpoint
scraped and parsed with prometheus-client's parser."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from auraed.api import node_agent as na
from auraed.client import ClientError
from auraed.orka.model import MIB, container_name
from auraed.pki import PkiPaths, ensure_dev_pki
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.containers_helpers import logs, status
from tests.integration.test_orka_agent import agent_args
from tests.support.cri import mirrors_config, publish
from tests.support.images import BuiltImage, ImageConfig, build_busybox_layout
from tests.support.orka import SchedulerProcess, WorkloadClient
from tests.support.registry import LocalRegistry, free_port

WAITING, RUNNING, TERMINATED = (na.WorkloadStatusStatusStatusCode(c) for c in range(3))
STOP, KILL = na.WorkloadSignalSignal.STOP, na.WorkloadSignalSignal.KILL
# Echoes its environment, spins (so its CPU use shows), and ends with 7 on its StopSignal.
WORKER = "docker.io/library/orka-worker:1"
WORKER_CONFIG = ImageConfig(
    cmd=["sh", "-c", 'trap "exit 7" USR1; echo "worker $GREETING"; while :; do :; done'],
    stop_signal="SIGUSR1",
)
# Ignores its stop signal (SIGTERM, as PID 1 of its namespace without a handler).
STUBBORN = "docker.io/library/orka-stubborn:1"
STUBBORN_CONFIG = ImageConfig(cmd=["sh", "-c", "while :; do sleep 0.1; done"])
ONESHOT = "docker.io/library/orka-oneshot:1"
ONESHOT_CONFIG = ImageConfig(cmd=["sh", "-c", "echo done; exit 3"])
GRACE = 2.0  # the daemons' stop grace period (tests/conftest.py)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A registry serving the workloads' images as docker.io's mirror."""
    root = tmp_path_factory.mktemp("orka-images")
    with LocalRegistry() as found:
        for name, config in ((WORKER, WORKER_CONFIG), (STUBBORN, STUBBORN_CONFIG), (ONESHOT, ONESHOT_CONFIG)):
            image: BuiltImage = build_busybox_layout(root / name.rsplit("/", 1)[1].replace(":", "-"), config)
            publish(image, found, name)
        yield found


@pytest.fixture(scope="module")
def scheduler_pki(pki: PkiPaths) -> PkiPaths:
    """The test PKI with a certificate for the scheduler's identity, and one for somebody else."""
    return ensure_dev_pki(pki.ca_crt.parent, client_names=(*pki.clients, "orka-scheduler"))


@dataclass
class Node:
    daemon: DaemonProcess
    scheduler: SchedulerProcess
    client: WorkloadClient
    workload_address: str
    metrics_url: str

    def connect(self, identity: str) -> WorkloadClient:
        pki = self.daemon.pki
        crt, key = pki.clients[identity]
        return WorkloadClient.connect(self.workload_address, pki.ca_crt, crt, key)


@pytest.fixture
async def node(
    daemon_factory: DaemonFactory, registry: LocalRegistry, scheduler_pki: PkiPaths, tmp_path: Path
) -> AsyncIterator[Node]:
    scheduler = SchedulerProcess(free_port(), tmp_path / "scheduler-events.jsonl")
    scheduler.start()
    port, metrics_port = free_port(), free_port()
    daemon = daemon_factory(
        *agent_args(scheduler, port=port),
        "--orka-workload-status-interval", "0.2",
        "--metrics-listen", f"127.0.0.1:{metrics_port}",
        config_text=mirrors_config(registry, ("docker.io",)),
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    crt, key = scheduler_pki.clients["orka-scheduler"]
    client = WorkloadClient.connect(address, scheduler_pki.ca_crt, crt, key)
    found = Node(daemon, scheduler, client, address, f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        yield found
    finally:
        await client.close()
        scheduler.stop()


def workload(instance_id: str, image: str, **fields: object) -> na.Workload:
    return na.Workload(instance_id=instance_id, image=image, **fields)  # type: ignore[arg-type]


def state(reply: na.WorkloadStatus) -> tuple[na.WorkloadStatusStatusStatusCode, str]:
    assert reply.status is not None
    return na.WorkloadStatusStatusStatusCode(reply.status.code), reply.status.message or ""


def usage(reply: na.WorkloadStatus) -> na.WorkloadStatusResources:
    assert reply.resource_usage is not None
    return reply.resource_usage


async def statuses_until(
    stream: AsyncIterator[na.WorkloadStatus], code: na.WorkloadStatusStatusStatusCode, count: int = 1
) -> list[na.WorkloadStatus]:
    """What the stream sends until it has sent ``count`` statuses with ``code``."""
    seen: list[na.WorkloadStatus] = []
    async for reply in stream:
        seen.append(reply)
        if sum(1 for s in seen if state(s)[0] == code) >= count:
            return seen
    raise AssertionError(f"the stream ended before {count} x {code.name}: {seen}")


async def refusal(call: Awaitable[object] | AsyncIterator[object]) -> grpc.aio.AioRpcError:
    """The error of a call that must fail (a stream's: at its first message)."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        if isinstance(call, AsyncIterator):
            await anext(call)
        else:
            await call
    return error.value


def cgroup_value(daemon: DaemonProcess, container_id: str, name: str) -> str:
    found = list(Path("/sys/fs/cgroup").glob(f"*/{daemon.cgroup_base}/_containers/{container_id}/{name}"))
    assert found, f"no {name} for {container_id}"
    return found[0].read_text().strip()


def http_get(url: str, method: str = "GET") -> tuple[int, str, str]:
    """The status, content type and body of a request to ``url``."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], ""


async def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample the endpoint serves, by name, parsed by prometheus-client's own parser."""
    code, content_type, text = await asyncio.to_thread(http_get, url)
    assert code == 200 and content_type.startswith("text/plain; version="), (code, content_type)
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for found, v in samples.get(name, []) if all(found.get(k) == w for k, w in labels.items()))


async def test_create_runs_a_container_with_limits_and_stop_removes_it(node: Node) -> None:
    daemon = node.daemon
    limits = na.WorkloadResources(cpu=200, memory=64)
    stream = node.client.create(
        workload("web-1", WORKER, environment=["GREETING=hi"], resource_limits=limits)
    )
    seen = await statuses_until(stream, RUNNING, count=4)
    assert state(seen[0]) == (WAITING, f"pulling {WORKER}") and seen[0].instance_id == "web-1"
    running = [s for s in seen if state(s)[0] == RUNNING]
    # Its CPU in millicores over each interval: spinning, held to its 200 by the CFS quota (whose
    # 100 ms periods do not line up with the intervals, hence the margin).
    cpus = [usage(s).cpu for s in running]
    assert all(0 <= cpu <= 1000 * (os.cpu_count() or 1) for cpu in cpus), cpus
    assert all(100 <= cpu <= 320 for cpu in cpus[1:]), cpus
    assert all(0 < usage(s).memory < 64 for s in running)

    async with daemon.client() as aurae:
        container = await status(aurae, container_name("web-1"))
        assert dict(container.labels) == {"orka.instance-id": "web-1"}
        assert container.image == WORKER
        assert cgroup_value(daemon, container.id, "cpu.cfs_quota_us") == "20000"
        assert cgroup_value(daemon, container.id, "cpu.cfs_period_us") == "100000"
        assert int(cgroup_value(daemon, container.id, "memory.limit_in_bytes")) == 64 * MIB
        assert await logs(aurae, container.name) == ["worker hi"]

        # An instance that exists: ALREADY_EXISTS.
        error = await refusal(node.client.create(workload("web-1", WORKER)))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS

        samples = await scrape(node.metrics_url)
        assert value(samples, "auraed_containers", state="running") == 1
        assert value(samples, "auraed_image_pulls_total", result="ok") == 1
        assert value(samples, "auraed_image_pull_bytes_total") > 1_000_000  # busybox's layer

        # STOP: its StopSignal (SIGUSR1, on which it exits 7), then it is removed.
        began = time.monotonic()
        await node.client.signal("web-1", STOP)
        assert time.monotonic() - began < GRACE
        rest = [reply async for reply in stream]
        assert state(rest[-1]) == (TERMINATED, "Signal STOP: exited with code 7")
        with pytest.raises(ClientError, match="NOT_FOUND"):
            await status(aurae, container.name)

    await node.client.signal("web-1", STOP)  # a repeated signal: a success
    await node.client.signal("web-1", KILL)
    error = await refusal(node.client.signal("never-made", STOP))
    assert error.code() is grpc.StatusCode.NOT_FOUND and "never-made" in (error.details() or "")

    samples = await scrape(node.metrics_url)
    rpc = "grpc_server_handled_total"
    assert (
        value(samples, rpc, grpc_service="node_agent.WorkloadService", grpc_method="Signal", grpc_code="OK")
        == 3
    )
    assert value(samples, rpc, grpc_method="Signal", grpc_code="NOT_FOUND") == 1
    assert value(samples, rpc, grpc_method="Create", grpc_code="OK") == 1
    assert value(samples, rpc, grpc_method="Create", grpc_code="ALREADY_EXISTS") == 1
    assert value(samples, "grpc_server_handling_seconds_count", grpc_method="Create") == 2
    assert value(samples, "auraed_containers", state="running") == 0
    # The node's figures: NodeStatus reports the same ones.
    sent = node.scheduler.wait_for(lambda e: e["event"] == "status")
    assert value(samples, "auraed_node_memory_total_bytes") == sent["total"]
    assert value(samples, "auraed_node_cpu_seconds_total", mode="busy") > 0


async def test_stop_waits_the_grace_period_then_kill_is_at_once(node: Node) -> None:
    stubborn = node.client.create(workload("stubborn", STUBBORN))
    quick = node.client.create(workload("quick", STUBBORN))
    await statuses_until(stubborn, RUNNING)
    await statuses_until(quick, RUNNING)

    began = time.monotonic()
    await node.client.signal("stubborn", STOP)  # SIGTERM is ignored: SIGKILL after the grace
    took = time.monotonic() - began
    assert GRACE <= took < GRACE + 3, took
    final = [reply async for reply in stubborn][-1]
    assert state(final) == (TERMINATED, "Signal STOP: killed by signal 9 (SIGKILL)")

    began = time.monotonic()
    await node.client.signal("quick", KILL)
    assert time.monotonic() - began < 1.5
    final = [reply async for reply in quick][-1]
    assert state(final) == (TERMINATED, "Signal KILL: killed by signal 9 (SIGKILL)")


async def test_exit_code_pull_failure_bad_inputs_and_refused_identities(node: Node) -> None:
    replies = [reply async for reply in node.client.create(workload("once", ONESHOT))]
    assert state(replies[-1]) == (TERMINATED, "exited with code 3")  # the last: the stream ended
    assert TERMINATED not in [state(r)[0] for r in replies[:-1]]

    replies = [reply async for reply in node.client.create(workload("absent", "docker.io/library/absent:1"))]
    code, message = state(replies[-1])
    assert code == TERMINATED and "docker.io/library/absent:1" in message and "not found" in message, message
    await node.client.signal("absent", STOP)  # what never ran is removed as well

    bad = [
        (workload("x", ""), "image: is required"),
        (workload("", WORKER), "instance_id: is required"),
        (workload("x", "Not A Reference!"), "image:"),
        (workload("x", WORKER, environment=["GREETING"]), "environment[0]: 'GREETING' is not KEY=VALUE"),
        (workload("x", WORKER, resource_limits=na.WorkloadResources(disk=10)), "resource_limits.disk"),
        (workload("x", WORKER, resource_limits=na.WorkloadResources(memory=1)), "resource_limits.memory"),
        (workload("x", WORKER, resource_limits=na.WorkloadResources(cpu=0)), "resource_limits.cpu"),
    ]
    for request, message in bad:
        error = await refusal(node.client.create(request))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, request
        assert message in (error.details() or ""), (request, error.details())

    intruder = node.connect("intruder")
    try:
        error = await refusal(intruder.signal("once", KILL))
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await intruder.close()
    plain = WorkloadClient.connect(node.workload_address)  # no TLS: no handshake, no call
    try:
        error = await refusal(plain.signal("once", KILL))
        assert error.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await plain.close()

    # After a restart the workload is still known: its Signal removes it, and again succeeds.
    node.daemon.stop()
    node.daemon.start()
    await node.client.signal("once", STOP)
    await node.client.signal("once", STOP)
    async with node.daemon.client() as aurae:
        with pytest.raises(ClientError, match="NOT_FOUND"):
            await status(aurae, container_name("once"))
    error = await refusal(node.client.signal("absent-forever", KILL))
    assert error.code() is grpc.StatusCode.NOT_FOUND


async def test_plain_workload_service_is_warned_about(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    scheduler = SchedulerProcess(free_port(), tmp_path / "events.jsonl")
    scheduler.start()
    try:
        port = free_port()
        daemon = daemon_factory(*agent_args(scheduler, "--orka-plaintext", port=port))
        assert "served without TLS, so without authorization" in daemon.log()
        client = WorkloadClient.connect(f"127.0.0.1:{port}")
        try:
            error = await refusal(client.signal("nothing", STOP))
            assert error.code() is grpc.StatusCode.NOT_FOUND  # served, to anybody
        finally:
            await client.close()
    finally:
        scheduler.stop()


async def test_the_metrics_endpoint_answers_only_its_path(node: Node) -> None:
    base = node.metrics_url.removesuffix("/metrics")
    assert (await asyncio.to_thread(http_get, f"{base}/other"))[0] == 404
    assert (await asyncio.to_thread(http_get, node.metrics_url, "POST"))[0] == 405
    head = await asyncio.to_thread(http_get, node.metrics_url, "HEAD")
    assert head[0] == 200 and head[2] == ""
    # A scraper that connects and says nothing is let go, and the endpoint serves on.
    _, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
    writer.close()
    samples = await scrape(node.metrics_url)
    assert value(samples, "auraed_cells", state="ready") == 0
    assert ("auraed_pods" in samples) and ("auraed_vms" in samples)
