"""A machine's randomness and clock made fresh: what a guest cloned from a template needs first.

Every clone of a template starts with the template's kernel RNG state and its wall clock. The
host hands it fresh entropy and the time (auraed/init/identity.py at a clone's start; the
SystemService's ReseedRandom and SetTime RPCs at any time, e.g. after a host suspend), as the Kata
agent's reseed_random_device and set_guest_date_time do: the entropy is written to /dev/random,
credited (RNDADDTOENTCNT), and the kernel's CRNG is reseeded from it at once (RNDRESEEDCRNG).
Stdlib only: a guest's PID 1 imports it.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import time

RNDADDTOENTCNT = 0x40045201  # _IOW('R', 0x01, int)
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
MIN_ENTROPY = 32  # bytes: a full reseed of the CRNG's 256-bit key
MAX_ENTROPY = 4096
RANDOM_DEVICE = "/dev/random"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def reseed_random(entropy: bytes, device: str = RANDOM_DEVICE) -> None:
    """Mix ``entropy`` into the kernel's pool, credit it, and reseed the CRNG from it now."""
    if not MIN_ENTROPY <= len(entropy) <= MAX_ENTROPY:
        raise ValueError(f"entropy: {len(entropy)} bytes, not {MIN_ENTROPY} to {MAX_ENTROPY}")
    fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    try:
        written = os.write(fd, entropy)
        if written != len(entropy):
            raise OSError(f"{device}: wrote {written} of {len(entropy)} bytes")
        fcntl.ioctl(fd, RNDADDTOENTCNT, struct.pack("i", 8 * len(entropy)))
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)
    # Python's own generator was seeded once, when the template imported it: again, from the
    # reseeded kernel (a module not imported yet seeds itself when it is).
    random = sys.modules.get("random")
    if random is not None:
        random.seed()


def set_wall_clock(unix_ns: int) -> None:
    """Set CLOCK_REALTIME (settimeofday) to ``unix_ns``."""
    time.clock_settime_ns(time.CLOCK_REALTIME, unix_ns)


def boot_id(path: str = BOOT_ID) -> str:
    """The kernel's boot id (made at its first read: a template never reads it, so each clone
    makes its own after its reseed)."""
    with open(path) as handle:
        return handle.read().strip()
