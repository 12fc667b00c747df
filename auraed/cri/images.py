"""runtime.v1 ImageService over the host's image store: what a kubelet pulls, lists and removes.

The CRI names images by reference (tagged or by digest) or by id; all of them resolve through the
images subsystem, so an image has one id (its config digest) in every call and across registries,
whatever reference pulled it. Repo tags are the image's tagged references, repo digests the
``repository@sha256:...`` names it was pulled by.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from auraed.api.runtime import v1 as cri
from auraed.cri.errors import CriError
from auraed.errors import ErrorKind
from auraed.images.errors import ImageError
from auraed.images.images import Images
from auraed.images.model import ImageRecord
from auraed.system.fs_usage import FsUsageCache
from auraed.wire.handlers import Context

SERVICE_NAME = "runtime.v1.ImageService"
MAX_REFERENCE = 4096
# ImageFsInfo is asked for every few seconds by a kubelet; walking a large store that often would
# cost more than it tells.
FS_USAGE_TTL = 10.0


def image_user(config: dict[str, object]) -> tuple[int | None, str]:
    """The image's user as the CRI reports it: (uid, "") for a numeric user, (None, name) else.

    "1002", "1002:1002" and "1002:users" are uid 1002; "www-data" and "www-data:www-data" are the
    username www-data; an image without a user has neither (the runtime's default, root).
    """
    user = str(config.get("User") or "").partition(":")[0]
    if not user:
        return None, ""
    return (int(user), "") if user.isdecimal() else (None, user)


def _is_digest_reference(reference: str) -> bool:
    return "@" in reference


def image_message(image: ImageRecord) -> cri.Image:
    uid, username = image_user(image.config)
    return cri.Image(
        id=image.id,
        repo_tags=[r for r in image.references if not _is_digest_reference(r)],
        repo_digests=list(image.repo_digests),
        size=image.size,
        uid=cri.Int64Value(value=uid) if uid is not None else None,
        username=username,
        spec=cri.ImageSpec(image=image.id),
    )


def _reference(spec: cri.ImageSpec | None, field: str) -> str:
    reference = spec.image if spec is not None else ""
    if not reference:
        raise CriError.invalid(f"{field}.image", "is required")
    if len(reference) > MAX_REFERENCE or "\0" in reference:
        raise CriError.invalid(f"{field}.image", "is not a plausible image reference")
    return reference


def _pull_reference(spec: cri.ImageSpec | None) -> str:
    """The reference to pull: only a name, never an image id, can be fetched from a registry."""
    reference = _reference(spec, "image")
    from auraed.references import ReferenceError, parse_reference

    try:
        parse_reference(reference)
    except ReferenceError as exc:
        raise CriError.invalid("image.image", str(exc)) from None
    return reference


def _find(images: Images, reference: str, field: str) -> ImageRecord | None:
    """The image ``reference`` names, None when there is none (the CRI's "image unset")."""
    try:
        return images.find(reference)
    except ImageError as exc:
        if exc.kind is ErrorKind.NOT_FOUND:
            return None
        if exc.kind is ErrorKind.INVALID_ARGUMENT:  # worded for the field the kubelet filled in
            raise CriError.invalid(f"{field}.image", exc.message.removeprefix("reference: ")) from None
        raise


class ImageServicer:
    """Translates runtime.v1.ImageService calls to the images subsystem."""

    def __init__(self, images: Images, fs_usage: FsUsageCache) -> None:
        self._images = images
        self._fs_usage = fs_usage

    def _listed(self, request_filter: cri.ImageFilter | None) -> list[cri.Image]:
        spec = request_filter.image if request_filter else None
        if spec is not None and spec.image:
            found = _find(self._images, _reference(spec, "filter.image"), "filter.image")
            return [image_message(found)] if found else []
        return [image_message(image) for image in sorted(self._images.all(), key=lambda i: i.created_at)]

    async def list_images(self, request: cri.ListImagesRequest, context: Context) -> cri.ListImagesResponse:
        return cri.ListImagesResponse(images=self._listed(request.filter))

    async def stream_images(
        self, request: cri.StreamImagesRequest, context: Context
    ) -> AsyncIterator[cri.StreamImagesResponse]:
        yield cri.StreamImagesResponse(images=self._listed(request.filter))

    async def image_status(
        self, request: cri.ImageStatusRequest, context: Context
    ) -> cri.ImageStatusResponse:
        image = _find(self._images, _reference(request.image, "image"), "image")
        if image is None:
            return cri.ImageStatusResponse()
        info: dict[str, str] = {}
        if request.verbose:
            info["info"] = json.dumps(
                {
                    "manifestDigest": image.manifest_digest,
                    "mediaType": image.manifest_media_type,
                    "os": image.os,
                    "architecture": image.architecture,
                    "layers": [layer.digest for layer in image.layers],
                    "config": image.config,
                }
            )
        return cri.ImageStatusResponse(image=image_message(image), info=info)

    async def pull_image(self, request: cri.PullImageRequest, context: Context) -> cri.PullImageResponse:
        reference = _pull_reference(request.image)
        # Imported here: the HTTP stack costs ~5 MiB and guests, which never pull, never load it.
        from auraed.images.registry import Credentials

        credentials = Credentials.from_auth(_auth_credentials(request.auth))
        image: ImageRecord | None = None
        async for event in self._images.pull(reference, credentials):
            if isinstance(event, ImageRecord):
                image = event
        if image is None:  # the domain always ends a pull with the record, or raises
            raise CriError(ErrorKind.INTERNAL, f"the pull of {reference} ended without an image")
        return cri.PullImageResponse(image_ref=image.id)

    async def remove_image(
        self, request: cri.RemoveImageRequest, context: Context
    ) -> cri.RemoveImageResponse:
        reference = _reference(request.image, "image")
        if _find(self._images, reference, "image") is None:
            return cri.RemoveImageResponse()  # idempotent: already gone
        try:
            await self._images.remove(reference)
        except ImageError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:  # a concurrent removal got there first
                raise
        return cri.RemoveImageResponse()

    async def image_fs_info(
        self, request: cri.ImageFsInfoRequest, context: Context
    ) -> cri.ImageFsInfoResponse:
        usage = await self._fs_usage.usage()
        return cri.ImageFsInfoResponse(
            image_filesystems=[
                cri.FilesystemUsage(
                    timestamp=usage.timestamp_ns,
                    fs_id=cri.FilesystemIdentifier(mountpoint=str(self._fs_usage.root)),
                    used_bytes=cri.UInt64Value(value=usage.used_bytes),
                    inodes_used=cri.UInt64Value(value=usage.inodes_used),
                )
            ]
        )


@dataclass(frozen=True)
class _Auth:
    """A CRI AuthConfig in the shape the registry client takes (``auth`` is base64 user:password)."""

    username: str
    password: str
    registry_token: str
    identity_token: str


def _auth_credentials(auth: cri.AuthConfig | None) -> _Auth | None:
    if auth is None:
        return None
    username, password = auth.username, auth.password
    if auth.auth and not (username or password):
        import base64
        import binascii

        try:
            decoded = base64.b64decode(auth.auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise CriError.invalid("auth.auth", "is not base64 of user:password") from None
        username, sep, password = decoded.partition(":")
        if not sep:
            raise CriError.invalid("auth.auth", "is not base64 of user:password")
    return _Auth(username, password, auth.registry_token, auth.identity_token)
