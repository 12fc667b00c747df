"""runtime.v1.RuntimeService, served by parts: one object per concern (runtime info, pods,
containers, streaming), each translating its RPCs to a domain operation.

The server binds every RPC of the service to the attribute of the same name; this object finds it
on the first part that has it, so each part stays a small class of its own.
"""

from __future__ import annotations

from typing import Any

SERVICE_NAME = "runtime.v1.RuntimeService"


class RuntimeServicer:
    def __init__(self, *parts: object) -> None:
        self._parts = parts

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        for part in self._parts:
            found = getattr(part, name, None)
            if found is not None:
                return found
        raise AttributeError(name)
