"""auraed.system.monitor and auraed.system.namespaces on this host (root; cgroup v1/hybrid for the
cgroup tests).

Every fixture cleans up what it made even when a test fails: executables and monitors are killed
(identified by pid + start ticks), cgroup directories removed, namespace files unmounted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.system.cri_log import LOG_LINE_MAX, format_cri_timestamp, parse_cri_log_line, parse_rfc3339_ns
from auraed.system.monitor import monitor_command
from auraed.system.monitor_protocol import ExitRecord, MonitorSpec, read_exit_record
from auraed.system.namespaces import create_network_namespace, remove_network_namespace

CGROUP_V1 = Path("/sys/fs/cgroup")
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"]
TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return None if fields[0] == b"Z" else int(fields[19])


def kill_if_same(pid: int, ticks: int | None, sig: int = signal.SIGKILL) -> None:
    if ticks is not None and start_ticks(pid) == ticks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def read_sync(fd: int, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no sync line within {timeout}s (got {data!r})"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    assert data, "sync fd closed without a line"
    result: dict[str, Any] = json.loads(data)
    return result


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Run:
    def __init__(self, spec: MonitorSpec, monitor_pid: int, sync: dict[str, Any]) -> None:
        self.spec = spec
        self.monitor_pid = monitor_pid
        self.sync = sync

    @property
    def pid(self) -> int:
        pid: int = self.sync["pid"]
        return pid

    def wait_exit(self, timeout: float = 15.0) -> ExitRecord:
        wait_for(lambda: Path(self.spec.exit_path).exists(), timeout, "exit.json")
        record = read_exit_record(self.spec.exit_path)
        assert record is not None
        return record

    def records(self) -> list[tuple[float, str, bool, str]]:
        text = Path(self.spec.log_path).read_text()
        return [parse_cri_log_line(line) for line in text.splitlines()]

    def lines(self, stream: str) -> list[str]:
        return [content for _, name, _, content in self.records() if name == stream]


class Monitors:
    """Starts monitors; kills whatever is left at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.count = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: list[tuple[int, int | None]] = []

    def spec(self, argv: list[str], **kwargs: Any) -> MonitorSpec:
        self.count += 1
        directory = self.base / f"exe{self.count}"
        directory.mkdir()
        kwargs.setdefault("env", ENV)
        return MonitorSpec(
            argv=argv,
            log_path=str(directory / "output.log"),
            exit_path=str(directory / "exit.json"),
            **kwargs,
        )

    def command(self, spec: MonitorSpec, sync_fd: int) -> list[str]:
        spec_path = Path(spec.exit_path).parent / "spec.json"
        spec_path.write_text(spec.to_json())
        return [sys.executable, "-m", "auraed.system.monitor", str(spec_path), str(sync_fd)]

    def start(self, spec: MonitorSpec, fast: bool = False) -> Run:
        r, w = os.pipe()
        try:
            cmd = self.command(spec, w)
            if fast:
                cmd = monitor_command(cmd[-2], w)
            stderr = open(Path(spec.exit_path).parent / "monitor.err", "wb")  # noqa: SIM115
            with stderr:
                proc = subprocess.Popen(
                    cmd, pass_fds=[w], stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr
                )
            self.procs.append(proc)
            self.pids.append((proc.pid, start_ticks(proc.pid)))
            os.close(w)
            w = -1
            sync = read_sync(r)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if "pid" in sync:
            self.pids.append((sync["pid"], sync["start_ticks"]))
        return Run(spec, proc.pid, sync)

    def track(self, pid: int) -> None:
        self.pids.append((pid, start_ticks(pid)))

    def cleanup(self) -> None:
        for pid, ticks in reversed(self.pids):
            kill_if_same(pid, ticks)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def monitors(tmp_path: Path) -> Iterator[Monitors]:
    m = Monitors(tmp_path)
    try:
        yield m
    finally:
        m.cleanup()


def make_cgroup(controller: str) -> Path:
    root = CGROUP_V1 / controller
    assert (root / "cgroup.procs").exists(), f"no cgroup v1 {controller} hierarchy"
    path = root / f"aurae-montest-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


def remove_cgroup(path: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    path = make_cgroup("pids")
    try:
        yield path
    finally:
        remove_cgroup(path)


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    path = make_cgroup("memory")
    try:
        (path / "memory.limit_in_bytes").write_text(str(32 << 20))
        memsw = path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(32 << 20))
        yield path
    finally:
        remove_cgroup(path)


@pytest.fixture
def netns_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "netns" / "cell0"
    try:
        yield path
    finally:
        remove_network_namespace(path)


# ------------------------------------------------------------------------------------ pure helpers


def test_spec_round_trip() -> None:
    spec = MonitorSpec(
        argv=["/bin/sh", "-c", 'echo "\u00e9"'],
        log_path="/run/x/output.log",
        exit_path="/run/x/exit.json",
        env=["A=1"],
        uid=1000,
        cgroup_join_files=["/sys/fs/cgroup/pids/x/cgroup.procs"],
        new_pid_ns=True,
        hostname="h",
    )
    data = json.loads(spec.to_json())
    assert data["argv"] == ["/bin/sh", "-c", 'echo "\u00e9"']
    assert data["uid"] == 1000 and data["gid"] is None and data["new_pid_ns"] is True
    assert data["netns_path"] is None and data["oom_counter_file"] is None
    assert MonitorSpec.from_json(spec.to_json()) == spec


def test_cri_timestamps_and_lines() -> None:
    ns = 1_796_000_000_123_456_789
    ts = format_cri_timestamp(ns)
    assert TS_RE.match(ts)
    assert parse_rfc3339_ns(ts) == ns
    assert parse_rfc3339_ns("1970-01-01T00:00:00Z") == 0
    assert parse_rfc3339_ns("2000-03-01T01:00:00.5+01:00") == 951868800 * 10**9 + 5 * 10**8
    assert parse_cri_log_line(f"{ts} stdout P a b  c\n") == (ns / 1e9, "stdout", True, "a b  c")
    assert parse_cri_log_line(f"{ts} stderr F ") == (ns / 1e9, "stderr", False, "")
    with pytest.raises(ValueError):
        parse_cri_log_line("garbage")


def test_read_exit_record_missing(tmp_path: Path) -> None:
    assert read_exit_record(tmp_path / "nope.json") is None


def test_monitor_path_imports_stay_lean(tmp_path: Path) -> None:
    """The fast launch form must not import json/re/enum/typing/dataclasses/ctypes for a plain run."""
    spec = MonitorSpec(
        argv=["true"], env=ENV, log_path=str(tmp_path / "o.log"), exit_path=str(tmp_path / "e.json")
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    r, w = os.pipe()
    cmd = monitor_command(str(tmp_path / "spec.json"), w)
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]], pass_fds=[w], capture_output=True, check=True
    )
    os.close(w)
    assert json.loads(os.read(r, 4096))["pid"] > 0
    os.close(r)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.decode().splitlines() if "|" in line}
    assert not modules & {"json", "re", "enum", "typing", "dataclasses", "ctypes", "signal", "contextlib"}
    assert read_exit_record(spec.exit_path) is not None


# ---------------------------------------------------------------------------------- monitor basics


def test_stdout_and_stderr_land_in_cri_log(monitors: Monitors) -> None:
    before = time.time()
    run = monitors.start(
        monitors.spec(["sh", "-c", "echo out1; echo err1 >&2; echo; echo out2; printf tail"])
    )
    assert run.pid > 0 and isinstance(run.sync["start_ticks"], int)
    record = run.wait_exit()
    assert (record.exit_code, record.signal, record.oom_killed, record.error) == (0, None, False, None)
    assert before <= record.started_at <= record.finished_at <= time.time()
    # "tail" has no newline: logged as written (P), its line ended by an empty F at EOF.
    stdout = [(partial, content) for _, name, partial, content in run.records() if name == "stdout"]
    assert stdout == [(False, "out1"), (False, ""), (False, "out2"), (True, "tail"), (False, "")]
    assert run.lines("stderr") == ["err1"]
    raw = Path(run.spec.log_path).read_text().splitlines()
    for line in raw:
        assert TS_RE.match(line.split(" ", 1)[0])
        assert line.split(" ")[2] in ("F", "P")
    for ts, _, _, _ in run.records():
        assert before - 1 <= ts <= time.time() + 1


# A stand-in for `runc run --detach`: it starts the process, writes the pid file, and only exits
# once the monitor has logged the process's stdout (or gives up after ~10 s, failing the run).
# It notes whether stderr, written first, was in the log by then.
FAKE_RUNTIME_RUN = """
pid_file=$1 log=$2 seen=$3
sh -c 'echo early-err >&2; echo early-out; exec sleep 100' &
echo $! > "$pid_file"
tries=0
until grep -q early-out "$log" 2>/dev/null; do
    tries=$((tries + 1)); [ $tries -gt 500 ] && exit 3
    sleep 0.02
done
grep -c early-err "$log" > "$seen"
exit 0
"""


def test_runtime_starts_logs_stdout_before_the_runtime_exits(monitors: Monitors, tmp_path: Path) -> None:
    """With runtime_starts a follower sees stdout at once; stderr, which also carries the
    runtime's own errors, waits until the runtime has succeeded."""
    spec = monitors.spec(["sh"], subreaper=True, runtime_starts=True)
    pid_file, seen = tmp_path / "container.pid", tmp_path / "seen"
    spec.pid_file = str(pid_file)
    spec.argv = ["sh", "-c", FAKE_RUNTIME_RUN, "runtime", str(pid_file), spec.log_path, str(seen)]
    run = monitors.start(spec)
    assert "pid" in run.sync, run.sync
    wait_for(lambda: run.lines("stderr") == ["early-err"], what="stderr logged after the runtime")
    assert run.lines("stdout") == ["early-out"]
    assert seen.read_text().strip() == "0"  # stderr was still held while the runtime ran
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait_exit().signal == signal.SIGKILL


def test_output_without_a_newline_is_logged_as_it_is_written(monitors: Monitors, tmp_path: Path) -> None:
    """What a read brings is logged at once, a line or not (an attach follows the log): the
    start of a line as a P record while the process waits, its end as the F record."""
    go = tmp_path / "go"
    script = f"printf hello; until [ -e {go} ]; do sleep 0.02; done; echo ' world'"
    run = monitors.start(monitors.spec(["sh", "-c", script]))
    wait_for(lambda: Path(run.spec.log_path).exists() and bool(run.records()), what="the line's start")
    assert [(name, partial, content) for _, name, partial, content in run.records()] == [
        ("stdout", True, "hello")
    ]
    go.touch()
    assert run.wait_exit().exit_code == 0
    assert [(partial, content) for _, _, partial, content in run.records()] == [
        (True, "hello"),
        (False, " world"),
    ]


def test_long_line_is_split_into_partial_records(monitors: Monitors) -> None:
    script = "import sys; sys.stdout.write('a' * 40960 + '\\n' + 'b' * 3 + '\\n'); sys.stdout.flush()"
    run = monitors.start(monitors.spec([sys.executable, "-S", "-c", script]))
    assert run.wait_exit().exit_code == 0
    records = [(name, partial, len(content)) for _, name, partial, content in run.records()]
    assert records == [
        ("stdout", True, LOG_LINE_MAX),
        ("stdout", True, LOG_LINE_MAX),
        ("stdout", False, 40960 - 2 * LOG_LINE_MAX),
        ("stdout", False, 3),
    ]
    assert "".join(run.lines("stdout")[:3]) == "a" * 40960


def test_exit_code_recorded(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sh", "-c", "exit 3"]))
    record = run.wait_exit()
    assert (record.exit_code, record.signal, record.cri_exit_code) == (3, None, 3)


def test_exit_by_signal_recorded(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sleep", "100"]))
    time.sleep(0.1)
    assert not Path(run.spec.exit_path).exists()
    os.kill(run.pid, signal.SIGTERM)
    record = run.wait_exit()
    assert (record.exit_code, record.signal, record.oom_killed) == (None, signal.SIGTERM, False)
    assert record.cri_exit_code == 128 + signal.SIGTERM


def test_monitor_ignores_sigint_and_sighup(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sh", "-c", "sleep 0.5; echo still-here"]))
    os.kill(run.monitor_pid, signal.SIGINT)
    os.kill(run.monitor_pid, signal.SIGHUP)
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == ["still-here"]


def test_missing_binary_reports_an_error_sync_line(monitors: Monitors) -> None:
    spec = monitors.spec(["/nonexistent/binary", "x"])
    run = monitors.start(spec)
    assert run.sync == {"error": "exec /nonexistent/binary: No such file or directory", "errno": 2}
    record = run.wait_exit()
    assert record.exit_code == 127 and record.error == "exec /nonexistent/binary: No such file or directory"
    run2 = monitors.start(monitors.spec(["no-such-command-aurae"]))
    assert run2.sync["errno"] == 2 and "exec no-such-command-aurae" in run2.sync["error"]
    run3 = monitors.start(monitors.spec(["true"], cwd="/nonexistent-dir"))
    assert run3.sync == {"error": "chdir /nonexistent-dir: No such file or directory", "errno": 2}


def test_path_lookup_uses_spec_env(monitors: Monitors, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "aurae-hello"
    tool.write_text("#!/bin/sh\necho hello from $0 $FOO\n")
    tool.chmod(0o755)
    run = monitors.start(monitors.spec(["aurae-hello"], env=[f"PATH={bindir}:/usr/bin:/bin", "FOO=bar"]))
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == [f"hello from {tool} bar"]


def test_executable_outliving_pipes_of_a_grandchild(monitors: Monitors) -> None:
    """A background grandchild keeps stdout open: exit.json still comes ~2 s after the child died."""
    run = monitors.start(monitors.spec(["sh", "-c", "sleep 30 & echo $!"]))
    wait_for(lambda: bool(Path(run.spec.log_path).read_text()), what="grandchild pid")
    grandchild = int(run.lines("stdout")[0])
    monitors.track(grandchild)
    started = time.monotonic()
    record = run.wait_exit(timeout=10)
    assert record.exit_code == 0
    assert time.monotonic() - started < 5
    kill_if_same(grandchild, start_ticks(grandchild))


def test_sigusr1_reopens_the_log(monitors: Monitors, tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    run = monitors.start(
        monitors.spec(["sh", "-c", f"echo before; while [ ! -e {flag} ]; do sleep 0.02; done; echo after"])
    )
    log = Path(run.spec.log_path)
    wait_for(lambda: "before" in log.read_text(), what="first line")
    log.rename(log.with_name("output.log.1"))
    os.kill(run.monitor_pid, signal.SIGUSR1)
    wait_for(log.exists, what="reopened log")
    flag.touch()
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == ["after"]
    assert "before" in log.with_name("output.log.1").read_text()


def test_monitor_survives_its_parent(monitors: Monitors, tmp_path: Path) -> None:
    """Start the monitor from an intermediate process that exits at once (like a kill -9 of auraed)."""
    spec = monitors.spec(["sh", "-c", "sleep 1; echo done"])
    r, w = os.pipe()
    cmd = monitors.command(spec, w)
    launcher = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen({cmd!r}, pass_fds=[{w}], stdin=subprocess.DEVNULL,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
    )
    out = subprocess.run([sys.executable, "-c", launcher], pass_fds=[w], capture_output=True, check=True)
    os.close(w)
    monitor_pid = int(out.stdout)
    monitors.track(monitor_pid)
    sync = read_sync(r)
    os.close(r)
    monitors.track(sync["pid"])
    assert start_ticks(monitor_pid) is not None, "monitor died with its parent"
    assert start_ticks(sync["pid"]) == sync["start_ticks"]
    assert os.getsid(monitor_pid) == monitor_pid
    record = Run(spec, monitor_pid, sync).wait_exit()
    assert record.exit_code == 0
    assert Run(spec, monitor_pid, sync).lines("stdout") == ["done"]


# ------------------------------------------------------------------------------------ namespaces


def test_new_pid_namespace(monitors: Monitors) -> None:
    spec = monitors.spec(["sh", "-c", "echo $$; ls /proc"], new_pid_ns=True, new_mount_ns=True)
    run = monitors.start(spec)
    record = run.wait_exit()
    assert record.exit_code == 0, Path(run.spec.log_path).read_text()
    lines = run.lines("stdout")
    assert lines[0] == "2"  # PID 1 is the init that relays signals to it
    pids = [int(name) for name in lines[1:] if name.isdigit()]
    assert {1, 2} <= set(pids) and len(pids) <= 4, pids
    assert str(os.getpid()) in os.listdir("/proc"), "the host /proc must be untouched"


def test_pid_namespace_child_is_signalled_with_sigkill(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sleep", "100"], new_pid_ns=True))
    os.kill(run.pid, signal.SIGKILL)  # kills its init, and so the whole namespace
    assert run.wait_exit().signal == signal.SIGKILL


def test_pid_namespace_init_relays_signals_and_status(monitors: Monitors) -> None:
    """A namespace's PID 1 gets only the signals it handles: the init passes them on, and the
    exit record is the executable's (its signal, its exit code), not the init's."""
    run = monitors.start(monitors.spec(["sleep", "100"], new_pid_ns=True))
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait_exit().signal == signal.SIGTERM
    run = monitors.start(monitors.spec(["sh", "-c", "exit 7"], new_pid_ns=True))
    record = run.wait_exit()
    assert (record.exit_code, record.signal) == (7, None)


def test_hostname_in_new_uts_namespace(monitors: Monitors) -> None:
    host = socket.gethostname()
    run = monitors.start(
        monitors.spec(["cat", "/proc/sys/kernel/hostname"], new_uts_ns=True, hostname="aurae-cell-7"),
        fast=True,
    )
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == ["aurae-cell-7"]
    assert socket.gethostname() == host


LO_PROBE = """
import fcntl, socket, struct
names = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack_from('16sH', fcntl.ioctl(s.fileno(), 0x8913, struct.pack('16sH22x', b'lo', 0)))[1]
print(' '.join(names), 'UP' if flags & 1 else 'DOWN')
"""


def test_network_namespace(monitors: Monitors, netns_file: Path) -> None:
    own_ns = os.readlink("/proc/thread-self/ns/net")
    create_network_namespace(netns_file)
    assert os.readlink("/proc/thread-self/ns/net") == own_ns
    assert str(netns_file) in Path("/proc/self/mountinfo").read_text()
    with pytest.raises(FileExistsError):
        create_network_namespace(netns_file)

    run = monitors.start(monitors.spec([sys.executable, "-S", "-c", LO_PROBE], netns_path=str(netns_file)))
    assert run.wait_exit().exit_code == 0, Path(run.spec.log_path).read_text()
    assert run.lines("stdout") == ["lo UP"]

    remove_network_namespace(netns_file)
    assert not netns_file.exists()
    assert str(netns_file) not in Path("/proc/self/mountinfo").read_text()
    remove_network_namespace(netns_file)  # idempotent


def test_bad_netns_path_is_a_start_error(monitors: Monitors, tmp_path: Path) -> None:
    run = monitors.start(monitors.spec(["true"], netns_path=str(tmp_path / "missing")))
    assert run.sync["errno"] == 2 and run.sync["error"].startswith(f"setns {tmp_path / 'missing'}: ")
    assert run.wait_exit().exit_code == 127


# ---------------------------------------------------------------------------------------- cgroups


def test_child_joins_cgroup_before_exec(monitors: Monitors, pids_cgroup: Path) -> None:
    # Through "tasks", as cells join v1 hierarchies: the child's one thread is the whole process.
    spec = monitors.spec(
        ["sh", "-c", "cat /proc/self/cgroup; exec sleep 100"],
        cgroup_join_files=[str(pids_cgroup / "tasks")],
    )
    run = monitors.start(spec)
    name = f"/{pids_cgroup.name}"
    wait_for(lambda: bool(run.lines("stdout")), what="cgroup listing")
    assert any(line.split(":")[1:] == ["pids", name] for line in run.lines("stdout"))
    assert str(run.pid) in (pids_cgroup / "cgroup.procs").read_text().split()
    monitor_cgroups = Path(f"/proc/{run.monitor_pid}/cgroup").read_text()
    assert f"pids:{name}" not in monitor_cgroups
    os.kill(run.pid, signal.SIGKILL)
    record = run.wait_exit()
    assert (record.signal, record.oom_killed) == (signal.SIGKILL, False)


def test_spawned_child_starts_in_the_cell_and_the_monitor_stays_out(
    monitors: Monitors, pids_cgroup: Path, netns_file: Path, tmp_path: Path
) -> None:
    """v1 cgroups and a network namespace only: posix_spawn from a thread that joined both (and
    changed directory), so the child starts there while the monitor keeps its own."""
    create_network_namespace(netns_file)
    workdir = tmp_path / "work"
    workdir.mkdir()
    spec = monitors.spec(
        ["sh", "-c", "pwd; readlink /proc/self/ns/net; cut -d' ' -f6 /proc/$$/stat; "
         "grep :pids: /proc/self/cgroup; exec sleep 100"],
        cgroup_join_files=[str(pids_cgroup / "tasks")],
        netns_path=str(netns_file),
        cwd=str(workdir),
    )  # fmt: skip
    run = monitors.start(spec)
    wait_for(lambda: len(run.lines("stdout")) == 4, what="the child's report")
    cwd, netns, sid, cgroup = run.lines("stdout")
    assert cwd == str(workdir)
    assert netns == f"net:[{os.stat(netns_file).st_ino}]"
    assert int(sid) == run.pid  # its own session
    assert cgroup.endswith(f":pids:/{pids_cgroup.name}")
    monitor = f"/proc/{run.monitor_pid}"
    assert os.readlink(f"{monitor}/cwd") == os.getcwd()
    assert os.readlink(f"{monitor}/ns/net") == os.readlink("/proc/self/ns/net")
    assert f"pids:/{pids_cgroup.name}" not in Path(f"{monitor}/cgroup").read_text()
    assert sorted(os.listdir(f"{monitor}/task")) == [str(run.monitor_pid)]  # the thread is gone
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait_exit().signal == signal.SIGKILL


def test_a_cell_allowing_one_process_runs_one(monitors: Monitors, pids_cgroup: Path) -> None:
    """pids.max 1: the process starts (a thread spawning it would hold the one pid itself, so the
    monitor forks a child that joins instead) and cannot fork."""
    (pids_cgroup / "pids.max").write_text("1")
    spec = monitors.spec(["sh", "-c", "echo started; (true)"], cgroup_join_files=[str(pids_cgroup / "tasks")])
    run = monitors.start(spec)
    assert run.wait_exit().exit_code == 2  # dash gives up on a fork that fails
    assert run.lines("stdout") == ["started"]
    assert "fork" in " ".join(run.lines("stderr")).lower()


def test_oom_kill_is_recorded(monitors: Monitors, memory_cgroup: Path) -> None:
    oom_control = memory_cgroup / "memory.oom_control"
    assert "oom_kill " in oom_control.read_text(), "kernel without the oom_kill counter"
    spec = monitors.spec(
        [sys.executable, "-S", "-c", "a = b'x' * (200 << 20); print('survived')"],
        cgroup_join_files=[str(memory_cgroup / "cgroup.procs")],
        oom_counter_file=str(oom_control),
    )
    run = monitors.start(spec)
    record = run.wait_exit(timeout=30)
    assert (record.exit_code, record.signal, record.oom_killed) == (None, signal.SIGKILL, True)
    assert run.lines("stdout") == []

    # A SIGKILL that is not an OOM kill in the same cgroup is not reported as one.
    run2 = monitors.start(
        monitors.spec(
            ["sleep", "100"],
            cgroup_join_files=[str(memory_cgroup / "cgroup.procs")],
            oom_counter_file=str(oom_control),
        )
    )
    os.kill(run2.pid, signal.SIGKILL)
    record2 = run2.wait_exit()
    assert (record2.signal, record2.oom_killed) == (signal.SIGKILL, False)


def test_child_gets_only_stdio_fds(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sh", "-c", "ls /proc/$$/fd; readlink /proc/$$/fd/0"]))
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == ["0", "1", "2", "/dev/null"]


def test_uid_gid_and_no_supplementary_groups(monitors: Monitors) -> None:
    run = monitors.start(monitors.spec(["sh", "-c", "id -u; id -g; id -G"], uid=65534, gid=65534))
    assert run.wait_exit().exit_code == 0
    assert run.lines("stdout") == ["65534", "65534", "65534"]


def test_unusable_log_path_is_a_start_error(monitors: Monitors) -> None:
    spec = monitors.spec(["true"])
    spec.log_path = "/proc/aurae-no-such-dir/output.log"
    run = monitors.start(spec)
    assert run.sync["error"].startswith("open log /proc/aurae-no-such-dir/output.log: ")
    record = run.wait_exit()
    assert record.exit_code == 127 and record.error == run.sync["error"]


CRASHING_MONITOR = """
import sys
from auraed.system import cri_log, monitor

def boom(self, stream, data):
    raise RuntimeError("injected")

cri_log.CriLogWriter.feed = boom
sys.exit(monitor.main(sys.argv[1:]))
"""


def test_monitor_crash_still_reaps_and_writes_exit(monitors: Monitors) -> None:
    """An unexpected exception in the monitor: the child is reaped and exit.json is still written."""
    spec = monitors.spec(["sh", "-c", "echo first; sleep 0.2; echo second; exit 4"])
    r, w = os.pipe()
    cmd = monitors.command(spec, w)
    err = Path(spec.exit_path).parent / "monitor.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHING_MONITOR, *cmd[-2:]], pass_fds=[w], stderr=stderr
        )
    monitors.procs.append(proc)
    os.close(w)
    sync = read_sync(r)
    os.close(r)
    monitors.track(sync["pid"])
    assert proc.wait(timeout=15) == 0
    record = read_exit_record(spec.exit_path)
    assert record is not None and record.error is None
    # The pipes were closed: the child died of SIGPIPE writing "second" (or exited if it raced past).
    assert record.signal == signal.SIGPIPE or record.exit_code == 4
    assert start_ticks(sync["pid"]) is None  # reaped, not a zombie
    assert "injected" in err.read_text()
