"""aurae.vms.v0.VmService over gRPC: requests are validated into typed values here, at the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator

from auraed.api.aurae.vms import v0 as pb
from auraed.names import seconds_from_ms, validate_label
from auraed.vms.debug import DebugConsoles
from auraed.vms.errors import VmError
from auraed.vms.guests import Guests
from auraed.vms.model import (
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
    MAX_VCPUS,
    MIN_MEMORY_MIB,
    State,
    host_memory_mib,
    parse_kernel_args,
    parse_path,
    parse_vm,
)
from auraed.vms.templates import AUTO_PREFIX, TemplateRecord
from auraed.vms.vms import DEFAULT_START_TIMEOUT, TAIL_LINE_MAX, Vms, VmView
from auraed.wire.handlers import Context, peer_identities

SERVICE_NAME = "aurae.vms.v0.VmService"
MAX_TAIL = 1_000_000
MAX_MARKER = 4096

STATES = {
    State.ALLOCATING: pb.VmState.ALLOCATED,
    State.ALLOCATED: pb.VmState.ALLOCATED,
    State.STARTING: pb.VmState.STARTING,
    State.RUNNING: pb.VmState.RUNNING,
    State.STOPPING: pb.VmState.STOPPING,
    State.STOPPED: pb.VmState.STOPPED,
    State.EXITED: pb.VmState.EXITED,
    State.CRASHED: pb.VmState.CRASHED,
}


def status_message(view: VmView) -> pb.VmStatus:
    record = view.record
    state = STATES[record.state]
    reported = view.backend_status
    if (
        state == pb.VmState.RUNNING
        and reported not in ("", "running")
        and not reported.startswith("unreachable")
    ):
        state = pb.VmState.PAUSED
    net = record.net
    return pb.VmStatus(
        vm=record.spec.to_message(),
        state=state,
        backend=record.backend,
        backend_status=view.backend_status,
        pid=view.pid,
        tap=net.tap if net else "",
        host_address=f"{net.host_ip}/{net.prefixlen}" if net else "",
        guest_address=f"{net.guest_ip}/{net.prefixlen}" if net else "",
        mac=net.mac if net else "",
        address=view.address,
        console_path=str(record.console_path),
        accelerator=record.accelerator,
        started_at=record.started_at,
        finished_at=record.finished_at,
        exit_code=record.exit_code,
        signal=record.signal,
        reason=record.reason,
        # Cut here too: records saved before tails were cut may hold lines of any length.
        console_tail=[line[:TAIL_LINE_MAX] for line in record.console_tail],
        template=record.template,
        restore_ms=record.restore_ms,
    )


def template_message(record: TemplateRecord, clones: list[str]) -> pb.TemplateStatus:
    shape = record.shape
    return pb.TemplateStatus(
        template=pb.Template(
            name=record.name,
            vcpus=shape.vcpus,
            memory_mib=shape.memory_mib,
            kernel=shape.kernel,
            initramfs=shape.initramfs,
            root_disk=shape.root_disk,
            kernel_args=list(shape.kernel_args),
        ),
        state=record.state,
        reason=record.reason,
        backend=record.backend,
        machine=record.machine,
        accelerator=record.accelerator,
        digest=record.digest,
        auto=record.auto,
        created_at=record.created_at,
        build_ms=round(record.build_seconds * 1000),
        imports_ms=round(record.imports_seconds * 1000),
        save_ms=round(record.save_seconds * 1000),
        memory_resident_bytes=record.memory_resident_bytes(),
        clones=clones,
        debug_console=record.debug_console,
        max_vcpus=record.max_vcpus,
        max_memory_mib=record.max_memory_mib,
        memory_slots=record.memory_slots,
        build=record.build,
        mem_total_kib=record.mem_total_kib,
    )


class VmServicer:
    def __init__(self, vms: Vms, guests: Guests, debug_console: bool = False) -> None:
        self._vms = vms
        self._guests = guests
        self._debug = DebugConsoles(vms, debug_console)

    async def allocate(
        self, request: pb.VmServiceAllocateRequest, context: Context
    ) -> pb.VmServiceAllocateResponse:
        record = await self._guests.allocate(parse_vm(request.vm))
        return pb.VmServiceAllocateResponse(status=status_message(await self._vms.view(record)))

    async def free(self, request: pb.VmServiceFreeRequest, context: Context) -> pb.VmServiceFreeResponse:
        name = validate_label(request.name, "name")
        await self._guests.free(name, seconds_from_ms(request.timeout_ms, "timeout_ms"))
        return pb.VmServiceFreeResponse()

    async def start(self, request: pb.VmServiceStartRequest, context: Context) -> pb.VmServiceStartResponse:
        name = validate_label(request.name, "name")
        marker = request.wait_for_console
        if len(marker) > MAX_MARKER or "\0" in marker:
            raise VmError.invalid("wait_for_console", f"at most {MAX_MARKER} characters, no NUL")
        timeout = seconds_from_ms(request.timeout_ms, "timeout_ms")
        if timeout is not None and timeout <= 0:
            raise VmError.invalid("timeout_ms", "must be positive")
        booted = await self._guests.boot(
            name, wait_for_console=marker, timeout=timeout or DEFAULT_START_TIMEOUT
        )
        view = await self._vms.view(booted.record)
        return pb.VmServiceStartResponse(
            address=view.address,
            status=status_message(view),
            console_ready_ms=round(booted.ready * 1000) if booted.ready is not None else 0,
        )

    async def stop(self, request: pb.VmServiceStopRequest, context: Context) -> pb.VmServiceStopResponse:
        name = validate_label(request.name, "name")
        record = await self._vms.stop(name, seconds_from_ms(request.timeout_ms, "timeout_ms"))
        return pb.VmServiceStopResponse(status=status_message(await self._vms.view(record)))

    async def list(self, request: pb.VmServiceListRequest, context: Context) -> pb.VmServiceListResponse:
        name = validate_label(request.name, "name") if request.name else ""
        views = await self._vms.list(name)
        return pb.VmServiceListResponse(vms=[status_message(v) for v in views])

    async def get_console(
        self, request: pb.VmServiceGetConsoleRequest, context: Context
    ) -> AsyncIterator[pb.VmServiceGetConsoleResponse]:
        name = validate_label(request.name, "name")
        if request.tail is not None and request.tail > MAX_TAIL:
            raise VmError.invalid("tail", f"at most {MAX_TAIL}")
        async for line in self._vms.console(name, request.tail, request.follow):
            yield pb.VmServiceGetConsoleResponse(line=line)

    async def resize(
        self, request: pb.VmServiceResizeRequest, context: Context
    ) -> pb.VmServiceResizeResponse:
        name = validate_label(request.name, "name")
        spec = self._vms.get(name).spec
        vcpus = request.vcpus or spec.vcpus
        if vcpus > MAX_VCPUS:
            raise VmError.invalid("vcpus", f"{vcpus} is out of range 1..{MAX_VCPUS}")
        memory = request.memory_mib or spec.memory_mib
        limit = host_memory_mib()
        if limit and memory > limit:
            raise VmError.invalid(
                "memory_mib", f"{memory} MiB is more than the host has ({limit} MiB MemTotal)"
            )
        record, resized = await self._guests.resize_reporting(name, vcpus, memory)
        return pb.VmServiceResizeResponse(
            status=status_message(await self._vms.view(record)),
            guest_online_cpus=resized.online_cpus,
            guest_mem_total_kib=resized.mem_total_kib,
            resize_ms=round(resized.seconds * 1000),
        )

    async def debug_shell(
        self, requests: AsyncIterator[pb.VmServiceDebugShellRequest], context: Context
    ) -> AsyncIterator[pb.VmServiceDebugShellResponse]:
        stream = aiter(requests)
        first = await anext(stream, None)
        if first is None or not first.name:
            raise VmError.invalid("name", "the first message must name the VM")
        name = validate_label(first.name, "name")
        who = ",".join(peer_identities(context)) or "an unidentified client"

        async def inputs() -> AsyncIterator[tuple[bytes, tuple[int, int] | None]]:
            if first.input:
                yield first.input, None
            async for request in stream:
                yield request.input, _size_of(request)

        async for item in self._debug.session(name, who, _size_of(first), inputs()):
            yield pb.VmServiceDebugShellResponse(output=item.data, exit_code=item.exit_code)

    async def create_template(
        self, request: pb.VmServiceCreateTemplateRequest, context: Context
    ) -> pb.VmServiceCreateTemplateResponse:
        template = request.template
        if template is None:
            raise VmError.invalid("template", "is required")
        name = validate_label(template.name, "template.name")
        if name.startswith(AUTO_PREFIX) or name == "auto":
            raise VmError.invalid("template.name", f"{name!r}: auto and auto-* are the host's own templates")
        vcpus = template.vcpus or DEFAULT_VCPUS
        if not 1 <= vcpus <= MAX_VCPUS:
            raise VmError.invalid("template.vcpus", f"{vcpus} is out of range 1..{MAX_VCPUS}")
        memory = template.memory_mib or DEFAULT_MEMORY_MIB
        limit = host_memory_mib()
        if memory < MIN_MEMORY_MIB or (limit and memory > limit):
            raise VmError.invalid(
                "template.memory_mib", f"{memory} MiB is out of range {MIN_MEMORY_MIB}..{limit}"
            )
        record = await self._guests.create_template(
            name,
            vcpus=vcpus,
            memory_mib=memory,
            kernel=parse_path(template.kernel, "template.kernel", False),
            initramfs=parse_path(template.initramfs, "template.initramfs", False),
            root_disk=parse_path(template.root_disk, "template.root_disk", False),
            kernel_args=parse_kernel_args(list(template.kernel_args)),
        )
        return pb.VmServiceCreateTemplateResponse(
            status=template_message(record, self._guests.template_users(name))
        )

    async def list_templates(
        self, request: pb.VmServiceListTemplatesRequest, context: Context
    ) -> pb.VmServiceListTemplatesResponse:
        templates = self._guests.templates
        records = [templates.get(validate_label(request.name, "name"))] if request.name else templates.all()
        return pb.VmServiceListTemplatesResponse(
            templates=[template_message(r, self._guests.template_users(r.name)) for r in records]
        )

    async def remove_template(
        self, request: pb.VmServiceRemoveTemplateRequest, context: Context
    ) -> pb.VmServiceRemoveTemplateResponse:
        await self._guests.remove_template(validate_label(request.name, "name"))
        return pb.VmServiceRemoveTemplateResponse()


def _size_of(request: pb.VmServiceDebugShellRequest) -> tuple[int, int] | None:
    size = request.size
    return (size.rows, size.columns) if size is not None and size.rows and size.columns else None
