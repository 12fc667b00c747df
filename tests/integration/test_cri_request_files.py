"""Attacks through the files a CreateContainer names, and the isolation an empty security context
gets (issue 33, points 4 and 5), on real runc containers of cell pods through the kubelet's socket.

* A Localhost seccomp profile that is a FIFO: refused at once, and eight of them at a time (more
  than the loop's default pool of six threads) hold up no honest CreateContainer nor Version.
* A profile that is a directory, /dev/zero, or larger than ``cri_profile_max_kib``: refused, the
  device unopened and the large file unread.
* A log path that is a FIFO: refused at CreateContainer; a log replaced by one: ReopenContainerLog
  refuses it at once.
* An unprivileged container with empty masked and read-only path lists: masked /proc and /sys
  files and a read-only /proc/sys (empty lists would mean procMount Unmasked, which only a pod
  with its own user namespace may have); a privileged container keeps none.

Each FIFO test releases, at its end, whatever open may still wait on its FIFO (old code did), so
that the daemon stops cleanly whatever the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.api.runtime import v1 as cri
from tests.conftest import DaemonFactory
from tests.integration.test_cri_containers import RUNNING, TOP, Node, cri_error, leftover_cgroups
from tests.integration.test_cri_containers import mirror as busybox_mirror
from tests.support.cni import cni_network
from tests.support.cri import cri_client, mirrors_config, pod_config, pull_image, run_pod

mirror = busybox_mirror  # the registry fixture, used by name

PROFILE_MAX_KIB = 4
FILE_TIMEOUT = 5.0
QUICK = 5.0  # seconds within which a refusal must come: no wait on a FIFO, no read of a device
FIFO_CALLS = 8  # more than the loop's default pool (min(32, cores + 4): 6 on 2 cores)
ALLOW_ALL = {"defaultAction": "SCMP_ACT_ALLOW"}
Profile = cri.SecurityProfileProfileType


@pytest.fixture
async def node(daemon_factory: DaemonFactory, mirror: Any, tmp_path: Path) -> AsyncIterator[Node]:
    """test_cri_containers' node, with a small profile limit and file deadline."""
    settings = f"cri_profile_max_kib = {PROFILE_MAX_KIB}\ncri_file_timeout = {FILE_TIMEOUT}\n"
    with cni_network(tmp_path) as network:
        network.write(network.conflist())
        daemon = daemon_factory(
            "--cni-conf-dir", str(network.conf_dir), config_text=settings + mirrors_config(mirror)
        )
        found = Node(daemon, network, cri_client(daemon), "", tmp_path / "logs")
        try:
            found.image_id = await pull_image(found.client, "registry.k8s.io/e2e-test-images/busybox:1.29-2")
            yield found
            for pod_id in await found.pod_ids():
                await found.stop_pod(pod_id)
                await found.remove_pod(pod_id)
            assert await found.containers() == []
        finally:
            await found.client.close()
        assert leftover_cgroups(daemon) == []


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path``; at the end every open still waiting on it is let through (an open for
    reading waits for a writer and the other way round: old code did wait) and it is removed."""
    os.mkfifo(path)
    try:
        yield path
    finally:
        for _ in range(64):  # a writer's open lets every waiting reader through
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                break  # no reader left
            time.sleep(0.05)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # lets waiting writers through
        time.sleep(0.2)
        os.close(reader)
        path.unlink()


def localhost(path: Path | str) -> cri.LinuxContainerConfig:
    profile = cri.SecurityProfile(profile_type=Profile.Localhost, localhost_ref=str(path))
    return cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(seccomp=profile))


async def refusal(
    node: Node, pod_id: str, config: cri.ContainerConfig, timeout: float = 30
) -> tuple[Any, float]:
    """The error CreateContainer answers with, and how long it took."""
    began = time.monotonic()
    request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
    error = await cri_error(node.call("CreateContainer", request, timeout))
    return error, time.monotonic() - began


# -- seccomp profiles ---------------------------------------------------------------------------


async def test_a_fifo_profile_is_refused_at_once_and_holds_up_no_one(node: Node, tmp_path: Path) -> None:
    pod_id = await node.run_pod("fifo")
    with fifo(tmp_path / "profile.fifo") as path:
        attacks = [
            asyncio.ensure_future(refusal(node, pod_id, node.config(f"fifo{i}", TOP, linux=localhost(path))))
            for i in range(FIFO_CALLS)
        ]
        await asyncio.sleep(0.5)  # the attacks are in the daemon first
        version = await node.call("Version", cri.VersionRequest(), timeout=10)
        request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=node.config("honest", TOP))
        honest = (await node.call("CreateContainer", request, timeout=30)).container_id
        outcomes = await asyncio.gather(*attacks)
    assert version.runtime_name
    for error, took in outcomes:
        assert error.code == "INVALID_ARGUMENT", error
        assert "is a FIFO, not a regular file" in error.message and "seccomp" in error.message, error
        assert took < QUICK, took
    await node.start(honest)
    await node.wait_state(honest, RUNNING)


async def test_profiles_that_are_no_regular_file_or_too_large_are_refused_unread(
    node: Node, tmp_path: Path
) -> None:
    pod_id = await node.run_pod("profiles")
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:
        file.truncate(1 << 30)  # sparse: 1 GiB that reading would take seconds and memory
    too_large = tmp_path / "too-large.json"
    too_large.write_text(json.dumps(ALLOW_ALL) + " " * (PROFILE_MAX_KIB * 1024))
    cases = {
        str(tmp_path): "is a directory, not a regular file",
        "/dev/zero": "is a character device, not a regular file",
        str(huge): f"holds {1 << 30} bytes, more than the {PROFILE_MAX_KIB * 1024} allowed",
        str(too_large): f"more than the {PROFILE_MAX_KIB * 1024} allowed",
    }
    for index, (path, problem) in enumerate(cases.items()):
        error, took = await refusal(node, pod_id, node.config(f"bad{index}", TOP, linux=localhost(path)))
        assert error.code == "INVALID_ARGUMENT" and problem in error.message, (path, error)
        assert error.message.startswith("config.linux.security_context.seccomp.localhost_ref: "), error
        assert took < QUICK, (path, took)
    # A link to a regular file is followed, as containerd follows it (the kubelet's seccomp
    # directory is often links), and a profile under the limit is used.
    fitting = tmp_path / "fitting.json"
    fitting.write_text(json.dumps(ALLOW_ALL) + " " * (PROFILE_MAX_KIB * 1024 // 2))
    linked = tmp_path / "linked.json"
    linked.symlink_to(fitting)
    container = await node.run(pod_id, node.config("fitting", TOP, linux=localhost(linked)))
    await node.wait_state(container, RUNNING)
    assert b"2" in (await node.exec_sync(container, ["grep", "Seccomp:", "/proc/self/status"])).stdout


# -- log paths ----------------------------------------------------------------------------------


async def test_a_fifo_log_path_is_refused_at_create(node: Node, tmp_path: Path) -> None:
    pod_id = await node.run_pod("fifolog", log_directory=True)
    with fifo(node.log_root / "fifolog" / "trap.log"):
        config = node.config("trap", TOP)
        config.log_path = "trap.log"
        error, took = await refusal(node, pod_id, config)
    assert error.code == "INVALID_ARGUMENT", error
    assert error.message.startswith("config.log_path: ") and "is a FIFO, not a regular file" in error.message
    assert took < QUICK, took
    assert await node.containers(pod_sandbox_id=pod_id) == []


async def test_a_log_replaced_by_a_fifo_is_not_reopened(node: Node) -> None:
    """A log collector with the log directory as a writable hostPath swaps the log for a FIFO:
    ReopenContainerLog refuses at once rather than wait for a reader forever."""
    pod_id = await node.run_pod("swapped", log_directory=True)
    container = await node.run(
        pod_id, node.config("talker", ["sh", "-c", "while true; do echo hi; sleep 0.2; done"], log=True)
    )
    await node.wait_state(container, RUNNING)
    log_path = node.log_root / "swapped" / "talker.log"
    log_path.rename(log_path.with_suffix(".old"))
    with fifo(log_path):
        began = time.monotonic()
        request = cri.ReopenContainerLogRequest(container_id=container)
        error = await cri_error(node.call("ReopenContainerLog", request, 30))
        took = time.monotonic() - began
    assert error.code == "FAILED_PRECONDITION" and "is a FIFO, not a regular file" in error.message, error
    assert took < QUICK, took
    # A regular file there again is reopened and written.
    request = cri.ReopenContainerLogRequest(container_id=container)
    await node.call("ReopenContainerLog", request)
    deadline = time.monotonic() + 30
    while not (log_path.exists() and "hi" in log_path.read_text()):
        assert time.monotonic() < deadline, "the reopened log was never written"
        await asyncio.sleep(0.2)


# -- masked and read-only paths -----------------------------------------------------------------


async def test_empty_masked_and_readonly_lists_are_the_defaults(node: Node) -> None:
    """critest and a kubelet send the lists; a client that sends none (crictl with a bare config)
    gets the defaults, not a container that reads the host's timers and keys and writes
    /proc/sys. A privileged container keeps none, as in containerd."""
    pod_id = await node.run_pod("masked")
    plain = cri.LinuxContainerSecurityContext(masked_paths=[], readonly_paths=[])
    container = await node.run(
        pod_id, node.config("plain", TOP, linux=cri.LinuxContainerConfig(security_context=plain))
    )
    await node.wait_state(container, RUNNING)
    for masked in ("/proc/timer_list", "/proc/keys"):
        read = await node.exec_sync(container, ["cat", masked])
        assert (read.exit_code, read.stdout) == (0, b""), (masked, read)
    listed = await node.exec_sync(container, ["ls", "-A", "/sys/firmware"])
    assert (listed.exit_code, listed.stdout) == (0, b""), listed
    written = await node.exec_sync(container, ["sh", "-c", "echo attacker > /proc/sys/kernel/domainname"])
    assert written.exit_code != 0 and b"Read-only file system" in written.stderr, written

    privileged_pod = pod_config("privileged", namespace="critest")
    privileged_pod.linux = cri.LinuxPodSandboxConfig(
        security_context=cri.LinuxSandboxSecurityContext(privileged=True)
    )
    privileged_id = await run_pod(node.client, privileged_pod)
    everything = cri.LinuxContainerSecurityContext(privileged=True)
    root = await node.run(
        privileged_id, node.config("root", TOP, linux=cri.LinuxContainerConfig(security_context=everything))
    )
    await node.wait_state(root, RUNNING)
    timers = await node.exec_sync(root, ["cat", "/proc/timer_list"])
    assert timers.exit_code == 0 and b"Timer List" in timers.stdout, timers.stderr
