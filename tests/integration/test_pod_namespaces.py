"""Pinned pod namespaces (auraed.system.pod_namespaces) on this host, made inside a process that
has grpc loaded and a grpc.aio server running, as in the daemon: nothing may fork it.

Every test removes what it pinned, also when it fails (``pod_namespaces`` and ``pod_dir``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from auraed.containers.errors import ContainerError
from auraed.containers.pid_groups import GROUP_PREFIX, USERNS_GROUP, PidGroups
from auraed.errors import ErrorKind
from auraed.system.pod_namespaces import (
    INIT_RECORD,
    POD_INIT_NAME,
    NamespaceError,
    PodNamespaceSpec,
    create_pod_namespaces,
    remove_pod_namespaces,
)
from auraed.system.userns import IdMap
from tests.support.cni import pod_namespaces

SYSCTLS = {
    "net.ipv4.ip_unprivileged_port_start": "0",
    "net.ipv4.conf.lo.rp_filter": "2",
    "kernel.shm_rmid_forced": "1",
    "fs.mqueue.msg_max": "77",
}
REPORT = (
    "hostname; cat /proc/sys/net/ipv4/ip_unprivileged_port_start /proc/sys/net/ipv4/conf/lo/rp_filter "
    "/proc/sys/kernel/shm_rmid_forced /proc/sys/fs/mqueue/msg_max; ip -o link show"
)


@pytest.fixture
async def grpc_server(tmp_path: Path) -> AsyncIterator[grpc.aio.Server]:
    server = grpc.aio.server()
    server.add_insecure_port(f"unix:{tmp_path / 'grpc.sock'}")
    await server.start()
    try:
        yield server
    finally:
        await server.stop(None)


@pytest.fixture
def pod_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "aurae-pod"
    try:
        yield directory
    finally:
        remove_pod_namespaces(directory)


def host_values() -> list[str]:
    files = [f"/proc/sys/{name.replace('.', '/')}" for name in SYSCTLS]
    return [socket.gethostname(), *(Path(f).read_text().strip() for f in files)]


def members(pin: str, kind: str) -> list[int]:
    """The pids of every process (zombies too) in the namespace pinned at ``pin``."""
    inode = os.stat(pin).st_ino
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.stat(proc / "ns" / kind).st_ino == inode:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


async def test_network_ipc_uts_with_hostname_and_sysctls(grpc_server: grpc.aio.Server, pod_dir: Path) -> None:
    before = host_values()
    spec = PodNamespaceSpec(hostname="pod-one", sysctls=SYSCTLS)
    pinned = await asyncio.to_thread(create_pod_namespaces, pod_dir, spec)
    assert pinned.net and pinned.ipc and pinned.uts and pinned.pid is None and pinned.init_pid is None
    for kind, pin in (("net", pinned.net), ("ipc", pinned.ipc), ("uts", pinned.uts)):
        assert os.stat(pin).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino
        assert members(pin, kind) == []  # pinned, with no process kept alive
    report = subprocess.run(
        ["nsenter", f"--net={pinned.net}", f"--ipc={pinned.ipc}", f"--uts={pinned.uts}", "sh", "-c", REPORT],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert report[:5] == ["pod-one", "0", "2", "1", "77"]
    assert len(report) == 6 and report[5].startswith("1: lo: <LOOPBACK,UP,")  # lo alone, and up
    assert host_values() == before

    await asyncio.to_thread(remove_pod_namespaces, pod_dir)
    assert not pod_dir.exists()
    assert str(pod_dir) not in Path("/proc/self/mounts").read_text()
    remove_pod_namespaces(pod_dir)  # idempotent


async def test_the_loop_thread_keeps_its_namespaces(grpc_server: grpc.aio.Server, pod_dir: Path) -> None:
    own = {kind: os.readlink(f"/proc/thread-self/ns/{kind}") for kind in ("net", "ipc", "uts")}
    create_pod_namespaces(pod_dir, PodNamespaceSpec(hostname="other"))  # on the loop's thread itself
    assert {kind: os.readlink(f"/proc/thread-self/ns/{kind}") for kind in own} == own
    assert socket.gethostname() != "other"


async def test_a_shared_pid_namespace_has_an_init_that_reaps(
    grpc_server: grpc.aio.Server, pod_dir: Path
) -> None:
    pinned = await asyncio.to_thread(create_pod_namespaces, pod_dir, PodNamespaceSpec(pid=True))
    assert pinned.pid and pinned.init_pid
    assert Path(f"/proc/{pinned.init_pid}/cmdline").read_bytes().split(b"\0")[0] == POD_INIT_NAME.encode()
    # The init sits in the pod's other namespaces too, as a pause container would.
    assert members(pinned.net or "", "net") == [pinned.init_pid]
    joined = subprocess.run(
        ["nsenter", f"--pid={pinned.pid}", "sh", "-c", "echo $$; sleep 0.2 & true"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert joined.stdout.split() == ["2"]  # PID 1 is the init
    # The orphaned sleep went to the init, which reaps it: only the init stays, and no zombie.
    wait_for(lambda: members(pinned.pid or "", "pid") == [pinned.init_pid])


async def test_removal_ends_every_process_of_the_pid_namespace(
    grpc_server: grpc.aio.Server, pod_dir: Path
) -> None:
    pinned = await asyncio.to_thread(create_pod_namespaces, pod_dir, PodNamespaceSpec(pid=True))
    assert pinned.pid
    sleeper = subprocess.Popen(["nsenter", f"--pid={pinned.pid}", "sleep", "100"])
    try:
        wait_for(lambda: len(members(pinned.pid or "", "pid")) == 2)
        await asyncio.to_thread(remove_pod_namespaces, pod_dir)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # nsenter dies of what killed its child
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not os.path.exists(f"/proc/{pinned.init_pid}")  # killed and reaped by its parent, us
    assert not pod_dir.exists()


def test_an_init_started_by_another_process_is_stopped_too(tmp_path: Path, pod_dir: Path) -> None:
    """After a restart of auraed the init is no child of the new one: it is killed, waited for
    and left to its new parent to reap."""
    create = (
        "import sys; from pathlib import Path; "
        "from auraed.system.pod_namespaces import PodNamespaceSpec, create_pod_namespaces; "
        "print(create_pod_namespaces(Path(sys.argv[1]), PodNamespaceSpec(pid=True)).init_pid)"
    )
    out = subprocess.run(
        [sys.executable, "-c", create, str(pod_dir)], capture_output=True, text=True, check=True
    )
    init = int(out.stdout)
    assert (pod_dir / INIT_RECORD).read_text().split()[0] == str(init)
    assert os.path.exists(f"/proc/{init}")  # outlived its parent
    remove_pod_namespaces(pod_dir)
    wait_for(lambda: not os.path.exists(f"/proc/{init}"))
    assert not pod_dir.exists()


def test_only_the_namespaces_asked_for(pod_dir: Path) -> None:
    with pod_namespaces(pod_dir, PodNamespaceSpec(network=False, ipc=True, uts=False)) as pinned:
        assert (pinned.net, pinned.uts, pinned.pid) == (None, None, None)
        assert pinned.ipc and sorted(os.listdir(pod_dir)) == ["ipc"]


def test_a_sysctl_that_cannot_be_set_leaves_nothing(pod_dir: Path) -> None:
    spec = PodNamespaceSpec(pid=True, sysctls={"net.ipv4.conf.eth0.rp_filter": "1"})  # no eth0 yet
    with pytest.raises(NamespaceError) as caught:
        create_pod_namespaces(pod_dir, spec)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert caught.value.message == "sysctls.net.ipv4.conf.eth0.rp_filter: cannot set '1': no such sysctl"
    assert not pod_dir.exists()
    assert str(pod_dir) not in Path("/proc/self/mounts").read_text()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (PodNamespaceSpec(sysctls={"kernel.pid_max": "100"}), "sysctls.kernel.pid_max: is not namespaced"),
        (PodNamespaceSpec(network=False, sysctls={"net.core.somaxconn": "1"}), "own network namespace"),
        (PodNamespaceSpec(uts=False, hostname="x"), "hostname: needs the pod's own UTS namespace"),
        (PodNamespaceSpec(hostname="x" * 65), "hostname: must be at most 64"),
        (PodNamespaceSpec(network=False, ipc=False, uts=False), "at least one namespace"),
    ],
)
def test_bad_specs_are_refused_before_anything_is_made(
    pod_dir: Path, spec: PodNamespaceSpec, message: str
) -> None:
    with pytest.raises(NamespaceError, match=message) as caught:
        create_pod_namespaces(pod_dir, spec)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert not pod_dir.exists()


def test_another_pods_pins_are_never_touched(pod_dir: Path) -> None:
    with pod_namespaces(pod_dir) as pinned:
        with pytest.raises(NamespaceError) as caught:
            create_pod_namespaces(pod_dir, PodNamespaceSpec())
        assert caught.value.kind is ErrorKind.ALREADY_EXISTS
        assert pinned.net and str(pinned.net) in Path("/proc/self/mounts").read_text()


def test_a_user_namespace_group_owns_its_ipc_and_pid_namespaces_and_agrees_with_its_containers(
    tmp_path: Path,
) -> None:
    """A guest's group of a pod's user namespace (auraed.containers.pid_groups, a vm pod with
    hostUsers: false): the user namespace, with the pod's mappings, owns the IPC and PID
    namespaces made with it; a container asking for other mappings, or for no shared PID
    namespace, is refused; the last one's release removes it all, its init reaped."""
    groups = PidGroups(tmp_path / "groups")
    idmap = IdMap(1_000_000, 65536, 1_000_000, 65536)
    try:
        sandbox = groups.user_sandbox(idmap, share_pid=True)
        shared = sandbox.namespaces
        assert shared.user is not None and shared.pid is not None and shared.ipc is not None
        assert shared.user.idmap == idmap
        [init] = members(str(shared.pid), "pid")
        assert Path(f"/proc/{init}/uid_map").read_text().split() == ["0", "1000000", "65536"]
        user = os.stat(shared.user.path).st_ino
        assert os.stat(f"/proc/{init}/ns/user").st_ino == user
        assert os.stat(f"/proc/{init}/ns/ipc").st_ino == os.stat(shared.ipc).st_ino
        assert groups.user_sandbox(idmap, share_pid=True) == sandbox  # the next container's
        for other, share_pid, field in (
            (IdMap(2_000_000, 65536, 2_000_000, 65536), True, "config.user_namespace"),
            (idmap, False, "config.shared_pid"),
        ):
            with pytest.raises(ContainerError) as error:
                groups.user_sandbox(other, share_pid=share_pid)
            assert error.value.kind is ErrorKind.FAILED_PRECONDITION
            assert error.value.message.startswith(f"{field}:"), error.value.message
    finally:
        groups.release(GROUP_PREFIX + USERNS_GROUP, in_use=False)
    assert not (tmp_path / "groups" / USERNS_GROUP).exists()
    assert not Path(f"/proc/{init}").exists()
