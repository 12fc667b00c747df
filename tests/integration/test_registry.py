"""The registry client against real local registries (docker-registry 2.8) and fake broken ones."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from auraed.images.model import DOCKER_MANIFEST, OCI_MANIFEST
from auraed.images.registry import (
    Credentials,
    Descriptor,
    RegistryClient,
    RegistryError,
    RegistryHostConfig,
)
from auraed.pki import PkiPaths, ensure_dev_pki
from auraed.references import parse_reference
from tests.support.images import (
    OCI_CONFIG,
    BuiltImage,
    build_busybox_layout,
    build_multilayer_layout,
    canonical_json,
    push_index,
    push_layout,
    sha256_digest,
)
from tests.support.registry import (
    PACE_CHUNK,
    FakeRegistry,
    FakeResponse,
    LocalRegistry,
    free_port,
    processes_running,
    silent_port,
)

REPO = "team/app"


@dataclass(frozen=True)
class Images:
    busybox: BuiltImage
    multilayer: BuiltImage


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    root = tmp_path_factory.mktemp("layouts")
    return Images(build_busybox_layout(root / "busybox"), build_multilayer_layout(root / "multilayer"))


@pytest.fixture(scope="module")
def registry(images: Images) -> Iterator[LocalRegistry]:
    with LocalRegistry() as local:
        push_layout(images.busybox, f"{local.host}/{REPO}:1")
        push_layout(images.multilayer, f"{local.host}/{REPO}:multi")
        push_layout(images.multilayer, f"{local.host}/{REPO}:docker", format="v2s2")
        push_layout(images.busybox, f"{local.host}/pause:3.9")
        yield local


@pytest.fixture(scope="module")
def basic_registry(images: Images) -> Iterator[LocalRegistry]:
    with LocalRegistry(mode="basic", users={"alice": "secret"}) as local:
        push_layout(images.busybox, f"{local.host}/{REPO}:1", creds=local.creds)
        yield local


@pytest.fixture
def token_registry(images: Images) -> Iterator[LocalRegistry]:
    with LocalRegistry(mode="token", users={"alice": "secret"}) as local:
        push_layout(images.busybox, f"{local.host}/{REPO}:1", creds=local.creds)
        yield local


def _read(client: RegistryClient, ref_text: str, auth: Credentials | None = None) -> dict[str, bytes]:
    """Resolve and download every blob: digest -> bytes."""
    ref = parse_reference(ref_text)
    resolved = client.resolve(ref, auth)
    blobs = {resolved.config.digest: client.fetch_blob_bytes(ref, resolved.config, auth)}
    for layer in resolved.layers:
        blobs[layer.digest] = b"".join(client.fetch_blob(ref, layer, auth))
    return blobs


def _assert_same_image(
    client: RegistryClient, ref_text: str, image: BuiltImage, auth: Credentials | None = None
) -> None:
    resolved = client.resolve(parse_reference(ref_text), auth)
    assert resolved.digest == image.manifest_digest
    assert resolved.raw == image.manifest
    assert resolved.media_type == OCI_MANIFEST
    blobs = _read(client, ref_text, auth)
    assert blobs[image.config_digest] == image.config
    for layer in image.layers:
        assert blobs[layer.digest] == image.blob(layer.digest)


# -- anonymous: tags, digests, indexes, schema 2 ---------------------------------------------------


def test_resolve_and_fetch_by_tag_and_by_digest(registry: LocalRegistry, images: Images) -> None:
    client = RegistryClient()
    image = images.busybox
    _assert_same_image(client, f"{registry.host}/{REPO}:1", image)
    _assert_same_image(client, f"{registry.host}/{REPO}@{image.manifest_digest}", image)
    _assert_same_image(client, f"{registry.host}/{REPO}:1@{image.manifest_digest}", image)
    resolved = client.resolve(parse_reference(f"{registry.host}/{REPO}:1"))
    assert resolved.index_digest is None
    assert resolved.endpoint == registry.url
    assert resolved.config.media_type == OCI_CONFIG
    assert resolved.total_size == image.total_layer_size


def test_multilayer_blobs_verify(registry: LocalRegistry, images: Images) -> None:
    client = RegistryClient()
    _assert_same_image(client, f"{registry.host}/{REPO}:multi", images.multilayer)
    resolved = client.resolve(parse_reference(f"{registry.host}/{REPO}:multi"))
    assert [layer.digest for layer in resolved.layers] == [layer.digest for layer in images.multilayer.layers]


def test_stream_is_chunked_and_closable(registry: LocalRegistry, images: Images) -> None:
    client = RegistryClient()
    ref = parse_reference(f"{registry.host}/{REPO}:1")
    layer = client.resolve(ref).layers[0]
    with client.fetch_blob(ref, layer, chunk_size=64 * 1024) as stream:
        chunks = list(stream)
    assert len(chunks) > 1 and all(len(chunk) <= 64 * 1024 for chunk in chunks)
    assert sha256_digest(b"".join(chunks)) == layer.digest
    # Abandoning a stream early is fine and releases the connection.
    stream = client.fetch_blob(ref, layer, chunk_size=1024)
    next(stream)
    stream.close()
    assert list(stream) == []


def test_docker_schema2_manifest(registry: LocalRegistry, images: Images) -> None:
    client = RegistryClient()
    ref = parse_reference(f"{registry.host}/{REPO}:docker")
    resolved = client.resolve(ref)
    assert resolved.media_type == DOCKER_MANIFEST
    assert resolved.digest == sha256_digest(resolved.raw)
    assert json.loads(resolved.raw)["mediaType"] == DOCKER_MANIFEST
    assert resolved.config.media_type == "application/vnd.docker.container.image.v1+json"
    assert {layer.media_type for layer in resolved.layers} == {
        "application/vnd.docker.image.rootfs.diff.tar.gzip"
    }
    blobs = _read(client, ref.name)
    for layer in images.multilayer.layers:  # skopeo converts the manifest, not the layers
        assert blobs[layer.digest] == images.multilayer.blob(layer.digest)


def test_index_resolves_to_linux_amd64(registry: LocalRegistry, tmp_path: Path) -> None:
    index = push_index(
        tmp_path,
        registry.url,
        "team/multiarch",
        "1",
        platforms=("linux/arm64", "linux/amd64", "linux/arm/v7"),
    )
    client = RegistryClient()
    for text in (f"{registry.host}/team/multiarch:1", f"{registry.host}/team/multiarch@{index.digest}"):
        ref = parse_reference(text)
        resolved = client.resolve(ref)
        amd64 = index.images["linux/amd64"]
        assert resolved.digest == amd64.manifest_digest
        assert resolved.raw == amd64.manifest
        assert resolved.index_digest == index.digest
        assert resolved.platform == {"architecture": "amd64", "os": "linux"}
        platform_layer = b"".join(client.fetch_blob(ref, resolved.layers[-1]))
        assert platform_layer == amd64.blob(amd64.layers[-1].digest)


def test_index_prefers_variantless_amd64(registry: LocalRegistry, tmp_path: Path) -> None:
    index = push_index(
        tmp_path, registry.url, "team/variants", "1", platforms=("linux/amd64/v3", "linux/amd64")
    )
    resolved = RegistryClient().resolve(parse_reference(f"{registry.host}/team/variants:1"))
    assert resolved.digest == index.images["linux/amd64"].manifest_digest


def test_index_without_amd64_lists_platforms(registry: LocalRegistry, tmp_path: Path) -> None:
    push_index(
        tmp_path, registry.url, "team/armonly", "1", platforms=("linux/arm64", "linux/arm/v7", "linux/s390x")
    )
    with pytest.raises(RegistryError) as caught:
        RegistryClient().resolve(parse_reference(f"{registry.host}/team/armonly:1"))
    error = caught.value
    assert error.kind == "not_found"
    assert "no linux/amd64 manifest" in str(error)
    assert "platforms offered: linux/arm/v7, linux/arm64, linux/s390x" in str(error)
    assert error.registry == registry.host and error.repository == "team/armonly"


def test_other_platform_can_be_chosen(registry: LocalRegistry, tmp_path: Path) -> None:
    index = push_index(tmp_path, registry.url, "team/arm", "1", platforms=("linux/arm64", "linux/amd64"))
    resolved = RegistryClient(platform=("linux", "arm64")).resolve(
        parse_reference(f"{registry.host}/team/arm:1")
    )
    assert resolved.digest == index.images["linux/arm64"].manifest_digest


def test_not_found(registry: LocalRegistry) -> None:
    client = RegistryClient()
    for text, what in [
        (f"{registry.host}/{REPO}:nope", "manifest nope not found"),
        (f"{registry.host}/team/missing:1", "manifest 1 not found"),
    ]:
        with pytest.raises(RegistryError, match=what) as caught:
            client.resolve(parse_reference(text))
        assert caught.value.kind == "not_found"
        assert registry.host in str(caught.value)
    ref = parse_reference(f"{registry.host}/{REPO}:1")
    missing = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", sha256_digest(b"nothing"), 7)
    with pytest.raises(RegistryError, match="BLOB_UNKNOWN") as caught:
        client.fetch_blob(ref, missing)
    assert caught.value.kind == "not_found"


# -- basic auth ------------------------------------------------------------------------------------


def test_basic_auth(basic_registry: LocalRegistry, images: Images) -> None:
    ref_text = f"{basic_registry.host}/{REPO}:1"
    client = RegistryClient()
    _assert_same_image(client, ref_text, images.busybox, Credentials("alice", "secret"))

    with pytest.raises(RegistryError, match="refused user 'alice'") as caught:
        client.resolve(parse_reference(ref_text), Credentials("alice", "wrong"))
    assert caught.value.kind == "unauthorized"

    with pytest.raises(RegistryError, match="requires a username and password") as caught:
        RegistryClient().resolve(parse_reference(ref_text))
    assert caught.value.kind == "unauthorized"


def test_credentials_from_an_api_message(basic_registry: LocalRegistry) -> None:
    @dataclass
    class RegistryAuth:  # the shape of the proto message
        username: str = ""
        password: str = ""
        registry_token: str = ""
        identity_token: str = ""

    assert Credentials.from_auth(RegistryAuth()) is None
    creds = Credentials.from_auth(RegistryAuth("alice", "secret"))
    assert creds == Credentials("alice", "secret")
    assert "secret" not in repr(creds)
    RegistryClient().resolve(parse_reference(f"{basic_registry.host}/{REPO}:1"), creds)


def test_docker_config_credentials(
    basic_registry: LocalRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ref = parse_reference(f"{basic_registry.host}/{REPO}:1")
    config = tmp_path / "config.json"
    auth = base64.b64encode(b"alice:secret").decode()
    config.write_text(
        json.dumps(
            {
                "auths": {f"http://{basic_registry.host}/v1/": {"auth": auth}},
                "credHelpers": {"gcr.io": "gcloud"},
            }
        )
    )
    with caplog.at_level(logging.INFO, logger="auraed.images.registry"):
        RegistryClient(docker_config=config).resolve(ref)
    assert "credential helpers are not run" in caplog.text

    # Explicit credentials win over the file.
    basic_registry.docker_config(config, password="wrong")
    client = RegistryClient(docker_config=config)
    with pytest.raises(RegistryError, match="refused") as caught:
        client.resolve(ref)
    assert caught.value.kind == "unauthorized"
    client.resolve(ref, Credentials("alice", "secret"))

    # The file is re-read when it changes (a `docker login` while the daemon runs).
    time.sleep(0.01)
    basic_registry.docker_config(config)
    client.resolve(ref)


def test_docker_config_from_environment(
    basic_registry: LocalRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    basic_registry.docker_config(tmp_path / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    RegistryClient().resolve(parse_reference(f"{basic_registry.host}/{REPO}:1"))


# -- bearer tokens ---------------------------------------------------------------------------------


def test_bearer_token_auth(token_registry: LocalRegistry, images: Images) -> None:
    assert token_registry.token_server is not None
    ref_text = f"{token_registry.host}/{REPO}:1"
    client = RegistryClient()
    _assert_same_image(client, ref_text, images.busybox, Credentials("alice", "secret"))
    fetched = [r for r in token_registry.token_server.requests if r.scopes == [f"repository:{REPO}:pull"]]
    assert len(fetched) == 1  # one token, cached for the manifest and every blob
    assert fetched[0].user == "alice"

    with pytest.raises(RegistryError, match="token service refused user 'alice'") as caught:
        RegistryClient().resolve(parse_reference(ref_text), Credentials("alice", "wrong"))
    assert caught.value.kind == "unauthorized"

    with pytest.raises(RegistryError, match="anonymous access") as caught:
        RegistryClient().resolve(parse_reference(ref_text))
    assert caught.value.kind == "unauthorized"


def test_bearer_docker_config(token_registry: LocalRegistry, tmp_path: Path) -> None:
    config = token_registry.docker_config(tmp_path / "config.json")
    RegistryClient(docker_config=config).resolve(parse_reference(f"{token_registry.host}/{REPO}:1"))


def test_anonymous_token_for_public_pulls(images: Images) -> None:
    with LocalRegistry(mode="token", anonymous_pull=True) as local:
        push_layout(images.busybox, f"{local.host}/{REPO}:1", creds=local.creds)
        _assert_same_image(RegistryClient(), f"{local.host}/{REPO}:1", images.busybox)
        assert local.token_server is not None
        assert any(r.user is None and r.status == 200 for r in local.token_server.requests)


def test_identity_and_registry_tokens(token_registry: LocalRegistry) -> None:
    server = token_registry.token_server
    assert server is not None
    ref = parse_reference(f"{token_registry.host}/{REPO}:1")
    server.refresh_tokens["refresh-123"] = "alice"
    RegistryClient().resolve(ref, Credentials(identity_token="refresh-123"))
    assert server.requests[-1].grant_type == "refresh_token" and server.requests[-1].method == "POST"

    with pytest.raises(RegistryError, match="token service refused") as caught:
        RegistryClient().resolve(ref, Credentials(identity_token="revoked"))
    assert caught.value.kind == "unauthorized"

    seen = len(server.requests)
    token = server.issue("alice", [f"repository:{REPO}:pull"])
    RegistryClient().resolve(ref, Credentials(registry_token=token))
    assert len(server.requests) == seen  # used as is, never exchanged


@pytest.mark.slow
def test_expired_token_is_refreshed_once(token_registry: LocalRegistry) -> None:
    server = token_registry.token_server
    assert server is not None
    # Tokens the registry accepts for ~3 s (it allows 60 s of leeway past exp) but that the
    # token service says last 5 minutes: the client keeps one until the registry refuses it.
    server.token_lifetime = -57
    server.advertised_expires_in = 300
    client = RegistryClient()
    creds = Credentials("alice", "secret")
    ref = parse_reference(f"{token_registry.host}/{REPO}:1")
    resolved = client.resolve(ref, creds)
    before = len(server.requests)
    time.sleep(3.5)
    data = b"".join(client.fetch_blob(ref, resolved.layers[0], creds))
    assert sha256_digest(data) == resolved.layers[0].digest
    assert len(server.requests) == before + 1  # refreshed exactly once


def test_refused_fresh_token_is_not_retried_forever(token_registry: LocalRegistry) -> None:
    server = token_registry.token_server
    assert server is not None
    server.token_lifetime = -120  # every token is expired on arrival
    started = time.monotonic()
    before = len(server.requests)
    with pytest.raises(RegistryError, match="not authorized") as caught:
        RegistryClient().resolve(
            parse_reference(f"{token_registry.host}/{REPO}:1"), Credentials("alice", "secret")
        )
    assert caught.value.kind == "unauthorized"
    assert len(server.requests) == before + 1
    assert time.monotonic() - started < 2


# -- mirrors ---------------------------------------------------------------------------------------


def test_mirror_serves_an_upstream_name(registry: LocalRegistry, images: Images) -> None:
    hosts = {"registry.k8s.io": RegistryHostConfig("registry.k8s.io", mirrors=[registry.url])}
    client = RegistryClient(hosts)
    ref = parse_reference("registry.k8s.io/pause:3.9")
    resolved = client.resolve(ref)
    assert resolved.digest == images.busybox.manifest_digest
    assert resolved.endpoint == registry.url
    data = b"".join(client.fetch_blob(ref, resolved.layers[0]))
    assert data == images.busybox.blob(images.busybox.layers[0].digest)


def test_mirrors_in_order_then_upstream(registry: LocalRegistry, images: Images) -> None:
    down = f"127.0.0.1:{free_port()}"
    # A dead mirror, then a scheme-less one (http because insecure), for an upstream that is down.
    config = RegistryHostConfig(
        down, mirrors=[f"http://127.0.0.1:{free_port()}", registry.host], insecure=True
    )
    client = RegistryClient([config])
    started = time.monotonic()
    resolved = client.resolve(parse_reference(f"{down}/pause:3.9"))
    assert resolved.endpoint == registry.url
    assert time.monotonic() - started < 3

    # Nobody has it: the error names every endpoint; the kind is the upstream's.
    with pytest.raises(RegistryError) as caught:
        client.resolve(parse_reference(f"{down}/pause:nope"))
    message = str(caught.value)
    assert caught.value.kind == "unavailable"
    assert "every endpoint failed" in message and "not found" in message and "Connection refused" in message
    assert f"mirror {registry.url}" in message


def test_explicit_credentials_are_not_sent_to_mirrors(basic_registry: LocalRegistry, tmp_path: Path) -> None:
    down = f"127.0.0.1:{free_port()}"
    hosts = [RegistryHostConfig(down, mirrors=[basic_registry.url], insecure=True)]
    ref = parse_reference(f"{down}/{REPO}:1")
    with pytest.raises(RegistryError, match="requires a username and password"):
        RegistryClient(hosts).resolve(ref, Credentials("alice", "secret"))
    # A mirror authenticates with the config.json entry for its own host.
    config = basic_registry.docker_config(tmp_path / "config.json")
    assert RegistryClient(hosts, docker_config=config).resolve(ref).endpoint == basic_registry.url


def test_corrupt_mirror_falls_back_to_upstream(registry: LocalRegistry, images: Images) -> None:
    manifest = images.busybox.manifest
    headers = {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": sha256_digest(b"other")}
    routes = {("GET", "/v2/pause/manifests/3.9"): FakeResponse(200, manifest, headers)}
    with FakeRegistry(routes) as mirror:
        client = RegistryClient([RegistryHostConfig(registry.host, mirrors=[mirror.url], insecure=True)])
        resolved = client.resolve(parse_reference(f"{registry.host}/pause:3.9"))
    assert resolved.endpoint == registry.url


# -- failures: bounded and classified --------------------------------------------------------------


def test_registry_down_is_unavailable_fast() -> None:
    started = time.monotonic()
    with pytest.raises(RegistryError) as caught:
        RegistryClient().resolve(parse_reference(f"127.0.0.1:{free_port()}/{REPO}:1"))
    elapsed = time.monotonic() - started
    assert caught.value.kind == "unavailable"
    assert "Connection refused" in str(caught.value) and REPO in str(caught.value)
    assert elapsed < 10
    assert elapsed < 2  # one retry, 0.2 s apart


def test_hung_registry_times_out_without_retrying() -> None:
    with silent_port() as port:
        started = time.monotonic()
        with pytest.raises(RegistryError, match="did not answer within 1s") as caught:
            RegistryClient(timeout=1.0).resolve(parse_reference(f"127.0.0.1:{port}/{REPO}:1"))
        assert caught.value.kind == "unavailable"
        assert time.monotonic() - started < 3


MANIFEST_PATH = f"/v2/{REPO}/manifests/1"


@pytest.mark.parametrize(
    ("response", "kind", "problem"),
    [
        (FakeResponse(200, b"{not json", {"Content-Type": OCI_MANIFEST}), "invalid", "not JSON"),
        (FakeResponse(200, b"[1, 2]", {"Content-Type": OCI_MANIFEST}), "invalid", "not a JSON object"),
        (
            FakeResponse(200, b'{"schemaVersion": 2, "mediaType": "application/x-foo"}', {}),
            "unsupported",
            "unsupported media type 'application/x-foo'",
        ),
        (
            FakeResponse(200, b'{"schemaVersion": 1, "name": "x", "fsLayers": []}', {}),
            "unsupported",
            "schema 1",
        ),
        (FakeResponse(200, b"[" * 200_000, {"Content-Type": OCI_MANIFEST}), "invalid", "not JSON"),
        (
            FakeResponse(
                200, b'{"schemaVersion": 2, "mediaType": "' + OCI_MANIFEST.encode() + b'", "layers": []}', {}
            ),
            "invalid",
            "config: not a descriptor",
        ),
        (FakeResponse(500, b"oops", {}), "unavailable", "HTTP 500"),
        (FakeResponse(429, b"slow down", {}), "unavailable", "HTTP 429"),
        (
            FakeResponse(400, b'{"errors":[{"code":"NAME_INVALID","message":"bad"}]}', {}),
            "invalid",
            "NAME_INVALID",
        ),
        (FakeResponse(403, b"", {}), "unauthorized", "access denied"),
        (FakeResponse(401, b"", {}), "unauthorized", "without an authentication challenge"),
        (FakeResponse(401, b"", {"WWW-Authenticate": 'Negotiate realm="x"'}), "unauthorized", "unsupported"),
        (FakeResponse(200, b"{}" * (3 << 20), {}), "invalid", "larger than"),
    ],
)
def test_broken_manifests(response: FakeResponse, kind: str, problem: str) -> None:
    with FakeRegistry({("GET", MANIFEST_PATH): response}) as fake:
        with pytest.raises(RegistryError, match=problem) as caught:
            RegistryClient().resolve(parse_reference(f"{fake.host}/{REPO}:1"))
        assert caught.value.kind == kind
        assert fake.host in str(caught.value) and REPO in str(caught.value)


def _artifact_manifest(config_type: str) -> bytes:
    return canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": config_type, "digest": sha256_digest(b"{}"), "size": 2},
            "layers": [],
        }
    )


def test_an_artifact_is_unsupported_and_digest_mismatches_are_invalid(images: Images) -> None:
    manifest = images.busybox.manifest
    wrong_digest = sha256_digest(b"something else")
    routes = {
        ("GET", MANIFEST_PATH): FakeResponse(
            200, _artifact_manifest("application/vnd.cncf.helm.config.v1+json")
        ),
        ("GET", f"/v2/{REPO}/manifests/lying"): FakeResponse(
            200, manifest, {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": wrong_digest}
        ),
        ("GET", f"/v2/{REPO}/manifests/{wrong_digest}"): FakeResponse(
            200, manifest, {"Content-Type": OCI_MANIFEST}
        ),
    }
    client = RegistryClient()
    with FakeRegistry(routes) as fake:
        for text, problem, kind in [
            (f"{fake.host}/{REPO}:1", "not a container image config", "unsupported"),
            (f"{fake.host}/{REPO}:lying", "Docker-Content-Digest", "invalid"),
            (f"{fake.host}/{REPO}@{wrong_digest}", "digest mismatch", "invalid"),
        ]:
            with pytest.raises(RegistryError, match=problem) as caught:
                client.resolve(parse_reference(text))
            assert caught.value.kind == kind


def _blob_registry(served: bytes, declared: bytes, send_length: bool = True) -> FakeRegistry:
    digest = sha256_digest(declared)
    routes = {("GET", f"/v2/{REPO}/blobs/{digest}"): FakeResponse(200, served, {}, send_length)}
    return FakeRegistry(routes)


def _layer(data: bytes) -> Descriptor:
    return Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", sha256_digest(data), len(data))


def test_corrupt_blob_is_never_handed_out_whole() -> None:
    good = bytes(range(256)) * 64  # 16 KiB
    bad = good[:-1] + b"\x00"
    with _blob_registry(bad, good) as fake:
        ref = parse_reference(f"{fake.host}/{REPO}:1")
        received = bytearray()
        with pytest.raises(RegistryError, match="digest mismatch") as caught:
            for chunk in RegistryClient().fetch_blob(ref, _layer(good), chunk_size=1024):
                received += chunk
        assert caught.value.kind == "invalid"
        assert len(received) < len(bad)  # the last chunk was held back
        with pytest.raises(RegistryError, match="digest mismatch"):
            RegistryClient().fetch_blob_bytes(ref, _layer(good))


def test_blob_size_mismatches() -> None:
    data = b"x" * 5000
    # Longer than declared, said up front by Content-Length.
    with _blob_registry(data + b"more", data) as fake:
        with pytest.raises(RegistryError, match="Content-Length 5004") as caught:
            RegistryClient().fetch_blob(parse_reference(f"{fake.host}/{REPO}:1"), _layer(data))
        assert caught.value.kind == "invalid"
    # The stream sends more than declared (no Content-Length): fails at once, before the extra.
    with _blob_registry(data + b"more", data, send_length=False) as fake:
        received = bytearray()
        with pytest.raises(RegistryError, match="more than the 5000 bytes") as caught:
            for chunk in RegistryClient().fetch_blob(
                parse_reference(f"{fake.host}/{REPO}:1"), _layer(data), None, 1000
            ):
                received += chunk
        assert len(received) < len(data)
    # The connection closes before Content-Length bytes arrived.
    routes = {
        ("GET", f"/v2/{REPO}/blobs/{sha256_digest(data)}"): FakeResponse(
            200, data[:3000], {"Content-Length": "5000"}
        )
    }
    with FakeRegistry(routes) as fake, pytest.raises(RegistryError, match="broke off after") as caught:
        RegistryClient().fetch_blob_bytes(parse_reference(f"{fake.host}/{REPO}:1"), _layer(data))
    assert caught.value.kind == "unavailable"
    # The descriptor is bigger than the blob.
    short = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", sha256_digest(data), 6000)
    with (
        _blob_registry(data, data, send_length=False) as fake,
        pytest.raises(RegistryError, match="size mismatch: got 5000 bytes"),
    ):
        RegistryClient().fetch_blob_bytes(parse_reference(f"{fake.host}/{REPO}:1"), short)


@pytest.mark.parametrize("status", [500, 404, 401])
def test_an_endless_error_answer_is_read_only_in_part(status: int) -> None:
    """A hostile registry's error body never ends: only its start is read, for the message."""
    endless = FakeResponse(status, b'{"errors": [' * 4096, endless=True)
    with FakeRegistry({("GET", MANIFEST_PATH): endless}) as fake:
        started = time.monotonic()
        with pytest.raises(RegistryError) as caught:
            RegistryClient().resolve(parse_reference(f"{fake.host}/{REPO}:1"))
        assert time.monotonic() - started < 5
        assert f"HTTP {status}" in str(caught.value)
        assert fake.sent[MANIFEST_PATH] < 64 << 20  # what the socket buffers took before the hang-up


def _bearer_challenge(realm: str) -> dict[str, str]:
    return {"WWW-Authenticate": f'Bearer realm="{realm}",service="fake"'}


def test_bearer_is_answered_when_basic_is_offered_too() -> None:
    """A registry may send one challenge per scheme; without a password only Bearer can work."""
    with FakeRegistry() as tokens:
        tokens.routes[("GET", "/token")] = FakeResponse(200, b'{"token": "anonymous"}')

        def manifest(method: str, path: str, headers: Mapping[str, str]) -> FakeResponse | None:
            if path != MANIFEST_PATH or headers.get("Authorization") == "Bearer anonymous":
                return None  # the route: not found, which says the token was taken
            challenges = ['Basic realm="fake"', *_bearer_challenge(f"{tokens.url}/token").values()]
            return FakeResponse(401, b"", {"WWW-Authenticate": challenges})

        with FakeRegistry(handler=manifest) as fake:
            with pytest.raises(RegistryError, match="not found") as caught:
                RegistryClient().resolve(parse_reference(f"{fake.host}/{REPO}:1"))
            assert caught.value.kind == "not_found"
        assert [seen.path for seen in tokens.requests] == ["/token"]


def test_an_endless_or_failing_token_service_is_the_registry_failing() -> None:
    with FakeRegistry() as tokens:
        routes = {("GET", MANIFEST_PATH): FakeResponse(401, b"", _bearer_challenge(f"{tokens.url}/token"))}
        with FakeRegistry(routes) as fake:
            reference = parse_reference(f"{fake.host}/{REPO}:1")
            tokens.routes[("GET", "/token")] = FakeResponse(200, b'{"token": "' * 4096, endless=True)
            with pytest.raises(RegistryError, match="larger than") as caught:
                RegistryClient().resolve(reference)
            assert caught.value.kind == "invalid"
            # A 404 from the token service is not the image missing (NOT_FOUND): the service failed.
            tokens.routes[("GET", "/token")] = FakeResponse(404, b"no such service")
            with pytest.raises(RegistryError, match="HTTP 404") as caught:
                RegistryClient().resolve(reference)
            assert caught.value.kind == "unavailable"


def test_credentials_never_follow_a_redirect_to_the_host_it_names() -> None:
    """The registry redirects a blob to storage that challenges: its token service must not get
    the user's password (requests drops Authorization on the redirect; the challenge is ours)."""
    data = b"layer bytes"
    layer = _layer(data)
    with FakeRegistry() as storage:
        storage.routes[("GET", "/storage/blob")] = FakeResponse(
            401, b"", _bearer_challenge(f"{storage.url}/token")
        )
        storage.routes[("GET", "/token")] = FakeResponse(200, b'{"token": "t"}')
        redirect = FakeResponse(307, b"", {"Location": f"{storage.url}/storage/blob"})
        with (
            FakeRegistry({("GET", f"/v2/{REPO}/blobs/{layer.digest}"): redirect}) as fake,
            pytest.raises(RegistryError, match="redirected the request") as caught,
        ):
            RegistryClient().fetch_blob(
                parse_reference(f"{fake.host}/{REPO}:1"), layer, Credentials("alice", "s3cret")
            )
        assert caught.value.kind == "unauthorized"
        assert [seen.path for seen in storage.requests] == ["/storage/blob"]
        assert "Authorization" not in storage.requests[0].headers


@pytest.mark.parametrize(
    "location", ["http://[zz]/x", "http://" + "a" * 64 + ".example/x", "http://127.0.0.1:99999/x"]
)
def test_a_redirect_to_nowhere_is_the_registry_failing(location: str) -> None:
    """urllib3 and the standard library raise their own errors for these, not requests': each is
    still an answer from the registry that cannot be followed."""
    with FakeRegistry({("GET", MANIFEST_PATH): FakeResponse(302, b"", {"Location": location})}) as fake:
        with pytest.raises(RegistryError, match="request to") as caught:
            RegistryClient().resolve(parse_reference(f"{fake.host}/{REPO}:1"))
        assert caught.value.kind == "unavailable"


def test_redirect_loops_and_slow_drips_are_cut_short() -> None:
    loop = FakeResponse(302, b"", {"Location": MANIFEST_PATH})
    with FakeRegistry({("GET", MANIFEST_PATH): loop}) as fake:
        with pytest.raises(RegistryError, match="redirects") as caught:
            RegistryClient().resolve(parse_reference(f"{fake.host}/{REPO}:1"))
        assert caught.value.kind == "unavailable"
        assert len(fake.requests) <= 1 + 5 + 1  # /v2/ is not asked; at most the redirect limit
    # A byte now and then keeps each read within the timeout, but not the whole answer.
    drip = FakeResponse(200, b" " * (12 * PACE_CHUNK), {"Content-Type": OCI_MANIFEST}, pace_s=0.4)
    with FakeRegistry({("GET", MANIFEST_PATH): drip}) as fake:
        started = time.monotonic()
        with pytest.raises(RegistryError, match="not received within 1s") as caught:
            RegistryClient(timeout=1.0).resolve(parse_reference(f"{fake.host}/{REPO}:1"))
        assert caught.value.kind == "unavailable"
        assert time.monotonic() - started < 3.0  # the whole answer would take 4.8 s


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiPaths:
    """A CA and a server certificate for 127.0.0.1: an HTTPS registry on loopback."""
    return ensure_dev_pki(tmp_path_factory.mktemp("pki"))


def test_an_https_registry_is_verified_against_its_configured_ca(pki: PkiPaths) -> None:
    with FakeRegistry(tls=pki) as fake:
        reference = parse_reference(f"{fake.host}/{REPO}:1")

        def client(**settings: Any) -> RegistryClient:
            return RegistryClient([RegistryHostConfig(fake.host, **settings)])

        # Verified with the CA given: the request got through (the fake knows no such image).
        with pytest.raises(RegistryError, match="not found") as caught:
            client(ca_file=pki.ca_crt).resolve(reference)
        assert caught.value.kind == "not_found"
        with pytest.raises(RegistryError, match="TLS with") as caught:
            client().resolve(reference)  # the system's CAs do not know ours
        assert caught.value.kind == "unavailable"
        with pytest.raises(RegistryError, match="not found"):
            client(skip_verify=True).resolve(reference)


def test_credentials_are_not_sent_in_the_clear_to_an_https_registrys_token_service(pki: PkiPaths) -> None:
    """An HTTPS registry whose challenge names a plain-HTTP token service on another host: the
    password would cross the network in the clear. Refused before any request is made. (0.0.0.0
    is not a loopback address to the check, yet a connection to it stays on this machine.)"""
    challenge = {"WWW-Authenticate": 'Bearer realm="http://0.0.0.0:1/token",service="fake"'}
    with FakeRegistry({("GET", MANIFEST_PATH): FakeResponse(401, b"", challenge)}, tls=pki) as fake:
        client = RegistryClient([RegistryHostConfig(fake.host, ca_file=pki.ca_crt)])
        with pytest.raises(RegistryError, match="plain HTTP; credentials are not sent") as caught:
            client.resolve(parse_reference(f"{fake.host}/{REPO}:1"), Credentials("alice", "s3cret"))
        assert caught.value.kind == "unauthorized"


def test_config_limit(registry: LocalRegistry) -> None:
    big = Descriptor(OCI_CONFIG, sha256_digest(b"x"), 100 << 20)
    with pytest.raises(RegistryError, match="over the") as caught:
        RegistryClient().fetch_blob_bytes(parse_reference(f"{registry.host}/{REPO}:1"), big)
    assert caught.value.kind == "invalid"


def test_registries_leave_nothing_behind(images: Images) -> None:
    local = LocalRegistry(mode="token")
    with local:
        workdir = local.workdir
        assert workdir is not None and workdir.exists()
        pid = local.process.pid if local.process else -1
        assert pid in processes_running()
    assert not workdir.exists()
    assert pid not in processes_running()
    assert local.token_server is None
