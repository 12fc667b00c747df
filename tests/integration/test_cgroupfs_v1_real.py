"""auraed.system.cgroupfs against this host's real cgroup v1 hierarchies (root only).

Every test works below a per-process base and the fixture removes it again, even on failure,
then asserts that no directory named like the base is left in any hierarchy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from auraed.system.cgroupfs import (
    DEFAULT_ROOT,
    CgroupError,
    Cgroupfs,
    CgroupLayout,
    CgroupLimits,
    cpu_weight_to_shares,
    find_v1_mounts,
    read_oom_kill_count,
)

BASE = f"aurae-test-{os.getpid()}"
MIB = 1 << 20
Spawn = Callable[..., "subprocess.Popen[bytes]"]


def leftovers() -> list[Path]:
    return [p for hierarchy in DEFAULT_ROOT.iterdir() for p in hierarchy.glob(f"{BASE}*")]


@pytest.fixture
def fs() -> Iterator[Cgroupfs]:
    cgroups = Cgroupfs(base=BASE)
    assert cgroups.layout in (CgroupLayout.V1, CgroupLayout.HYBRID)
    try:
        yield cgroups
    finally:
        cgroups.kill_all("")
        cgroups.remove_tree("")
        assert leftovers() == []


@pytest.fixture
def spawn(fs: Cgroupfs) -> Iterator[Spawn]:
    """Start a process that joins the cgroup itself between fork and exec, like the daemon does."""
    started: list[subprocess.Popen[bytes]] = []

    def start(path: str, argv: list[str], stderr: int | None = None) -> subprocess.Popen[bytes]:
        # A shell writes its own pid ($$, kept across exec) to every cgroup.procs file, then execs
        # argv: the process is inside before it runs anything, without preexec_fn.
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        files = [str(f) for f in fs.procs_files(path)]
        proc = subprocess.Popen(["sh", "-c", join, "join", *files, "--", *argv], stderr=stderr)
        started.append(proc)
        return proc

    yield start
    for proc in started:  # reap, so nothing outlives the test even when kill_all was not reached
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def kernel_file(controller: str, path: str, name: str) -> str:
    return (find_v1_mounts()[controller] / BASE / path / name).read_text().strip()


def test_nested_limits_read_back(fs: Cgroupfs) -> None:
    fs.create(
        "web",
        CgroupLimits(
            cpu_weight=200,
            cpu_max_us=50_000,
            cpu_period_us=100_000,
            cpuset_cpus="0",
            cpuset_mems="0",
            memory_max=256 * MIB,
            pids_max=100,
        ),
    )
    fs.create("web/api", CgroupLimits(cpu_weight=50, cpu_max_us=20_000, memory_max=64 * MIB, pids_max=10))
    assert kernel_file("cpu", "web", "cpu.shares") == str(cpu_weight_to_shares(200))
    assert kernel_file("cpu", "web", "cpu.cfs_quota_us") == "50000"
    assert kernel_file("cpu", "web", "cpu.cfs_period_us") == "100000"
    assert kernel_file("cpuset", "web", "cpuset.cpus") == "0"
    assert kernel_file("memory", "web", "memory.limit_in_bytes") == str(256 * MIB)
    assert kernel_file("pids", "web", "pids.max") == "100"
    assert kernel_file("cpu", "web/api", "cpu.shares") == str(cpu_weight_to_shares(50))
    assert kernel_file("cpu", "web/api", "cpu.cfs_quota_us") == "20000"
    assert kernel_file("cpuset", "web/api", "cpuset.cpus") == "0"  # copied from the parent
    assert kernel_file("cpuset", "web/api", "cpuset.mems") == "0"
    assert kernel_file("memory", "web/api", "memory.limit_in_bytes") == str(64 * MIB)
    assert kernel_file("pids", "web/api", "pids.max") == "10"
    assert fs.list_children("") == ["web"]
    assert fs.list_children("web") == ["api"]
    fs.update("web/api", CgroupLimits(pids_max=20))
    assert kernel_file("pids", "web/api", "pids.max") == "20"
    for d in fs.cgroup_dirs("web/api"):
        assert d.is_dir()


def test_kernel_rejection_rolls_back(fs: Cgroupfs) -> None:
    with pytest.raises(CgroupError) as err:
        fs.create("bad", CgroupLimits(pids_max=5, cpuset_cpus="0-63"))
    assert err.value.kind == "invalid"
    assert "cpuset.cpus" in str(err.value)
    assert not fs.exists("bad")
    assert leftovers() == []  # the base created on demand is gone too
    with pytest.raises(CgroupError) as err:
        fs.create("bad", CgroupLimits(memory_high=MIB))
    assert err.value.kind == "unsupported"


def test_processes_listed_and_killed(fs: Cgroupfs, spawn: Spawn) -> None:
    fs.create("web", CgroupLimits())
    fs.create("web/api", CgroupLimits())
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        fs.add_process("web", sleeper.pid)
        forker = spawn("web/api", ["sh", "-c", "sleep 60 & sleep 60 & wait"])
        # The shell and its two sleeps, once it has forked them.
        deadline = time.monotonic() + 10
        while len(fs.pids("web/api")) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fs.pids("web") == [sleeper.pid]
        assert forker.pid in fs.pids("web/api")
        assert len(fs.pids("web/api")) == 3
        assert fs.memory_current("web") > 0
        proc_cgroup = Path(f"/proc/{forker.pid}/cgroup").read_text().splitlines()
        for controller in ("cpu", "cpuset", "memory", "pids", "freezer"):
            line = next(x for x in proc_cgroup if controller in x.split(":")[1].split(","))
            assert line.split(":")[2] == fs.cgroup_path("web/api")
        with pytest.raises(CgroupError) as err:
            fs.remove("web/api")
        assert err.value.kind == "busy"
        fs.kill_all("web")
        assert sleeper.wait(timeout=5) == -9
        assert forker.wait(timeout=5) == -9
        assert fs.pids("web") == []
        assert fs.pids("web/api") == []
        fs.remove("web/api")
        fs.remove("web")
        fs.remove("web")  # idempotent
        assert not fs.exists("web")
        assert all(not d.exists() for d in fs.cgroup_dirs("web"))
    finally:
        sleeper.kill()
        sleeper.wait()


def test_oom_kill_counted(fs: Cgroupfs, spawn: Spawn) -> None:
    fs.create("oom", CgroupLimits(memory_max=32 * MIB))
    before = fs.oom_kill_count("oom")
    hog = spawn("oom", [sys.executable, "-c", "data = b'x' * (200 * 1024 * 1024)"])
    assert hog.wait(timeout=30) == -9
    assert fs.oom_kill_count("oom") >= before + 1
    assert read_oom_kill_count(fs.oom_counter_file("oom")) == fs.oom_kill_count("oom")


def test_pids_max_blocks_forks(fs: Cgroupfs, spawn: Spawn) -> None:
    fs.create("forks", CgroupLimits(pids_max=5))
    script = "for i in $(seq 20); do sleep 1 & done; wait"
    proc = spawn("forks", ["sh", "-c", script], stderr=subprocess.PIPE)
    _out, err = proc.communicate(timeout=30)
    assert b"fork" in err.lower()
    events = kernel_file("pids", "forks", "pids.events")
    assert int(events.split()[1]) > 0  # "max <number of refused forks>"


def test_cpu_quota_throttles(fs: Cgroupfs, spawn: Spawn) -> None:
    fs.create("cpu", CgroupLimits(cpu_max_us=10_000, cpu_period_us=100_000))
    busy = "import time\nend = time.monotonic() + 1\nwhile time.monotonic() < end: pass"
    proc = spawn("cpu", [sys.executable, "-c", busy])
    assert proc.wait(timeout=30) == 0
    stat = fs.cpu_stat("cpu")
    assert stat["nr_periods"] > 0
    assert stat["nr_throttled"] > 0
    assert stat["throttled_usec"] > 0
    assert 0 < stat["usage_usec"] < 600_000  # ~10% of the ~1 s wall time, plus startup


def test_remove_busy_with_child_then_idempotent(fs: Cgroupfs) -> None:
    fs.create("a", CgroupLimits())
    fs.create("a/b", CgroupLimits())
    with pytest.raises(CgroupError) as err:
        fs.remove("a")
    assert err.value.kind == "busy"
    assert fs.exists("a/b")  # nothing half-removed
    fs.remove_tree("a")
    fs.remove_tree("a")
    assert not fs.exists("a")
