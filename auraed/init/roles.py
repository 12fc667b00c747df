"""Which role this auraed plays: host, guest or nested."""

from __future__ import annotations

import enum
import os
from pathlib import Path

from auraed.bootargs import BootArgs


class Role(enum.Enum):
    HOST = "host"
    GUEST = "guest"
    NESTED = "nested"


GUEST_KERNEL_ARG = "auraed.role=guest"


def detect_role(
    override: str = "",
    nested: bool = False,
    pid: int | None = None,
    kernel_cmdline: str | None = None,
) -> tuple[Role, str]:
    """The role and the reason it was chosen (logged at start)."""
    if override:
        return Role(override), "set by configuration"
    if nested:
        return Role.NESTED, "--nested was given"
    pid = os.getpid() if pid is None else pid
    if pid == 1:
        if kernel_cmdline is None:
            try:
                kernel_cmdline = Path("/proc/cmdline").read_text()
            except OSError:
                kernel_cmdline = ""
        # Read as PID 1 reads it (BootArgs), or the two disagree: a "-- auraed.role=guest"
        # (init's argv) or a later "auraed.role=host" made a guest daemon under a PID 1 that
        # skipped the config disk and, at the end, halted instead of powering off.
        if BootArgs.parse(kernel_cmdline).guest:
            return Role.GUEST, f"PID 1 with {GUEST_KERNEL_ARG} on the kernel command line"
        return Role.HOST, "PID 1 without a guest marker: bare-metal host"
    return Role.HOST, "running as a daemon"
