"""aurae.system.v0.SystemService: the daemon itself and, where auraed is PID 1, the machine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from auraed.api.aurae.system import v0 as pb
from auraed.errors import AuraeError
from auraed.server.authz import peer_identities
from auraed.wire.handlers import Context

SERVICE_NAME = "aurae.system.v0.SystemService"
MAX_REASON_CHARS = 256  # a reason is one line of the daemon's log, not a document

log = logging.getLogger(__name__)


def _reason(text: str) -> str:
    if len(text) > MAX_REASON_CHARS:
        raise AuraeError.invalid("reason", f"at most {MAX_REASON_CHARS} characters, got {len(text)}")
    if not text.isprintable():
        raise AuraeError.invalid("reason", "must be printable text on one line")
    return text


class Machine(Protocol):
    """The machine, where auraed is its PID 1 (auraed/init/pid1.py Pid1, handed over by
    auraed/__main__.py)."""

    def power_off(self, reason: str, reboot: bool = False) -> str:
        """Stop auraed, then power off or reboot (or exit, PID 1 of a pid namespace): what follows
        the stop. Raises FAILED_PRECONDITION where it could only halt the machine, or cannot reboot."""
        ...


class SystemServicer:
    """``request_stop`` stops the daemon gracefully (what SIGTERM does); ``machine`` is None
    unless auraed is PID 1."""

    def __init__(self, request_stop: Callable[[], None], machine: Machine | None = None) -> None:
        self._request_stop = request_stop
        self._machine = machine

    async def shutdown(
        self, request: pb.SystemServiceShutdownRequest, context: Context
    ) -> pb.SystemServiceShutdownResponse:
        reason = _reason(request.reason)
        caller = ",".join(peer_identities(context)) or "an unidentified client"
        why = f"Shutdown called by {caller}" + (f": {reason}" if reason else "")
        if self._machine is None:
            if request.reboot:
                raise AuraeError.precondition("reboot: auraed is not this machine's init")
            log.info("%s: stopping", why)
            self._request_stop()
            return pb.SystemServiceShutdownResponse(then="exit")
        # PID 1 stops the daemon, then powers off (or exits, PID 1 of a pid namespace); refused
        # with FAILED_PRECONDITION where it could only halt the machine.
        return pb.SystemServiceShutdownResponse(then=self._machine.power_off(why, request.reboot))
