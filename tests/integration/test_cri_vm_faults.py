"""Faults of ``vm`` pods with real QEMU guests (TCG here): a guest that never becomes ready, and a
guest that stops answering under its pod.

A guest not serving within the daemon's ``guest_ready_timeout`` fails its RunPodSandbox with
DEADLINE_EXCEEDED, its console's tail in the message, and leaves nothing: as containerd and Kata
do, a failed RunPodSandbox is undone (no process, tap, namespace, CNI lease, cgroup, VM or share;
no pod listed). A guest whose QEMU is frozen (SIGSTOP) answers no call: those that need it end
UNAVAILABLE naming its VM once the host's ping to it goes unanswered (``guest_keepalive_time`` +
``guest_keepalive_timeout``), well before the caller's deadline; what the host knows of the pod
answers at once; the guest is served again once it runs again (SIGCONT); and a pod whose guest
is frozen is stopped, or removed with no stop first, all the same, leaving nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.vms import v0 as vms
from auraed.api.runtime import v1 as cri
from auraed.client import ClientError
from auraed.cri.setup import GUEST_CONTAINERS_DIR
from auraed.pki import PkiPaths
from tests.conftest import DaemonFactory
from tests.integration.test_cri_containers import EXITED, RUNNING, Node, cri_error
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.integration.test_cri_vm_containers import VmPod
from tests.integration.test_cri_vm_pods import vm_pod
from tests.integration.vm_pods_helpers import VMS, cgroups_of, leftovers_of_pod, qemu_of, vm_daemon
from tests.support.cni import cni_network
from tests.support.cri import BUSYBOX_IMAGE, RUNTIME_SERVICE, cri_client, mirrors_config, pull_image, run_pod
from tests.support.registry import LocalRegistry

mirror = busybox_mirror  # the registry fixture, used by name

BOOT_TIMEOUT = 300.0
READY_TIMEOUT = 3.0
"""The never-ready daemon's guest_ready_timeout: far less than a guest takes to serve under TCG."""
KEEPALIVE_TIME = 5.0
KEEPALIVE_TIMEOUT = 3.0
"""The frozen guest's daemon's guest_keepalive_time and guest_keepalive_timeout."""
UNANSWERED = KEEPALIVE_TIME + KEEPALIVE_TIMEOUT
"""Seconds within which a call to a guest that stopped answering ends (its ping unanswered)."""
CONNECT = 20.0
"""Seconds a channel's connection attempt may take (auraed.wire.channel): a call made once the
connection to the frozen guest was dropped ends when its new connection cannot be made."""
SLACK = 3.0
RECONNECT = KEEPALIVE_TIMEOUT + 2 * SLACK
"""Seconds the thawed guest may take to be served again: the host's connection attempt in flight
ends by its TCP user timeout (grpc's is the keepalive timeout), the next one connects."""
VM_STOP = 2.0
"""Seconds a frozen QEMU takes to end: it is killed at once (it would answer no QMP quit)."""
CALLER_DEADLINE = 60.0
"""The deadline the test gives each call: every one must be answered well before it."""


async def test_a_guest_never_ready_fails_its_run_and_leaves_nothing(
    daemon_factory: DaemonFactory, guest_image: Path, pki: PkiPaths, tmp_path: Path
) -> None:
    with cni_network(tmp_path) as network:
        # Booted cold: a template would not be ready within the timeout either (it would be tried
        # first, then the pod boot cold all the same).
        daemon = vm_daemon(
            daemon_factory, network, guest_image, pki, "--guest-ready-timeout", str(READY_TIMEOUT),
            "--cri-vm-boot", "cold",
        )  # fmt: skip
        client = cri_client(daemon)
        try:
            started = time.monotonic()
            failed = await cri_error(
                asyncio.wait_for(run_pod(client, vm_pod("never-ready"), "vm"), BOOT_TIMEOUT)
            )
            took = time.monotonic() - started
            print(f"RunPodSandbox failed after {took:.1f} s: {failed.code}: {failed.message[:300]}")
            assert failed.code == "DEADLINE_EXCEEDED", failed
            head, _, tail = failed.message.partition("Console tail:\n")
            found = re.match(
                r"pod sandbox [0-9a-f]{13}: its guest did not boot: guest (pod-[0-9a-f]{16}) ", head
            )
            assert found is not None, head
            assert f"was not serving within {READY_TIMEOUT:g} s, the guest_ready_timeout" in head
            assert tail.strip(), failed.message  # what the guest printed before it was stopped
            assert took < READY_TIMEOUT + 30  # QEMU's start, the wait, the undo

            pod_id = pod_id_of(daemon.log(), found.group(1))
            assert leftovers_of_pod(daemon, network, pod_id) == {}
            assert network.allocations() == {}
            listed = await client.call(RUNTIME_SERVICE, "ListPodSandbox", cri.ListPodSandboxRequest())
            assert listed.items == []
            async with daemon.client() as aurae:
                assert (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms == []
            pods_dir = daemon.root / "run" / "pods"
            assert not pods_dir.exists() or list(pods_dir.iterdir()) == []
            # The pod's share, its mount namespace's pin and the pins' own mount, all gone.
            shares_dir = daemon.root / "run" / "pod-shares"
            assert not shares_dir.exists()
            assert str(shares_dir) not in Path("/proc/self/mountinfo").read_text()
        finally:
            await client.close()


def pod_id_of(log: str, vm: str) -> str:
    """The id of the pod whose VM is ``vm``, from the daemon's log (a failed run returns none)."""
    prefix = vm.removeprefix("pod-")
    for word in re.findall(r"[0-9a-f]{64}", log):
        if word.startswith(prefix):
            return word
    raise AssertionError(f"no pod id for {vm} in the log")


@pytest.fixture
async def frozen_node(
    daemon_factory: DaemonFactory, mirror: LocalRegistry, guest_image: Path, pki: PkiPaths, tmp_path: Path
) -> AsyncIterator[Node]:
    """A vm daemon pinging its guests every KEEPALIVE_TIME s; every pod gone after the test."""
    with cni_network(tmp_path) as network:
        daemon = vm_daemon(
            daemon_factory, network, guest_image, pki,
            "--guest-keepalive-time", str(KEEPALIVE_TIME),
            "--guest-keepalive-timeout", str(KEEPALIVE_TIMEOUT),
            config_text=mirrors_config(mirror),
        )  # fmt: skip
        node = Node(daemon, network, cri_client(daemon), "", tmp_path / "logs")
        try:
            node.image_id = await pull_image(node.client, BUSYBOX_IMAGE)
            yield node
            pod_ids = await node.pod_ids()
            for pod_id in pod_ids:
                await node.stop_pod(pod_id)
                await node.remove_pod(pod_id)
            assert await node.containers() == []
            async with daemon.client() as aurae:
                assert (await aurae.call(VMS, "List", vms.VmServiceListRequest())).vms == []
            for pod_id in pod_ids:
                assert leftovers_of_pod(daemon, network, pod_id) == {}
        finally:
            await node.client.close()


@dataclass
class Outcome:
    seconds: float
    code: str  # "OK" or the status code
    message: str


async def timed(call: Awaitable[Any]) -> Outcome:
    started = time.monotonic()
    try:
        await call
    except ClientError as exc:
        return Outcome(time.monotonic() - started, exc.code, exc.message)
    return Outcome(time.monotonic() - started, "OK", "")


@dataclass
class FrozenPod:
    """A vm pod with a container sleeping in its guest, and its QEMU's processes to freeze."""

    node: Node
    pod_id: str
    config: cri.PodSandboxConfig
    sleeper: str
    vm: str
    pids: list[int]

    def call(self, method: str, request: Any) -> Awaitable[Any]:
        return self.node.call(method, request, CALLER_DEADLINE)

    def exec_sync(self, timeout: int) -> Awaitable[Any]:
        request = cri.ExecSyncRequest(container_id=self.sleeper, cmd=["true"], timeout=timeout)
        return self.call("ExecSync", request)


async def frozen_pod(node: Node, name: str) -> FrozenPod:
    config = vm_pod(name)
    logs = node.log_root / name
    logs.mkdir(parents=True, mode=0o777)
    config.log_directory = str(logs)
    pod_id = await asyncio.wait_for(run_pod(node.client, config, "vm"), BOOT_TIMEOUT)
    sleeper = await VmPod(node, pod_id, config, logs).run("sleeper", ["sleep", "3600"])
    vm = f"pod-{pod_id[:16]}"
    pids = qemu_of(vm)
    assert pids
    # What the leak checks look for is there while the pod lives (its cgroup holds the VM's).
    alive = leftovers_of_pod(node.daemon, node.network, pod_id)
    assert set(alive) == {"qemu", "virtiofsd", "pod dir", "namespace pins", "share", "vm run dir",
                          "cgroups", "cni leases", "veths"}, alive  # fmt: skip
    assert all((Path(cgroup) / "vmm").is_dir() for cgroup in cgroups_of(node.daemon, pod_id)), alive
    return FrozenPod(node, pod_id, config, sleeper, vm, pids)


async def test_a_frozen_guest_fails_the_calls_that_need_it_in_time(frozen_node: Node) -> None:
    pod = await frozen_pod(frozen_node, "frozen")
    await calls_to_a_frozen_guest(pod)
    await served_again_once_thawed(pod)
    await stopped_while_frozen(pod)
    await removed_while_frozen(await frozen_pod(frozen_node, "frozen-removed"))


async def calls_to_a_frozen_guest(pod: FrozenPod) -> None:
    """What needs the guest ends UNAVAILABLE naming its VM once its ping goes unanswered (an
    exec's own shorter timeout first, DEADLINE_EXCEEDED naming it); what the host knows of the pod
    answers at once; its stats are UNAVAILABLE as its calls are, a node's listing answers."""
    late = pod.node.config("late", ["sleep", "1"])
    create = cri.CreateContainerRequest(pod_sandbox_id=pod.pod_id, config=late, sandbox_config=pod.config)
    sleeper, pod_id = pod.sleeper, pod.pod_id
    with frozen(pod.pids):
        names = ("exec", "exec with a timeout", "exec past the ping", "create", "status", "pod status",
                 "container stats", "pod stats", "listed stats")  # fmt: skip
        outcomes = dict(zip(names, await asyncio.gather(
            timed(pod.exec_sync(0)),
            timed(pod.exec_sync(2)),
            timed(pod.exec_sync(int(CALLER_DEADLINE) - 10)),
            timed(pod.call("CreateContainer", create)),
            timed(pod.call("ContainerStatus", cri.ContainerStatusRequest(container_id=sleeper))),
            timed(pod.call("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id))),
            timed(pod.call("ContainerStats", cri.ContainerStatsRequest(container_id=sleeper))),
            timed(pod.call("PodSandboxStats", cri.PodSandboxStatsRequest(pod_sandbox_id=pod_id))),
            timed(pod.call("ListContainerStats", cri.ListContainerStatsRequest())),
        ), strict=True))  # fmt: skip
        # Once its connection was dropped: a call connects again, and cannot.
        outcomes["exec, reconnecting"] = await timed(pod.exec_sync(0))
    for name, outcome in outcomes.items():
        print(f"frozen guest: {name}: {outcome.seconds:.1f} s, {outcome.code} {outcome.message[:160]}")

    for name in ("exec", "exec past the ping", "create"):
        outcome = outcomes[name]
        assert outcome.code == "UNAVAILABLE" and f"guest {pod.vm}" in outcome.message, (name, outcome)
        assert outcome.seconds < UNANSWERED + SLACK, (name, outcome)
    reconnecting = outcomes["exec, reconnecting"]
    assert reconnecting.code == "UNAVAILABLE" and pod.vm in reconnecting.message, reconnecting
    assert reconnecting.seconds < CONNECT + SLACK, reconnecting
    timed_out = outcomes["exec with a timeout"]
    assert timed_out.code == "DEADLINE_EXCEEDED" and f"in guest VM {pod.vm}" in timed_out.message, timed_out
    assert timed_out.seconds < 2 + SLACK, timed_out
    for name in ("status", "pod status"):
        assert outcomes[name].code == "OK" and outcomes[name].seconds < SLACK, (name, outcomes[name])
    # The stats of a guest that does not answer are an error (as containerd's with Kata), but a
    # listing of the node's containers answers, without that guest's figures.
    for name in ("container stats", "pod stats"):
        outcome = outcomes[name]
        assert outcome.code == "UNAVAILABLE" and pod.vm in outcome.message, (name, outcome)
        assert outcome.seconds < UNANSWERED + SLACK, (name, outcome)
    listed = outcomes["listed stats"]
    assert listed.code == "OK" and listed.seconds < UNANSWERED + SLACK, listed


async def served_again_once_thawed(pod: FrozenPod) -> None:
    """Running again, the guest answers again once the host's channel has connected again (an
    attempt made while it was frozen ends by its TCP timeout, the ping's): the pod and its
    container carry on."""
    node = pod.node
    thawed = time.monotonic()
    while True:
        try:
            reply = await node.exec_sync(pod.sleeper, ["echo", "back"])
            break
        except ClientError as exc:
            assert exc.code == "UNAVAILABLE" and pod.vm in exc.message, exc
            assert time.monotonic() - thawed < RECONNECT, exc
            await asyncio.sleep(0.2)
    print(f"thawed guest: served again after {time.monotonic() - thawed:.1f} s")
    assert (reply.exit_code, reply.stdout) == (0, b"back\n")
    assert (await node.status(pod.sleeper)).state == RUNNING
    status = (
        await pod.call("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=pod.pod_id))
    ).status
    assert status.state == cri.PodSandboxState.SANDBOX_READY


async def stopped_while_frozen(pod: FrozenPod) -> None:
    """Frozen again, the pod is stopped all the same (its guest's QEMU ended, its containers with
    it: EXITED, their reason saying so), then removed, leaving nothing."""
    with frozen(pod.pids):
        stopped = await timed(
            pod.call("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod.pod_id))
        )
    print(f"frozen guest: stop pod: {stopped.seconds:.1f} s, {stopped.code} {stopped.message[:160]}")
    assert stopped.code == "OK", stopped
    assert stopped.seconds < UNANSWERED + VM_STOP + SLACK, stopped
    ended = await pod.node.wait_state(pod.sleeper, EXITED, CALLER_DEADLINE)
    assert "guest VM" in ended.reason or "guest VM" in ended.message, ended
    removed = await timed(
        pod.call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_id))
    )
    assert removed.code == "OK", removed
    assert qemu_of(pod.vm) == [] and leftovers_of_pod(pod.node.daemon, pod.node.network, pod.pod_id) == {}


async def removed_while_frozen(pod: FrozenPod) -> None:
    """A pod removed with no stop first (the CRI's Remove stops what runs) while its guest is
    frozen: removed all the same, leaving nothing."""
    with frozen(pod.pids):
        removed = await timed(
            pod.call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=pod.pod_id))
        )
    print(f"frozen guest: remove pod: {removed.seconds:.1f} s, {removed.code} {removed.message[:160]}")
    assert removed.code == "OK", removed
    assert removed.seconds < UNANSWERED + VM_STOP + SLACK, removed
    assert await pod.node.ids() == []
    assert qemu_of(pod.vm) == [] and leftovers_of_pod(pod.node.daemon, pod.node.network, pod.pod_id) == {}
    assert not (pod.node.daemon.root / "state" / GUEST_CONTAINERS_DIR / pod.sleeper).exists()


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """The processes ``pids`` stopped (SIGSTOP) for the block, continued after it if they live."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
