"""Onlining hotplugged CPUs and memory blocks (auraed/system/hotplug.py), on a fake sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.system.hotplug import mem_total_kib, online_cpu_mem, online_until


def tree(root: Path, cpus: dict[str, str | None], blocks: dict[str, str], mem_total: int) -> Path:
    """``cpus``: cpuN -> its online file's content (None: no file, as cpu0); ``blocks``: memoryN ->
    its state. Returns the meminfo file."""
    for name, online in cpus.items():
        (root / "cpu" / name).mkdir(parents=True)
        if online is not None:
            (root / "cpu" / name / "online").write_text(f"{online}\n")
    (root / "cpu" / "cpufreq").mkdir()  # not a CPU
    (root / "cpu" / "online").write_text("0-1\n")  # the kernel's summary file: not a CPU either
    for name, state in blocks.items():
        (root / "memory" / name).mkdir(parents=True)
        (root / "memory" / name / "state").write_text(f"{state}\n")
    if blocks:
        (root / "memory" / "auto_online_blocks").write_text("offline\n")
    meminfo = root / "meminfo"
    meminfo.write_text(f"MemTotal:       {mem_total} kB\nMemFree:          1000 kB\n")
    return meminfo


def test_every_offline_cpu_and_memory_block_is_onlined_and_counted(tmp_path: Path) -> None:
    sysfs = tmp_path / "system"
    cpus = {"cpu0": None, "cpu1": "1", "cpu2": "0", "cpu10": "0"}
    blocks = {"memory0": "online", "memory4": "offline", "memory5": "offline", "memory6": "going-offline"}
    meminfo = tree(sysfs, cpus, blocks, 773120)
    done = online_cpu_mem(sysfs, meminfo)
    assert (done.online_cpus, done.cpus_onlined, done.memory_blocks_onlined) == (4, 2, 2)
    assert done.mem_total_kib == 773120 and done.failures == ()
    assert (sysfs / "cpu" / "cpu2" / "online").read_text() == "1"
    assert (sysfs / "cpu" / "cpu10" / "online").read_text() == "1"
    assert (sysfs / "memory" / "memory5" / "state").read_text() == "online"
    # A block on its way out is left alone; the summary files are not touched.
    assert (sysfs / "memory" / "memory6" / "state").read_text() == "going-offline\n"
    assert (sysfs / "memory" / "auto_online_blocks").read_text() == "offline\n"
    # Again: nothing left to online.
    again = online_cpu_mem(sysfs, meminfo)
    assert (again.online_cpus, again.cpus_onlined, again.memory_blocks_onlined) == (4, 0, 0)


def test_what_the_kernel_refuses_is_reported_and_the_rest_still_onlined(tmp_path: Path) -> None:
    sysfs = tmp_path / "system"
    meminfo = tree(sysfs, {"cpu0": None, "cpu1": "0", "cpu2": "0"}, {"memory3": "offline"}, 1024)
    # A control file that cannot be read (a directory where the file should be: EISDIR).
    (sysfs / "cpu" / "cpu1" / "online").unlink()
    (sysfs / "cpu" / "cpu1" / "online").mkdir()
    done = online_cpu_mem(sysfs, meminfo)
    assert done.cpus_onlined == 1 and done.memory_blocks_onlined == 1
    assert [f.split(":")[0] for f in done.failures] == ["cpu1"]


def test_a_machine_without_memory_hotplug_has_no_memory_directory(tmp_path: Path) -> None:
    sysfs = tmp_path / "system"
    meminfo = tree(sysfs, {"cpu0": None}, {}, 2048)
    done = online_cpu_mem(sysfs, meminfo)
    assert (done.online_cpus, done.memory_blocks_onlined, done.mem_total_kib) == (1, 0, 2048)


def test_meminfo_without_mem_total_is_an_error(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree: 1 kB\n")
    with pytest.raises(ValueError, match="MemTotal"):
        mem_total_kib(meminfo)


def test_a_grown_clone_waits_until_what_was_plugged_is_online(tmp_path: Path) -> None:
    """online_until: onlined at once when there; until the timeout, saying what is, when not."""
    sysfs = tmp_path / "system"
    meminfo = tree(sysfs, {"cpu0": None, "cpu1": "0"}, {"memory2": "offline"}, 512 * 1024)
    done = online_until(2, 512 * 1024, timeout=1.0, sysfs=sysfs, meminfo=meminfo)
    assert (done.online_cpus, done.cpus_onlined, done.memory_blocks_onlined) == (2, 1, 1)
    # A third CPU the kernel has not added (its ACPI event not handled yet), memory not counted.
    with pytest.raises(TimeoutError) as waited:
        online_until(3, 640 * 1024, timeout=0.05, sysfs=sysfs, meminfo=meminfo)
    assert "2 of 3 CPUs and MemTotal 524288 of 655360 KiB online within 0.05 s" in str(waited.value)
