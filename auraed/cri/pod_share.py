"""A ``vm`` pod's shared directory: the host paths its containers mount (emptyDir, configMap,
secret, the service-account token: what the kubelet prepares on the host), made visible in the
pod's guest, which can write only what is meant to be writable.

The guest mounts the share over virtio-fs at auraed.bootargs.SHARE_MOUNT (virtiofsd serves it;
auraed.vms.qemu): for each container, every host path it mounts is bound in the share at
``<key>/<n>`` and the container in the guest bind-mounts ``SHARE_MOUNT/<key>/<n>`` instead, the
Kata agent's shared-directory model.

Each pod's share lives in a mount namespace of its own, as a runc container's mounts do: the
host's mount table holds none of the pod's volumes, so the host's own mounts below a volume can
be unmounted and their mount points removed while the pod lives (Linux detaches another
namespace's copies on rmdir; a second mount in the host's own namespace made it EBUSY: critest's
readonly specs). The namespace is a copy of the daemon's made when the share is, every mount in
it private (nothing the host mounts later reaches it, nothing of it reaches the host), pinned on
the host at ``<runtime dir>/pod-shares/<pod id>/mnt`` (a bind of its nsfs file; found again
after a restart of the daemon), and virtiofsd is started in it (``nsenter --mount``). The pins'
directory, ``pod-shares``, is a private bind of itself on the host (Linux refuses to propagate a
mount namespace's file, and a copy elsewhere would keep the namespace alive); the pod's
namespace drops its copies of the host's namespace pins, the other pods' among them
(auraed.system.namespaces.create_mount_namespace). In the pod's namespace, under
``<runtime dir>/pod-shares/<pod id>/``:

- ``points``: a tmpfs of the pod's own that only the host writes: the mount points
  (``<key>/<n>``, an empty directory or file) are made there;
- ``share``: a read-only bind of ``points`` (nosuid, nodev, noexec), a shared mount in a peer
  group of its own: what virtiofsd serves. virtiofsd's namespace sandbox holds a slave of it, so
  what is mounted on ``share`` after virtiofsd started reaches it, and its root is read-only
  there: a guest, even root in a privileged container that mounts the tag again, creates
  nothing in the share (no file, no symlink for the host to trip over).

For a pod with a user namespace of its own (``hostUsers: false``) every bind is also idmapped
while detached by that namespace (the pod's, on the host): the guest cannot idmap virtio-fs, so
virtiofsd serves the host's root's files as the mapping's first id, and stores what that id
writes as the host's root's; a filesystem the kernel cannot idmap is refused.

A host path is bound without a window: cloned in the daemon's namespace (open_tree), made
read-only while still detached where it is read-only (mount_setattr, recursively for ``rro``)
and given its propagation, then attached (move_mount) on its mount point by a short-lived thread
that entered the pod's namespace (auraed.system.namespaces.in_mount_namespace). Mount
propagation copies a mount with its attributes, so virtiofsd's copy is read-only from its first
moment: a guest that remounts its own mount read-write in its kernel still writes nothing
through it. Only a writable volume is writable from the guest.

Every path below the pod's directory is resolved by descriptor beneath it without following a
link (openat2, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), and mounts are made and removed at
descriptors (auraed.system.mount_api). A release detaches, in the pod's namespace, what was
bound for a key (each mount with its submounts) and removes its mount points; the pod's removal
detaches the whole share there, unpins the namespace, then deletes its directories without
following links, whatever is there. What a guest wrote into a writable volume is the volume's,
on the host's side of the mount, and stays.

A container's image layers (the host's snapshots its root filesystem is made of in the guest,
auraed.cri.guest_containers) are bound as its volumes are, after them under its key, each
read-only with ``rro``: the share holds the layers of the images its pod's containers use and
nothing else of the host's store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from auraed.bootargs import SHARE_MOUNT
from auraed.containers.request import Mount
from auraed.cri.errors import CriError
from auraed.errors import ErrorKind
from auraed.system import namespaces
from auraed.system.idmapped_mounts import IdmapRefused, idmap_tree
from auraed.system.mount_api import (
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_PRIVATE,
    MS_SHARED,
    MS_SLAVE,
    attach,
    clone_tree,
    detach,
    detach_all,
    fd_path,
    open_beneath,
    set_mount_attributes,
)
from auraed.system.mounts import THREAD_MOUNTINFO, read_mounts

log = logging.getLogger(__name__)

BIND_TYPES = ("", "bind", "rbind")
POINTS = "points"
"""The pod's mount points, written by the host only (a tmpfs)."""
SERVED = "share"
"""The read-only view of ``POINTS`` with the host paths bound on it: what virtiofsd serves."""
NAMESPACE = "mnt"
"""The pin of the pod's mount namespace (a bind of its nsfs file, on the host)."""
POINTS_SOURCE = "aurae-pod-share"
"""The tmpfs's name in mountinfo."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIRECTORY = os.O_PATH | os.O_DIRECTORY
_SEALED = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC


@dataclasses.dataclass(frozen=True)
class Binding:
    """How a host path is bound in the share: with its submounts (rbind) or not; its top mount
    read-only, or every mount of it (``rro``); following the host's later mounts below it
    (rslave, rshared) or not (rprivate: nothing reaches it after it was bound)."""

    recursive: bool = True
    read_only: bool = False
    recursive_read_only: bool = False
    follows_host: bool = False

    @classmethod
    def of(cls, mount: Mount) -> Binding:
        return cls(
            recursive="bind" not in mount.options,  # rbind unless asked not
            read_only=mount.read_only or "ro" in mount.options,
            recursive_read_only="rro" in mount.options,
            follows_host=bool({"rslave", "rshared"} & set(mount.options)),
        )


@dataclasses.dataclass(frozen=True)
class _Opened:
    """The descriptors of a pod's share: its ``POINTS`` and ``SERVED`` mounts' roots."""

    points: int
    served: int


class PodShares:
    """The shared directories of the ``vm`` pods, under ``root``."""

    def __init__(self, root: Path) -> None:
        # As mountinfo names mount points: the runtime directory may be reached through a symlink.
        self._root = Path(os.path.realpath(root))
        # The pins' mount is made with the first share and dropped with the last one.
        self._pins_lock = threading.Lock()

    def directory(self, pod_id: str) -> Path:
        return self._root / pod_id

    def served(self, pod_id: str) -> Path:
        """What the pod's virtiofsd serves, in the pod's mount namespace (``namespace``)."""
        return self.directory(pod_id) / SERVED

    def namespace(self, pod_id: str) -> Path:
        """The pin of the pod's mount namespace, where its share is mounted and virtiofsd runs."""
        return self.directory(pod_id) / NAMESPACE

    def make(self, pod_id: str) -> Path:
        """The pod's share, made in a mount namespace of its own (idempotent); the directory
        virtiofsd serves there."""
        _check_name(pod_id)
        with self._pins_lock:
            self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
            _make_private_bind(self._root)
            with contextlib.ExitStack() as stack:
                root = _keep(stack, os.open(self._root, _DIRECTORY | os.O_CLOEXEC))
                _make_directory(root, pod_id)
                pod = _keep(stack, open_beneath(root, pod_id, _DIRECTORY, into_mounts=False))
                _make_directory(pod, POINTS)
                _make_directory(pod, SERVED)
                if not _holds_mount(pod, NAMESPACE):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(NAMESPACE, dir_fd=pod)  # an empty pin file a crash left
                    namespaces.create_mount_namespace(self.namespace(pod_id), lambda: self._set_up(pod_id))
        return self.served(pod_id)

    def _set_up(self, pod_id: str) -> None:
        """In the pod's new mount namespace (without the host's namespace pins, the other pods'
        included): ``points`` and ``share`` mounted."""
        with contextlib.ExitStack() as stack:
            root = _keep(stack, os.open(self._root, _DIRECTORY | os.O_CLOEXEC))
            pod = _keep(stack, open_beneath(root, pod_id, _DIRECTORY, into_mounts=False))
            at = _keep(stack, open_beneath(pod, POINTS, _DIRECTORY, into_mounts=False))
            flags = namespaces.MS_NOSUID | namespaces.MS_NODEV | namespaces.MS_NOEXEC
            namespaces.mount(POINTS_SOURCE, fd_path(at), "tmpfs", flags, "mode=0700")
            points = _keep(stack, open_beneath(pod, POINTS, _DIRECTORY))
            view = _keep(stack, clone_tree(points, recursive=False))
            set_mount_attributes(view, set_flags=_SEALED)  # read-only before it is anywhere
            attach(view, _keep(stack, open_beneath(pod, SERVED, _DIRECTORY, into_mounts=False)))
            # A peer group of its own (every mount around it is private): what is bound on the
            # share reaches virtiofsd's slaves of it, and never ``points``.
            set_mount_attributes(_keep(stack, open_beneath(pod, SERVED, _DIRECTORY)), propagation=MS_SHARED)

    def bind(
        self, pod_id: str, key: str, mounts: tuple[Mount, ...], *, idmap_by: Path | None = None
    ) -> tuple[Mount, ...]:
        """The container's mounts as the guest makes them: each host path bound in the pod's
        share at ``<key>/<n>``; mounts of no host path (tmpfs, ...) as they are. With
        ``idmap_by`` (a user namespace, the pod's), each bind is idmapped by its mappings: the
        guest sees a file of the host's root as the mapping's first id. On failure what was
        bound for ``key`` is released."""
        _check_name(key)
        if not self._pinned(pod_id):
            raise CriError.precondition(f"pod sandbox {pod_id[:13]} has no shared directory")
        guest = []
        try:
            with contextlib.ExitStack() as stack:
                userns_fd = None
                if idmap_by is not None:
                    userns_fd = _keep(stack, os.open(idmap_by, os.O_RDONLY | os.O_CLOEXEC))
                trees = []
                for index, mount in enumerate(mounts):
                    if mount.type not in BIND_TYPES:
                        guest.append(mount)
                        continue
                    # Cloned here, in the daemon's namespace: the host's mounts as they are now.
                    trees.append(_Tree(str(index), mount.source, _keep(stack, _detached(mount, userns_fd))))
                    guest.append(_guest_mount(mount, f"{SHARE_MOUNT}/{key}/{index}"))
                namespaces.in_mount_namespace(
                    self.namespace(pod_id), lambda: self._attach(pod_id, key, tuple(trees))
                )
        except BaseException:
            self.release(pod_id, key)
            raise
        return tuple(guest)

    def _attach(self, pod_id: str, key: str, trees: tuple[_Tree, ...]) -> None:
        """In the pod's namespace: each tree attached on its mount point ``<key>/<name>``."""
        with self._opened(pod_id) as share:
            if share is None:
                raise CriError.precondition(f"pod sandbox {pod_id[:13]} has no shared directory")
            _make_directory(share.points, key)
            for tree in trees:
                try:
                    with contextlib.ExitStack() as stack:
                        points = _keep(stack, open_beneath(share.points, key, _DIRECTORY, into_mounts=False))
                        if stat.S_ISDIR(os.fstat(tree.fd).st_mode):
                            _make_directory(points, tree.name)
                        else:
                            _make_file(points, tree.name)
                        at = _keep(stack, open_beneath(share.served, f"{key}/{tree.name}", into_mounts=False))
                        attach(tree.fd, at)
                except OSError as exc:
                    raise _cannot_share(tree.source, exc) from None

    def release(self, pod_id: str, key: str) -> None:
        """Detach what was bound for ``key`` (in the pod's namespace), then remove its mount
        points."""
        _check_name(key)
        if self._pinned(pod_id):
            namespaces.in_mount_namespace(self.namespace(pod_id), lambda: self._release(pod_id, key))

    def _release(self, pod_id: str, key: str) -> None:
        with self._opened(pod_id) as share:
            if share is None:
                return
            if detach_all(share.served, self.served(pod_id), key, THREAD_MOUNTINFO):
                _remove_tree(share.points, key)

    def remove(self, pod_id: str) -> None:
        """Detach the pod's share (every mount in it with it) in its namespace, unpin the
        namespace, then remove the pod's directory; the pins' mount goes with the last pod's."""
        _check_name(pod_id)
        with self._pins_lock:
            try:
                root = os.open(self._root, _DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                self._remove_namespace(pod_id)
                # On the host: nothing, or what an auraed that bound in its own namespace left.
                if detach_all(root, self._root, pod_id):
                    _remove_tree(root, pod_id)
            finally:
                os.close(root)
            _drop_private_bind_when_empty(self._root)

    def _remove_namespace(self, pod_id: str) -> None:
        """The share's mounts detached in the pod's namespace (a virtiofsd still running loses
        them too), and the namespace unpinned: it ends with its last process."""
        if not self._pinned(pod_id):
            return
        try:
            namespaces.in_mount_namespace(self.namespace(pod_id), lambda: self._detach_share(pod_id))
        except OSError as exc:
            log.warning("cannot detach pod %s's share in its namespace: %s", pod_id[:13], exc.strerror or exc)
        namespaces.unpin_namespace(self.namespace(pod_id))

    def _detach_share(self, pod_id: str) -> None:
        root = os.open(self._root, _DIRECTORY | os.O_CLOEXEC)
        try:
            detach_all(root, self._root, pod_id, THREAD_MOUNTINFO)
        finally:
            os.close(root)

    def _pinned(self, pod_id: str) -> bool:
        """Whether the pod's mount namespace is pinned (its share made, not removed)."""
        _check_name(pod_id)
        try:
            with contextlib.ExitStack() as stack:
                root = _keep(stack, os.open(self._root, _DIRECTORY | os.O_CLOEXEC))
                pod = _keep(stack, open_beneath(root, pod_id, _DIRECTORY, into_mounts=False))
                return _holds_mount(pod, NAMESPACE)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EXDEV):  # none, or a share an older auraed made
                return False
            raise

    @contextlib.contextmanager
    def _opened(self, pod_id: str) -> Iterator[_Opened | None]:
        """The pod's share opened (on a thread in its namespace), or None when it has none."""
        _check_name(pod_id)
        with contextlib.ExitStack() as stack:
            try:
                root = _keep(stack, os.open(self._root, _DIRECTORY | os.O_CLOEXEC))
                pod = _keep(stack, open_beneath(root, pod_id, _DIRECTORY, into_mounts=False))
            except FileNotFoundError:
                yield None
                return
            if not (_holds_mount(pod, POINTS) and _holds_mount(pod, SERVED)):
                yield None
                return
            points = _keep(stack, open_beneath(pod, POINTS, _DIRECTORY))
            yield _Opened(points, _keep(stack, open_beneath(pod, SERVED, _DIRECTORY)))


@dataclasses.dataclass(frozen=True)
class _Tree:
    """A host path's detached copy (``fd``), to be attached at ``<key>/<name>``."""

    name: str
    source: str
    fd: int


def _detached(mount: Mount, userns_fd: int | None = None) -> int:
    """``mount``'s host path cloned (open_tree) and set up while detached: its propagation,
    idmapped by the user namespace ``userns_fd`` when given, and read-only where it is, before
    it is anywhere."""
    binding = Binding.of(mount)
    try:
        tree = clone_tree(mount.source, recursive=binding.recursive)
    except OSError as exc:
        raise _cannot_share(mount.source, exc) from None
    try:
        propagation = MS_SLAVE if binding.follows_host else MS_PRIVATE
        set_mount_attributes(tree, propagation=propagation, recursive=True)
        if userns_fd is not None:
            _idmap(tree, mount, userns_fd, binding.recursive)
        if binding.read_only or binding.recursive_read_only:
            set_mount_attributes(tree, set_flags=MOUNT_ATTR_RDONLY, recursive=binding.recursive_read_only)
    except OSError as exc:
        os.close(tree)
        raise _cannot_share(mount.source, exc) from None
    except CriError:
        os.close(tree)
        raise
    return tree


def _idmap(tree: int, mount: Mount, userns_fd: int, recursive: bool) -> None:
    """The detached ``tree`` (every mount of it with ``recursive``) idmapped by ``userns_fd``;
    FAILED_PRECONDITION when a filesystem of it cannot be (the kernel's EINVAL)."""
    try:
        idmap_tree(tree, mount.source, userns_fd, recursive=recursive)
    except (IdmapRefused, OSError) as exc:
        why = (
            f"its filesystem ({exc.fs_type}) cannot be idmapped"
            if isinstance(exc, IdmapRefused)
            else exc.strerror or str(exc)
        )
        raise CriError(
            ErrorKind.FAILED_PRECONDITION,
            f"cannot map {mount.source} for the pod's user namespace ({why}): a pod with hostUsers: "
            "false mounts only what this host can idmap",
        ) from None


def _cannot_share(source: str, exc: OSError) -> CriError:
    return CriError(
        ErrorKind.FAILED_PRECONDITION, f"cannot share {source} with the pod's guest: {exc.strerror or exc}"
    )


def _make_private_bind(directory: Path) -> None:
    """``directory`` a bind of itself, private, unless it is a mount already (idempotent): the
    pins' mount, from which no bind propagates."""
    parent = os.open(directory.parent, _DIRECTORY | os.O_CLOEXEC)
    try:
        if _holds_mount(parent, directory.name):
            return
    finally:
        os.close(parent)
    namespaces.mount(directory, directory, None, namespaces.MS_BIND)
    namespaces.mount(None, directory, None, namespaces.MS_PRIVATE)


def _drop_private_bind_when_empty(directory: Path) -> None:
    """The pins' mount detached and its directory removed once no pod's share is in it."""
    try:
        if any(os.scandir(directory)):
            return
    except FileNotFoundError:
        return
    fd = os.open(directory, _DIRECTORY | os.O_CLOEXEC)
    try:
        detach(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def _guest_mount(mount: Mount, source: str) -> Mount:
    """``mount`` as the guest makes it, from the share. ``rro`` is the host's: in the guest the
    share is one virtio-fs mount, so a read-only bind of it holds everything below. For the
    same reason a read-only volume that is not recursively so, with mounts below it on the host,
    is bound read-write in the guest: virtiofsd already refuses writes to the volume itself (its
    top mount is read-only where virtiofsd serves it), and its submounts stay writable, as on a
    cell (critest's "non-recursive readonly mounts")."""
    options = tuple(option for option in mount.options if option != "rro")
    binding = Binding.of(mount)
    if (
        binding.read_only
        and binding.recursive
        and not binding.recursive_read_only
        and _has_submounts(mount.source)
    ):
        options = tuple(option for option in options if option != "ro")
        return dataclasses.replace(mount, source=source, options=options, read_only=False)
    return dataclasses.replace(mount, source=source, options=options)


def _has_submounts(source: str) -> bool:
    """Whether a mount sits below the host path ``source`` (as the daemon sees the host)."""
    below = os.path.realpath(source).rstrip("/") + "/"
    return any(entry.mount_point.startswith(below) for entry in read_mounts())


def _check_name(name: str) -> None:
    """A pod id or a key: one plain path component."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a name for a pod's share: {name[:80]!r}")


def _keep(stack: contextlib.ExitStack, fd: int) -> int:
    """``fd``, closed when ``stack`` ends."""
    stack.callback(os.close, fd)
    return fd


def _make_directory(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)


def _make_file(dir_fd: int, name: str) -> None:
    """An empty file, a mount point for a file's bind."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    os.close(os.open(name, flags, 0o600, dir_fd=dir_fd))


def _holds_mount(dir_fd: int, name: str) -> bool:
    """Whether something is mounted on ``name`` in ``dir_fd`` (a bind of the same filesystem
    included, which st_dev cannot tell); False when there is no ``name``."""
    try:
        os.close(open_beneath(dir_fd, name, into_mounts=False))
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            return True
        raise
    return False


def _remove_tree(dir_fd: int, name: str) -> None:
    """``name`` in ``dir_fd`` and everything below it, removed without following links
    (shutil.rmtree's descriptor walk); what cannot be is left, said once."""

    def failed(
        function: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]
    ) -> None:
        error = exc_info[1]
        if not isinstance(error, FileNotFoundError):
            log.warning("left %s in a pod's share: %s", path, getattr(error, "strerror", None) or error)

    shutil.rmtree(name, dir_fd=dir_fd, onerror=failed)
