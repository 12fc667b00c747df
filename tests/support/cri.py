"""A CRI (runtime.v1) client for tests, and the images critest pulls, served by a local registry.

``cri_client(daemon)`` speaks to the daemon's plain CRI socket with the same descriptor-driven
client as the aurae API. The helpers below wrap one RPC each in the terms critest uses: an image
is named by a reference or an id, ``image_status`` returns None for an absent image (the CRI's
"image unset"), ``pull_image`` returns the image_ref.

critest pulls its images by their original names (``registry.k8s.io/...``, ``gcr.io/...``); a
runtime serves them from a local registry through registry mirrors. ``mirrors_config`` is the
daemon TOML for that, ``mirror_destination`` where an original name lives on the mirror (the
repository path without the upstream's host, as a mirror is asked for it), ``publish`` pushes a
built image there under its original name, and ``publish_critest_images`` publishes every image
critest's image specs pull (busybox included). A name the mirror lacks falls through to the real
upstream registry: pull only what was published, and name any other image by a loopback
registry's own address.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient
from auraed.references import parse_reference
from tests.support.images import (
    OCI_INDEX,
    BuiltImage,
    Entry,
    ImageConfig,
    LayerSpec,
    build_layout,
    busybox_rootfs,
    push_index,
    push_layout,
    put_manifest,
)
from tests.support.registry import LocalRegistry

if TYPE_CHECKING:
    from tests.conftest import DaemonProcess

IMAGE_SERVICE = "runtime.v1.ImageService"
RUNTIME_SERVICE = "runtime.v1.RuntimeService"
# Generous: a pull under load on a shared machine; critest itself allows 300 s per unary call.
CALL_TIMEOUT = 120.0

CRITEST_REGISTRIES = ("registry.k8s.io", "gcr.io")
"""The upstream registries critest pulls from, each mirrored to the local registry."""
BUSYBOX_IMAGE = "registry.k8s.io/e2e-test-images/busybox:1.29-2"
"""critest's default container image (``top``, ``sh``, ``id``, ...)."""

# critest's image specs' names (cri-tools pkg/validate), all in one repository namespace.
TEST_IMAGES = "gcr.io/k8s-staging-cri-tools"
IMAGE_WITH_TAG = f"{TEST_IMAGES}/test-image-tag:test"
IMAGE_WITH_ALL_REFERENCES = f"{TEST_IMAGES}/test-image-tag:all"
IMAGE_WITHOUT_TAG = f"{TEST_IMAGES}/test-image-latest"
IMAGE_BY_DIGEST_REPOSITORY = f"{TEST_IMAGES}/test-image-digest"
DIFFERENT_TAG_DIFFERENT_IMAGE = tuple(f"{TEST_IMAGES}/test-image-{n}:latest" for n in (1, 2, 3))
DIFFERENT_TAG_SAME_IMAGE = tuple(f"{TEST_IMAGES}/test-image-tags:{n}" for n in (1, 2, 3))
USER_IMAGES = {  # name -> the Dockerfile's USER
    f"{TEST_IMAGES}/test-image-user-uid": "1002",
    f"{TEST_IMAGES}/test-image-user-username": "www-data",
    f"{TEST_IMAGES}/test-image-user-uid-group": "1003:1004",
    f"{TEST_IMAGES}/test-image-user-username-group": "www-data:1004",
}
PREDEFINED_GROUP_IMAGE = f"{TEST_IMAGES}/test-image-predefined-group:latest"
"""critest's image of SupplementalGroupsPolicy: USER 1000 (default-user), whose /etc/group makes
that user a member of group 50000 (PREDEFINED_GROUP_GID)."""
PREDEFINED_GROUP_UID = 1000
PREDEFINED_GROUP_GID = 50000
PLATFORMS = ("linux/amd64", "linux/arm64")
"""Of a multi-arch test image: ours, and one it must not pick."""


def cri_client(daemon: DaemonProcess) -> AuraeClient:
    """A client on the daemon's CRI socket (plain gRPC, as a kubelet speaks it)."""
    return AuraeClient(grpc.aio.insecure_channel(f"unix:{daemon.cri_socket}"))


# -- the images critest pulls -----------------------------------------------------------------


def mirrors_config(registry: LocalRegistry, upstreams: tuple[str, ...] = CRITEST_REGISTRIES) -> str:
    """Daemon TOML making ``registry`` the mirror of each of ``upstreams``."""
    return "".join(f'[registries."{host}"]\nmirrors = ["{registry.url}"]\n' for host in upstreams)


def mirror_destination(registry: LocalRegistry, name: str) -> str:
    """Where ``name`` (an original, tagged name) is pushed so that ``registry`` serves it as a mirror."""
    ref = parse_reference(name)
    if ref.tag is None:
        raise ValueError(f"{name}: a mirror is pushed to by tag")
    return f"{registry.host}/{ref.repository}:{ref.tag}"


def publish(image: BuiltImage, registry: LocalRegistry, *names: str) -> None:
    """Push ``image`` to ``registry`` as the mirror of each of ``names`` (original names)."""
    for name in names:
        push_layout(image, mirror_destination(registry, name))


@dataclass(frozen=True)
class Published:
    """One image as the registry serves it: its id (config digest) and what its names resolve
    to (the manifest digest, or the index digest for a multi-arch image)."""

    id: str
    digest: str


@dataclass(frozen=True)
class CritestImages:
    """critest's images, published to a mirror; ``by_digest`` is the digest reference to pull."""

    published: dict[str, Published]  # by every name they were published under
    by_digest: str

    def __getitem__(self, name: str) -> Published:
        return self.published[name]


def _published(image: BuiltImage) -> Published:
    return Published(image.config_digest, image.manifest_digest)


def _publish_index(
    registry: LocalRegistry,
    workdir: Path,
    names: tuple[str, ...],
    layers: list[LayerSpec],
    config: ImageConfig | None = None,
) -> Published:
    """A multi-arch image (PLATFORMS) pushed under every one of ``names`` (one repository)."""
    refs = [parse_reference(name) for name in names]
    repository, first_tag = refs[0].repository, refs[0].tag or "latest"
    index = push_index(
        workdir, registry.url, repository, first_tag, platforms=PLATFORMS, base_layers=layers, config=config
    )
    for ref in refs[1:]:
        assert ref.repository == repository and ref.tag, f"{names}: one repository, tagged"
        put_manifest(registry.url, repository, ref.tag, index.raw, media_type=OCI_INDEX)
    return Published(index.images[PLATFORMS[0]].config_digest, index.digest)


def publish_critest_images(registry: LocalRegistry, workdir: Path) -> CritestImages:
    """Build and push every image critest's image specs pull, as the mirror of their registries.

    As cri-tools builds them (images/build), each is busybox plus one marker file named after it
    (so each name is a different image, but the three ``test-image-tags`` are one); the tagged
    multi-arch ones and the image pulled by digest are indexes over PLATFORMS, the others single
    manifests, so both kinds are pulled by tag.
    """
    root = busybox_rootfs(workdir)
    layout = workdir / "layout"
    published: dict[str, Published] = {}

    def single(name: str, marker: str, config: ImageConfig | None = None) -> None:
        slug = marker.replace(":", "-")
        image = build_layout(layout, [root, {marker: b""}], config, ref_name=slug)
        publish(image, registry, name)
        published[name] = _published(image)

    busybox = build_layout(layout, [root], ref_name="busybox")
    publish(busybox, registry, BUSYBOX_IMAGE)
    published[BUSYBOX_IMAGE] = _published(busybox)
    single(IMAGE_WITH_TAG, "test-image-tag-test")
    single(f"{IMAGE_WITHOUT_TAG}:latest", "test-image-latest")
    for name in DIFFERENT_TAG_DIFFERENT_IMAGE:
        single(name, name.rpartition("/")[2])
    for name, user in USER_IMAGES.items():
        single(f"{name}:latest", name.rpartition("/")[2], ImageConfig(user=user))
    same = _publish_index(registry, workdir / "tags", DIFFERENT_TAG_SAME_IMAGE, [root, {"same-image": b""}])
    published.update(dict.fromkeys(DIFFERENT_TAG_SAME_IMAGE, same))
    published[IMAGE_WITH_ALL_REFERENCES] = _publish_index(
        registry, workdir / "all", (IMAGE_WITH_ALL_REFERENCES,), [root, {"test-image-tag-all": b""}]
    )
    digest_image = _publish_index(
        registry, workdir / "digest", (f"{IMAGE_BY_DIGEST_REPOSITORY}:index",), [root, {"digest": b""}]
    )
    by_digest = f"{IMAGE_BY_DIGEST_REPOSITORY}@{digest_image.digest}"
    published[by_digest] = digest_image
    return CritestImages(published, by_digest)


def predefined_group_image(workdir: Path) -> BuiltImage:
    """PREDEFINED_GROUP_IMAGE as cri-tools builds it (images/image-predefined-group): busybox with
    ``adduser -u 1000 default-user; addgroup -g 50000 group-defined-in-image; addgroup
    default-user group-defined-in-image``."""
    uid, gid = PREDEFINED_GROUP_UID, PREDEFINED_GROUP_GID
    passwd = f"root:x:0:0:root:/root:/bin/sh\ndefault-user:x:{uid}:{uid}::/home/default-user:/bin/sh\n"
    group = f"root:x:0:\ndefault-user:x:{uid}:\ngroup-defined-in-image:x:{gid}:default-user\n"
    accounts: dict[str, Entry] = {"etc/passwd": passwd.encode(), "etc/group": group.encode()}
    config = ImageConfig(user=str(uid))
    return build_layout(
        workdir / "layout", [busybox_rootfs(workdir), accounts], config, ref_name="predefined-group"
    )


@dataclass(frozen=True)
class GroupsCase:
    """One of critest's SupplementalGroupsPolicy containers on PREDEFINED_GROUP_IMAGE: its name,
    security context, and the groups its process must have (sorted, as ``id -G`` prints them)."""

    name: str
    context: cri.LinuxContainerSecurityContext
    groups: list[int]

    @property
    def shown(self) -> str:
        return " ".join(map(str, self.groups))

    def reported(self, status: cri.ContainerStatus) -> bool:
        """Whether ContainerStatus reports the user's uid, its primary group and the groups."""
        user = status.user.linux if status.user is not None else None
        ids = (user.uid, user.gid, sorted(user.supplemental_groups)) if user is not None else None
        uid = PREDEFINED_GROUP_UID  # default-user's primary group has its uid's number
        return ids == (uid, uid, self.groups)


def supplemental_groups_cases() -> list[GroupsCase]:
    """Merge (the default): the user's group in the image and the pod's; Strict: the pod's only."""
    uid, image_group, pod_group = PREDEFINED_GROUP_UID, PREDEFINED_GROUP_GID, 1234
    policies = cri.SupplementalGroupsPolicy
    return [
        GroupsCase(
            f"groups-{policy.name.lower()}",
            cri.LinuxContainerSecurityContext(
                run_as_user=cri.Int64Value(value=uid),
                supplemental_groups=[pod_group],
                supplemental_groups_policy=policy,
            ),
            groups,
        )
        for policy, groups in (
            (policies.Merge, [uid, pod_group, image_group]),
            (policies.Strict, [uid, pod_group]),
        )
    ]


# -- one RPC each -------------------------------------------------------------------------------


def image_spec(name: str) -> cri.ImageSpec:
    return cri.ImageSpec(image=name)


async def pull_image(
    client: AuraeClient,
    name: str,
    *,
    auth: cri.AuthConfig | None = None,
    sandbox_config: cri.PodSandboxConfig | None = None,
    timeout: float = CALL_TIMEOUT,
) -> str:
    """PullImage; the image_ref (the image id)."""
    request = cri.PullImageRequest(image=image_spec(name), auth=auth, sandbox_config=sandbox_config)
    response: cri.PullImageResponse = await client.call(IMAGE_SERVICE, "PullImage", request, timeout)
    return response.image_ref


async def image_status_response(
    client: AuraeClient, name: str, verbose: bool = False
) -> cri.ImageStatusResponse:
    request = cri.ImageStatusRequest(image=image_spec(name), verbose=verbose)
    response: cri.ImageStatusResponse = await client.call(IMAGE_SERVICE, "ImageStatus", request, CALL_TIMEOUT)
    return response


async def image_status(client: AuraeClient, name: str) -> cri.Image | None:
    """ImageStatus; None when the runtime has no such image."""
    return (await image_status_response(client, name)).image


async def list_images(client: AuraeClient, name: str = "") -> list[cri.Image]:
    """ListImages, filtered by ``name`` (a reference or id) when given."""
    image_filter = cri.ImageFilter(image=image_spec(name)) if name else None
    request = cri.ListImagesRequest(filter=image_filter)
    response: cri.ListImagesResponse = await client.call(IMAGE_SERVICE, "ListImages", request, CALL_TIMEOUT)
    return response.images


async def stream_images(client: AuraeClient, name: str = "") -> list[cri.Image]:
    """StreamImages, every image of every message until the stream ends."""
    image_filter = cri.ImageFilter(image=image_spec(name)) if name else None
    request = cri.StreamImagesRequest(filter=image_filter)
    images: list[cri.Image] = []
    async for response in client.stream(IMAGE_SERVICE, "StreamImages", request, CALL_TIMEOUT):
        images += response.images
    return images


async def remove_image(client: AuraeClient, name: str) -> None:
    await client.call(
        IMAGE_SERVICE, "RemoveImage", cri.RemoveImageRequest(image=image_spec(name)), CALL_TIMEOUT
    )


async def remove_image_by_id(client: AuraeClient, name: str) -> None:
    """critest's removeImage: the image ``name`` names, if any, removed by its id."""
    image = await image_status(client, name)
    if image is not None:
        await remove_image(client, image.id)


async def image_fs_info(client: AuraeClient) -> cri.ImageFsInfoResponse:
    response: cri.ImageFsInfoResponse = await client.call(
        IMAGE_SERVICE, "ImageFsInfo", cri.ImageFsInfoRequest(), CALL_TIMEOUT
    )
    return response


# -- pods ---------------------------------------------------------------------------------------


def pod_config(
    name: str = "pod",
    *,
    uid: str = "",
    namespace: str = "default",
    attempt: int = 2,
    hostname: str = "",
    dns: cri.DnsConfig | None = None,
    port_mappings: list[cri.PortMapping] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    linux: cri.LinuxPodSandboxConfig | None = None,
) -> cri.PodSandboxConfig:
    """A pod's config as critest's helpers make it: metadata (attempt 2, critest's default; uid
    ``<name>-uid`` unless given), labels {} unless given, and what else is given."""
    metadata = cri.PodSandboxMetadata(
        name=name, uid=uid or f"{name}-uid", namespace=namespace, attempt=attempt
    )
    return cri.PodSandboxConfig(
        metadata=metadata,
        hostname=hostname,
        dns_config=dns,
        port_mappings=port_mappings or [],
        labels=labels or {},
        annotations=annotations or {},
        linux=linux or cri.LinuxPodSandboxConfig(),
    )


def namespaces(
    network: cri.NamespaceMode = cri.NamespaceMode.POD,
    pid: cri.NamespaceMode = cri.NamespaceMode.POD,
    ipc: cri.NamespaceMode = cri.NamespaceMode.POD,
) -> cri.LinuxSandboxSecurityContext:
    return cri.LinuxSandboxSecurityContext(
        namespace_options=cri.NamespaceOption(network=network, pid=pid, ipc=ipc)
    )


async def run_pod(
    client: AuraeClient, config: cri.PodSandboxConfig, handler: str = "", timeout: float = CALL_TIMEOUT
) -> str:
    """RunPodSandbox; the pod's id."""
    request = cri.RunPodSandboxRequest(config=config, runtime_handler=handler)
    response: cri.RunPodSandboxResponse = await client.call(
        RUNTIME_SERVICE, "RunPodSandbox", request, timeout
    )
    return response.pod_sandbox_id


async def stop_pod(client: AuraeClient, pod_id: str) -> None:
    request = cri.StopPodSandboxRequest(pod_sandbox_id=pod_id)
    await client.call(RUNTIME_SERVICE, "StopPodSandbox", request, CALL_TIMEOUT)


async def remove_pod(client: AuraeClient, pod_id: str) -> None:
    request = cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id)
    await client.call(RUNTIME_SERVICE, "RemovePodSandbox", request, CALL_TIMEOUT)


async def pod_status(client: AuraeClient, pod_id: str, verbose: bool = False) -> cri.PodSandboxStatusResponse:
    request = cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose)
    response: cri.PodSandboxStatusResponse = await client.call(
        RUNTIME_SERVICE, "PodSandboxStatus", request, CALL_TIMEOUT
    )
    return response


async def list_pods(
    client: AuraeClient, pod_filter: cri.PodSandboxFilter | None = None
) -> list[cri.PodSandbox]:
    request = cri.ListPodSandboxRequest(filter=pod_filter)
    response: cri.ListPodSandboxResponse = await client.call(
        RUNTIME_SERVICE, "ListPodSandbox", request, CALL_TIMEOUT
    )
    return response.items


async def stream_pods(
    client: AuraeClient, pod_filter: cri.PodSandboxFilter | None = None
) -> list[cri.PodSandbox]:
    """StreamPodSandboxes, every pod of every message until the stream ends."""
    request = cri.StreamPodSandboxesRequest(filter=pod_filter)
    pods: list[cri.PodSandbox] = []
    async for response in client.stream(RUNTIME_SERVICE, "StreamPodSandboxes", request, CALL_TIMEOUT):
        pods += response.pod_sandboxes
    return pods
