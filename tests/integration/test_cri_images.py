"""The CRI ImageService on the kubelet's socket, as cri-tools' critest checks it.

critest's images keep their original names (registry.k8s.io/..., gcr.io/...): the daemon has a
local registry as the mirror of both, and the images are built here and pushed to it. Names that
are not mirrored (missing images, private registries) are pulled from a loopback registry by its
own address, so no test ever reaches a registry beyond this machine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import betterproto2
import pytest

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient, ClientError
from auraed.references import parse_reference
from tests.conftest import DaemonFactory, DaemonProcess
from tests.support.cri import (
    BUSYBOX_IMAGE,
    DIFFERENT_TAG_DIFFERENT_IMAGE,
    DIFFERENT_TAG_SAME_IMAGE,
    IMAGE_SERVICE,
    IMAGE_WITH_ALL_REFERENCES,
    IMAGE_WITH_TAG,
    IMAGE_WITHOUT_TAG,
    USER_IMAGES,
    CritestImages,
    cri_client,
    image_fs_info,
    image_spec,
    image_status,
    image_status_response,
    list_images,
    mirrors_config,
    publish_critest_images,
    pull_image,
    remove_image,
    remove_image_by_id,
    stream_images,
)
from tests.support.images import BuiltImage, push_layout
from tests.support.registry import LocalRegistry

# critest's PullImage sandbox config for image specs: labels only, no metadata.
IMAGE_POD = cri.PodSandboxConfig(labels={})
SECOND_REGISTRY_PATH = "e2e-test-images/busybox:1.29-2"
# ImageStatus of each user image, as critest expects it: (uid or None, username).
EXPECTED_USERS = {
    "test-image-user-uid": (1002, ""),
    "test-image-user-username": (None, "www-data"),
    "test-image-user-uid-group": (1003, ""),
    "test-image-user-username-group": (None, "www-data"),
}


@pytest.fixture(scope="module")
def mirror() -> Iterator[LocalRegistry]:
    with LocalRegistry() as registry:
        yield registry


@pytest.fixture(scope="module")
def critest_images(mirror: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> CritestImages:
    return publish_critest_images(mirror, tmp_path_factory.mktemp("critest-images"))


@pytest.fixture(scope="module")
def second_registry(busybox_layout: BuiltImage) -> Iterator[LocalRegistry]:
    """Another registry serving critest's busybox image, by its own address."""
    with LocalRegistry() as registry:
        push_layout(busybox_layout, f"{registry.host}/{SECOND_REGISTRY_PATH}")
        yield registry


@pytest.fixture
def cri_daemon(
    daemon_factory: DaemonFactory, mirror: LocalRegistry, critest_images: CritestImages
) -> DaemonProcess:
    return daemon_factory(config_text=mirrors_config(mirror))


@pytest.fixture
async def client(cri_daemon: DaemonProcess) -> AsyncIterator[AuraeClient]:
    async with cri_client(cri_daemon) as c:
        yield c


async def cri_error(call: Awaitable[object]) -> ClientError:
    with pytest.raises(ClientError) as error:
        await call
    return error.value


async def test_pull_by_tag_status_and_remove(client: AuraeClient, critest_images: CritestImages) -> None:
    published = critest_images[IMAGE_WITH_TAG]
    assert await image_status(client, IMAGE_WITH_TAG) is None
    ref = await pull_image(client, IMAGE_WITH_TAG, sandbox_config=IMAGE_POD)
    assert ref == published.id  # image_ref is the image id, the config digest
    status = await image_status(client, IMAGE_WITH_TAG)
    assert status is not None
    assert status.id == ref
    assert status.repo_tags == [IMAGE_WITH_TAG]  # fully qualified, no docker.io normalisation
    assert status.repo_digests == [f"gcr.io/k8s-staging-cri-tools/test-image-tag@{published.digest}"]
    assert status.size > 0
    assert status.uid is None and status.username == ""  # no USER: the runtime's default
    assert [image.id for image in await list_images(client)] == [ref]
    await remove_image(client, status.id)
    assert await image_status(client, IMAGE_WITH_TAG) is None
    assert await list_images(client) == []


async def test_untagged_name_is_latest(client: AuraeClient, critest_images: CritestImages) -> None:
    tagged = f"{IMAGE_WITHOUT_TAG}:latest"
    # critest pulls the tagged name with the pod config; a kubelet may give neither.
    ref = await pull_image(client, tagged, sandbox_config=IMAGE_POD)
    assert await pull_image(client, IMAGE_WITHOUT_TAG) == ref
    status = await image_status(client, IMAGE_WITHOUT_TAG)
    assert status is not None and status.id == ref == critest_images[tagged].id
    assert status.repo_tags == [tagged]
    await remove_image(client, IMAGE_WITHOUT_TAG)
    assert await image_status(client, tagged) is None


async def test_pull_by_index_digest_reports_that_digest(
    client: AuraeClient, critest_images: CritestImages
) -> None:
    name = critest_images.by_digest
    ref = await pull_image(client, name, sandbox_config=IMAGE_POD)
    assert ref == critest_images[name].id  # the linux/amd64 image of the index
    status = await image_status(client, name)
    assert status is not None and status.id == ref
    assert status.repo_tags == []
    assert status.repo_digests == [name]  # the index digest pulled by, not the platform's manifest
    assert await image_status(client, ref) == status
    await remove_image_by_id(client, name)
    assert await image_status(client, name) is None


async def test_status_is_the_same_by_every_reference(
    client: AuraeClient, critest_images: CritestImages
) -> None:
    name = IMAGE_WITH_ALL_REFERENCES
    published = critest_images[name]
    await pull_image(client, name, sandbox_config=IMAGE_POD)
    status = await image_status(client, name)
    assert status is not None
    # A tag naming an index: the repo digest is the index's, as docker and containerd report it.
    assert status.repo_digests == [f"gcr.io/k8s-staging-cri-tools/test-image-tag@{published.digest}"]
    names = [status.id, status.id.removeprefix("sha256:"), *status.repo_tags, *status.repo_digests]
    for other in names:
        assert await image_status(client, other) == status, other
    verbose = await image_status_response(client, name, verbose=True)
    assert verbose.image == status
    info = json.loads(verbose.info["info"])
    assert (info["os"], info["architecture"]) == ("linux", "amd64")
    assert info["manifestDigest"] != published.digest  # the platform's manifest, chosen from the index
    await remove_image(client, status.id)
    for other in names:
        assert await image_status(client, other) is None, other


async def test_uid_and_username_from_the_image_user(
    client: AuraeClient, critest_images: CritestImages
) -> None:
    for name, user in USER_IMAGES.items():
        await pull_image(client, f"{name}:latest", sandbox_config=IMAGE_POD)
        status = await image_status(client, name)
        assert status is not None, name
        uid, username = EXPECTED_USERS[name.rpartition("/")[2]]
        assert (status.uid.value if status.uid else None, status.username) == (uid, username), user
        await remove_image_by_id(client, name)


async def test_list_three_images_and_three_tags_of_one(
    client: AuraeClient, critest_images: CritestImages
) -> None:
    refs = [
        await pull_image(client, name, sandbox_config=IMAGE_POD) for name in DIFFERENT_TAG_DIFFERENT_IMAGE
    ]
    assert len(set(refs)) == 3
    listed = {image.id: image for image in await list_images(client)}
    for name, ref in zip(DIFFERENT_TAG_DIFFERENT_IMAGE, refs, strict=True):
        assert listed[ref].repo_tags == [name]
        assert await list_images(client, name) == [listed[ref]]  # the filter, by name
        assert await list_images(client, ref) == [listed[ref]]  # and by id

    same = {await pull_image(client, name, sandbox_config=IMAGE_POD) for name in DIFFERENT_TAG_SAME_IMAGE}
    assert same == {critest_images[DIFFERENT_TAG_SAME_IMAGE[0]].id}
    (image_id,) = same
    listed = {image.id: image for image in await list_images(client)}
    assert sorted(listed[image_id].repo_tags) == sorted(DIFFERENT_TAG_SAME_IMAGE)
    index_digest = critest_images[DIFFERENT_TAG_SAME_IMAGE[0]].digest
    assert listed[image_id].repo_digests == [f"gcr.io/k8s-staging-cri-tools/test-image-tags@{index_digest}"]
    assert len(listed) == 4
    streamed = await stream_images(client)
    assert {image.id: image for image in streamed} == listed and len(streamed) == 4
    assert await stream_images(client, DIFFERENT_TAG_SAME_IMAGE[1]) == [listed[image_id]]
    assert await list_images(client, "gcr.io/k8s-staging-cri-tools/test-image-tags:4") == []

    await remove_image_by_id(client, DIFFERENT_TAG_SAME_IMAGE[0])  # removing by one tag: all go
    for name in (*DIFFERENT_TAG_SAME_IMAGE, image_id):
        assert await image_status(client, name) is None, name
    for name in DIFFERENT_TAG_DIFFERENT_IMAGE:
        await remove_image(client, name)  # by tag
    assert await list_images(client) == []


async def test_one_image_in_two_registries(
    client: AuraeClient, critest_images: CritestImages, second_registry: LocalRegistry
) -> None:
    first, second = BUSYBOX_IMAGE, f"{second_registry.host}/{SECOND_REGISTRY_PATH}"
    refs = [await pull_image(client, name, sandbox_config=IMAGE_POD) for name in (first, second)]
    assert refs[0] == refs[1] == critest_images[first].id
    (image,) = await list_images(client)
    assert sorted(image.repo_tags) == sorted([first, second])
    digest = critest_images[first].digest
    assert sorted(image.repo_digests) == sorted(
        [
            f"registry.k8s.io/e2e-test-images/busybox@{digest}",
            f"{parse_reference(second).repository_name}@{digest}",
        ]
    )
    assert await image_status(client, second) == await image_status(client, first) == image
    await remove_image_by_id(client, first)
    for name in (first, second, image.id):
        assert await image_status(client, name) is None, name


async def test_removal_is_idempotent_and_absent_images_are_unset(client: AuraeClient) -> None:
    zeros = "0" * 64  # critest's id of an image that does not exist: 64 hex digits, no sha256:
    for name in (zeros, zeros, f"sha256:{zeros}", IMAGE_WITH_TAG, "gcr.io/k8s-staging-cri-tools/never:1"):
        await remove_image(client, name)
        response = await image_status_response(client, name)
        assert response.image is None and response.info == {}


async def test_concurrent_removes_all_succeed(client: AuraeClient) -> None:
    image_id = await pull_image(client, IMAGE_WITH_TAG, sandbox_config=IMAGE_POD)

    async def remove_then_status() -> cri.Image | None:
        await remove_image(client, image_id)
        return await image_status(client, image_id)

    assert await asyncio.gather(*(remove_then_status() for _ in range(5))) == [None] * 5
    assert await list_images(client) == []
    # Nothing of it is left behind: pulling again fetches it whole and works.
    assert await pull_image(client, IMAGE_WITH_TAG) == image_id
    await remove_image(client, image_id)


async def test_pull_past_its_deadline_is_deadline_exceeded(client: AuraeClient) -> None:
    # critest: a 1 ms deadline, no auth, no sandbox config; nothing may answer sooner with another code.
    error = await cri_error(pull_image(client, IMAGE_WITH_TAG, timeout=0.001))
    assert error.code == "DEADLINE_EXCEEDED", error
    image_id = await pull_image(client, IMAGE_WITH_TAG)  # the abandoned pull left nothing in the way
    assert [image.id for image in await list_images(client)] == [image_id]
    await remove_image(client, image_id)


async def test_bad_input_names_the_field(client: AuraeClient, mirror: LocalRegistry) -> None:
    async def invalid(method: str, request: betterproto2.Message, field: str) -> None:
        error = await cri_error(client.call(IMAGE_SERVICE, method, request))
        assert error.code == "INVALID_ARGUMENT", (method, error)
        assert error.message.startswith(f"{field}:"), (method, error.message)

    for spec in (None, image_spec("")):
        await invalid("PullImage", cri.PullImageRequest(image=spec), "image.image")
        await invalid("ImageStatus", cri.ImageStatusRequest(image=spec), "image.image")
        await invalid("RemoveImage", cri.RemoveImageRequest(image=spec), "image.image")
    for garbage in ("Not A::Reference", "UPPER/case:1", "busybox@sha256:abc", "x" * 5000):
        await invalid("PullImage", cri.PullImageRequest(image=image_spec(garbage)), "image.image")
        await invalid("ImageStatus", cri.ImageStatusRequest(image=image_spec(garbage)), "image.image")
        await invalid("RemoveImage", cri.RemoveImageRequest(image=image_spec(garbage)), "image.image")
        listing = cri.ListImagesRequest(filter=cri.ImageFilter(image=image_spec(garbage)))
        await invalid("ListImages", listing, "filter.image.image")
    # An image id is found locally but is no name to pull by.
    await invalid("PullImage", cri.PullImageRequest(image=image_spec("0" * 64)), "image.image")
    not_base64 = cri.PullImageRequest(
        image=image_spec(f"{mirror.host}/team/app:1"), auth=cri.AuthConfig(auth="not base64!")
    )
    await invalid("PullImage", not_base64, "auth.auth")
    assert await list_images(client) == []


async def test_missing_image_is_not_found(client: AuraeClient, mirror: LocalRegistry) -> None:
    for name in (f"{mirror.host}/k8s-staging-cri-tools/absent:1", f"{mirror.host}/e2e-test-images/busybox:0"):
        error = await cri_error(pull_image(client, name))
        assert error.code == "NOT_FOUND", error
        repository = name.removeprefix(f"{mirror.host}/").rpartition(":")[0]
        assert repository in error.message and mirror.host in error.message, error.message
    assert await list_images(client) == []


async def test_auth_from_the_request(daemon_factory: DaemonFactory, busybox_layout: BuiltImage) -> None:
    with LocalRegistry(mode="basic") as private:
        name = f"{private.host}/team/app:1"
        push_layout(busybox_layout, name, creds=private.creds)
        daemon = daemon_factory()
        user, password = private.user, private.password
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        async with cri_client(daemon) as client:
            for auth in (None, cri.AuthConfig(username=user, password="wrong")):
                error = await cri_error(pull_image(client, name, auth=auth))
                assert error.code == "PERMISSION_DENIED", error
            for auth in (cri.AuthConfig(username=user, password=password), cri.AuthConfig(auth=basic)):
                assert await pull_image(client, name, auth=auth) == busybox_layout.config_digest
                await remove_image(client, name)
                assert await image_status(client, name) is None


async def test_image_fs_info(client: AuraeClient, cri_daemon: DaemonProcess) -> None:
    await pull_image(client, BUSYBOX_IMAGE)
    before = time.time_ns()
    response = await image_fs_info(client)
    after = time.time_ns()
    (usage,) = response.image_filesystems
    assert usage.fs_id is not None and usage.fs_id.mountpoint == str(cri_daemon.root / "state" / "images")
    assert Path(usage.fs_id.mountpoint).is_dir()
    assert before <= usage.timestamp <= after  # nanoseconds since the epoch
    assert usage.used_bytes is not None and usage.used_bytes.value > 0
    assert usage.inodes_used is not None and usage.inodes_used.value > 0
    await remove_image(client, BUSYBOX_IMAGE)
