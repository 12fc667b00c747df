"""What a guest takes as a shared root filesystem (``config.shared_rootfs``): the host's layers
below the share's mount, an image id and config; anything else is refused at the edge, naming
the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.bootargs import SHARE_MOUNT
from auraed.containers.errors import ContainerError
from auraed.containers.request import IMAGE_MOUNT, Mount
from auraed.containers.rootfs import MAX_SHARED_LAYERS, SharedImage
from auraed.containers.servicer import container_request, shared_image
from auraed.errors import ErrorKind

IMAGE_ID = "sha256:" + "ab" * 32
LAYERS = [f"{SHARE_MOUNT}/0123abcd/{n}" for n in range(3)]


def message(**fields: object) -> pb.SharedRootfs:
    values: dict[str, object] = {"image_id": IMAGE_ID, "layers": LAYERS, "image_config": '{"Env": ["A=1"]}'}
    return pb.SharedRootfs(**(values | fields))  # type: ignore[arg-type]


def test_the_hosts_layers_become_the_image() -> None:
    assert shared_image(message()) == SharedImage(IMAGE_ID, {"Env": ["A=1"]}, tuple(map(Path, LAYERS)))
    assert shared_image(message(image_config="")).config == {}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"image_id": "busybox"}, "config.shared_rootfs.image_id"),
        ({"image_id": "sha256:" + "AB" * 32}, "config.shared_rootfs.image_id"),
        ({"layers": []}, "config.shared_rootfs.layers"),
        ({"layers": LAYERS * (MAX_SHARED_LAYERS // 3 + 1)}, "config.shared_rootfs.layers"),
        ({"layers": ["/etc"]}, "config.shared_rootfs.layers[0]"),
        ({"layers": [SHARE_MOUNT]}, "config.shared_rootfs.layers[0]"),
        ({"layers": [*LAYERS[:1], f"{SHARE_MOUNT}/k/../../../etc"]}, "config.shared_rootfs.layers[1]"),
        ({"layers": [f"{SHARE_MOUNT}//k/0"]}, "config.shared_rootfs.layers[0]"),
        ({"layers": [f"{SHARE_MOUNT}/k/0:/etc"]}, "config.shared_rootfs.layers[0]"),
        ({"layers": [f"{SHARE_MOUNT}/k/0,upperdir=/etc"]}, "config.shared_rootfs.layers[0]"),
        ({"layers": [f"{SHARE_MOUNT}/k/0\\"]}, "config.shared_rootfs.layers[0]"),
        ({"image_config": "[1]"}, "config.shared_rootfs.image_config"),
        ({"image_config": "{"}, "config.shared_rootfs.image_config"),
    ],
)
def test_anything_else_is_refused_naming_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ContainerError) as error:
        shared_image(message(**fields))
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT
    assert error.value.message.startswith(f"{field}:"), error.value.message


def test_an_image_volumes_shared_layers_become_the_mounts_image() -> None:
    """A vm pod's image volume: its Mount names the image's layers in the share, checked as a
    shared rootfs's are; ``source`` is the image's id."""
    config = pb.ContainerConfig(
        name="c",
        mounts=[
            pb.Mount(
                source="busybox", destination="/v", type="image", read_only=True, sub_path="bin",
                shared_image=pb.SharedRootfs(image_id=IMAGE_ID, layers=LAYERS),
            ),
            pb.Mount(source="busybox", destination="/stored", type="image", read_only=True),
        ],
    )  # fmt: skip
    shared, stored = container_request(config).mounts
    assert shared == Mount("/v", IMAGE_ID, IMAGE_MOUNT, (), True, "bin", tuple(LAYERS))
    assert stored == Mount("/stored", "busybox", IMAGE_MOUNT, (), True)  # the guest's own store's


@pytest.mark.parametrize(
    ("mount", "field"),
    [
        (
            pb.Mount(
                destination="/v",
                type="image",
                shared_image=pb.SharedRootfs(image_id=IMAGE_ID, layers=["/etc"]),
            ),
            "config.mounts[0].shared_image.layers[0]",
        ),
        (pb.Mount(source="/tmp", destination="/v", sub_path="x"), "config.mounts[0]"),
        (pb.Mount(source="/tmp", destination="/v", shared_image=message()), "config.mounts[0]"),
    ],
)
def test_an_image_volumes_shared_layers_are_checked(mount: pb.Mount, field: str) -> None:
    with pytest.raises(ContainerError) as refused:
        container_request(pb.ContainerConfig(name="c", mounts=[mount]))
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and refused.value.message.startswith(field)
