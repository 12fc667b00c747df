"""The host placing its images in guests: only the blobs a guest lacks, sent over its ImportImage.

This is how a guest without a share gets an image (a VmService guest booted by ``aer vm``,
orka's VM workloads); a vm pod's guest holds none: its containers read the host's snapshots
through the pod's share (auraed.cri.guest_containers). For a Create in a guest, the host's store
holds the image (pulled once per host); the guest is
asked which of its blobs it lacks (MissingBlobs) and only those are streamed. Guests never reach a
registry. The placer remembers what it placed in each boot of a guest, so later Creates with that
image need no placing (two round trips to the guest fewer) until the VM boots again; a guest that
lost it otherwise answers NOT_FOUND, and then it is placed again. Relaying the calls themselves to
a guest is the server's (``auraed/server/guest_router.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from auraed.api.aurae.containers import v0 as pb
from auraed.errors import ErrorKind
from auraed.images.content import ContentStore
from auraed.images.images import Images
from auraed.images.model import MAX_MANIFEST_BYTES, ImageRecord
from auraed.vms.errors import VmError
from auraed.wire import codec

log = logging.getLogger(__name__)

CONTAINERS = "aurae.containers.v0.ContainerService"
CHUNK = 1 << 20
MAX_NAMED = 3  # blobs named in an error message, at most
MAX_DIGEST_CHARS = 80  # a peer's "digest" or VM name is any string; error messages keep it short


def _never_closed() -> str:
    return ""


@dataclasses.dataclass(frozen=True)
class GuestEndpoint:
    """How the host reaches one guest's auraed."""

    name: str
    address: str  # ip:port
    server_name: str  # a name in the guest's certificate
    channel: grpc.aio.Channel
    booted_at: float  # when its VMM was launched: a new boot is a guest with an empty store
    # Why the host closed ``channel`` ("" while open): its VM ended or was freed. Closing the
    # channel cancels every call on it; the relays then answer UNAVAILABLE with this reason.
    why_closed: Callable[[], str] = _never_closed


GuestLookup = Callable[[str], Awaitable[GuestEndpoint]]


async def send_image(
    channel: grpc.aio.Channel, image: ImageRecord, content: ContentStore, reference: str
) -> int:
    """Make ``image`` exist in the guest under ``reference``; the number of blobs sent.

    Only blobs of ``image`` ever leave the host: a guest naming any other blob as missing (it
    could name another tenant's layers) is refused with PERMISSION_DENIED and sent nothing. A blob
    that cannot be read ends the placement with INTERNAL naming it.
    """
    digests = [image.id, *(layer.digest for layer in image.layers)]
    # Bytes in and out, encoded and decoded here: grpc's hooks would hide a failure.
    request = codec.encode(pb.ContainerServiceMissingBlobsRequest(digests=digests))
    reply = await channel.unary_unary(f"/{CONTAINERS}/MissingBlobs")(request)
    missing = list(dict.fromkeys(codec.decode(pb.ContainerServiceMissingBlobsResponse, reply).digests))
    foreign = [d for d in missing if d not in image.blobs]
    if foreign:
        log.warning("a guest asked for blobs not of image %s: %s", reference, foreign[:MAX_NAMED])
        raise VmError(
            ErrorKind.PERMISSION_DENIED,
            f"the guest asked for blobs that are not of image {reference}: "
            f"{', '.join(d[:MAX_DIGEST_CHARS] for d in foreign[:MAX_NAMED])}; sent nothing",
        )
    try:
        manifest = content.read_blob(image.manifest_digest, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise _unreadable(image.manifest_digest, reference, exc) from None
    header = pb.ImportImageHeader(
        reference=reference, manifest=manifest, manifest_media_type=image.manifest_media_type
    )
    failed: list[VmError] = []
    call = channel.stream_unary(f"/{CONTAINERS}/ImportImage")(
        _import_requests(header, missing, content, failed)
    )
    try:
        await call
    except asyncio.CancelledError:
        # grpc cancels the call when its request iterator fails; report why, unless this task
        # itself is being cancelled.
        task = asyncio.current_task()
        if failed and (task is None or not task.cancelling()):
            raise failed[0] from None
        raise
    if failed:
        raise failed[0]
    return len(missing)


async def _import_requests(
    header: pb.ImportImageHeader, missing: Sequence[str], content: ContentStore, failed: list[VmError]
) -> AsyncIterator[bytes]:
    """ImportImage's requests: the header, then each missing blob in chunks.

    A blob that cannot be read is put in ``failed`` and the stream ends with an error, which
    makes grpc cancel the call (an error raised here never reaches the caller on its own).
    """
    yield codec.encode(pb.ContainerServiceImportImageRequest(header=header))
    for digest in missing:
        try:
            blob = content.blob_path(digest).open("rb")
        except OSError as exc:
            failed.append(_unreadable(digest, header.reference, exc))
            raise failed[-1] from None
        with blob:
            chunk = b""
            while True:
                try:
                    following = blob.read(CHUNK)
                except OSError as exc:
                    failed.append(_unreadable(digest, header.reference, exc))
                    raise failed[-1] from None
                if chunk or not following:  # the last chunk says so; an empty blob is one chunk
                    blob_chunk = pb.BlobChunk(digest=digest, data=chunk, last=not following)
                    yield codec.encode(pb.ContainerServiceImportImageRequest(chunk=blob_chunk))
                if not following:
                    break
                chunk = following


def _unreadable(digest: str, reference: str, exc: OSError) -> VmError:
    return VmError.internal(
        f"blob {digest} of image {reference} cannot be read from the host's store: {exc.strerror or exc}"
    )


class ImagePlacer:
    """Places the host's images in guests, and remembers what it placed in each boot of a guest."""

    def __init__(self, images: Images) -> None:
        self._images = images
        # (VM name, boot, reference, image id) placed in that boot of the guest.
        self._placed: set[tuple[str, float, str, str]] = set()

    def image(self, reference: str) -> ImageRecord:
        """The host's image named ``reference`` (Images.find's errors when there is none)."""
        return self._images.find(reference)

    def placed(self, guest: GuestEndpoint, reference: str, image: ImageRecord) -> bool:
        """Whether ``image`` was placed under ``reference`` in this boot of ``guest``."""
        return _key(guest, reference, image) in self._placed

    async def place(self, guest: GuestEndpoint, reference: str, image: ImageRecord) -> int:
        """Send ``guest`` what it lacks of ``image`` (send_image); the number of blobs sent.

        The guest's own failures come as its grpc.aio.AioRpcError, a reply that cannot be read
        as codec.CodecError.
        """
        sent = await send_image(guest.channel, image, self._images.content, reference)
        log.info("image %s placed in guest %s (%d blobs sent)", reference, guest.name, sent)
        self.forget(guest.name, keep_boot=guest.booted_at)  # earlier boots' entries
        self._placed.add(_key(guest, reference, image))
        return sent

    def lost(self, guest: GuestEndpoint, reference: str, image: ImageRecord) -> None:
        """The guest no longer has ``image`` (it answered NOT_FOUND): place it again next time."""
        self._placed.discard(_key(guest, reference, image))

    def forget(self, vm: str, keep_boot: float | None = None) -> None:
        """Forget what was placed in ``vm`` (freed, stopped, its images removed), except in its
        boot ``keep_boot``."""
        self._placed = {key for key in self._placed if key[0] != vm or key[1] == keep_boot}


def _key(guest: GuestEndpoint, reference: str, image: ImageRecord) -> tuple[str, float, str, str]:
    return (guest.name, guest.booted_at, reference, image.id)
