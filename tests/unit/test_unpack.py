"""Layer unpacking into overlayfs snapshots: fidelity, whiteouts, a real overlay mount, hostile layers.

Every layer here is built by hand in memory with tarfile (plus raw headers where tarfile refuses to
write the hostile thing). Malicious layers run in ``tmp_path`` with ``target`` and an empty
``sentinel`` directory side by side; after each one, the sentinel must still be empty and nothing
else may have appeared (also not at a unique absolute path under /tmp).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auraed.images.unpack import (
    LAYER_MEDIA_TYPES,
    MAX_DEPTH,
    UnpackError,
    UnpackStats,
    decompressed,
    unpack_layer,
)

TAR = "application/vnd.oci.image.layer.v1.tar"
GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
MEDIA_TYPES = [TAR, GZIP, ZSTD]
MTIME = 1_600_000_000
# security.capability v2, effective, cap_net_raw permitted
CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


Member = tuple[tarfile.TarInfo, bytes]


def member(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    *,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = MTIME,
    link: str = "",
    xattrs: dict[str, bytes] | None = None,
    major: int = 0,
    minor: int = 0,
) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, mtime
    info.linkname = link
    info.devmajor, info.devminor = major, minor
    info.pax_headers = {
        f"SCHILY.xattr.{key}": value.decode("utf-8", "surrogateescape")
        for key, value in (xattrs or {}).items()
    }
    return info, data


def layer(*members: Member, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def compress(data: bytes, media_type: str) -> bytes:
    compression = LAYER_MEDIA_TYPES[media_type]
    if compression == "gzip":
        return gzip.compress(data)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def unpack(
    data: bytes,
    target: Path,
    media_type: str = TAR,
    *,
    allow_device_nodes: bool = False,
    preserve_ownership: bool = True,
) -> UnpackStats:
    return unpack_layer(
        io.BytesIO(compress(data, media_type)),
        target,
        media_type=media_type,
        allow_device_nodes=allow_device_nodes,
        preserve_ownership=preserve_ownership,
    )


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length).encode() + body) != length:
        length += 1
    return str(length).encode() + body


def raw_member(info: tarfile.TarInfo, data: bytes = b"", pax: dict[bytes, bytes] | None = None) -> bytes:
    """One member as raw bytes (ustar header), optionally preceded by a hand-made PAX header."""
    out = b""
    if pax:
        records = b"".join(pax_record(key, value) for key, value in pax.items())
        header = tarfile.TarInfo("PaxHeader")
        header.type, header.size = tarfile.XHDTYPE, len(records)
        out += header.tobuf(format=tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512)
    out += info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)
    return out


EOF_BLOCKS = bytes(1024)


def xattr(path: Path, name: str) -> bytes:
    return os.getxattr(path, name, follow_symlinks=False)


@dataclass
class Box:
    """A target directory with an empty sentinel next to it, and a unique absolute path to watch."""

    root: Path
    target: Path
    sentinel: Path
    outside: str  # an absolute path under /tmp that must never be created

    def assert_untouched(self) -> None:
        assert list(self.sentinel.iterdir()) == []
        assert sorted(p.name for p in self.root.iterdir()) == ["sentinel", "target"]
        assert not os.path.lexists(self.outside)

    def refuse(self, data: bytes, match: str) -> UnpackError:
        with pytest.raises(UnpackError, match=match) as info:
            unpack(data, self.target)
        self.assert_untouched()
        return info.value


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    (tmp_path / "target").mkdir()
    (tmp_path / "sentinel").mkdir()
    outside = f"/tmp/auraed-unpack-{uuid.uuid4().hex}"
    yield Box(tmp_path, tmp_path / "target", tmp_path / "sentinel", outside)
    assert not os.path.lexists(outside)


# --- a normal layer ------------------------------------------------------------------------------


def normal_layer() -> bytes:
    return layer(
        member("etc/", tarfile.DIRTYPE, mode=0o755, mtime=MTIME + 1),
        member("etc/motd", data=b"hello\n", mode=0o640, uid=1000, gid=1000, mtime=MTIME + 2),
        member("etc/passwd-link", tarfile.SYMTYPE, link="/etc/passwd", uid=1000, gid=1000, mtime=MTIME + 3),
        member("usr/", tarfile.DIRTYPE, mode=0o755),
        member("usr/bin/", tarfile.DIRTYPE, mode=0o755, mtime=MTIME + 4),
        member(
            "usr/bin/ping",
            data=b"\x7fELF" + os.urandom(3000),
            mode=0o4755,
            uid=1000,
            gid=1000,
            xattrs={"user.test": b"value", "security.capability": CAP_NET_RAW},
        ),
        member("usr/bin/ping2", tarfile.LNKTYPE, link="usr/bin/ping"),
        member("usr/bin/rel", tarfile.SYMTYPE, link="ping"),
        member("shared/", tarfile.DIRTYPE, mode=0o2775, gid=1000),
        member("tmp/", tarfile.DIRTYPE, mode=0o1777),
        member("run/fifo", tarfile.FIFOTYPE, mode=0o620, uid=1000, gid=1000, mtime=MTIME + 5),
        member("big", data=os.urandom(3 << 20), mode=0o600),
    )


@pytest.mark.parametrize("media_type", MEDIA_TYPES)
def test_normal_layer_round_trips(tmp_path: Path, media_type: str) -> None:
    data = normal_layer()
    stats = unpack(data, tmp_path, media_type)
    assert stats == UnpackStats(sha256(data), 12, 6 + 3004 + (3 << 20), 0, 0)

    etc, ping = tmp_path / "etc", tmp_path / "usr/bin/ping"
    motd = (etc / "motd").lstat()
    assert (etc / "motd").read_bytes() == b"hello\n"
    assert (stat.S_IMODE(motd.st_mode), motd.st_uid, motd.st_gid) == (0o640, 1000, 1000)
    assert motd.st_mtime_ns == (MTIME + 2) * 10**9
    assert etc.stat().st_mtime_ns == (MTIME + 1) * 10**9  # set after its contents
    assert (tmp_path / "usr/bin").stat().st_mtime_ns == (MTIME + 4) * 10**9

    link = (etc / "passwd-link").lstat()
    assert os.readlink(etc / "passwd-link") == "/etc/passwd"  # stored as is, never followed
    assert (stat.S_ISLNK(link.st_mode), link.st_uid, link.st_mtime_ns) == (True, 1000, (MTIME + 3) * 10**9)
    assert os.readlink(tmp_path / "usr/bin/rel") == "ping"

    st_ping = ping.lstat()
    assert (stat.S_IMODE(st_ping.st_mode), st_ping.st_uid, st_ping.st_nlink) == (0o4755, 1000, 2)
    assert xattr(ping, "user.test") == b"value"
    assert xattr(ping, "security.capability") == CAP_NET_RAW
    assert (tmp_path / "usr/bin/ping2").lstat().st_ino == st_ping.st_ino

    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o2775
    assert stat.S_IMODE((tmp_path / "tmp").stat().st_mode) == 0o1777
    fifo = (tmp_path / "run/fifo").lstat()
    assert (stat.S_ISFIFO(fifo.st_mode), stat.S_IMODE(fifo.st_mode), fifo.st_uid) == (True, 0o620, 1000)
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o755  # implicit parent


def test_ownership_can_be_left_alone(tmp_path: Path) -> None:
    unpack(layer(member("f", data=b"x", uid=1234, gid=1234)), tmp_path, preserve_ownership=False)
    assert (tmp_path / "f").stat().st_uid == os.geteuid()


@pytest.mark.parametrize("media_type", MEDIA_TYPES)
def test_diff_id_covers_the_whole_uncompressed_stream(tmp_path: Path, media_type: str) -> None:
    data = layer(member("a", data=b"x" * 5000)) + bytes(10240) + b"trailing bytes after the archive"
    stats = unpack(data, tmp_path, media_type)
    assert stats.diff_id == sha256(data)
    assert sha256(compress(data, media_type)) != stats.diff_id or media_type == TAR


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_in_every_tar_format(tmp_path: Path, fmt: int) -> None:
    deep = "/".join(["d" * 60] * 2) + "/" + "f" * 80  # fits ustar's prefix + name
    link = "x" * (90 if fmt == tarfile.USTAR_FORMAT else 150)  # ustar has no long links
    unpack(layer(member(deep, data=b"deep"), member("l", tarfile.SYMTYPE, link=link), fmt=fmt), tmp_path)
    assert (tmp_path / deep).read_bytes() == b"deep"
    assert os.readlink(tmp_path / "l") == link


def test_pax_numbers_beyond_ustar(tmp_path: Path) -> None:
    info, _ = member("f", uid=3_000_000, gid=3_000_001)
    info.mtime = MTIME + 0.25  # tarfile writes a fractional PAX mtime
    unpack(layer((info, b"")), tmp_path)
    st_f = (tmp_path / "f").stat()
    assert (st_f.st_uid, st_f.st_gid, st_f.st_mtime_ns) == (3_000_000, 3_000_001, MTIME * 10**9 + 250_000_000)


def test_later_entries_replace_earlier_ones(tmp_path: Path) -> None:
    data = layer(
        member("x/", tarfile.DIRTYPE),
        member("x/inner", data=b"1"),
        member("x", data=b"now a file"),  # replaces the directory and its contents
        member("y", data=b"old"),
        member("y", data=b"new"),
        member("z", tarfile.SYMTYPE, link="y"),
        member("z/", tarfile.DIRTYPE),  # a directory replaces the symlink
        member("z/in", data=b"in"),
        member("m/", tarfile.DIRTYPE, mtime=MTIME),
        member("m/", tarfile.DIRTYPE, mtime=MTIME + 9),  # the last word on a directory wins
    )
    unpack(data, tmp_path)
    assert (tmp_path / "m").stat().st_mtime_ns == (MTIME + 9) * 10**9
    assert (tmp_path / "x").read_bytes() == b"now a file"
    assert (tmp_path / "y").read_bytes() == b"new"
    assert (tmp_path / "z").is_dir() and not (tmp_path / "z").is_symlink()
    assert (tmp_path / "z/in").read_bytes() == b"in"


def test_root_entry_is_ignored_and_target_must_be_empty(tmp_path: Path) -> None:
    before = tmp_path.stat()
    data = layer(member("./", tarfile.DIRTYPE, mode=0o751, uid=5), member("./f", data=b"f"))
    stats = unpack(data, tmp_path)
    assert stats.entries == 2
    after = tmp_path.stat()
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    with pytest.raises(UnpackError, match="not empty"):
        unpack(layer(), tmp_path)


# --- whiteouts -----------------------------------------------------------------------------------


def test_whiteout_becomes_an_overlay_whiteout_device(tmp_path: Path) -> None:
    data = layer(
        member("etc/", tarfile.DIRTYPE),
        member("etc/.wh.passwd"),
        member("etc/.wh..wh.plnk"),  # AUFS bookkeeping: ignored
        member("gone/deeper/.wh.x"),  # parents created on the way
    )
    stats = unpack(data, tmp_path)
    assert stats.whiteouts == 2
    for path in (tmp_path / "etc/passwd", tmp_path / "gone/deeper/x"):
        st_wh = path.lstat()
        assert stat.S_ISCHR(st_wh.st_mode) and st_wh.st_rdev == os.makedev(0, 0)
    assert sorted(os.listdir(tmp_path / "etc")) == ["passwd"]


def test_opaque_directory_gets_the_overlay_xattr(tmp_path: Path) -> None:
    data = layer(member("d/", tarfile.DIRTYPE), member("d/.wh..wh..opq"), member("d/new", data=b"n"))
    stats = unpack(data, tmp_path)
    assert stats.whiteouts == 1
    assert xattr(tmp_path / "d", "trusted.overlay.opaque") == b"y"
    # And where a guest reading it through virtiofsd finds its trusted.overlay.opaque.
    assert xattr(tmp_path / "d", "user.virtiofs.trusted.overlay.opaque") == b"y"
    assert stats.unshared_opaque == 0
    assert os.listdir(tmp_path / "d") == ["new"]


def test_whiteout_never_hides_its_own_layer(tmp_path: Path) -> None:
    stats = unpack(layer(member("a", data=b"mine"), member(".wh.a")), tmp_path)
    assert (tmp_path / "a").read_bytes() == b"mine"
    assert stats.whiteouts == 0


def test_overlay_xattrs_from_the_tar_are_dropped(tmp_path: Path) -> None:
    marks = {"trusted.overlay.opaque": b"y", "user.virtiofs.trusted.overlay.opaque": b"y", "user.keep": b"1"}
    unpack(layer(member("d/", tarfile.DIRTYPE, xattrs=marks)), tmp_path)
    assert os.listxattr(tmp_path / "d") == ["user.keep"]


def test_three_layers_through_a_real_overlay_mount(tmp_path: Path) -> None:
    layers = [
        layer(
            member("a/", tarfile.DIRTYPE),
            member("a/keep", data=b"keep"),
            member("a/gone", data=b"gone"),
            member("o/", tarfile.DIRTYPE),
            member("o/old1", data=b"1"),
            member("o/sub/old2", data=b"2"),
            member("top", data=b"top"),
        ),
        layer(
            member("a/", tarfile.DIRTYPE),
            member("a/.wh.gone"),
            member("o/", tarfile.DIRTYPE),
            member("o/.wh..wh..opq"),
            member("o/new2", data=b"new2"),
        ),
        layer(member("a/", tarfile.DIRTYPE), member("a/added", data=b"added"), member("new/file", data=b"f")),
    ]
    snapshots = []
    for i, data in enumerate(layers, 1):
        snapshot = tmp_path / f"l{i}"
        snapshot.mkdir()
        unpack(data, snapshot, GZIP)
        snapshots.append(snapshot)
    upper, work, merged = tmp_path / "upper", tmp_path / "work", tmp_path / "merged"
    for path in (upper, work, merged):
        path.mkdir()
    lower = ":".join(str(s) for s in reversed(snapshots))
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        assert sorted(os.listdir(merged / "a")) == ["added", "keep"]
        assert (merged / "a/keep").read_bytes() == b"keep"
        assert sorted(os.listdir(merged / "o")) == ["new2"]  # opaque: only layer 2's entries
        assert (merged / "top").read_bytes() == b"top"
        assert (merged / "new/file").read_bytes() == b"f"
        assert sorted(os.listdir(merged)) == ["a", "new", "o", "top"]
    finally:
        subprocess.run(["umount", str(merged)], check=True)


# --- device nodes --------------------------------------------------------------------------------


def device_layer() -> bytes:
    return layer(
        member("dev/null", tarfile.CHRTYPE, mode=0o666, major=1, minor=3),
        member("dev/loop0", tarfile.BLKTYPE, mode=0o660, major=7, minor=0),
        member("dev/null2", tarfile.LNKTYPE, link="dev/null"),
    )


def test_device_nodes_are_skipped_by_default(box: Box) -> None:
    stats = unpack(device_layer(), box.target)
    assert (stats.skipped_devices, stats.entries) == (3, 3)
    assert os.listdir(box.target / "dev") == []
    box.assert_untouched()


def test_device_nodes_when_allowed(box: Box) -> None:
    stats = unpack(device_layer(), box.target, allow_device_nodes=True)
    assert stats.skipped_devices == 0
    null, loop = (box.target / "dev/null").lstat(), (box.target / "dev/loop0").lstat()
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    assert stat.S_IMODE(null.st_mode) == 0o666 and null.st_nlink == 2
    assert stat.S_ISBLK(loop.st_mode) and loop.st_rdev == os.makedev(7, 0)


def test_a_skipped_device_replaces_and_is_replaced_like_any_entry(box: Box) -> None:
    data = layer(
        member("dev", tarfile.CHRTYPE, major=1, minor=3),  # skipped
        member("dev", data=b"a file now"),
        member("link", tarfile.LNKTYPE, link="dev"),  # links the file
        member("x", data=b"replaced by a device"),
        member("x", tarfile.CHRTYPE, major=1, minor=3),  # skipped, and x is gone
    )
    assert unpack(data, box.target).skipped_devices == 2
    assert sorted(os.listdir(box.target)) == ["dev", "link"]
    assert (box.target / "link").stat().st_ino == (box.target / "dev").stat().st_ino
    box.assert_untouched()


# --- hostile layers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "a/b/../../../evil", "../sentinel/evil"])
def test_dotdot_names_are_refused(box: Box, name: str) -> None:
    box.refuse(layer(member(name, data=b"evil")), "'..' component")


def test_absolute_names_stay_inside(box: Box) -> None:
    unpack(layer(member("/abs/evil", data=b"1"), member(box.outside, data=b"2")), box.target)
    assert (box.target / "abs/evil").read_bytes() == b"1"
    assert (box.target / box.outside.lstrip("/")).read_bytes() == b"2"
    box.assert_untouched()


@pytest.mark.parametrize("link", ["ABS_SENTINEL", "../sentinel", "/tmp", "OUTSIDE"])
def test_file_through_a_symlinked_parent_is_refused(box: Box, link: str) -> None:
    link = {"ABS_SENTINEL": str(box.sentinel), "OUTSIDE": box.outside}.get(link, link)
    data = layer(member("a", tarfile.SYMTYPE, link=link), member("a/evil", data=b"evil"))
    box.refuse(data, "a/evil: a is a symlink")


def test_symlinked_parent_pointing_inside_is_refused_too(box: Box) -> None:
    data = layer(member("real/", tarfile.DIRTYPE), member("a", tarfile.SYMTYPE, link="real"), member("a/x"))
    box.refuse(data, "symlink")


def test_directory_entry_through_a_symlinked_parent_is_refused(box: Box) -> None:
    data = layer(member("a", tarfile.SYMTYPE, link=str(box.sentinel)), member("a/d/", tarfile.DIRTYPE))
    box.refuse(data, "symlink")


@pytest.mark.parametrize("link", ["../../etc/passwd", "../sentinel/x", "/etc/passwd", "missing"])
def test_hardlinks_out_of_the_layer_are_refused(box: Box, link: str) -> None:
    nlink = os.stat("/etc/passwd").st_nlink
    box.refuse(
        layer(member("h", tarfile.LNKTYPE, link=link)), r"'..' component|does not exist|cannot hardlink"
    )
    assert os.stat("/etc/passwd").st_nlink == nlink


def test_absolute_hardlink_target_is_relative_to_the_layer(box: Box) -> None:
    unpack(layer(member("f", data=b"f"), member("h", tarfile.LNKTYPE, link="/f")), box.target)
    assert (box.target / "h").stat().st_ino == (box.target / "f").stat().st_ino


def test_hardlink_through_a_symlinked_parent_is_refused(box: Box) -> None:
    nlink = os.stat("/etc/passwd").st_nlink
    data = layer(member("l", tarfile.SYMTYPE, link="/etc"), member("h", tarfile.LNKTYPE, link="l/passwd"))
    box.refuse(data, "symlink")
    assert os.stat("/etc/passwd").st_nlink == nlink


def test_hardlink_to_a_directory_is_refused(box: Box) -> None:
    data = layer(member("d/", tarfile.DIRTYPE), member("h", tarfile.LNKTYPE, link="d"))
    assert box.refuse(data, "cannot hardlink").kind == "invalid"


def test_hardlink_to_an_outward_symlink_links_the_symlink_itself(box: Box) -> None:
    nlink = os.stat("/etc/passwd").st_nlink
    data = layer(member("s", tarfile.SYMTYPE, link="/etc/passwd"), member("h", tarfile.LNKTYPE, link="s"))
    unpack(data, box.target)
    assert stat.S_ISLNK((box.target / "h").lstat().st_mode)
    assert os.readlink(box.target / "h") == "/etc/passwd"
    assert (box.target / "h").lstat().st_ino == (box.target / "s").lstat().st_ino
    assert os.stat("/etc/passwd").st_nlink == nlink
    box.assert_untouched()


@pytest.mark.parametrize("kind", [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE, tarfile.SYMTYPE])
def test_entry_replacing_an_outward_symlink_replaces_the_link(box: Box, kind: bytes) -> None:
    data = layer(member("f", tarfile.SYMTYPE, link=f"{box.sentinel}/x"), member("f", kind, b"mine", link="y"))
    unpack(data, box.target)
    expected = {
        tarfile.REGTYPE: stat.S_IFREG,
        tarfile.DIRTYPE: stat.S_IFDIR,
        tarfile.FIFOTYPE: stat.S_IFIFO,
        tarfile.SYMTYPE: stat.S_IFLNK,
    }
    assert stat.S_IFMT((box.target / "f").lstat().st_mode) == expected[kind]
    if kind == tarfile.REGTYPE:
        assert (box.target / "f").read_bytes() == b"mine"
    box.assert_untouched()


@pytest.mark.parametrize("name", ["../.wh.x", "a/../../.wh.x", ".wh..", "a/.wh..."])
def test_escaping_whiteouts_are_refused(box: Box, name: str) -> None:
    box.refuse(layer(member(name)), r"'..' component|whiteout of")


def test_names_deeper_than_the_limit_are_refused(box: Box) -> None:
    error = box.refuse(layer(member("/".join(["a"] * (MAX_DEPTH + 1)), data=b"x")), "components")
    assert error.kind == "invalid"


def test_replacing_a_deep_directory_never_follows_its_symlinks(box: Box) -> None:
    data = layer(
        member("/".join(["d"] * MAX_DEPTH), data=b"as deep as a layer goes"),
        member("d/link", tarfile.SYMTYPE, link=str(box.root)),
        member("d", data=b"now a file"),  # removes the whole tree, not what the link points to
    )
    unpack(data, box.target)
    assert (box.target / "d").read_bytes() == b"now a file"
    box.assert_untouched()


@pytest.mark.parametrize("key", [b"mtime", b"uid", b"gid", b"size"])
def test_pax_numbers_with_thousands_of_digits_are_refused(box: Box, key: bytes) -> None:
    data = raw_member(tarfile.TarInfo("f"), pax={key: b"1" * 5000}) + EOF_BLOCKS
    assert box.refuse(data, "5000 digits").kind == "invalid"


@pytest.mark.parametrize(
    ("name", "size"),
    [("user.big", 8000), ("user.huge", 70_000), ("user." + "n" * 300, 1)],
    ids=["ENOSPC on ext4", "E2BIG", "ERANGE"],
)
def test_xattrs_the_filesystem_cannot_hold_are_the_layers_fault(box: Box, name: str, size: int) -> None:
    error = box.refuse(layer(member("f", data=b"f", xattrs={name: b"v" * size})), "xattr")
    assert error.kind == "invalid"


def test_name_with_nul_is_refused(box: Box) -> None:
    data = raw_member(tarfile.TarInfo("placeholder"), pax={b"path": b"a\0/../../evil"}) + EOF_BLOCKS
    box.refuse(data, "NUL")


def test_symlink_target_with_nul_is_refused(box: Box) -> None:
    info = tarfile.TarInfo("s")
    info.type = tarfile.SYMTYPE
    box.refuse(raw_member(info, pax={b"linkpath": b"/etc\0x"}) + EOF_BLOCKS, "bad symlink target")


@pytest.mark.parametrize("media_type", MEDIA_TYPES)
def test_truncated_streams_are_refused(box: Box, media_type: str) -> None:
    data = layer(member("a", data=os.urandom(100_000)), member("b", data=b"b"))
    blob = compress(data, media_type)
    with pytest.raises(UnpackError, match=r"truncated|corrupt"):
        unpack_layer(io.BytesIO(blob[: len(blob) // 2]), box.target, media_type=media_type)
    box.assert_untouched()


def test_stream_ending_without_end_of_archive_is_refused(box: Box) -> None:
    data = layer(member("a", data=b"a"))
    box.refuse(data[:1024], "no tar end-of-archive")  # header + data, then nothing


def test_size_larger_than_the_stream_is_refused(box: Box) -> None:
    info = tarfile.TarInfo("huge")
    info.size = 1 << 40
    header = info.tobuf(format=tarfile.GNU_FORMAT)
    box.refuse(header + b"only a few bytes", "huge: stream truncated")


def test_oversized_pax_header_is_refused(box: Box) -> None:
    records = pax_record(b"comment", b"x" * (2 << 20))
    header = tarfile.TarInfo("PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(records)
    box.refuse(header.tobuf(format=tarfile.USTAR_FORMAT) + records, "extended header")


@pytest.mark.parametrize(
    ("media_type", "blob"),
    [
        (GZIP, layer(member("a"))),  # plain tar declared gzip
        (ZSTD, gzip.compress(layer(member("a")))),
        (TAR, gzip.compress(layer(member("a")))),  # gzip declared plain
        (GZIP, b"\x1f\x8b" + os.urandom(500)),
        (ZSTD, b"\x28\xb5\x2f\xfd" + os.urandom(500)),
        (TAR, os.urandom(4096)),
    ],
    # Named: ids made of the blobs (gzip's timestamp, random bytes) differ between the parallel
    # workers' collections, which xdist refuses.
    ids=["tar-as-gzip", "gzip-as-zstd", "gzip-as-tar", "garbage-gzip", "garbage-zstd", "garbage-tar"],
)
def test_wrong_or_garbage_compression_is_refused(box: Box, media_type: str, blob: bytes) -> None:
    with pytest.raises(UnpackError, match=r"corrupt|checksum|not a number|truncated") as info:
        unpack_layer(io.BytesIO(blob), box.target, media_type=media_type)
    assert info.value.kind == "invalid"
    box.assert_untouched()


def test_unknown_media_type_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnpackError) as info:
        unpack_layer(io.BytesIO(b""), tmp_path, media_type="application/vnd.oci.image.layer.v1.tar+lz4")
    assert info.value.kind == "unsupported"


def test_read_errors_of_the_source_become_unpack_errors(tmp_path: Path) -> None:
    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: object) -> int:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset")

    with pytest.raises(UnpackError, match="reading the stream failed") as info:
        unpack_layer(Failing(), tmp_path, media_type=GZIP)  # type: ignore[arg-type]
    assert info.value.kind == "os"


def test_decompressed_streams_without_reading_all(tmp_path: Path) -> None:
    data = layer(member("a", data=os.urandom(1 << 20)))
    reader = decompressed(io.BytesIO(zstandard.ZstdCompressor().compress(data)), ZSTD)
    assert reader.read(512) == data[:512]


# --- random layers never escape ------------------------------------------------------------------

# Escapes take two or three entries in a row ("a -> OUTSIDE" then "a/x"; "a -> OUTSIDE/f" then a
# file "a"), too unlikely from independent random choices: entries are drawn half from such steps,
# half from component soups. "OUTSIDE" becomes the absolute path of a directory next to the
# target's parent (which "../../outside" reaches too).
STEPS = [
    ("a", tarfile.SYMTYPE, "OUTSIDE"),
    ("a", tarfile.SYMTYPE, "OUTSIDE/f"),
    ("a", tarfile.SYMTYPE, "../../outside"),
    ("a", tarfile.SYMTYPE, "../../outside/f"),
    ("b", tarfile.SYMTYPE, "a"),
    ("a", tarfile.REGTYPE, ""),
    ("a/", tarfile.DIRTYPE, ""),
    ("a/x", tarfile.REGTYPE, ""),
    ("b/x", tarfile.REGTYPE, ""),
    ("a/x/", tarfile.DIRTYPE, ""),
    ("a", tarfile.FIFOTYPE, ""),
    ("h", tarfile.LNKTYPE, "a"),
    ("h", tarfile.LNKTYPE, "a/f"),
    ("h", tarfile.LNKTYPE, "b/x"),
    ("a/.wh.f", tarfile.REGTYPE, ""),
    ("b/.wh..wh..opq", tarfile.REGTYPE, ""),
]
COMPONENTS = ["a", "b", "..", ".", "", ".wh.b", ".wh..wh..opq"]
LINK_TARGETS = ["OUTSIDE", "OUTSIDE/f", "../../outside", "../../outside/f", "..", "/", "/etc", "a"]
KINDS = [
    tarfile.REGTYPE,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CHRTYPE,
]

random_names = st.builds(
    lambda slash, parts: slash + "/".join(parts),
    st.sampled_from(["", "/"]),
    st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=3),
)
random_entries = st.lists(
    st.sampled_from(STEPS)
    | st.tuples(random_names, st.sampled_from(KINDS), st.sampled_from(LINK_TARGETS) | random_names),
    max_size=8,
)


def tree_snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int, int, int]]:
    """Everything under ``root`` except ``skip``: type, size, mtime, link count."""
    seen: dict[str, tuple[int, int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in [".", *dirnames, *filenames]:
            st_x = os.lstat(Path(dirpath, name))
            seen[os.path.join(dirpath, name)] = (st_x.st_mode, st_x.st_size, st_x.st_mtime_ns, st_x.st_nlink)
    return seen


@contextlib.contextmanager
def surroundings() -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "outside/a").mkdir(parents=True)
        (root / "outside/f").write_bytes(b"f")
        (root / "box/target").mkdir(parents=True)
        yield root, root / "box/target"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=random_entries, allow_devices=st.booleans())
def test_random_layers_never_touch_anything_outside(
    entries: list[tuple[str, bytes, str]], allow_devices: bool
) -> None:
    with surroundings() as (root, target):
        outside = str(root / "outside")
        members = [
            member(name, kind, b"data", link=link.replace("OUTSIDE", outside), major=1, minor=3)
            for name, kind, link in entries
        ]
        before = tree_snapshot(root, target)
        passwd = os.stat("/etc/passwd")
        with contextlib.suppress(UnpackError):
            unpack(layer(*members), target, allow_device_nodes=allow_devices)
        assert tree_snapshot(root, target) == before
        after = os.stat("/etc/passwd")
        assert (after.st_nlink, after.st_mtime_ns, after.st_size) == (
            passwd.st_nlink,
            passwd.st_mtime_ns,
            passwd.st_size,
        )
