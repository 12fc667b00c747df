"""How a call's failure reaches the client, through auraed's rpc layer on a real grpc.aio server.

Errors map to status codes in one place (auraed.wire.status): an AuraeError to its kind's code, with
details capped so that no message can outgrow what grpc carries in trailers; grpc's own abort
(context.abort) passes through as the servicer meant it; any other exception, a failed call of
our own to another server included, is INTERNAL and logged.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from auraed.api.aurae.cells import v0 as pb
from auraed.client import AuraeClient, ClientError
from auraed.errors import AuraeError, ErrorKind
from auraed.server.rpc import generic_handler
from auraed.wire.status import MAX_DETAIL_BYTES, wire_size

CELLS = "aurae.cells.v0.CellService"
HUGE = 1 << 20  # a message far beyond what trailers carry (grpc's metadata limit is 8 KiB)


class FailingCells:
    """A CellService whose every method fails the way the cell's name says."""

    def __init__(self, elsewhere: str) -> None:
        self.elsewhere = elsewhere  # an address where nothing serves

    async def allocate(self, request: pb.CellServiceAllocateRequest, context: Any) -> Any:
        assert request.cell is not None
        return await self._fail(request.cell.name, context)

    async def _fail(self, how: str, context: Any) -> Any:
        if how == "huge":
            raise AuraeError(ErrorKind.INVALID_ARGUMENT, "cell: " + "x" * HUGE)
        if how == "huge-wide":  # characters of several bytes: cut at a character's edge
            raise AuraeError(ErrorKind.FAILED_PRECONDITION, "é€" * HUGE)
        if how == "undecodable":  # a file name that is not UTF-8, as os.listdir gives it
            raise AuraeError(ErrorKind.NOT_FOUND, b"file \xff not found".decode(errors="surrogateescape"))
        if how == "abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "the servicer's own answer")
        if how == "nested":  # a call of ours to another server failed and was not handled
            async with grpc.aio.insecure_channel(self.elsewhere) as channel:
                await channel.unary_unary("/x.Y/Z")(b"", timeout=5)
        return pb.CellServiceAllocateResponse()

    async def list(self, request: pb.CellServiceListRequest, context: Any) -> Any:
        return pb.CellServiceListResponse()

    def __getattr__(self, name: str) -> Any:
        async def unused(request: Any, context: Any) -> Any:
            raise AssertionError(name)

        return unused


@pytest.fixture
async def client() -> AsyncIterator[AuraeClient]:
    directory = Path(tempfile.mkdtemp(prefix="aurae-errors-", dir="/tmp"))
    socket = directory / "s.sock"
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([generic_handler(CELLS, FailingCells(f"unix:{directory / 'none.sock'}"))])
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    client = AuraeClient(grpc.aio.insecure_channel(f"unix:{socket}"))
    try:
        yield client
    finally:
        await client.close()
        await server.stop(None)
        socket.unlink(missing_ok=True)
        directory.rmdir()


async def _failure(client: AuraeClient, how: str) -> ClientError:
    with pytest.raises(ClientError) as error:
        await client.call(
            CELLS, "Allocate", pb.CellServiceAllocateRequest(cell=pb.Cell(name=how)), timeout=20
        )
    return error.value


async def test_a_huge_error_message_is_capped_keeping_its_code(client: AuraeClient) -> None:
    error = await _failure(client, "huge")
    assert error.code == "INVALID_ARGUMENT"
    assert error.message.startswith("cell: xxx")
    assert (
        len(error.message) > MAX_DETAIL_BYTES // 2 and wire_size(error.message.encode()) <= MAX_DETAIL_BYTES
    )
    assert error.message.endswith("(cut)")
    wide = await _failure(client, "huge-wide")
    assert wide.code == "FAILED_PRECONDITION"
    # Percent-encoded, each of these bytes takes three on the wire.
    assert wide.message.startswith("é€é€") and wire_size(wide.message.encode()) <= MAX_DETAIL_BYTES


async def test_an_error_message_that_is_not_utf8_keeps_its_code(client: AuraeClient) -> None:
    error = await _failure(client, "undecodable")
    assert (error.code, error.message) == ("NOT_FOUND", "file ? not found")


async def test_grpcs_own_abort_is_the_servicers_answer(
    client: AuraeClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        error = await _failure(client, "abort")
    assert (error.code, error.message) == ("NOT_FOUND", "the servicer's own answer")
    assert "failed" not in caplog.text and "INTERNAL" not in caplog.text


async def test_a_failed_call_of_our_own_is_internal_and_logged(
    client: AuraeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Not UNKNOWN with grpc's "Unexpected error" text, as when it escaped to grpc."""
    error = await _failure(client, "nested")
    assert error.code == "INTERNAL"
    assert "AioRpcError" in error.message and "auraed log" in error.message
    assert "/aurae.cells.v0.CellService/Allocate failed" in caplog.text
    # The daemon serves on.
    await client.call(CELLS, "List", pb.CellServiceListRequest())
