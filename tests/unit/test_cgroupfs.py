"""Unit tests for auraed.system.cgroupfs on fake cgroup trees in tmp_path (no kernel needed)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from auraed.system.cgroupfs import (
    CgroupError,
    Cgroupfs,
    CgroupLayout,
    CgroupLimits,
    IoCounters,
    cpu_weight_to_shares,
    cpus_present,
    detect_layout,
    find_v1_mounts,
    format_cpu_list,
    parse_cpu_list,
)

NO_MOUNTINFO = Path("/nonexistent/mountinfo")  # force the directory-based discovery on fake trees

V2_FILES = {
    "cgroup.procs": "",
    "cgroup.subtree_control": "",
    "cgroup.events": "populated 0\nfrozen 0\n",
    "cgroup.freeze": "0\n",
    "cgroup.kill": "",
}
V2_CONTROLLER_FILES = {
    "cpu": {"cpu.weight": "100\n", "cpu.max": "max 100000\n", "cpu.stat": "usage_usec 7\nnr_periods 3\n"},
    "cpuset": {"cpuset.cpus": "\n", "cpuset.mems": "\n"},
    "memory": {
        "memory.min": "0\n",
        "memory.low": "0\n",
        "memory.high": "max\n",
        "memory.max": "max\n",
        "memory.current": "4096\n",
        "memory.events": "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n",
    },
    "pids": {"pids.max": "max\n"},
}
V1_FILES = {
    "cgroup.procs": "",
    "cpu.shares": "1024\n",
    "cpu.cfs_period_us": "100000\n",
    "cpu.cfs_quota_us": "-1\n",
    "cpu.stat": "nr_periods 10\nnr_throttled 4\nthrottled_time 5000000\n",
    "cpuacct.usage": "2000000\n",
    "cpuset.cpus": "\n",
    "cpuset.mems": "\n",
    "memory.limit_in_bytes": "9223372036854771712\n",
    "memory.usage_in_bytes": "8192\n",
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
    "pids.max": "max\n",
    "freezer.state": "THAWED\n",
}


class FakeCgroupOps:
    """Stands in for the kernel: mkdir populates interface files, rmdir drops them (EBUSY with children)."""

    def __init__(self, v2: bool, omit: frozenset[str] = frozenset()) -> None:
        self.v2 = v2
        self.omit = omit
        self.mkdirs: list[Path] = []
        self.rmdirs: list[Path] = []

    def mkdir(self, path: Path) -> None:
        path.mkdir()
        self.mkdirs.append(path)
        files = dict(V2_FILES) if self.v2 else dict(V1_FILES)
        if self.v2:
            # The kernel exposes to a child exactly the controllers enabled in its parent.
            enabled = [c.lstrip("+") for c in (path.parent / "cgroup.subtree_control").read_text().split()]
            files["cgroup.controllers"] = " ".join(enabled) + "\n"
            for controller in enabled:
                files.update(V2_CONTROLLER_FILES.get(controller, {}))
        for name, content in files.items():
            if name not in self.omit:
                (path / name).write_text(content)

    def rmdir(self, path: Path) -> None:
        if any(entry.is_dir() for entry in path.iterdir()):
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        for entry in path.iterdir():
            entry.unlink()
        path.rmdir()
        self.rmdirs.append(path)


def make_v2_root(root: Path, controllers: str = "cpuset cpu io memory hugetlb pids rdma misc") -> Path:
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("1\n")
    return root


def make_v1_root(root: Path, unified: bool = False) -> Path:
    """cpu and cpuacct co-mounted as "cpu,cpuacct" with symlinks, like most systemd hosts."""
    for name in ("cpu,cpuacct", "cpuset", "memory", "pids", "freezer", "devices"):
        (root / name).mkdir(parents=True)
        (root / name / "cgroup.procs").write_text("1\n")
    (root / "cpu").symlink_to("cpu,cpuacct")
    (root / "cpuacct").symlink_to("cpu,cpuacct")
    (root / "cpuset" / "cpuset.cpus").write_text("0-3\n")
    (root / "cpuset" / "cpuset.mems").write_text("0\n")
    if unified:
        (root / "unified").mkdir()
        (root / "unified" / "cgroup.controllers").write_text("hugetlb\n")
    return root


@pytest.fixture
def v2(tmp_path: Path) -> tuple[Cgroupfs, FakeCgroupOps, Path]:
    root = make_v2_root(tmp_path / "cg")
    ops = FakeCgroupOps(v2=True)
    return Cgroupfs(root, mountinfo=NO_MOUNTINFO, dir_ops=ops), ops, root


@pytest.fixture
def v1(tmp_path: Path) -> tuple[Cgroupfs, FakeCgroupOps, Path]:
    root = make_v1_root(tmp_path / "cg")
    ops = FakeCgroupOps(v2=False)
    return Cgroupfs(root, mountinfo=NO_MOUNTINFO, dir_ops=ops), ops, root


def read(path: Path) -> str:
    return path.read_text().strip()


# ---------------------------------------------------------------------------- cpu lists


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", set()), ("0", {0}), ("0-2,4", {0, 1, 2, 4}), ("3\n", {3}), ("1-1", {1}), ("007", {7})],
)
def test_parse_cpu_list(text: str, expected: set[int]) -> None:
    assert parse_cpu_list(text) == expected


@pytest.mark.parametrize(
    "text", ["a", "1-", "-1", "3-1", "1,,2", "1 2", ",", "1-2-3", "0x1", "\u0663", "0-99999999", "1,"]
)
def test_parse_cpu_list_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="malformed cpu list"):
        parse_cpu_list(text)


@given(st.sets(st.integers(min_value=0, max_value=1024), max_size=64))
def test_cpu_list_round_trip(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_format_cpu_list_collapses_runs() -> None:
    assert format_cpu_list({0, 1, 2, 4, 6, 7}) == "0-2,4,6-7"


def test_cpus_present(tmp_path: Path) -> None:
    (tmp_path / "online").write_text("0-1\n")
    assert cpus_present(tmp_path) == {0, 1}
    (tmp_path / "present").write_text("0-3\n")
    assert cpus_present(tmp_path) == {0, 1, 2, 3}
    with pytest.raises(CgroupError) as err:
        cpus_present(tmp_path / "missing")
    assert err.value.kind == "not_found"


# ---------------------------------------------------------------------------- weight -> shares


def test_weight_to_shares_bounds() -> None:
    assert cpu_weight_to_shares(1) == 2
    assert cpu_weight_to_shares(10_000) == 262_144
    assert cpu_weight_to_shares(100) == 2 + (99 * 262_142) // 9_999


@given(st.integers(min_value=1, max_value=9_999))
def test_weight_to_shares_monotonic(weight: int) -> None:
    assert 2 <= cpu_weight_to_shares(weight) <= cpu_weight_to_shares(weight + 1) <= 262_144


@pytest.mark.parametrize("weight", [0, -1, 10_001])
def test_weight_out_of_range(weight: int) -> None:
    with pytest.raises(CgroupError) as err:
        cpu_weight_to_shares(weight)
    assert err.value.kind == "invalid"


# ---------------------------------------------------------------------------- layout detection


def test_detect_v2(tmp_path: Path) -> None:
    assert detect_layout(make_v2_root(tmp_path), NO_MOUNTINFO) is CgroupLayout.V2


def test_detect_v1_and_hybrid(tmp_path: Path) -> None:
    assert detect_layout(make_v1_root(tmp_path / "a"), NO_MOUNTINFO) is CgroupLayout.V1
    assert detect_layout(make_v1_root(tmp_path / "b", unified=True), NO_MOUNTINFO) is CgroupLayout.HYBRID


def test_detect_nothing(tmp_path: Path) -> None:
    with pytest.raises(CgroupError) as err:
        detect_layout(tmp_path, NO_MOUNTINFO)
    assert err.value.kind == "unsupported"


def test_v1_mounts_from_mountinfo(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"31 23 0:28 / {root} rw - tmpfs tmpfs rw\n"
        f"32 31 0:29 / {root}/cpu\\040acct rw,relatime shared:5 - cgroup cgroup rw,cpu,cpuacct\n"
        f"34 31 0:31 / {root}/cs rw,relatime - cgroup cgroup rw,cpuset\n"
        f"35 31 0:32 / {root}/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
        f"36 31 0:32 / /elsewhere/memory rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert find_v1_mounts(root, mountinfo) == {
        "cpu": root / "cpu acct",
        "cpuacct": root / "cpu acct",
        "cpuset": root / "cs",
    }


def test_v1_mounts_from_dirs_dedupes_comounted(tmp_path: Path) -> None:
    root = make_v1_root(tmp_path)
    mounts = find_v1_mounts(root, NO_MOUNTINFO)
    assert mounts["cpu"] == mounts["cpuacct"] == (root / "cpu,cpuacct").resolve()
    assert set(mounts) == {"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer"}


# ---------------------------------------------------------------------------- v2 on a fake tree

ALL_V2 = CgroupLimits(
    cpu_weight=500,
    cpu_max_us=50_000,
    cpuset_cpus="0-1",
    cpuset_mems="0",
    memory_min=1 << 20,
    memory_low=2 << 20,
    memory_high=3 << 20,
    memory_max=4 << 20,
    pids_max=64,
)


def test_v2_create_writes_limits(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, ops, root = v2
    assert fs.layout is CgroupLayout.V2
    assert fs.controllers() == ["cpu", "cpuset", "io", "memory", "pids"]
    fs.create("web", ALL_V2)
    web = root / "aurae" / "web"
    assert ops.mkdirs == [root / "aurae", web]
    assert read(root / "cgroup.subtree_control") == "+cpu +cpuset +io +memory +pids"
    assert read(root / "aurae" / "cgroup.subtree_control") == "+cpu +cpuset +io +memory +pids"
    assert read(web / "cgroup.subtree_control") == ""  # a leaf: processes go here
    assert read(web / "cpu.weight") == "500"
    assert read(web / "cpu.max") == "50000 100000"
    assert read(web / "cpuset.cpus") == "0-1"
    assert read(web / "cpuset.mems") == "0"
    assert read(web / "memory.min") == str(1 << 20)
    assert read(web / "memory.low") == str(2 << 20)
    assert read(web / "memory.high") == str(3 << 20)
    assert read(web / "memory.max") == str(4 << 20)
    assert read(web / "pids.max") == "64"
    assert fs.exists("web")
    assert fs.cgroup_path("web") == "/aurae/web"
    assert fs.procs_files("web") == [web / "cgroup.procs"]
    assert fs.join_files("web") == [web / "cgroup.procs"]  # v2 moves whole processes only


def test_v2_nested_enables_parent_and_untouched_defaults(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("web", CgroupLimits())
    fs.create("web/api", CgroupLimits(cpu_max_us=20_000, cpu_period_us=50_000))
    api = root / "aurae" / "web" / "api"
    assert read(root / "aurae" / "web" / "cgroup.subtree_control") == "+cpu +cpuset +io +memory +pids"
    assert read(api / "cpu.max") == "20000 50000"
    assert read(api / "memory.max") == "max"  # None leaves the kernel default
    assert fs.list_children("") == ["web"]
    assert fs.list_children("web") == ["api"]


def test_v2_update_period_only_keeps_quota(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("web", CgroupLimits(cpu_max_us=30_000))
    fs.update("web", CgroupLimits(cpu_period_us=200_000, pids_max=7))
    assert read(root / "aurae" / "web" / "cpu.max") == "30000 200000"
    assert read(root / "aurae" / "web" / "pids.max") == "7"
    with pytest.raises(CgroupError) as err:
        fs.update("nope", CgroupLimits(pids_max=1))
    assert err.value.kind == "not_found"


def test_v2_missing_parent_rolls_back_base(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    with pytest.raises(CgroupError) as err:
        fs.create("web/api", CgroupLimits())
    assert err.value.kind == "not_found"
    assert not (root / "aurae").exists()


def test_v2_failed_limit_removes_everything_created(tmp_path: Path) -> None:
    root = make_v2_root(tmp_path / "cg")
    ops = FakeCgroupOps(v2=True, omit=frozenset({"pids.max"}))
    fs = Cgroupfs(root, mountinfo=NO_MOUNTINFO, dir_ops=ops)
    with pytest.raises(CgroupError) as err:
        fs.create("web", CgroupLimits(cpu_weight=10, pids_max=5))
    assert err.value.kind == "unsupported"
    assert "pids.max" in str(err.value)
    assert ops.rmdirs == [root / "aurae" / "web", root / "aurae"]
    assert not (root / "aurae").exists()


def test_v2_existing_is_busy(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, _root = v2
    fs.create("web", CgroupLimits())
    with pytest.raises(CgroupError) as err:
        fs.create("web", CgroupLimits())
    assert err.value.kind == "busy"


def test_v2_unavailable_controller_is_unsupported(tmp_path: Path) -> None:
    root = make_v2_root(tmp_path / "cg", controllers="cpu memory")
    fs = Cgroupfs(root, mountinfo=NO_MOUNTINFO, dir_ops=FakeCgroupOps(v2=True))
    assert fs.controllers() == ["cpu", "memory"]
    with pytest.raises(CgroupError) as err:
        fs.create("web", CgroupLimits(pids_max=3))
    assert err.value.kind == "unsupported"
    assert "pids_max" in str(err.value)
    fs.create("web", CgroupLimits(memory_max=1 << 20))
    assert read(root / "cgroup.subtree_control") == "+cpu +memory"


@pytest.mark.parametrize(
    "limits",
    [
        CgroupLimits(cpu_weight=0),
        CgroupLimits(cpu_weight=10_001),
        CgroupLimits(cpu_max_us=999),
        CgroupLimits(cpu_period_us=2_000_000),
        CgroupLimits(cpuset_cpus="0-"),
        CgroupLimits(cpuset_mems=""),
        CgroupLimits(memory_max=-1),
        CgroupLimits(pids_max=-5),
    ],
)
def test_invalid_limits(v2: tuple[Cgroupfs, FakeCgroupOps, Path], limits: CgroupLimits) -> None:
    fs, ops, _root = v2
    with pytest.raises(CgroupError) as err:
        fs.create("web", limits)
    assert err.value.kind == "invalid"
    assert ops.mkdirs == []


@pytest.mark.parametrize("path", ["", "/web", "web/", "a//b", "..", "a/../b", ".hidden", "a b", "x\n"])
def test_invalid_paths(v2: tuple[Cgroupfs, FakeCgroupOps, Path], path: str) -> None:
    fs, _ops, _root = v2
    with pytest.raises(CgroupError) as err:
        fs.create(path, CgroupLimits())
    assert err.value.kind == "invalid"


def test_v2_remove(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("web", CgroupLimits())
    fs.create("web/api", CgroupLimits())
    with pytest.raises(CgroupError) as err:
        fs.remove("web")
    assert err.value.kind == "busy"
    (root / "aurae" / "web" / "api" / "cgroup.procs").write_text("4242\n")
    assert fs.pids("web/api") == [4242]
    with pytest.raises(CgroupError) as err:
        fs.remove("web/api")
    assert err.value.kind == "busy"
    assert "4242" in str(err.value)
    (root / "aurae" / "web" / "api" / "cgroup.procs").write_text("")
    fs.remove_tree("")
    assert not (root / "aurae").exists()
    fs.remove("web")  # idempotent
    assert fs.list_children("") == []


def test_v2_kill_all_uses_cgroup_kill(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("web", CgroupLimits())
    fs.kill_all("web")
    assert read(root / "aurae" / "web" / "cgroup.kill") == "1"
    fs.kill_all("missing")  # nothing to kill


def test_v2_stats_and_process_files(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("web", CgroupLimits())
    web = root / "aurae" / "web"
    assert fs.oom_counter_file("web") == web / "memory.events"
    assert fs.oom_kill_count("web") == 1
    assert fs.memory_current("web") == 4096
    assert fs.cpu_stat("web") == {"usage_usec": 7, "nr_periods": 3}
    fs.add_process("web", 1234)
    assert read(web / "cgroup.procs") == "1234"
    with pytest.raises(CgroupError) as err:
        fs.memory_current("nope")
    assert err.value.kind == "not_found"


# ---------------------------------------------------------------------------- v1 on a fake tree


def test_v1_refuses_v2_only_memory_fields(v1: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, ops, _root = v1
    refused = {
        "memory_min": CgroupLimits(memory_min=1 << 20),
        "memory_low": CgroupLimits(memory_low=1 << 20),
        "memory_high": CgroupLimits(memory_high=1 << 20, memory_max=2 << 20),
    }
    for field, limits in refused.items():
        with pytest.raises(CgroupError) as err:
            fs.create("web", limits)
        assert err.value.kind == "unsupported"
        assert field in str(err.value)
    assert ops.mkdirs == []


def test_v1_create_each_hierarchy_once(v1: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, ops, root = v1
    assert fs.layout is CgroupLayout.V1
    assert fs.controllers() == ["cpu", "cpuacct", "cpuset", "freezer", "memory", "pids"]
    fs.create("web", CgroupLimits(cpu_weight=100, cpu_max_us=25_000, memory_max=1 << 26, pids_max=9))
    hierarchies = ["cpu,cpuacct", "cpuset", "freezer", "memory", "pids"]
    made = sorted(str(p.relative_to(root.resolve())) for p in ops.mkdirs)
    assert made == sorted([f"{h}/aurae" for h in hierarchies] + [f"{h}/aurae/web" for h in hierarchies])
    cpu = root / "cpu" / "aurae" / "web"
    assert read(cpu / "cpu.shares") == str(cpu_weight_to_shares(100))
    assert read(cpu / "cpu.cfs_quota_us") == "25000"
    assert read(cpu / "cpu.cfs_period_us") == "100000"
    assert read(root / "memory" / "aurae" / "web" / "memory.limit_in_bytes") == str(1 << 26)
    assert read(root / "pids" / "aurae" / "web" / "pids.max") == "9"
    # v1 cpuset children start empty: base and child copy the parent's cpus/mems.
    for d in (root / "cpuset" / "aurae", root / "cpuset" / "aurae" / "web"):
        assert read(d / "cpuset.cpus") == "0-3"
        assert read(d / "cpuset.mems") == "0"
    assert len(fs.procs_files("web")) == 5
    # v1: a new process joins through "tasks", moving its one thread (no RCU grace period).
    assert fs.join_files("web") == [f.with_name("tasks") for f in fs.procs_files("web")]


def test_v1_explicit_cpuset_and_remove(v1: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, ops, root = v1
    fs.create("web", CgroupLimits(cpuset_cpus="1"))
    assert read(root / "cpuset" / "aurae" / "web" / "cpuset.cpus") == "1"
    fs.remove_tree("")
    assert len(ops.rmdirs) == 10
    assert not any((root / h / "aurae").exists() for h in ("cpu", "cpuset", "memory", "pids", "freezer"))


def test_v1_stats_kill_and_paths(v1: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v1
    fs.create("web", CgroupLimits())
    assert fs.cpu_stat("web") == {
        "nr_periods": 10,
        "nr_throttled": 4,
        "throttled_usec": 5000,
        "usage_usec": 2000,
    }
    assert fs.oom_counter_file("web") == root.resolve() / "memory" / "aurae" / "web" / "memory.oom_control"
    assert fs.oom_kill_count("web") == 3
    assert fs.memory_current("web") == 8192
    fs.kill_all("web")  # freeze, nothing to kill, thaw
    assert read(root / "freezer" / "aurae" / "web" / "freezer.state") == "THAWED"


# ---------------------------------------------------------------------------- what metrics read


def test_v2_memory_cpu_io_and_processes(v2: tuple[Cgroupfs, FakeCgroupOps, Path]) -> None:
    fs, _ops, root = v2
    fs.create("pod", CgroupLimits(cpu_max_us=20_000, cpu_period_us=50_000, cpu_weight=100))
    fs.create("pod/c1", CgroupLimits())
    pod = root / "aurae" / "pod"
    (pod / "memory.stat").write_text("anon 100\nfile 200\nfile_mapped 30\ninactive_file 50\npgfault 7\n")
    (pod / "memory.peak").write_text("9000\n")
    (pod / "io.stat").write_text("8:0 rbytes=10 wbytes=20 rios=1 wios=2 dbytes=0 dios=0\n\n253:1 rbytes=5\n")
    (pod / "c1" / "cgroup.procs").write_text("11\n12\n")
    (pod / "cgroup.procs").write_text("10\n")
    assert fs.memory_stat("pod")["anon"] == 100 and fs.memory_stat("pod")["file_mapped"] == 30
    assert fs.memory_peak("pod") == 9000
    assert fs.memory_swap("pod") is None  # no memory.swap.current: no swap accounting
    assert fs.cpu_max("pod") == (20_000, 50_000)
    assert fs.cpu_max("pod/c1") == (None, 100_000)
    assert fs.cpu_shares("pod") == cpu_weight_to_shares(100)
    assert fs.io_stat("pod") == {"8:0": IoCounters(10, 20, 1, 2), "253:1": IoCounters(5, 0, 0, 0)}
    assert fs.io_bytes("pod") == (15, 20)
    assert fs.process_count("pod") == 3
    assert fs.memory_peak("pod/c1") is None  # a kernel before 5.19 has no memory.peak


def test_v1_memory_cpu_io_and_processes(tmp_path: Path) -> None:
    root = make_v1_root(tmp_path / "cg")
    (root / "blkio").mkdir()
    (root / "blkio" / "cgroup.procs").write_text("1\n")
    fs = Cgroupfs(root, mountinfo=NO_MOUNTINFO, dir_ops=FakeCgroupOps(v2=False))
    fs.create("pod", CgroupLimits(cpu_max_us=20_000))
    memory = root / "memory" / "aurae" / "pod"
    (memory / "memory.stat").write_text(
        "rss 1\ncache 2\ntotal_rss 100\ntotal_cache 200\ntotal_mapped_file 30\ntotal_pgmajfault 4\n"
    )
    (memory / "memory.max_usage_in_bytes").write_text("9000\n")
    (memory / "memory.memsw.usage_in_bytes").write_text("10192\n")  # usage is 8192
    assert fs.memory_stat("pod") == {"anon": 100, "file": 200, "file_mapped": 30, "pgmajfault": 4}
    assert fs.memory_peak("pod") == 9000
    assert fs.memory_swap("pod") == 2000
    assert fs.cpu_max("pod") == (20_000, 100_000)
    assert fs.cpu_shares("pod") == 1024

    blkio = root / "blkio" / "aurae" / "pod"
    lines = "8:0 Read 10\n8:0 Write 20\n8:0 Sync 30\n8:0 Total 30\n8:16 Read 5\nTotal 35\n"
    (blkio / "blkio.throttle.io_service_bytes").write_text(lines)
    (blkio / "blkio.throttle.io_serviced").write_text("8:0 Read 1\n8:0 Write 2\nTotal 3\n")
    # Without the recursive counters (an older kernel), the cgroup's own.
    assert fs.io_stat("pod") == {"8:0": IoCounters(10, 20, 1, 2), "8:16": IoCounters(5, 0, 0, 0)}
    (blkio / "blkio.throttle.io_service_bytes_recursive").write_text("8:0 Read 70\nTotal 70\n")
    (blkio / "blkio.throttle.io_serviced_recursive").write_text("8:0 Read 7\nTotal 7\n")
    assert fs.io_stat("pod") == {"8:0": IoCounters(70, 0, 7, 0)}
    assert fs.io_bytes("pod") == (70, 0)
