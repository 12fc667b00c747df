"""PID 1 at its edges, for real: stop signals that arrive while it boots, and SIGPWR.

As in test_pid1.py, every PID 1 here is PID 1 of a NEW pid namespace (``unshare --pid --fork``),
with its mounts under a temporary root in a private mount namespace: it can only exit, never power
off. The signals come from this process, in the parent pid namespace: the kernel delivers them to
a namespace's init only if it has a handler for them, exactly as to a guest's PID 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_pid1 import REPO, UNSHARE, _ns_init_pid, _stop

STOP_WAIT = 30.0  # seconds for PID 1 to stop once signalled (it takes well under one here)
NEVER_STOPS = 600  # seconds the stand-in daemon serves unless asked to stop

# PID 1 boots, says so, then spends STARTUP seconds before serving: what reading the configuration
# and importing the Daemon take (~1 s here, several under TCG). The stand-in daemon says when it
# starts and serves until asked to stop.
STANDIN = r"""
import asyncio, sys, time

from auraed.init.pid1 import Pid1, Pid1Layout

STARTUP = float(sys.argv[1])
NEVER_STOPS = float(sys.argv[2])


class Standin:
    def __init__(self):
        self.stopped = None

    def request_stop(self):
        if self.stopped is not None:
            self.stopped.set()

    async def run(self):
        self.stopped = asyncio.Event()
        print("serving", flush=True)
        await asyncio.wait_for(self.stopped.wait(), timeout=NEVER_STOPS)
        return 0


init = Pid1(Pid1Layout.from_env())
init.boot()
print("booted", flush=True)
time.sleep(STARTUP)
init.finish(init.run(Standin()))
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def pid1(tmp_path: Path, root: Path) -> Iterator[Any]:
    """Starts the stand-in as PID 1 of a new pid namespace: ``pid1(startup)`` -> (unshare, console)."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    console = tmp_path / "console.log"
    env = {**os.environ, "AURAED_PID1_ROOT": str(root)}
    started: list[subprocess.Popen[str]] = []

    def start(startup: float) -> tuple[subprocess.Popen[str], Path]:
        with console.open("wb") as stderr:
            process = subprocess.Popen(
                [*UNSHARE, sys.executable, str(script), str(startup), str(NEVER_STOPS)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        started.append(process)
        return process, console

    try:
        yield start
    finally:
        for process in started:
            _stop(process)
            if process.stdout is not None:
                process.stdout.close()


def _expect_line(process: subprocess.Popen[str], line: str, console: Path) -> None:
    assert process.stdout is not None
    got = process.stdout.readline().strip()
    assert got == line, f"expected {line!r}, got {got!r}:\n{console.read_text()}"


def _wait_stopped(process: subprocess.Popen[str], console: Path) -> int:
    try:
        return process.wait(timeout=STOP_WAIT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"PID 1 did not stop in {STOP_WAIT:g} s:\n{console.read_text()}") from None


@pytest.mark.parametrize("name", ["SIGTERM", "SIGPWR"])
def test_a_stop_signal_while_pid1_boots_is_not_lost(pid1: Any, name: str) -> None:
    """Before the fix, a signal between boot and serving hit no handler, so the kernel dropped it
    (a namespace's init, like a guest's, ignores what it does not handle) and auraed served on."""
    process, console = pid1(2.0)
    _expect_line(process, "booted", console)
    os.kill(_ns_init_pid(process.pid), signal.Signals[name])
    assert _wait_stopped(process, console) == 0
    log = console.read_text()
    assert f"received {name} before auraed started: not starting it" in log, log
    assert f"auraed ended (status 0, received {name}): exiting" in log, log
    assert "unmounted 8 file systems" in log
    assert "Traceback" not in log, log


def test_sigpwr_stops_a_serving_pid1(pid1: Any) -> None:
    """SIGPWR is how container managers (LXC) ask an init to shut down; before the fix PID 1 had no
    handler for it, so it was dropped and the container ran on until SIGKILLed."""
    process, console = pid1(0.0)
    _expect_line(process, "booted", console)
    _expect_line(process, "serving", console)
    os.kill(_ns_init_pid(process.pid), signal.SIGPWR)
    assert _wait_stopped(process, console) == 0
    log = console.read_text()
    assert "received SIGPWR: stopping auraed, then exiting" in log, log
    assert "auraed ended (status 0, received SIGPWR): exiting" in log, log
    assert "Traceback" not in log, log


def test_loopback_comes_up_without_an_address_for_eth0(netns: str) -> None:
    """A guest booted without auraed.ip (no network device) still needs 127.0.0.1; before the fix
    lo came up only together with eth0's address."""
    code = (
        "from auraed.bootargs import BootArgs\nfrom auraed.init.pid1 import Pid1\n"
        "Pid1(args=BootArgs(role='guest')).configure_network()\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    link = subprocess.run(
        ["ip", "-n", netns, "-o", "link", "show", "dev", "lo"], capture_output=True, text=True, check=True
    )
    assert "<LOOPBACK,UP,LOWER_UP>" in link.stdout, link.stdout


def test_check_leaks_finds_a_loop_device_left_over(tmp_path: Path) -> None:
    """Tests attach config disks to loop devices (test_pid1.py); hack/check-leaks used to look at
    cgroups, mounts, processes, sockets and links, but not at loop devices, so one left attached
    passed unnoticed."""
    image = tmp_path / "config.img"
    image.write_bytes(bytes(1 << 20))
    device = subprocess.run(
        ["losetup", "--find", "--show", "--read-only", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        done = subprocess.run(
            [sys.executable, str(REPO / "hack" / "check-leaks")], capture_output=True, text=True, check=False
        )
    finally:
        subprocess.run(["losetup", "--detach", device], check=False)
    assert done.returncode == 1
    assert f"{device}: {image}" in done.stderr, done.stderr
