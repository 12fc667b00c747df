"""The containers of ``vm`` pods: each made and run by its pod's guest (the guest's
ContainerService), with the host keeping what the kubelet reads.

The guest has no CRI or pod concept, and holds nothing of the image: its root filesystem is the
host's layer snapshots (pulled and unpacked once per host), bound read-only in the pod's share
(auraed.cri.pod_share, under the container's own key with its volumes), over which the guest
mounts the container's overlay with its writable layer in the guest (``shared_rootfs``). An
image volume's image is checked as a cell's is (pulled: containers.volume_image) and its layers
are shared so too, after the rootfs's (the Mount's ``shared_image``): the guest mounts them
read-only, resolving the sub path inside them. The container's layers, its volumes' too, are in
use while its record exists (Images.layers_in_use): a RemoveImage forgets the image, but its
layers stay until no container reads them. The guest creates the
container with its network (the pod network: the guest's eth0 has the pod IP), and its IPC
namespace (the pod's); PID as the pod asks (the pod's in the guest, one of the container's own,
or another container's that it targets). For each container
the host keeps a record like a host container's, a mirror of the guest's status: updated by
every call's reply and by a Wait held open while the container runs, and saved (kind
``cri_guest_container``) so that a restarted host auraed finds its containers again and asks
their guests how they are.

The container's output: the guest logs it inside the guest; the host follows the guest's Logs
stream by records (``partial``: a line's parts as soon as the guest logged them, so an attach,
which follows the host's copy, sees output that stopped mid-line at once) and writes each record
to the container's log path on the host in the CRI format, P or F as in the guest, which is what
the kubelet reads. Where the copy got to (the last record's time, and how many records of that
time were written) is saved with the record, so that a host auraed killed and restarted resumes
there: nothing lost, nothing written twice.

A guest that ends under its containers (QEMU died, the pod's VM was freed) ends them too: each
reports EXITED with the guest's end as its reason. A guest that does not answer a call is
UNAVAILABLE with the VM named (auraed.vms.guest_calls), never a wait past the call's deadline.
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
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from auraed.api.aurae.containers import v0 as pb
from auraed.containers.containers import volume_image
from auraed.containers.errors import ContainerError
from auraed.containers.model import ContainerRecord, State
from auraed.containers.oci_spec import process_user
from auraed.containers.request import IMAGE_MOUNT, ContainerRequest, Mount, Resources
from auraed.containers.sandbox import SandboxContext
from auraed.cri.container_host import AttachInput, CgroupUsage, ProcessHandle
from auraed.cri.pod_share import PodShares
from auraed.errors import AuraeError, ErrorKind
from auraed.images.images import Images
from auraed.state.store import Store
from auraed.system.cri_log import LOG_MODE, format_cri_timestamp
from auraed.system.fs_usage import FsUsage
from auraed.system.request_files import NotRegularFile, open_regular
from auraed.system.tasks import run_to_end
from auraed.system.userns import IdMap
from auraed.vms.errors import VmError
from auraed.vms.guest_calls import call_guest, channel_closed, guest_error, stream_guest
from auraed.vms.guests import Guests
from auraed.vms.model import State as VmState
from auraed.vms.placement import CONTAINERS, GuestEndpoint
from auraed.wire import codec

log = logging.getLogger(__name__)

KIND = "cri_guest_container"
CALL_TIMEOUT = 30.0
"""Seconds a guest has to answer a call about a container (a status, a start, a delete)."""
CREATE_TIMEOUT = 300.0
"""Seconds for creating a container in a guest (its rootfs mounted, its bundle written: under TCG,
slowly)."""
STOP_SLACK = 30.0
"""Seconds a guest's Stop may take beyond the container's grace period."""
MAX_LABEL = 63
POD_PID_GROUP = "pod"
"""The guest's PID namespace group of a pod that shares one (a guest holds one pod)."""
LOG_RETRY = 1.0
"""Seconds between attempts to follow a container's log in a guest that did not answer."""

STATES = {
    pb.ContainerState.CREATED: State.CREATED,
    pb.ContainerState.RUNNING: State.RUNNING,
    pb.ContainerState.EXITED: State.EXITED,
    pb.ContainerState.UNKNOWN: State.UNKNOWN,
}


@dataclasses.dataclass
class _Guested:
    """A container in a guest: the host's mirror of it, where its log's copy got to."""

    vm: str
    record: ContainerRecord
    share: str = ""  # its key in the pod's shared directory: its volumes and its image's layers
    layers: list[str] = dataclasses.field(default_factory=list)  # the diff_ids its rootfs reads
    log_us: int = 0  # microseconds since the epoch of the last record copied to the host
    log_seen: int = 0  # records of that microsecond copied

    def to_doc(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it would deep-copy the record too, on every batch of log lines.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "record": self.record.to_doc()}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> _Guested:
        return cls(**{**doc, "record": ContainerRecord.from_doc(doc["record"])})


@dataclasses.dataclass
class _Resume:
    """Where a follow of a guest's log starts: records before ``micros``, and the first ``skip``
    of that microsecond, were copied before."""

    micros: int
    skip: int


def config_message(
    request: ContainerRequest, image: str, labels: dict[str, str], share_pid: bool, idmap: IdMap | None = None
) -> pb.ContainerConfig:
    """The guest's ContainerConfig of a CRI container: the guest's network and IPC (the pod's),
    its PID namespace with ``share_pid``; privileged means the guest's devices and capabilities
    (a vm pod's privilege ends at its VM, as with Kata). With ``idmap`` (a pod with hostUsers:
    false), the pod's user namespace in the guest, which owns the pod's IPC namespace there
    (and PID namespace, shared)."""
    security = request.security
    resources = request.resources
    return pb.ContainerConfig(
        name=guest_name(request.name),
        image=image,
        command=list(request.command),
        args=list(request.args),
        env=list(request.env),
        working_dir=request.working_dir,
        hostname=request.hostname,
        mounts=[_mount_message(m) for m in request.mounts],
        resources=_resources_message(resources),
        security=pb.Security(
            capabilities_add=list(security.capabilities_add),
            capabilities_drop=list(security.capabilities_drop),
            no_new_privileges=security.no_new_privileges,
            read_only_rootfs=security.read_only_rootfs,
            masked_paths=list(security.masked_paths),
            readonly_paths=list(security.readonly_paths),
            user=security.user,
            additional_gids=list(security.additional_gids),
            strict_groups=security.strict_groups,
            seccomp_profile=security.seccomp_profile,
            oom_score_adj=security.oom_score_adj,
            privileged=security.privileged,
            # A Localhost profile, read and translated on the host: the guest has no such file.
            seccomp_json=json.dumps(security.seccomp) if security.seccomp is not None else "",
            exact_paths=security.exact_paths,
        ),
        rlimits=[pb.Rlimit(r.type, r.soft, r.hard) for r in request.rlimits],
        sysctls=dict(request.sysctls),
        tty=request.tty,
        stdin=request.stdin,
        stdin_once=request.stdin_once,
        labels=labels,
        stop_signal=request.stop_signal,
        host_network=True,
        host_ipc=idmap is None,
        shared_pid=POD_PID_GROUP if share_pid else "",
        user_namespace=_id_mapping_message(idmap) if idmap is not None else None,
    )


def _id_mapping_message(idmap: IdMap) -> pb.IdMapping:
    return pb.IdMapping(
        uid=idmap.uid, uid_length=idmap.uid_length, gid=idmap.gid, gid_length=idmap.gid_length
    )


def guest_name(name: str) -> str:
    """The container's name in its guest, a DNS label as the guest wants: the CRI's host name
    is ``<name>_<pod>_<namespace>_<uid>_<attempt>``, and a guest holds one pod, so the container
    is its name and attempt there."""
    parts = name.split("_")
    wanted = f"{parts[0]}-{parts[-1]}" if len(parts) > 1 else name
    label = re.sub(r"[^a-z0-9-]+", "-", wanted.lower()).strip("-")[-MAX_LABEL:].strip("-")
    return label or "container"


def _refuse_what_crosses_the_vm(mounts: tuple[Mount, ...]) -> None:
    """A mount the guest would propagate back to the host (``rshared``: Bidirectional) cannot be
    given: what the guest's kernel mounts lives in the guest, and no host mount namespace ever
    sees it. Host to container (``rslave``) is given: virtiofsd announces the host's later
    submounts to the guest."""
    for index, mount in enumerate(mounts):
        if "rshared" in mount.options:
            raise VmError.invalid(
                f"config.mounts[{index}].propagation",
                "PROPAGATION_BIDIRECTIONAL cannot cross a vm pod's VM boundary (mounts made in the "
                "guest never reach the host); use HOST_TO_CONTAINER, or the cell handler",
            )


def pod_file_mounts(request: ContainerRequest, sandbox: SandboxContext) -> tuple[Mount, ...]:
    """The pod's /etc/resolv.conf, /etc/hosts and /etc/hostname (host files) as mounts of the
    container, as a host container of a pod has them: read-only with a read-only rootfs, a mount
    of the request's own at one of those places winning."""
    taken = {mount.destination.rstrip("/") for mount in request.mounts}
    files = (
        ("/etc/resolv.conf", sandbox.resolv_conf),
        ("/etc/hosts", sandbox.hosts),
        ("/etc/hostname", sandbox.hostname_file),
    )
    return tuple(
        Mount(
            destination=destination,
            source=str(source),
            type="bind",
            options=("rbind", "rprivate"),
            read_only=request.security.read_only_rootfs,
        )
        for destination, source in files
        if source is not None and destination not in taken
    )


def _layer_mount(snapshot: Path) -> Mount:
    """A layer snapshot of the host's store as the pod's share binds it: read-only, every mount
    of it (a guest, even root in a privileged container, writes nothing there)."""
    return Mount(destination="/", source=str(snapshot), type="bind", options=("rbind", "rro"), read_only=True)


def _mount_message(mount: Mount) -> pb.Mount:
    return pb.Mount(
        mount.source, mount.destination, mount.type, list(mount.options), mount.read_only, mount.sub_path
    )


def _resources_message(resources: Resources) -> pb.Resources:
    """The CRI's resources as the guest takes them: a kubelet sends cpu_shares on every node (2
    for a BestEffort pod), which the guest's runtime turns into cpu.weight on its cgroup v2."""
    return pb.Resources(
        cpu_shares=resources.cpu_shares,
        memory_swap=resources.memory_swap,
        cpu_weight=resources.cpu_weight,
        cpu_max=resources.cpu_max,
        cpu_period=resources.cpu_period,
        cpuset_cpus=resources.cpuset_cpus,
        cpuset_mems=resources.cpuset_mems,
        memory_max=resources.memory_max,
        pids_max=resources.pids_max,
    )


def mirror(record: ContainerRecord, status: pb.ContainerStatus) -> ContainerRecord:
    """``record`` with the guest's status of the container."""
    record.state = STATES.get(status.state, State.UNKNOWN)
    record.pid = status.pid
    record.exit_code = status.exit_code
    record.signal = status.signal
    record.oom_killed = status.oom_killed
    record.started_at = status.started_at
    record.finished_at = status.finished_at
    record.reason = status.reason
    if status.user is not None:  # the ids its process runs with, which ContainerStatus reports
        user = status.user
        record.process = {"user": process_user(user.uid, user.gid, user.additional_gids)}
    return record


def _ended_with_guest(record: ContainerRecord, why: str) -> None:
    """The guest ended under the container: it ended then, with the guest's end as its reason."""
    if record.state in (State.RUNNING, State.CREATED, State.CREATING):
        record.state = State.EXITED
        record.finished_at = record.finished_at or time.time()
        record.reason = f"its guest VM ended: {why}"


class GuestExec:
    """A process exec'd in a guest's container, over the guest's Exec stream (a ProcessHandle)."""

    def __init__(self, endpoint: GuestEndpoint, start: pb.ExecStart) -> None:
        self._endpoint = endpoint
        self._requests: asyncio.Queue[pb.ContainerServiceExecRequest | None] = asyncio.Queue()
        self._requests.put_nowait(pb.ContainerServiceExecRequest(start=start))
        self._call = endpoint.channel.stream_stream(f"/{CONTAINERS}/Exec")(self._encoded())
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def _encoded(self) -> AsyncIterator[bytes]:
        while (request := await self._requests.get()) is not None:
            yield codec.encode(request)

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        try:
            async for message in self._call:
                reply = codec.decode(pb.ContainerServiceExecResponse, message)
                if reply.stdout:
                    yield "stdout", reply.stdout
                if reply.stderr:
                    yield "stderr", reply.stderr
                if reply.exit_code is not None and not self._exit.done():
                    self._exit.set_result(reply.exit_code)
        except (grpc.aio.AioRpcError, codec.CodecError) as exc:
            self._fail(guest_error(self._endpoint, exc))
        except asyncio.CancelledError:
            error = channel_closed(self._endpoint)
            if error is None:
                raise
            self._fail(error)
        if not self._exit.done():
            self._fail(
                VmError(
                    ErrorKind.UNAVAILABLE, f"guest {self._endpoint.name}: the exec ended with no exit code"
                )
            )
        self._requests.put_nowait(None)  # the call is over: nothing more to send

    def _fail(self, error: AuraeError) -> None:
        if not self._exit.done():
            self._exit.set_exception(error)

    async def write_stdin(self, data: bytes) -> None:
        if data:
            self._requests.put_nowait(pb.ContainerServiceExecRequest(stdin=data))

    async def close_stdin(self) -> None:
        self._requests.put_nowait(pb.ContainerServiceExecRequest(close_stdin=True))

    def resize(self, rows: int, cols: int) -> None:
        if rows > 0 and cols > 0:
            size = pb.TerminalSize(rows=rows, columns=cols)
            self._requests.put_nowait(pb.ContainerServiceExecRequest(resize=size))

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    async def kill(self) -> None:
        """The guest kills a process whose caller went away."""
        self._call.cancel()

    async def close(self) -> None:
        self._call.cancel()
        self._requests.put_nowait(None)
        if not self._exit.done():
            self._exit.cancel()


class GuestInput:
    """A guest container's input for one attach, over the guest's Attach stream (an
    AttachInput): the host reads the output from its own copy of the log, so none is asked."""

    def __init__(self, endpoint: GuestEndpoint, container_id: str, closes_stdin: bool) -> None:
        self.closes_stdin = closes_stdin
        self._endpoint = endpoint
        self._requests: asyncio.Queue[pb.ContainerServiceAttachRequest | None] = asyncio.Queue()
        self._requests.put_nowait(
            pb.ContainerServiceAttachRequest(start=pb.AttachStart(container_id=container_id))
        )
        self._call = endpoint.channel.stream_stream(f"/{CONTAINERS}/Attach")(self._encoded())
        self._replies = asyncio.get_running_loop().create_task(self._drain(), name="guest attach")

    async def _encoded(self) -> AsyncIterator[bytes]:
        while (request := await self._requests.get()) is not None:
            yield codec.encode(request)

    async def _drain(self) -> None:
        """The guest's replies (its exit code at the end); a refusal is logged: the client's
        input then goes nowhere, as to a container whose stdin is closed."""
        try:
            async for _ in self._call:
                pass
        except (grpc.aio.AioRpcError, codec.CodecError) as exc:
            log.warning(
                "attach to a container in %s: %s", self._endpoint.name, guest_error(self._endpoint, exc)
            )

    async def write(self, data: bytes) -> None:
        if data:
            self._requests.put_nowait(pb.ContainerServiceAttachRequest(stdin=data))

    def resize(self, rows: int, cols: int) -> None:
        if rows > 0 and cols > 0:
            size = pb.TerminalSize(rows=rows, columns=cols)
            self._requests.put_nowait(pb.ContainerServiceAttachRequest(resize=size))

    async def end(self) -> None:
        self._requests.put_nowait(pb.ContainerServiceAttachRequest(close_stdin=True))

    def close(self) -> None:
        self._call.cancel()
        self._requests.put_nowait(None)
        self._replies.cancel()


class GuestContainers:
    """The ContainerHost of ``vm`` pods (see the module's doc). ``vm_of(pod_id)`` names the pod's
    VM; ``root`` holds a directory per container on the host (its log when the pod names no log
    directory)."""

    def __init__(
        self,
        store: Store,
        guests: Guests,
        images: Images,
        root: Path,
        *,
        vm_of: Callable[[str], str],
        shares: PodShares,
    ) -> None:
        self._store = store
        self._guests = guests
        self._images = images
        self._root = root
        self._vm_of = vm_of
        self._shares = shares
        self._containers: dict[str, _Guested] = {}
        self._logs: dict[str, asyncio.Task[None]] = {}
        self._logs_refused: set[str] = set()  # containers whose log path is no regular file now
        self._written: dict[str, tuple[Path, FsUsage]] = {}  # id: its writable layer in the guest
        self._creating: dict[str, tuple[str, ...]] = {}  # share key: the layers a Create shares
        for doc in store.load(KIND, _Guested.from_doc):
            self._containers[doc.record.id] = doc
        images.layers_in_use = self.layers_in_use

    def layers_in_use(self) -> set[str]:
        """The layers the containers of vm pods read, and those being shared for one."""
        used = {layer for guested in self._containers.values() for layer in guested.layers}
        return used.union(*self._creating.values())

    # -- lookups ---------------------------------------------------------------------------

    def place(self, pod_id: str) -> str:
        return f" in guest VM {self._vm_of(pod_id)}"

    def _guested(self, container_id: str) -> _Guested:
        guested = self._containers.get(container_id)
        if guested is None:
            raise ContainerError.not_found(f"container {container_id[:100]}")
        return guested

    def get(self, container_id: str) -> ContainerRecord:
        return self._guested(container_id).record

    def all(self) -> list[ContainerRecord]:
        return [g.record for g in self._containers.values()]

    async def _endpoint(self, guested: _Guested) -> GuestEndpoint:
        return await self._endpoint_of(guested.vm)

    async def _endpoint_of(self, vm: str) -> GuestEndpoint:
        """The guest's endpoint; UNAVAILABLE naming the VM when it is not running."""
        try:
            return await self._guests.lookup(vm)
        except AuraeError as exc:
            raise VmError(ErrorKind.UNAVAILABLE, f"guest {vm}: {exc.message}") from None

    def _save(self, guested: _Guested) -> None:
        self._store.put(KIND, guested.record.id, guested.to_doc())

    # -- lifecycle -------------------------------------------------------------------------

    async def create(
        self, request: ContainerRequest, image: str, labels: dict[str, str], *, sandbox: SandboxContext,
        log_path: Path | None, pid_of: ContainerRecord | None = None,
    ) -> ContainerRecord:  # fmt: skip
        """The container in the pod's guest (``sandbox.sandbox_id`` names the pod), its rootfs
        the host's snapshots of the image, shared with the guest with its volumes. Its PID
        namespace is the pod's when the sandbox gives it one, that of ``pid_of`` (a container of
        the same guest) when named."""
        vm = self._vm_of(sandbox.sandbox_id)
        _refuse_what_crosses_the_vm(request.mounts)
        host_image = self._images.find(image)
        volume_images = {
            index: volume_image(self._images, mount, index)
            for index, mount in enumerate(request.mounts)
            if mount.type == IMAGE_MOUNT
        }
        share = secrets.token_hex(8)
        # In use from here on (no await since the images were found): a RemoveImage meanwhile
        # forgets an image but leaves its layers. The rootfs's first, then each volume's.
        images = (host_image, *volume_images.values())
        self._creating[share] = tuple(layer.diff_id for each in images for layer in each.layers)
        try:
            # A pod with hostUsers: false: its user namespace on the host (the pod's, pinned)
            # idmaps what the share binds, its mappings make the same one in the guest.
            userns = sandbox.namespaces.user
            idmap = userns.idmap if userns is not None else None
            share_pid = sandbox.namespaces.pid is not None
            config = config_message(request, image, labels, share_pid=share_pid, idmap=idmap)
            config.pid_of = pid_of.id if pid_of is not None else ""
            config.image = host_image.id
            volumes = (*request.mounts, *pod_file_mounts(request, sandbox))
            layers = tuple(
                _layer_mount(self._images.snapshots.snapshot_path(d)) for d in self._creating[share]
            )
            shared = await run_to_end(
                asyncio.to_thread(
                    self._shares.bind, sandbox.sandbox_id, share, (*volumes, *layers),
                    idmap_by=userns.path if userns is not None else None,
                )
            )  # fmt: skip
            config.mounts = [_mount_message(m) for m in shared[: len(volumes)]]
            layer_dirs = iter(m.source for m in shared[len(volumes) :])
            config.shared_rootfs = pb.SharedRootfs(
                image_id=host_image.id,
                layers=[next(layer_dirs) for _ in host_image.layers],
                image_config=json.dumps(host_image.config),
            )
            for index, volume in volume_images.items():
                config.mounts[index].source = volume.id
                config.mounts[index].shared_image = pb.SharedRootfs(
                    image_id=volume.id, layers=[next(layer_dirs) for _ in volume.layers]
                )
            try:
                return await self._create(
                    request, image, labels=labels, sandbox=sandbox, log_path=log_path, vm=vm, config=config,
                    share=share, layers=list(self._creating[share]),
                )  # fmt: skip
            except BaseException:
                await run_to_end(asyncio.to_thread(self._shares.release, sandbox.sandbox_id, share))
                raise
        finally:
            released = self._creating.pop(share)
            if share not in {g.share for g in self._containers.values()}:
                self._images.layers_released(released)

    async def _create(
        self, request: ContainerRequest, image: str, *, labels: dict[str, str], sandbox: SandboxContext,
        log_path: Path | None, vm: str, config: pb.ContainerConfig, share: str, layers: list[str],
    ) -> ContainerRecord:  # fmt: skip
        config.hostname = sandbox.hostname or ""
        reply = await call_guest(
            await self._endpoint_of(vm), "Create", pb.ContainerServiceCreateRequest(config=config),
            pb.ContainerServiceCreateResponse, CREATE_TIMEOUT,
        )  # fmt: skip
        status = reply.status or pb.ContainerStatus()
        directory = self._root / status.id
        record = ContainerRecord(
            id=status.id,
            name=request.name,
            image=image,
            image_id=config.image,
            directory=str(directory),
            labels=labels,
            tty=request.tty,
            stdin=request.stdin,
            stdin_once=request.stdin_once,
            stop_signal=0,
            process={},
            cgroup_parent="",
            sandbox_id=sandbox.sandbox_id,
            log_file=str(log_path) if log_path is not None else "",
            created_at=time.time(),
        )
        guested = _Guested(vm, mirror(record, status), share, layers)
        try:
            await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(_touch, record.log_path)  # there from Create on, as a host container's
            self._containers[record.id] = guested
            self._save(guested)
        except BaseException:
            await run_to_end(self._delete_in_guest(guested, force=True))
            self._containers.pop(record.id, None)
            raise
        return record

    async def _call(
        self, guested: _Guested, method: str, request: Any, reply: type[Any], timeout: float = CALL_TIMEOUT
    ) -> Any:
        return await call_guest(await self._endpoint(guested), method, request, reply, timeout)

    def _update(self, guested: _Guested, status: pb.ContainerStatus | None) -> ContainerRecord:
        if status is not None:
            mirror(guested.record, status)
            if guested.record.id in self._containers:
                self._save(guested)
        return guested.record

    async def start(self, record: ContainerRecord) -> ContainerRecord:
        guested = self._guested(record.id)
        request = pb.ContainerServiceStartRequest(container_id=record.id)
        reply = await self._call(guested, "Start", request, pb.ContainerServiceStartResponse)
        self._update(guested, reply.status)
        self._copy_log(guested)
        return record

    async def stop(self, record: ContainerRecord, timeout: float | None) -> ContainerRecord:
        """The stop signal, SIGKILL after ``timeout`` seconds (10 s, the guest's default, when None). A
        container whose guest is gone ended with it."""
        guested = self._guested(record.id)
        if record.state not in (State.RUNNING, State.CREATED):
            return record
        grace = 10.0 if timeout is None else timeout
        request = pb.ContainerServiceStopRequest(container_id=record.id, timeout_ms=round(grace * 1000))
        try:
            reply = await self._call(
                guested, "Stop", request, pb.ContainerServiceStopResponse, grace + STOP_SLACK
            )
        except AuraeError as exc:
            if exc.kind is not ErrorKind.UNAVAILABLE or self._guest_running(guested):
                raise
            _ended_with_guest(record, self._vm_state(guested.vm))
            self._save(guested)
            return record
        return self._update(guested, reply.status)

    async def delete(self, record: ContainerRecord, force: bool, keep_logs: bool) -> None:
        """Removed in the guest (which may be gone: then so is the container) and on the host;
        the log on the host stays, as a host container's CRI log does."""
        guested = self._containers.get(record.id)
        if guested is None:
            return
        if self._guest_running(guested):
            await self._delete_in_guest(guested, force)
        task = self._logs.pop(record.id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if guested.share:  # its layers stay in use until they are unbound
            await run_to_end(asyncio.to_thread(self._shares.release, record.sandbox_id, guested.share))
        self._containers.pop(record.id, None)
        self._written.pop(record.id, None)
        self._store.delete(KIND, record.id)
        self._images.layers_released(guested.layers)  # those no image names any more are collected
        directory = Path(record.directory)
        await asyncio.to_thread(_remove_directory, directory, record.log_path if keep_logs else None)

    async def _delete_in_guest(self, guested: _Guested, force: bool) -> None:
        request = pb.ContainerServiceDeleteRequest(container_id=guested.record.id, force=force)
        try:
            await self._call(guested, "Delete", request, pb.ContainerServiceDeleteResponse)
        except AuraeError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                return
            if exc.kind is ErrorKind.UNAVAILABLE and not self._guest_running(guested):
                return  # its VM ended: the container with it
            raise

    async def wait(self, record: ContainerRecord) -> ContainerRecord:
        """Until the container ends in its guest, or its guest ends under it."""
        guested = self._guested(record.id)
        while record.state in (State.RUNNING, State.CREATED):
            request = pb.ContainerServiceWaitRequest(container_id=record.id)
            try:
                endpoint = await self._guests.lookup(guested.vm)
                reply = await call_guest(endpoint, "Wait", request, pb.ContainerServiceWaitResponse, 1e9)
            except AuraeError as exc:
                if exc.kind is ErrorKind.NOT_FOUND and record.id not in self._containers:
                    raise ContainerError.not_found(f"container {record.id[:13]}") from None
                if self._guest_running(guested):
                    log.warning(
                        "container %s: waiting in guest %s: %s", record.id[:13], guested.vm, exc.message
                    )
                    await asyncio.sleep(LOG_RETRY)
                    continue
                _ended_with_guest(record, self._vm_state(guested.vm))
                if record.id in self._containers:
                    self._save(guested)
                break
            self._update(guested, reply.status)
        return record

    def _guest_running(self, guested: _Guested) -> bool:
        try:
            return self._guests.vms.get(guested.vm).state == VmState.RUNNING
        except AuraeError:
            return False

    def _vm_state(self, vm: str) -> str:
        try:
            return f"VM {vm} is {self._guests.vms.get(vm).state_with_reason()}"
        except AuraeError:
            return f"VM {vm} is gone"

    # -- in a running container ------------------------------------------------------------

    async def exec(
        self, record: ContainerRecord, command: list[str], *, tty: bool, stdin: bool
    ) -> ProcessHandle:
        """``command`` in the container in its guest, with the container's user, env and cwd."""
        endpoint = await self._endpoint(self._guested(record.id))
        start = pb.ExecStart(container_id=record.id, command=command, tty=tty, stdin=stdin)
        return GuestExec(endpoint, start)

    async def attach_input(self, record: ContainerRecord) -> AttachInput | None:
        """The guest's Attach stream to the container; None when it was made with no input."""
        if not (record.stdin or record.tty):
            return None
        endpoint = await self._endpoint(self._guested(record.id))
        return GuestInput(endpoint, record.id, closes_stdin=record.stdin_once and not record.tty)

    async def reopen_log(self, record: ContainerRecord) -> None:
        """The host's copy writes to a file it opens for each batch: a new file is made at the
        log's path now, and written from then on."""
        if record.state != State.RUNNING:
            raise ContainerError.precondition(f"container {record.name} is not running ({record.state})")
        try:
            await asyncio.to_thread(_touch, record.log_path)
        except NotRegularFile as exc:
            raise ContainerError.precondition(f"container {record.name}: its log {exc.strerror}") from None

    async def update_resources(self, record: ContainerRecord, resources: Resources) -> None:
        """The container's limits in the guest (its cgroup there); the guest itself is grown by
        UpdatePodSandboxResources, which gives the pod's total."""
        request = pb.ContainerServiceUpdateRequest(
            container_id=record.id, resources=_resources_message(resources)
        )
        await self._call(self._guested(record.id), "Update", request, pb.ContainerServiceUpdateResponse)

    async def usage(self, record: ContainerRecord) -> CgroupUsage | None:
        guested = self._guested(record.id)
        request = pb.ContainerServiceStatsRequest(container_id=record.id)
        try:
            stats = await self._call(guested, "Stats", request, pb.ContainerServiceStatsResponse)
        except AuraeError as exc:
            # Ended as it was read, or its guest with it: no usage, the status says how. A guest
            # that runs but does not answer is an error to report, as containerd with Kata does.
            if exc.kind is ErrorKind.UNAVAILABLE and self._guest_running(guested):
                raise
            return None
        now = time.time_ns()
        self._written[record.id] = (
            Path(stats.writable_path or record.directory),
            FsUsage(now, stats.writable_bytes, stats.writable_inodes),
        )
        return CgroupUsage(
            timestamp_ns=now,
            cpu_ns=stats.cpu_usage_usec * 1000,
            memory_working_set=stats.memory_working_set,
            memory_usage=stats.memory_current,
            processes=stats.pids_current,
        )

    async def writable(self, record: ContainerRecord) -> tuple[Path, FsUsage]:
        """The writable layer in the guest as the guest's last Stats reply gave it (a usage
        asks it first, in the same call); nothing yet before one."""
        return self._written.get(record.id, (Path(record.directory), FsUsage(time.time_ns(), 0, 0)))

    # -- logs ------------------------------------------------------------------------------

    def _copy_log(self, guested: _Guested) -> None:
        """Follow the container's log in its guest into its log on the host, until it ends."""
        container_id = guested.record.id
        if container_id in self._logs:
            return

        async def copy() -> None:
            try:
                await self._follow_log(guested)
            finally:
                self._logs.pop(container_id, None)

        self._logs[container_id] = asyncio.get_running_loop().create_task(
            copy(), name=f"guest log {container_id}"
        )

    async def _follow_log(self, guested: _Guested) -> None:
        record = guested.record
        while record.id in self._containers:
            # From the last record copied on: the records of its microsecond that were copied are
            # skipped (the guest's times have finer steps than a double's seconds keep).
            resume = _Resume(guested.log_us, guested.log_seen)
            since = (guested.log_us - 1) / 1e6 if guested.log_us else None
            request = pb.ContainerServiceLogsRequest(
                container_id=record.id, follow=True, since=since, partial=True
            )
            try:
                endpoint = await self._endpoint(guested)
                async for reply in stream_guest(endpoint, "Logs", request, pb.ContainerServiceLogsResponse):
                    await asyncio.to_thread(self._write_lines, guested, reply.lines, resume)
                return  # the container ended and its log was read to the end
            except AuraeError as exc:
                if not self._guest_running(guested):
                    return
                log.warning(
                    "container %s: following its log in guest %s: %s", record.id[:13], guested.vm, exc.message
                )
                await asyncio.sleep(LOG_RETRY)

    def _write_lines(self, guested: _Guested, lines: list[pb.LogLine], resume: _Resume) -> None:
        """Append the records not copied yet to the host's log, then note where the copy got to.
        (A guest with an older auraed sends whole lines, never partial: each becomes an F.)"""
        records = []
        for line in lines:
            micros = round(line.timestamp * 1e6)
            if micros < resume.micros:
                continue
            if micros == resume.micros and resume.skip > 0:
                resume.skip -= 1
                continue
            if micros == guested.log_us:
                guested.log_seen += 1
            else:
                guested.log_us, guested.log_seen = micros, 1
            stamp = format_cri_timestamp(round(line.timestamp * 1e9))
            tag = "P" if line.partial else "F"
            records.append(f"{stamp} {line.stream} {tag} {line.line}\n".encode())
        if not records:
            return
        path = guested.record.log_path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE)
        except NotRegularFile as exc:
            # Dropped, as a host container's monitor drops what its log cannot take: the
            # container's output is still drained from its guest.
            if guested.record.id not in self._logs_refused:
                self._logs_refused.add(guested.record.id)
                log.warning("container %s: lines not logged: %s", guested.record.id[:13], exc.strerror)
            return
        self._logs_refused.discard(guested.record.id)
        with os.fdopen(fd, "ab") as file:
            file.write(b"".join(records))
        if guested.record.id in self._containers:
            self._save(guested)

    # -- restart ---------------------------------------------------------------------------

    async def recover(self, keep: Callable[[str], bool]) -> None:
        """At start: each container's status from its guest (one whose guest is gone ended with
        it), its log's copy resumed; those ``keep`` refuses (no CRI record) removed."""
        for guested in list(self._containers.values()):
            record = guested.record
            if not keep(record.id):
                log.warning(
                    "container %s in guest %s has no CRI record; removing it", record.id[:13], guested.vm
                )
                with contextlib.suppress(AuraeError):
                    await self.delete(record, force=True, keep_logs=False)
                continue
            if not self._guest_running(guested):
                _ended_with_guest(record, self._vm_state(guested.vm))
                self._save(guested)
                continue
            try:
                request = pb.ContainerServiceStatusRequest(container_id=record.id)
                reply = await self._call(guested, "Status", request, pb.ContainerServiceStatusResponse)
            except AuraeError as exc:
                log.warning(
                    "container %s: no status from guest %s: %s", record.id[:13], guested.vm, exc.message
                )
                continue
            self._update(guested, reply.status)
            if record.state != State.CREATED:
                self._copy_log(guested)

    async def close(self) -> None:
        for task in list(self._logs.values()):
            task.cancel()
        await asyncio.gather(*self._logs.values(), return_exceptions=True)


def _touch(path: Path) -> None:
    """The log file at ``path``, made if missing; NotRegularFile when something else is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE))


def _remove_directory(directory: Path, keep: Path | None) -> None:
    """The container's directory on the host (its log too, where the pod names no log directory),
    but for ``keep``. A kubelet's log is outside it: the kubelet removes that one."""
    if not directory.exists():
        return
    for entry in directory.iterdir():
        if entry != keep:
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        directory.rmdir()
