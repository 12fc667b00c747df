"""aurae.containers.v0.ContainerService over gRPC: images and containers.

Requests are validated here into typed values (``request.ContainerRequest``, names, signals); the
domain code in images/ and containers/ never sees a raw message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from auraed.api.aurae.containers import v0 as pb
from auraed.containers.attach import ContainerInput, attach_input
from auraed.containers.containers import Containers, spec_error
from auraed.containers.errors import ContainerError
from auraed.containers.exec import ExecSession
from auraed.containers.files import CopiedFiles, PendingFile, file_error, file_spec
from auraed.containers.model import ContainerRecord, ProcessUser, State
from auraed.containers.oci_spec import exec_process, image_runtime_config, process_user, resolve_user
from auraed.containers.pid_groups import PidGroups
from auraed.containers.request import (
    IMAGE_MOUNT,
    MAX_ID,
    ContainerRequest,
    Hook,
    Hooks,
    Mount,
    Resources,
    Rlimit,
    Security,
    SpecError,
    parse_signal,
)
from auraed.containers.rootfs import MAX_SHARED_LAYERS, SharedImage, shared_layer
from auraed.containers.sandbox import HOST_LOCAL, SandboxContext, in_pid_namespace_of
from auraed.images.images import Images, PullProgress
from auraed.images.model import MAX_CONFIG_BYTES, ImageRecord
from auraed.names import seconds_from_ms, validate_label
from auraed.observe.logfile import end_position
from auraed.system.userns import IdMap
from auraed.wire.handlers import Context

log = logging.getLogger(__name__)

SERVICE_NAME = "aurae.containers.v0.ContainerService"
MAX_TAIL = 1_000_000
ATTACH_BACKLOG = 16
"""Replies held for an attached client that reads slowly; then the log follower waits."""
STREAMS = {
    "": frozenset({"stdout", "stderr"}),
    "stdout": frozenset({"stdout"}),
    "stderr": frozenset({"stderr"}),
}
STATES = {
    State.CREATING: pb.ContainerState.CREATED,
    State.CREATED: pb.ContainerState.CREATED,
    State.RUNNING: pb.ContainerState.RUNNING,
    State.EXITED: pb.ContainerState.EXITED,
    State.UNKNOWN: pb.ContainerState.UNKNOWN,
}


def _required(value: str, field: str) -> str:
    if not value:
        raise ContainerError.invalid(field, "is required")
    if len(value) > 4096 or "\0" in value:
        raise ContainerError.invalid(field, "is not a plausible value")
    return value


# -- messages -> typed values ----------------------------------------------------------------


def resources_value(resources: pb.Resources) -> Resources:
    return Resources(
        cpu_weight=resources.cpu_weight,
        cpu_max=resources.cpu_max,
        cpu_period=resources.cpu_period,
        cpuset_cpus=resources.cpuset_cpus,
        cpuset_mems=resources.cpuset_mems,
        memory_max=resources.memory_max,
        pids_max=resources.pids_max,
        cpu_shares=resources.cpu_shares,
        memory_swap=resources.memory_swap,
    )


def container_request(config: pb.ContainerConfig) -> ContainerRequest:
    resources = config.resources or pb.Resources()
    security = config.security or pb.Security()
    hooks = config.hooks or pb.Hooks()

    def hook_list(values: list[pb.Hook]) -> tuple[Hook, ...]:
        return tuple(Hook(h.path, tuple(h.args), tuple(h.env), h.timeout_seconds) for h in values)

    return ContainerRequest(
        name=validate_label(config.name, "config.name"),
        command=tuple(config.command),
        args=tuple(config.args),
        env=tuple(config.env),
        working_dir=config.working_dir,
        hostname=config.hostname,
        mounts=tuple(_mount_value(m, f"config.mounts[{index}]") for index, m in enumerate(config.mounts)),
        resources=resources_value(resources),
        security=Security(
            capabilities_add=tuple(security.capabilities_add),
            capabilities_drop=tuple(security.capabilities_drop),
            no_new_privileges=security.no_new_privileges,
            read_only_rootfs=security.read_only_rootfs,
            masked_paths=tuple(security.masked_paths),
            readonly_paths=tuple(security.readonly_paths),
            user=security.user,
            additional_gids=tuple(security.additional_gids),
            strict_groups=security.strict_groups,
            seccomp_profile=security.seccomp_profile,
            oom_score_adj=security.oom_score_adj,
            privileged=security.privileged,
            seccomp=_seccomp_section(security.seccomp_json),
            exact_paths=security.exact_paths,
        ),
        rlimits=tuple(Rlimit(r.type, r.soft, r.hard) for r in config.rlimits),
        sysctls=dict(config.sysctls),
        hooks=Hooks(
            hook_list(hooks.create_runtime),
            hook_list(hooks.create_container),
            hook_list(hooks.start_container),
            hook_list(hooks.poststart),
            hook_list(hooks.poststop),
        ),
        tty=config.tty,
        stdin=config.stdin,
        stdin_once=config.stdin_once,
        stop_signal=config.stop_signal,
        host_network=config.host_network,
    )


def _mount_value(mount: pb.Mount, field: str) -> Mount:
    """A request's mount; an image volume's shared layers checked as a shared rootfs's are (its
    ``source`` then the image id)."""
    if mount.type != IMAGE_MOUNT:
        if mount.sub_path or mount.shared_image is not None:
            raise ContainerError.invalid(field, "sub_path and shared_image go with type image only")
        return Mount(mount.destination, mount.source, mount.type, tuple(mount.options), mount.read_only)
    layers: tuple[str, ...] = ()
    source = mount.source
    if mount.shared_image is not None:
        shared = shared_image(mount.shared_image, f"{field}.shared_image")
        source, layers = shared.id, tuple(str(layer) for layer in shared.layers)
    return Mount(
        mount.destination, source, mount.type, tuple(mount.options), mount.read_only, mount.sub_path, layers
    )


def _seccomp_section(text: str) -> dict[str, Any] | None:
    """``seccomp_json`` as the OCI seccomp section it must be (the runtime checks its rules)."""
    if not text:
        return None
    try:
        section = json.loads(text)
    except ValueError as exc:
        raise ContainerError.invalid("config.security.seccomp_json", f"is not JSON: {exc}") from None
    if not isinstance(section, dict):
        raise ContainerError.invalid("config.security.seccomp_json", "is not a JSON object")
    return section


def shared_image(shared: pb.SharedRootfs, field: str = "config.shared_rootfs") -> SharedImage:
    """``shared`` (the request's ``field``) as the image it describes: a sha256 id, one layer or
    more, each a directory below the shared directory's mount, and a config that is a JSON object."""
    algorithm, _, digest = shared.image_id.partition(":")
    if algorithm != "sha256" or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ContainerError.invalid(f"{field}.image_id", f"{shared.image_id[:100]!r} is not a sha256 digest")
    if not 0 < len(shared.layers) <= MAX_SHARED_LAYERS:
        raise ContainerError.invalid(f"{field}.layers", f"must name 1 to {MAX_SHARED_LAYERS} layers")
    layers = []
    for index, path in enumerate(shared.layers):
        try:
            layers.append(shared_layer(path))
        except ValueError as exc:
            raise ContainerError.invalid(f"{field}.layers[{index}]", str(exc)) from None
    if len(shared.image_config) > MAX_CONFIG_BYTES:
        raise ContainerError.invalid(f"{field}.image_config", f"is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(shared.image_config or "{}")
    except ValueError as exc:
        raise ContainerError.invalid(f"{field}.image_config", f"is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ContainerError.invalid(f"{field}.image_config", "is not a JSON object")
    return SharedImage(shared.image_id, config, tuple(layers))


def id_mapping(mapping: pb.IdMapping) -> IdMap:
    """``config.user_namespace`` as the mappings it must be: each range non-empty, within the
    32-bit ids, and never of this machine's root."""
    field = "config.user_namespace"
    for kind, start, length in (
        ("uid", mapping.uid, mapping.uid_length),
        ("gid", mapping.gid, mapping.gid_length),
    ):
        if length < 1 or start + length > MAX_ID + 1:
            raise ContainerError.invalid(
                f"{field}.{kind}_length", f"{length} ids from {start} are out of range"
            )
        if start == 0:
            raise ContainerError.invalid(f"{field}.{kind}", "must not map this machine's root (id 0)")
    return IdMap(mapping.uid, mapping.uid_length, mapping.gid, mapping.gid_length)


def container_sandbox(
    config: pb.ContainerConfig, groups: PidGroups, pid_of: ContainerRecord | None
) -> SandboxContext:
    """A container on its own, but for the machine's IPC namespace and a group's or another
    container's PID namespace where asked: in a pod's guest VM, the pod's, shared by its
    containers, or that of the container a container targets."""
    idmap = id_mapping(config.user_namespace) if config.user_namespace is not None else None
    if idmap is not None:
        if config.host_ipc:
            raise ContainerError.invalid(
                "config.host_ipc",
                "goes with no user_namespace (the pod's IPC namespace is its user namespace's)",
            )
        sandbox = groups.user_sandbox(idmap, share_pid=bool(config.shared_pid))
    elif config.shared_pid:
        sandbox = groups.sandbox(config.shared_pid)
    else:
        sandbox = HOST_LOCAL
    if pid_of is not None:
        sandbox = in_pid_namespace_of(sandbox, pid_of.pid)
    if config.host_ipc:  # the runtime's own, auraed's: left out of the spec (SharedNamespaces.host)
        host = sandbox.namespaces.host | {"ipc"}
        sandbox = dataclasses.replace(sandbox, namespaces=dataclasses.replace(sandbox.namespaces, host=host))
    return sandbox


def _labels(values: dict[str, str], field: str) -> dict[str, str]:
    if len(values) > 256:
        raise ContainerError.invalid(field, "more than 256 labels")
    for key, value in values.items():
        if not key or len(key) > 253 or len(value) > 4096:
            raise ContainerError.invalid(field, f"label {key[:60]!r} is empty or too long")
    return dict(values)


def _signal(value: str) -> int:
    try:
        return parse_signal(value, "signal")
    except SpecError as exc:
        raise spec_error(exc) from None


# -- typed values -> messages ----------------------------------------------------------------


def image_message(image: ImageRecord) -> pb.Image:
    # Lenient: the images subsystem stores configs Create would refuse (Env ["FOO"]), and one of
    # them must not make every ListImages fail. Create still parses strictly and names the field.
    config = image_runtime_config({"config": image.config}, lenient=True)
    return pb.Image(
        id=image.id,
        references=list(image.references),
        repo_digests=list(image.repo_digests),
        manifest_digest=image.manifest_digest,
        size=image.size,
        config=pb.ImageConfig(
            entrypoint=list(config.entrypoint),
            cmd=list(config.cmd),
            env=list(config.env),
            working_dir=config.working_dir,
            user=config.user,
            stop_signal=config.stop_signal,
            volumes=list(config.volumes),
            exposed_ports=list(config.exposed_ports),
            labels=dict(config.labels),
        ),
        os=image.os,
        architecture=image.architecture,
        layers=[layer.digest for layer in image.layers],
        created_at=image.created_at,
    )


def status_message(record: ContainerRecord) -> pb.ContainerStatus:
    return pb.ContainerStatus(
        id=record.id,
        name=record.name,
        image=record.image,
        image_id=record.image_id,
        state=STATES[record.state],
        pid=record.pid if record.state == State.RUNNING else 0,
        exit_code=record.exit_code,
        signal=record.signal,
        oom_killed=record.oom_killed,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        labels=dict(record.labels),
        log_path=str(record.log_path),
        reason=record.reason,
        user=_user_message(record.user),
    )


def _user_message(user: ProcessUser | None) -> pb.ProcessUser | None:
    if user is None:
        return None
    return pb.ProcessUser(uid=user.uid, gid=user.gid, additional_gids=list(user.additional_gids))


def _progress_message(event: PullProgress) -> pb.ContainerServicePullImageResponse:
    return pb.ContainerServicePullImageResponse(
        progress=pb.PullProgress(
            phase=event.phase,
            digest=event.digest,
            layer_done=event.layer_done,
            layer_total=event.layer_total,
            done=event.done,
            total=event.total,
        )
    )


class ContainerServicer:
    def __init__(self, images: Images, containers: Containers, files: CopiedFiles) -> None:
        self._images = images
        self._containers = containers
        self._files = files

    # -- images ----------------------------------------------------------------------------

    async def pull_image(
        self, request: pb.ContainerServicePullImageRequest, context: Context
    ) -> AsyncIterator[pb.ContainerServicePullImageResponse]:
        reference = _required(request.reference, "reference")
        # Imported here: the HTTP stack costs ~5 MiB and ~1 s under emulation, and guests never pull.
        from auraed.images.registry import Credentials

        async for event in self._images.pull(reference, Credentials.from_auth(request.auth)):
            if isinstance(event, PullProgress):
                yield _progress_message(event)
            else:
                yield pb.ContainerServicePullImageResponse(image=image_message(event))

    async def missing_blobs(
        self, request: pb.ContainerServiceMissingBlobsRequest, context: Context
    ) -> pb.ContainerServiceMissingBlobsResponse:
        if len(request.digests) > 10_000:
            raise ContainerError.invalid("digests", "more than 10000")
        return pb.ContainerServiceMissingBlobsResponse(
            digests=self._images.missing_blobs(list(request.digests))
        )

    async def import_image(
        self, requests: AsyncIterator[pb.ContainerServiceImportImageRequest], context: Context
    ) -> pb.ContainerServiceImportImageResponse:
        first = await anext(aiter(requests), None)
        if first is None or first.header is None:
            raise ContainerError.invalid("header", "the first message must carry the header")
        header = first.header

        async def chunks() -> AsyncIterator[tuple[str, bytes, bool]]:
            async for message in requests:
                if message.chunk is None:
                    raise ContainerError.invalid("chunk", "every message after the first must carry a chunk")
                yield message.chunk.digest, message.chunk.data, message.chunk.last

        image, received = await self._images.import_image(
            _required(header.reference, "header.reference"),
            header.manifest,
            header.manifest_media_type,
            chunks(),
        )
        return pb.ContainerServiceImportImageResponse(image=image_message(image), received=received)

    async def import_image_layout(
        self, request: pb.ContainerServiceImportImageLayoutRequest, context: Context
    ) -> pb.ContainerServiceImportImageLayoutResponse:
        path = _required(request.path, "path")
        if not path.startswith("/"):
            raise ContainerError.invalid("path", "must be absolute")
        image = await self._images.import_layout(Path(path), request.ref_name, request.reference)
        return pb.ContainerServiceImportImageLayoutResponse(image=image_message(image))

    async def list_images(
        self, request: pb.ContainerServiceListImagesRequest, context: Context
    ) -> pb.ContainerServiceListImagesResponse:
        return pb.ContainerServiceListImagesResponse(images=[image_message(i) for i in self._images.all()])

    async def image_status(
        self, request: pb.ContainerServiceImageStatusRequest, context: Context
    ) -> pb.ContainerServiceImageStatusResponse:
        image = self._images.find(_required(request.image, "image"))
        return pb.ContainerServiceImageStatusResponse(image=image_message(image))

    async def remove_image(
        self, request: pb.ContainerServiceRemoveImageRequest, context: Context
    ) -> pb.ContainerServiceRemoveImageResponse:
        freed, deferred = await self._images.remove(_required(request.image, "image"))
        return pb.ContainerServiceRemoveImageResponse(freed_bytes=freed, collection_deferred=deferred)

    # -- containers ------------------------------------------------------------------------

    def _find(self, container_id: str) -> ContainerRecord:
        return self._containers.get(_required(container_id, "container_id"))

    def _running(self, container_id: str, what: str) -> ContainerRecord:
        record = self._find(container_id)
        if record.state != State.RUNNING:
            raise ContainerError.precondition(f"container {record.name} is {record.state}: cannot {what}")
        return record

    async def create(
        self, request: pb.ContainerServiceCreateRequest, context: Context
    ) -> pb.ContainerServiceCreateResponse:
        config = request.config
        if config is None:
            raise ContainerError.invalid("config", "is required")
        typed = container_request(config)
        pid_of = self._pid_of(config)
        record = await self._containers.create(
            typed,
            _required(config.image, "config.image"),
            _labels(config.labels, "config.labels"),
            start=request.start,
            sandbox=await asyncio.to_thread(container_sandbox, config, self._containers.pid_groups, pid_of),
            shared=shared_image(config.shared_rootfs) if config.shared_rootfs is not None else None,
        )
        return pb.ContainerServiceCreateResponse(status=status_message(record))

    def _pid_of(self, config: pb.ContainerConfig) -> ContainerRecord | None:
        """The running container whose PID namespace ``config.pid_of`` names."""
        if not config.pid_of:
            return None
        if config.shared_pid:
            raise ContainerError.invalid("config.pid_of", "goes with no shared_pid (one PID namespace)")
        target = self._containers.get(config.pid_of)
        if target.state != State.RUNNING or not target.pid:
            raise ContainerError.precondition(f"config.pid_of: container {target.name} is {target.state}")
        return target

    async def start(
        self, request: pb.ContainerServiceStartRequest, context: Context
    ) -> pb.ContainerServiceStartResponse:
        record = await self._containers.start(self._find(request.container_id))
        return pb.ContainerServiceStartResponse(status=status_message(record))

    async def stop(
        self, request: pb.ContainerServiceStopRequest, context: Context
    ) -> pb.ContainerServiceStopResponse:
        record = self._find(request.container_id)
        record = await self._containers.stop(record, seconds_from_ms(request.timeout_ms, "timeout_ms"))
        return pb.ContainerServiceStopResponse(status=status_message(record))

    async def update(
        self, request: pb.ContainerServiceUpdateRequest, context: Context
    ) -> pb.ContainerServiceUpdateResponse:
        record = self._find(request.container_id)
        await self._containers.update_resources(record, resources_value(request.resources or pb.Resources()))
        return pb.ContainerServiceUpdateResponse()

    async def kill(
        self, request: pb.ContainerServiceKillRequest, context: Context
    ) -> pb.ContainerServiceKillResponse:
        record = self._find(request.container_id)
        await self._containers.kill(record, _signal(_required(request.signal, "signal")))
        return pb.ContainerServiceKillResponse()

    async def delete(
        self, request: pb.ContainerServiceDeleteRequest, context: Context
    ) -> pb.ContainerServiceDeleteResponse:
        await self._containers.delete(self._find(request.container_id), request.force, request.keep_logs)
        return pb.ContainerServiceDeleteResponse()

    async def wait(
        self, request: pb.ContainerServiceWaitRequest, context: Context
    ) -> pb.ContainerServiceWaitResponse:
        record = await self._containers.wait(self._find(request.container_id))
        return pb.ContainerServiceWaitResponse(status=status_message(record))

    async def list(
        self, request: pb.ContainerServiceListRequest, context: Context
    ) -> pb.ContainerServiceListResponse:
        records = self._containers.all(_labels(request.labels, "labels"))
        return pb.ContainerServiceListResponse(containers=[status_message(r) for r in records])

    async def status(
        self, request: pb.ContainerServiceStatusRequest, context: Context
    ) -> pb.ContainerServiceStatusResponse:
        return pb.ContainerServiceStatusResponse(status=status_message(self._find(request.container_id)))

    async def logs(
        self, request: pb.ContainerServiceLogsRequest, context: Context
    ) -> AsyncIterator[pb.ContainerServiceLogsResponse]:
        record = self._find(request.container_id)
        streams = STREAMS.get(request.stream)
        if streams is None:
            raise ContainerError.invalid("stream", "must be stdout, stderr or empty")
        if request.tail is not None and request.tail > MAX_TAIL:
            raise ContainerError.invalid("tail", f"at most {MAX_TAIL}")
        if request.tail is not None and request.partial:
            raise ContainerError.invalid("tail", "counts whole lines: not with partial")
        batches = self._containers.logs(
            record, streams, request.tail, request.follow, request.since, parts=request.partial
        )
        async with contextlib.aclosing(batches):  # its file watch ends with the call, not at GC
            async for batch in batches:
                lines = [
                    pb.LogLine(line=x.content, stream=x.stream, timestamp=x.timestamp, partial=x.partial)
                    for x in batch
                ]
                yield pb.ContainerServiceLogsResponse(lines=lines)

    async def stats(
        self, request: pb.ContainerServiceStatsRequest, context: Context
    ) -> pb.ContainerServiceStatsResponse:
        record = self._find(request.container_id)
        values = await asyncio.to_thread(self._containers.stats, record)
        root, writable = await asyncio.to_thread(self._containers.writable_usage, record)
        return pb.ContainerServiceStatsResponse(
            **values,
            timestamp=time.time(),
            writable_bytes=writable.used_bytes,
            writable_inodes=writable.inodes_used,
            writable_path=str(root),
        )

    async def exec(
        self, requests: AsyncIterator[pb.ContainerServiceExecRequest], context: Context
    ) -> AsyncIterator[pb.ContainerServiceExecResponse]:
        start = await _first_start(requests)
        record = self._running(start.container_id, "exec into it")
        process = self._exec_process(record, start)
        size = (start.size.rows, start.size.columns) if start.size is not None and start.tty else None
        session = await self._containers.exec(record, process, start.tty, stdin=start.stdin, size=size)
        feeder = asyncio.ensure_future(_feed(session, requests))
        try:
            async for stream, data in session.output():
                yield (
                    pb.ContainerServiceExecResponse(stdout=data)
                    if stream == "stdout"
                    else pb.ContainerServiceExecResponse(stderr=data)
                )
            yield pb.ContainerServiceExecResponse(exit_code=await session.wait())
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            await session.close()

    async def attach(
        self, requests: AsyncIterator[pb.ContainerServiceAttachRequest], context: Context
    ) -> AsyncIterator[pb.ContainerServiceAttachResponse]:
        start = await _first_start(requests)
        record = self._running(start.container_id, "attach to it")
        asked = {"stdout": start.stdout, "stderr": start.stderr}
        streams = frozenset(name for name, wanted in asked.items() if wanted)
        # Where the output starts, before any input can reach the container: what it answers
        # to the client's first line is after this.
        log_end = await asyncio.to_thread(end_position, record.log_path, streams or STREAMS[""])
        container_input = attach_input(self._containers, record)
        detached = asyncio.Event()
        feeder = asyncio.ensure_future(_feed_attach(container_input, requests, detached))
        try:
            async for reply in self._attached(record, streams, log_end, detached):
                yield reply
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            if container_input is not None:
                container_input.close()

    async def _attached(
        self,
        record: ContainerRecord,
        streams: frozenset[str],
        log_end: tuple[int, int],
        detached: asyncio.Event,
    ) -> AsyncIterator[pb.ContainerServiceAttachResponse]:
        """The container's output from ``log_end`` on, record by record as it was written (a
        line's end where it ended), then its exit code; nothing more once the client detaches."""
        replies: asyncio.Queue[pb.ContainerServiceAttachResponse | None] = asyncio.Queue(ATTACH_BACKLOG)
        newline = b"\r\n" if record.tty else b"\n"

        async def follow() -> None:
            try:
                if streams:
                    batches = self._containers.logs(
                        record, streams, None, True, None, start=log_end, parts=True
                    )
                    async with contextlib.aclosing(batches):
                        async for batch in batches:
                            for part in batch:
                                data = part.content.encode() + (b"" if part.partial else newline)
                                await replies.put(
                                    pb.ContainerServiceAttachResponse(stdout=data)
                                    if part.stream == "stdout"
                                    else pb.ContainerServiceAttachResponse(stderr=data)
                                )
                ended = await self._containers.wait(record)
                await replies.put(pb.ContainerServiceAttachResponse(exit_code=ended.exit_code))
            except ContainerError as exc:  # deleted meanwhile: the call ends, with no exit code
                log.info("attach to %s ended: %s", record.name, exc)
            await replies.put(None)

        async def detach() -> None:
            await detached.wait()
            await replies.put(None)

        tasks = [asyncio.ensure_future(follow()), asyncio.ensure_future(detach())]
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def list_processes(
        self, request: pb.ContainerServiceListProcessesRequest, context: Context
    ) -> pb.ContainerServiceListProcessesResponse:
        found = await asyncio.to_thread(self._containers.processes, self._find(request.container_id))
        return pb.ContainerServiceListProcessesResponse(
            processes=[
                pb.Process(pid=p.pid, ppid=p.ppid, args=list(p.args), state=p.state, uid=p.uid) for p in found
            ]
        )

    async def copy_file(
        self, requests: AsyncIterator[pb.ContainerServiceCopyFileRequest], context: Context
    ) -> pb.ContainerServiceCopyFileResponse:
        first = await anext(aiter(requests), None)
        if first is None:
            raise ContainerError.invalid("path", "the first message must name the file")
        spec = file_spec(first.path, first.mode, first.uid, first.gid)
        pending = await asyncio.to_thread(self._files.open, spec)
        try:
            await _write_copied(pending, first.data)
            async for message in requests:
                if message.path or message.mode or message.uid is not None or message.gid is not None:
                    raise ContainerError.invalid("path", "only the first message names the file and its mode")
                await _write_copied(pending, message.data)
            await asyncio.to_thread(_commit_copied, pending)
        finally:
            pending.abort()  # nothing once committed; else the temporary file goes
        log.info("copied %s (%d bytes)", pending.path, pending.size)
        return pb.ContainerServiceCopyFileResponse(path=str(pending.path), size=pending.size)

    def _exec_process(self, record: ContainerRecord, start: pb.ExecStart) -> dict[str, Any]:
        defaults = self._containers.process_defaults(record)
        try:
            process = exec_process(defaults, start.command, start.env, start.working_dir)
            if start.user:
                uid, gid, groups = resolve_user(record.rootfs, start.user, where="start.user")
                process["user"] = process_user(uid, gid, groups)
        except SpecError as exc:
            raise spec_error(exc) from None
        return process


async def _write_copied(pending: PendingFile, data: bytes) -> None:
    if data:
        try:
            await asyncio.to_thread(pending.write, data)
        except OSError as exc:
            raise file_error(exc, pending.path) from None


def _commit_copied(pending: PendingFile) -> None:
    try:
        pending.commit()
    except OSError as exc:
        raise file_error(exc, pending.path) from None


async def _feed(session: ExecSession, requests: AsyncIterator[pb.ContainerServiceExecRequest]) -> None:
    """Client -> process: stdin data, terminal resizes, the end of stdin and signals."""
    async for message in requests:
        if message.resize is not None:
            session.resize(message.resize.rows, message.resize.columns)
        if message.stdin:
            await session.write_stdin(message.stdin)
        if message.close_stdin:
            await session.close_stdin()
        if message.signal:
            await session.kill(_signal(message.signal))
    if not session.tty:
        # The client is done sending: the process sees EOF. (On a terminal that would be ^D,
        # which ends an interactive shell: there only an explicit close_stdin sends it.)
        await session.close_stdin()


async def _first_start(requests: AsyncIterator[Any]) -> Any:
    """The ``start`` of a stream's first message (Exec's ExecStart, Attach's AttachStart)."""
    first = await anext(aiter(requests), None)
    if first is None or first.start is None:
        raise ContainerError.invalid("start", "the first message must carry start")
    return first.start


async def _feed_attach(
    container_input: ContainerInput | None,
    requests: AsyncIterator[pb.ContainerServiceAttachRequest],
    detached: asyncio.Event,
) -> None:
    """Client -> container: stdin data and terminal resizes (dropped where it has no input open),
    then the end of input: the client detaches, or with stdin_once the container's stdin closes."""
    async for message in requests:
        if container_input is not None:
            if message.resize is not None:
                container_input.resize(message.resize.rows, message.resize.columns)
            if message.stdin:
                await container_input.write(message.stdin)
        if message.close_stdin:
            break
    if container_input is not None and container_input.closes_stdin:
        await container_input.end()
    else:
        detached.set()
