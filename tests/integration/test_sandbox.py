"""Containers created through the pod seam (auraed.containers.sandbox) by the Containers domain
object itself, in-process, with real runc: a network namespace pinned with ``ip netns add``, a
sandbox's resolv.conf, hosts and hostname files and /dev/shm, namespaces of another container
joined by path, a cgroup parent of the sandbox's, and a restart that finds it all again.

Needs root and runc. Every container is deleted, every Containers closed, and the cgroups below
``aurae-sbtest-<pid>`` are removed from every hierarchy and checked gone, even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from auraed.containers.containers import Containers
from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord, State
from auraed.containers.oci_cli import Runc
from auraed.containers.oci_spec import exec_process
from auraed.containers.request import ContainerRequest
from auraed.containers.rootfs import OverlaySnapshotter
from auraed.containers.sandbox import CGROUP_PARENT, SandboxContext, SharedNamespaces
from auraed.errors import ErrorKind
from auraed.images.content import LocalStore
from auraed.images.images import Images
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs
from auraed.system.supervisor import Supervisor
from tests.conftest import wait_until
from tests.integration.containers_helpers import BUSYBOX
from tests.support.images import BuiltImage

if TYPE_CHECKING:
    from auraed.images.registry import RegistryClient

RUNC = shutil.which("runc")
BASE = f"aurae-sbtest-{os.getpid()}"
POD_PARENT = "_pods/p1"
RESOLV_CONF = "nameserver 192.168.255.53\nsearch pod.test\n"
HOSTS = "127.0.0.1 localhost\n192.168.255.10 web-0\n"


def no_registry() -> RegistryClient:
    raise AssertionError("these tests never pull")


class Lab:
    """One state store and image store; Containers over them (a new one is a restart)."""

    def __init__(self, root: Path, store: Store, images: Images, cgroups: Cgroupfs) -> None:
        self.root = root
        self.store = store
        self.images = images
        self.cgroups = cgroups
        self.made: list[tuple[Containers, Supervisor]] = []

    def containers(self) -> Containers:
        run_dir = self.root / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        supervisor = Supervisor(run_dir)
        assert RUNC is not None
        containers = Containers(
            self.store,
            self.images,
            snapshotter=OverlaySnapshotter(self.images.snapshots),
            cgroups=self.cgroups,
            runtime=Runc(RUNC, self.root / "runtime", scratch_dir=self.root / "exec"),
            supervisor=supervisor,
            root=self.root / "containers",
            sockets_dir=self.root / "consoles",
            default_stop_timeout=1.0,
        )
        self.made.append((containers, supervisor))
        return containers

    async def restart(self, containers: Containers) -> Containers:
        """What a daemon's stop and start do to the containers, which keep running."""
        await self.close(containers)
        again = self.containers()
        await again.recover()
        return again

    async def close(self, containers: Containers) -> None:
        await containers.close()
        supervisor = next(s for c, s in self.made if c is containers)
        supervisor.close()

    def sandbox(self, namespaces: SharedNamespaces) -> SandboxContext:
        """A sandbox's context with its files and /dev/shm under the lab's directory."""
        files = self.root / "pod"
        files.mkdir(exist_ok=True)
        (files / "resolv.conf").write_text(RESOLV_CONF)
        (files / "hosts").write_text(HOSTS)
        (files / "hostname").write_text("web-0\n")
        (files / "shm").mkdir(mode=0o1777, exist_ok=True)
        return SandboxContext(
            sandbox_id="p1",
            cgroup_parent=POD_PARENT,
            hostname="web-0",
            resolv_conf=files / "resolv.conf",
            hosts=files / "hosts",
            hostname_file=files / "hostname",
            shm=files / "shm",
            namespaces=namespaces,
        )

    async def clean(self) -> None:
        for containers, supervisor in self.made:  # their containers keep running
            await containers.close()
            supervisor.close()
        last = self.containers()  # sees every container still recorded, whoever made it
        await last.recover()
        for record in reversed(last.all()):  # joiners before the containers they joined
            await last.delete(record, force=True, keep_logs=False)
        await self.close(last)
        for parent in (POD_PARENT, "_pods", CGROUP_PARENT, ""):
            self.cgroups.prune(parent)
        self.store.close()
        left = [d for d in self.cgroups.cgroup_dirs("") if d.exists()]
        assert left == [], f"cgroups left behind: {left}"


@contextlib.asynccontextmanager
async def open_lab(root: Path, image: BuiltImage, reference: str, cgroup_base: str) -> AsyncIterator[Lab]:
    """A Lab under ``root`` holding ``image`` as ``reference``, cleaned when left."""
    store = Store(root / "auraed.db")
    local = LocalStore(root / "images")
    images = Images(store, local, local, no_registry)
    await images.import_layout(image.layout, image.ref_name, reference)
    lab = Lab(root, store, images, Cgroupfs(base=cgroup_base))
    try:
        yield lab
    finally:
        await lab.clean()


@pytest.fixture
async def lab(tmp_path: Path, busybox_layout: BuiltImage) -> AsyncIterator[Lab]:
    async with open_lab(tmp_path, busybox_layout, BUSYBOX, BASE) as made:
        yield made


async def create(
    containers: Containers,
    name: str,
    command: tuple[str, ...],
    sandbox: SandboxContext | None = None,
    hostname: str = "",
) -> ContainerRecord:
    typed = ContainerRequest(name=name, command=command, hostname=hostname)
    if sandbox is None:  # the default: a container on its own
        return await containers.create(typed, BUSYBOX, {}, start=True)
    return await containers.create(typed, BUSYBOX, {}, start=True, sandbox=sandbox)


async def exec_output(containers: Containers, record: ContainerRecord, command: list[str]) -> str:
    process = exec_process(containers.process_defaults(record), command, [], "")
    session = await containers.exec(record, process, False, stdin=False, size=None)
    try:
        out = b"".join([data async for stream, data in session.output() if stream == "stdout"])
        assert await session.wait() == 0
    finally:
        await session.close()
    return out.decode()


def log_lines(record: ContainerRecord) -> list[str]:
    """The contents of the container's CRI-format log lines ("<time> <stream> <tag> <content>")."""
    return [line.split(" ", 3)[3] for line in record.log_path.read_text().splitlines()]


def inode(path: str | Path) -> int:
    return os.stat(path).st_ino


async def test_a_sandboxs_containers_join_its_netns_and_share_its_files_and_shm(lab: Lab, netns: str) -> None:
    pinned = Path("/run/netns") / netns
    sandbox = lab.sandbox(namespaces=SharedNamespaces(network=pinned))
    containers = lab.containers()
    writer = await create(
        containers, "writer", ("sh", "-c", "echo shared > /dev/shm/note; exec sleep 300"), sandbox
    )
    assert inode(f"/proc/{writer.pid}/ns/net") == inode(pinned)
    out = await exec_output(
        containers, writer, ["sh", "-c", "hostname; cat /etc/hostname /etc/resolv.conf /etc/hosts"]
    )
    assert out == "web-0\nweb-0\n" + RESOLV_CONF + HOSTS

    # It lives under the sandbox's cgroup parent, in every hierarchy.
    assert containers.cgroup(writer) == f"{POD_PARENT}/{writer.id}"
    assert writer.pid in lab.cgroups.pids(containers.cgroup(writer))
    assert f"/{BASE}/{POD_PARENT}/{writer.id}" in Path(f"/proc/{writer.pid}/cgroup").read_text()
    assert (writer.cgroup_parent, writer.sandbox_id) == (POD_PARENT, "p1")

    # /dev/shm is the sandbox's host directory, shared with every container of the sandbox.
    note = lab.root / "pod" / "shm" / "note"
    await wait_until(note.exists)
    reader = await create(
        containers, "reader", ("sh", "-c", "cat /dev/shm/note; readlink /proc/self/ns/net"), sandbox
    )
    ended = await asyncio.wait_for(containers.wait(reader), 30)
    assert (ended.state, ended.exit_code) == (State.EXITED, 0)
    assert log_lines(reader) == ["shared", f"net:[{inode(pinned)}]"]


async def test_a_container_joins_another_ones_ipc_uts_and_pid_namespaces_by_path(lab: Lab) -> None:
    containers = lab.containers()
    owner = await create(containers, "owner", ("sleep", "300"), hostname="holder")  # on its own
    kinds = ("ipc", "uts", "pid")
    paths = {kind: Path(f"/proc/{owner.pid}/ns/{kind}") for kind in kinds}
    shared = SharedNamespaces(ipc=paths["ipc"], uts=paths["uts"], pid=paths["pid"])
    sandbox = SandboxContext(cgroup_parent=POD_PARENT, namespaces=shared)
    joiner = await create(containers, "joiner", ("sleep", "301"), sandbox)
    for kind in kinds:
        assert inode(f"/proc/{joiner.pid}/ns/{kind}") == inode(paths[kind]), kind
    assert inode(f"/proc/{joiner.pid}/ns/net") != inode(f"/proc/{owner.pid}/ns/net")  # not asked to share
    # The owner's hostname, and the owner's process as PID 1 of the shared pid namespace.
    out = await exec_output(containers, joiner, ["sh", "-c", "hostname; tr '\\0' ' ' < /proc/1/cmdline"])
    assert out == "holder\nsleep 300 "


async def test_a_restart_finds_a_sandboxed_container_in_its_cgroup(lab: Lab) -> None:
    containers = lab.containers()
    sandbox = SandboxContext(sandbox_id="p1", cgroup_parent=POD_PARENT)
    kept = await create(containers, "kept", ("sleep", "300"), sandbox)
    again = await lab.restart(containers)
    found = again.get("kept")
    assert (found.id, found.state, found.cgroup_parent, found.sandbox_id) == (
        kept.id,
        State.RUNNING,
        POD_PARENT,
        "p1",
    )
    assert (await asyncio.to_thread(again.stats, found))["pids_current"] >= 1
    await again.delete(found, force=True, keep_logs=False)
    assert not any(d.exists() for d in lab.cgroups.cgroup_dirs(f"{POD_PARENT}/{kept.id}"))


async def test_a_bad_cgroup_parent_is_refused_before_anything_is_made(lab: Lab) -> None:
    containers = lab.containers()
    for parent in ("", "../escape", "/absolute", "a//b"):
        with pytest.raises(ContainerError) as refused:
            await create(containers, "refused", ("true",), SandboxContext(cgroup_parent=parent))
        assert refused.value.kind is ErrorKind.INVALID_ARGUMENT, parent
        assert refused.value.message.startswith("sandbox.cgroup_parent: "), refused.value.message
    assert containers.all() == []
    assert not (lab.root / "containers").exists() or list((lab.root / "containers").iterdir()) == []
