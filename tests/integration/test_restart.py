"""kill -9 of auraed: cells and executables survive, and a restarted auraed finds them again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from auraed.api.aurae.cells import v0 as pb
from auraed.client import AuraeClient
from auraed.state.store import Store
from tests.conftest import DaemonFactory, catches, wait_until
from tests.integration.test_cells import CELLS, allocate, output, start, status, wait_exited


async def test_kill_9_and_restart_recovers_cells_and_executables(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    async with daemon.client() as client:
        await allocate(client, "keep", memory=pb.MemoryController(max=128 << 20))
        await allocate(client, "keep/inner")
        survivor = await start(
            client, "keep/inner", "survivor", "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.1; done"
        )
        doomed = await start(
            client, "keep/inner", "doomed", "trap 'exit 7' TERM; while true; do sleep 0.1; done"
        )
        finished = await start(client, "keep/inner", "finished", "echo early; exit 4")
        await wait_exited(client, "keep/inner", "finished")
        await wait_until(lambda: catches(doomed, signal.SIGTERM))
    assert finished
    daemon.kill9()
    # While auraed is down: one executable ends with a known status, the other keeps writing.
    os.kill(doomed, signal.SIGTERM)
    await wait_until(lambda: not Path(f"/proc/{doomed}").exists())
    daemon.start()
    assert "recovered 2 cells" in daemon.log()
    async with daemon.client() as client:
        listing = await client.call(CELLS, "List", pb.CellServiceListRequest())
        assert [n.cell.name for n in listing.cells] == ["keep"]
        assert listing.cells[0].cell.memory.max == 128 << 20
        alive = await status(client, "keep/inner", "survivor")
        assert alive.state == pb.ExecutableState.RUNNING and alive.pid == survivor
        gone = await status(client, "keep/inner", "doomed")
        assert gone.state == pb.ExecutableState.EXITED and gone.exit_code == 7
        earlier = await status(client, "keep/inner", "finished")
        assert earlier.state == pb.ExecutableState.EXITED and earlier.exit_code == 4
        # Logs kept flowing while auraed was down, and still do.
        before = len(await output(client, "keep/inner", "survivor"))
        await wait_until(lambda: _more_lines(client, before), timeout=10)
        # And the recovered executable is still controllable.
        stopped = await client.call(
            CELLS, "Stop", pb.CellServiceStopRequest(cell_name="keep/inner", executable_name="survivor")
        )
        assert stopped.status.state == pb.ExecutableState.EXITED and stopped.status.signal == 15
        await client.call(CELLS, "Free", pb.CellServiceFreeRequest(cell_name="keep"))


async def _more_lines(client: AuraeClient, before: int) -> bool:
    return len(await output(client, "keep/inner", "survivor")) > before


async def test_half_made_cell_is_cleaned_at_start(daemon_factory: DaemonFactory) -> None:
    """A cell record left mid-allocation (auraed killed in between) is torn down, not resurrected."""
    daemon = daemon_factory()
    async with daemon.client() as client:
        await allocate(client, "half")
    daemon.kill9()
    store = Store(daemon.root / "state" / "auraed.db")
    doc = store.get("cell", "half")
    assert doc is not None
    doc["state"] = "allocating"
    store.put("cell", "half", doc)
    store.close()
    daemon.start()
    assert "was being allocated" in daemon.log()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        assert not (hierarchy / daemon.cgroup_base / "half").exists()
    async with daemon.client() as client:
        assert (await client.call(CELLS, "List", pb.CellServiceListRequest())).cells == []
