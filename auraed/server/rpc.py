"""Serve betterproto2 servicers through grpc.aio generic handlers, built from the proto descriptors.

The protos are the single source of truth: for each service we look the methods up in the
descriptor pool the generated code registers, find the request/response classes in the message pool
(both through auraed.wire.descriptors), and bind each RPC to the servicer method of the same name in
snake_case. Every call goes through one wrapper that turns :class:`~auraed.errors.AuraeError` into
the matching gRPC status (auraed.wire.status) and any other exception into INTERNAL (logged with its
traceback), so nothing a request does can take the daemon down.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import betterproto2
import grpc
from google.protobuf.descriptor import MethodDescriptor

from auraed.errors import AuraeError, ErrorKind
from auraed.wire import codec
from auraed.wire.descriptors import message_class, service_descriptor, snake_case
from auraed.wire.handlers import Context
from auraed.wire.status import status_for

log = logging.getLogger(__name__)


class _MalformedRequest(AuraeError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.INVALID_ARGUMENT, message)


def _parse(cls: type[betterproto2.Message], data: bytes) -> betterproto2.Message:
    # Parsed here rather than by grpc's deserializer hook: grpc answers a failing hook with
    # INTERNAL, but a malformed message is the client's mistake.
    try:
        return codec.decode(cls, data)
    except codec.CodecError as exc:
        raise _MalformedRequest(str(exc)) from None


async def _parse_stream(cls: type[betterproto2.Message], raw: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    async for data in raw:
        yield _parse(cls, data)


def _is_grpc_abort(exc: BaseException) -> bool:
    # context.abort() raises grpc's AbortError, which must reach grpc to end the call with the
    # status given. Nothing else of grpc's does: a failed call of ours to another server
    # (AioRpcError) that escaped would reach the client as UNKNOWN, unlogged; it is INTERNAL.
    return isinstance(exc, grpc.aio.AbortError)


async def _abort(context: Context, exc: BaseException, method: str) -> None:
    code, detail = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        log.warning("%s: %s: %s", method, code.name, detail)  # the operator has to act
    else:
        log.info("%s: %s: %s", method, code.name, detail)
    await context.abort(code, detail)


Behavior = Callable[[Any, Context], Any]


def _unary_response(
    method: str, func: Callable[..., Awaitable[Any]], request: Callable[[Any], Any]
) -> Behavior:
    async def behavior(raw: Any, context: Context) -> Any:
        try:
            return _encoded(await func(request(raw), context))
        except Exception as exc:
            if _is_grpc_abort(exc):
                raise
            await _abort(context, exc, method)

    return behavior


def _streaming_response(
    method: str, func: Callable[..., AsyncIterator[Any]], request: Callable[[Any], Any]
) -> Behavior:
    async def behavior(raw: Any, context: Context) -> AsyncIterator[Any]:
        try:
            async for item in func(request(raw), context):
                yield _encoded(item)
        except Exception as exc:
            if _is_grpc_abort(exc):
                raise
            await _abort(context, exc, method)

    return behavior


def _encoded(reply: betterproto2.Message | bytes) -> bytes:
    """A servicer may return a reply it encoded once and kept (Discover's)."""
    return reply if isinstance(reply, bytes) else codec.encode(reply)


def _method_handler(method: MethodDescriptor, servicer: object, service_name: str) -> grpc.RpcMethodHandler:
    request_cls = message_class(method.input_type.full_name)
    func = getattr(servicer, snake_case(method.name))
    path = f"/{service_name}/{method.name}"
    if method.client_streaming:

        def request(raw: Any) -> Any:
            return _parse_stream(request_cls, raw)
    else:

        def request(raw: Any) -> Any:
            return _parse(request_cls, raw)

    make = _streaming_response if method.server_streaming else _unary_response
    behavior = make(path, func, request)
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(method.client_streaming, method.server_streaming)]
    # Bytes in and out: requests are parsed and replies encoded inside the behavior, not by grpc's
    # hooks. grpc logs a failing hook and sends an empty message in place of the reply; here the
    # failure ends the call with INTERNAL.
    return factory(behavior, request_deserializer=None, response_serializer=None)


def generic_handler(service_name: str, servicer: object) -> grpc.GenericRpcHandler:
    """A handler serving every RPC of ``service_name`` (e.g. "aurae.cells.v0.CellService")."""
    descriptor = service_descriptor(service_name)
    missing = [m.name for m in descriptor.methods if not hasattr(servicer, snake_case(m.name))]
    if missing:
        raise TypeError(
            f"{type(servicer).__name__} lacks {', '.join(map(snake_case, missing))} for {service_name}"
        )
    handlers = {m.name: _method_handler(m, servicer, service_name) for m in descriptor.methods}
    return grpc.method_handlers_generic_handler(service_name, handlers)


class CollectedHandlers:
    """Stands in for the server with grpcio's ``add_XServicer_to_server`` helpers.

    It keeps the handlers they register, so the daemon can serve them behind its own wrapping
    handlers (authorization) like every other service.
    """

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        # The helpers register the same handlers through add_generic_rpc_handlers as well.
        pass


class LazyService(grpc.GenericRpcHandler):  # type: ignore[misc]
    """``service``'s handlers, made by ``make`` at its first call, not at start: for a service few
    clients call whose library is costly to import (reflection's, in a guest under emulation)."""

    def __init__(self, service: str, make: Callable[[], Sequence[grpc.GenericRpcHandler]]) -> None:
        self._prefix = f"/{service}/"
        self._make = make
        self._handlers: Sequence[grpc.GenericRpcHandler] | None = None

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not str(handler_call_details.method).startswith(self._prefix):
            return None
        if self._handlers is None:
            self._handlers = self._make()
        for handler in self._handlers:
            found = handler.service(handler_call_details)
            if found is not None:
                return found
        return None
