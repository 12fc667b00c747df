"""Shared fixtures: a dev PKI, and real auraed daemons started as subprocesses with their own dirs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from auraed.client import AuraeClient, ClientConfig
from auraed.pki import PkiPaths, ensure_dev_pki

READY_TIMEOUT = 30.0


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    return ensure_dev_pki(tmp_path_factory.mktemp("pki"), client_names=("aurae-client", "reader", "intruder"))


class DaemonProcess:
    """One auraed under test: its directories, its process, and clients for it."""

    def __init__(self, root: Path, pki: PkiPaths, extra_args: list[str], config_text: str = "") -> None:
        self.root = root
        self.pki = pki
        self.socket = root / "run" / "aurae.sock"
        self.cgroup_base = f"aurae-test-{os.getpid()}-{root.name}"
        self.log_path = root / "auraed.log"
        self.config_path = root / "auraed.toml"
        self.config_path.write_text(config_text)
        self.args = [
            sys.executable, "-m", "auraed",
            "--config", str(self.config_path),
            "--socket", str(self.socket),
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


@pytest.fixture
def daemon_factory(tmp_path: Path, pki: PkiPaths) -> Iterator[DaemonFactory]:
    made: list[DaemonProcess] = []

    def make(*extra_args: str, config_text: str = "", name: str = "d") -> DaemonProcess:
        root = tmp_path / f"{name}{len(made)}"
        root.mkdir()
        daemon = DaemonProcess(root, pki, list(extra_args), config_text)
        made.append(daemon)
        daemon.start()
        return daemon

    yield make
    for daemon in made:
        with contextlib.suppress(Exception):
            daemon.stop()
        free_all_cells(daemon)
        for netns in (daemon.root / "run" / "netns").glob("*"):
            subprocess.run(["umount", "-l", str(netns)], check=False, capture_output=True)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


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
