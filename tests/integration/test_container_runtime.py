"""Containers under our monitor with a real runc: auraed.system.monitor (subreaper, pid_file,
console_socket), auraed.containers.oci_cli (Runc) and auraed.containers.exec (ExecSession).

Needs root and runc. Every fixture cleans up what it made even when a test fails: every container
id is deleted with ``runc delete --force``, monitors are killed (pid + start ticks), the cgroup
parent ``aurae-rttest-<pid>`` is removed from every hierarchy and the directories are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from auraed.containers.exec import ExecSession
from auraed.containers.oci_cli import Crun, Runc
from auraed.containers.runtime import OciRuntimeError, runtime_message
from auraed.system.cri_log import parse_cri_log_line
from auraed.system.monitor import monitor_command
from auraed.system.monitor_protocol import ExitRecord, MonitorSpec, read_exit_record
from auraed.system.supervisor import Supervisor
from tests.integration.test_monitor import kill_if_same, read_sync, start_ticks, wait_for
from tests.support.busybox import make_busybox_rootfs

RUNC = shutil.which("runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = f"aurae-rttest-{os.getpid()}"
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


CAPS = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_CHOWN", "CAP_SETUID", "CAP_SETGID"]


def oci_spec(
    rootfs: Path,
    args: list[str],
    container_id: str,
    *,
    terminal: bool = False,
    pid_ns: bool = True,
) -> dict[str, Any]:
    """A minimal valid OCI runtime spec (what ``runc spec`` writes, trimmed) for a busybox rootfs."""
    namespaces = [{"type": t} for t in ("ipc", "uts", "mount", "network")]
    if pid_ns:
        namespaces.insert(0, {"type": "pid"})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": terminal,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": [*ENV, "TERM=xterm"],
            "cwd": "/",
            "capabilities": dict.fromkeys(("bounding", "effective", "permitted"), CAPS),
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": container_id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
        ],
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "cgroupsPath": f"/{CGROUP_PARENT}/{container_id}",
            "namespaces": namespaces,
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append((int(entry), fields[0].decode()))
    return found


def exec_process(args: list[str], **extra: Any) -> dict[str, Any]:
    return {"args": args, "env": ENV, "cwd": "/", "user": {"uid": 0, "gid": 0}, **extra}


class Container:
    def __init__(self, lab: Lab, container_id: str, directory: Path, monitor_pid: int, sync: dict[str, Any]):
        self.lab = lab
        self.id = container_id
        self.dir = directory
        self.monitor_pid = monitor_pid
        self.sync = sync

    @property
    def pid(self) -> int:
        pid: int = self.sync["pid"]
        return pid

    @property
    def log_path(self) -> Path:
        return self.dir / "output.log"

    @property
    def exit_path(self) -> Path:
        return self.dir / "exit.json"

    def lines(self, stream: str) -> list[str]:
        if not self.log_path.exists():
            return []
        records = [parse_cri_log_line(line) for line in self.log_path.read_text().splitlines()]
        return [content for _, name, _, content in records if name == stream]

    def wait_exit(self, timeout: float = 15.0) -> ExitRecord:
        wait_for(self.exit_path.exists, timeout, "exit.json")
        record = read_exit_record(self.exit_path)
        assert record is not None
        return record

    async def async_wait_exit(self, timeout: float = 15.0) -> ExitRecord:
        deadline = time.monotonic() + timeout
        while not self.exit_path.exists():
            assert time.monotonic() < deadline, "timed out waiting for exit.json"
            await asyncio.sleep(0.02)
        record = read_exit_record(self.exit_path)
        assert record is not None
        return record


class Lab:
    """A runc state dir, a shared read-only busybox rootfs, containers under monitors; cleans up."""

    def __init__(self, base: Path, rootfs: Path) -> None:
        self.base = base
        self.rootfs = rootfs
        self.runtime = Runc(binary=str(RUNC), root=base / "state", scratch_dir=base / "x")
        self.supervisor = Supervisor(base / "run")
        self.count = 0
        self.ids: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: list[tuple[int, int | None]] = []

    def new_id(self) -> str:
        self.count += 1
        container_id = f"rt{os.getpid()}-{self.count}"
        self.ids.append(container_id)
        return container_id

    def prepare(
        self,
        args: list[str],
        *,
        terminal: bool = False,
        pid_ns: bool = True,
        bundle_config: bool = True,
        start: bool = False,
    ) -> tuple[str, Path, MonitorSpec]:
        container_id = self.new_id()
        directory = self.base / container_id
        bundle = directory / "bundle"
        bundle.mkdir(parents=True)
        if bundle_config:
            spec = oci_spec(self.rootfs, args, container_id, terminal=terminal, pid_ns=pid_ns)
            (bundle / "config.json").write_text(json.dumps(spec))
        console = directory / "console.sock" if terminal else None
        pid_file = directory / "container.pid"
        monitor = MonitorSpec(
            argv=self.runtime.create_argv(container_id, bundle, pid_file, console, start=start),
            log_path=str(directory / "output.log"),
            exit_path=str(directory / "exit.json"),
            env=ENV,
            subreaper=True,
            pid_file=str(pid_file),
            console_socket=str(console) if console else None,
            runtime_starts=start,
            oom_counter_file=str(
                CGROUP_ROOT / "memory" / CGROUP_PARENT / container_id / "memory.oom_control"
            ),
        )
        (directory / "monitor.json").write_text(monitor.to_json())
        return container_id, directory, monitor

    def launch(self, directory: Path, sync_fd: int) -> subprocess.Popen[bytes]:
        with (directory / "monitor.log").open("ab") as log:
            proc = subprocess.Popen(
                monitor_command(str(directory / "monitor.json"), sync_fd),
                pass_fds=[sync_fd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        self.procs.append(proc)
        self.pids.append((proc.pid, start_ticks(proc.pid)))
        return proc

    def create(self, args: list[str], **kwargs: Any) -> Container:
        container_id, directory, _ = self.prepare(args, **kwargs)
        return self.start_monitor(container_id, directory)

    def start_monitor(self, container_id: str, directory: Path) -> Container:
        r, w = os.pipe()
        try:
            proc = self.launch(directory, w)
            os.close(w)
            w = -1
            sync = read_sync(r, timeout=30)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if "pid" in sync:
            self.pids.append((sync["pid"], sync["start_ticks"]))
        return Container(self, container_id, directory, proc.pid, sync)

    def cleanup(self) -> None:
        self.supervisor.close()
        for container_id in self.ids:
            subprocess.run(
                [str(RUNC), "--root", str(self.runtime.root), "delete", "--force", container_id],
                capture_output=True,
                timeout=60,
                check=False,
            )
        for pid, ticks in reversed(self.pids):
            kill_if_same(pid, ticks)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        remove_cgroup_parent()
        shutil.rmtree(self.base, ignore_errors=True)


def remove_cgroup_parent() -> None:
    for hierarchy in CGROUP_ROOT.iterdir():
        parent = hierarchy / CGROUP_PARENT
        if not parent.is_dir():
            continue
        for leaf in [p for p in parent.iterdir() if p.is_dir()] + [parent]:
            for _ in range(100):
                with contextlib.suppress(OSError):
                    for pid in (leaf / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    leaf.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


@pytest.fixture(scope="module")
def rootfs() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="rtfs-"))
    try:
        yield make_busybox_rootfs(base / "rootfs")
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def lab(rootfs: Path) -> Iterator[Lab]:
    # Short paths: console sockets live here and unix socket paths are limited to 107 bytes.
    lab = Lab(Path(tempfile.mkdtemp(prefix="rt-")), rootfs)
    try:
        yield lab
    finally:
        lab.cleanup()


@pytest.fixture
async def running(lab: Lab) -> AsyncIterator[Container]:
    """A started container sleeping in its own pid namespace."""
    container = lab.create(["sleep", "1000"])
    assert "pid" in container.sync, container.sync
    await lab.runtime.start(container.id)
    yield container


# ----------------------------------------------------------------------------------- pure helpers


def test_runtime_message_extracts_logrus_messages() -> None:
    err = b'time="2026-01-01T00:00:00Z" level=error msg="exec failed: \\"x\\" not found"\n'
    assert runtime_message(err) == 'exec failed: "x" not found'
    assert runtime_message("crun: container `x` does not exist\n") == "crun: container `x` does not exist"


def test_argv_shapes(tmp_path: Path) -> None:
    runtime = Crun(binary="/usr/bin/crun", root=Path("/run/r"))
    assert runtime.create_argv("c1", Path("/b"), Path("/p"), None) == [
        "/usr/bin/crun", "--root", "/run/r", "create", "--bundle", "/b", "--pid-file", "/p", "c1",
    ]  # fmt: skip
    assert runtime.exec_argv("c1", Path("/f"), Path("/p"), Path("/s"))[3:] == [
        "exec", "--detach", "--pid-file", "/p", "--process", "/f", "--tty", "--console-socket", "/s", "c1",
    ]  # fmt: skip
    started = runtime.create_argv("c1", Path("/b"), Path("/p"), None, start=True)
    assert started[3:6] == ["run", "--detach", "--bundle"]
    with pytest.raises(OciRuntimeError) as info:
        runtime.create_argv("--help", Path("/b"), Path("/p"), None)
    assert info.value.kind == "invalid"
    with pytest.raises(OciRuntimeError) as info:
        runtime.create_argv("c1", Path("/b"), Path("/p"), Path("/" + "d" * 120 + "/console.sock"))
    assert info.value.kind == "invalid" and "107" in str(info.value)


async def test_mount_options_are_what_the_runtime_lists(tmp_path: Path) -> None:
    """runc 1.1's ``features`` lists ``rro`` (what the CRI's cell handler advertises on); crun
    1.8 has no ``features``, and a runtime that cannot run at all lists nothing either."""
    assert "rro" in await Runc(binary=shutil.which("runc") or "runc", root=tmp_path).mount_options()
    assert await Crun(binary=shutil.which("crun") or "crun", root=tmp_path).mount_options() == frozenset()
    assert await Runc(binary=str(tmp_path / "no-such-runtime"), root=tmp_path).mount_options() == frozenset()


# ------------------------------------------------------------------------------ create and start


async def test_created_until_started_then_output_and_exit_code(lab: Lab) -> None:
    container = lab.create(["sh", "-c", "echo hello; echo err >&2; exit 3"])
    assert set(container.sync) == {"pid", "start_ticks"}, container.sync
    assert start_ticks(container.pid) == container.sync["start_ticks"]
    state = await lab.runtime.state(container.id)
    assert state is not None and state["status"] == "created" and state["pid"] == container.pid
    # The container init was forked by runc and abandoned: the monitor adopted it.
    assert (container.pid, "S") in children_of(container.monitor_pid)
    await asyncio.sleep(0.2)
    assert container.lines("stdout") == [] and not container.exit_path.exists()

    await lab.runtime.start(container.id)
    record = await container.async_wait_exit()
    assert (record.exit_code, record.signal, record.oom_killed, record.error) == (3, None, False, None)
    assert container.lines("stdout") == ["hello"]
    assert container.lines("stderr") == ["err"]
    state = await lab.runtime.state(container.id)
    assert state is not None and state["status"] == "stopped"
    with pytest.raises(OciRuntimeError) as info:
        await lab.runtime.start(container.id)
    assert info.value.kind == "invalid"


async def test_start_created_releases_the_init_or_says_it_ended(lab: Lab) -> None:
    # What runc start does, without a runc process: the init waiting at its exec fifo runs.
    container = lab.create(["sh", "-c", "echo released"])
    monitor = lab.procs[-1]
    await lab.runtime.start_created(container.id, lambda: monitor.poll() is None)
    record = await container.async_wait_exit()
    assert (record.exit_code, container.lines("stdout")) == (0, ["released"])
    state = await lab.runtime.state(container.id)
    assert state is not None and state["status"] == "stopped"

    # An init that died before: said so once its monitor has seen it, not a wait until timeout.
    doomed = lab.create(["true"])
    monitor = lab.procs[-1]
    os.kill(doomed.pid, signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(OciRuntimeError) as info:
        await lab.runtime.start_created(doomed.id, lambda: monitor.poll() is None)
    assert "ended before it was started" in str(info.value)
    assert time.monotonic() - began < 5


async def test_run_detach_keeps_the_output_written_while_the_runtime_ran(lab: Lab) -> None:
    # 3 MB at once: more than the monitor reads while runc still runs (EARLY_OUTPUT_MAX), so the
    # container blocks on its pipe until the monitor supervises it; nothing may be lost.
    script = "echo first; echo err >&2; head -c 3000000 /dev/zero | tr '\\0' x; echo; echo last; exit 4"
    container = lab.create(["sh", "-c", script], start=True)
    assert set(container.sync) == {"pid", "start_ticks"}, container.sync
    record = await container.async_wait_exit()
    assert (record.exit_code, record.signal) == (4, None)
    stdout = container.lines("stdout")
    assert stdout[0] == "first" and stdout[-1] == "last"
    assert "".join(stdout[1:-1]) == "x" * 3_000_000
    assert container.lines("stderr") == ["err"]
    state = await lab.runtime.state(container.id)
    assert state is not None and state["status"] == "stopped"


async def test_run_detach_failure_is_the_runtimes_message(lab: Lab) -> None:
    container = lab.create(["/no/such/binary"], start=True)
    assert "error" in container.sync, container.sync
    assert "/no/such/binary" in container.sync["error"]
    record = container.wait_exit()
    assert record.exit_code == 127 and container.lines("stdout") == container.lines("stderr") == []


async def test_sigterm_is_recorded_as_the_signal(lab: Lab) -> None:
    # Not PID 1 of a pid namespace: there a signal without a handler would be ignored.
    container = lab.create(["sleep", "1000"], pid_ns=False)
    await lab.runtime.start(container.id)
    state = await lab.runtime.state(container.id)
    assert state is not None and state["status"] == "running"
    await lab.runtime.kill(container.id, signal.SIGTERM)
    record = await container.async_wait_exit()
    assert (record.exit_code, record.signal, record.cri_exit_code) == (None, signal.SIGTERM, 143)
    with pytest.raises(OciRuntimeError) as info:
        await lab.runtime.kill(container.id, signal.SIGKILL)
    assert info.value.kind == "invalid"


async def test_sigkill_all_in_pid_namespace(running: Container) -> None:
    runtime = running.lab.runtime
    assert await runtime.ps(running.id) == [running.pid]
    await runtime.kill(running.id, signal.SIGKILL, all_processes=True)
    record = await running.async_wait_exit()
    assert record.signal == signal.SIGKILL and not record.oom_killed


async def test_tty_container_logs_through_the_console_socket(lab: Lab) -> None:
    container = lab.create(["sh", "-c", "tty; echo hello; printf 'no newline'"], terminal=True)
    assert "pid" in container.sync, container.sync
    assert not (container.dir / "console.sock").exists()  # the monitor removed it once used
    await lab.runtime.start(container.id)
    record = await container.async_wait_exit()
    assert record.exit_code == 0
    lines = container.lines("stdout")  # a record each: "no newline" a P, its line ended at EOF
    assert lines[0].startswith("/dev/pts/") and lines[1:] == ["hello", "no newline", ""], lines
    assert container.lines("stderr") == []


async def test_runtime_failure_is_reported(lab: Lab) -> None:
    container = lab.create(["true"], bundle_config=False)
    assert set(container.sync) == {"error", "errno"}
    assert "runc exited with status 1" in container.sync["error"]
    assert "config.json" in container.sync["error"]
    record = container.wait_exit()
    assert record.exit_code == 127 and record.error == container.sync["error"]


async def test_missing_executable_fails_at_create(lab: Lab) -> None:
    container = lab.create(["/no/such/binary"])
    assert "error" in container.sync, container.sync
    assert "/no/such/binary" in container.sync["error"]


async def test_delete_removes_state_and_cgroups(lab: Lab) -> None:
    container = lab.create(["true"])
    leaves = [h / CGROUP_PARENT / container.id for h in CGROUP_ROOT.iterdir()]
    assert any(leaf.is_dir() for leaf in leaves)
    await lab.runtime.start(container.id)
    assert (await container.async_wait_exit()).exit_code == 0
    await lab.runtime.delete(container.id)
    assert await lab.runtime.state(container.id) is None
    assert not (lab.runtime.root / container.id).exists()
    assert not any(leaf.exists() for leaf in leaves)
    await lab.runtime.delete(container.id)  # idempotent
    await lab.runtime.delete(container.id, force=True)


async def test_unknown_container(lab: Lab) -> None:
    runtime = lab.runtime
    assert await runtime.state("nope") is None
    for call in (runtime.start("nope"), runtime.kill("nope", signal.SIGTERM), runtime.ps("nope")):
        with pytest.raises(OciRuntimeError) as info:
            await call
        assert info.value.kind == "not_found", info.value
    await runtime.delete("nope")
    with pytest.raises(OciRuntimeError) as info:
        await ExecSession.start(runtime, "nope", exec_process(["true"]), tty=False, supervisor=lab.supervisor)
    assert info.value.kind == "not_found"
    assert not list((lab.base / "x").iterdir())  # the exec session removed its files


async def test_delete_running_needs_force(running: Container) -> None:
    runtime = running.lab.runtime
    with pytest.raises(OciRuntimeError) as info:
        await runtime.delete(running.id)
    assert info.value.kind == "invalid"
    await runtime.delete(running.id, force=True)
    record = await running.async_wait_exit()
    assert record.signal == signal.SIGKILL
    assert await runtime.state(running.id) is None


# ------------------------------------------------------------------------------ monitor behaviour


def plain_monitor(lab: Lab, argv: list[str], name: str) -> Container:
    """A monitor in pid_file mode around a shell command instead of runc."""
    directory = lab.base / name
    directory.mkdir()
    spec = MonitorSpec(
        argv=argv,
        log_path=str(directory / "output.log"),
        exit_path=str(directory / "exit.json"),
        env=ENV,
        pid_file=str(directory / "pid"),
    )
    (directory / "monitor.json").write_text(spec.to_json())
    return lab.start_monitor(name, directory)


async def test_pid_file_mode_adopts_the_abandoned_process(lab: Lab) -> None:
    pid_file = lab.base / "adopt" / "pid"
    script = f"(sleep 0.3; echo from-child; exit 7) & echo $! > {pid_file}; echo from-launcher"
    run = plain_monitor(lab, ["sh", "-c", script], "adopt")
    assert "pid" in run.sync, run.sync
    assert run.sync["pid"] == int(pid_file.read_text())
    record = await run.async_wait_exit()
    assert (record.exit_code, record.signal, record.error) == (7, None, None)
    # What the launcher (the "runtime") said is not the process's output.
    assert run.lines("stdout") == ["from-child"]
    assert "from-launcher" in (run.dir / "monitor.log").read_text()


async def test_pid_file_mode_failures(lab: Lab) -> None:
    run = plain_monitor(lab, ["sh", "-c", "echo line1 >&2; echo oops >&2; exit 4"], "fails")
    assert run.sync == {"error": "sh exited with status 4: line1; oops", "errno": 0}
    assert (await run.async_wait_exit()).error == run.sync["error"]
    run = plain_monitor(lab, ["true"], "nopid")
    assert run.sync["error"].startswith("true wrote no usable pid file ")


async def test_pid_file_naming_a_process_that_is_not_ours(lab: Lab) -> None:
    """Only its end can be seen, not its status: exit.json then has neither code nor signal."""
    other = subprocess.Popen(["sleep", "0.5"])
    try:
        pid_file = lab.base / "foreign" / "pid"
        run = plain_monitor(lab, ["sh", "-c", f"echo {other.pid} > {pid_file}"], "foreign")
        assert run.sync["pid"] == other.pid
        record = await run.async_wait_exit()
        assert (record.exit_code, record.signal, record.error) == (None, None, None)
    finally:
        other.kill()
        other.wait()


async def test_monitor_outlives_its_parent_and_the_container_keeps_running(lab: Lab) -> None:
    container_id, directory, _ = lab.prepare(["sleep", "1000"])
    r, w = os.pipe()
    launcher = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen({monitor_command(str(directory / 'monitor.json'), w)!r}, pass_fds=[{w}],"
        " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
    )
    out = subprocess.run([sys.executable, "-c", launcher], pass_fds=[w], capture_output=True, check=True)
    os.close(w)
    monitor_pid = int(out.stdout)
    lab.pids.append((monitor_pid, start_ticks(monitor_pid)))
    sync = read_sync(r, timeout=30)
    os.close(r)
    assert "pid" in sync, sync
    lab.pids.append((sync["pid"], sync["start_ticks"]))
    container = Container(lab, container_id, directory, monitor_pid, sync)
    assert start_ticks(monitor_pid) is not None, "monitor died with its parent"
    assert os.getsid(monitor_pid) == monitor_pid
    await lab.runtime.start(container_id)
    await asyncio.sleep(0.3)
    state = await lab.runtime.state(container_id)
    assert state is not None and state["status"] == "running"
    assert (container.pid, "S") in children_of(monitor_pid)
    await lab.runtime.kill(container_id, signal.SIGKILL)
    assert (await container.async_wait_exit()).signal == signal.SIGKILL


async def test_orphans_are_reaped_by_the_monitor(lab: Lab) -> None:
    # Host pid namespace: the background sleep's parent exits, so it is reparented to the nearest
    # subreaper, the monitor, which must reap it when it ends.
    container = lab.create(["sh", "-c", "(sleep 0.5 &); exec sleep 1000"], pid_ns=False)
    await lab.runtime.start(container.id)
    monitor = container.monitor_pid

    def orphan_adopted() -> bool:
        return any(pid != container.pid for pid, _ in children_of(monitor))

    wait_for(orphan_adopted, 5, "the orphan to be reparented to the monitor")
    await asyncio.sleep(1.0)
    assert children_of(monitor) == [(container.pid, "S")], "zombies left under the monitor"
    await lab.runtime.kill(container.id, signal.SIGKILL)
    assert (await container.async_wait_exit()).signal == signal.SIGKILL


# ----------------------------------------------------------------------------------------- exec


async def collect(session: ExecSession) -> dict[str, bytes]:
    out: dict[str, bytes] = {"stdout": b"", "stderr": b""}
    async for stream, data in session.output():
        out[stream] += data
    return out


async def test_exec_with_stdin(running: Container) -> None:
    runtime = running.lab.runtime
    async with await ExecSession.start(
        runtime, running.id, exec_process(["cat"]), tty=False, supervisor=running.lab.supervisor
    ) as session:
        assert session.pid > 0 and session.pid != running.pid
        output = session.output()
        await session.write_stdin(b"ping\n")
        stream, data = await asyncio.wait_for(anext(output), 10)
        assert (stream, data) == ("stdout", b"ping\n")
        await session.write_stdin(b"pong")
        await session.close_stdin()
        rest = b""
        async for _stream, chunk in output:
            rest += chunk
        assert rest == b"pong"
        assert await asyncio.wait_for(session.wait(), 10) == 0
    assert not session.work_dir.exists()


async def test_exec_exit_code_and_stderr(running: Container) -> None:
    runtime = running.lab.runtime
    process = exec_process(["sh", "-c", "echo out; echo err >&2; exit 3"])
    async with await ExecSession.start(
        runtime, running.id, process, tty=False, stdin=False, supervisor=running.lab.supervisor
    ) as session:
        out = await asyncio.wait_for(collect(session), 10)
        assert out == {"stdout": b"out\n", "stderr": b"err\n"}
        assert await session.wait() == 3


async def test_exec_kill(running: Container) -> None:
    runtime = running.lab.runtime
    async with await ExecSession.start(
        runtime, running.id, exec_process(["sleep", "100"]), tty=False, supervisor=running.lab.supervisor
    ) as session:
        await session.kill()
        assert await asyncio.wait_for(session.wait(), 10) == 128 + signal.SIGKILL
    # Closing a session whose process still runs kills it.
    session = await ExecSession.start(
        runtime, running.id, exec_process(["sleep", "100"]), tty=False, supervisor=running.lab.supervisor
    )
    pid, ticks = session.pid, session.ticks
    await session.close()
    assert start_ticks(pid) != ticks or start_ticks(pid) is None


async def test_exec_with_a_terminal(running: Container) -> None:
    runtime = running.lab.runtime
    process = exec_process(["sh", "-c", "tty; stty size; read line; echo got $line; stty size"])
    async with await ExecSession.start(
        runtime, running.id, process, tty=True, size=(24, 80), supervisor=running.lab.supervisor
    ) as session:
        text = b""
        output = session.output()

        async def until(marker: bytes) -> None:
            nonlocal text
            while marker not in text:
                stream, data = await asyncio.wait_for(anext(output), 10)
                assert stream == "stdout"
                text += data

        await until(b"24 80\r\n")
        assert text.startswith(b"/dev/pts/"), text
        session.resize(40, 100)
        await session.write_stdin(b"go\n")
        await until(b"40 100\r\n")
        assert b"got go\r\n" in text
        async for _stream, data in output:
            text += data
        assert await asyncio.wait_for(session.wait(), 10) == 0


async def test_exec_tty_close_stdin_sends_eof(running: Container) -> None:
    runtime = running.lab.runtime
    async with await ExecSession.start(
        runtime, running.id, exec_process(["cat"]), tty=True, supervisor=running.lab.supervisor
    ) as session:
        await session.write_stdin(b"abc\n")
        await session.close_stdin()
        out = await asyncio.wait_for(collect(session), 10)
        assert out["stdout"].count(b"abc\r\n") == 2  # the terminal's echo and cat's copy
        assert await session.wait() == 0


async def test_exec_into_a_stopped_container_fails(lab: Lab) -> None:
    container = lab.create(["true"])
    await lab.runtime.start(container.id)
    await container.async_wait_exit()
    for tty in (False, True):
        with pytest.raises(OciRuntimeError) as info:
            await ExecSession.start(
                lab.runtime, container.id, exec_process(["true"]), tty=tty, supervisor=lab.supervisor
            )
        assert info.value.kind == "invalid", info.value
        assert "stopped" in str(info.value)
    assert not list((lab.base / "x").iterdir())
