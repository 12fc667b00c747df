"""Container root filesystems: a snapshotter mounts one over the image's layer snapshots.

The :class:`Snapshotter` interface is what containers ask for (containerd's snapshotter, for the
one writable snapshot a container gets over its image's committed layers); :class:`OverlaySnapshotter`
is overlayfs over the layers the image store keeps (auraed.images.content.LayerSnapshots), or over
a :class:`SharedImage`'s: layers this machine does not store but reads where another machine
shares them (a vm pod's guest: its host's snapshots, read-only in the pod's virtio-fs share at
auraed.bootargs.SHARE_MOUNT), the writable layer still this machine's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from auraed.bootargs import SHARE_MOUNT
from auraed.containers.errors import ContainerError
from auraed.containers.sandbox import UserNamespace
from auraed.errors import ErrorKind
from auraed.images.content import LayerSnapshots
from auraed.images.model import ImageRecord
from auraed.system import mount_api, namespaces
from auraed.system.idmapped_mounts import IdmapRefused, attach_idmapped_clone
from auraed.system.userns import IdMap

# The kernel takes mount options in one page; each lower layer costs its path length.
MAX_MOUNT_DATA = 4095


_IMAGE_VOLUME_FLAGS = namespaces.MS_RDONLY | namespaces.MS_NOSUID | namespaces.MS_NODEV | namespaces.MS_NOEXEC
"""An image volume's mount: read-only, nothing executable or set-id (mount(2)'s flags)."""
_IMAGE_VOLUME_ATTRIBUTES = (
    mount_api.MOUNT_ATTR_RDONLY
    | mount_api.MOUNT_ATTR_NOSUID
    | mount_api.MOUNT_ATTR_NODEV
    | mount_api.MOUNT_ATTR_NOEXEC
)
"""The same, as mount_setattr(2) takes them."""

MAX_SHARED_LAYERS = 500
"""Layers a shared root filesystem may name: more than one overlay mount takes anyway."""
# overlayfs splits its options at "," and lower dirs at ":"; "\\" escapes them.
_OVERLAY_SEPARATORS = frozenset(",:\\\n\0")


@dataclasses.dataclass(frozen=True)
class SharedImage:
    """An image whose layers this machine reads where another machine shares them, read-only,
    and stores nothing of: its id, its config's "config" object, and its layers' directories,
    the bottom one first, each below the shared directory's mount (SHARE_MOUNT)."""

    id: str
    config: dict[str, Any]
    layers: tuple[Path, ...]


def shared_layer(path: str) -> Path:
    """``path`` as a shared layer's directory: absolute, normal (no ``..``, no ``//``), below
    SHARE_MOUNT, and free of what overlayfs's options would split at; ValueError saying why not."""
    if (
        not path.startswith(f"{SHARE_MOUNT}/")
        or os.path.normpath(path) != path
        or _OVERLAY_SEPARATORS & set(path)
    ):
        raise ValueError(f"{path[:200]!r} is not a plain directory path below {SHARE_MOUNT}")
    return Path(path)


def check_shared_layers(layers: Sequence[Path]) -> None:
    """Each of ``layers`` a directory (the share mounted, the host's binds there); a
    FAILED_PRECONDITION naming the first that is not."""
    for layer in layers:
        if not os.path.isdir(layer):
            raise ContainerError.precondition(
                f"the shared layer {layer} is not there: is the host's share mounted at {SHARE_MOUNT}?"
            )


class Snapshotter(Protocol):
    """A container's root filesystem from its image's layers."""

    def layers(self, image: ImageRecord) -> tuple[Path, ...]:
        """The directories of the stored image's layers, the bottom one first."""
        ...

    def mount(
        self,
        layers: Sequence[Path],
        writable: Path,
        target: Path,
        userns: UserNamespace | None = None,
        *,
        layers_mapped: bool = False,
    ) -> None:
        """Mount at ``target`` the ``layers`` (bottom first) under a writable layer kept in
        ``writable`` (the container's own directory: what the container writes lasts as long as
        it does); for a container in ``userns``, its root owning the image's files: the layers
        mapped here, or, ``layers_mapped``, as they are (mapped where they are shared from)."""
        ...

    def mount_read_only(
        self, layers: Sequence[Path], target: Path, userns: UserNamespace | None = None
    ) -> None:
        """Mount at ``target`` an image's files (its ``layers``, bottom first), read-only, nothing
        executable or set-id (an image volume); for a container in ``userns``, owned as its
        root filesystem's are."""
        ...

    def unmount(self, target: Path) -> None:
        """Unmount if mounted; never hangs on a stray process."""
        ...

    def is_mounted(self, target: Path) -> bool: ...

    def written(self, writable: Path) -> Path:
        """Where, in ``writable``, what the container wrote to its root filesystem is kept."""
        ...


class OverlaySnapshotter:
    """overlayfs: the image's layer snapshots as lower dirs, ``writable/upper`` (with its
    ``writable/work``) as the upper one."""

    def __init__(self, layers: LayerSnapshots) -> None:
        self._layers = layers

    def layers(self, image: ImageRecord) -> tuple[Path, ...]:
        return tuple(self._layers.snapshot_path(layer.diff_id) for layer in image.layers)

    def mount(
        self,
        layers: Sequence[Path],
        writable: Path,
        target: Path,
        userns: UserNamespace | None = None,
        *,
        layers_mapped: bool = False,
    ) -> None:
        lowers = list(reversed(layers))  # overlayfs takes the topmost first
        upper, work = self.written(writable), writable / "work"
        if userns is None:
            mount_rootfs(lowers, upper, work, target)
        elif layers_mapped:
            _make_owned(upper, userns.idmap)
            mount_rootfs(lowers, upper, work, target)
        else:
            mount_mapped_rootfs(lowers, upper, work, target, userns)

    def mount_read_only(
        self, layers: Sequence[Path], target: Path, userns: UserNamespace | None = None
    ) -> None:
        lowers = list(reversed(layers))  # overlayfs takes the topmost first
        if userns is not None:
            mount_mapped_read_only(lowers, target, userns)
            return
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            if len(lowers) == 1:  # overlayfs needs two layers to stack none writable
                namespaces.mount(lowers[0], target, None, namespaces.MS_BIND)
                namespaces.mount(
                    None, target, None, namespaces.MS_BIND | namespaces.MS_REMOUNT | _IMAGE_VOLUME_FLAGS
                )
            elif lowers:
                _mount_read_only_overlay(lowers, target)
        except OSError as exc:
            raise ContainerError(ErrorKind.INTERNAL, f"cannot mount the image at {target}: {exc}") from exc

    def unmount(self, target: Path) -> None:
        unmount_rootfs(target)

    def written(self, writable: Path) -> Path:
        return writable / "upper"

    def is_mounted(self, target: Path) -> bool:
        return is_mounted(target)


def _mount_read_only_overlay(lowers: list[Path], target: Path) -> None:
    """A read-only overlay of ``lowers`` (topmost first, two at least) at ``target`` (made)."""
    data = f"lowerdir={':'.join(map(os.fspath, lowers))}"
    if len(data) > MAX_MOUNT_DATA:
        raise ContainerError(ErrorKind.FAILED_PRECONDITION, f"the image has too many layers ({len(lowers)})")
    target.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        namespaces.mount("overlay", target, "overlay", _IMAGE_VOLUME_FLAGS, data)
    except OSError as exc:
        raise ContainerError(ErrorKind.INTERNAL, f"cannot mount the image at {target}: {exc}") from exc


def is_mounted(target: Path) -> bool:
    # A rootfs is always its own overlay mount, with a device of its own: two lstat calls tell,
    # where reading /proc/self/mountinfo grows with every mount on the host (Start runs this on
    # the event loop).
    return os.path.ismount(target)


def mount_rootfs(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount ``lowers`` (topmost first) with a writable upper layer at ``target``."""
    for directory in (upper, work, target):
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    data = f"lowerdir={':'.join(map(os.fspath, lowers))},upperdir={upper},workdir={work}"
    if len(data) > MAX_MOUNT_DATA:
        raise ContainerError(
            ErrorKind.FAILED_PRECONDITION,
            f"the image has too many layers ({len(lowers)}) for one overlay mount",
        )
    try:
        namespaces.mount("overlay", target, "overlay", 0, data)
    except OSError as exc:
        raise ContainerError(
            ErrorKind.INTERNAL, f"cannot mount the root filesystem at {target}: {exc}"
        ) from exc


def mount_mapped_rootfs(
    lowers: list[Path], upper: Path, work: Path, target: Path, userns: UserNamespace
) -> None:
    """:func:`mount_rootfs` for a container in its pod's user namespace, as containerd does it
    where the kernel can: each layer seen through an idmapped mount (``MOUNT_ATTR_IDMAP`` with the
    namespace: a file of the host's root is the container root's), so layers stay shared with
    every other container, unchanged; and the upper layer owned by the container's root on the
    host, so that what it writes is its own. overlayfs itself takes no idmap (EINVAL), its layers
    do. The mapped layers are attached under ``work``'s sibling ``mapped/`` only for the overlay
    mount to name them, then detached: the overlay keeps them."""
    with _mapped_layers(lowers, work.parent / "mapped", userns) as mapped:
        _make_owned(upper, userns.idmap)
        mount_rootfs(mapped, upper, work, target)


def mount_mapped_read_only(lowers: list[Path], target: Path, userns: UserNamespace) -> None:
    """:meth:`OverlaySnapshotter.mount_read_only` for a container in its pod's user namespace:
    the image's files owned as :func:`mount_mapped_rootfs` shows its rootfs's (each layer idmapped,
    the read-only overlay over them; one layer mapped straight at ``target``)."""
    if not lowers:  # an image of no layer: an empty directory, as unmapped
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        return
    if len(lowers) == 1:  # overlayfs needs two layers to stack none writable
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        userns_fd = os.open(userns.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _attach_mapped(lowers[0], target, userns_fd, _IMAGE_VOLUME_ATTRIBUTES, mode=0o755)
        finally:
            os.close(userns_fd)
        return
    with _mapped_layers(lowers, target.parent / f"{target.name}.mapped", userns) as mapped:
        _mount_read_only_overlay(mapped, target)


@contextlib.contextmanager
def _mapped_layers(lowers: list[Path], staging: Path, userns: UserNamespace) -> Iterator[list[Path]]:
    """Each of ``lowers`` idmapped for ``userns``, attached below ``staging`` (made, and removed
    after with the mounts: an overlay mounted over them meanwhile keeps them)."""
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    userns_fd = os.open(userns.path, os.O_RDONLY | os.O_CLOEXEC)
    mapped: list[Path] = []
    try:
        for index, lower in enumerate(lowers):
            mapped.append(_attach_mapped(lower, staging / str(index), userns_fd))
        yield mapped
    finally:
        os.close(userns_fd)
        for path in mapped:
            with contextlib.suppress(OSError):
                namespaces.umount(path, namespaces.MNT_DETACH)
        shutil.rmtree(staging, ignore_errors=True)


def _make_owned(upper: Path, idmap: IdMap) -> None:
    """The upper layer (its directory is the root's), owned by the user namespace's root: what
    the container writes is its own."""
    upper.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chown(upper, idmap.uid, idmap.gid)


def _attach_mapped(
    source: Path, target: Path, userns_fd: int, attributes: int = 0, mode: int = 0o700
) -> Path:
    """A detached copy of ``source`` mapped by the user namespace ``userns_fd``, attached at
    ``target`` (made)."""
    try:
        attach_idmapped_clone(source, target, userns_fd, attributes=attributes, mode=mode)
    except (OSError, IdmapRefused) as exc:
        raise ContainerError(
            ErrorKind.FAILED_PRECONDITION,
            f"cannot map the image's layer {source} for the pod's user namespace: {exc}",
        ) from exc
    return target


def unmount_image_volume(target: Path) -> None:
    """Detach an image volume's mount if there is one. By the unmount's own answer, not
    :func:`is_mounted`: a one-layer image is a bind of a directory of the same filesystem, which
    os.path.ismount does not see."""
    try:
        namespaces.umount(target, namespaces.MNT_DETACH)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):
            raise ContainerError(ErrorKind.INTERNAL, f"cannot unmount {target}: {exc}") from exc


def unmount_rootfs(target: Path) -> None:
    """Unmount if mounted; a busy mount is detached so deletion never hangs on a stray process."""
    if not is_mounted(target):
        return
    try:
        namespaces.umount(target)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise ContainerError(ErrorKind.INTERNAL, f"cannot unmount {target}: {exc}") from exc
        namespaces.umount(target, namespaces.MNT_DETACH)
