"""OCI layouts read for import: a directory or a tar of one, and the hostile or broken ones.

Layouts are built by tests.support.images; hostile tars are made of raw headers, since tarfile will
not write most of them. Every bad layout must be refused as INVALID_ARGUMENT, with the memory a
hostile tar costs bounded.
"""

from __future__ import annotations

import gzip
import json
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any, Literal

import pytest

from auraed.errors import ErrorKind
from auraed.images.content import LocalStore
from auraed.images.errors import ImageError
from auraed.images.layout import MAX_MEMBERS, open_layout
from auraed.images.model import MAX_MANIFEST_BYTES, BlobRef
from tests.support.images import (
    OCI_INDEX,
    OCI_MANIFEST,
    BuiltImage,
    build_layout,
    canonical_json,
    sha256_digest,
)

END = bytes(1024)  # a tar's end-of-archive blocks
HUGE = 64 << 20  # the size a hostile extended header claims
COMMENT = b"12 comment=\n"  # a PAX record: its length, 12, counts itself
SPARSE_1_0 = b"22 GNU.sparse.major=1\n22 GNU.sparse.minor=0\n"


def image_in(tmp_path: Path) -> BuiltImage:
    return build_layout(tmp_path / "layout", [{"etc/hello": b"hello\n"}])


def tar_of(layout: Path, mode: Literal["w", "w:gz"] = "w") -> Path:
    archive = layout.with_suffix(".tar.gz" if mode == "w:gz" else ".tar")
    with tarfile.open(archive, mode) as tar:
        tar.add(layout, arcname=".")
    return archive


def header(kind: bytes, size: int, name: str = "././@LongLink") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def extended(kind: bytes, data: bytes) -> bytes:
    """An extended header (GNU long name "L", PAX "x" or global "g", ...) with its data."""
    return header(kind, len(data)) + data + bytes(-len(data) % 512)


def write_index(layout: Path, *descriptors: dict[str, Any]) -> None:
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(descriptors)}
    (layout / "index.json").write_bytes(canonical_json(index))


def blob_descriptor(image: BuiltImage, raw: bytes, media_type: str = OCI_INDEX) -> dict[str, Any]:
    """Store ``raw`` as a blob of the layout; the descriptor naming it."""
    image.blob_path(sha256_digest(raw)).write_bytes(raw)
    return {"mediaType": media_type, "digest": sha256_digest(raw), "size": len(raw)}


def nest_in_an_index(image: BuiltImage) -> dict[str, Any]:
    """index.json names an index that names the image; the nested index's descriptor."""
    nested = canonical_json(
        {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [image.manifest_descriptor()]}
    )
    descriptor = blob_descriptor(image, nested)
    write_index(image.layout, descriptor)
    return descriptor


def refused(path: Path) -> ImageError:
    with pytest.raises(ImageError) as info, open_layout(path) as layout:
        layout.select("")
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT
    return info.value


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_a_layout_tar_is_imported(tmp_path: Path, mode: Literal["w", "w:gz"]) -> None:
    image = image_in(tmp_path)
    store = LocalStore(tmp_path / "store")
    with open_layout(tar_of(image.layout, mode)) as layout:
        assert layout.select("latest") == (image.manifest, OCI_MANIFEST, "latest")
        for layer in image.layers:
            layout.copy_blob(BlobRef(layer.media_type, layer.digest, layer.size), store)
    assert store.read_blob(image.layers[0].digest, 1 << 20) == image.blob(image.layers[0].digest)


def test_a_nested_index_is_followed(tmp_path: Path) -> None:
    image = image_in(tmp_path)
    nest_in_an_index(image)
    with open_layout(image.layout) as layout:
        assert layout.select("")[0] == image.manifest


# --- hostile tars --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", [tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE]
)
def test_a_huge_extended_header_is_refused_unread(tmp_path: Path, kind: bytes) -> None:
    path = tmp_path / "layout.tar"
    with path.open("wb") as file:
        file.write(header(kind, HUGE))
        file.truncate(len(header(kind, HUGE)) + HUGE + len(END))  # zeros, sparse: quick to make
    tracemalloc.start()
    try:
        error = refused(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # tarfile alone reads the whole claimed size
    assert "extended headers" in error.message


HOSTILE_TARS = {
    # tarfile reads a run of extended headers recursively
    "a run of extended headers": (
        extended(tarfile.XHDTYPE, COMMENT) * 2000 + header(tarfile.REGTYPE, 0, "f"),
        "extended headers",
    ),
    # tarfile keeps global headers, and copies them into every member
    "a second PAX global header": (
        (extended(tarfile.XGLTYPE, COMMENT) + header(tarfile.REGTYPE, 0, "f")) * 2,
        "global header",
    ),
    # tarfile reads the maps of sparse members without a bound
    "an old GNU sparse member": (header(tarfile.GNUTYPE_SPARSE, 0, "f"), "sparse"),
    "a PAX sparse member": (
        extended(tarfile.XHDTYPE, SPARSE_1_0)
        + header(tarfile.REGTYPE, 512, "f")
        + b"9999999\n".ljust(512, b"\0"),
        "sparse",
    ),
    "a negative size": (
        header(tarfile.GNUTYPE_LONGNAME, -1024) + header(tarfile.REGTYPE, 0, "f"),
        "negative size",
    ),
    "too many members": (
        header(tarfile.REGTYPE, 0, "f") * (MAX_MEMBERS + 1),
        f"more than {MAX_MEMBERS} members",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_TARS)
def test_hostile_layout_tars_are_refused(tmp_path: Path, case: str) -> None:
    data, problem = HOSTILE_TARS[case]
    path = tmp_path / "layout.tar"
    path.write_bytes(data + END)
    assert problem in refused(path).message


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_a_truncated_layout_tar_is_refused(tmp_path: Path, mode: Literal["w", "w:gz"]) -> None:
    archive = tar_of(image_in(tmp_path).layout, mode)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    refused(archive)


def test_a_corrupt_compressed_layout_tar_is_refused(tmp_path: Path) -> None:
    archive = tar_of(image_in(tmp_path).layout, "w:gz")
    data = bytearray(archive.read_bytes())
    data[len(data) // 2 :] = gzip.compress(b"garbage")  # a valid start, then a second stream
    archive.write_bytes(bytes(data))
    refused(archive)


# --- manifests and indexes against their descriptors ---------------------------------------------


def change_manifest_bytes(image: BuiltImage) -> None:
    manifest = json.loads(image.manifest)
    image.blob_path(image.manifest_digest).write_bytes(json.dumps(manifest, indent=1).encode())


def change_nested_index_bytes(image: BuiltImage) -> None:
    descriptor = nest_in_an_index(image)
    path = image.blob_path(descriptor["digest"])
    path.write_bytes(path.read_bytes() + b" ")


MISMATCHES = {
    "manifest bytes": change_manifest_bytes,
    "manifest size": lambda image: write_index(
        image.layout, {**image.manifest_descriptor(), "size": image.manifest_size + 1}
    ),
    "manifest size beyond the limit": lambda image: write_index(
        image.layout, {**image.manifest_descriptor(), "size": MAX_MANIFEST_BYTES + 1}
    ),
    "nested index bytes": change_nested_index_bytes,
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_what_does_not_match_its_descriptor_is_refused(tmp_path: Path, case: str) -> None:
    image = image_in(tmp_path)
    MISMATCHES[case](image)
    assert "descriptor" in refused(image.layout).message


MALFORMED = {
    "not a descriptor": lambda image: write_index(image.layout, "oops"),  # type: ignore[arg-type]
    "annotations": lambda image: write_index(
        image.layout, {**image.manifest_descriptor(), "annotations": ["x"]}
    ),
    "nested index that is not JSON": lambda image: write_index(
        image.layout, blob_descriptor(image, b"not json")
    ),
    "nested index that is not an object": lambda image: write_index(
        image.layout, blob_descriptor(image, b"[1]")
    ),
    "nested index listing no descriptors": lambda image: write_index(
        image.layout, blob_descriptor(image, b'{"manifests": [1]}')
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_layouts_are_refused(tmp_path: Path, case: str) -> None:
    image = image_in(tmp_path)
    MALFORMED[case](image)
    refused(image.layout)


def test_a_blob_that_cannot_be_stored_leaves_no_temporary_file(tmp_path: Path) -> None:
    image = image_in(tmp_path)
    store = LocalStore(tmp_path / "store")
    layer = image.layers[0]
    (store.blob_path(layer.digest) / "in-the-way").mkdir(parents=True)  # the rename onto it fails
    with open_layout(image.layout) as layout, pytest.raises(IsADirectoryError):
        layout.copy_blob(BlobRef(layer.media_type, layer.digest, layer.size), store)
    assert list(store.ingest_dir.iterdir()) == []
