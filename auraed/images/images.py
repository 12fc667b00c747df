"""Images: pull from registries, import from peers and OCI layouts, list, look up, remove + GC.

Every layer is downloaded and unpacked in one pass (the unpacker reads the download as it
arrives), layers run concurrently, and only verified blobs and complete snapshots are ever
published, so a failed or interrupted pull leaves nothing half-made and a retry skips what is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from auraed.errors import ErrorKind
from auraed.images.content import ContentStore, LayerSnapshots, remove_tree
from auraed.images.errors import ImageError
from auraed.images.model import (
    MAX_CONFIG_BYTES,
    BlobRef,
    ImageConfigFile,
    ImageRecord,
    LayerRecord,
    Manifest,
    check_platform,
    parse_image_config,
    parse_manifest,
)
from auraed.images.unpack import UnpackError, unpack_layer
from auraed.metrics.sink import NO_METRICS, MetricsSink
from auraed.state.store import Store

if TYPE_CHECKING:
    from auraed.images.registry import RegistryClient
    from auraed.references import ImageReference

log = logging.getLogger(__name__)

ID_PREFIX_MIN = 12
"""Hex digits an image id prefix needs (docker's short id length)."""

KIND = "image"
LAYER_CONCURRENCY = 3
CHUNK = 1 << 20
# A layer the image makes impossible to unpack is the image's fault; these are the machine's.
UNPACK_ERROR_KINDS = {"exhausted": ErrorKind.RESOURCE_EXHAUSTED, "os": ErrorKind.INTERNAL}


@dataclasses.dataclass(frozen=True)
class PullProgress:
    phase: str  # "resolving", "downloading", "unpacking", "done"
    digest: str = ""
    layer_done: int = 0
    layer_total: int = 0
    done: int = 0
    total: int = 0


class _Progress:
    """Per-layer byte counts from worker threads, delivered to the pull's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, layers: tuple[BlobRef, ...]) -> None:
        self._loop = loop
        self._done = {layer.digest: 0 for layer in layers}
        self._sizes = {layer.digest: layer.size for layer in layers}
        self.total = sum(self._sizes.values())
        self.queue: asyncio.Queue[PullProgress] = asyncio.Queue()
        self._last_report = 0.0

    def advance(self, digest: str, amount: int, phase: str = "downloading", force: bool = False) -> None:
        self._done[digest] += amount
        now = time.monotonic()
        if not force and now - self._last_report < 0.1:
            return  # at most ~10 messages a second
        self._last_report = now
        event = PullProgress(
            phase, digest, self._done[digest], self._sizes[digest], sum(self._done.values()), self.total
        )
        self._loop.call_soon_threadsafe(self.queue.put_nowait, event)


class _TeeReader:
    """A read()-able stream over blob chunks that also writes each chunk to the blob's ingest file.

    The unpacker reads from it, so the layer is unpacked while it downloads, in one thread.
    """

    def __init__(self, chunks: Iterator[bytes], sink: Callable[[bytes], None]) -> None:
        self._chunks = chunks
        self._sink = sink
        self._chunk = b""
        self._offset = 0  # into _chunk: small reads must not copy the rest of a 1 MiB chunk

    def read(self, size: int = -1) -> bytes:
        parts: list[bytes] = []
        wanted = size if size >= 0 else None
        while wanted is None or wanted > 0:
            if self._offset >= len(self._chunk):
                self._chunk, self._offset = next(self._chunks, b""), 0
                if not self._chunk:
                    break
                self._sink(self._chunk)
            end = len(self._chunk) if wanted is None else min(len(self._chunk), self._offset + wanted)
            parts.append(self._chunk[self._offset : end])
            if wanted is not None:
                wanted -= end - self._offset
            self._offset = end
        return b"".join(parts)

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


class _Abandoned(Exception):
    """Raised in a layer's download once another layer of the same pull has failed."""


def _until_abandoned(abandon: threading.Event, chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        for chunk in chunks:
            if abandon.is_set():
                raise _Abandoned
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # let the download go now, not when its generator is collected


class _StoreGate:
    """Stores and collections of the content store, kept apart.

    A garbage collection keeps what registered images name. What a pull or an import has stored
    but not yet registered (its layers, or a shared layer it found already there) is named by
    none, so a collection waits until no store is under way, and stores wait while one collects.
    """

    def __init__(self) -> None:
        self._storing = 0
        self._collecting = False
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def storing(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._collecting)
            self._storing += 1
        try:
            yield
        finally:
            self._storing -= 1  # first: a cancelled wake-up below must not leave it counted
            async with self._changed:
                self._changed.notify_all()

    def storing_now(self) -> bool:
        return self._storing > 0

    @contextlib.asynccontextmanager
    async def collecting(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._collecting and not self._storing)
            self._collecting = True
        try:
            yield
        finally:
            self._collecting = False
            async with self._changed:
                self._changed.notify_all()


class Images:
    def __init__(
        self,
        store: Store,
        content: ContentStore,
        snapshots: LayerSnapshots,
        registry_factory: Callable[[], RegistryClient],
        allow_device_nodes: bool = False,
        *,
        metrics: MetricsSink = NO_METRICS,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self.content = content
        self.snapshots = snapshots
        # Made on first use: a guest is fed by its host and never pays for the HTTP stack.
        self._registry_factory = registry_factory
        self._registry_client: RegistryClient | None = None
        self._allow_device_nodes = allow_device_nodes
        self._layer_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.in_use: Callable[[str], bool] = lambda image_id: False  # set by the container service
        # The diff_ids of layers containers read whether or not an image names them any more
        # (a vm pod's guest reads them through its share): never collected. Set by their owner.
        self.layers_in_use: Callable[[], set[str]] = set
        self._gate = _StoreGate()
        self._deferred_collection: asyncio.Task[None] | None = None
        self._collect_again = False  # a collection was asked for while one ran

    @property
    def _registry(self) -> RegistryClient:
        if self._registry_client is None:
            self._registry_client = self._registry_factory()
        return self._registry_client

    def close(self) -> None:
        if self._registry_client is not None:
            self._registry_client.close()
        if self._deferred_collection is not None:
            self._deferred_collection.cancel()  # the next removal collects what it would have

    # -- records ---------------------------------------------------------------------------

    def all(self) -> list[ImageRecord]:
        return [ImageRecord.from_doc(doc) for _, doc in self._store.list(KIND)]

    def find(self, name: str) -> ImageRecord:
        """By image id, id prefix (ID_PREFIX_MIN+ hex digits, "sha256:" optional), reference
        (normalized as a registry would) or repo digest. A name that is none of these forms is
        INVALID_ARGUMENT; a prefix more than one image starts with is too."""
        hex_prefix = name.removeprefix("sha256:")
        is_prefix = len(hex_prefix) >= ID_PREFIX_MIN and all(c in "0123456789abcdef" for c in hex_prefix)
        wanted = {name}
        try:
            wanted.add(normalize_reference(name))
        except ImageError:
            if not is_prefix:
                raise
        images = self.all()
        for image in images:
            if image.id in wanted or wanted & set(image.references) or wanted & set(image.repo_digests):
                return image
        by_prefix = [
            image for image in images if is_prefix and image.id.partition(":")[2].startswith(hex_prefix)
        ]
        if len(by_prefix) > 1:
            raise ImageError(
                ErrorKind.INVALID_ARGUMENT, f"image id prefix {name} is ambiguous: {len(by_prefix)} images"
            )
        if by_prefix:
            return by_prefix[0]
        raise ImageError.not_found(f"image {name[:200]}")

    def _save(self, image: ImageRecord) -> None:
        self._store.put(KIND, image.id, image.to_doc())

    def _register(
        self,
        manifest_digest: str,
        manifest: Manifest,
        config: ImageConfigFile,
        reference: str,
        repository: str,
        *,
        resolved_digest: str = "",
    ) -> ImageRecord:
        """Record the image; its repo digest is ``repository@resolved_digest``: what the reference
        resolved to (an index's digest for a multi-arch image, as docker and containerd report
        it), the manifest's when it named one."""
        layers = tuple(
            LayerRecord(blob.digest, diff_id, blob.size, blob.media_type)
            for blob, diff_id in zip(manifest.layers, config.diff_ids, strict=True)
        )
        image_id = manifest.config.digest
        # A reference names one image: move it off any other image that had it.
        for other in self.all():
            if other.id != image_id and reference in other.references:
                self._save(
                    dataclasses.replace(
                        other, references=tuple(r for r in other.references if r != reference)
                    )
                )
        previous = self._store.get(KIND, image_id)
        old = ImageRecord.from_doc(previous) if previous else None
        repo_digest = f"{repository}@{resolved_digest or manifest_digest}"
        image = ImageRecord(
            id=image_id,
            references=tuple(dict.fromkeys([*(old.references if old else ()), reference])),
            repo_digests=tuple(dict.fromkeys([*(old.repo_digests if old else ()), repo_digest])),
            manifest_digest=manifest_digest,
            manifest_media_type=manifest.media_type,
            layers=layers,
            config=config.config,
            os=config.os,
            architecture=config.architecture,
            created_at=old.created_at if old else time.time(),
        )
        self._save(image)
        log.info(
            "image %s stored as %s (%d layers, %d bytes)", reference, image_id[:19], len(layers), image.size
        )
        return image

    # -- layers ----------------------------------------------------------------------------

    def _layer_lock(self, diff_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._layer_locks.setdefault(diff_id, threading.Lock())

    def _ensure_layer(
        self,
        blob: BlobRef,
        diff_id: str,
        chunks: Callable[[], Iterator[bytes]] | None,
        progress: _Progress | None,
    ) -> None:
        """Make sure the blob is stored and its snapshot exists; runs in a worker thread."""
        with self._layer_lock(diff_id):
            have_blob, have_snapshot = (
                self.content.has_blob(blob.digest),
                self.snapshots.has_snapshot(diff_id),
            )
            if have_blob and have_snapshot:
                if progress:
                    progress.advance(blob.digest, blob.size, "done", force=True)
                return
            if have_blob or chunks is None:
                self._unpack_local(blob, diff_id, progress)
            else:
                self._download_and_unpack(blob, diff_id, chunks(), progress)

    def _unpack_into_snapshot(self, stream: BinaryIO, blob: BlobRef, diff_id: str) -> Path:
        work = self.snapshots.new_snapshot_dir()
        try:
            stats = unpack_layer(
                stream, work, media_type=blob.media_type, allow_device_nodes=self._allow_device_nodes
            )
        except UnpackError as exc:
            remove_tree(work)
            kind = UNPACK_ERROR_KINDS.get(exc.kind, ErrorKind.FAILED_PRECONDITION)
            raise ImageError(kind, f"layer {blob.digest}: {exc}") from exc
        except BaseException:
            remove_tree(work)
            raise
        if stats.diff_id != diff_id:
            remove_tree(work)
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION,
                f"layer {blob.digest} unpacks to {stats.diff_id}, but the image config says {diff_id}",
            )
        if stats.unshared_opaque:
            log.warning(
                "layer %s: %d opaque directories cannot carry the mark virtio-fs guests read (no "
                "user.* xattrs on this filesystem): vm pods' guests would see what they hide",
                blob.digest,
                stats.unshared_opaque,
            )
        return work

    def _unpack_local(self, blob: BlobRef, diff_id: str, progress: _Progress | None) -> None:
        if not self.content.has_blob(blob.digest):
            raise ImageError(ErrorKind.FAILED_PRECONDITION, f"layer {blob.digest} is not in the store")
        with self.content.blob_path(blob.digest).open("rb") as stream:
            work = self._unpack_into_snapshot(stream, blob, diff_id)
        self.snapshots.commit_snapshot(work, diff_id)
        if progress:
            progress.advance(blob.digest, blob.size, "unpacking", force=True)

    def _download_and_unpack(
        self, blob: BlobRef, diff_id: str, chunks: Iterator[bytes], progress: _Progress | None
    ) -> None:
        writer = self.content.writer(blob.digest, blob.size)

        def sink(chunk: bytes) -> None:
            writer.write(chunk)
            self._metrics.image_bytes_downloaded(len(chunk))
            if progress:
                progress.advance(blob.digest, len(chunk))

        work: Path | None = None
        try:
            reader = _TeeReader(chunks, sink)
            # The unpacker only calls read(): the tee is a stream in every way it uses.
            work = self._unpack_into_snapshot(cast(BinaryIO, reader), blob, diff_id)
            reader.drain()  # the rest of the blob (tar padding) must be stored and hashed too
            writer.commit()
        except BaseException:
            writer.abort()
            if work is not None:  # unpacked, but the blob was refused or could not be stored
                remove_tree(work)
            raise
        self.snapshots.commit_snapshot(work, diff_id)
        if progress:
            progress.advance(blob.digest, 0, "unpacking", force=True)

    async def _ensure_layers(
        self,
        manifest: Manifest,
        config: ImageConfigFile,
        fetch: Callable[[BlobRef], Callable[[], Iterator[bytes]]] | None,
        progress: _Progress | None,
    ) -> None:
        if len(manifest.layers) != len(config.diff_ids):
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION,
                f"the manifest has {len(manifest.layers)} layers but the config {len(config.diff_ids)}",
            )
        limit = asyncio.Semaphore(LAYER_CONCURRENCY)
        # Once a layer fails (or the pull is cancelled) the others stop at their next chunk and
        # clean up, and those still waiting never start: the error is reported once nothing of
        # this pull runs or lies half-made any more.
        abandon = threading.Event()
        failures: list[BaseException] = []

        async def one(blob: BlobRef, diff_id: str) -> None:
            async with limit:
                if abandon.is_set():
                    return
                download = fetch(blob) if fetch else None
                chunks = (lambda: _until_abandoned(abandon, download())) if download else None
                try:
                    await asyncio.to_thread(self._ensure_layer, blob, diff_id, chunks, progress)
                except BaseException as exc:
                    if not abandon.is_set():
                        failures.append(exc)
                    abandon.set()
                    raise

        layers = zip(manifest.layers, config.diff_ids, strict=True)
        every_layer = asyncio.gather(*(one(b, d) for b, d in layers), return_exceptions=True)
        try:
            await asyncio.shield(every_layer)
        except asyncio.CancelledError:
            # The client went away: the layers stop at their next chunk, and this returns only
            # once no thread of the pull runs, so nothing is stored after the caller has left the
            # store gate (a collection then could not know of it).
            abandon.set()
            await asyncio.wait({every_layer})
            raise
        if failures:
            raise failures[0]

    # -- pull ------------------------------------------------------------------------------

    async def pull(
        self, reference: str, credentials: Any = None
    ) -> AsyncIterator[PullProgress | ImageRecord]:
        from auraed.references import ReferenceError, parse_reference

        try:
            ref = parse_reference(reference)
        except ReferenceError as exc:
            raise ImageError(ErrorKind.INVALID_ARGUMENT, f"reference: {exc}") from None
        yield PullProgress("resolving")
        result = "cancelled"  # unless it ends otherwise: its consumer left (GeneratorExit)
        try:
            async with self._gate.storing(), contextlib.aclosing(self._pull(ref, credentials)) as events:
                async for event in events:
                    if isinstance(event, ImageRecord):
                        result = "ok"  # the last event: a consumer may stop once it has it
                    yield event
        except ImageError as exc:
            result = exc.kind.value
            raise
        except Exception:
            result = ErrorKind.INTERNAL.value
            raise
        finally:
            self._metrics.image_pull_finished(result)

    async def _pull(
        self, ref: ImageReference, credentials: Any
    ) -> AsyncGenerator[PullProgress | ImageRecord, None]:
        from auraed.images.registry import RegistryError

        try:
            resolved = await asyncio.to_thread(self._registry.resolve, ref, credentials)
            manifest = parse_manifest(resolved.raw, resolved.media_type)
            if self.content.has_blob(manifest.config.digest):
                config_raw = self.content.read_blob(manifest.config.digest, MAX_CONFIG_BYTES)
            else:
                descriptor = resolved.config
                config_raw = await asyncio.to_thread(
                    self._registry.fetch_blob_bytes, ref, descriptor, credentials
                )
            config = parse_image_config(config_raw)
            check_platform(config, f"image {ref.name}")
            await asyncio.to_thread(self.content.write_blob, manifest.config.digest, config_raw)
            progress = _Progress(asyncio.get_running_loop(), manifest.layers)
            layer_descriptors = {d.digest: d for d in resolved.layers}

            def fetch(blob: BlobRef) -> Callable[[], Iterator[bytes]]:
                return lambda: self._registry.fetch_blob(ref, layer_descriptors[blob.digest], credentials)

            task = asyncio.ensure_future(self._ensure_layers(manifest, config, fetch, progress))
            try:
                async for event in _events_until(task, progress.queue):
                    yield event
            finally:  # a consumer that stops early (cancelled) leaves the layers to be abandoned
                task.cancel()
                await asyncio.wait({task})
            await asyncio.to_thread(self.content.write_blob, resolved.digest, resolved.raw)
        except RegistryError as exc:
            raise registry_error(exc) from None
        image = self._register(
            resolved.digest,
            manifest,
            config,
            ref.name,
            ref.repository_name,
            resolved_digest=resolved.index_digest or resolved.digest,
        )
        yield PullProgress("done", done=progress.total, total=progress.total)
        yield image

    # -- import from a peer ----------------------------------------------------------------

    def missing_blobs(self, digests: list[str]) -> list[str]:
        return self.content.missing(digests)

    async def import_image(
        self,
        reference: str,
        manifest_raw: bytes,
        media_type: str,
        blobs: AsyncIterator[tuple[str, bytes, bool]],
    ) -> tuple[ImageRecord, list[str]]:
        """Store a peer's image: every blob the manifest names must arrive or already be stored."""
        async with self._gate.storing():
            ref_name, repository = _reference_names(reference)
            manifest = parse_manifest(manifest_raw, media_type)
            expected = {b.digest: b for b in (manifest.config, *manifest.layers)}
            received: list[str] = []
            writer = None
            try:
                async for digest, data, last in blobs:
                    if digest not in expected:
                        raise ImageError(
                            ErrorKind.INVALID_ARGUMENT, f"blob {digest[:80]} is not part of the manifest"
                        )
                    if writer is None or writer.digest != digest:
                        if writer is not None:
                            raise ImageError(
                                ErrorKind.INVALID_ARGUMENT, f"blob {writer.digest} ended without last=true"
                            )
                        writer = self.content.writer(digest, expected[digest].size)
                    await asyncio.to_thread(writer.write, data)
                    if last:
                        await asyncio.to_thread(writer.commit)
                        received.append(digest)
                        writer = None
            finally:
                if writer is not None:
                    writer.abort()
            missing = self.content.missing(expected)
            if missing:
                raise ImageError(
                    ErrorKind.FAILED_PRECONDITION, f"blobs missing after import: {', '.join(missing)}"
                )
            image = await self._finish_local_import(ref_name, repository, manifest_raw, manifest)
            return image, received

    async def _finish_local_import(
        self, ref_name: str, repository: str, manifest_raw: bytes, manifest: Manifest
    ) -> ImageRecord:
        config = parse_image_config(self.content.read_blob(manifest.config.digest, MAX_CONFIG_BYTES))
        check_platform(config, f"image {ref_name}")
        await self._ensure_layers(manifest, config, None, None)
        manifest_digest = _sha256(manifest_raw)
        await asyncio.to_thread(self.content.write_blob, manifest_digest, manifest_raw)
        return self._register(manifest_digest, manifest, config, ref_name, repository)

    # -- import from an OCI layout ---------------------------------------------------------

    async def import_layout(self, path: Path, ref_name: str, reference: str) -> ImageRecord:
        from auraed.images.layout import open_layout

        async with self._gate.storing():
            with open_layout(path) as layout:
                manifest_raw, media_type, annotated_name = layout.select(ref_name)
                manifest = parse_manifest(manifest_raw, media_type)
                for blob in (manifest.config, *manifest.layers):
                    if not self.content.has_blob(blob.digest):
                        await asyncio.to_thread(layout.copy_blob, blob, self.content)
            name = reference or annotated_name
            if not name:
                raise ImageError(
                    ErrorKind.INVALID_ARGUMENT, "reference: the layout names no image; give a reference"
                )
            ref_name, repository = _reference_names(name)
            return await self._finish_local_import(ref_name, repository, manifest_raw, manifest)

    # -- remove ----------------------------------------------------------------------------

    async def remove(self, name: str) -> tuple[int, bool]:
        """Forget the image and collect what no image names nor a container reads any more
        (layers_in_use): (bytes freed, deferred).

        The check and the record's removal run on the event loop, as a container's Create finds
        its image and records itself: one of them sees the other. The collection must not run
        while a pull or an import is under way (_StoreGate); then it is deferred until they end,
        and the removal does not wait for them (a large pull could take minutes).
        """
        image = self.find(name)
        if self.in_use(image.id):
            raise ImageError.precondition(f"image {name} is used by a container; delete the container first")
        self._store.delete(KIND, image.id)
        if self._gate.storing_now():
            self._collect_later()
            return 0, True
        async with self._gate.collecting():
            return await asyncio.to_thread(self._collect, self.layers_in_use()), False

    def layers_released(self, diff_ids: Iterable[str]) -> None:
        """A container stopped reading these layers: those no image names are collected soon
        (once no store is under way)."""
        named = {layer.diff_id for image in self.all() for layer in image.layers}
        if set(diff_ids) - named:
            self._collect_later()

    def _collect_later(self) -> None:
        """One collection, run once no store is under way; removals meanwhile share it, and one
        asked for while it runs runs again after it (it may have kept what is free now)."""
        self._collect_again = True
        if self._deferred_collection is None or self._deferred_collection.done():
            self._deferred_collection = asyncio.get_running_loop().create_task(
                self._collect_when_free(), name="image-collection"
            )

    async def _collect_when_free(self) -> None:
        try:
            while self._collect_again:
                self._collect_again = False
                async with self._gate.collecting():
                    await asyncio.to_thread(self._collect, self.layers_in_use())
        except Exception:
            log.exception("the deferred garbage collection of images failed")

    def _collect(self, layers_in_use: set[str]) -> int:
        """Remove what no registered image names and no container reads (``layers_in_use``, read
        on the event loop); only under the gate's collecting()."""
        images = self.all()
        keep_blobs = set().union(*(i.blobs for i in images)) if images else set()
        keep_snapshots = {layer.diff_id for i in images for layer in i.layers} | layers_in_use
        freed = self.content.collect_blobs(keep_blobs) + self.snapshots.collect_snapshots(keep_snapshots)
        with self._locks_guard:  # no pull runs during a collection (_StoreGate): none is held
            self._layer_locks = {d: lock for d, lock in self._layer_locks.items() if d in keep_snapshots}
        log.info("garbage collection freed %d bytes", freed)
        return freed


async def _events_until(
    task: asyncio.Future[None], queue: asyncio.Queue[PullProgress]
) -> AsyncIterator[PullProgress]:
    while not task.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        waiting: set[asyncio.Future[Any]] = {getter, task}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            yield getter.result()
        else:
            getter.cancel()
    task.result()


def _sha256(data: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(data).hexdigest()


def normalize_reference(name: str) -> str:
    from auraed.references import ReferenceError, parse_reference

    try:
        return parse_reference(name).name
    except ReferenceError as exc:
        raise ImageError(ErrorKind.INVALID_ARGUMENT, f"reference: {exc}") from None


def _reference_names(name: str) -> tuple[str, str]:
    from auraed.references import ReferenceError, parse_reference

    try:
        ref = parse_reference(name)
    except ReferenceError as exc:
        raise ImageError(ErrorKind.INVALID_ARGUMENT, f"reference: {exc}") from None
    return ref.name, ref.repository_name


def registry_error(exc: Any) -> ImageError:
    kinds = {
        "not_found": ErrorKind.NOT_FOUND,
        "unauthorized": ErrorKind.PERMISSION_DENIED,
        "unavailable": ErrorKind.UNAVAILABLE,
        # Garbage from the registry is the registry failing, like one that is down (the issue
        # asks for UNAVAILABLE); a well-formed image this runtime cannot run is a precondition.
        "invalid": ErrorKind.UNAVAILABLE,
        "unsupported": ErrorKind.FAILED_PRECONDITION,
    }
    return ImageError(kinds.get(getattr(exc, "kind", ""), ErrorKind.UNAVAILABLE), str(exc))
