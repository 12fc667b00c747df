"""Onlining the CPUs and memory a host hotplugged into this machine (a guest VM grown by Resize).

As the Kata agent's online_cpu_mem: every CPU whose ``/sys/devices/system/cpu/cpuN/online`` reads
0 gets 1 written to it, every memory block whose ``/sys/devices/system/memory/memoryN/state`` is
``offline`` gets ``online``. A CPU without an ``online`` file (cpu0 on x86) cannot be offline. The
kernel onlines hotplugged memory by itself when booted with ``memhp_default_state=online`` (QEMU's
q35 guests are, auraed/vms/qemu.py); CPUs it never onlines by itself (userspace does: udev, or
this). Stdlib only: a guest's daemon runs it, and tests point it at a fake tree.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

SYSFS = Path("/sys/devices/system")
MEMINFO = Path("/proc/meminfo")
_CPU = re.compile(r"^cpu(\d+)$")
_MEMORY = re.compile(r"^memory(\d+)$")


@dataclasses.dataclass(frozen=True)
class Onlined:
    online_cpus: int
    mem_total_kib: int
    cpus_onlined: int
    memory_blocks_onlined: int
    failures: tuple[str, ...]


def _numbered(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), e) for e in entries if (m := pattern.match(e.name)) and e.is_dir()]
    return sorted(found)


def _write(path: Path, value: str) -> str:
    """Empty when written, else why not (the kernel's refusal, in words)."""
    try:
        with path.open("w") as handle:
            handle.write(value)
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)


def mem_total_kib(meminfo: Path = MEMINFO) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    raise ValueError(f"{meminfo}: no MemTotal line")


def online_cpu_mem(sysfs: Path = SYSFS, meminfo: Path = MEMINFO) -> Onlined:
    """Online every offline CPU and memory block under ``sysfs``; what is online then."""
    failures = []
    cpus_onlined = online = 0
    for number, cpu in _numbered(sysfs / "cpu", _CPU):
        control = cpu / "online"
        try:
            state = control.read_text().strip()
        except FileNotFoundError:
            online += 1  # not hot-removable (cpu0): always online
            continue
        except OSError as exc:
            failures.append(f"cpu{number}: {exc.strerror or exc}")
            continue
        if state == "1":
            online += 1
            continue
        if why := _write(control, "1"):
            failures.append(f"cpu{number}: {why}")
            continue
        cpus_onlined += 1
        online += 1
    blocks_onlined = 0
    for number, block in _numbered(sysfs / "memory", _MEMORY):
        control = block / "state"
        try:
            state = control.read_text().strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures.append(f"memory{number}: {exc.strerror or exc}")
            continue
        if state != "offline":
            continue
        if why := _write(control, "online"):
            failures.append(f"memory{number}: {why}")
            continue
        blocks_onlined += 1
    return Onlined(online, mem_total_kib(meminfo), cpus_onlined, blocks_onlined, tuple(failures))


def online_until(
    cpus: int,
    mem_total_kib: int,
    timeout: float,
    *,
    poll: float = 0.01,
    sysfs: Path = SYSFS,
    meminfo: Path = MEMINFO,
) -> Onlined:
    """Online what was hotplugged (online_cpu_mem) until ``cpus`` CPUs are online and MemTotal is
    at least ``mem_total_kib``: the host has plugged them, and the kernel adds each as it handles
    its ACPI event. What is online then; TimeoutError saying what is after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done = online_cpu_mem(sysfs, meminfo)
        if done.online_cpus >= cpus and done.mem_total_kib >= mem_total_kib:
            return done
        if time.monotonic() > deadline:
            refused = f"; refused: {'; '.join(done.failures)}" if done.failures else ""
            raise TimeoutError(
                f"{done.online_cpus} of {cpus} CPUs and MemTotal {done.mem_total_kib} of {mem_total_kib} KiB "
                f"online within {timeout:g} s{refused}"
            )
        time.sleep(poll)
