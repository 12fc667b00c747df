"""Which pytest-xdist worker this is, and its own share of an address range.

hack/test runs the suite in parallel workers (``AURAE_TEST_WORKERS``). Tests pick address pools
and CNI subnets from the host's free space, which another worker may be about to take between
the check and the moment its tap or bridge appears: each worker therefore takes only from its
own slice of a range (``worker_share``), so no two workers ever choose the same block. Without
xdist (or with one worker) the share is the whole range. Loopback ports likewise
(``free_port``): probed free, a port is bound by the caller a moment later, and only this worker
ever picks from its slice.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket

PORTS = range(20000, 32768)
"""Where ``free_port`` takes test ports from: below Linux's default ephemeral range (32768-60999),
so no outgoing connection of another worker is handed one, and cut into one slice per worker."""


def worker_index() -> int:
    """0 for ``gw0`` (and outside xdist), 1 for ``gw1``, ..."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def worker_count() -> int:
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))


def worker_share(within: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    """This worker's slice of ``within``: the range cut into the next power of two at or above
    the worker count, one slice per worker."""
    count = worker_count()
    if count == 1:
        return within
    bits = (count - 1).bit_length()
    if within.prefixlen + bits > 30:
        raise AssertionError(f"{within} is too small to share between {count} workers")
    return list(within.subnets(prefixlen_diff=bits))[worker_index() % count]


def free_port() -> int:
    """A TCP port of this worker's slice of ``PORTS`` free on 127.0.0.1 a moment ago."""
    count = worker_count()
    size = len(PORTS) // count
    start = PORTS.start + size * (worker_index() % count)
    candidates = list(range(start, start + size))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {start}-{start + size - 1}")
