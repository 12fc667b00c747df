"""CellService end to end on this host's real cgroups (v1 hybrid), with real processes."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from auraed.api.aurae.cells import v0 as pb
from auraed.api.aurae.observe import v0 as observe
from auraed.client import AuraeClient, ClientError
from tests.conftest import DaemonProcess, wait_until

CELLS = "aurae.cells.v0.CellService"
OBSERVE = "aurae.observe.v0.ObserveService"
V1 = Path("/sys/fs/cgroup")


async def allocate(client: AuraeClient, name: str, **fields: Any) -> Any:
    return await client.call(
        CELLS, "Allocate", pb.CellServiceAllocateRequest(cell=pb.Cell(name=name, **fields))
    )


async def start(client: AuraeClient, cell: str, name: str, command: str, **fields: Any) -> int:
    request = pb.CellServiceStartRequest(
        cell_name=cell, executable=pb.Executable(name=name, shell_command=command, **fields)
    )
    reply = await client.call(CELLS, "Start", request)
    return int(reply.pid)


async def status(client: AuraeClient, cell: str, name: str) -> pb.ExecutableStatus:
    reply = await client.call(CELLS, "List", pb.CellServiceListRequest())

    def find(nodes: list[pb.CellGraphNode]) -> pb.ExecutableStatus | None:
        for node in nodes:
            for executable in node.executables:
                if executable.cell_name == cell and executable.name == name:
                    return executable
            found = find(node.children)
            if found is not None:
                return found
        return None

    found = find(reply.cells)
    assert found is not None, f"{cell}/{name} not listed"
    return found


async def wait_exited(
    client: AuraeClient, cell: str, name: str, timeout: float = 20.0
) -> pb.ExecutableStatus:
    async def exited() -> bool:
        return (await status(client, cell, name)).state == pb.ExecutableState.EXITED

    await wait_until(exited, timeout)
    return await status(client, cell, name)


async def output(client: AuraeClient, cell: str, name: str, follow: bool = False) -> list[str]:
    request = observe.ObserveServiceGetSubProcessStreamRequest(
        cell_name=cell, executable_name=name, follow=follow
    )
    return [
        item.item.line async for item in client.stream(OBSERVE, "GetSubProcessStream", request, timeout=30)
    ]


def cgroup_dir(daemon: DaemonProcess, controller: str, cell: str) -> Path:
    return V1 / controller / daemon.cgroup_base / cell


async def test_allocate_list_free_nested(client: AuraeClient, daemon: DaemonProcess) -> None:
    reply = await allocate(client, "web", cpu=pb.CpuController(weight=200), pids=pb.PidsController(max=50))
    assert reply.cgroup_path == f"/{daemon.cgroup_base}/web"
    await allocate(client, "web/api", memory=pb.MemoryController(max=64 << 20))
    for controller in ("cpu", "memory", "pids", "cpuset"):
        assert cgroup_dir(daemon, controller, "web/api").is_dir()
    assert (cgroup_dir(daemon, "pids", "web") / "pids.max").read_text().strip() == "50"
    assert int((cgroup_dir(daemon, "memory", "web/api") / "memory.limit_in_bytes").read_text()) == 64 << 20
    # weight 200 -> shares 2 + (199 * 262142) // 9999
    assert int((cgroup_dir(daemon, "cpu", "web") / "cpu.shares").read_text()) == 2 + (199 * 262142) // 9999
    listing = await client.call(CELLS, "List", pb.CellServiceListRequest())
    assert [n.cell.name for n in listing.cells] == ["web"]
    assert [n.cell.name for n in listing.cells[0].children] == ["web/api"]
    assert listing.cells[0].children[0].cell.memory.max == 64 << 20
    await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name="web"))
    for controller in ("cpu", "memory", "pids", "cpuset", "cpuacct", "freezer"):
        assert not cgroup_dir(daemon, controller, "web").exists()
    assert (await client.call(CELLS, "List", pb.CellServiceListRequest())).cells == []


@pytest.mark.parametrize(
    ("cell", "code", "words"),
    [
        (pb.Cell(name="Bad_Name"), "INVALID_ARGUMENT", "cell.name"),
        (pb.Cell(name=""), "INVALID_ARGUMENT", "cell.name"),
        (pb.Cell(name="a" * 64), "INVALID_ARGUMENT", "DNS label"),
        (pb.Cell(name="aurae"), "INVALID_ARGUMENT", "reserved"),
        (pb.Cell(name="nope/child"), "NOT_FOUND", "cell nope"),
        (pb.Cell(name="x", cpu=pb.CpuController(weight=0)), "INVALID_ARGUMENT", "cell.cpu.weight"),
        (pb.Cell(name="x", cpu=pb.CpuController(weight=10001)), "INVALID_ARGUMENT", "cell.cpu.weight"),
        (
            pb.Cell(name="x", cpuset=pb.CpusetController(cpus="0-4095")),
            "INVALID_ARGUMENT",
            "cell.cpuset.cpus",
        ),
        (pb.Cell(name="x", cpuset=pb.CpusetController(cpus="zero")), "INVALID_ARGUMENT", "cell.cpuset.cpus"),
        (pb.Cell(name="x", memory=pb.MemoryController(max=1)), "INVALID_ARGUMENT", "cell.memory.max"),
        (
            pb.Cell(name="x", memory=pb.MemoryController(high=2 << 20, max=1 << 20)),
            "INVALID_ARGUMENT",
            "cell.memory.high",
        ),
        # memory.low has no cgroup v1 equivalent: refused rather than silently ignored.
        (pb.Cell(name="x", memory=pb.MemoryController(low=1 << 20)), "FAILED_PRECONDITION", "memory_low"),
        (pb.Cell(name="x", pids=pb.PidsController(max=0)), "INVALID_ARGUMENT", "cell.pids.max"),
    ],
)
async def test_bad_cells_are_refused(
    client: AuraeClient, daemon: DaemonProcess, cell: pb.Cell, code: str, words: str
) -> None:
    with pytest.raises(ClientError) as error:
        await client.call(CELLS, "Allocate", pb.CellServiceAllocateRequest(cell=cell))
    assert error.value.code == code
    assert words in error.value.message
    assert not cgroup_dir(daemon, "memory", "x").exists()


async def test_duplicates_and_unknowns(client: AuraeClient) -> None:
    await allocate(client, "dup")
    with pytest.raises(ClientError) as error:
        await allocate(client, "dup")
    assert error.value.code == "ALREADY_EXISTS"
    with pytest.raises(ClientError) as error:
        await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name="ghost"))
    assert error.value.code == "NOT_FOUND"
    with pytest.raises(ClientError) as error:
        await client.call(CELLS, "Stop", pb.CellServiceStopRequest(cell_name="dup", executable_name="ghost"))
    assert error.value.code == "NOT_FOUND"
    await start(client, "dup", "sleeper", "sleep 30")
    with pytest.raises(ClientError) as error:
        await start(client, "dup", "sleeper", "sleep 30")
    assert error.value.code == "ALREADY_EXISTS"
    with pytest.raises(ClientError) as error:
        await allocate(client, "dup/child")
    assert error.value.code == "FAILED_PRECONDITION"
    with pytest.raises(ClientError) as error:
        await client.call(
            CELLS,
            "Start",
            pb.CellServiceStartRequest(
                cell_name="dup", executable=pb.Executable(name="both", args=["true"], shell_command="true")
            ),
        )
    assert error.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ClientError) as error:
        await client.call(
            CELLS,
            "Start",
            pb.CellServiceStartRequest(
                cell_name="dup", executable=pb.Executable(name="missing", args=["/nonexistent/program"])
            ),
        )
    assert error.value.code == "FAILED_PRECONDITION"
    assert "/nonexistent/program" in error.value.message


async def test_executable_output_exit_code_and_environment(client: AuraeClient) -> None:
    await allocate(client, "out")
    await start(
        client,
        "out",
        "hello",
        "echo hello; echo oops >&2; echo $GREETING; pwd; exit 3",
        env=["GREETING=hi there"],
        cwd="/tmp",
    )
    final = await wait_exited(client, "out", "hello")
    assert final.exit_code == 3 and final.signal is None and not final.oom_killed
    # stdout and stderr are separate pipes: their relative order is not kept, each one's is.
    assert sorted(await output(client, "out", "hello")) == sorted(["hello", "oops", "hi there", "/tmp"])
    for channel, lines in (
        (observe.LogChannelType.STDOUT, ["hello", "hi there", "/tmp"]),
        (observe.LogChannelType.STDERR, ["oops"]),
    ):
        request = observe.ObserveServiceGetSubProcessStreamRequest(
            cell_name="out", executable_name="hello", channel_type=channel
        )
        assert [i.item.line async for i in client.stream(OBSERVE, "GetSubProcessStream", request)] == lines


async def test_follow_streams_until_exit(client: AuraeClient) -> None:
    await allocate(client, "follow")
    await start(client, "follow", "ticker", "for i in 1 2 3; do echo tick $i; sleep 0.2; done")
    lines = await asyncio.wait_for(output(client, "follow", "ticker", follow=True), 20)
    assert lines == ["tick 1", "tick 2", "tick 3"]


async def test_stop_is_graceful_then_forced(client: AuraeClient) -> None:
    await allocate(client, "stops")
    await start(client, "stops", "polite", "sleep 60")
    stopped = await client.call(
        CELLS, "Stop", pb.CellServiceStopRequest(cell_name="stops", executable_name="polite")
    )
    assert stopped.status.state == pb.ExecutableState.EXITED and stopped.status.signal == 15
    # A process that ignores SIGTERM is killed once the grace period is over.
    await start(client, "stops", "stubborn", "trap '' TERM; echo ready; while true; do sleep 0.1; done")
    await wait_until(lambda: _has_output(client, "stops", "stubborn"))
    stopped = await client.call(
        CELLS,
        "Stop",
        pb.CellServiceStopRequest(cell_name="stops", executable_name="stubborn", grace_period_ms=300),
    )
    assert stopped.status.signal == 9
    signals_request = observe.ObserveServiceGetPosixSignalsStreamRequest(
        workload="stops/stubborn", include_past=True
    )
    seen: list[tuple[str, str]] = []
    async for item in client.stream(OBSERVE, "GetPosixSignalsStream", signals_request):
        seen.append((item.signal.signal_name, item.signal.how))
        if len(seen) == 3:
            break
    assert seen == [("SIGTERM", "sent"), ("SIGKILL", "sent"), ("SIGKILL", "terminated")]


async def _has_output(client: AuraeClient, cell: str, name: str) -> bool:
    return bool(await output(client, cell, name))


async def test_memory_limit_oom_kills_and_is_reported(client: AuraeClient) -> None:
    await allocate(client, "hog", memory=pb.MemoryController(max=32 << 20))
    await start(client, "hog", "eater", "exec python3 -c 'b = bytearray(256 << 20); print(len(b))'")
    final = await wait_exited(client, "hog", "eater")
    assert final.signal == 9
    assert final.oom_killed


async def test_pids_limit_makes_fork_fail(client: AuraeClient) -> None:
    await allocate(client, "forks", pids=pb.PidsController(max=4))
    await start(client, "forks", "bomb", "for i in 1 2 3 4 5 6 7 8; do sleep 2 & done; wait; echo done")
    await wait_exited(client, "forks", "bomb")
    text = " ".join(await output(client, "forks", "bomb"))
    assert "fork" in text.lower() or "resource temporarily unavailable" in text.lower()


async def test_a_cell_allowing_one_process_runs_it(client: AuraeClient) -> None:
    """pids.max 1, on the cell or on a cell above it: the one process starts."""
    await allocate(client, "single", pids=pb.PidsController(max=1))
    await allocate(client, "capped", pids=pb.PidsController(max=1))
    await allocate(client, "capped/inner")
    for cell in ("single", "capped/inner"):
        await start(client, cell, "only", "echo alone")
        assert (await wait_exited(client, cell, "only")).exit_code == 0
        assert await output(client, cell, "only") == ["alone"]


async def test_cpu_max_throttles(client: AuraeClient, daemon: DaemonProcess) -> None:
    await allocate(client, "slow", cpu=pb.CpuController(max=10_000, period=100_000))
    await start(client, "slow", "spin", "timeout 1 sh -c 'while :; do :; done'; true")
    await wait_exited(client, "slow", "spin")
    stat = dict(
        line.split() for line in (cgroup_dir(daemon, "cpu", "slow") / "cpu.stat").read_text().splitlines()
    )
    assert int(stat["nr_throttled"]) > 0


async def test_isolate_process_gives_own_pids_proc_and_hostname(client: AuraeClient) -> None:
    await allocate(client, "iso", isolate_process=True)
    await start(client, "iso", "whoami", "echo $$; hostname; ls /proc | grep -c '^[0-9]'")
    final = await wait_exited(client, "iso", "whoami")
    assert final.exit_code == 0
    pid, hostname, visible = await output(client, "iso", "whoami")
    assert pid == "2"  # PID 1 is the init that relays signals to it
    assert hostname == "iso"
    assert int(visible) <= 4  # sh, hostname/ls/grep: nothing of the host
    assert socket.gethostname() != "iso"


async def test_isolate_network_has_only_loopback_up(client: AuraeClient) -> None:
    await allocate(client, "net", isolate_network=True)
    await start(
        client,
        "net",
        "links",
        "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; "
        "cat /sys/class/net/lo/operstate 2>/dev/null; ip -o link show lo",
    )
    await wait_exited(client, "net", "links")
    lines = await output(client, "net", "links")
    assert lines[0] == "lo" and len([x for x in lines if x == "lo"]) == 1
    assert "UP" in lines[-1] or "LOOPBACK,UP" in lines[-1]
    # Executables of the same cell share the namespace.
    listener = await start(client, "net", "listener", "exec python3 -m http.server --bind 127.0.0.1 18080")
    assert listener
    await start(
        client,
        "net",
        "caller",
        'for i in $(seq 50); do python3 -c "import urllib.request as u; '
        "print(u.urlopen('http://127.0.0.1:18080/').status)\" && break; sleep 0.1; done",
    )
    await wait_exited(client, "net", "caller")
    assert "200" in await output(client, "net", "caller")
    await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name="net"))


async def test_free_stops_everything_and_removes_cgroups(client: AuraeClient, daemon: DaemonProcess) -> None:
    await allocate(client, "busy")
    await allocate(client, "busy/inner")
    pid = await start(client, "busy/inner", "sleeper", "sleep 600")
    assert Path(f"/proc/{pid}").exists()
    await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name="busy", grace_period_ms=500))
    await wait_until(lambda: not Path(f"/proc/{pid}").exists())
    for hierarchy in V1.iterdir():
        assert not (hierarchy / daemon.cgroup_base / "busy").exists()
