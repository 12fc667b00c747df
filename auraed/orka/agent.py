"""The node agent's side of an orka scheduler: join, stream the node's status, re-join, leave.

orka's own agent (dev-sys-do/orka, node-agent/) falls short where this does not:
- the node's id is the same across restarts (the daemon keeps it in its state store), not a new
  UUID each start, so a scheduler sees a restarted node as itself;
- a join that fails is tried again ``retry_interval`` after, and after ``join_attempts`` failed
  attempts (as orka's agent counts its ``lifecycle_retries``) the daemon exits saying why, or
  keeps serving and keeps trying in the background, as configured; two attempts are never closer
  than the interval, whatever came between them (the start-up attempts, a status stream refused
  at once);
- when the status stream breaks (the scheduler restarted, the network went), the agent joins
  again and resumes;
- orka's scheduler keeps the address of a node's first join (the join's peer IP and the port it
  sent) and answers ALREADY_EXISTS to later joins of that id without updating it: a node killed
  without leaving and back on another port or IP would never be called there. So a join answered
  ALREADY_EXISTS leaves and joins again, once: the scheduler's record is then this node's address;
- NodeStatus carries real figures (auraed.system.node): memory total and available from the
  kernel, the CPU load over the last interval, the first sample at once;
- on a graceful stop it leaves the cluster.

Calls go over one channel: TLS when a CA is configured for the scheduler, as orka's scheduler
serves by default (with a certificate it makes itself for "localhost": ``server_name`` names what
to check it against), plain otherwise (orka's scheduler started with ``--no-tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from auraed.api.scheduler import agent as pb
from auraed.errors import ConfigError
from auraed.system import node
from auraed.wire import codec, tls
from auraed.wire.channel import channel_options

log = logging.getLogger(__name__)

LIFECYCLE = "scheduler.agent.LifecycleService"
STATUS = "scheduler.agent.StatusUpdateService"
JOIN_TIMEOUT = 10.0  # seconds one JoinCluster may take (a scheduler that does not answer)
LEAVE_TIMEOUT = 2.0  # seconds LeaveCluster may hold up a graceful stop


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    scheduler: str  # host:port
    port: int  # the WorkloadService's, told to the scheduler
    retry_interval: float = 5.0  # from the end of one join attempt to the start of the next
    join_attempts: int = 3  # failed at start, after which the daemon exits or serves on
    exit_on_join_failure: bool = True
    status_interval: float = 15.0
    ca_crt: Path | None = None  # TLS to the scheduler when set
    server_name: str = ""  # what the scheduler's certificate must name; its host when empty


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


def tls_hint(details: str, settings: AgentSettings) -> str:
    """What to set when a failure to connect says that the node and the scheduler disagree about
    TLS, in the words grpc was seen to use; "" otherwise. orka's scheduler serves TLS unless
    started with --no-tls, with a certificate it makes itself for localhost."""
    if "failed to connect" not in details:
        return ""
    if settings.ca_crt is None and ("Socket closed" in details or "Connection reset by peer" in details):
        return (
            "perhaps the scheduler serves TLS, as orka's does unless started with --no-tls: set "
            "orka_scheduler_ca to its certificate, orka's own being tls/scheduler.pem in its data_dir"
        )
    if settings.ca_crt is not None and "WRONG_VERSION_NUMBER" in details:
        return "the scheduler serves no TLS, as orka's started with --no-tls: leave orka_scheduler_ca unset"
    if settings.ca_crt is not None and "Hostname Verification" in details:
        name = settings.server_name or settings.scheduler.rpartition(":")[0]
        return (
            f"its certificate does not name {name}: set orka_scheduler_server_name to a name it "
            "has; orka's own certificate names localhost"
        )
    return ""


def scheduler_channel(settings: AgentSettings) -> grpc.aio.Channel:
    """The channel to the scheduler; a CA that cannot be read is refused now, naming the file."""
    options: list[tuple[str, int | str]] = list(channel_options())
    if settings.ca_crt is None:
        return grpc.aio.insecure_channel(settings.scheduler, options=options)
    ca = tls.read_credential(settings.ca_crt, "orka scheduler's CA certificate", ConfigError)
    if not tls.holds_certificate(ca):
        raise ConfigError(f"orka_scheduler_ca: {settings.ca_crt} holds no valid PEM certificate")
    if settings.server_name:
        options.append(("grpc.ssl_target_name_override", settings.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.aio.secure_channel(settings.scheduler, credentials, options=options)


class NodeAgent:
    """``give_up(message)`` is called when the first join failed every time and the daemon is
    to exit; otherwise the agent runs until :meth:`leave`. ``cpu`` is the load sampler, made as
    the daemon starts: the first sample covers its start."""

    def __init__(
        self,
        settings: AgentSettings,
        node_id: str,
        give_up: Callable[[str], None],
        cpu: node.CpuLoad | None = None,
    ) -> None:
        self.settings = settings
        self.node_id = node_id
        self._give_up = give_up
        self._channel = scheduler_channel(settings)
        self._cpu = cpu or node.CpuLoad()
        self._task: asyncio.Task[None] | None = None
        self._last_attempt_end: float | None = None  # time.monotonic() when the last join ended
        self.joined = False  # the scheduler took this node at least once

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="orka node agent")

    async def _run(self) -> None:
        settings = self.settings
        if not await self._join(attempts=settings.join_attempts):
            seconds = (settings.join_attempts - 1) * settings.retry_interval
            if settings.exit_on_join_failure:
                self._give_up(
                    f"cannot join the orka scheduler at {settings.scheduler}: {settings.join_attempts} "
                    f"attempts over {seconds:g} s failed (orka_join_failure = exit)"
                )
                return
            log.warning(
                "the orka scheduler at %s could not be joined: serving locally, and trying to join "
                "every %g s in the background (orka_join_failure = serve)",
                settings.scheduler,
                settings.retry_interval,
            )
            await self._join(attempts=None)
        while True:
            reason = await self._stream_status()
            log.warning("the status stream to the orka scheduler ended (%s): joining it again", reason)
            await self._join(attempts=None)

    async def _join(self, attempts: int | None) -> bool:
        """Join, trying up to ``attempts`` times (None: until it works)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._paced_join()
                return True
            except grpc.aio.AioRpcError as exc:
                last = attempts is not None and attempt >= attempts
                of = f" of {attempts}" if attempts is not None else ""
                hint = tls_hint(exc.details() or "", self.settings)
                then = "" if last else f"; next attempt in {self.settings.retry_interval:g} s"
                log.warning(
                    "cannot join the orka scheduler at %s (attempt %d%s): %s%s%s",
                    self.settings.scheduler, attempt, of, _reason(exc), f" ({hint})" if hint else "", then,
                )  # fmt: skip
                if last:
                    return False

    async def _paced_join(self) -> None:
        """One join attempt, no sooner than retry_interval after the last one ended: the
        scheduler is not hammered, by the retries nor by a stream it refuses at once."""
        if self._last_attempt_end is not None:
            ready = self._last_attempt_end + self.settings.retry_interval
            await asyncio.sleep(max(0.0, ready - time.monotonic()))
        try:
            await self._join_once()
        finally:
            self._last_attempt_end = time.monotonic()

    async def _join_once(self) -> None:
        try:
            await self._call_join()
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.ALREADY_EXISTS:
                raise
            await self._join_again()
        log.info(
            "joined the orka scheduler at %s as node %s (WorkloadService on port %d)",
            self.settings.scheduler, self.node_id, self.settings.port,
        )  # fmt: skip
        self.joined = True

    async def _join_again(self) -> None:
        """The scheduler knows this node already, maybe at another address (orka's keeps the
        first join's): leave and join, once, so that its record is this node's address. A
        failure of either is the attempt's."""
        settings = self.settings
        log.info(
            "the orka scheduler at %s knows node %s already, maybe at an earlier address: leaving "
            "and joining again, so that it calls this node on port %d",
            settings.scheduler, self.node_id, settings.port,
        )  # fmt: skip
        await self._call_leave(JOIN_TIMEOUT)
        try:
            await self._call_join()
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.ALREADY_EXISTS:
                raise
            # Not forgotten on leaving: a scheduler unlike orka's, or another node with this id.
            log.warning(
                "the orka scheduler at %s still knows node %s after it left: it may call this "
                "node at an address it no longer has",
                settings.scheduler, self.node_id,
            )  # fmt: skip

    async def _call_join(self) -> None:
        request = codec.encode(pb.ConnectionRequest(id=self.node_id, port=self.settings.port))
        await self._channel.unary_unary(f"/{LIFECYCLE}/JoinCluster")(request, timeout=JOIN_TIMEOUT)

    async def _call_leave(self, timeout: float) -> None:
        request = codec.encode(pb.DisconnectionNotice(id=self.node_id))
        await self._channel.unary_unary(f"/{LIFECYCLE}/LeaveCluster")(request, timeout=timeout)

    def node_status(self) -> pb.NodeStatus:
        memory = node.read_memory()
        return pb.NodeStatus(
            id=self.node_id,
            memory=pb.NodeStatusMemory(total=memory.total, free=memory.available),
            cpu_load=pb.NodeStatusCpuLoad(load=self._cpu.sample()),
        )

    async def _statuses(self) -> AsyncIterator[bytes]:
        while True:
            yield codec.encode(self.node_status())
            await asyncio.sleep(self.settings.status_interval)

    async def _stream_status(self) -> str:
        """Stream NodeStatus until the stream ends; why it ended."""
        call = self._channel.stream_unary(f"/{STATUS}/UpdateNodeStatus")(self._statuses())
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return _reason(exc)
        return "the scheduler ended it"

    async def leave(self) -> None:
        """Stop streaming and leave the cluster (if it was joined); then close the channel."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.joined:
            try:
                await self._call_leave(LEAVE_TIMEOUT)
                log.info("left the orka scheduler at %s", self.settings.scheduler)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "cannot leave the orka scheduler at %s: %s", self.settings.scheduler, _reason(exc)
                )
        await self._channel.close()
