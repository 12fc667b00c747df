"""aurae.cells.v0.CellService over gRPC: requests are validated into typed values here, at the edge."""

from __future__ import annotations

from auraed.api.aurae.cells import v0 as pb
from auraed.cells.cells import Cells
from auraed.cells.executables import ExecutableRecord, State
from auraed.cells.model import parse_cell, parse_executable
from auraed.names import seconds_from_ms, validate_label, validate_path
from auraed.wire.handlers import Context

SERVICE_NAME = "aurae.cells.v0.CellService"

STATES = {
    State.STARTING: pb.ExecutableState.STARTING,
    State.RUNNING: pb.ExecutableState.RUNNING,
    State.EXITED: pb.ExecutableState.EXITED,
    State.UNKNOWN: pb.ExecutableState.UNKNOWN,
}


def executable_status(record: ExecutableRecord) -> pb.ExecutableStatus:
    return pb.ExecutableStatus(
        cell_name=record.spec.cell_name,
        name=record.spec.name,
        pid=record.pid,
        state=STATES[record.state],
        exit_code=record.exit_code,
        signal=record.signal,
        oom_killed=record.oom_killed,
        started_at=record.started_at,
        finished_at=record.finished_at,
        args=list(record.spec.argv),
        description=record.spec.description,
    )


class CellServicer:
    def __init__(self, cells: Cells) -> None:
        self._cells = cells

    async def allocate(
        self, request: pb.CellServiceAllocateRequest, context: Context
    ) -> pb.CellServiceAllocateResponse:
        spec = parse_cell(request.cell)
        await self._cells.allocate(spec)
        return pb.CellServiceAllocateResponse(
            cell_name=spec.name, cgroup_path=self._cells.cgroup_path(spec.name)
        )

    async def free(self, request: pb.CellServiceFreeRequest, context: Context) -> pb.CellServiceFreeResponse:
        name = validate_path(request.cell_name, "cell_name")
        grace = seconds_from_ms(request.grace_period_ms, "grace_period_ms")
        await self._cells.free(name, self._cells.grace(grace))
        return pb.CellServiceFreeResponse()

    async def start(
        self, request: pb.CellServiceStartRequest, context: Context
    ) -> pb.CellServiceStartResponse:
        cell_name = validate_path(request.cell_name, "cell_name")
        spec = parse_executable(cell_name, request.executable)
        record = await self._cells.start(spec)
        return pb.CellServiceStartResponse(pid=record.pid)

    async def stop(self, request: pb.CellServiceStopRequest, context: Context) -> pb.CellServiceStopResponse:
        cell_name = validate_path(request.cell_name, "cell_name")
        name = validate_label(request.executable_name, "executable_name")
        grace = seconds_from_ms(request.grace_period_ms, "grace_period_ms")
        record = await self._cells.stop(cell_name, name, self._cells.grace(grace))
        return pb.CellServiceStopResponse(status=executable_status(record))

    async def list(self, request: pb.CellServiceListRequest, context: Context) -> pb.CellServiceListResponse:
        return pb.CellServiceListResponse(cells=[self._node(r.spec.name) for r in self._cells.children(None)])

    def _node(self, name: str) -> pb.CellGraphNode:
        record = self._cells.get(name)
        return pb.CellGraphNode(
            cell=record.spec.to_message(),
            children=[self._node(child.spec.name) for child in self._cells.children(name)],
            executables=[executable_status(e) for e in self._cells.executables.in_cell(name)],
        )
