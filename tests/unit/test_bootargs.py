"""The kernel command line as PID 1 and the Daemon read it: they must agree on the role.

Both read it with auraed/bootargs.py BootArgs: PID 1 (auraed/init/pid1.py) decides from the role
whether to mount the config disk and whether the end is a power-off or a halt; the Daemon
(auraed/init/roles.py) decides from it which services to serve. The host appends a VM's own
kernel_args after ``auraed.role=guest``.
"""

from __future__ import annotations

import pytest

from auraed.bootargs import BootArgs
from auraed.init.roles import Role, detect_role


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("console=ttyS0 auraed.role=guest", Role.GUEST),
        ("console=ttyS0 auraed.role=guest auraed.role=host", Role.HOST),  # the last one counts
        ("console=ttyS0 auraed.role=host auraed.role=guest", Role.GUEST),
        ("console=ttyS0 -- auraed.role=guest", Role.HOST),  # after "--": init's argv, not ours
        ("auraed.role=guest -- auraed.role=host", Role.GUEST),
        ("auraed.role=guests", Role.HOST),
        ("auraed.role", Role.HOST),
        ("", Role.HOST),
    ],
)
def test_pid1_and_the_daemon_agree_on_the_role(cmdline: str, role: Role) -> None:
    """Before the fix the Daemon looked for the word anywhere: with "auraed.role=guest
    auraed.role=host" (or "-- auraed.role=guest") it served as a guest under a PID 1 that had
    skipped the config disk and, at the end, halted the VM forever instead of powering it off."""
    detected, _ = detect_role(pid=1, kernel_cmdline=cmdline)
    assert detected is role
    assert BootArgs.parse(cmdline).guest == (role is Role.GUEST)


def test_odd_values_parse_without_raising() -> None:
    args = BootArgs.parse(
        "auraed.ip= auraed.gateway=x auraed.hostname=== auraed.iface= auraed.poweroff=TRUE "
        "auraed.=1 auraed.role=guest=1 =auraed.role=guest"
    )
    assert args == BootArgs(ip="", gateway="x", hostname="==", role="guest=1", poweroff=True)
    assert args.iface == "eth0"  # an empty auraed.iface= keeps the default
    assert not args.guest


def test_a_shared_directory_is_named_by_its_tag() -> None:
    assert BootArgs.parse("auraed.role=guest auraed.share=aurae-share").share == "aurae-share"
    assert BootArgs.parse("auraed.role=guest").share == ""


def test_the_debug_console_flag_and_its_frames() -> None:
    from auraed.bootargs import DEBUG_FRAME_MAX, DEBUG_INPUT, DEBUG_SIZE, DebugFrames, debug_frame

    assert BootArgs.parse("auraed.role=guest auraed.debug_console=1").debug_console
    assert not BootArgs.parse("auraed.debug_console=1 auraed.debug_console=0").debug_console
    assert not BootArgs.parse("auraed.role=guest").debug_console
    stream = debug_frame(DEBUG_SIZE, b"\x00\x18\x00\x50") + debug_frame(
        DEBUG_INPUT, b"x" * (DEBUG_FRAME_MAX + 5)
    )
    frames = DebugFrames()
    got = [f for i in range(0, len(stream), 7) for f in frames.feed(stream[i : i + 7])]
    assert got == [
        (DEBUG_SIZE, b"\x00\x18\x00\x50"),
        (DEBUG_INPUT, b"x" * DEBUG_FRAME_MAX),
        (DEBUG_INPUT, b"x" * 5),
    ]
    assert debug_frame(DEBUG_INPUT, b"") == b"\x00\x00\x00"
