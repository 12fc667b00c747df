"""Images through the daemon: pulls from real local registries, peer import, layouts, hostile layers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import tarfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.client import AuraeClient, ClientError
from auraed.images.content import LocalStore
from auraed.images.images import Images
from auraed.state.store import Store
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.integration.containers_helpers import CONTAINERS, delete, import_layout, logs, run
from tests.support import workers
from tests.support.images import (
    OCI_MANIFEST,
    BuiltImage,
    build_busybox_layout,
    build_layout,
    build_multilayer_layout,
    push_layout,
)
from tests.support.registry import PACE_CHUNK, FakeRegistry, FakeResponse, LocalRegistry


@pytest.fixture
def registry() -> Iterator[LocalRegistry]:
    with LocalRegistry() as local:
        yield local


async def pull(client: AuraeClient, reference: str, **auth: str) -> tuple[list[pb.PullProgress], pb.Image]:
    request = pb.ContainerServicePullImageRequest(
        reference=reference, auth=pb.RegistryAuth(**auth) if auth else None
    )
    progress, image = [], None
    async for reply in client.stream(CONTAINERS, "PullImage", request, timeout=120):
        if reply.progress is not None:
            progress.append(reply.progress)
        if reply.image is not None:
            image = reply.image
    assert image is not None
    return progress, image


async def pull_error(client: AuraeClient, reference: str, **auth: str) -> ClientError:
    with pytest.raises(ClientError) as error:
        await pull(client, reference, **auth)
    return error.value


async def test_pull_shows_progress_and_runs(
    daemon: DaemonProcess, registry: LocalRegistry, busybox_layout: BuiltImage
) -> None:
    push_layout(busybox_layout, f"{registry.host}/library/busybox:1")
    async with daemon.client() as client:
        progress, image = await pull(client, f"{registry.host}/library/busybox:1")
        phases = [p.phase for p in progress]
        assert phases[0] == "resolving" and phases[-1] == "done"
        assert progress[-1].done == progress[-1].total == busybox_layout.total_layer_size
        assert image.id == busybox_layout.config_digest
        assert image.manifest_digest == busybox_layout.manifest_digest
        assert f"{registry.host}/library/busybox:1" in image.references
        final = await run(
            client, "pulled", f"{registry.host}/library/busybox:1", command=["echo", "pulled ok"]
        )
        assert final.exit_code == 0 and await logs(client, "pulled") == ["pulled ok"]
        await delete(client, "pulled")
        # By digest too, and a second pull downloads nothing new.
        _, again = await pull(client, f"{registry.host}/library/busybox@{busybox_layout.manifest_digest}")
        assert again.id == image.id


async def test_images_are_found_by_id_prefix_and_bad_names_are_refused(
    daemon: DaemonProcess, busybox_layout: BuiltImage
) -> None:
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, "localhost/found:1")
        hex_id = busybox_layout.config_digest.removeprefix("sha256:")

        async def status(name: str) -> Any:
            request = pb.ContainerServiceImageStatusRequest(image=name)
            return (await client.call(CONTAINERS, "ImageStatus", request)).image

        for name in (hex_id[:12], f"sha256:{hex_id[:12]}", "localhost/found:1", busybox_layout.config_digest):
            assert (await status(name)).id == busybox_layout.config_digest
        with pytest.raises(ClientError) as error:
            await status(f"sha256:{hex_id[:5]}")  # 12 characters, but 5 digits: too short a prefix
        assert error.value.code == "NOT_FOUND"
        with pytest.raises(ClientError) as error:
            await status("Not A::Reference")
        assert error.value.code == "INVALID_ARGUMENT" and "reference" in error.value.message


async def test_mirror_serves_another_registry(
    daemon_factory: DaemonFactory, registry: LocalRegistry, busybox_layout: BuiltImage
) -> None:
    push_layout(busybox_layout, f"{registry.host}/pause:3.9")
    config = f'[registries."registry.k8s.io"]\nmirrors = ["http://{registry.host}"]\n'
    daemon = daemon_factory(config_text=config)
    async with daemon.client() as client:
        _, image = await pull(client, "registry.k8s.io/pause:3.9")
        assert "registry.k8s.io/pause:3.9" in image.references


async def test_basic_auth_and_docker_config(
    daemon_factory: DaemonFactory, busybox_layout: BuiltImage, tmp_path: Path
) -> None:
    with LocalRegistry(mode="basic") as private:
        push_layout(busybox_layout, f"{private.host}/team/app:1", creds=private.creds)
        daemon = daemon_factory()
        async with daemon.client() as client:
            error = await pull_error(client, f"{private.host}/team/app:1")
            assert error.code == "PERMISSION_DENIED"
            error = await pull_error(
                client, f"{private.host}/team/app:1", username=private.user, password="wrong"
            )
            assert error.code == "PERMISSION_DENIED"
            await pull(client, f"{private.host}/team/app:1", username=private.user, password=private.password)
        docker_config = tmp_path / "docker.json"
        auth = base64.b64encode(f"{private.user}:{private.password}".encode()).decode()
        docker_config.write_text(json.dumps({"auths": {private.host: {"auth": auth}}}))
        with_config = daemon_factory("--docker-config", str(docker_config))
        async with with_config.client() as client:
            await pull(client, f"{private.host}/team/app:1")


async def test_bearer_token_auth(daemon: DaemonProcess, busybox_layout: BuiltImage) -> None:
    with LocalRegistry(mode="token") as private:
        push_layout(busybox_layout, f"{private.host}/team/app:1", creds=private.creds)
        async with daemon.client() as client:
            await pull(client, f"{private.host}/team/app:1", username=private.user, password=private.password)


async def test_registry_down_or_garbage_fails_fast_and_clearly(daemon: DaemonProcess) -> None:
    closed_port = workers.free_port()  # this worker's own: no other worker listens on it meanwhile
    async with daemon.client() as client:
        started = time.monotonic()
        error = await pull_error(client, f"127.0.0.1:{closed_port}/app:1")
        assert error.code == "UNAVAILABLE" and f"127.0.0.1:{closed_port}" in error.message
        assert time.monotonic() - started < 10
        garbage = FakeResponse(
            200, b"{not json", {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
        )
        with FakeRegistry({("GET", "/v2/app/manifests/1"): garbage}) as fake:
            error = await pull_error(client, f"{fake.host}/app:1")
        assert error.code == "UNAVAILABLE" and "not JSON" in error.message
        error = await pull_error(client, "Not A Reference")
        assert error.code == "INVALID_ARGUMENT"
        # Nothing half-made: no image, no blobs beyond what verified, an empty ingest area.
        assert (
            await client.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())
        ).images == []
        assert list((daemon.root / "state" / "images" / "ingest").iterdir()) == []


async def test_a_failing_layer_stops_the_others_before_the_error_is_reported(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Two layers download at once: a slow one, and one whose bytes do not match its digest."""
    slow = {"data/noise.bin": os.urandom(4 << 20)}  # incompressible: ~64 chunks on the slow link
    corrupt = {"data/small.txt": b"small\n" * 1000}
    image = build_layout(tmp_path / "layout", [slow, corrupt])
    slow_layer, corrupt_layer = image.layers
    broken = bytearray(image.blob(corrupt_layer.digest))
    broken[len(broken) // 2] ^= 0xFF
    base = "/v2/app"
    routes = {
        ("GET", f"{base}/manifests/1"): FakeResponse(200, image.manifest, {"Content-Type": OCI_MANIFEST}),
        ("GET", f"{base}/blobs/{image.config_digest}"): FakeResponse(200, image.config),
        ("GET", f"{base}/blobs/{slow_layer.digest}"): FakeResponse(
            200, image.blob(slow_layer.digest), pace_s=0.02
        ),
        ("GET", f"{base}/blobs/{corrupt_layer.digest}"): FakeResponse(200, bytes(broken)),
    }
    with FakeRegistry(routes) as fake:
        async with daemon.client() as client:
            error = await pull_error(client, f"{fake.host}/app:1")
        assert error.code == "UNAVAILABLE" and corrupt_layer.digest in error.message
        # Reported once the slow layer's download had stopped and its work was gone.
        assert list((daemon.root / "state" / "images" / "ingest").iterdir()) == []
        sent = fake.sent[f"{base}/blobs/{slow_layer.digest}"]
        await asyncio.sleep(0.5)
        assert fake.sent[f"{base}/blobs/{slow_layer.digest}"] <= sent + 2 * PACE_CHUNK
        assert sent < slow_layer.size


async def test_a_pull_its_client_gives_up_on_stores_nothing_after(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The client hangs up during a slow download: the daemon stops the download and removes its
    work before it lets go of the store (nothing lands later, when a collection could not know)."""
    image = build_layout(tmp_path / "layout", [{"data/noise.bin": os.urandom(4 << 20)}])
    (layer,) = image.layers
    base, blob_path = "/v2/app", f"/v2/app/blobs/{layer.digest}"
    routes = {
        ("GET", f"{base}/manifests/1"): FakeResponse(200, image.manifest, {"Content-Type": OCI_MANIFEST}),
        ("GET", f"{base}/blobs/{image.config_digest}"): FakeResponse(200, image.config),
        ("GET", blob_path): FakeResponse(200, image.blob(layer.digest), pace_s=0.05),
    }
    images = daemon.root / "state" / "images"
    with FakeRegistry(routes) as fake:
        async with daemon.client() as client:
            request = pb.ContainerServicePullImageRequest(reference=f"{fake.host}/app:1")
            # AuraeClient.stream is an async generator: closing it cancels the call.
            replies = cast(AsyncGenerator[Any, None], client.stream(CONTAINERS, "PullImage", request))
            async for reply in replies:
                if reply.progress is not None and reply.progress.done > 0:
                    break
            await replies.aclose()
            await wait_until(lambda: list((images / "ingest").iterdir()) == [])
            sent = fake.sent[blob_path]
            await asyncio.sleep(1.0)
            assert fake.sent[blob_path] <= sent + 2 * PACE_CHUNK < layer.size
            assert not (images / "blobs" / "sha256" / layer.digest[7:]).exists()
            assert (
                await client.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())
            ).images == []


async def test_removing_an_image_during_a_pull_keeps_what_the_pull_stored(
    daemon: DaemonProcess, registry: LocalRegistry, busybox_layout: BuiltImage, large_layout: BuiltImage
) -> None:
    """RemoveImage collects what no registered image names; a pull's layers are named by none
    until it ends. So the collection is deferred until the pull ends, the removal does not wait
    for it, and the pulled image runs whole."""
    push_layout(large_layout, f"{registry.host}/big:1")
    other_config = daemon.root / "state" / "images" / "blobs" / "sha256" / busybox_layout.config_digest[7:]
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, "localhost/other:1")
        assert other_config.exists()
        removed: Any = None
        request = pb.ContainerServicePullImageRequest(reference=f"{registry.host}/big:1")
        async for reply in client.stream(CONTAINERS, "PullImage", request, timeout=120):
            if removed is None and reply.progress is not None and reply.progress.done > 5 << 20:
                remove = pb.ContainerServiceRemoveImageRequest(image="localhost/other:1")
                removed = await client.call(CONTAINERS, "RemoveImage", remove)
                assert other_config.exists()  # still there: the pull is under way
        assert removed is not None
        assert removed.collection_deferred and removed.freed_bytes == 0
        await wait_until(lambda: not other_config.exists())  # collected once the pull ended
        final = await run(client, "whole", f"{registry.host}/big:1", command=["sh", "-c", "ls /data"])
        assert final.exit_code == 0 and await logs(client, "whole") == ["random", "text"]
        await delete(client, "whole")


async def test_kill_9_mid_pull_corrupts_nothing_and_retry_completes(
    daemon_factory: DaemonFactory, registry: LocalRegistry, large_layout: BuiltImage
) -> None:
    push_layout(large_layout, f"{registry.host}/big:1")
    daemon = daemon_factory()
    async with daemon.client() as client:
        request = pb.ContainerServicePullImageRequest(reference=f"{registry.host}/big:1")
        async for reply in client.stream(CONTAINERS, "PullImage", request, timeout=120):
            if reply.progress is not None and reply.progress.done > 5 << 20:
                daemon.kill9()
                break
    store = daemon.root / "state" / "images"
    for blob in (store / "blobs" / "sha256").iterdir():  # whatever is there is whole and verified
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    daemon.start()
    assert list((store / "ingest").iterdir()) == []
    async with daemon.client() as client:
        _, image = await pull(client, f"{registry.host}/big:1")
        assert image.id == large_layout.config_digest


async def test_peer_import_sends_only_missing_blobs(
    daemon: DaemonProcess, busybox_layout: BuiltImage
) -> None:
    async with daemon.client() as client:
        digests = [busybox_layout.config_digest, *(layer.digest for layer in busybox_layout.layers)]
        missing = await client.call(
            CONTAINERS, "MissingBlobs", pb.ContainerServiceMissingBlobsRequest(digests=digests)
        )
        assert sorted(missing.digests) == sorted(digests)
        reply = await client.upload(
            CONTAINERS, "ImportImage", _import_stream(busybox_layout, missing.digests)
        )
        assert sorted(reply.received) == sorted(digests) and reply.image.id == busybox_layout.config_digest
        missing = await client.call(
            CONTAINERS, "MissingBlobs", pb.ContainerServiceMissingBlobsRequest(digests=digests)
        )
        assert missing.digests == []
        # A second import under another name sends no blob at all.
        reply = await client.upload(
            CONTAINERS, "ImportImage", _import_stream(busybox_layout, [], "localhost/again:1")
        )
        assert reply.received == [] and "localhost/again:1" in reply.image.references


async def test_peer_import_refuses_a_corrupt_blob(daemon: DaemonProcess, busybox_layout: BuiltImage) -> None:
    async with daemon.client() as client:
        layer = busybox_layout.layers[0].digest
        with pytest.raises(ClientError) as error:
            await client.upload(
                CONTAINERS, "ImportImage", _import_stream(busybox_layout, [layer], corrupt=layer)
            )
        assert error.value.code == "FAILED_PRECONDITION" and layer in error.value.message
        missing = await client.call(
            CONTAINERS, "MissingBlobs", pb.ContainerServiceMissingBlobsRequest(digests=[layer])
        )
        assert missing.digests == [layer]


async def _import_stream(
    image: BuiltImage, send: list[str], reference: str = "localhost/peer:1", corrupt: str = ""
) -> AsyncIterator[pb.ContainerServiceImportImageRequest]:
    yield pb.ContainerServiceImportImageRequest(
        header=pb.ImportImageHeader(
            reference=reference,
            manifest=image.manifest,
            manifest_media_type="application/vnd.oci.image.manifest.v1+json",
        )
    )
    for digest in send:
        data = image.blob(digest)
        if digest == corrupt:
            data = data[:-1] + bytes([data[-1] ^ 1])
        chunks = [data[i : i + (256 << 10)] for i in range(0, len(data), 256 << 10)] or [b""]
        for index, chunk in enumerate(chunks):
            yield pb.ContainerServiceImportImageRequest(
                chunk=pb.BlobChunk(digest=digest, data=chunk, last=index == len(chunks) - 1)
            )


async def test_layout_tar_import(daemon: DaemonProcess, busybox_layout: BuiltImage, tmp_path: Path) -> None:
    archive = tmp_path / "busybox.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(busybox_layout.layout, arcname=".")
    async with daemon.client() as client:
        image = await import_layout(client, archive, "localhost/from-tar:1")
        assert image.id == busybox_layout.config_digest


def _hostile_layer() -> dict[str, object]:
    from tests.support.images import Symlink

    return {"escape": Symlink("/tmp"), "escape/aurae-hostile-marker": b"must never be written\n"}


async def test_hostile_layer_is_refused_and_writes_nothing_outside(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    marker = Path("/tmp/aurae-hostile-marker")
    marker.unlink(missing_ok=True)
    layout = tmp_path / "hostile"
    build_layout(layout, [_hostile_layer()])  # type: ignore[list-item]
    async with daemon.client() as client:
        with pytest.raises(ClientError) as error:
            await import_layout(client, layout, "localhost/hostile:1")
        assert error.value.code == "FAILED_PRECONDITION"
        assert (
            await client.call(CONTAINERS, "ListImages", pb.ContainerServiceListImagesRequest())
        ).images == []
    assert not marker.exists()
    store = daemon.root / "state" / "images"
    assert list((store / "snapshots").iterdir()) == [] and list((store / "ingest").iterdir()) == []


async def test_concurrent_containers(daemon: DaemonProcess, busybox_layout: BuiltImage) -> None:
    async with daemon.client() as client:
        await import_layout(client, busybox_layout.layout, "localhost/busybox:1")
        names = [f"c{i}" for i in range(10)]
        finals = await asyncio.gather(
            *(run(client, n, "localhost/busybox:1", command=["echo", n]) for n in names)
        )
        assert all(f.exit_code == 0 for f in finals)
        for name in names:
            assert await logs(client, name) == [name]
            await delete(client, name)


async def test_layers_containers_read_stay_after_their_image_is_removed(tmp_path: Path) -> None:
    """A vm pod's container reads its image's snapshots through its pod's share whether or not
    the image is still named (Images.layers_in_use): RemoveImage forgets the image and its blobs,
    its layers stay while they are read, and go once they are released."""
    store = Store(tmp_path / "state.db")
    local = LocalStore(tmp_path / "images")
    images = Images(store, local, local, registry_factory=lambda: None)  # type: ignore[arg-type,return-value]
    busybox = build_busybox_layout(tmp_path / "busybox").layout
    await images.import_layout(busybox, "latest", "x/bb:1")
    layout = build_multilayer_layout(tmp_path / "multilayer").layout
    image = await images.import_layout(layout, "latest", "x/multi:1")
    layers = [layer.diff_id for layer in image.layers]
    read: set[str] = set(layers)
    images.layers_in_use = lambda: set(read)

    await images.remove("x/multi:1")
    assert not local.has_blob(image.id) and not local.has_blob(image.layers[1].digest)
    assert all(local.has_snapshot(layer) for layer in layers)

    read.clear()
    images.layers_released(layers)
    await wait_until(lambda: not local.has_snapshot(layers[2]), timeout=30)
    # The first is busybox's own layer, which its image still names.
    assert [local.has_snapshot(layer) for layer in layers] == [True, False, False]
