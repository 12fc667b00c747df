"""What serving a call looks at, for every handler: its context, and which handler serves it.

Servicers, the server's wrapping handlers (authorization) and the host's guest router all take a
call's context and look a method up among generic handlers the way grpc does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import grpc

# grpc ships no type information; at run time this is grpc.aio.ServicerContext.
Context: TypeAlias = Any

# The auth context properties naming a client, as grpc fills them from the verified certificate:
# its CN and its DNS SANs. Not "x509_subject_alternative_name", which mixes in URI, e-mail and IP
# SANs: a certificate made for one of those (a SPIFFE ID, a mail address) must not pass for a
# listed identity of the same spelling.
IDENTITY_PROPERTIES = ("x509_common_name", "peer_dns")


def peer_identities(context: Context) -> list[str]:
    """The client certificate's CN followed by its DNS SANs, as TLS verified them."""
    auth = context.auth_context()
    names = [v.decode(errors="replace") for key in IDENTITY_PROPERTIES for v in auth.get(key, [])]
    return list(dict.fromkeys(names))


def first_handler(
    handlers: Sequence[grpc.GenericRpcHandler], details: grpc.HandlerCallDetails
) -> grpc.RpcMethodHandler | None:
    """The handler the first of ``handlers`` serving ``details.method`` gives, as grpc looks it up."""
    for generic in handlers:
        found = generic.service(details)
        if found is not None:
            return found
    return None


def handler_parts(handler: grpc.RpcMethodHandler) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A handler's behavior and the grpc factory that makes a handler of its kind around another.

    For the server's wrapping handlers (authorization, metrics), which guard each handler once.
    """
    for attribute, factory in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ):
        inner = getattr(handler, attribute)
        if inner is not None:
            return inner, factory
    raise TypeError(f"handler without behavior: {handler!r}")
