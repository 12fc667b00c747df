"""The gate every call passes: open while the daemon serves, closed once it begins to shut down."""

from __future__ import annotations

import grpc

from auraed.wire.handlers import Context


class CallGate:
    """Admits calls until :meth:`close`; from then on every new call is refused with UNAVAILABLE.

    Shutdown closes it before it stops any subsystem: a call admitted while cells and containers
    are being stopped could start an executable or a container that outlives the daemon. Calls
    already running carry on; the server's stop grace ends them.
    """

    def __init__(self) -> None:
        self._why_closed = ""

    @property
    def closed(self) -> bool:
        return bool(self._why_closed)

    def close(self, why: str) -> None:
        self._why_closed = why

    async def admit(self, context: Context) -> None:
        """Refuse the call (grpc's abort) when the gate is closed; return otherwise."""
        if self._why_closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._why_closed)
