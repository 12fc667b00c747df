"""Messages that cannot be encoded, on both ends of a real grpc.aio call through auraed's rpc layer.

grpc itself logs a failing serializer hook and sends an empty message in its place; auraed encodes
outside grpc's hooks so that never happens: a client's bad request is refused before it is sent
(INVALID_ARGUMENT, naming the field), a servicer's bad reply fails the call with INTERNAL.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, ClientError
from auraed.server.rpc import generic_handler

CONTAINERS = "aurae.containers.v0.ContainerService"


class RecordingContainers:
    """A ContainerService answering empty replies, remembering which methods were called."""

    def __init__(self) -> None:
        self.called: list[str] = []
        self.imported_chunks = 0

    async def stop(self, request: pb.ContainerServiceStopRequest, context: Any) -> Any:
        self.called.append("stop")
        if request.container_id == "bad-reply":  # a status no pid can have
            return pb.ContainerServiceStopResponse(status=pb.ContainerStatus(pid=2**40))
        return pb.ContainerServiceStopResponse()

    async def import_image(
        self, requests: AsyncIterator[pb.ContainerServiceImportImageRequest], context: Any
    ) -> Any:
        self.called.append("import_image")
        async for _ in requests:
            self.imported_chunks += 1
        return pb.ContainerServiceImportImageResponse()

    def __getattr__(self, name: str) -> Any:
        async def empty(request: Any, context: Any) -> bytes:
            self.called.append(name)
            return b""

        return empty


@pytest.fixture
async def served() -> AsyncIterator[tuple[AuraeClient, RecordingContainers]]:
    servicer = RecordingContainers()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([generic_handler(CONTAINERS, servicer)])
    socket = Path(tempfile.mkdtemp(prefix="aurae-codec-", dir="/tmp")) / "s.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    client = AuraeClient(grpc.aio.insecure_channel(f"unix:{socket}"))
    try:
        yield client, servicer
    finally:
        await client.close()
        await server.stop(None)
        socket.unlink(missing_ok=True)
        socket.parent.rmdir()


async def test_a_request_out_of_range_is_refused_before_it_is_sent(
    served: tuple[AuraeClient, RecordingContainers],
) -> None:
    client, servicer = served
    with pytest.raises(ClientError) as error:
        await client.call(CONTAINERS, "Stop", pb.ContainerServiceStopRequest(container_id="c", timeout_ms=-1))
    assert error.value.code == "INVALID_ARGUMENT"
    assert "ContainerServiceStopRequest field timeout_ms" in error.value.message
    assert servicer.called == []
    # The same call with a valid request goes through.
    await client.call(CONTAINERS, "Stop", pb.ContainerServiceStopRequest(container_id="c", timeout_ms=1))
    assert servicer.called == ["stop"]


async def test_a_stream_with_a_request_that_cannot_be_encoded_is_refused(
    served: tuple[AuraeClient, RecordingContainers],
) -> None:
    client, servicer = served

    async def chunks() -> AsyncIterator[pb.ContainerServiceImportImageRequest]:
        yield pb.ContainerServiceImportImageRequest(chunk=pb.BlobChunk(digest="sha256:aa", data=b"x"))
        yield pb.ContainerServiceImportImageRequest(chunk=pb.BlobChunk(digest=7))  # type: ignore[arg-type]

    with pytest.raises(ClientError) as error:
        await client.upload(CONTAINERS, "ImportImage", chunks())
    assert error.value.code == "INVALID_ARGUMENT"
    assert "field chunk.digest" in error.value.message
    assert servicer.imported_chunks <= 1  # never an empty message in place of the bad one


async def test_a_reply_that_cannot_be_encoded_fails_the_call_with_internal(
    served: tuple[AuraeClient, RecordingContainers], caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = served
    with pytest.raises(ClientError) as error:
        await client.call(CONTAINERS, "Stop", pb.ContainerServiceStopRequest(container_id="bad-reply"))
    assert error.value.code == "INTERNAL"
    assert "status.pid" in caplog.text
