"""The machine's figures, from the kernel: memory (/proc/meminfo) and CPU time (/proc/stat).

The metrics endpoint and the orka node agent's NodeStatus both read them here, so the two never
disagree: memory as the kernel counts it, CPU load as the busy share of every CPU's time between
two readings of the same counters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

PROC = Path("/proc")
# /proc/stat's cpu line counts in USER_HZ, which is 100 on every architecture Linux exports it so.
USER_HZ = 100
# Of /proc/stat's cpu columns (user nice system idle iowait irq softirq steal guest guest_nice),
# the ones a CPU spends idle. guest and guest_nice are already counted in user and nice.
_IDLE_COLUMNS = (3, 4)
_COUNTED_COLUMNS = 8


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes: ``total`` is MemTotal, ``available`` MemAvailable (what can be had without swapping:
    free memory plus the caches the kernel would drop), what schedulers mean by free."""

    total: int
    available: int


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """Every CPU's time since boot, in clock ticks (USER_HZ): spent busy, and in all."""

    busy: int
    total: int

    @property
    def idle(self) -> int:
        return self.total - self.busy


def read_memory(proc: Path = PROC) -> Memory:
    values: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            values[name] = int(rest.split()[0]) * 1024  # the kernel writes kB, meaning KiB
    return Memory(values["MemTotal"], values["MemAvailable"])


def read_cpu_times(proc: Path = PROC) -> CpuTimes:
    first = (proc / "stat").read_text().split("\n", 1)[0]  # "cpu  user nice system idle ..."
    columns = [int(value) for value in first.split()[1 : 1 + _COUNTED_COLUMNS]]
    idle = sum(columns[i] for i in _IDLE_COLUMNS)
    return CpuTimes(busy=sum(columns) - idle, total=sum(columns))


def load_percent(earlier: CpuTimes, later: CpuTimes) -> float:
    """The busy share of every CPU's time between two readings, 0 to 100 (0 when no tick passed)."""
    elapsed = later.total - earlier.total
    if elapsed <= 0:
        return 0.0
    return min(100.0, max(0.0, 100.0 * (later.busy - earlier.busy) / elapsed))


class CpuLoad:
    """The CPU load since the previous reading: each ``sample()`` reads the counters again.

    The first sample covers the time since this object was made (a daemon makes it as it starts),
    or, when not a tick passed meanwhile, the time since boot.
    """

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._last = read_cpu_times(proc)

    def sample(self) -> float:
        now = read_cpu_times(self._proc)
        earlier = self._last if now.total > self._last.total else CpuTimes(0, 0)
        self._last = now
        return load_percent(earlier, now)
