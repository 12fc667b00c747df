"""Shared fixtures: a dev PKI, and real auraed daemons started as subprocesses with their own dirs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.client import AuraeClient, ClientConfig
from auraed.pki import PkiPaths, ensure_dev_pki
from tests.support.cni import HostSnapshot, host_snapshot, restore_host
from tests.support.images import BuiltImage, build_busybox_layout, build_large_layout

READY_TIMEOUT = 30.0
HOST_BEFORE = pytest.StashKey[HostSnapshot]()
REQUIRED_PROGRAMS = (
    "runc",
    "crun",
    "busybox",
    "gcc",
    "skopeo",
    "docker-registry",
    "qemu-system-x86_64",
    "ip",
    "nsenter",
    "iptables",
)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Tests never skip for something missing: the machine must have it, or the run fails here."""
    from auraed.system.cgroupfs import CgroupLayout, detect_layout
    from tests.support.cni import missing_plugins

    problems = []
    if os.geteuid() != 0:
        problems.append("the tests run as root")
    problems += [f"{name} is not installed" for name in REQUIRED_PROGRAMS if shutil.which(name) is None]
    problems += [
        f"CNI plugin {name} is not installed (containernetworking-plugins)" for name in missing_plugins()
    ]
    if not Path("/bin/busybox").exists():
        problems.append("busybox-static (/bin/busybox) is not installed")
    if detect_layout() is CgroupLayout.V2:
        problems.append("the host tests exercise cgroup v1/hybrid (the v2 path runs in guests)")
    if not Path("/dev/kvm").exists():
        problems.append("/dev/kvm is missing (the KVM probe is tested on it)")
    if problems:
        pytest.exit(
            "this machine cannot run the suite: " + "; ".join(problems) + " (hack/test sets it up)", 1
        )
    if _is_xdist_controller(session.config):
        session.config.stash[HOST_BEFORE] = host_snapshot()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Parallel workers leave the host-wide state CNI networks share to the session (see
    tests/support/cni.py): put back once every worker is done."""
    before = session.config.stash.get(HOST_BEFORE, None)
    if before is not None:
        restore_host(before)


def _is_xdist_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


# The files whose tests boot TCG guests, in two groups of about equal length (~6.5 min each
# without xdist on this 2-core kind of machine): under hack/test's parallel workers each group
# runs on one worker, so that at most two guests (one per core) boot at once however many workers
# there are, and their timing (boots, keepalives, deadlines) is not starved by a third. They are
# scheduled first, the longest work ahead of the short files that fill in around it.
GUEST_GROUPS = {
    "guests-1": (
        "test_nested.py",
        "test_host_image.py",
        "test_host_console.py",
        "test_guest_image.py",
        "test_orka_vms.py",
        "test_vms.py",
        "test_cri_vm_pods.py",
        "test_vm_templates_q35.py",
        "test_cri_vm_share.py",
        "test_cri_vm_rootfs.py",
    ),
    "guests-2": (
        "test_host_disk.py",
        "test_cri_vm_faults.py",
        "test_vm_templates.py",
        "test_cri_vm_containers.py",
        "test_vm_resize.py",
        "test_vm_debug_console.py",
        "test_vm_edges.py",
        "test_cri_vm_templates.py",
    ),
}
GUEST_GROUP_OF = {
    f"tests/integration/{name}": group for group, names in GUEST_GROUPS.items() for name in names
}


def _group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return GUEST_GROUP_OF.get(path, path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (hack/test's parallel workers): each test runs in its guest group
    (``GUEST_GROUPS``) or else its file's, a group's tests on one worker, so that module fixtures
    (a booted machine, a registry) are made once and a module's tests run in order, as they do
    without xdist. The grouping is this scheduler's: xdist's own (the ``xdist_group`` marker)
    renames node ids, which pytest 9 no longer lets a plugin do, and has no effect."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under parallel workers the guest groups are collected first (every worker collects the
    same order; hack/test keeps it: --no-loadscope-reorder), the longest work ahead of the short
    files that fill in around it."""
    if not getattr(config.option, "loadgroup", False):  # xdist hands its workers dist "no"
        return
    order = list(GUEST_GROUPS)
    items.sort(key=lambda item: order.index(g) if (g := _group_of(item.nodeid)) in order else len(order))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("pki"), client_names=("aurae-client", "reader", "intruder"))


class DaemonProcess:
    """One auraed under test: its directories, its process, and clients for it."""

    def __init__(self, root: Path, pki: PkiPaths, extra_args: list[str], config_text: str = "") -> None:
        self.root = root
        self.pki = pki
        self.socket = root / "run" / "aurae.sock"
        self.cri_socket = root / "run" / "cri.sock"
        self.cgroup_base = f"aurae-test-{os.getpid()}-{root.name}"
        self.log_path = root / "auraed.log"
        self.config_path = root / "auraed.toml"
        self.config_path.write_text(config_text)
        self.args = [
            sys.executable, "-m", "auraed",
            "--config", str(self.config_path),
            "--socket", str(self.socket),
            "--cri-socket", str(self.cri_socket),
            "--cni-conf-dir", str(root / "net.d"),
            "--ca-crt", str(pki.ca_crt),
            "--server-crt", str(pki.server_crt),
            "--server-key", str(pki.server_key),
            "--state-dir", str(root / "state"),
            "--runtime-dir", str(root / "run"),
            "--cgroup-base", self.cgroup_base,
            "--stop-grace-period", "2",
            "--log-level", "DEBUG",
            *extra_args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"auraed exited with {self.process.returncode}:\n{self.log()}")
            if "serving on unix:" in self.log()[offset:]:
                return
            time.sleep(0.05)
        raise RuntimeError(f"auraed did not become ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def client_config(self, identity: str = "aurae-client") -> ClientConfig:
        crt, key = self.pki.clients[identity]
        return ClientConfig(
            ca_crt=self.pki.ca_crt, client_crt=crt, client_key=key, address=f"unix:{self.socket}"
        )

    def client(self, identity: str = "aurae-client") -> AuraeClient:
        return AuraeClient.connect(self.client_config(identity))


def free_all_cells(daemon: DaemonProcess) -> None:
    """Leave no cgroup behind, whatever the test did: remove the daemon's cgroup base everywhere."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        base = hierarchy / daemon.cgroup_base
        if not base.is_dir():
            continue
        for directory in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if directory.is_dir():
                _kill_procs(directory)
                with contextlib.suppress(OSError):
                    directory.rmdir()
        _kill_procs(base)
        with contextlib.suppress(OSError):
            base.rmdir()


def _kill_procs(directory: Path) -> None:
    procs = directory / "cgroup.procs"
    with contextlib.suppress(OSError):
        for pid in procs.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if not procs.read_text().strip():
                return
        time.sleep(0.02)


DaemonFactory = Callable[..., "DaemonProcess"]


def start_refused(daemon: DaemonProcess) -> str:
    """Start ``daemon``, which must refuse to start: what it logged. Everything it made is removed."""
    try:
        daemon.start()
    except RuntimeError:
        return daemon.log()
    finally:
        daemon.stop()
        remove_daemon_leftovers(daemon)
    pytest.fail("the daemon started")


def remove_daemon_leftovers(daemon: DaemonProcess) -> None:
    """Whatever a test did: kill its monitors, delete runtime state, unmount, remove its files."""
    root = str(daemon.root).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if root in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
    runtime_root = daemon.root / "run" / "runtime"
    if runtime_root.is_dir():
        for state in runtime_root.iterdir():
            subprocess.run(
                ["runc", "--root", str(runtime_root), "delete", "--force", state.name],
                capture_output=True,
                check=False,
            )
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(str(daemon.root))), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    free_all_cells(daemon)
    remove_taps_of(daemon.root)
    subprocess.run(["rm", "-rf", str(daemon.root)], check=False)


def remove_taps_of(root: Path) -> None:
    """Taps a daemon made carry the alias "auraed-vm <its run dir>": remove those under ``root``."""
    links = subprocess.run(
        ["ip", "-o", "-d", "link", "show"], capture_output=True, text=True, check=False
    ).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith("atap") and f"alias auraed-vm {root}" in line:
            subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)


@pytest.fixture
def daemon_factory(pki: PkiPaths) -> Iterator[DaemonFactory]:
    made: list[DaemonProcess] = []

    def make(*extra_args: str, config_text: str = "", name: str = "d") -> DaemonProcess:
        # Short paths: unix socket paths (ours, and console sockets) are limited to 107 bytes.
        root = Path(tempfile.mkdtemp(prefix=f"aurae-{name}{len(made)}-", dir="/tmp"))
        daemon = DaemonProcess(root, pki, list(extra_args), config_text)
        made.append(daemon)
        daemon.start()
        return daemon

    yield make
    for daemon in made:
        with contextlib.suppress(Exception):
            daemon.stop()
        remove_daemon_leftovers(daemon)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def netns() -> Iterator[str]:
    """A named network namespace of the test's own, removed afterwards."""
    name = f"aurae-t-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AuraeClient]:
    async with daemon.client() as c:
        yield c


async def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its SigCgt mask in /proc): a shell
    signalled before its ``trap`` runs takes the default action instead."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.fixture(scope="session")
def guest_image() -> Path:
    """guest-image/build's output directory (built once, cached by the builder)."""
    prebuilt = os.environ.get("AURAED_TEST_GUEST_IMAGE")
    if prebuilt:
        out = Path(prebuilt)
    else:
        result = subprocess.run(
            [str(Path(__file__).resolve().parent.parent / "guest-image" / "build")],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        assert result.returncode == 0, f"guest-image/build failed:\n{result.stderr[-4000:]}"
        out = Path(result.stdout.strip().splitlines()[-1])
    for name in ("vmlinuz", "initramfs.img", "rootfs.img", "bare-initramfs.img", "manifest.json"):
        assert (out / name).is_file(), f"guest image {out} lacks {name}"
    return out


@pytest.fixture(scope="session")
def busybox_layout(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    """busybox as an OCI image layout, built once per session; tests only read it."""
    return build_busybox_layout(tmp_path_factory.mktemp("busybox-layout"))


@pytest.fixture(scope="session")
def large_layout(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    """busybox and ~50 MB more in two layers, built once per session; tests only read it."""
    return build_large_layout(tmp_path_factory.mktemp("large-layout"))
