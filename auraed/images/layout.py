"""Reading OCI image layouts (a directory, or a tar of one) for offline import."""

from __future__ import annotations

import contextlib
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from auraed.errors import ErrorKind
from auraed.images.content import ContentStore, split_digest
from auraed.images.errors import ImageError
from auraed.images.model import (
    DOCKER_MANIFEST_LIST,
    MANIFEST_TYPES,
    MAX_MANIFEST_BYTES,
    OCI_INDEX,
    PLATFORM,
    BlobRef,
)

REF_NAME = "org.opencontainers.image.ref.name"
INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
COPY_CHUNK = 1 << 20


def _invalid(path: Path, problem: str) -> ImageError:
    return ImageError(ErrorKind.INVALID_ARGUMENT, f"OCI layout {path}: {problem}")


class Layout:
    """Blobs and index of one layout; files are opened through ``_open`` (directory or tar)."""

    def __init__(self, path: Path, tar: tarfile.TarFile | None) -> None:
        self.path = path
        self._tar = tar
        self._members = (
            {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()} if tar is not None else {}
        )

    def _open(self, name: str) -> IO[bytes]:
        if self._tar is None:
            target = self.path / name
            if target.is_symlink() or not target.is_file():
                raise _invalid(self.path, f"{name} is missing")
            return target.open("rb")
        member = self._members.get(name)
        extracted = self._tar.extractfile(member) if member is not None else None
        if extracted is None:
            raise _invalid(self.path, f"{name} is missing")
        return extracted

    def _json(self, name: str) -> Any:
        with self._open(name) as file:
            raw = file.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _invalid(self.path, f"{name} is too large")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise _invalid(self.path, f"{name} is not JSON: {exc}") from None

    def _blob_name(self, digest: str) -> str:
        return f"blobs/sha256/{split_digest(digest)}"

    def _read_blob(self, descriptor: dict[str, Any]) -> bytes:
        with self._open(self._blob_name(str(descriptor.get("digest", "")))) as file:
            return file.read(MAX_MANIFEST_BYTES + 1)

    def select(self, ref_name: str) -> tuple[bytes, str, str]:
        """The manifest bytes, media type and ref name of the wanted image (linux/amd64)."""
        index = self._json("index.json")
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list) or not manifests:
            raise _invalid(self.path, "index.json lists no manifests")
        names = [str((m.get("annotations") or {}).get(REF_NAME, "")) for m in manifests]
        if ref_name:
            matches = [m for m, n in zip(manifests, names, strict=True) if n == ref_name]
            if not matches:
                raise ImageError(
                    ErrorKind.NOT_FOUND,
                    f"OCI layout {self.path} has no image {ref_name!r} "
                    f"(it has: {', '.join(filter(None, names)) or 'unnamed images'})",
                )
        elif len(manifests) > 1:
            raise ImageError(
                ErrorKind.INVALID_ARGUMENT,
                f"OCI layout {self.path} holds {len(manifests)} images; "
                f"name one: {', '.join(filter(None, names))}",
            )
        else:
            matches = manifests
        descriptor = matches[0]
        name = str((descriptor.get("annotations") or {}).get(REF_NAME, ""))
        return (*self._resolve_platform(descriptor), name)

    def _resolve_platform(self, descriptor: dict[str, Any], depth: int = 0) -> tuple[bytes, str]:
        media_type = str(descriptor.get("mediaType", ""))
        raw = self._read_blob(descriptor)
        if media_type in MANIFEST_TYPES:
            return raw, media_type
        if media_type not in INDEX_TYPES or depth > 2:
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION, f"OCI layout {self.path}: unsupported {media_type!r}"
            )
        for entry in json.loads(raw).get("manifests", []):
            platform = entry.get("platform") or {}
            if (platform.get("os"), platform.get("architecture")) == PLATFORM:
                return self._resolve_platform(entry, depth + 1)
        raise ImageError(
            ErrorKind.NOT_FOUND, f"OCI layout {self.path}: no {'/'.join(PLATFORM)} image in the index"
        )

    def copy_blob(self, blob: BlobRef, content: ContentStore) -> None:
        """Copy one blob into the store, verified against its digest and size."""
        writer = content.writer(blob.digest, blob.size)
        try:
            with self._open(self._blob_name(blob.digest)) as file:
                while chunk := file.read(COPY_CHUNK):
                    writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        writer.commit()


@contextlib.contextmanager
def open_layout(path: Path) -> Iterator[Layout]:
    if path.is_dir():
        yield Layout(path, None)
        return
    if not path.is_file():
        raise ImageError(ErrorKind.NOT_FOUND, f"OCI layout {path} does not exist")
    try:
        tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by the with below
    except (tarfile.TarError, OSError) as exc:
        raise _invalid(path, f"not a directory or a readable tar ({exc})") from None
    with tar:
        yield Layout(path, tar)
