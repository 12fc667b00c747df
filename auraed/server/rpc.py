"""Serve betterproto2 servicers through grpc.aio generic handlers, built from the proto descriptors.

The protos are the single source of truth: for each service we look the methods up in the
descriptor pool the generated code registers, find the request/response classes in the message pool,
and bind each RPC to the servicer method of the same name in snake_case. Every call goes through
one wrapper that turns :class:`~auraed.errors.AuraeError` into the matching gRPC status and any
other exception into INTERNAL (logged with its traceback), so nothing a request does can take the
daemon down.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import betterproto2
import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from auraed import codec
from auraed.api.google_proto_descriptor_pool import default_google_proto_descriptor_pool
from auraed.api.message_pool import default_message_pool
from auraed.errors import RESOURCE_ERRNOS, AuraeError, ErrorKind

log = logging.getLogger(__name__)

# grpc ships no type information; at run time this is grpc.aio.ServicerContext.
Context: TypeAlias = Any

STATUS_FOR_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


# The most of a status's details sent, in bytes on the wire. Details travel in the trailers, which
# grpc limits to 8 KiB with everything else in them (and between 8 and 16 KiB refuses at random):
# a longer message (a runtime's whole stderr, a name echoed back) would reach the client as
# RESOURCE_EXHAUSTED about metadata, its code lost.
MAX_DETAIL_BYTES = 4096
CUT_MARKER = " ... (cut)"  # ends a detail that was longer
# grpc sends the details percent-encoded: printable ASCII but "%" as itself, every other byte as
# three ("%C3").
_PLAIN_BYTES = frozenset(range(0x20, 0x7F)) - {ord("%")}
_ENCODED_BYTE_SIZE = 3


def wire_size(data: bytes) -> int:
    """Bytes ``data`` takes as a percent-encoded grpc-message."""
    return sum(1 if byte in _PLAIN_BYTES else _ENCODED_BYTE_SIZE for byte in data)


def capped(detail: str) -> str:
    """``detail`` as UTF-8 text of at most MAX_DETAIL_BYTES on the wire, cut at a character's edge."""
    data = detail.encode("utf-8", "replace")  # lone surrogates (undecodable names) become "?"
    # No byte takes less than one on the wire: what is past the limit in bytes is past it encoded.
    head = data[: MAX_DETAIL_BYTES + 1]
    if wire_size(head) <= MAX_DETAIL_BYTES:
        return data.decode()
    budget = MAX_DETAIL_BYTES - len(CUT_MARKER)
    # Running totals only grow: the bytes kept are those whose total is still within the budget.
    totals = itertools.accumulate(1 if byte in _PLAIN_BYTES else _ENCODED_BYTE_SIZE for byte in head)
    end = sum(1 for total in totals if total <= budget)
    return head[:end].decode("utf-8", "ignore") + CUT_MARKER


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from exceptions to what the client is told (details capped)."""
    code, detail = _status_for(exc)
    return code, capped(detail)


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, AuraeError):
        return STATUS_FOR_KIND[exc.kind], exc.message
    if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
        where = f": {exc.filename}" if exc.filename else ""
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"on the daemon's machine: {exc.strerror}{where}"
    if getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL":  # sqlite3.Error, not imported here
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "on the daemon's machine: the state store's disk is full"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the auraed log"


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _import_package_of(full_name: str) -> None:
    """Import the generated module defining ``full_name``, registering its descriptors and messages.

    A proto package maps to one module (aurae.cells.v0 -> auraed.api.aurae.cells.v0), so only what
    is used gets imported: a guest never pays for the CRI's large module.
    """
    parts = full_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module("auraed.api." + ".".join(parts[:end]))
            return
        except ModuleNotFoundError:
            continue


@functools.cache  # a client looks its method up on every call
def service_descriptor(service: str) -> ServiceDescriptor:
    _import_package_of(service)
    return default_google_proto_descriptor_pool.FindServiceByName(service)


def message_class(full_name: str) -> type[betterproto2.Message]:
    url = f"type.googleapis.com/{full_name}"
    if url not in default_message_pool.url_to_type:
        _import_package_of(full_name)
    return default_message_pool.url_to_type[url]


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


def first_handler(
    handlers: Sequence[grpc.GenericRpcHandler], details: grpc.HandlerCallDetails
) -> grpc.RpcMethodHandler | None:
    """The handler the first of ``handlers`` serving ``details.method`` gives, as grpc looks it up."""
    for generic in handlers:
        found = generic.service(details)
        if found is not None:
            return found
    return None


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
