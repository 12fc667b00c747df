"""The host relaying ContainerService (and NetworkService) calls to guests, by the VM a call names.

A client targets a VM by sending the gRPC metadata ``aurae-vm: <name>`` with a ContainerService
call to the host (``aer --vm NAME container ...``). The host then forwards the call, byte for byte,
to the guest's ContainerService over mTLS with the host's guest-client certificate — after making
sure, for Create, that the guest has the image (``auraed/vms/placement.py`` places it). The
guest's NetworkService is relayed the same way (``aer --vm NAME network ...``). A call naming a VM
for any other service is refused rather than served by the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from auraed.api.aurae.containers import v0 as pb
from auraed.errors import AuraeError
from auraed.images.model import ImageRecord
from auraed.vms.placement import CONTAINERS, MAX_DIGEST_CHARS, GuestEndpoint, GuestLookup, ImagePlacer
from auraed.wire import codec
from auraed.wire.handlers import Context, first_handler
from auraed.wire.metadata import VM_METADATA_KEY
from auraed.wire.status import status_for

log = logging.getLogger(__name__)

NETWORK = "aurae.network.v0.NetworkService"
RELAYED = (f"/{CONTAINERS}/", f"/{NETWORK}/")
"""The services whose calls naming a VM go to its guest: its containers and its network."""


class GuestRouter(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Serves ``local``; its ContainerService calls that name a VM go to that VM's guest instead."""

    def __init__(
        self, guests: GuestLookup, placer: ImagePlacer, local: Sequence[grpc.GenericRpcHandler]
    ) -> None:
        self._guests = guests
        self._placer = placer
        self._local = tuple(local)
        # One forwarder per method, reused: the VM is read from each call's metadata.
        self._forwarders: dict[str, grpc.RpcMethodHandler] = {}
        self._refusals: dict[str, grpc.RpcMethodHandler] = {}  # likewise, for other services

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        local = first_handler(self._local, details)
        vm = _vm_named(details.invocation_metadata)
        if not details.method.startswith(RELAYED):
            # Only ContainerService and NetworkService calls go to guests: any other call naming
            # a VM would be served by the host instead, the caller believing it ran in the guest. One
            # refusal per method served (the caller's wrapper caches handlers by identity, and
            # unknown methods must not grow that): ``local`` is every service of the daemon.
            if local is None or not vm:
                return local
            refusal = self._refusals.get(details.method)
            if refusal is None:
                refusal = self._refusals[details.method] = _refusal(details.method)
            return refusal
        if local is None or not vm:
            return local
        forwarder = self._forwarders.get(details.method)
        if forwarder is None:
            forwarder = self._forwarders[details.method] = self._forwarder(local, details.method)
        return forwarder

    def _forwarder(self, local: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        router = self

        async def unary_unary(request: bytes, context: Context) -> bytes:
            guest = await router._guest(context)
            call = guest.channel.unary_unary(method)
            async with _while_guest_open(guest, context):
                if method == f"/{CONTAINERS}/Create":
                    return await router._create(guest, call, request, context)
                if method == f"/{CONTAINERS}/RemoveImage":
                    router._placer.forget(guest.name)
                return await _relay(call(request, metadata=_forwarded(context)), context)  # type: ignore[no-any-return]

        async def unary_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
            guest = await router._guest(context)
            call = guest.channel.unary_stream(method)(request, metadata=_forwarded(context))
            async for reply in _relay_stream(guest, call, context):
                yield reply

        async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
            guest = await router._guest(context)
            call = guest.channel.stream_unary(method)
            async with _while_guest_open(guest, context):
                return await _relay(call(requests, metadata=_forwarded(context)), context)  # type: ignore[no-any-return]

        async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            guest = await router._guest(context)
            call = guest.channel.stream_stream(method)(requests, metadata=_forwarded(context))
            async for reply in _relay_stream(guest, call, context):
                yield reply

        # Raw bytes in and out: the guest parses and validates; the host only relays.
        if local.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary_unary)
        if local.unary_stream:
            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if local.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_unary)
        return grpc.stream_stream_rpc_method_handler(stream_stream)

    async def _guest(self, context: Context) -> GuestEndpoint:
        vm = _vm_named(context.invocation_metadata())
        try:
            return await self._guests(vm)
        except AuraeError as exc:
            self._placer.forget(vm)  # freed, stopped or never there
            code, detail = status_for(exc)
            await context.abort(code, detail)
            raise

    async def _create(
        self, guest: GuestEndpoint, call: grpc.aio.UnaryUnaryMultiCallable, request: bytes, context: Context
    ) -> bytes:
        """Relay a Create; place its image in the guest first unless it was placed before."""
        name, image = await self._host_image(request, context)
        if self._placer.placed(guest, name, image):
            try:
                return await call(request, metadata=_forwarded(context))  # type: ignore[no-any-return]
            except Exception as exc:
                if not (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND):
                    await _abort_relayed(context, exc)
                # The guest may have lost the image (removed there, or rebooted): place it again.
                self._placer.lost(guest, name, image)
        await self._place(guest, name, image, context)
        return await _relay(call(request, metadata=_forwarded(context)), context)  # type: ignore[no-any-return]

    async def _host_image(self, request: bytes, context: Context) -> tuple[str, ImageRecord]:
        try:
            config = codec.decode(pb.ContainerServiceCreateRequest, request).config
            name = config.image if config is not None else ""
            return name, self._placer.image(name)
        except codec.CodecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        except AuraeError as exc:
            code, detail = status_for(exc)
            await context.abort(code, detail)
            raise

    async def _place(self, guest: GuestEndpoint, name: str, image: ImageRecord, context: Context) -> None:
        try:
            await self._placer.place(guest, name, image)
        except AuraeError as exc:
            code, detail = status_for(exc)
            await context.abort(code, detail)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"guest {guest.name}: {exc.details()}")
        except codec.CodecError as exc:
            log.error("guest %s answered a reply that cannot be read: %s", guest.name, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"guest {guest.name}: {exc}")


def _refusal(method: str) -> grpc.RpcMethodHandler:
    """A handler refusing ``method`` for naming a VM; streaming both ways, so it fits any call
    (the caller's arity does not show on the wire, and its requests are never read)."""

    async def refuse(requests: AsyncIterator[bytes], context: Context) -> None:
        vm = _vm_named(context.invocation_metadata())
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method} names VM {vm[:MAX_DIGEST_CHARS]!r} ({VM_METADATA_KEY}), but only "
            "ContainerService calls are placed in guests; call it without the VM",
        )

    return grpc.stream_stream_rpc_method_handler(refuse)


def _vm_named(metadata: Any) -> str:
    """The VM a call names in its metadata ("" for none)."""
    return next((value for key, value in metadata or () if key == VM_METADATA_KEY), "")


def _forwarded(context: Context) -> list[tuple[str, Any]]:
    return [
        (k, v)
        for k, v in context.invocation_metadata() or ()
        if k not in (VM_METADATA_KEY,) and not k.startswith(":")
    ]


@contextlib.asynccontextmanager
async def _while_guest_open(guest: GuestEndpoint, context: Context) -> AsyncIterator[None]:
    """Answer UNAVAILABLE, naming why, when the host closes the guest's channel mid-call.

    Closing a channel cancels its calls: the relay sees CancelledError from the guest's call, not
    a status. Without this a call to a guest whose VM died waited for the dead connection (TCP
    gives up after many minutes) or its deadline.
    """
    try:
        yield
    except asyncio.CancelledError:
        why = guest.why_closed()
        if not why:
            raise  # the host's own call was cancelled
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"guest {guest.name}: {why}")


async def _relay_stream(guest: GuestEndpoint, call: Any, context: Context) -> AsyncIterator[bytes]:
    """The guest's replies, then its status as the host's."""
    async with _while_guest_open(guest, context):
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        finally:
            call.cancel()  # the host's caller went away: so does the guest's call (a no-op once done)


async def _relay(call: Any, context: Context) -> Any:
    try:
        return await call
    except Exception as exc:
        await _abort_relayed(context, exc)


async def _abort_relayed(context: Context, exc: Exception) -> None:
    """End the host's call as the guest's ended: its status, or UNAVAILABLE when it never answered."""
    if isinstance(exc, grpc.aio.AioRpcError):
        await context.abort(exc.code(), exc.details() or "")
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"guest unreachable: {exc}")
