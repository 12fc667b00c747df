"""Containers: created from stored images, run by the OCI runtime under our monitor, persisted.

Each container owns ``state_dir/containers/<id>/``: the overlay upper and work dirs, the mounted
rootfs, the OCI bundle, the CRI-format log and the monitor's exit record. Its cgroup is
``<cgroup_base>/<parent>/<id>``: the parent and what else it shares come from its sandbox
(auraed.containers.sandbox), ``_containers`` for one on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import signal as signals
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auraed.containers.errors import ContainerError
from auraed.containers.exec import ExecSession
from auraed.containers.model import ContainerRecord, State
from auraed.containers.oci_spec import build_spec, image_runtime_config, resource_limits, stop_signal
from auraed.containers.pid_groups import PidGroups
from auraed.containers.request import IMAGE_MOUNT, ContainerRequest, Mount, Resources, SpecError, check_path
from auraed.containers.rootfs import SharedImage, Snapshotter, check_shared_layers, unmount_image_volume
from auraed.containers.runtime import OciRuntime, OciRuntimeError
from auraed.containers.sandbox import CGROUP_PARENT, HOST_LOCAL, SandboxContext, UserNamespace
from auraed.errors import ErrorKind
from auraed.images.content import remove_tree
from auraed.images.errors import ImageError
from auraed.images.images import Images
from auraed.images.model import ImageRecord
from auraed.observe.logfile import LogLine, LogWatch, stream_line_batches
from auraed.state.store import Store, StoreError
from auraed.system import mount_api, namespaces, processes
from auraed.system.cgroupfs import CgroupError, Cgroupfs
from auraed.system.cri_log import LOG_MODE
from auraed.system.fs_usage import FsUsage, measure
from auraed.system.idmapped_mounts import IdmapRefused, attach_idmapped_clone
from auraed.system.monitor_protocol import ExitRecord, MonitorSpec, holds_open, read_exit_record
from auraed.system.pod_namespaces import IPC, NET, NamespaceError, sysctl_namespace, write_sysctls
from auraed.system.processes import ProcessInfo
from auraed.system.request_files import NotRegularFile, open_regular
from auraed.system.supervisor import ORPHANED, MonitorStartError, Supervisor
from auraed.system.tasks import run_to_end
from auraed.system.userns import DEFAULT_USERNS_ROOTFS_DIR

log = logging.getLogger(__name__)

KIND = "container"
PID_GROUPS_DIR = "pid-groups"
"""Beside the consoles' directory (in the runtime dir): the shared PID namespaces' pins."""
IMAGE_VOLUMES_DIR = "image-volumes"
"""In a container's directory: where its image volumes are mounted, one directory each."""
USERNS_ROOTFS, USERNS_MOUNTS = "rootfs", "mounts"
"""In a container's directory below ``userns_rootfs_dir``: its rootfs's bind, its idmapped binds."""
KILL_WAIT = 30.0  # seconds to wait for a SIGKILLed container to be reaped
ENDED_BEFORE_START = "its process ended before it was started"
ID_BYTES = 16  # a container id is this many random bytes in hex: 32 lowercase hex digits
ID_SHAPE = re.compile(f"[0-9a-f]{{{2 * ID_BYTES}}}")
LOG_REOPEN_TIMEOUT = 5.0  # seconds a monitor has to reopen its log once asked
LOG_REOPEN_RESEND = 0.1  # seconds between asks (one sent while the monitor starts goes unseen)
LOG_REOPEN_POLL = 0.005  # seconds between looks at whether it has

SPEC_ERROR_KINDS = {
    "invalid": ErrorKind.INVALID_ARGUMENT,
    "not_found": ErrorKind.NOT_FOUND,
    "unsupported": ErrorKind.FAILED_PRECONDITION,
}


def spec_error(exc: SpecError) -> ContainerError:
    return ContainerError(SPEC_ERROR_KINDS.get(exc.kind, ErrorKind.INVALID_ARGUMENT), str(exc))


def runtime_error(exc: OciRuntimeError, what: str) -> ContainerError:
    kind = ErrorKind.NOT_FOUND if exc.kind == "not_found" else ErrorKind.FAILED_PRECONDITION
    return ContainerError(kind, f"{what}: {exc}")


@dataclass
class _Stopping:
    """A container's Stop under way: its stop signal went (unless the grace is 0), and SIGKILL
    goes at ``kill_at`` (loop time) unless it has exited. A later Stop may bring that forward."""

    kill_at: float
    sooner: asyncio.Event = field(default_factory=asyncio.Event)

    def hurry(self, kill_at: float) -> None:
        if kill_at < self.kill_at:
            self.kill_at = kill_at
            self.sooner.set()


async def _until_set(*events: asyncio.Event, timeout: float) -> None:
    """Until one of ``events`` is set, or ``timeout`` seconds have passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


class Containers:
    def __init__(
        self,
        store: Store,
        images: Images,
        *,
        snapshotter: Snapshotter,
        cgroups: Cgroupfs,
        runtime: OciRuntime,
        supervisor: Supervisor,
        root: Path,
        sockets_dir: Path,
        default_stop_timeout: float,
        log_watch: LogWatch | None = None,
        pid_groups: PidGroups | None = None,
        userns_rootfs_dir: Path = DEFAULT_USERNS_ROOTFS_DIR,
        machine_sysctls: bool = False,
    ) -> None:
        # In a guest, the machine is the pod: a container in its network or IPC namespace has
        # its sysctls of those written there (True), where on a host they would be the host's.
        self._machine_sysctls = machine_sysctls
        self._log_watch = log_watch  # wakes Logs followers (None: they poll)
        self._userns_rootfs_dir = userns_rootfs_dir
        self._sockets_dir = sockets_dir
        self.pid_groups = pid_groups or PidGroups(sockets_dir.parent / PID_GROUPS_DIR)
        self._store = store
        self._images = images
        self._snapshotter = snapshotter
        self._cgroups = cgroups
        self._runtime = runtime
        self._supervisor = supervisor
        self._root = root
        self._default_stop_timeout = default_stop_timeout
        self._records: dict[str, ContainerRecord] = {}
        self._exited: dict[str, asyncio.Event] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._changing: dict[str, str] = {}  # id -> the change under way: "created", "started", ...
        self._runtime_creates: dict[str, asyncio.Task[None]] = {}  # id -> its create_ahead
        self._runtime_releases: dict[str, asyncio.Task[None]] = {}  # id -> its delete at exit
        self._runtime_created: dict[str, asyncio.Future[None]] = {}  # id -> create_ahead's outcome
        # id -> the Stop under way: its escalation to SIGKILL, which no caller's end may cut short
        self._stopping: dict[str, tuple[_Stopping, asyncio.Task[None]]] = {}
        self._closed = False  # close() has run: no Stop may begin a task nothing would await
        self._lock = asyncio.Lock()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        images.in_use = lambda image_id: any(
            r.image_id == image_id or image_id in r.volume_images for r in self._records.values()
        )

    @property
    def runtime_binary(self) -> str:
        """The OCI runtime's program, as chosen at start (the CRI reports it)."""
        return self._runtime.binary

    async def makes_recursive_read_only(self) -> bool:
        """Whether the runtime makes a bind mount read-only with every mount below it (the
        ``rro`` mount option: runc 1.1 with Linux 5.12's mount_setattr)."""
        return "rro" in await self._runtime.mount_options()

    # -- lookup ----------------------------------------------------------------------------

    def get(self, id_or_name: str) -> ContainerRecord:
        record = self._records.get(id_or_name)
        if record is None:
            record = next((r for r in self._records.values() if r.name == id_or_name), None)
        if record is None:
            raise ContainerError.not_found(f"container {id_or_name[:100]}")
        return record

    def all(self, labels: dict[str, str] | None = None) -> list[ContainerRecord]:
        wanted = labels or {}
        records = sorted(self._records.values(), key=lambda r: r.created_at)
        return [r for r in records if all(r.labels.get(k) == v for k, v in wanted.items())]

    def cgroup(self, record: ContainerRecord) -> str:
        return f"{record.cgroup_parent}/{record.id}"

    # -- create ----------------------------------------------------------------------------

    async def create(
        self,
        request: ContainerRequest,
        image_name: str,
        labels: dict[str, str],
        start: bool = False,
        *,
        sandbox: SandboxContext = HOST_LOCAL,
        log_path: Path | None = None,
        shared: SharedImage | None = None,
    ) -> ContainerRecord:
        """Create a container: its rootfs and bundle, and with ``start`` its process.

        ``sandbox`` is where it lives and what it shares (its cgroup parent, namespaces, files);
        the default, a container on its own. ``log_path`` is where its CRI-format log goes (an
        absolute path; its directory is made if missing); None: in its own directory. ``shared``:
        the image is not the store's but read where another machine shares its layers
        (``image_name`` then only names it).

        With ``start``, one ``run --detach``. Without, the reply does not wait for the runtime:
        its ``create`` is handed to a monitor before the reply goes (create_ahead) and runs while
        the client sends Start, and Start then only releases the init at its exec fifo. A Start
        that finds no runtime-created container (the create failed, or a reboot came between)
        runs ``run --detach`` instead.
        """
        # Lookups take an id or a name, ids first: a name shaped like an id could shadow another
        # container (Delete by that name would delete the other one). Refusing the shape, rather
        # than only the ids in use, keeps every name unambiguous whatever ids come later.
        if ID_SHAPE.fullmatch(request.name):
            raise ContainerError.invalid(
                "config.name", f"{request.name} has the shape of a container id (32 hex digits)"
            )
        self._check_cgroup_parent(sandbox.cgroup_parent)
        log_file = self._check_log_path(log_path)
        async with self._lock:
            if any(r.name == request.name for r in self._records.values()):
                raise ContainerError.already_exists(f"container {request.name}")
            image = self._images.find(image_name) if shared is None else shared
            volume_images = self._volume_images(request)
            container_id = secrets.token_hex(ID_BYTES)
            record = ContainerRecord(
                id=container_id,
                name=request.name,
                image=image_name,
                image_id=image.id,
                shared_layers=[str(layer) for layer in shared.layers] if shared is not None else [],
                directory=str(self._root / container_id),
                labels=labels,
                tty=request.tty,
                stdin=request.stdin,
                stdin_once=request.stdin_once,
                stop_signal=signals.SIGTERM,
                process={},
                cgroup_parent=sandbox.cgroup_parent,
                sandbox_id=sandbox.sandbox_id,
                log_file=log_file,
                created_at=time.time(),
                volume_images=volume_images,
                shared_volume_layers=[list(m.image_layers) for m in request.mounts if m.type == IMAGE_MOUNT],
            )
            self._changing[record.id] = "created"  # claimed before the record can be seen
            self._exited[record.id] = asyncio.Event()  # a Wait may begin as soon as it can be seen
            # Saved before any kernel object exists: a crash from here on is cleaned at start.
            try:
                self._save(record)
            except BaseException:
                del self._changing[record.id]
                del self._exited[record.id]
                raise
        try:
            spec = await asyncio.to_thread(self._prepare, record, image, request, sandbox)
            if start:
                await self._launch(record, start=True)
        except BaseException:
            await self._teardown(record, keep_logs=False)
            raise
        finally:
            del self._changing[record.id]
        if start:
            self._started(record)
        else:
            record.state = State.CREATED
            self._save(record)
            if self._runtime.releases_by_fifo and not spec.get("hooks", {}).get("poststart"):
                loop = asyncio.get_running_loop()
                created = self._runtime_created[record.id] = loop.create_future()
                self._runtime_creates[record.id] = loop.create_task(
                    self._create_ahead(record, created), name=f"create {record.id}"
                )
                # One turn of the loop lets the task hand its request to the spare monitor
                # before this reply goes out rather than after it: the runtime starts 0.2-0.6 ms
                # sooner (docs/benchmarks.md).
                await asyncio.sleep(0)
        log.info(
            "%s container %s (%s) from %s",
            "started" if start else "created",
            record.name,
            record.id,
            image_name,
        )
        return record

    @staticmethod
    def _check_log_path(log_path: Path | None) -> str:
        if log_path is None:
            return ""
        try:
            return check_path(str(log_path), "log_path", allow_root=False)
        except SpecError as exc:
            raise spec_error(exc) from None

    def _check_cgroup_parent(self, parent: str) -> None:
        """A cgroup path below the base, not the base itself (where cells are)."""
        if not parent:
            raise ContainerError.invalid("sandbox.cgroup_parent", "must not be empty")
        try:
            self._cgroups.cgroup_path(parent)
        except CgroupError as exc:
            raise ContainerError.invalid("sandbox.cgroup_parent", str(exc)) from None

    def _prepare(
        self,
        record: ContainerRecord,
        image: ImageRecord | SharedImage,
        request: ContainerRequest,
        sandbox: SandboxContext,
    ) -> dict[str, Any]:
        """Mount the rootfs and write the bundle; its spec. Runs in a worker thread."""
        record.path.mkdir(mode=0o700, parents=True)
        self._mount(record, image if isinstance(image, ImageRecord) else None, sandbox.namespaces.user)
        try:
            request = self._image_volumes_bound(record, request)
            if self._machine_sysctls:
                request = _machine_sysctls_written(request, sandbox)
            rootfs = record.rootfs if sandbox.namespaces.user is None else self._reachable_rootfs(record)
            image_config = image_runtime_config({"config": image.config})
            record.stop_signal = stop_signal(image_config, request)
            spec = build_spec(
                image_config,
                request,
                rootfs,
                self._cgroups.cgroup_path(self.cgroup(record)),
                sandbox=sandbox,
            )
        except SpecError as exc:
            raise spec_error(exc) from None
        # A shared rootfs's container (a vm pod's, in its guest) has its binds from the share,
        # mapped where they are shared from, as its layers are: the guest cannot map virtio-fs.
        if sandbox.namespaces.user is not None and not record.shared_layers:
            spec["mounts"] = self._idmapped_binds(record, spec["mounts"], sandbox.namespaces.user)
        record.process = spec["process"]
        record.bundle.mkdir(mode=0o700)
        (record.bundle / "config.json").write_text(json.dumps(spec))  # compact: the C encoder, 6x faster
        return spec

    def _mount(
        self, record: ContainerRecord, image: ImageRecord | None = None, userns: UserNamespace | None = None
    ) -> None:
        """The rootfs over the image's layers (the store's, or those shared with this machine);
        the container's directory keeps what was written; its image volumes, read-only."""
        if record.shared_layers:
            layers = tuple(Path(layer) for layer in record.shared_layers)
            check_shared_layers(layers)
        else:
            layers = self._snapshotter.layers(image or self._images.find(record.image_id))
        # Shared layers are mapped where they are shared from (a vm pod's host: the guest cannot
        # map a virtio-fs mount), as the container's user namespace says.
        layers_mapped = bool(record.shared_layers)
        self._snapshotter.mount(layers, record.path, record.rootfs, userns, layers_mapped=layers_mapped)
        for index, image_id in enumerate(record.volume_images):
            shared = record.shared_volume_layers[index] if index < len(record.shared_volume_layers) else []
            if shared:  # mapped where they are shared from, as the rootfs's
                volume_layers = tuple(Path(layer) for layer in shared)
                check_shared_layers(volume_layers)
                self._snapshotter.mount_read_only(volume_layers, _image_volume(record, index))
            else:
                volume_layers = self._snapshotter.layers(self._images.find(image_id))
                self._snapshotter.mount_read_only(volume_layers, _image_volume(record, index), userns)

    def _volume_images(self, request: ContainerRequest) -> tuple[str, ...]:
        """The ids of the images ``request`` mounts as volumes: a shared one's as its mount
        names it, a stored one's found in the store (it must be pulled)."""
        return tuple(
            mount.source if mount.image_layers else volume_image(self._images, mount, index).id
            for index, mount in enumerate(request.mounts)
            if mount.type == IMAGE_MOUNT
        )

    def _image_volumes_bound(self, record: ContainerRecord, request: ContainerRequest) -> ContainerRequest:
        """``request`` with each image volume a read-only bind of the image mounted for it (its
        ``sub_path`` resolved inside the image, never out of it)."""
        mounts, seen = [], 0
        for index, mount in enumerate(request.mounts):
            if mount.type != IMAGE_MOUNT:
                mounts.append(mount)
                continue
            root = _image_volume(record, seen)
            seen += 1
            source = str(root)
            if mount.sub_path:
                try:
                    source = mount_api.resolve_in_root(root, mount.sub_path)
                except OSError as exc:
                    raise ContainerError.invalid(
                        f"mounts[{index}].sub_path", f"{mount.sub_path!r} is not in the image: {exc.strerror}"
                    ) from None
            options = ("nosuid", "nodev", "noexec", "rprivate")
            mounts.append(Mount(mount.destination, source, "bind", options, read_only=True))
        return dataclasses.replace(request, mounts=tuple(mounts))

    def _userns_directory(self, record: ContainerRecord) -> Path:
        """The container's directory below ``userns_rootfs_dir`` (a container in its own user
        namespace): its ``rootfs`` and its idmapped ``mounts``."""
        return self._userns_rootfs_dir / record.id

    def _reachable_rootfs(self, record: ContainerRecord) -> Path:
        """The rootfs bound below ``userns_rootfs_dir``, for a container in its own user
        namespace: runc mounts the rootfs by its path once in that namespace, whose root (another
        host uid) cannot pass the owner-only state directory; containerd keeps its rootfs under
        /run/containerd (0711) for the same reason."""
        self._userns_rootfs_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        directory = self._userns_directory(record)
        directory.mkdir(mode=0o711, exist_ok=True)
        reachable = directory / USERNS_ROOTFS
        reachable.mkdir(mode=0o755, exist_ok=True)
        namespaces.mount(record.rootfs, reachable, None, namespaces.MS_BIND)
        return reachable

    def _idmapped_binds(
        self, record: ContainerRecord, mounts: list[dict[str, Any]], userns: UserNamespace
    ) -> list[dict[str, Any]]:
        """The spec's ``mounts`` with each bind's source (the request's host paths, the pod's
        /etc files and /dev/shm) replaced by an idmapped clone of it for the container's user
        namespace (containerd 2 with runc 1.2 idmaps every bind of such a pod; runc 1.1 cannot),
        attached at ``mounts/<n>`` in its directory below ``userns_rootfs_dir``: a file of the
        host's root is the container root's, and what it writes there is stored as the host
        root's. The clone is read-only where the bind is; runc still applies every option on its
        bind of it. Image volumes are left as they are: their layers are mapped already."""
        staging = self._userns_directory(record) / USERNS_MOUNTS
        staging.mkdir(mode=0o711)
        image_volumes = f"{record.path / IMAGE_VOLUMES_DIR}/"
        userns_fd = os.open(userns.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapped = []
            for mount in mounts:
                source = mount["source"]
                if mount["type"] != "bind" or f"{source}/".startswith(image_volumes):
                    mapped.append(mount)
                    continue
                target = staging / str(len(mapped))
                options = mount["options"]
                read_only = "ro" in options or "rro" in options
                try:
                    attach_idmapped_clone(
                        source,
                        target,
                        userns_fd,
                        recursive="rbind" in options,
                        attributes=mount_api.MOUNT_ATTR_RDONLY if read_only else 0,
                        mode=0o755,
                    )
                except IdmapRefused as exc:
                    raise ContainerError.precondition(
                        f"the mount at {mount['destination']} (host path {source}) cannot be idmapped for "
                        f"the pod's user namespace: its filesystem, {exc.fs_type}, takes no idmapped mount"
                    ) from None
                except OSError as exc:
                    raise ContainerError(
                        ErrorKind.INTERNAL,
                        f"cannot idmap the mount at {mount['destination']} (host path {source}): {exc}",
                    ) from None
                mapped.append({**mount, "source": str(target)})
            return mapped
        finally:
            os.close(userns_fd)

    def _remove_userns_directory(self, record: ContainerRecord) -> None:
        """Detach the container's mounts below ``userns_rootfs_dir`` (its rootfs's bind, its
        idmapped binds), found in the mount table rather than from its spec (a daemon killed
        mid-create leaves some), then remove their mount points."""
        try:
            top = os.open(self._userns_rootfs_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            if mount_api.detach_all(top, self._userns_rootfs_dir, record.id):
                remove_tree(self._userns_directory(record))
        finally:
            os.close(top)

    def _console_socket(self, record: ContainerRecord) -> Path:
        # Unix socket paths are limited to 107 bytes: keep them in the (short) runtime dir.
        self._sockets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self._sockets_dir / f"{record.id}.sock"

    async def _launch(self, record: ContainerRecord, start: bool) -> None:
        """Create the container under a new monitor, and with ``start`` run it (``run --detach``)."""
        monitor = MonitorSpec(
            argv=self._runtime.create_argv(
                record.id,
                record.bundle,
                record.path / "container.pid",
                self._console_socket(record) if record.tty else None,
                start=start,
            ),
            log_path=str(record.log_path),
            exit_path=str(record.exit_path),
            oom_counter_file=str(self._cgroups.oom_counter_path(self.cgroup(record))),
            subreaper=True,
            pid_file=str(record.path / "container.pid"),
            console_socket=str(self._console_socket(record)) if record.tty else None,
            runtime_starts=start,
            stdin=record.stdin,
        )
        try:
            supervised = await self._supervisor.launch(monitor, record.path)
        except MonitorStartError as exc:
            kind = ErrorKind.UNAVAILABLE if exc.timed_out else ErrorKind.FAILED_PRECONDITION
            raise ContainerError(kind, f"cannot run container {record.name}: {exc}") from None
        record.monitor_pid, record.monitor_ticks = supervised.monitor_pid, supervised.monitor_ticks
        record.pid, record.ticks = supervised.pid, supervised.ticks
        record.input_fd = supervised.input_fd

    async def _create_ahead(self, record: ContainerRecord, created: asyncio.Future[None]) -> None:
        """The runtime's ``create`` for a created container, begun with Create's reply; on any
        failure its traces go and Start runs the container as if this had not been tried.

        ``created`` is resolved once the container is created (its init waits at the exec fifo)
        or once a failure's traces are gone. A Start waiting for it releases the init before
        the record is saved here: the save is for a restart, and off the path to the output.
        """
        try:
            try:
                await self._launch(record, start=False)
            except BaseException as exc:
                await self._forget_runtime_create(record)
                if not isinstance(exc, Exception):
                    raise
                log.info("container %s: create ahead of Start failed, Start runs it: %s", record.name, exc)
                return
            finally:
                created.set_result(None)
            await asyncio.sleep(0)  # a Start waiting on `created` releases the init first
            if self._records.get(record.id) is record and record.state == State.CREATED:
                self._save_created(record)
                self._watch(record)
        finally:
            self._runtime_creates.pop(record.id, None)
            self._runtime_created.pop(record.id, None)

    def _save_created(self, record: ContainerRecord) -> None:
        """Save the monitor and init the runtime's create made, so that a restart finds them.
        Should that fail (a full disk), the container goes on: Start may have released it
        already. Only a restart before its next save would take the create as lost and undo it."""
        try:
            self._save(record)
        except StoreError as exc:
            log.warning("container %s: its monitor could not be recorded: %s", record.name, exc)

    async def _runtime_create_settled(self, record: ContainerRecord) -> None:
        """Until the container's create ahead, if one runs, has created it or failed and left
        nothing behind (it is never cancelled)."""
        created = self._runtime_created.get(record.id)
        if created is not None:
            await asyncio.shield(created)

    async def _create_ahead_done(self, record: ContainerRecord) -> None:
        """Until the container's create ahead, if one runs, has ended (it is never cancelled)."""
        ahead = self._runtime_creates.get(record.id)
        if ahead is not None:
            await asyncio.shield(ahead)

    async def _forget_runtime_create(self, record: ContainerRecord) -> None:
        """Undo a runtime ``create``: kill its init (its monitor then ends), drop what it left."""
        with contextlib.suppress(OciRuntimeError):
            await self._runtime.delete(record.id, force=True)
        await self._monitor_ended(record)
        record.monitor_pid, record.monitor_ticks, record.pid, record.ticks = 0, None, 0, None
        for leftover in (record.exit_path, record.path / "container.pid"):
            leftover.unlink(missing_ok=True)
        if record.id in self._records:
            with contextlib.suppress(StoreError):  # the record on disk is undone at recovery
                self._save(record)

    def _runtime_create_lost(self, record: ContainerRecord) -> bool:
        """A created container whose runtime create ended (a reboot, say), or began but was never
        recorded (auraed killed meanwhile)."""
        if record.pid:
            return not Supervisor.alive(record.supervised)
        return self._runtime.knows(record.id)

    async def _monitor_ended(self, record: ContainerRecord) -> None:
        """Wait (at most KILL_WAIT) for a killed container's monitor to end, so that nothing
        writes into its directory any more."""
        if record.monitor_pid and Supervisor.alive(record.supervised):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._supervisor.wait(record.supervised, record.exit_path), KILL_WAIT)

    # -- lifecycle -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _changing_now(self, record: ContainerRecord, change: str) -> Iterator[None]:
        """One lifecycle change at a time per container: Create, Start and Delete each refuse a
        container another of them is changing (a Delete under a Start would pull the bundle
        from under the runtime)."""
        under_way = self._changing.get(record.id)
        if under_way is not None:
            raise ContainerError.precondition(f"container {record.name} is being {under_way}")
        self._changing[record.id] = change
        try:
            yield
        finally:
            del self._changing[record.id]

    async def start(self, record: ContainerRecord) -> ContainerRecord:
        with self._changing_now(record, "started"):
            if record.state != State.CREATED:
                raise ContainerError.precondition(f"container {record.name} is {record.state}, not created")
            await self._runtime_create_settled(record)
            try:
                if record.pid:  # the runtime created it: its init waits at the exec fifo
                    await self._release(record)
                else:
                    if not self._snapshotter.is_mounted(
                        record.rootfs
                    ):  # created before a reboot: the mount is gone
                        await asyncio.to_thread(self._mount, record)
                    await self._launch(record, start=True)
            except BaseException as exc:  # a cancelled Start too: the runtime may have run already
                await self._start_failed(record, str(exc) if isinstance(exc, ContainerError) else repr(exc))
                raise
            self._started(record)
        return record

    async def _release(self, record: ContainerRecord) -> None:
        def alive() -> bool:
            return Supervisor.alive(record.supervised)

        try:
            await self._runtime.start_created(record.id, alive)
        except OciRuntimeError as exc:
            raise runtime_error(exc, f"cannot run container {record.name}") from None

    def _started(self, record: ContainerRecord) -> None:
        record.state = State.RUNNING
        record.started_at = time.time()
        self._save(record)
        self._watch(record)

    async def _start_failed(
        self, record: ContainerRecord, message: str, exit_record: ExitRecord | None = None
    ) -> None:
        """Like containerd: a container that failed to start is EXITED, with the reason kept
        (and how its process ended, when it had one)."""
        watcher = self._watchers.pop(record.id, None)  # a created container's init's: it is over
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        with contextlib.suppress(OciRuntimeError):
            await self._runtime.delete(record.id, force=True)
        record.state, record.reason = State.EXITED, message
        if exit_record is not None:
            record.exit_code, record.signal = exit_record.exit_code, exit_record.signal
        record.finished_at = time.time()
        self._save(record)
        self._exited[record.id].set()  # still there: Delete, which drops it, waits its turn

    async def stop(self, record: ContainerRecord, timeout: float | None) -> ContainerRecord:
        """The stop signal, then SIGKILL once ``timeout`` (else the default grace) has passed.

        The sequence is a task of ours, one per container: a caller that goes away (its deadline,
        a disconnect) leaves it running to the SIGKILL, rather than a container that got only its
        stop signal. A Stop that finds one under way joins it, bringing the SIGKILL forward when
        its own timeout ends sooner."""
        if record.state != State.RUNNING:  # a created container has no process yet
            return record
        grace = self._default_stop_timeout if timeout is None else timeout
        await asyncio.shield(self._stop_task(record, grace))
        return record

    def _stop_task(self, record: ContainerRecord, grace: float) -> asyncio.Task[None]:
        kill_at = asyncio.get_running_loop().time() + grace
        under_way = self._stopping.get(record.id)
        if under_way is not None and not under_way[1].done():
            stopping, task = under_way
            stopping.hurry(kill_at)
            return task
        if self._closed:
            raise ContainerError(ErrorKind.UNAVAILABLE, "auraed is shutting down")
        stopping = _Stopping(kill_at)
        task = asyncio.get_running_loop().create_task(
            self._stop_sequence(record, stopping), name=f"stop {record.id}"
        )
        self._stopping[record.id] = (stopping, task)
        task.add_done_callback(lambda done: self._stop_done(record, done))
        return task

    async def _stop_sequence(self, record: ContainerRecord, stopping: _Stopping) -> None:
        loop = asyncio.get_running_loop()
        if stopping.kill_at > loop.time():
            await self._signal(record, record.stop_signal)
            exited = self._exited.get(record.id) or asyncio.Event()  # a running one has its own
            while record.alive and (grace := stopping.kill_at - loop.time()) > 0:
                stopping.sooner.clear()
                await _until_set(exited, stopping.sooner, timeout=grace)
            if not record.alive:
                return
        await self._signal(record, signals.SIGKILL, all_processes=True)
        if not await self._wait_exit(record, KILL_WAIT):
            raise ContainerError(ErrorKind.UNAVAILABLE, f"container {record.name} did not die after SIGKILL")

    def _stop_done(self, record: ContainerRecord, task: asyncio.Task[None]) -> None:
        under_way = self._stopping.get(record.id)
        if under_way is not None and under_way[1] is task:
            del self._stopping[record.id]
        if not task.cancelled() and task.exception() is not None:  # retrieved: its callers may be gone
            log.warning("container %s: stop failed: %s", record.name, task.exception())

    async def kill(self, record: ContainerRecord, signal: int) -> None:
        if record.state != State.RUNNING:
            raise ContainerError.precondition(f"container {record.name} is not running ({record.state})")
        await self._signal(record, signal)

    async def _signal(self, record: ContainerRecord, signal: int, all_processes: bool = False) -> None:
        try:
            await self._runtime.kill(record.id, signal, all_processes=all_processes)
        except OciRuntimeError as exc:
            if record.alive:  # a container that died meanwhile is not an error
                raise runtime_error(exc, f"cannot signal container {record.name}") from None

    async def _wait_exit(self, record: ContainerRecord, timeout: float) -> bool:
        event = self._exited.get(record.id)
        if event is None:
            return not record.alive
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return not record.alive

    async def wait(self, record: ContainerRecord) -> ContainerRecord:
        """Until the container has exited (from Create on: a Wait may begin while it is made).
        One removed before it ran never exits: NOT_FOUND then, as for any Wait after that."""
        event = self._exited.get(record.id)
        if event is not None:
            await event.wait()
        if record.state in (State.CREATING, State.CREATED) and record.id not in self._records:
            raise ContainerError(ErrorKind.NOT_FOUND, f"container {record.name} was removed before it ran")
        return record

    async def delete(self, record: ContainerRecord, force: bool, keep_logs: bool) -> None:
        """Runs to its end when the caller leaves: a Delete cut short (``aer container run --rm``
        interrupted, a deadline) left the container half removed, still listed."""
        with self._changing_now(record, "deleted"):
            if record.state == State.RUNNING and not force:
                raise ContainerError.precondition(
                    f"container {record.name} is {record.state}; stop it or force"
                )
            await run_to_end(self._delete(record, keep_logs))
        in_use = any(r.sandbox_id == record.sandbox_id for r in self._records.values())
        await asyncio.to_thread(self.pid_groups.release, record.sandbox_id, in_use)

    async def _delete(self, record: ContainerRecord, keep_logs: bool) -> None:
        if record.state == State.RUNNING:
            await self.stop(record, timeout=0)
        await self._teardown(record, keep_logs)
        log.info("deleted container %s (%s)", record.name, record.id)  # also when its caller left

    async def _teardown(self, record: ContainerRecord, keep_logs: bool) -> None:
        """Remove every trace of a container; safe on half-made ones and repeatable."""
        await self._create_ahead_done(record)
        await self._runtime_released(record)
        if record.state == State.CREATED:
            await self._monitor_ended(record)  # a runtime-created init was killed just now
        watcher = self._watchers.pop(record.id, None)
        if watcher is not None:
            watcher.cancel()
        await asyncio.to_thread(self._remove_files, record, keep_logs)
        self._store.delete(KIND, record.id)  # first: should it fail, a Delete can be retried
        self._records.pop(record.id, None)
        exited = self._exited.pop(record.id, None)
        if exited is not None:
            exited.set()  # a Wait on a container deleted before it ran ends too

    def _remove_files(self, record: ContainerRecord, keep_logs: bool) -> None:
        self._remove_userns_directory(record)
        self._snapshotter.unmount(record.rootfs)
        for index in range(len(record.volume_images)):
            unmount_image_volume(_image_volume(record, index))
        with contextlib.suppress(CgroupError):
            if self._cgroups.exists(self.cgroup(record)):
                self._cgroups.kill_all(self.cgroup(record))
                self._cgroups.remove(self.cgroup(record))
        if not record.path.exists():
            return
        for entry in record.path.iterdir():
            if not (keep_logs and entry == record.log_path):
                remove_tree(entry)
        if not keep_logs:
            record.path.rmdir()

    # -- exits -----------------------------------------------------------------------------

    def _watch(self, record: ContainerRecord) -> None:
        """Until the container's process ends, replacing an earlier watch: a runtime-created
        container is watched from its create on, its init waiting for Start."""
        self._exited.setdefault(record.id, asyncio.Event())  # Waits may have begun at Create
        earlier = self._watchers.pop(record.id, None)
        if earlier is not None:
            earlier.cancel()
        task = asyncio.get_running_loop().create_task(self._await_exit(record), name=f"watch {record.id}")
        self._watchers[record.id] = task

    async def _await_exit(self, record: ContainerRecord) -> None:
        def orphaned() -> None:
            record.reason = ORPHANED
            if record.id in self._records:
                self._save(record)
            log.warning("container %s: its monitor ended while it runs; %s", record.name, ORPHANED)

        exit_record = await self._supervisor.wait(record.supervised, record.exit_path, orphaned)
        if record.state != State.CREATED:
            self._finish(record, exit_record)
        elif record.id not in self._changing:  # else the Start or Delete under way sees it
            await self._ended_before_start(record, exit_record)

    async def _ended_before_start(self, record: ContainerRecord, exit_record: ExitRecord | None) -> None:
        """A runtime-created init that ended before Start (killed, say): the container is EXITED
        now, as Start would find it, and its Waits end."""
        with self._changing_now(record, "marked exited"):
            await self._start_failed(record, ENDED_BEFORE_START, exit_record)
        log.info("container %s: %s", record.name, ENDED_BEFORE_START)

    def _finish(self, record: ContainerRecord, exit_record: ExitRecord | None) -> None:
        if exit_record is None:
            record.state, record.reason = State.UNKNOWN, "the monitor ended without recording an exit status"
        else:
            record.state = State.EXITED
            record.exit_code, record.signal = exit_record.exit_code, exit_record.signal
            record.oom_killed = exit_record.oom_killed
            record.finished_at = exit_record.finished_at
            if exit_record.oom_killed:
                record.reason = "OOMKilled"
        record.finished_at = record.finished_at or time.time()
        if record.id in self._records:
            self._save(record)
        if exit_record is not None:
            self._release_runtime(record)
        event = self._exited.get(record.id)
        if event is not None:
            event.set()

    def _release_runtime(self, record: ContainerRecord) -> None:
        """As containerd deletes a task when it exits: the runtime's delete runs now (its state,
        its cgroup, what is left of a shared PID namespace's processes, its poststop hooks), so a
        Remove, often long after, has only files left."""
        if record.id in self._runtime_releases or self._closed:
            return
        self._runtime_releases[record.id] = asyncio.get_running_loop().create_task(
            self._delete_in_runtime(record), name=f"release {record.id}"
        )

    async def _delete_in_runtime(self, record: ContainerRecord) -> None:
        try:
            await self._runtime.delete(record.id, force=True)
        except OciRuntimeError as exc:  # a Remove tries again
            log.warning("container %s: the runtime's delete after its exit failed: %s", record.name, exc)

    async def _runtime_released(self, record: ContainerRecord) -> None:
        """Until the runtime keeps nothing of the container: the delete begun at its exit, else
        one now (a created container, one whose delete failed, one from before a restart)."""
        released = self._runtime_releases.pop(record.id, None)
        if released is not None:
            await asyncio.shield(released)
            if not self._runtime.knows(record.id):
                return
        with contextlib.suppress(OciRuntimeError):
            await self._runtime.delete(record.id, force=True)
        log.info(
            "container %s exited: code=%s signal=%s oom=%s",
            record.name,
            record.exit_code,
            record.signal,
            record.oom_killed,
        )

    # -- logs and stats --------------------------------------------------------------------

    def logs(
        self,
        record: ContainerRecord,
        streams: frozenset[str],
        tail: int | None,
        follow: bool,
        since: float | None,
        *,
        start: tuple[int, int] | None = None,
        parts: bool = False,
    ) -> AsyncGenerator[list[LogLine], None]:
        """The log's lines, or with ``parts`` its records (see stream_line_batches; ``start``
        from end_position replaces ``tail``)."""
        return stream_line_batches(
            record.log_path,
            streams,
            tail,
            follow,
            lambda: not record.alive or record.id not in self._records,  # ended, or deleted
            since=since,
            watch=self._log_watch,
            start=start,
            parts=parts,
        )

    def processes(self, record: ContainerRecord) -> list[ProcessInfo]:
        """The running container's processes, by pid: its cgroup's and its children's (runc puts
        exec'd processes there too)."""
        if record.state != State.RUNNING:
            raise ContainerError.precondition(
                f"container {record.name} is {record.state}: it has no processes"
            )
        pids: set[int] = set()
        pending = [self.cgroup(record)]
        try:
            while pending:
                path = pending.pop()
                pids.update(self._cgroups.pids(path))
                pending.extend(f"{path}/{child}" for child in self._cgroups.list_children(path))
        except CgroupError as exc:
            raise ContainerError.precondition(f"container {record.name}: {exc}") from None
        return [info for pid in sorted(pids) if (info := processes.process_info(pid)) is not None]

    def stats(self, record: ContainerRecord) -> dict[str, int]:
        if record.state == State.CREATED:  # its cgroup may hold the runtime's init, not yet ours
            raise ContainerError.precondition(f"container {record.name} has not started")
        path = self.cgroup(record)
        if not self._cgroups.exists(path):
            raise ContainerError.precondition(f"container {record.name} has no cgroup ({record.state})")
        try:
            cpu = self._cgroups.cpu_stat(path)
            read, write = self._cgroups.io_bytes(path)
            return {
                "cpu_usage_usec": cpu.get("usage_usec", 0),
                "cpu_throttled_usec": cpu.get("throttled_usec", 0),
                "memory_current": self._cgroups.memory_current(path),
                "memory_working_set": self._cgroups.memory_working_set(path),
                "memory_max": self._cgroups.memory_max(path) or 0,
                "pids_current": self._cgroups.pids_current(path),
                "pids_max": self._cgroups.pids_max(path) or 0,
                "io_read_bytes": read,
                "io_write_bytes": write,
            }
        except CgroupError as exc:
            raise ContainerError.precondition(f"container {record.name}: {exc}") from None

    def writable_usage(self, record: ContainerRecord) -> tuple[Path, FsUsage]:
        """The container's writable layer and what it uses, measured by walking it (a caller
        polling often caches it, as the host's CRI does)."""
        root = self.written(record)
        return root, measure(root)

    def written(self, record: ContainerRecord) -> Path:
        """Where what the container wrote to its root filesystem is kept (its writable layer)."""
        return self._snapshotter.written(record.path)

    async def reopen_log(self, record: ContainerRecord) -> None:
        """A new log file at the log's path, which its owner moved away (log rotation): the file
        exists when this returns, and the monitor writes only there from then on."""
        if record.state != State.RUNNING:
            raise ContainerError.precondition(f"container {record.name} is not running ({record.state})")
        if not Supervisor.alive(record.supervised):
            raise ContainerError.precondition(f"container {record.name} is {ORPHANED}")
        try:
            fresh = await asyncio.to_thread(_create_log_file, record.log_path)
        except NotRegularFile as exc:
            raise ContainerError.precondition(f"container {record.name}: its log {exc.strerror}") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOG_REOPEN_TIMEOUT
        while loop.time() < deadline:
            if not processes.send_signal(record.monitor_pid, signals.SIGUSR1, record.monitor_ticks):
                raise ContainerError.precondition(f"container {record.name}: its monitor ended")
            resend_at = loop.time() + LOG_REOPEN_RESEND
            while loop.time() < resend_at:
                if holds_open(record.monitor_pid, fresh):
                    return
                await asyncio.sleep(LOG_REOPEN_POLL)
        raise ContainerError(
            ErrorKind.UNAVAILABLE,
            f"container {record.name}: its monitor did not reopen {record.log_path} "
            f"in {LOG_REOPEN_TIMEOUT:g}s",
        )

    async def update_resources(self, record: ContainerRecord, resources: Resources) -> None:
        """New limits for a created or running container: its cgroup now (the runtime's
        ``update``), and its bundle for a run that is still to come."""
        if not record.alive:
            raise ContainerError.precondition(f"container {record.name} is {record.state}")
        with self._changing_now(record, "updated"):
            await self._runtime_create_settled(record)
            try:
                limits = resource_limits(resources)
            except SpecError as exc:
                raise spec_error(exc) from None
            update = await asyncio.to_thread(self._write_limits, record, limits)
            if self._runtime.knows(record.id):
                try:
                    await self._runtime.update(record.id, update)
                except OciRuntimeError as exc:
                    raise runtime_error(exc, f"cannot update container {record.name}") from None

    @staticmethod
    def _write_limits(record: ContainerRecord, limits: dict[str, Any]) -> Path:
        """The limits merged into the bundle's spec, and written alone for the runtime's update."""
        config = record.bundle / "config.json"
        spec = json.loads(config.read_text())
        current = spec.setdefault("linux", {}).setdefault("resources", {})
        for key, values in limits.items():
            current[key] = {**current.get(key, {}), **values}
        config.write_text(json.dumps(spec))
        update = record.path / "resources.json"
        update.write_text(json.dumps(limits))
        return update

    # -- persistence and restart -----------------------------------------------------------

    def _save(self, record: ContainerRecord) -> None:
        self._store.put(KIND, record.id, record.to_doc())  # first: it may fail (disk full)
        self._records[record.id] = record

    async def recover(self) -> None:
        for record in self._store.load(KIND, ContainerRecord.from_doc):
            self._records[record.id] = record
            if record.state == State.CREATING:
                log.warning("container %s was being created when auraed stopped; removing it", record.name)
                await self._teardown(record, keep_logs=False)
            elif record.state == State.CREATED:  # nothing runs until Start
                self._exited[record.id] = asyncio.Event()
                if self._runtime_create_lost(record):
                    await self._forget_runtime_create(record)
                elif record.pid:
                    self._watch(record)  # its init waits for Start
            elif record.alive and Supervisor.alive(record.supervised):
                log.info("found container %s running as pid %d", record.name, record.pid)
                self._watch(record)
            elif record.alive:
                self._exited[record.id] = asyncio.Event()
                self._finish(record, read_exit_record(record.exit_path))
        log.info("recovered %d containers", len(self._records))

    async def close(self) -> None:
        self._closed = True
        # Not cancelled: a runtime create cut short would leave an init nothing knows of.
        await asyncio.gather(*self._runtime_creates.values(), return_exceptions=True)
        await asyncio.gather(*self._runtime_releases.values(), return_exceptions=True)
        # Nor are Stops under way: one cut short leaves a container that got only its stop signal.
        # Their SIGKILL goes now rather than after a grace that may be minutes; the watchers,
        # which see the exits, are cancelled only after.
        now = asyncio.get_running_loop().time()
        for stopping, _ in self._stopping.values():
            stopping.hurry(now)
        await asyncio.gather(*(task for _, task in self._stopping.values()), return_exceptions=True)
        for task in list(self._watchers.values()):
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        self._cgroups.prune(CGROUP_PARENT)  # unless containers still run; a sandbox prunes its own

    def running(self) -> list[ContainerRecord]:
        return [r for r in self._records.values() if r.alive]

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r, None) for r in self.running()), return_exceptions=True)

    def process_defaults(self, record: ContainerRecord) -> dict[str, Any]:
        return dict(record.process)

    async def exec(
        self,
        record: ContainerRecord,
        process: dict[str, Any],
        tty: bool,
        *,
        stdin: bool,
        size: tuple[int, int] | None,
    ) -> ExecSession:
        try:
            return await ExecSession.start(
                self._runtime, record.id, process, tty, stdin=stdin, size=size, supervisor=self._supervisor
            )
        except OciRuntimeError as exc:
            raise runtime_error(exc, f"exec in container {record.name}") from None

    def borrow_input(self, record: ContainerRecord) -> int:
        """A descriptor of our own for the running container's input: the stdin pipe its
        monitor holds, or its terminal's master (the terminal's input and its size). The caller
        closes it; the monitor keeps its own."""
        if record.state != State.RUNNING:
            raise ContainerError.precondition(f"container {record.name} is {record.state}")
        if record.input_fd < 0:
            raise ContainerError.precondition(
                f"container {record.name} was created without stdin or a terminal"
            )
        try:
            copy = processes.borrow_fd(record.monitor_pid, record.monitor_ticks, record.input_fd)
        except OSError as exc:
            raise ContainerError(
                ErrorKind.FAILED_PRECONDITION, f"container {record.name}: its input cannot be reached: {exc}"
            ) from None
        # The monitor made the stdin pipe blocking; nothing but auraed writes its end, so making
        # the shared description non-blocking changes nothing for the monitor, and a container
        # that does not read can never hold the event loop in a write. (A terminal master is
        # non-blocking already: the monitor reads it that way.)
        os.set_blocking(copy, False)
        return copy

    def release_stdin(self, record: ContainerRecord) -> None:
        """The monitor lets go of the container's stdin pipe: the process reads EOF once the
        copies borrowed from it are closed too (stdin_once). Its descriptor number is forgotten
        at once: the monitor may give it to another file."""
        if record.stdin and not record.tty and record.alive and record.input_fd >= 0:
            record.input_fd = -1
            self._save(record)
            processes.send_signal(record.monitor_pid, signals.SIGUSR2, record.monitor_ticks)


def _create_log_file(path: Path) -> os.stat_result:
    """The log file at ``path``, made if missing (as the monitor makes it); its identity. What is
    there must be a regular file (NotRegularFile otherwise, without waiting on a FIFO)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def volume_image(images: Images, mount: Mount, index: int) -> ImageRecord:
    """The stored image the image volume ``mount`` (the request's ``index``-th mount) names:
    pulled, or the store's error (NOT_FOUND, ...) naming the mount. Every handler's check."""
    try:
        return images.find(mount.source)
    except ImageError as exc:
        raise ContainerError(exc.kind, f"mounts[{index}].source: {exc.message}") from None


def _image_volume(record: ContainerRecord, index: int) -> Path:
    """Where the container's ``index``-th image volume is mounted (its own directory)."""
    return record.path / IMAGE_VOLUMES_DIR / str(index)


def _machine_sysctls_written(request: ContainerRequest, sandbox: SandboxContext) -> ContainerRequest:
    """``request`` without the sysctls of the namespaces it shares with the machine (its network
    with ``host_network``, its IPC with the machine's), which are written in the machine's own
    (a guest's: the pod's) instead; the OCI runtime would refuse them in a namespace it joins."""
    shared = {NET} if request.host_network else set()
    if "ipc" in sandbox.namespaces.host:
        shared.add(IPC)
    machine: dict[str, str] = {}
    own: dict[str, str] = {}
    for name, value in request.sysctls.items():
        try:
            kind = sysctl_namespace(name)
        except NamespaceError as exc:
            raise ContainerError(exc.kind, exc.message) from None
        (machine if kind in shared else own)[name] = value
    if not machine:
        return request
    try:
        write_sysctls(machine)
    except NamespaceError as exc:
        raise ContainerError(exc.kind, exc.message) from None
    return dataclasses.replace(request, sysctls=own)
