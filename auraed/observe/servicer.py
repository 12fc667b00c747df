"""aurae.observe.v0.ObserveService over gRPC."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from auraed.api.aurae.observe import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.names import validate_label, validate_path
from auraed.observe.events import ObserveHub, SignalEvent
from auraed.observe.logfile import LogSource, LogWatch, stream_lines
from auraed.wire.handlers import Context

SERVICE_NAME = "aurae.observe.v0.ObserveService"
MAX_TAIL = 1_000_000
CHANNEL_STREAMS = {
    pb.LogChannelType.UNSPECIFIED: frozenset({"stdout", "stderr"}),
    pb.LogChannelType.STDOUT: frozenset({"stdout"}),
    pb.LogChannelType.STDERR: frozenset({"stderr"}),
}
STREAM_CHANNEL = {"stdout": pb.LogChannelType.STDOUT, "stderr": pb.LogChannelType.STDERR}


def _tail(value: int | None) -> int | None:
    if value is not None and value > MAX_TAIL:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"tail: at most {MAX_TAIL}")
    return value


def _channel(value: Any) -> frozenset[str]:
    streams = CHANNEL_STREAMS.get(value)
    if streams is None:
        raise AuraeError(ErrorKind.INVALID_ARGUMENT, f"channel_type: unknown value {value!r}")
    return streams


def _validate_workload(workload: str) -> None:
    """CELL/EXECUTABLE, as cell paths and executable names are; without both halves a cell
    path's own error ("must not be empty") would not say what is missing."""
    cell, _, name = workload.rpartition("/")
    if not cell or not name:
        raise AuraeError(
            ErrorKind.INVALID_ARGUMENT,
            f"workload: expected CELL/EXECUTABLE, e.g. web/server, not {workload!r}",
        )
    validate_path(cell, "workload")
    validate_label(name, "workload")


def _signal_message(event: SignalEvent) -> pb.ObserveServiceGetPosixSignalsStreamResponse:
    return pb.ObserveServiceGetPosixSignalsStreamResponse(
        signal=pb.PosixSignal(
            signal=event.signal,
            signal_name=event.name,
            process_id=event.process_id,
            workload=event.workload,
            how=event.how,
            timestamp=event.timestamp,
        )
    )


class ObserveServicer:
    """``executable_logs`` finds an executable's log by CELL/NAME (Executables.log_source): given,
    not imported, so that observe, servicer and all, sits below the cells that publish into it."""

    def __init__(
        self, hub: ObserveHub, executable_logs: Callable[[str], LogSource | None], log_watch: LogWatch
    ) -> None:
        self._hub = hub
        self._executable_logs = executable_logs
        self._log_watch = log_watch

    async def get_aurae_daemon_log_stream(
        self, request: pb.ObserveServiceGetAuraeDaemonLogStreamRequest, context: Context
    ) -> AsyncIterator[pb.ObserveServiceGetAuraeDaemonLogStreamResponse]:
        tail = _tail(request.tail)
        with self._hub.daemon_log.subscribe(tail) as live:
            for line in live.recent:
                yield pb.ObserveServiceGetAuraeDaemonLogStreamResponse(
                    item=pb.LogItem(item="auraed", line=line.line, timestamp=line.timestamp, level=line.level)
                )
            while request.follow:
                line = await live.get()
                yield pb.ObserveServiceGetAuraeDaemonLogStreamResponse(
                    item=pb.LogItem(item="auraed", line=line.line, timestamp=line.timestamp, level=line.level)
                )

    async def get_sub_process_stream(
        self, request: pb.ObserveServiceGetSubProcessStreamRequest, context: Context
    ) -> AsyncIterator[pb.ObserveServiceGetSubProcessStreamResponse]:
        cell_name = validate_path(request.cell_name, "cell_name")
        name = validate_label(request.executable_name, "executable_name")
        streams = _channel(request.channel_type)
        tail = _tail(request.tail)
        workload = f"{cell_name}/{name}"
        source = self._executable_logs(workload)
        if source is None:
            raise AuraeError.not_found(f"executable {name} in cell {cell_name}")
        lines = stream_lines(
            source.path, streams, tail, request.follow, source.finished, watch=self._log_watch
        )
        async with contextlib.aclosing(lines):  # its file watch ends with the call, not at GC
            async for line in lines:
                yield pb.ObserveServiceGetSubProcessStreamResponse(
                    item=pb.LogItem(
                        item=workload,
                        channel=STREAM_CHANNEL[line.stream],
                        line=line.content,
                        timestamp=line.timestamp,
                    )
                )

    async def get_posix_signals_stream(
        self, request: pb.ObserveServiceGetPosixSignalsStreamRequest, context: Context
    ) -> AsyncIterator[pb.ObserveServiceGetPosixSignalsStreamResponse]:
        workload = request.workload
        if workload:
            _validate_workload(workload)
        with self._hub.signals.subscribe(None if request.include_past else 0) as live:
            for event in live.recent:
                if not workload or event.workload == workload:
                    yield _signal_message(event)
            while True:
                event = await live.get()
                if not workload or event.workload == workload:
                    yield _signal_message(event)
