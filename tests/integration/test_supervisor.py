"""Supervisor and its monitor launcher, for real: forked monitors, their life after the launcher,
a launcher that died, many launches at once."""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import select
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from auraed.system import processes
from auraed.system.cri_log import parse_cri_log_line
from auraed.system.monitor_launcher import MONITOR_NAME, SPARE_NAME
from auraed.system.monitor_protocol import MonitorSpec
from auraed.system.supervisor import MonitorStartError, Supervised, Supervisor
from tests.conftest import wait_until
from tests.integration.test_container_runtime import children_of

PIDFD_GETFD = 438  # x86_64 syscall number

LAUNCHED: list[Supervised] = []


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[Supervisor]:
    supervisor = Supervisor(tmp_path / "run")
    try:
        yield supervisor
    finally:
        supervisor.close()
        while LAUNCHED:  # whatever a failed test left running
            handle = LAUNCHED.pop()
            processes.send_signal(handle.pid, signal.SIGKILL, handle.ticks)
            processes.send_signal(handle.monitor_pid, signal.SIGKILL, handle.monitor_ticks)


async def launch(supervisor: Supervisor, run_dir: Path, argv: list[str]) -> Supervised:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = MonitorSpec(argv=argv, log_path=str(run_dir / "out.log"), exit_path=str(run_dir / "exit.json"))
    handle = await supervisor.launch(spec, run_dir)
    LAUNCHED.append(handle)
    return handle


def logged(run_dir: Path) -> list[str]:
    return [parse_cri_log_line(line)[3] for line in (run_dir / "out.log").read_text().splitlines()]


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def test_monitors_are_forked_by_one_launcher_named_after_the_runtime_dir(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    first = await launch(supervisor, tmp_path / "a", ["sh", "-c", "echo one"])
    second = await launch(supervisor, tmp_path / "b", ["sh", "-c", "echo two"])
    launcher = supervisor.launcher_pid
    assert launcher is not None
    assert str(tmp_path / "run").encode() in cmdline(launcher)
    assert b"auraed.system.monitor_launcher" in cmdline(launcher)
    for handle, run_dir, line in ((first, tmp_path / "a", "one"), (second, tmp_path / "b", "two")):
        record = await supervisor.wait(handle, run_dir / "exit.json")
        assert record is not None and record.exit_code == 0
        assert logged(run_dir) == [line]
    assert supervisor.launcher_pid == launcher  # one launcher served both


async def test_monitors_outlive_the_launcher(supervisor: Supervisor, tmp_path: Path) -> None:
    go = tmp_path / "go"  # the child runs on until the test has seen its monitor outlive the launcher
    script = f"until [ -e {go} ]; do sleep 0.02; done; echo after; exit 3"
    handle = await launch(supervisor, tmp_path / "a", ["sh", "-c", script])
    launcher = supervisor.launcher_pid
    assert launcher is not None
    supervisor.close()  # as when auraed stops or dies: the launcher leaves at EOF
    assert not Path(f"/proc/{launcher}").exists()
    assert Supervisor.alive(handle)
    go.touch()
    record = await supervisor.wait(handle, tmp_path / "a" / "exit.json")
    assert record is not None and record.exit_code == 3
    assert logged(tmp_path / "a") == ["after"]


async def test_a_killed_launcher_is_replaced(supervisor: Supervisor, tmp_path: Path) -> None:
    running = await launch(supervisor, tmp_path / "a", ["sleep", "30"])
    launcher = supervisor.launcher_pid
    assert launcher is not None
    ticks = processes.start_ticks(launcher)
    os.kill(launcher, signal.SIGKILL)
    await processes.wait_for_exit(launcher, ticks)
    handle = await launch(supervisor, tmp_path / "b", ["sh", "-c", "echo again"])
    assert supervisor.launcher_pid not in (None, launcher)
    record = await supervisor.wait(handle, tmp_path / "b" / "exit.json")
    assert record is not None and record.exit_code == 0
    assert Supervisor.alive(running)  # the killed launcher's monitor goes on
    processes.send_signal(running.pid, signal.SIGTERM, running.ticks)
    record = await supervisor.wait(running, tmp_path / "a" / "exit.json")
    assert record is not None and record.signal == signal.SIGTERM


async def only_child(pid: int) -> int:
    """The one live child ``pid`` settles to (a monitor that just ended is its child until it is
    reaped, a moment later: on a loaded machine the test can look in between)."""
    for _ in range(250):
        live = [child for child, state in children_of(pid) if state != "Z"]
        if len(live) == 1:
            return live[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"process {pid} keeps children {children_of(pid)}, not one")


async def test_the_launchers_spare_is_replaced_when_it_dies_and_leaves_with_it(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    # The launcher keeps one forked spare waiting for the next request.
    done = await launch(supervisor, tmp_path / "a", ["true"])
    await supervisor.wait(done, tmp_path / "a" / "exit.json")
    launcher = supervisor.launcher_pid
    assert launcher is not None
    spare = await only_child(launcher)
    assert cmdline(spare) == cmdline(launcher)
    assert Path(f"/proc/{spare}/comm").read_text().strip() == SPARE_NAME
    os.kill(spare, signal.SIGKILL)  # dead without a request: another replaces it
    handle = await launch(supervisor, tmp_path / "b", ["sh", "-c", "echo on; sleep 1"])
    assert handle.monitor_pid != spare and supervisor.launcher_pid == launcher
    assert Path(f"/proc/{handle.monitor_pid}/comm").read_text().strip() == MONITOR_NAME
    record = await supervisor.wait(handle, tmp_path / "b" / "exit.json")
    assert record is not None and record.exit_code == 0 and logged(tmp_path / "b") == ["on"]
    spare = await only_child(launcher)
    launcher_process = supervisor._launcher
    assert launcher_process is not None
    supervisor.close()  # EOF: the spare tells the launcher, and both end by themselves
    assert launcher_process.returncode == 0
    for _ in range(100):  # reaped by whoever inherited it, in a moment
        if not Path(f"/proc/{spare}").exists():
            break
        await asyncio.sleep(0.02)
    assert not Path(f"/proc/{spare}").exists()


async def launcher_and_spare(supervisor: Supervisor, run_dir: Path) -> tuple[int, int]:
    """The launcher's pid and its spare's, once a first launch (in ``run_dir``) has ended."""
    await supervisor.wait(await launch(supervisor, run_dir, ["true"]), run_dir / "exit.json")
    launcher = supervisor.launcher_pid
    assert launcher is not None
    spare = await only_child(launcher)
    return launcher, spare


def steal_launcher_socket(launcher: int) -> socket.socket:
    """A duplicate of the launcher's end of its control socket (pidfd_getfd), to take a request
    off it as a spare would."""
    control_fd = int(cmdline(launcher).split(b"\0")[5])  # python -I -S -c CODE CONTROL_FD LABEL
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(launcher)
    try:
        fd = libc.syscall(PIDFD_GETFD, pidfd, control_fd, 0)
    finally:
        os.close(pidfd)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    return socket.socket(fileno=fd)


async def test_a_request_lost_with_a_spare_killed_as_it_took_it_is_sent_again(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    # A spare SIGKILLed just as it dequeued a request dies holding it: nothing answers. Made
    # here by stopping the launcher (no new spare), killing its spare and taking the next
    # request off the socket in its place, then dropping it.
    launcher, spare = await launcher_and_spare(supervisor, tmp_path / "a")
    os.kill(launcher, signal.SIGSTOP)
    try:
        os.kill(spare, signal.SIGKILL)
        await wait_until(lambda: not Path(f"/proc/{spare}").exists(), 5)  # reaped by the kernel
        with steal_launcher_socket(launcher) as stolen:
            launching = asyncio.ensure_future(launch(supervisor, tmp_path / "b", ["sh", "-c", "echo on"]))
            # Not made non-blocking: that would be the launcher's socket too (one open file).
            await wait_until(lambda: select.select([stolen], [], [], 0)[0], 5)
            taken = socket.recv_fds(stolen, 4096, 4)
            for fd in taken[1]:
                os.close(fd)  # what dies with the spare that took it
            await asyncio.sleep(0.2)
            assert not launching.done()  # sent again, waiting for a spare
    finally:
        os.kill(launcher, signal.SIGCONT)
    handle = await asyncio.wait_for(launching, 10)
    record = await supervisor.wait(handle, tmp_path / "b" / "exit.json")
    assert record is not None and record.exit_code == 0 and logged(tmp_path / "b") == ["on"]
    assert supervisor.launcher_pid == launcher


async def test_a_launch_cancelled_while_waiting_for_its_monitor_leaves_the_next_launch_its_own(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    # Cancelled after its request went: the launcher's answer must not be taken for the next
    # request's, and the monitor it brings, which nobody waits for, is killed.
    _launcher, spare = await launcher_and_spare(supervisor, tmp_path / "a")
    os.kill(spare, signal.SIGSTOP)  # the request waits on the socket
    try:
        abandoned = asyncio.ensure_future(launch(supervisor, tmp_path / "b", ["sleep", "1"]))
        await asyncio.sleep(0.2)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
    finally:
        os.kill(spare, signal.SIGCONT)
    handle = await asyncio.wait_for(
        launch(supervisor, tmp_path / "c", ["sh", "-c", "echo mine; sleep 30"]), 10
    )
    assert handle.monitor_pid != spare  # the spare took the abandoned request: its monitor
    assert Supervisor.alive(handle)
    await wait_until(lambda: logged(tmp_path / "c") == ["mine"], 5)
    await wait_until(lambda: not Path(f"/proc/{spare}").exists(), 5)  # killed, reaped by the kernel
    processes.send_signal(handle.pid, signal.SIGKILL, handle.ticks)
    record = await supervisor.wait(handle, tmp_path / "c" / "exit.json")
    assert record is not None and record.signal == signal.SIGKILL


async def test_start_errors_come_from_the_monitor(supervisor: Supervisor, tmp_path: Path) -> None:
    with pytest.raises(MonitorStartError, match="no-such-binary"):
        await launch(supervisor, tmp_path / "a", ["/no-such-binary"])
    handle = await launch(supervisor, tmp_path / "b", ["true"])  # the launcher is still fine
    assert (await supervisor.wait(handle, tmp_path / "b" / "exit.json")) is not None


async def test_many_launches_at_once(supervisor: Supervisor, tmp_path: Path) -> None:
    handles = await asyncio.gather(
        *(launch(supervisor, tmp_path / f"c{i}", ["sh", "-c", f"echo {i}; exit {i}"]) for i in range(20))
    )
    assert len({handle.monitor_pid for handle in handles}) == 20
    for i, handle in enumerate(handles):
        record = await supervisor.wait(handle, tmp_path / f"c{i}" / "exit.json")
        assert record is not None and record.exit_code == i
        assert logged(tmp_path / f"c{i}") == [str(i)]


async def test_a_runtime_command_that_hangs_dies_with_its_monitor(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    # pid_file mode: argv stands for `runc create`; this one never writes the pid file nor ends.
    run_dir = tmp_path / "hang"
    run_dir.mkdir()
    marker = f"300.{os.getpid()}{secrets.randbelow(10**6)}"  # sleep takes fractions: a unique argv
    spec = MonitorSpec(
        argv=["sh", "-c", f"sleep {marker} & sleep {marker}"],  # a grandchild in the group too
        env=["PATH=/usr/bin:/bin"],
        log_path=str(run_dir / "out.log"),
        exit_path=str(run_dir / "exit.json"),
        pid_file=str(run_dir / "pid"),
    )
    with pytest.raises(MonitorStartError) as error:
        await supervisor.launch(spec, run_dir, timeout=1.0)
    assert error.value.timed_out

    def hanging() -> list[int]:
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, marker)]

    for _ in range(100):  # the monitor and its process group were SIGKILLed: gone in a moment
        if not hanging():
            break
        await asyncio.sleep(0.02)
    assert hanging() == []


async def test_a_runtime_command_that_cannot_start_is_reported(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    run_dir = tmp_path / "missing"
    run_dir.mkdir()
    spec = MonitorSpec(
        argv=["no-such-runtime", "create"],
        env=["PATH=/usr/bin:/bin"],
        log_path=str(run_dir / "out.log"),
        exit_path=str(run_dir / "exit.json"),
        pid_file=str(run_dir / "pid"),
    )
    with pytest.raises(MonitorStartError) as error:
        await supervisor.launch(spec, run_dir)
    assert "no-such-runtime" in str(error.value) and "No such file" in str(error.value)


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
