"""Image records and the OCI/Docker manifest and config formats they come from."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from auraed.errors import ErrorKind
from auraed.images.errors import ImageError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's suggested limit
MAX_CONFIG_BYTES = 8 << 20
PLATFORM = ("linux", "amd64")


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    digest: str
    diff_id: str
    size: int
    media_type: str


@dataclasses.dataclass(frozen=True)
class ImageRecord:
    id: str  # the config digest
    references: tuple[str, ...]
    repo_digests: tuple[str, ...]
    manifest_digest: str
    manifest_media_type: str
    layers: tuple[LayerRecord, ...]
    config: dict[str, Any]  # the image config's "config" object (Entrypoint, Cmd, Env, ...)
    os: str
    architecture: str
    created_at: float

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)

    @property
    def blobs(self) -> set[str]:
        return {self.id, self.manifest_digest, *(layer.digest for layer in self.layers)}

    def to_doc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ImageRecord:
        return cls(
            **{
                **doc,
                "references": tuple(doc["references"]),
                "repo_digests": tuple(doc["repo_digests"]),
                "layers": tuple(LayerRecord(**layer) for layer in doc["layers"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class BlobRef:
    media_type: str
    digest: str
    size: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    media_type: str
    config: BlobRef
    layers: tuple[BlobRef, ...]


@dataclasses.dataclass(frozen=True)
class ImageConfigFile:
    diff_ids: tuple[str, ...]
    os: str
    architecture: str
    config: dict[str, Any]


def _invalid(what: str, problem: str) -> ImageError:
    return ImageError(ErrorKind.INVALID_ARGUMENT, f"{what}: {problem}")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise _invalid(what, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _invalid(what, "not a JSON object")
    return value


def _blob_ref(value: Any, what: str) -> BlobRef:
    if not isinstance(value, dict):
        raise _invalid(what, "not a descriptor")
    media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if (
        not isinstance(media_type, str)
        or not isinstance(digest, str)
        or not isinstance(size, int)
        or size < 0
    ):
        raise _invalid(what, "a descriptor needs mediaType, digest and a non-negative size")
    return BlobRef(media_type, digest, size)


def parse_manifest(raw: bytes, media_type: str = "") -> Manifest:
    """An image manifest (OCI or Docker schema 2); indexes are resolved before this."""
    doc = _json_object(raw, "manifest")
    kind = doc.get("mediaType") or media_type or OCI_MANIFEST
    if kind not in MANIFEST_TYPES:
        raise ImageError(ErrorKind.FAILED_PRECONDITION, f"manifest: unsupported media type {kind!r}")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise _invalid("manifest", "has no layers list")
    return Manifest(
        kind,
        _blob_ref(doc.get("config"), "manifest.config"),
        tuple(_blob_ref(layer, f"manifest.layers[{i}]") for i, layer in enumerate(layers)),
    )


def parse_image_config(raw: bytes) -> ImageConfigFile:
    doc = _json_object(raw, "image config")
    rootfs = doc.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise _invalid("image config", "rootfs.diff_ids is missing")
    config = doc.get("config") or {}
    if not isinstance(config, dict):
        raise _invalid("image config", "config is not an object")
    return ImageConfigFile(tuple(diff_ids), str(doc.get("os", "")), str(doc.get("architecture", "")), config)


def check_platform(config: ImageConfigFile, what: str) -> None:
    if (config.os, config.architecture) != PLATFORM:
        raise ImageError(
            ErrorKind.FAILED_PRECONDITION,
            f"{what} is for {config.os}/{config.architecture}; this machine runs {'/'.join(PLATFORM)}",
        )
