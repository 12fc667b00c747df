"""RuntimeService RPCs auraed does not serve, answered UNIMPLEMENTED with a message saying so:
those not built yet (each moves to its part when it is built; this list is what remains of the CRI
issue), and those auraed refuses for good (:data:`NOT_SUPPORTED`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from auraed.cri.errors import CriError
from auraed.errors import ErrorKind

NOT_YET: tuple[str, ...] = ()  # every RPC of the CRI issue is served now


STREAMING: frozenset[str] = frozenset()  # of NOT_YET, those whose replies stream

NOT_SUPPORTED: Mapping[str, str] = {
    # runc checkpoints and restores through CRIU, which auraed's hosts do not have.
    "checkpoint_container": "checkpointing containers is not supported by auraed",
}
"""RPCs auraed never serves (none of them streams), with what it answers."""


def _not_yet(name: str) -> CriError:
    return CriError(ErrorKind.UNIMPLEMENTED, f"runtime.v1.RuntimeService {name} is not served by auraed yet")


def _refusing(refusal: Callable[[], CriError], streaming: bool) -> Any:
    if streaming:

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            raise refusal()
            yield  # an async generator, as the server iterates replies of a streaming RPC

        return stream

    async def call(request: Any, context: Any) -> Any:
        raise refusal()

    return call


class Unserved:
    """Answers what no other part serves (the last part of the RuntimeServicer)."""

    def __init__(self, names: tuple[str, ...] = NOT_YET, refused: Mapping[str, str] = NOT_SUPPORTED) -> None:
        for name in names:
            setattr(self, name, _refusing(functools.partial(_not_yet, name), name in STREAMING))
        for name, message in refused.items():
            refusal = functools.partial(CriError, ErrorKind.UNIMPLEMENTED, message)
            setattr(self, name, _refusing(refusal, False))
