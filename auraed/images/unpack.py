"""Streaming, hostile-input safe unpacking of OCI / Docker image layers into overlayfs snapshots.

Each layer is unpacked once into its own empty snapshot directory; a container's rootfs is an
overlayfs with the snapshots as lowerdirs. OCI whiteouts therefore become overlayfs whiteouts
here, as containerd's overlay snapshotter stores them:

* ``dir/.wh.name`` -> a character device 0:0 ``dir/name``;
* ``dir/.wh..wh..opq`` -> xattr ``trusted.overlay.opaque=y`` on ``dir``, and the same marker as a
  guest reading the snapshot through virtiofsd sees it (``SHARED_OPAQUE_XATTR``: a vm pod's guest
  mounts its container's overlay over the host's snapshots, auraed.cri.guest_containers);
* other ``.wh..wh.*`` names (AUFS bookkeeping) are ignored.

The layer is read as a stream (it may still be downloading) by our own tar reader, so that every
limit is ours: PAX and GNU long-name headers are bounded, sizes and numbers are checked, and the
``diff_id`` (sha256 of the uncompressed stream) covers every byte, up to the end of the stream.

Rules for hostile input (a layer can never touch anything outside ``target``):

* Names are relative to the layer root: leading ``/`` are stripped, ``.`` and empty components
  dropped. A name with a ``..`` component or a NUL, or more than ``MAX_DEPTH`` components, is
  refused (real layers never have them).
  An entry naming the root itself (``./``) is ignored, as containerd does.
* Parents are walked one component at a time with directory fds and ``O_NOFOLLOW``: a parent that
  is a symlink (wherever it points, even inside) or not a directory is refused, never followed.
  Missing parents are created (0755, root).
* A new entry replaces an existing one of the same path (tar semantics); the old entry is removed
  first (a directory with its contents, by fd), so nothing is ever written through a symlink.
  Only directory over directory keeps the directory and updates its metadata.
* Symlink targets are stored as they are: a symlink is only dangerous when followed, and nothing
  here follows one. Hardlinks must name an existing entry of this layer, found by the same walk;
  a hardlink to a symlink links the symlink itself; the linked inode keeps its own metadata.
* GNU sparse files, multi-volume and other exotic member types are "unsupported" (image tools do
  not write them); PAX global headers are ignored, as containerd does.
* Device nodes are created only with ``allow_device_nodes`` (otherwise skipped and counted, still
  replacing an earlier entry of their name); FIFOs always. Whiteout devices are ours and always
  made. Whiteouts never hide entries of their own layer (OCI spec), so a whiteout for a name the
  layer already has is ignored.
* ``trusted.overlay.*`` / ``user.overlay.*`` / ``user.virtiofs.*`` xattrs from the tar are
  dropped: overlay metadata in a snapshot comes only from whiteout conversion. xattrs the
  filesystem refuses (ENOTSUP, EPERM, e.g. ``user.*`` on a symlink) are logged and skipped, as
  containerd does; one too large or with too long a name for it (ENOSPC, E2BIG, ERANGE) makes the
  layer "invalid".
* The tar must end with its end-of-archive block, so a truncated stream is refused (zstd cannot
  tell a truncated frame from its end; gzip can). Callers still compare ``diff_id`` with the image
  config's ``rootfs.diff_ids``.

A failed unpack leaves ``target`` in an undefined state: the caller deletes the whole directory.
Every failure is an :class:`UnpackError`, read errors of the source stream included.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import logging
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol, TypeVar, cast

import zstandard

from auraed.errors import RESOURCE_ERRNOS
from auraed.images.content import (
    OPAQUE_XATTR,
    SHARED_XATTR_PREFIX,
    mark_shared_opaque,
    remove_at,
)

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

ErrorKind = Literal["invalid", "unsupported", "exhausted", "os"]
Compression = Literal["gzip", "zstd"] | None

_OCI = "application/vnd.oci.image.layer"
_DOCKER = "application/vnd.docker.image.rootfs"
LAYER_MEDIA_TYPES: Mapping[str, Compression] = MappingProxyType(
    {
        f"{_OCI}.v1.tar": None,
        f"{_OCI}.v1.tar+gzip": "gzip",
        f"{_OCI}.v1.tar+zstd": "zstd",
        f"{_OCI}.nondistributable.v1.tar": None,
        f"{_OCI}.nondistributable.v1.tar+gzip": "gzip",
        f"{_OCI}.nondistributable.v1.tar+zstd": "zstd",
        f"{_DOCKER}.diff.tar": None,
        f"{_DOCKER}.diff.tar.gzip": "gzip",
        f"{_DOCKER}.diff.tar.zstd": "zstd",
        f"{_DOCKER}.foreign.diff.tar": None,
        f"{_DOCKER}.foreign.diff.tar.gzip": "gzip",
    }
)

BLOCK = 512
CHUNK = 1 << 20
MAX_META = 1 << 20  # PAX records and GNU long names of one entry, together
MAX_NAME = 4096  # PATH_MAX: no tool makes longer names, and it bounds the walk
MAX_DEPTH = 256  # components of a name: real images stay far below; it bounds the fds a walk holds
MAX_PAX_DIGITS = 20  # no PAX number in range has more (sizes below 2**62 have 19)
WHITEOUT = b".wh."
WHITEOUT_META = b".wh..wh."
OPAQUE = b".wh..wh..opq"
DROPPED_XATTRS = ("trusted.overlay.", "user.overlay.", SHARED_XATTR_PREFIX)

_ZERO_BLOCK = bytes(BLOCK)
_LOW_BYTES = bytes(range(128))
_OCTAL = re.compile(rb"[0-7]*")
_DECIMAL = re.compile(rb"[0-9]+")
_PAX_TIME = re.compile(rb"(-?)([0-9]+)(?:\.([0-9]*))?")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# errnos caused by what the layer says rather than by the host
_INVALID_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EINVAL}
# setxattr: a value too large for the filesystem (ENOSPC on ext4, E2BIG above 64 KiB) or too long
# a name (ERANGE); the layer's doing, not a full disk
_XATTR_TOO_LARGE_ERRNOS = {errno.ENOSPC, errno.E2BIG, errno.ERANGE}

# tar type flags
_REGULAR = {b"0", b"\0", b"7"}
_HARDLINK, _SYMLINK, _CHAR, _BLOCK, _DIR, _FIFO = b"1", b"2", b"3", b"4", b"5", b"6"
_PAX, _PAX_GLOBAL, _GNU_LONGNAME, _GNU_LONGLINK = b"x", b"g", b"L", b"K"
_HEADER_ONLY = {_HARDLINK, _SYMLINK, _CHAR, _BLOCK, _DIR, _FIFO}  # data size is ignored, as Go does

T = TypeVar("T")


class UnpackError(Exception):
    """The layer cannot be unpacked; ``kind`` is "invalid", "unsupported", "exhausted" (out of disk,
    say) or "os"."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


@dataclass(frozen=True)
class UnpackStats:
    diff_id: str  # "sha256:<hex>" of the uncompressed stream: verify it against rootfs.diff_ids
    entries: int
    bytes_written: int
    whiteouts: int
    skipped_devices: int
    # Opaque directories whose SHARED_OPAQUE_XATTR the filesystem refused (no user.* xattrs): a
    # guest reading the snapshot through virtiofsd would see what they hide.
    unshared_opaque: int = 0


# --- streams -------------------------------------------------------------------------------------


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


class _DecoderErrors(io.RawIOBase):
    """Turns a decompressor's complaints into UnpackError; the source's own errors pass through."""

    def __init__(self, inner: _Readable, what: str) -> None:
        super().__init__()
        self._inner = inner
        self._what = what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._inner.read(len(view))
        except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as exc:
            raise UnpackError("invalid", f"layer: corrupt {self._what} stream: {exc}") from exc
        view[: len(data)] = data
        return len(data)


def decompressed(stream: BinaryIO, media_type: str) -> BinaryIO:
    """A streaming decompressing reader over ``stream`` for a layer of ``media_type``.

    Memory stays bounded (zstd windows are capped at zstd's default limit). A truncated gzip
    stream is an error; a truncated zstd stream just ends early (the tar reader notices).
    """
    if media_type not in LAYER_MEDIA_TYPES:
        raise UnpackError("unsupported", f"layer media type {media_type!r} is not supported")
    compression = LAYER_MEDIA_TYPES[media_type]
    if compression is None:
        return stream
    if compression == "gzip":
        reader = _DecoderErrors(gzip.GzipFile(fileobj=stream, mode="rb"), "gzip")
    else:
        dctx = zstandard.ZstdDecompressor()
        reader = _DecoderErrors(dctx.stream_reader(stream, read_across_frames=True, closefd=False), "zstd")
    return cast(BinaryIO, reader)


class _Hashing(io.RawIOBase):
    """Hashes every byte read, and reports a failing source as UnpackError."""

    def __init__(self, inner: BinaryIO) -> None:
        super().__init__()
        self._inner = inner
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._inner.read(len(view))
        except OSError as exc:  # the source's: downloading, or storing the blob while it streams
            raise UnpackError(_machine_kind(exc), f"layer: reading the stream failed: {exc}") from exc
        self.sha256.update(data)
        view[: len(data)] = data
        return len(data)


# --- tar -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    type: bytes
    name: bytes
    linkname: bytes
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    devmajor: int
    devminor: int
    xattrs: dict[str, bytes] = field(default_factory=dict)
    label: str = ""  # the name for messages


def _label(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace") or "/"


def _number(raw: bytes, what: str) -> int:
    """A numeric header field: octal text, or GNU base-256 (bit 7 set, bit 6 the sign)."""
    if raw and raw[0] & 0x80:
        value = int.from_bytes(bytes([raw[0] & 0x7F]) + raw[1:], "big")
        return value - (1 << (8 * len(raw) - 1)) if raw[0] & 0x40 else value
    text = raw.split(b"\0", 1)[0].strip(b" ")
    if not _OCTAL.fullmatch(text):
        raise UnpackError("invalid", f"layer: tar header field {what} is not a number: {raw!r}")
    return int(text, 8) if text else 0


def _checked(value: int, low: int, high: int, what: str, label: str) -> int:
    if not low <= value <= high:
        raise UnpackError("invalid", f"{label}: {what} {value} out of range")
    return value


def _verify_checksum(block: bytes) -> None:
    expected = _number(block[148:156], "chksum")
    rest = block[:148] + block[156:]
    unsigned = sum(rest) + 8 * 0x20  # the checksum field counts as spaces
    signed = unsigned - 256 * len(rest.translate(None, _LOW_BYTES))  # some old tars sum signed chars
    if expected not in (unsigned, signed):
        raise UnpackError("invalid", "layer: tar header checksum mismatch (not a tar stream, or corrupt)")


def _parse_pax(data: bytes) -> dict[bytes, bytes]:
    """PAX records "<length> <key>=<value>\\n", parsed strictly."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 20)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if _DECIMAL.fullmatch(digits) else 0
        record = data[pos : pos + length]
        if length <= len(digits) + 1 or len(record) != length or not record.endswith(b"\n"):
            raise UnpackError("invalid", "layer: malformed PAX header record")
        key, sep, value = record[len(digits) + 1 : -1].partition(b"=")
        if not sep or not key:
            raise UnpackError("invalid", "layer: malformed PAX header record")
        records[key] = value
        pos += length
    return records


def _pax_decimal(digits: bytes, what: str, label: str) -> int:
    """A PAX number's digits; too many are refused before int(), which refuses > 4300 itself."""
    if len(digits) > MAX_PAX_DIGITS:
        raise UnpackError("invalid", f"{label}: PAX {what} out of range ({len(digits)} digits)")
    return int(digits)


def _pax_time(value: bytes, label: str) -> int:
    match = _PAX_TIME.fullmatch(value)
    if not match:
        raise UnpackError("invalid", f"{label}: bad PAX mtime {value[:100]!r}")
    sign, seconds, fraction = match.groups()
    ns = _pax_decimal(seconds, "mtime", label) * 1_000_000_000 + int((fraction or b"").ljust(9, b"0")[:9])
    return -ns if sign else ns


def _pax_int(pax: dict[bytes, bytes], key: bytes, default: int, label: str) -> int:
    value = pax.get(key)
    if not value:  # an empty value means "use the header field"
        return default
    if not _DECIMAL.fullmatch(value):
        raise UnpackError("invalid", f"{label}: bad PAX {key.decode()} {value[:100]!r}")
    return _pax_decimal(value, key.decode(), label)


def _xattrs(pax: dict[bytes, bytes], label: str) -> dict[str, bytes]:
    xattrs: dict[str, bytes] = {}
    for key, value in pax.items():
        if key.startswith(b"GNU.sparse."):
            raise UnpackError("unsupported", f"{label}: sparse files are not supported")
        if not key.startswith(b"SCHILY.xattr."):
            continue
        raw = key.removeprefix(b"SCHILY.xattr.")
        if not raw or b"\0" in raw:
            raise UnpackError("invalid", f"{label}: bad xattr name {raw!r}")
        try:
            xattrs[raw.decode("utf-8")] = value
        except UnicodeDecodeError:
            raise UnpackError("invalid", f"{label}: bad xattr name {raw!r}") from None
    return xattrs


def _cstring(raw: bytes) -> bytes:
    return raw.split(b"\0", 1)[0]


def _make_entry(block: bytes, pax: dict[bytes, bytes], longname: bytes, longlink: bytes) -> _Entry:
    """One member from its ustar/GNU header, overridden by GNU long names and then by PAX records."""
    magic = block[257:263]
    name = _cstring(block[0:100])
    prefix = _cstring(block[345:500]) if magic == b"ustar\0" else b""  # GNU keeps times there
    name = pax.get(b"path") or longname or (prefix + b"/" + name if prefix else name)
    linkname = pax.get(b"linkpath") or longlink or _cstring(block[157:257])
    label = _label(name)
    kind = block[156:157]
    if kind == b"\0" and name.endswith(b"/"):
        kind = _DIR  # pre-POSIX tars mark directories by the name only
    ustar = magic.startswith(b"ustar")
    size = _pax_int(pax, b"size", _number(block[124:136], "size"), label)
    mtime = pax.get(b"mtime")
    mtime_ns = _pax_time(mtime, label) if mtime else _number(block[136:148], "mtime") * 1_000_000_000
    return _Entry(
        label=label,
        type=kind,
        name=name,
        linkname=linkname,
        size=_checked(0 if kind in _HEADER_ONLY else size, 0, 1 << 62, "size", label),
        mode=_number(block[100:108], "mode") & 0o7777,
        uid=_checked(
            _pax_int(pax, b"uid", _number(block[108:116], "uid"), label), 0, 2**32 - 2, "uid", label
        ),
        gid=_checked(
            _pax_int(pax, b"gid", _number(block[116:124], "gid"), label), 0, 2**32 - 2, "gid", label
        ),
        mtime_ns=_checked(mtime_ns, -(1 << 62), 1 << 62, "mtime", label),
        devmajor=_checked(_number(block[329:337], "devmajor") if ustar else 0, 0, 2**32 - 1, "major", label),
        devminor=_checked(_number(block[337:345], "devminor") if ustar else 0, 0, 2**32 - 1, "minor", label),
        xattrs=_xattrs(pax, label),
    )


class _TarReader:
    """A streaming tar reader: iterate :meth:`entries`, read a file's data with :meth:`read`."""

    def __init__(self, stream: BinaryIO) -> None:
        self._hashing = _Hashing(stream)
        self._src = io.BufferedReader(self._hashing, CHUNK)
        self._left = 0  # unread data of the current member
        self._pad = 0  # padding after it
        self._label = "layer"

    def _read_exact(self, size: int) -> bytes:
        data = self._src.read(size)
        if len(data) != size:
            raise UnpackError(
                "invalid", f"{self._label}: stream truncated (tar header says more than there is)"
            )
        return data

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes of the current member's data; b"" at its end."""
        data = self._read_exact(min(size, self._left))
        self._left -= len(data)
        return data

    def _skip(self) -> None:
        while self._left:
            self.read(CHUNK)
        self._read_exact(self._pad)
        self._pad = 0

    def _begin(self, size: int, label: str) -> None:
        self._left, self._pad, self._label = size, -size % BLOCK, label

    def _meta(self, size: int, total: int) -> bytes:
        if size + total > MAX_META:
            raise UnpackError("invalid", f"layer: tar extended headers larger than {MAX_META} bytes")
        self._begin(size, "layer")
        data = self.read(size)
        self._skip()
        return data

    def entries(self) -> Iterator[_Entry]:
        pax: dict[bytes, bytes] = {}
        longname = longlink = b""
        meta = 0
        while True:
            self._skip()
            block = self._src.read(BLOCK)
            if not block:
                raise UnpackError("invalid", "layer: stream truncated (no tar end-of-archive block)")
            if len(block) != BLOCK:
                raise UnpackError("invalid", "layer: stream truncated inside a tar header")
            if block == _ZERO_BLOCK:
                return
            _verify_checksum(block)
            kind, size = block[156:157], _number(block[124:136], "size")
            if kind in (_PAX, _PAX_GLOBAL, _GNU_LONGNAME, _GNU_LONGLINK):
                data = self._meta(_checked(size, 0, MAX_META, "extended header size", "layer"), meta)
                meta += len(data)
                if kind == _PAX:
                    pax.update(_parse_pax(data))
                elif kind == _GNU_LONGNAME:
                    longname = _cstring(data)
                elif kind == _GNU_LONGLINK:
                    longlink = _cstring(data)
                continue  # PAX global headers carry comments only; ignored, as containerd does
            entry = _make_entry(block, pax, longname, longlink)
            self._begin(entry.size, entry.label)
            yield entry
            pax, longname, longlink, meta = {}, b"", b"", 0

    def finish(self) -> str:
        """Read to the end of the stream (the diff_id covers it all) and return the diff_id."""
        self._skip()
        while self._src.read(CHUNK):
            pass
        return "sha256:" + self._hashing.sha256.hexdigest()


# --- the filesystem side -------------------------------------------------------------------------


@contextlib.contextmanager
def _os_errors(label: str, action: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        kind = "invalid" if exc.errno in _INVALID_ERRNOS else _machine_kind(exc)
        raise UnpackError(kind, f"{label}: cannot {action}: {exc.strerror or exc}") from exc


def _machine_kind(exc: OSError) -> ErrorKind:
    """An OSError that is not the layer's fault: the machine ran out of something, or failed."""
    return "exhausted" if exc.errno in RESOURCE_ERRNOS else "os"


def _clean(name: bytes, label: str) -> tuple[bytes, ...]:
    """The components of a layer path below the root; "" and "." dropped, ".." and NUL refused."""
    if b"\0" in name:
        raise UnpackError("invalid", f"{label}: name contains NUL")
    if len(name) > MAX_NAME:
        raise UnpackError("invalid", f"{label}: name longer than {MAX_NAME} bytes")
    parts = tuple(part for part in name.split(b"/") if part not in (b"", b"."))
    if b".." in parts:
        raise UnpackError("invalid", f"{label}: name has a '..' component")
    if len(parts) > MAX_DEPTH:
        raise UnpackError("invalid", f"{label}: name has {len(parts)} components, more than {MAX_DEPTH}")
    return parts


class _Tree:
    """Directories of the snapshot, opened by walking components with O_NOFOLLOW from the root fd.

    Open directory fds are cached by path (tar members come grouped by directory); removing a
    directory forgets it and everything below it. The cache is trimmed only between entries, so
    an fd handed out stays valid for the whole entry.
    """

    MAX_CACHED = 256

    def __init__(self, root: int) -> None:
        self.root = root
        self._cache: dict[tuple[bytes, ...], int] = {}

    def dir(self, parts: tuple[bytes, ...], *, create: bool, label: str) -> int:
        fd = self._cache.get(parts) if parts else self.root
        if fd is not None:
            return fd
        depth = len(parts) - 1
        while depth and parts[:depth] not in self._cache:
            depth -= 1
        fd = self._cache[parts[:depth]] if depth else self.root
        for i in range(depth, len(parts)):
            fd = self._open_child(fd, parts[i], create=create, label=label, path=parts[: i + 1])
            self._cache[parts[: i + 1]] = fd
        return fd

    @staticmethod
    def _open_child(parent: int, name: bytes, *, create: bool, label: str, path: tuple[bytes, ...]) -> int:
        shown = _label(b"/".join(path))
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise UnpackError("invalid", f"{label}: {shown} does not exist in this layer") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnpackError("invalid", f"{label}: {shown} is a symlink or not a directory") from None
            raise UnpackError("os", f"{label}: cannot open {shown}: {exc.strerror}") from exc
        with _os_errors(label, f"create directory {shown}"):
            os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            os.chmod(fd, 0o755)  # explicit: the daemon's umask must not shape the image
        return fd

    def remove(self, parent: int, base: bytes, parts: tuple[bytes, ...], label: str) -> None:
        """Remove whatever is at ``parts``, if anything: a directory with its contents, by fd,
        never following a symlink."""
        self.forget(parts)
        with _os_errors(label, "replace the existing entry"), contextlib.suppress(FileNotFoundError):
            remove_at(base, parent)

    def forget(self, prefix: tuple[bytes, ...]) -> None:
        for key in [key for key in self._cache if key[: len(prefix)] == prefix]:
            os.close(self._cache.pop(key))

    def trim(self) -> None:
        if len(self._cache) > self.MAX_CACHED:
            self.close()

    def close(self) -> None:
        for fd in self._cache.values():
            os.close(fd)
        self._cache.clear()


class _Writer:
    """Applies tar members to the snapshot below ``tree.root``."""

    def __init__(self, tree: _Tree, reader: _TarReader, *, allow_devices: bool, owners: bool) -> None:
        self._tree = tree
        self._reader = reader
        self._allow_devices = allow_devices
        self._owners = owners
        self._dir_times: dict[tuple[bytes, ...], int] = {}  # the last entry of a directory wins
        self._skipped: set[tuple[bytes, ...]] = set()
        self.entries = self.bytes_written = self.whiteouts = self.skipped_devices = 0
        self.unshared_opaque = 0

    def apply(self, entry: _Entry) -> None:
        self.entries += 1
        self._tree.trim()
        parts = _clean(entry.name, entry.label)
        if not parts:
            return  # the layer root: the snapshot directory is the caller's, as in containerd
        self._skipped.discard(parts)  # a device skipped here before is replaced by this entry
        if parts[-1].startswith(WHITEOUT):
            self._whiteout(entry, parts)
            return
        parent = self._tree.dir(parts[:-1], create=True, label=entry.label)
        if entry.type in _REGULAR:
            self._file(entry, parent, parts)
        elif entry.type == _DIR:
            self._directory(entry, parent, parts)
        elif entry.type == _SYMLINK:
            self._symlink(entry, parent, parts)
        elif entry.type == _HARDLINK:
            self._hardlink(entry, parent, parts)
        elif entry.type in (_CHAR, _BLOCK, _FIFO):
            self._special(entry, parent, parts)
        else:
            raise UnpackError(
                "unsupported", f"{entry.label}: tar member type {entry.type!r} is not supported"
            )

    def _replacing(self, create: Callable[[], T], parent: int, parts: tuple[bytes, ...], label: str) -> T:
        """Create an entry, first removing an existing one of that name (never writing through it)."""
        try:
            return create()
        except FileExistsError:
            self._tree.remove(parent, parts[-1], parts, label)
        return create()

    def _file(self, entry: _Entry, parent: int, parts: tuple[bytes, ...]) -> None:
        with _os_errors(entry.label, "create the file"):
            create = partial(os.open, parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
            fd = self._replacing(create, parent, parts, entry.label)
        try:
            self._copy(entry, fd)
            with _os_errors(entry.label, "set file metadata"):
                self._metadata_fd(entry, fd)
                os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        finally:
            os.close(fd)

    def _copy(self, entry: _Entry, fd: int) -> None:
        while data := self._reader.read(CHUNK):
            view = memoryview(data)
            with _os_errors(entry.label, "write the file"):
                while view:
                    view = view[os.write(fd, view) :]
            self.bytes_written += len(data)

    def _directory(self, entry: _Entry, parent: int, parts: tuple[bytes, ...]) -> None:
        with _os_errors(entry.label, "create the directory"):
            try:
                os.mkdir(parts[-1], 0o700, dir_fd=parent)
            except FileExistsError:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):  # directory over directory merges; others replace
                    self._tree.remove(parent, parts[-1], parts, entry.label)
                    os.mkdir(parts[-1], 0o700, dir_fd=parent)
        fd = self._tree.dir(parts, create=False, label=entry.label)
        with _os_errors(entry.label, "set directory metadata"):
            self._metadata_fd(entry, fd)
        self._dir_times[parts] = entry.mtime_ns  # set after its contents: see finish()

    def _symlink(self, entry: _Entry, parent: int, parts: tuple[bytes, ...]) -> None:
        if not entry.linkname or b"\0" in entry.linkname:
            raise UnpackError("invalid", f"{entry.label}: bad symlink target {entry.linkname!r}")
        with _os_errors(entry.label, "create the symlink"):
            create = partial(os.symlink, entry.linkname, parts[-1], dir_fd=parent)
            self._replacing(create, parent, parts, entry.label)
            self._metadata_at(entry, parent, parts[-1], symlink=True)

    def _hardlink(self, entry: _Entry, parent: int, parts: tuple[bytes, ...]) -> None:
        source = _clean(entry.linkname, entry.label)
        if not source:
            raise UnpackError("invalid", f"{entry.label}: hardlink to the layer root")
        if source in self._skipped:  # a link to a device node we did not make
            self._skip_device(parent, parts, entry.label)
            return
        if source == parts:
            return

        def link() -> None:  # resolves the source on each try: replacing may have removed it
            source_dir = self._tree.dir(source[:-1], create=False, label=entry.label)
            os.link(source[-1], parts[-1], src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)

        try:
            with _os_errors(entry.label, f"hardlink to {_label(entry.linkname)}"):
                self._replacing(link, parent, parts, entry.label)
        except UnpackError as exc:
            if isinstance(exc.__cause__, FileNotFoundError | PermissionError):  # missing, or a dir
                raise UnpackError("invalid", str(exc)) from exc.__cause__
            raise

    def _special(self, entry: _Entry, parent: int, parts: tuple[bytes, ...]) -> None:
        if entry.type == _FIFO:
            make = partial(os.mkfifo, parts[-1], 0o600, dir_fd=parent)
        elif not self._allow_devices:
            self._skip_device(parent, parts, entry.label)
            return
        else:
            kind = stat.S_IFCHR if entry.type == _CHAR else stat.S_IFBLK
            device = os.makedev(entry.devmajor, entry.devminor)
            make = partial(os.mknod, parts[-1], kind | 0o600, device, dir_fd=parent)
        with _os_errors(entry.label, "create the node"):
            self._replacing(make, parent, parts, entry.label)
            self._metadata_at(entry, parent, parts[-1], symlink=False)

    def _skip_device(self, parent: int, parts: tuple[bytes, ...], label: str) -> None:
        """A device node not made: counted, and like any entry it replaces one of its name."""
        self._tree.remove(parent, parts[-1], parts, label)
        self.skipped_devices += 1
        self._skipped.add(parts)

    def _whiteout(self, entry: _Entry, parts: tuple[bytes, ...]) -> None:
        parent = self._tree.dir(parts[:-1], create=True, label=entry.label)
        base = parts[-1]
        if base == OPAQUE:
            with _os_errors(entry.label, "mark the directory opaque"):
                os.setxattr(parent, OPAQUE_XATTR, b"y")
                if not mark_shared_opaque(parent):
                    self.unshared_opaque += 1
            self.whiteouts += 1
            return
        if base.startswith(WHITEOUT_META):
            return  # AUFS bookkeeping (.wh..wh.plnk, ...): nothing to do on overlayfs
        name = base.removeprefix(WHITEOUT)
        if name in (b"", b".", b".."):
            raise UnpackError("invalid", f"{entry.label}: whiteout of {name!r}")
        with _os_errors(entry.label, "create the whiteout"):
            try:
                os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=parent)
            except FileExistsError:
                return  # whiteouts hide lower layers only, never entries of their own layer
        self.whiteouts += 1

    def _metadata_fd(self, entry: _Entry, fd: int) -> None:
        """Owner, then mode (chown clears setuid/setgid), then xattrs (chown clears capabilities)."""
        if self._owners:
            os.chown(fd, entry.uid, entry.gid)
        os.chmod(fd, entry.mode)
        for name, value in self._wanted_xattrs(entry):
            self._setxattr(entry, fd, name, value)

    def _metadata_at(self, entry: _Entry, parent: int, base: bytes, *, symlink: bool) -> None:
        """Metadata of a symlink, FIFO or device node: by name, never opening (or following) it."""
        if self._owners:
            os.chown(base, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
        if not symlink:  # symlinks have no mode of their own on Linux
            os.chmod(base, entry.mode, dir_fd=parent)  # just created by us: not a symlink
        for name, value in self._wanted_xattrs(entry):
            # the magic /proc link resolves to the very directory fd; the last component is not followed
            path = f"/proc/self/fd/{parent}/".encode() + base
            self._setxattr(entry, path, name, value)
        os.utime(base, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=parent, follow_symlinks=False)

    @staticmethod
    def _wanted_xattrs(entry: _Entry) -> Iterator[tuple[str, bytes]]:
        for name, value in entry.xattrs.items():
            if name.startswith(DROPPED_XATTRS):
                log.debug("%s: dropping overlay xattr %s from the layer", entry.label, name)
            else:
                yield name, value

    @staticmethod
    def _setxattr(entry: _Entry, target: int | bytes, name: str, value: bytes) -> None:
        try:
            if isinstance(target, int):
                os.setxattr(target, name, value)
            else:
                os.setxattr(target, name, value, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in _XATTR_TOO_LARGE_ERRNOS:
                raise UnpackError(
                    "invalid", f"{entry.label}: xattr {name[:100]} ({len(value)} bytes): {exc.strerror}"
                ) from exc
            if exc.errno not in (errno.ENOTSUP, errno.EPERM):
                raise
            log.warning("%s: xattr %s not set: %s", entry.label, name, exc.strerror)

    def finish(self) -> None:
        """Directory mtimes, now that nothing more is created in them (utime leaves the parent's)."""
        for parts, mtime_ns in self._dir_times.items():
            self._tree.trim()
            label = _label(b"/".join(parts))
            try:
                fd = self._tree.dir(parts, create=False, label=label)
            except UnpackError:
                continue  # replaced by a later entry
            with _os_errors(label, "set the directory mtime"):
                os.utime(fd, ns=(mtime_ns, mtime_ns))


def _open_target(target: Path) -> int:
    try:
        root = os.open(target, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the caller's path is trusted
    except OSError as exc:
        raise UnpackError("os", f"{target}: cannot open the snapshot directory: {exc.strerror}") from exc
    if os.listdir(root):
        os.close(root)
        raise UnpackError("invalid", f"{target}: the snapshot directory is not empty")
    return root


def unpack_layer(
    stream: BinaryIO,
    target: Path,
    *,
    media_type: str,
    allow_device_nodes: bool = False,
    preserve_ownership: bool = True,
) -> UnpackStats:
    """Unpack the (compressed) layer read from ``stream`` into the empty directory ``target``.

    Reads ``stream`` to its end. On UnpackError ``target`` is in an undefined state: delete it.
    """
    reader = _TarReader(decompressed(stream, media_type))
    tree = _Tree(_open_target(target))
    writer = _Writer(tree, reader, allow_devices=allow_device_nodes, owners=preserve_ownership)
    try:
        for entry in reader.entries():
            writer.apply(entry)
        writer.finish()
        diff_id = reader.finish()
    finally:
        tree.close()
        os.close(tree.root)
    return UnpackStats(
        diff_id=diff_id,
        entries=writer.entries,
        bytes_written=writer.bytes_written,
        whiteouts=writer.whiteouts,
        skipped_devices=writer.skipped_devices,
        unshared_opaque=writer.unshared_opaque,
    )
