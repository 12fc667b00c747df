"""RuntimeService RPCs auraed does not serve yet, answered UNIMPLEMENTED with a message saying so.

Each moves to its part when it is built; this list is what remains of the CRI issue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from auraed.cri.errors import CriError
from auraed.errors import ErrorKind

NOT_YET = (
    "checkpoint_container",
    "list_metric_descriptors",
    "list_pod_sandbox_metrics",
    "stream_pod_sandbox_metrics",
    "update_pod_sandbox_resources",
)


STREAMING = frozenset({"stream_pod_sandbox_metrics"})  # of NOT_YET, those whose replies stream


def _refusal(name: str) -> CriError:
    return CriError(ErrorKind.UNIMPLEMENTED, f"runtime.v1.RuntimeService {name} is not served by auraed yet")


def _unserved(name: str) -> Any:
    if name in STREAMING:

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            raise _refusal(name)
            yield  # an async generator, as the server iterates replies of a streaming RPC

        return stream

    async def call(request: Any, context: Any) -> Any:
        raise _refusal(name)

    return call


class Unserved:
    """Answers what no other part serves (the last part of the RuntimeServicer)."""

    def __init__(self, names: tuple[str, ...] = NOT_YET) -> None:
        for name in names:
            setattr(self, name, _unserved(name))
