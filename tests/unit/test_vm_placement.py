"""Placing an image in a guest: only that image's blobs leave the host, and a blob that cannot be
read fails the placement at once. Calls naming a VM that cannot go to a guest are refused.

The "guest" is a real grpc.aio server on a unix socket answering MissingBlobs with what a test
chooses (as a compromised guest could) and recording every blob ImportImage brought it.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import grpc
import pytest
from cryptography import x509

from auraed.api.aurae.containers import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.images.content import ContentStore, LocalStore
from auraed.images.images import Images
from auraed.images.model import ImageRecord, LayerRecord
from auraed.pki import PrivateKey, create_ca, load_ca_files, write_pem_files
from auraed.server.guest_router import GuestRouter
from auraed.vms.errors import VmError
from auraed.vms.guests import HOST_IDENTITY, GuestTrust
from auraed.vms.placement import CONTAINERS, GuestEndpoint, ImagePlacer, send_image
from auraed.wire import codec
from auraed.wire.metadata import VM_METADATA_KEY

REFERENCE = "localhost/placed:1"
# Long enough for a placement that works; a hung one is caught well before the test's own timeout.
PLACE_TIMEOUT = 20.0
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeGuest:
    """What the guest answers to MissingBlobs, and the blobs it received."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.received: dict[str, bytes] = {}

    async def missing_blobs(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return codec.encode(pb.ContainerServiceMissingBlobsResponse(digests=self.missing))

    async def import_image(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async for raw in requests:
            chunk = codec.decode(pb.ContainerServiceImportImageRequest, raw).chunk
            if chunk is not None:
                self.received[chunk.digest] = self.received.get(chunk.digest, b"") + chunk.data
        return codec.encode(pb.ContainerServiceImportImageResponse(received=list(self.received)))

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            CONTAINERS,
            {
                "MissingBlobs": grpc.unary_unary_rpc_method_handler(self.missing_blobs),
                "ImportImage": grpc.stream_unary_rpc_method_handler(self.import_image),
            },
        )


@pytest.fixture
def guest() -> FakeGuest:
    return FakeGuest()


@pytest.fixture
async def channel(guest: FakeGuest) -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([guest.handler()])
    directory = Path(tempfile.mkdtemp(prefix="aurae-guest-", dir="/tmp"))
    socket = directory / "guest.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix:{socket}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(0)
        socket.unlink(missing_ok=True)
        directory.rmdir()


@pytest.fixture
def content(tmp_path: Path) -> Iterator[ContentStore]:
    yield LocalStore(tmp_path / "images")


def store_image(content: ContentStore, tag: bytes) -> ImageRecord:
    """An image of one layer whose blobs (manifest, config, layer) are in ``content``."""
    layer, config = b"layer of " + tag, b'{"config": "' + tag + b'"}'
    manifest = b'{"manifest": "' + tag + b'"}'
    for data in (layer, config, manifest):
        content.write_blob(digest_of(data), data)
    return ImageRecord(
        id=digest_of(config),
        references=(REFERENCE,),
        repo_digests=(),
        manifest_digest=digest_of(manifest),
        manifest_media_type="application/vnd.oci.image.manifest.v1+json",
        layers=(LayerRecord(digest_of(layer), digest_of(layer), len(layer), LAYER_MEDIA_TYPE),),
        config={},
        os="linux",
        architecture="amd64",
        created_at=0.0,
    )


async def test_the_image_s_missing_blobs_are_sent(
    guest: FakeGuest, channel: grpc.aio.Channel, content: ContentStore
) -> None:
    image = store_image(content, b"mine")
    guest.missing = [image.id, image.layers[0].digest]
    async with asyncio.timeout(PLACE_TIMEOUT):
        assert await send_image(channel, image, content, REFERENCE) == 2
    assert guest.received == {d: content.blob_path(d).read_bytes() for d in guest.missing}


async def test_a_guest_cannot_obtain_a_blob_of_another_image(
    guest: FakeGuest, channel: grpc.aio.Channel, content: ContentStore
) -> None:
    mine = store_image(content, b"mine")
    secret = store_image(content, b"someone else's")
    guest.missing = [mine.layers[0].digest, secret.layers[0].digest]
    with pytest.raises(VmError) as caught:
        async with asyncio.timeout(PLACE_TIMEOUT):
            await send_image(channel, mine, content, REFERENCE)
    assert caught.value.kind is ErrorKind.PERMISSION_DENIED
    assert secret.layers[0].digest in caught.value.message
    assert secret.layers[0].digest not in guest.received
    assert not guest.received  # nothing at all is sent to a guest asking for what is not its


async def test_an_unreadable_blob_fails_the_placement_at_once(
    guest: FakeGuest, channel: grpc.aio.Channel, content: ContentStore
) -> None:
    image = store_image(content, b"mine")
    layer = image.layers[0].digest
    guest.missing = [image.id, layer]
    # The layer's file goes (a disk error, a store collected meanwhile): not readable any more.
    content.blob_path(layer).unlink()
    content.blob_path(layer).mkdir()
    try:
        with pytest.raises(VmError) as caught:
            async with asyncio.timeout(PLACE_TIMEOUT):
                await send_image(channel, image, content, REFERENCE)
    finally:
        content.blob_path(layer).rmdir()
    assert caught.value.kind is ErrorKind.INTERNAL
    assert layer in caught.value.message and "cannot be read" in caught.value.message


CELLS = "aurae.cells.v0.CellService"
OBSERVE = "aurae.observe.v0.ObserveService"


async def _host_answers(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"from the host"


async def _host_streams(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"from the host"


async def test_a_call_naming_a_vm_is_refused_unless_it_can_go_to_the_guest(tmp_path: Path) -> None:
    async def lookup(name: str) -> GuestEndpoint:
        raise AuraeError.not_found(f"VM {name}")

    local = grpc.method_handlers_generic_handler(
        CONTAINERS, {"List": grpc.unary_unary_rpc_method_handler(_host_answers)}
    )
    others = [
        grpc.method_handlers_generic_handler(
            CELLS, {"List": grpc.unary_unary_rpc_method_handler(_host_answers)}
        ),
        grpc.method_handlers_generic_handler(
            OBSERVE, {"GetPosixSignalsStream": grpc.unary_stream_rpc_method_handler(_host_streams)}
        ),
    ]
    server = grpc.aio.server()
    router = GuestRouter(lookup, ImagePlacer(cast(Images, None)), [local, *others])  # around every service
    server.add_generic_rpc_handlers([router])
    socket = tmp_path / "host.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            cells = channel.unary_unary(f"/{CELLS}/List")
            signals = channel.unary_stream(f"/{OBSERVE}/GetPosixSignalsStream")
            on_vm = ((VM_METADATA_KEY, "g1"),)
            # Without a VM the host serves them; naming one, they are refused, not run on the host.
            assert await cells(b"", timeout=10) == b"from the host"
            assert [r async for r in signals(b"", timeout=10)] == [b"from the host"]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cells(b"", metadata=on_vm, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "only ContainerService" in (refused.value.details() or "")
            assert "g1" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in signals(b"", metadata=on_vm, timeout=10)]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A ContainerService call naming a VM goes to that VM (here: there is none).
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await channel.unary_unary(f"/{CONTAINERS}/List")(b"", metadata=on_vm, timeout=10)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            # Refusals are one handler per method served, made once: calls, however many and to
            # whatever method, add none (the daemon's authorization caches handlers by identity).
            for attempt in range(REPEATED_CALLS):
                with pytest.raises(grpc.aio.AioRpcError):
                    await cells(b"", metadata=on_vm, timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await channel.unary_unary(f"/x.Y/M{attempt}")(b"", metadata=on_vm, timeout=10)
                assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
            handlers = {router.service(_Details(f"/{CELLS}/List", on_vm)) for _ in range(REPEATED_CALLS)}
            assert len(handlers) == 1
            assert router.service(_Details("/x.Y/Z", on_vm)) is None
    finally:
        await server.stop(0)


REPEATED_CALLS = 20


class _Details(grpc.HandlerCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


def test_the_host_s_certificate_for_guests_follows_a_change_of_ca(tmp_path: Path) -> None:
    """Kept while the CA that issued it is the host's; reissued once the CA changed, since
    every guest (trusting only the new CA) would refuse it."""
    pki_dir = tmp_path / "pki"
    first = write_pem_files(tmp_path / "ca1", "ca", *_ca_pair())
    GuestTrust(*first, pki_dir).credentials()
    host_crt = pki_dir / f"{HOST_IDENTITY}.crt"
    issued_first = host_crt.read_bytes()
    GuestTrust(*first, pki_dir).credentials()
    assert host_crt.read_bytes() == issued_first  # same CA: kept
    second = write_pem_files(tmp_path / "ca2", "ca", *_ca_pair())
    GuestTrust(*second, pki_dir).credentials()
    reissued = x509.load_pem_x509_certificate(host_crt.read_bytes())
    assert reissued.issuer == load_ca_files(*second).cert.subject
    reissued.verify_directly_issued_by(load_ca_files(*second).cert)  # raises otherwise


def _ca_pair() -> tuple[x509.Certificate, PrivateKey]:
    ca = create_ca()
    return ca.cert, ca.key
