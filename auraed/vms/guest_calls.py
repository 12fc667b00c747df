"""The host calling a guest's ContainerService: typed requests and replies, the guest's failures
as errors of the daemon's vocabulary naming the guest.

Every caller on the host that works in a guest (orka's workloads, the CRI's vm pods) goes through
here, so that a guest's failure reads the same wherever it surfaces: the guest's own status code
and message, prefixed with the guest's name; a reply that cannot be read is INTERNAL; a call cut
short because the host closed the guest's channel (its VM ended or was freed) is UNAVAILABLE with
the reason, never a hang past the call's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

import betterproto2
import grpc

from auraed.errors import ErrorKind
from auraed.images.model import ImageRecord
from auraed.vms.errors import VmError
from auraed.vms.placement import CONTAINERS, GuestEndpoint, ImagePlacer
from auraed.wire import codec

Reply = TypeVar("Reply", bound=betterproto2.Message)


def error_kind(code: grpc.StatusCode) -> ErrorKind:
    """The daemon's kind of a guest's status code (a cancelled call: the guest went away)."""
    try:
        return ErrorKind(code.name.lower())
    except ValueError:
        return ErrorKind.UNAVAILABLE if code is grpc.StatusCode.CANCELLED else ErrorKind.INTERNAL


def closed_under(endpoint: GuestEndpoint) -> str:
    """Why the host closed the guest's channel under a call ("" when the caller was cancelled)."""
    why = endpoint.why_closed()
    task = asyncio.current_task()
    return why if why and (task is None or not task.cancelling()) else ""


def guest_error(endpoint: GuestEndpoint, exc: grpc.aio.AioRpcError | codec.CodecError) -> VmError:
    if isinstance(exc, codec.CodecError):
        return VmError(ErrorKind.INTERNAL, f"guest {endpoint.name}: {exc}")
    return VmError(error_kind(exc.code()), f"guest {endpoint.name}: {exc.details()}")


def channel_closed(endpoint: GuestEndpoint) -> VmError | None:
    """The error for a call cancelled because the host closed the guest's channel; None when the
    caller itself was cancelled (which then goes on as a cancellation)."""
    why = closed_under(endpoint)
    return VmError(ErrorKind.UNAVAILABLE, f"guest {endpoint.name}: {why}") if why else None


async def call_guest(
    endpoint: GuestEndpoint, method: str, request: betterproto2.Message, reply: type[Reply], timeout: float
) -> Reply:
    """``method`` of the guest's ContainerService; its failures as VmErrors of their kind."""
    call = endpoint.channel.unary_unary(f"/{CONTAINERS}/{method}")
    try:
        return codec.decode(reply, await call(codec.encode(request), timeout=timeout))
    except (grpc.aio.AioRpcError, codec.CodecError) as exc:
        raise guest_error(endpoint, exc) from None
    except asyncio.CancelledError:
        if (error := channel_closed(endpoint)) is not None:
            raise error from None
        raise


async def stream_guest(
    endpoint: GuestEndpoint,
    method: str,
    request: betterproto2.Message,
    reply: type[Reply],
    timeout: float | None = None,
) -> AsyncIterator[Reply]:
    """The replies of ``method``, a server-streaming method of the guest's ContainerService."""
    call = endpoint.channel.unary_stream(f"/{CONTAINERS}/{method}")(codec.encode(request), timeout=timeout)
    try:
        async for message in call:
            yield codec.decode(reply, message)
    except (grpc.aio.AioRpcError, codec.CodecError) as exc:
        raise guest_error(endpoint, exc) from None
    except asyncio.CancelledError:
        if (error := channel_closed(endpoint)) is not None:
            raise error from None
        raise
    finally:
        call.cancel()


async def place_in_guest(
    placer: ImagePlacer, endpoint: GuestEndpoint, reference: str, image: ImageRecord
) -> None:
    """``image`` placed in the guest under ``reference``; the guest's failures as VmErrors."""
    try:
        await placer.place(endpoint, reference, image)
    except (grpc.aio.AioRpcError, codec.CodecError) as exc:
        raise guest_error(endpoint, exc) from None
    except asyncio.CancelledError:
        if (error := channel_closed(endpoint)) is not None:
            raise error from None
        raise
