"""What serving a call looks at, for every handler: its context, and which handler serves it.

Servicers, the server's wrapping handlers (authorization) and the host's guest router all take a
call's context and look a method up among generic handlers the way grpc does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import grpc

# grpc ships no type information; at run time this is grpc.aio.ServicerContext.
Context: TypeAlias = Any


def first_handler(
    handlers: Sequence[grpc.GenericRpcHandler], details: grpc.HandlerCallDetails
) -> grpc.RpcMethodHandler | None:
    """The handler the first of ``handlers`` serving ``details.method`` gives, as grpc looks it up."""
    for generic in handlers:
        found = generic.service(details)
        if found is not None:
            return found
    return None
