"""Authorization by client certificate identity, applied to every RPC of every service."""

from __future__ import annotations

import fnmatch
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from auraed.config import AuthorizationPolicy
from auraed.server.gate import CallGate
from auraed.wire.handlers import Context, first_handler, handler_parts, peer_identities
from auraed.wire.status import capped

log = logging.getLogger(__name__)


# A refusal is logged at once, then its repeats (same identities and method) at most this often,
# with their count: a client retrying in a loop must not fill the log (journald, disks).
REFUSAL_LOG_INTERVAL = 60.0
# Refusals remembered for that; past this many distinct ones the oldest are forgotten.
MAX_REFUSALS_TRACKED = 1024


class RefusalLog:
    """Logs refused calls, each kind of refusal at most once per REFUSAL_LOG_INTERVAL."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL) -> None:
        self._interval = interval
        # (who, method) -> (when last logged, refusals not logged since)
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def refused(self, who: str, method: str, why: str) -> None:
        now = time.monotonic()
        key = (who, method)
        logged_at, unlogged = self._seen.get(key, (-math.inf, 0))
        if now - logged_at < self._interval:
            self._seen[key] = (logged_at, unlogged + 1)
            return
        self._seen.pop(key, None)  # re-inserted last: the dict stays in order of logging
        if len(self._seen) >= MAX_REFUSALS_TRACKED:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = (now, 0)
        more = f" ({unlogged} more like it since the last report)" if unlogged else ""
        log.warning("refused %s for %s: %s%s", method, who, why, more)


def allowed_patterns(policy: AuthorizationPolicy, identities: list[str]) -> tuple[str, ...]:
    listed = [p for name in identities for p in policy.identities.get(name, ())]
    if any(name in policy.identities for name in identities):
        return tuple(listed)
    return policy.default


def is_allowed(policy: AuthorizationPolicy, identities: list[str], method: str) -> bool:
    """``method`` is the gRPC path ("/pkg.Service/Method"); patterns omit the leading slash."""
    if not identities:
        return False
    target = method.lstrip("/")
    return any(fnmatch.fnmatchcase(target, pattern) for pattern in allowed_patterns(policy, identities))


class AuthorizedHandlers(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Serves what ``inner`` serves, each call checked against the policy before it runs.

    A wrapping handler rather than a grpc.aio server interceptor: grpc runs an interceptor's
    coroutine chain on every call, and the interceptor built a new guarded handler each time
    (~0.12 ms a call here). This guards each handler once and reuses it, so ``inner`` must give
    the same handler object for a method every time (grpc's own generic handlers do). ``gate``,
    when closed, refuses every call before its identity is even looked at (shutdown).
    """

    def __init__(
        self,
        policy: AuthorizationPolicy,
        inner: Sequence[grpc.GenericRpcHandler],
        gate: CallGate | None = None,
    ) -> None:
        self._policy = policy
        # Checked here, in the one wrapper every call passes, rather than in another layer.
        self._gate = gate or CallGate()
        self._inner = tuple(inner)
        self._refusals = RefusalLog()
        self._guarded: dict[tuple[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = first_handler(self._inner, details)
        if handler is None:
            return None
        key = (details.method, handler)
        guarded = self._guarded.get(key)
        if guarded is None:
            guarded = self._guarded[key] = self._guard(handler, details.method)
        return guarded

    async def _check(self, context: Context, method: str) -> None:
        await self._gate.admit(context)
        identities = peer_identities(context)
        if not identities:
            self._refusals.refused("a peer", method, "it presented no certificate identity")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a client certificate is required")
        if not is_allowed(self._policy, identities, method):
            who = "identity " + ",".join(identities)
            self._refusals.refused(who, method, "not allowed by the authorization policy")
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, capped(f"identity {identities[0]!r} may not call {method}")
            )

    def _guard(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner, factory = handler_parts(handler)
        check = self._check
        if inspect.isasyncgenfunction(inner):

            async def generator(request: Any, context: Context) -> Any:
                await check(context, method)
                async for item in inner(request, context):
                    yield item

            behavior: Callable[..., Any] = generator
        else:

            async def coroutine(request: Any, context: Context) -> Any:
                await check(context, method)
                return await inner(request, context)

            behavior = coroutine
        return factory(behavior, handler.request_deserializer, handler.response_serializer)


class GatedHandlers(AuthorizedHandlers):
    """Serves what ``inner`` serves behind the gate alone: for the CRI's socket, which has no TLS.

    Its callers are whoever may open the socket (owner-only: root), as a kubelet expects of its
    runtime; there is no identity to check.
    """

    def __init__(self, inner: Sequence[grpc.GenericRpcHandler], gate: CallGate) -> None:
        super().__init__(AuthorizationPolicy(), inner, gate)

    async def _check(self, context: Context, method: str) -> None:
        await self._gate.admit(context)
