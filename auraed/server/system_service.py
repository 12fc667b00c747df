"""aurae.system.v0.SystemService: the daemon itself and, where auraed is PID 1, the machine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from auraed.api.aurae.system import v0 as pb
from auraed.errors import AuraeError
from auraed.wire.handlers import Context, peer_identities

SERVICE_NAME = "aurae.system.v0.SystemService"
MAX_REASON_CHARS = 256  # a reason is one line of the daemon's log, not a document

log = logging.getLogger(__name__)


def _reason(text: str) -> str:
    if len(text) > MAX_REASON_CHARS:
        raise AuraeError.invalid("reason", f"at most {MAX_REASON_CHARS} characters, got {len(text)}")
    if not text.isprintable():
        raise AuraeError.invalid("reason", "must be printable text on one line")
    return text


def not_machine_init(what: str) -> AuraeError:
    """The refusal of what only the machine's init may do (change the machine itself)."""
    return AuraeError.precondition(
        f"{what}: only where auraed is the machine's init (a guest VM, bare metal), not on a "
        "machine it merely runs on"
    )


class Machine(Protocol):
    """The machine, where auraed is its PID 1 (auraed/init/pid1.py Pid1, handed over by
    auraed/__main__.py)."""

    def power_off(self, reason: str, reboot: bool = False) -> str:
        """Stop auraed, then power off or reboot (or exit, PID 1 of a pid namespace): what follows
        the stop. Raises FAILED_PRECONDITION where it could only halt the machine, or cannot reboot."""
        ...


class SystemServicer:
    """``request_stop`` stops the daemon gracefully (what SIGTERM does); ``machine`` is None
    unless auraed is PID 1."""

    def __init__(self, request_stop: Callable[[], None], machine: Machine | None = None) -> None:
        self._request_stop = request_stop
        self._machine = machine
        self._mem_total_kib = 0  # the machine's as OnlineCpuMem last saw it (its tmpfs sized to it)

    async def shutdown(
        self, request: pb.SystemServiceShutdownRequest, context: Context
    ) -> pb.SystemServiceShutdownResponse:
        reason = _reason(request.reason)
        why = f"Shutdown called by {_caller(context)}" + (f": {reason}" if reason else "")
        if self._machine is None:
            if request.reboot:
                raise AuraeError.precondition("reboot: auraed is not this machine's init")
            log.info("%s: stopping", why)
            self._request_stop()
            return pb.SystemServiceShutdownResponse(then="exit")
        # PID 1 stops the daemon, then powers off (or exits, PID 1 of a pid namespace); refused
        # with FAILED_PRECONDITION where it could only halt the machine.
        return pb.SystemServiceShutdownResponse(then=self._machine.power_off(why, request.reboot))

    def _machine_init(self, what: str) -> None:
        from auraed.init.pid1 import is_machine_init

        if self._machine is None or not is_machine_init():
            raise not_machine_init(what)

    async def reseed_random(
        self, request: pb.SystemServiceReseedRandomRequest, context: Context
    ) -> pb.SystemServiceReseedRandomResponse:
        from auraed.system import reseed

        entropy = bytes(request.entropy)
        if not reseed.MIN_ENTROPY <= len(entropy) <= reseed.MAX_ENTROPY:
            raise AuraeError.invalid(
                "entropy", f"{len(entropy)} bytes; {reseed.MIN_ENTROPY} to {reseed.MAX_ENTROPY} are taken"
            )
        self._machine_init("ReseedRandom")
        await asyncio.to_thread(reseed.reseed_random, entropy)
        log.info("random: %d bytes of entropy from %s, CRNG reseeded", len(entropy), _caller(context))
        return pb.SystemServiceReseedRandomResponse(boot_id=await asyncio.to_thread(reseed.boot_id))

    async def set_time(
        self, request: pb.SystemServiceSetTimeRequest, context: Context
    ) -> pb.SystemServiceSetTimeResponse:
        from auraed.system import reseed

        if request.unix_ns <= 0:
            raise AuraeError.invalid("unix_ns", "must be a time after the epoch")
        self._machine_init("SetTime")
        before = time.time_ns()
        reseed.set_wall_clock(request.unix_ns)
        adjusted = request.unix_ns - before
        log.info("clock set by %s (%+.3f s)", _caller(context), adjusted / 1e9)
        return pb.SystemServiceSetTimeResponse(adjusted_ns=adjusted)

    async def online_cpu_mem(
        self, request: pb.SystemServiceOnlineCpuMemRequest, context: Context
    ) -> pb.SystemServiceOnlineCpuMemResponse:
        from auraed.system import hotplug

        self._machine_init("OnlineCpuMem")
        done = await asyncio.to_thread(hotplug.online_cpu_mem)
        if done.mem_total_kib != self._mem_total_kib:
            from auraed.init.pid1 import resize_tmpfs

            # Grown: PID 1's tmpfs mounts take half the new memory, as a cold boot of its size has.
            self._mem_total_kib = done.mem_total_kib
            for failure in await asyncio.to_thread(resize_tmpfs):
                log.warning("a tmpfs not resized to the machine's memory: %s", failure)
        if done.cpus_onlined or done.memory_blocks_onlined or done.failures:
            log.info(
                "hotplug (asked by %s): %d CPUs and %d memory blocks onlined%s; %d CPUs, MemTotal %d KiB",
                _caller(context),
                done.cpus_onlined,
                done.memory_blocks_onlined,
                f", refused: {'; '.join(done.failures)}" if done.failures else "",
                done.online_cpus,
                done.mem_total_kib,
            )
        return pb.SystemServiceOnlineCpuMemResponse(
            online_cpus=done.online_cpus,
            mem_total_kib=done.mem_total_kib,
            cpus_onlined=done.cpus_onlined,
            memory_blocks_onlined=done.memory_blocks_onlined,
            failures=list(done.failures),
        )


def _caller(context: Context) -> str:
    return ",".join(peer_identities(context)) or "an unidentified client"
