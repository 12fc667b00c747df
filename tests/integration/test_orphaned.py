"""A monitor killed under the process it supervises (OOM killer, an operator's kill -9).

The process runs on, unsupervised: its output is no longer logged and its exit status will not
be known, but auraed still lists it as running (saying why) and can stop it, also after a
restart of its own. Once it has ended it shows as ended with an unknown status.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.containers import v0 as pb
from auraed.system.supervisor import ORPHANED
from tests.conftest import DaemonProcess, wait_until
from tests.integration.containers_helpers import CONTAINERS, create, delete, import_layout, start, status
from tests.integration.test_cells import CELLS, allocate
from tests.integration.test_cells import start as start_executable
from tests.integration.test_cells import status as executable_status
from tests.support.images import BuiltImage

BUSYBOX = "localhost/busybox:orphan"


def kill_monitor_of(pid: int) -> None:
    """SIGKILL the monitor: the supervised process's parent (the monitor is its subreaper)."""
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert b"auraed" in Path(f"/proc/{parent}/cmdline").read_bytes()
    os.kill(parent, signal.SIGKILL)


def ended(pid: int) -> bool:
    """Gone, or a zombie: an orphan's new parent (this machine's init) may not reap it at once."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_an_orphaned_container_is_still_running_and_stoppable_across_a_restart(
    daemon: DaemonProcess, busybox_layout: BuiltImage
) -> None:
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, BUSYBOX)
        await create(client, "orphan", BUSYBOX, command=["sleep", "300"])
        pid = (await start(client, "orphan")).pid
        kill_monitor_of(pid)

        async def orphaned() -> bool:
            return (await status(client, "orphan")).reason == ORPHANED

        await wait_until(orphaned)
        assert (await status(client, "orphan")).state == pb.ContainerState.RUNNING
    daemon.kill9()
    daemon.start()
    async with daemon.client() as client:
        found = await status(client, "orphan")
        assert (found.state, found.reason) == (pb.ContainerState.RUNNING, ORPHANED)
        request = pb.ContainerServiceStopRequest(container_id="orphan", timeout_ms=500)
        stopped = (await client.call(CONTAINERS, "Stop", request)).status
        assert stopped.state == pb.ContainerState.UNKNOWN and ended(pid)
        await delete(client, "orphan", force=False)


async def test_an_orphaned_executable_is_still_running_and_stoppable(daemon: DaemonProcess) -> None:
    async with daemon.client() as client:
        await allocate(client, "orphans")
        pid = await start_executable(client, "orphans", "sleeper", "exec sleep 300")
        kill_monitor_of(pid)
        await wait_until(lambda: "its monitor ended while it runs" in daemon.log())
        assert (
            await executable_status(client, "orphans", "sleeper")
        ).state == cells_pb.ExecutableState.RUNNING
        request = cells_pb.CellServiceStopRequest(
            cell_name="orphans", executable_name="sleeper", grace_period_ms=500
        )
        await client.call(CELLS, "Stop", request)
        assert ended(pid)
        assert (
            await executable_status(client, "orphans", "sleeper")
        ).state == cells_pb.ExecutableState.UNKNOWN
        await client.call(CELLS, "Free", cells_pb.CellServiceFreeRequest(cell_name="orphans"))
