"""Reading OCI image layouts (a directory, or a tar of one) for offline import.

A layout is untrusted input. index.json, any nested index and the manifest are checked against
what names them (the blobs copied into the store are verified there), and every malformed part
is the layout's fault (INVALID_ARGUMENT). A layout tar is read with tarfile, which believes what
a header claims: ``_BoundedTarInfo`` holds it to the little a layout needs, and of its members
only the files a layout is read from are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from auraed.errors import ErrorKind
from auraed.images.content import DIGEST_ALGORITHM, HEX_LENGTH, ContentStore, split_digest
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
BLOBS = f"blobs/{DIGEST_ALGORITHM}/"
MAX_MEMBERS = 10_000  # a layout tar has a member per blob and a few more: far fewer than this
MAX_EXTENDED = 16 << 10  # the extended headers of one member, together: a layout's names are short
_EXTENDED_TYPES = frozenset(
    {
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
    }
)
# what reading a damaged or truncated tar raises, from tarfile or a decompressor (bz2: OSError)
_TAR_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)


def _invalid(path: Path, problem: str) -> ImageError:
    return ImageError(ErrorKind.INVALID_ARGUMENT, f"OCI layout {path}: {problem}")


class Layout:
    """Blobs and index of one layout; files are opened through ``_open`` (directory or tar)."""

    def __init__(self, path: Path, tar: _LayoutTar | None) -> None:
        self.path = path
        self._tar = tar
        self._members = _layout_members(tar, path) if tar is not None else {}

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

    def _read(self, file: IO[bytes], name: str, size: int) -> bytes:
        """Up to ``size`` bytes of a layout file: a damaged or truncated tar is the layout's fault."""
        try:
            return file.read(size)
        except _TAR_ERRORS as exc:
            raise _invalid(self.path, f"cannot read {name}: {exc}") from None

    def _json(self, name: str) -> Any:
        with self._open(name) as file:
            raw = self._read(file, name, MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _invalid(self.path, f"{name} is too large")
        return self._parse(raw, name)

    def _parse(self, raw: bytes, name: str) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise _invalid(self.path, f"{name} is not JSON: {exc}") from None

    def _blob_name(self, digest: str) -> str:
        return f"{BLOBS}{split_digest(digest)}"

    def _read_blob(self, descriptor: dict[str, Any]) -> bytes:
        """The manifest or index ``descriptor`` names, checked against its size and digest."""
        digest, size = str(descriptor.get("digest", "")), descriptor.get("size")
        name = self._blob_name(digest)
        if not isinstance(size, int) or not 0 <= size <= MAX_MANIFEST_BYTES:
            raise _invalid(
                self.path, f"{name}: the descriptor's size {size!r} is not 0 to {MAX_MANIFEST_BYTES}"
            )
        with self._open(name) as file:
            raw = self._read(file, name, size + 1)
        if len(raw) != size or f"{DIGEST_ALGORITHM}:{hashlib.sha256(raw).hexdigest()}" != digest:
            raise _invalid(self.path, f"{name} does not match its descriptor (size {size}, digest {digest})")
        return raw

    def _manifests(self, index: Any, name: str) -> list[dict[str, Any]]:
        """The descriptors an index lists."""
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list):
            raise _invalid(self.path, f"{name} has no list of manifests")
        for i, descriptor in enumerate(manifests):
            if not isinstance(descriptor, dict):
                raise _invalid(self.path, f"{name}: manifests[{i}] is not a descriptor")
        return manifests

    def _ref_name(self, descriptor: dict[str, Any]) -> str:
        annotations = descriptor.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise _invalid(self.path, "index.json: a descriptor's annotations are not an object")
        return str(annotations.get(REF_NAME, ""))

    def select(self, ref_name: str) -> tuple[bytes, str, str]:
        """The manifest bytes, media type and ref name of the wanted image (linux/amd64)."""
        manifests = self._manifests(self._json("index.json"), "index.json")
        if not manifests:
            raise _invalid(self.path, "index.json lists no manifests")
        names = [self._ref_name(m) for m in manifests]
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
        return (*self._resolve_platform(descriptor), self._ref_name(descriptor))

    def _resolve_platform(self, descriptor: dict[str, Any], depth: int = 0) -> tuple[bytes, str]:
        media_type = str(descriptor.get("mediaType", ""))
        raw = self._read_blob(descriptor)
        if media_type in MANIFEST_TYPES:
            return raw, media_type
        if media_type not in INDEX_TYPES or depth > 2:
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION, f"OCI layout {self.path}: unsupported {media_type!r}"
            )
        name = self._blob_name(str(descriptor.get("digest", "")))
        for entry in self._manifests(self._parse(raw, name), name):
            platform = entry.get("platform")
            if isinstance(platform, dict) and (platform.get("os"), platform.get("architecture")) == PLATFORM:
                return self._resolve_platform(entry, depth + 1)
        raise ImageError(
            ErrorKind.NOT_FOUND, f"OCI layout {self.path}: no {'/'.join(PLATFORM)} image in the index"
        )

    def copy_blob(self, blob: BlobRef, content: ContentStore) -> None:
        """Copy one blob into the store, verified against its digest and size."""
        name = self._blob_name(blob.digest)
        writer = content.writer(blob.digest, blob.size)
        try:
            with self._open(name) as file:
                while chunk := self._read(file, name, COPY_CHUNK):
                    writer.write(chunk)
            writer.commit()
        except BaseException:
            writer.abort()
            raise


class _LayoutTarError(tarfile.TarError):
    """Something tarfile would read on through, but a layout tar does not need."""


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header, checked before tarfile acts on it (``_proc_member`` is tarfile's hook).

    Left alone, tarfile reads an extended header (GNU long name or link, PAX) whole at whatever
    size it claims, decompressed, and a run of them recursively; keeps PAX global headers for the
    rest of the archive, copying them into every member; and reads GNU sparse maps unbounded. A
    layout needs none of that (its names are short), so: the extended headers of one member take
    MAX_EXTENDED bytes at most, together and headers included (which bounds the recursion too);
    there is one PAX global header at most; sparse members and negative sizes are refused.
    """

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise _LayoutTarError(f"member {self.name[:100]!r} has a negative size")
        # tar.offset is where the headers of the member being read began
        if (
            self.type in _EXTENDED_TYPES
            and self.offset + tarfile.BLOCKSIZE + self.size - tar.offset > MAX_EXTENDED
        ):
            raise _LayoutTarError(f"the extended headers of a member take more than {MAX_EXTENDED} bytes")
        if self.type == tarfile.XGLTYPE and tar.pax_headers:
            raise _LayoutTarError("more than one PAX global header")
        if self.type == tarfile.GNUTYPE_SPARSE:
            self._refuse_sparse()
        member: tarfile.TarInfo = super()._proc_member(tar)  # type: ignore[misc]
        return member

    def _refuse_sparse(self, *_: object) -> NoReturn:
        raise _LayoutTarError("sparse members are not supported")

    # what tarfile calls for the sparse maps of PAX headers (GNU.sparse.*)
    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


class _LayoutTar(tarfile.TarFile):
    tarinfo = _BoundedTarInfo
    members: list[tarfile.TarInfo]  # tarfile's list of the members it has read (not in typeshed)


def _layout_members(tar: _LayoutTar, path: Path) -> dict[str, tarfile.TarInfo]:
    """The files of a layout tar that a layout is read from (index.json, blobs), by name."""
    members: dict[str, tarfile.TarInfo] = {}
    for _ in range(MAX_MEMBERS + 1):
        try:
            member = tar.next()
        except _TAR_ERRORS as exc:
            raise _invalid(path, f"cannot read the tar: {exc}") from None
        if member is None:
            return members
        tar.members.clear()  # tarfile keeps every member it has read; we keep the ones we need
        name = member.name.removeprefix("./")
        if member.isfile() and (
            name == "index.json" or (name.startswith(BLOBS) and len(name) == len(BLOBS) + HEX_LENGTH)
        ):
            member.pax_headers = {}  # applied already, and no use kept
            members[name] = member
    raise _invalid(path, f"the tar has more than {MAX_MEMBERS} members")


@contextlib.contextmanager
def open_layout(path: Path) -> Iterator[Layout]:
    if path.is_dir():
        yield Layout(path, None)
        return
    if not path.is_file():
        raise ImageError(ErrorKind.NOT_FOUND, f"OCI layout {path} does not exist")
    try:
        tar = _LayoutTar.open(path, "r:*")  # closed by the with below
    except _TAR_ERRORS as exc:
        raise _invalid(path, f"not a directory or a readable tar ({exc})") from None
    with tar:
        yield Layout(path, tar)
