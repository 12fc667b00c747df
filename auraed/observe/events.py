"""The event streams ObserveService serves: auraed's log lines and POSIX signals."""

from __future__ import annotations

import dataclasses
import logging
import signal as signals
import time

from auraed.observe.broadcast import Broadcast


@dataclasses.dataclass(frozen=True)
class DaemonLogLine:
    timestamp: float
    level: str
    line: str


@dataclasses.dataclass(frozen=True)
class SignalEvent:
    signal: int
    process_id: int
    workload: str
    how: str  # "sent" or "terminated"
    timestamp: float = dataclasses.field(default_factory=time.time)

    @property
    def name(self) -> str:
        try:
            return signals.Signals(self.signal).name
        except ValueError:
            return f"SIG{self.signal}"


class DaemonLogHandler(logging.Handler):
    """Feeds every log record auraed emits into a Broadcast for GetAuraeDaemonLogStream."""

    def __init__(self, broadcast: Broadcast[DaemonLogLine]) -> None:
        super().__init__()
        self._broadcast = broadcast
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._broadcast.publish(DaemonLogLine(record.created, record.levelname, self.format(record)))
        except Exception:  # a log handler must never raise into the code that logged
            self.handleError(record)


@dataclasses.dataclass
class ObserveHub:
    """Everything observable that is not a file: one instance per daemon, passed to who needs it."""

    daemon_log: Broadcast[DaemonLogLine]
    signals: Broadcast[SignalEvent]

    @classmethod
    def create(cls, log_lines: int) -> ObserveHub:
        return cls(daemon_log=Broadcast(log_lines), signals=Broadcast(1000))
