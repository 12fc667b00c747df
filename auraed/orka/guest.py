"""orka workloads each in a guest VM of their own (``orka_workload_isolation = vm``).

For each workload the host allocates and boots a guest VM (auraed/vms/guests.py: the guest
image, a config disk, ready once the guest's auraed serves over mTLS), sized from the workload's
limits (CPU millicores as vCPUs, rounded up; its memory plus what the guest itself takes) or the
configured default. The image, pulled on the host, is placed in the guest (only the blobs it
lacks, over ImportImage: guests never reach a registry), and the container is made and started
by the guest's ContainerService, with the same environment and limits it would have on the host.
Status is the guest's Status and Stats of the container; a Signal stops the container in the
guest (the image's stop signal, SIGKILL after the host's grace period, or SIGKILL), then the VM
is stopped and freed. A guest that never serves is stopped by Guests.boot, its console's tail in
the error, which becomes the workload's TERMINATED message; the VM is freed then too, as after
any failure of the preparation, so that a workload that did not run leaves nothing.

Disk usage is reported as 0: the guest's API does not say what a container wrote.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TypeVar

import betterproto2

from auraed.api.aurae.containers import v0 as pb
from auraed.errors import AuraeError, ErrorKind
from auraed.images.images import Images
from auraed.orka.model import (
    INSTANCE_LABEL,
    OrkaError,
    Phase,
    Sample,
    Status,
    Usage,
    Workload,
    WorkloadSpec,
    exit_message,
    usage_numbers,
)
from auraed.system.tasks import run_to_end
from auraed.vms.guest_calls import call_guest, place_in_guest
from auraed.vms.guests import GUEST_BASE_MIB, Guests
from auraed.vms.model import MAX_VCPUS, VmSpec, host_memory_mib
from auraed.vms.placement import GuestEndpoint, ImagePlacer

log = logging.getLogger(__name__)

STATUS_TIMEOUT = 10.0  # seconds a guest has to answer Status or Stats
CREATE_TIMEOUT = 300.0  # seconds for a Create in a guest: its layers unpacked there (TCG is slow)
STOP_SLACK = 30.0  # seconds a guest's Stop may take beyond its grace period

Reply = TypeVar("Reply", bound=betterproto2.Message)


@dataclasses.dataclass(frozen=True)
class GuestSizing:
    """A workload's guest when the workload gives no limits (orka_vm_vcpus, orka_vm_memory_mib)."""

    vcpus: int = 1
    memory_mib: int = 768


def guest_size(spec: WorkloadSpec, default: GuestSizing) -> tuple[int, int]:
    """(vCPUs, MiB) of a workload's guest: its CPU limit in whole CPUs, rounded up, and its
    memory limit plus the guest's own; the default where it gives none."""
    vcpus = math.ceil(spec.cpu_millicores / 1000) if spec.cpu_millicores else default.vcpus
    memory_mib = GUEST_BASE_MIB + spec.memory_mib if spec.memory_mib else default.memory_mib
    return vcpus, memory_mib


def check_guest_size(spec: WorkloadSpec, default: GuestSizing) -> None:
    """Refuse, naming the limit, a workload no guest VM could be made for."""
    vcpus, memory_mib = guest_size(spec, default)
    if vcpus > MAX_VCPUS:
        raise OrkaError.invalid(
            "resource_limits.cpu", f"{vcpus} vCPUs for its guest VM are more than {MAX_VCPUS}"
        )
    host = host_memory_mib()
    if host and memory_mib > host:
        raise OrkaError.invalid(
            "resource_limits.memory",
            f"its guest VM would need {memory_mib} MiB, more than the host has ({host} MiB)",
        )


def status_ending(status: pb.ContainerStatus) -> str:
    return exit_message(
        unknown=status.state == pb.ContainerState.UNKNOWN,
        reason=status.reason,
        oom_killed=status.oom_killed,
        signal=status.signal,
        exit_code=status.exit_code,
    )


class GuestRunner:
    """``grace``: the seconds a STOP gives the container (the host's stop_grace_period)."""

    def __init__(
        self, guests: Guests, images: Images, placer: ImagePlacer, sizing: GuestSizing, grace: float
    ) -> None:
        self._guests = guests
        self._images = images
        self._placer = placer
        self._sizing = sizing
        self._grace = grace

    def check(self, spec: WorkloadSpec) -> None:
        check_guest_size(spec, self._sizing)

    # -- run -------------------------------------------------------------------------------

    async def run(self, workload: Workload, image: str, save: Callable[[Workload], None]) -> None:
        name = workload.name
        vcpus, memory_mib = guest_size(workload.spec, self._sizing)
        workload.at(f"booting its guest VM {name} ({vcpus} vCPU{'s' if vcpus > 1 else ''}, {memory_mib} MiB)")
        spec = VmSpec.guest(name, vcpus, memory_mib)
        await self._guests.allocate(spec)  # undoes itself when it fails
        try:
            booted = await self._guests.boot(name)
            log.info(
                "orka workload %s: guest %s ready in %.1f s", workload.instance_id, name, booted.ready or 0
            )
            endpoint = await self._guests.lookup(name)
            workload.at(f"placing {image} in its guest VM")
            await place_in_guest(self._placer, endpoint, image, self._images.find(image))
            workload.at("creating its container in its guest VM")
            reply = await self._call(
                endpoint, "Create", self._create_request(workload, image), pb.ContainerServiceCreateResponse,
                CREATE_TIMEOUT,
            )  # fmt: skip
        except BaseException:
            await run_to_end(self._free(name))  # a workload that did not run leaves nothing
            raise
        workload.container_id = reply.status.id if reply.status else ""
        save(workload)
        log.info("orka workload %s runs in guest VM %s", workload.instance_id, name)

    @staticmethod
    def _create_request(workload: Workload, image: str) -> pb.ContainerServiceCreateRequest:
        spec = workload.spec
        resources = spec.resources()
        config = pb.ContainerConfig(
            name=workload.name,
            image=image,
            env=list(spec.env),
            labels={INSTANCE_LABEL: spec.instance_id},
            resources=pb.Resources(
                cpu_max=resources.cpu_max, cpu_period=resources.cpu_period, memory_max=resources.memory_max
            ),
        )
        return pb.ContainerServiceCreateRequest(config=config, start=True)

    @staticmethod
    async def _call(
        endpoint: GuestEndpoint,
        method: str,
        request: betterproto2.Message,
        reply: type[Reply],
        timeout: float,
    ) -> Reply:
        """``method`` of the guest's ContainerService; its failures as errors of their kind."""
        return await call_guest(endpoint, method, request, reply, timeout)

    # -- status ----------------------------------------------------------------------------

    def _vm_state(self, name: str) -> str:
        try:
            return f"its guest VM is {self._guests.vms.get(name).state_with_reason()}"
        except AuraeError:
            return "its guest VM is gone"

    async def _endpoint(self, workload: Workload) -> GuestEndpoint | None:
        """The guest's endpoint; None when its VM is not running."""
        try:
            return await self._guests.lookup(workload.name)
        except AuraeError:
            return None

    async def _container(self, endpoint: GuestEndpoint, workload: Workload) -> pb.ContainerStatus:
        request = pb.ContainerServiceStatusRequest(container_id=workload.container_id)
        reply = await self._call(
            endpoint, "Status", request, pb.ContainerServiceStatusResponse, STATUS_TIMEOUT
        )
        return reply.status or pb.ContainerStatus()

    async def status(self, workload: Workload, sample: Sample) -> tuple[Status, Sample]:
        endpoint = await self._endpoint(workload)
        if endpoint is None:  # its VM ended, or a Signal is freeing it (how it ended is known then)
            ending = workload.ended or workload.ended_with(self._vm_state(workload.name))
            return Status(Phase.TERMINATED, ending), sample
        try:
            container = await self._container(endpoint, workload)
            if container.state == pb.ContainerState.RUNNING:
                return await self._usage(endpoint, workload, container, sample)
        except AuraeError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                return Status(Phase.TERMINATED, workload.ended or "removed in its guest VM"), sample
            # Not an end: the next status asks again (its VM's end shows there).
            return Status(Phase.RUNNING, f"its guest VM does not answer: {exc.message}"), sample
        if container.state == pb.ContainerState.CREATED:
            return Status(Phase.WAITING, workload.stage), sample
        return Status(Phase.TERMINATED, workload.ended_with(status_ending(container))), sample

    async def _usage(
        self, endpoint: GuestEndpoint, workload: Workload, container: pb.ContainerStatus, sample: Sample
    ) -> tuple[Status, Sample]:
        """CPU over the interval and memory, from the guest's Stats; times are the guest's clock."""
        request = pb.ContainerServiceStatsRequest(container_id=workload.container_id)
        try:
            stats = await self._call(
                endpoint, "Stats", request, pb.ContainerServiceStatsResponse, STATUS_TIMEOUT
            )
        except AuraeError:  # it ended as it was read: the next status says how
            return Status(Phase.RUNNING), sample
        if sample is None:  # the first: over its life so far
            cpu, wall = stats.cpu_usage_usec, stats.timestamp - container.created_at
        else:
            cpu, wall = stats.cpu_usage_usec - sample[1], stats.timestamp - sample[0]
        millicores, memory_mib = usage_numbers(cpu, wall, stats.memory_current)
        return Status(Phase.RUNNING, None, Usage(millicores, memory_mib)), (
            stats.timestamp,
            stats.cpu_usage_usec,
        )

    # -- stop, remove ----------------------------------------------------------------------

    async def stop(self, workload: Workload, kill: bool) -> None:
        endpoint = await self._endpoint(workload)
        if endpoint is None or not workload.container_id:
            return
        grace = 0.0 if kill else self._grace
        request = pb.ContainerServiceStopRequest(
            container_id=workload.container_id, timeout_ms=round(grace * 1000)
        )
        try:
            await self._call(endpoint, "Stop", request, pb.ContainerServiceStopResponse, grace + STOP_SLACK)
        except AuraeError as exc:
            # Freeing its VM ends the container all the same.
            log.warning("orka workload %s: cannot stop its container: %s", workload.instance_id, exc.message)

    async def remove(self, workload: Workload) -> None:
        endpoint = await self._endpoint(workload)
        if endpoint is None:
            if self._exists(workload.name):
                workload.ended = workload.ended_with(self._vm_state(workload.name))
        elif workload.container_id:
            try:
                container = await self._container(endpoint, workload)
            except AuraeError as exc:
                log.warning(
                    "orka workload %s: no status from its guest: %s", workload.instance_id, exc.message
                )
            else:
                if container.state not in (pb.ContainerState.RUNNING, pb.ContainerState.CREATED):
                    workload.ended = workload.ended_with(status_ending(container))
        await self._free(workload.name)

    def _exists(self, name: str) -> bool:
        try:
            self._guests.vms.get(name)
        except AuraeError:
            return False
        return True

    async def _free(self, name: str) -> None:
        """Stop the VM at once and free it (its tap, its files): the container is done with."""
        if self._exists(name):
            await self._guests.free(name, 0.0)
            self._placer.forget(name)

    async def recover(self, workload: Workload) -> bool:
        if not self._exists(workload.name):
            return False
        if not workload.container_id:  # auraed ended while it was being prepared
            log.info("orka workload %s was being prepared: its guest VM is freed", workload.instance_id)
            await self._free(workload.name)
            return False
        return True
