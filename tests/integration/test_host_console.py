"""The host image's console shell (``console_shell = true`` in the daemon's config), for real (QEMU TCG).

A machine booted from the host image with a config disk (``auraed.config_disk=``, mounted on
/etc/aurae in place of the image's configuration: the image's auraed.toml plus ``console_shell =
true``). Enter on its serial console gives a root shell there, one at a time; its end brings the
status screen back, and each session is logged without what was typed. An orphan made from it is
reaped by PID 1. The image's own config leaves it off (test_host_image.py checks that nothing
typed there runs).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.configdisk import config_disk as squashfs_config_disk
from tests.support.hostvm import READY_MARKER, Booted, HostMachine, build_host_image

pytestmark = pytest.mark.slow

BOOT_TIMEOUT = 240.0
SHELL_TIMEOUT = 60.0
HOST_IMAGE = Path(__file__).resolve().parents[2] / "host-image"


def config_disk(work: Path) -> Path:
    """The image's own auraed.toml (host-image/mkhost.py writes it) with console_shell on, as a
    squashfs config disk; no vm pods' guest template made at start (a guest inside this 1-vCPU TCG
    machine would take its only CPU for minutes)."""
    sys.path.insert(0, str(HOST_IMAGE))
    try:
        mkhost = importlib.import_module("mkhost")  # a build script beside guest-image/'s, not a package
    finally:
        sys.path.remove(str(HOST_IMAGE))
    return squashfs_config_disk(work, mkhost.DAEMON_CONFIG + 'console_shell = true\ncri_vm_boot = "cold"\n')


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted[HostMachine]]:
    work = tmp_path_factory.mktemp("host-console")
    machine = HostMachine(build_host_image(), config_disk=config_disk(work))
    try:
        machine.start()
        seconds = machine.wait_for(READY_MARKER, BOOT_TIMEOUT)
        yield Booted(machine, machine.client_config(work / "client"), seconds)
    finally:
        machine.close()


async def test_enter_on_the_console_gives_a_root_shell_there(booted: Booted[HostMachine]) -> None:
    machine = booted.machine
    assert "press Enter for a root shell (console_shell = true)" in machine.console
    mark = machine.mark()
    machine.type_line("")
    machine.wait_for("console shell 1 opened on the console", SHELL_TIMEOUT, since=mark)
    machine.type_line("echo SHELL-$((6*7)) $(id -u) $(cat /proc/1/comm); tty")
    took = machine.wait_for("SHELL-42 0 python3", SHELL_TIMEOUT, since=mark)
    machine.wait_for("/dev/ttyS0", SHELL_TIMEOUT, since=mark)  # the console's tty, its own
    print(f"console shell: an answer {took:.1f} s after QEMU started")
    async with booted.client() as client:  # the API serves meanwhile
        from tests.integration.test_host_image import health

        assert await health(client) == 1
    # An orphan: the subshell ends at once, its sleep is reparented to PID 1 (no subreaper
    # between the console shell and it), which must reap it when it ends.
    machine.type_line(
        "(sleep 1 & echo $! > /tmp/orphan); sleep 4; test -e /proc/$(cat /tmp/orphan) || echo REAPED"
    )
    machine.wait_for("\nREAPED", SHELL_TIMEOUT, since=mark)  # not the typed line's echo
    closed = machine.mark()
    machine.type_line("exit 3")
    machine.wait_for("console shell 1 closed after", SHELL_TIMEOUT, since=closed)
    machine.wait_for(READY_MARKER, SHELL_TIMEOUT, since=closed)  # the status screen again
    assert "(exit status 3)" in machine.console[closed:]
    # Logged: when and how long, not what was typed (the tty echoes it; the log lines do not).
    log_lines = [line for line in machine.console[mark:].splitlines() if "console shell" in line]
    assert log_lines and not any("SHELL" in line for line in log_lines)
    # Enter again: a second session.
    again = machine.mark()
    machine.type_line("")
    machine.wait_for("console shell 2 opened on the console", SHELL_TIMEOUT, since=again)
    machine.type_line("exit")
    machine.wait_for("console shell 2 closed after", SHELL_TIMEOUT, since=again)
