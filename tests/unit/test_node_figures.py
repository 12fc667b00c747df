"""auraed.system.node: the machine's memory and CPU load as NodeStatus and the metrics read them."""

from __future__ import annotations

from pathlib import Path

from auraed.system.node import CpuLoad, CpuTimes, load_percent, read_cpu_times, read_memory

MEMINFO = "MemTotal:        8000000 kB\nMemFree:          100000 kB\nMemAvailable:    6000000 kB\n"


def fake_proc(root: Path, busy: int, idle: int, iowait: int = 0) -> Path:
    root.mkdir(exist_ok=True)
    (root / "meminfo").write_text(MEMINFO)
    # user nice system idle iowait irq softirq steal guest guest_nice
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} {iowait} 0 0 0 7 7\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    return root


def test_memory_is_read_in_bytes(tmp_path: Path) -> None:
    memory = read_memory(fake_proc(tmp_path, 0, 0))
    assert (memory.total, memory.available) == (8_000_000 * 1024, 6_000_000 * 1024)


def test_cpu_times_count_iowait_as_idle_and_guest_time_once(tmp_path: Path) -> None:
    times = read_cpu_times(fake_proc(tmp_path, busy=300, idle=600, iowait=100))
    assert times == CpuTimes(busy=300, total=1000)


def test_load_is_the_busy_share_between_two_readings() -> None:
    assert load_percent(CpuTimes(100, 1000), CpuTimes(150, 1100)) == 50.0
    assert load_percent(CpuTimes(100, 1000), CpuTimes(100, 1000)) == 0.0  # no tick passed


def test_cpu_load_samples_since_the_last_one_or_since_boot(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, busy=100, idle=900)
    load = CpuLoad(proc)
    assert load.sample() == 10.0  # not a tick since it was made: since boot
    fake_proc(tmp_path, busy=190, idle=910)
    assert load.sample() == 90.0
    fake_proc(tmp_path, busy=190, idle=1010)
    assert load.sample() == 0.0


def test_the_real_machine_reads() -> None:
    memory = read_memory()
    assert 0 < memory.available <= memory.total
    assert 0 <= CpuLoad().sample() <= 100
