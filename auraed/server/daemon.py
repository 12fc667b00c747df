"""The daemon: composes the services a role serves, serves them, and shuts down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from auraed.api.google_proto_descriptor_pool import default_google_proto_descriptor_pool
from auraed.cells.cells import Cells
from auraed.cells.servicer import SERVICE_NAME as CELLS
from auraed.cells.servicer import CellServicer
from auraed.config import AuthorizationPolicy, DaemonConfig
from auraed.discovery.capabilities import Capabilities, probe
from auraed.discovery.servicer import SERVICE_NAME as DISCOVERY
from auraed.discovery.servicer import DiscoveryServicer
from auraed.errors import AuraeError, ConfigError
from auraed.init.roles import Role, detect_role
from auraed.metrics.sink import NO_METRICS, MetricsSink
from auraed.observe.events import DaemonLogHandler, ObserveHub
from auraed.observe.logfile import LogWatch
from auraed.observe.servicer import SERVICE_NAME as OBSERVE
from auraed.observe.servicer import ObserveServicer
from auraed.server.authz import AuthorizedHandlers, GatedHandlers
from auraed.server.gate import CallGate
from auraed.server.listeners import (
    add_plain_unix_listener,
    add_tcp_listener,
    add_unix_listener,
    config_credentials,
    lock_state_dir,
    prepare_unix_socket,
    private_directory,
    remove_unix_socket,
    server_options,
)
from auraed.server.network_service import SERVICE_NAME as NETWORK
from auraed.server.network_service import NetworkServicer
from auraed.server.rpc import CollectedHandlers, LazyService, generic_handler
from auraed.server.system_service import SERVICE_NAME as SYSTEM
from auraed.server.system_service import Machine, SystemServicer
from auraed.state.store import Store
from auraed.system.cgroupfs import Cgroupfs
from auraed.system.sdnotify import notify
from auraed.system.supervisor import Supervisor

if TYPE_CHECKING:
    from auraed.containers.containers import Containers
    from auraed.cri.setup import Cri
    from auraed.images.images import Images
    from auraed.metrics.endpoint import MetricsEndpoint
    from auraed.metrics.prometheus import DaemonMetrics
    from auraed.orka.agent import NodeAgent
    from auraed.orka.workloads import Workloads
    from auraed.system.node import CpuLoad
    from auraed.vms.guests import Guests

log = logging.getLogger("auraed")

CONTAINERS = "aurae.containers.v0.ContainerService"
VMS = "aurae.vms.v0.VmService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
SERVER_STOP_GRACE = 2.0  # seconds in-flight calls get once shutdown begins
QUIET_LIBRARIES = ("pyroute2",)
"""Libraries whose DEBUG lines the daemon drops when it logs at DEBUG: pyroute2 logs every
netlink message whole (kilobytes per interface listed), which buries the daemon's own lines."""


def _not_library_debug(record: logging.LogRecord) -> bool:
    # A filter on the handlers, not a level on the library's logger: pyroute2 sets its logger's
    # level to 0 when it is imported, which is lazily, after this setup.
    return record.levelno >= logging.INFO or not record.name.startswith(QUIET_LIBRARIES)


def setup_logging(config: DaemonConfig, hub: ObserveHub) -> None:
    root = logging.getLogger()
    root.setLevel(config.log_level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for handler in (console, DaemonLogHandler(hub.daemon_log)):
        handler.addFilter(_not_library_debug)
        root.addHandler(handler)


def _reflection(services: list[str]) -> list[grpc.GenericRpcHandler]:
    """Reflection of ``services``, health and itself (made at its first call: LazyService)."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    _register_standard_descriptors()
    standard = CollectedHandlers()
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(
            [*services, HEALTH, REFLECTION], pool=default_google_proto_descriptor_pool
        ),
        standard,
    )
    return standard.handlers


def _register_standard_descriptors() -> None:
    """Reflection answers from our pool: it must also know health's and reflection's own files."""
    from grpc_reflection.v1alpha import reflection_pb2

    pool = default_google_proto_descriptor_pool
    for module in (health_pb2, reflection_pb2):
        try:
            pool.FindFileByName(module.DESCRIPTOR.name)
        except KeyError:
            pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)


class Daemon:
    """``machine``: where auraed is PID 1, the machine it powers off (auraed/__main__.py)."""

    def __init__(self, config: DaemonConfig, machine: Machine | None = None) -> None:
        self.config = config
        self._machine = machine
        self.hub = ObserveHub.create(config.log_buffer_lines)
        self.role, self._role_reason = detect_role(config.role, config.nested)
        self.health = HealthServicer()
        self.cells: Cells | None = None
        self.images: Images | None = None
        self.containers: Containers | None = None
        self.guests: Guests | None = None
        self.store: Store | None = None
        self._supervisor: Supervisor | None = None
        self._cgroups: Cgroupfs | None = None
        self._log_watch = LogWatch()
        self._server: grpc.aio.Server | None = None
        self._cri_server: grpc.aio.Server | None = None
        self.cri: Cri | None = None
        self._cri_socket_bound = False
        self.metrics: DaemonMetrics | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self.workloads: Workloads | None = None
        self.agent: NodeAgent | None = None
        self._orka_server: grpc.aio.Server | None = None
        self._cpu: CpuLoad | None = None
        self._exit_code = 0
        self._gate = CallGate()
        self._stopping = asyncio.Event()
        self._serving = False
        self._state_lock: int | None = None
        # Only a socket we bound is ours to remove: a refused start must not unlink a live one.
        self._socket_bound = False
        # A template guest's (auraed/init/identity.py): the start stops before the listeners until
        # this returns the clone's own configuration (its address, certificate and key).
        self.before_listening: Callable[[], Awaitable[DaemonConfig]] | None = None

    def _machine_init(self) -> bool:
        """Whether auraed is this machine's init (a guest's, a machine booted on auraed): what
        may change the machine itself (its network, its entropy pool, its clock)."""
        from auraed.init.pid1 import is_machine_init

        return self._machine is not None and is_machine_init()

    def services(self) -> list[str]:
        """The aurae services this role serves (the design's table)."""
        services = [CELLS, DISCOVERY, NETWORK, OBSERVE, SYSTEM]
        if self.role is not Role.NESTED:
            services.append(CONTAINERS)
        if self.role is Role.HOST:
            services.append(VMS)
        return sorted(services)

    async def run(self) -> int:
        setup_logging(self.config, self.hub)
        self.hub.daemon_log.bind(asyncio.get_running_loop())
        self.hub.signals.bind(asyncio.get_running_loop())
        # Before starting, not once serving: a signal in between (a SIGHUP right after "serving
        # on", a SIGTERM during recovery) took its default action and ended the daemon on the
        # spot. A stop asked for during start follows as soon as the start is done. Before the
        # first line too, which tells a watcher that signals are safe from then on.
        self._install_signal_handlers()
        log.info("auraed starting as %s (%s)", self.role.value, self._role_reason)
        if self.config.orka_scheduler:
            from auraed.system.node import CpuLoad

            self._cpu = CpuLoad()  # from the start on: the first NodeStatus covers the start
        try:
            await self._start()
        except Exception as exc:
            # An expected refusal (a config or system error) says enough; anything else is a bug.
            expected = isinstance(exc, (AuraeError, OSError))
            log.error("cannot start: %s", exc or type(exc).__name__, exc_info=not expected)
            await self._shutdown()
            return 1
        await self._stopping.wait()
        await self._shutdown()
        return self._exit_code

    def request_stop(self) -> None:
        self._stopping.set()

    def fail(self, message: str) -> None:
        """Stop, and exit non-zero, saying why (the node agent that could not join)."""
        log.error("%s: shutting down", message)
        self._exit_code = 1
        self.request_stop()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # A SIGINT ignored from the start stays ignored, as Python's own default has it: a
            # script starts its background jobs (`auraed &`) so, and its Ctrl-C then leaves the
            # daemon to the script's clean-up, which still needs it (hack/demo frees its VM).
            if sig is signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            loop.add_signal_handler(sig, self._on_signal, sig)
        # SIGHUP's default would end the daemon on the spot, without a graceful stop (a closed
        # terminal, or a "reload" from a service manager): there is nothing to reload, say so.
        loop.add_signal_handler(signal.SIGHUP, self._on_hangup)

    def _on_signal(self, sig: int) -> None:
        log.info("received %s: shutting down", signal.Signals(sig).name)
        self.request_stop()

    @staticmethod
    def _on_hangup() -> None:
        log.warning("received SIGHUP: ignored; auraed reads its configuration only at start (restart it)")

    async def _start(self) -> None:
        config = self.config
        held = self.before_listening
        # Before anything else: bad credentials would otherwise pass for a bind failure, or be
        # served, every client then refused. (A template has none yet: checked once it has.)
        if held is None:
            credentials = config_credentials(config)
        private_directory(config.state_dir, "state directory")
        private_directory(config.runtime_dir, "runtime directory")
        # Before touching any state: two daemons on one state dir would fight over every record.
        self._state_lock = lock_state_dir(config.state_dir)
        prepare_unix_socket(config.socket)
        if config.metrics_listen:
            from auraed.metrics.prometheus import DaemonMetrics

            self.metrics = DaemonMetrics()
        self.store = Store(config.state_dir / "auraed.db")
        cgroups = self._cgroups = Cgroupfs(root=config.cgroup_root, base=config.cgroup_base)
        log.info("cgroup layout: %s", cgroups.layout.value)
        supervisor = Supervisor(config.runtime_dir)
        self._supervisor = supervisor
        self.cells = Cells(
            self.store,
            self.hub,
            cgroups,
            runtime_dir=config.runtime_dir,
            default_grace_period=config.stop_grace_period,
            supervisor=supervisor,
        )
        self.cells.recover()
        if self.role is not Role.NESTED:
            from auraed.containers import setup as containers_setup
            from auraed.images import setup as images_setup

            self.images = images_setup.build(config, self.store, self._metrics_sink())
            self.containers = containers_setup.build(
                config,
                self.store,
                self.images,
                cgroups=cgroups,
                supervisor=supervisor,
                log_watch=self._log_watch,
                machine_sysctls=self.role is Role.GUEST,
            )
            await self.containers.recover()
        self._count_states()
        capabilities = await asyncio.to_thread(probe, cgroups)
        services = self.services()
        handlers = await self._handlers(self.cells, services, capabilities)
        # Authorization wraps every service, health and reflection too; no server interceptors.
        server = grpc.aio.server(options=server_options(config))
        self._server = server
        server.add_generic_rpc_handlers(
            self._metered(AuthorizedHandlers(config.authorization, handlers, self._gate))
        )
        if held is not None:
            config, credentials = await self._clone_config(held, supervisor)
        self._add_listeners(server, config, credentials)
        # Before the aurae API's line: a watcher that saw it finds the kubelet's socket too.
        if self.role is Role.HOST and config.cri and self.images is not None:
            await self._serve_cri()
        await server.start()
        if config.orka_scheduler and self.containers is not None and self.images is not None:
            await self._serve_orka(credentials)
        elif config.orka_scheduler:
            log.warning("orka_scheduler is ignored: a %s auraed runs no containers", self.role.value)
        await self._serve_metrics()
        log.info("serving on unix:%s", config.socket)
        await self._set_health([*services, ""], serving=True)
        notify("READY=1\nSTATUS=serving")  # systemd's Type=notify; PID 1 of the host image
        # After serving, not before: in a guest under emulation its start-up costs ~0.3 s of the
        # one vCPU, which boot-to-ready should not wait for.
        supervisor.start()

    def _add_listeners(
        self, server: grpc.aio.Server, config: DaemonConfig, credentials: grpc.ServerCredentials
    ) -> None:
        started = time.monotonic()
        add_unix_listener(server, config.socket, credentials)
        self._socket_bound = True
        if config.tcp_listen:
            port = add_tcp_listener(server, config.tcp_listen, credentials)
            took = (time.monotonic() - started) * 1000
            log.info("serving on %s (port %d; listeners added in %.0f ms)", config.tcp_listen, port, took)

    async def _clone_config(
        self, held: Callable[[], Awaitable[DaemonConfig]], supervisor: Supervisor
    ) -> tuple[DaemonConfig, grpc.ServerCredentials]:
        """A template's start, all done but the listeners (and saved): they wait for the clone's
        identity, which brings its own config (the template's but its address) and key. The
        monitors' launcher starts first, so that no clone pays for it. Nothing before may make a
        TLS object: a TLS library's random state made in the template would be every clone's."""
        supervisor.start()
        self.config = config = await held()
        started = time.monotonic()
        credentials = config_credentials(config)
        log.info("the clone's credentials loaded in %.0f ms", (time.monotonic() - started) * 1000)
        return config, credentials

    async def _handlers(
        self, cells: Cells, services: list[str], capabilities: Capabilities
    ) -> list[grpc.GenericRpcHandler]:
        """Every service this daemon serves, health and reflection included, in lookup order."""
        handlers: list[grpc.GenericRpcHandler] = []
        if self.containers is not None and self.images is not None:
            from auraed.containers.files import CopiedFiles
            from auraed.containers.servicer import ContainerServicer

            files = CopiedFiles(self.config.state_dir / "files", self.config.copy_file_max_mib << 20)
            servicer = ContainerServicer(self.images, self.containers, files)
            handlers.append(generic_handler(CONTAINERS, servicer))
        if self.role is Role.HOST and self.images is not None:
            handlers.append(await self._vm_service(capabilities))
        handlers += [
            generic_handler(CELLS, CellServicer(cells)),
            generic_handler(
                OBSERVE, ObserveServicer(self.hub, cells.executables.log_source, self._log_watch)
            ),
            generic_handler(
                DISCOVERY, DiscoveryServicer(self.role, services, capabilities, lambda: self._serving)
            ),
            generic_handler(SYSTEM, SystemServicer(self.request_stop, self._machine)),
            generic_handler(NETWORK, NetworkServicer(self._machine_init())),
        ]
        standard = CollectedHandlers()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, standard)
        handlers += standard.handlers
        # Few clients ask (grpcurl, a debugging operator); its modules cost ~0.2 MiB and ~0.1 s of
        # a guest's imports under TCG, so it is imported by the first call.
        handlers.append(LazyService(REFLECTION, functools.partial(_reflection, services)))
        if self.role is Role.HOST and self.guests is not None and self.images is not None:
            from auraed.server.guest_router import GuestRouter
            from auraed.vms.placement import ImagePlacer

            # Around every service: it relays ContainerService calls naming a VM to that guest,
            # and refuses a VM named on any other method it knows.
            return [GuestRouter(self.guests.lookup, ImagePlacer(self.images), handlers)]
        return handlers

    async def _serve_cri(self) -> None:
        """The kubelet's endpoint: its own server, so the plain socket never reaches the aurae API."""
        from auraed.cri import setup as cri_setup

        config = self.config
        assert self.store is not None and self._cgroups is not None
        assert self.images is not None and self.containers is not None
        self.cri = await cri_setup.build(
            config,
            self.store,
            self.images,
            self._cgroups,
            self.containers.runtime_binary,  # the one Containers chose: found once
            containers=self.containers,
            guests=self.guests,
            log_watch=self._log_watch,
        )
        if self.metrics is not None:
            from auraed.cri.model import PodState

            pods = self.cri.pods
            self.metrics.add_states(
                "auraed_pods", "CRI pod sandboxes by state", [state.value for state in PodState],
                lambda: [r.state.value for r in pods.all()],
            )  # fmt: skip
        server = grpc.aio.server(options=server_options(config))
        self._cri_server = server
        handlers = [generic_handler(name, servicer) for name, servicer in self.cri.servicers.items()]
        server.add_generic_rpc_handlers(self._metered(GatedHandlers(handlers, self._gate)))
        add_plain_unix_listener(server, config.cri_socket)
        self._cri_socket_bound = True
        await server.start()
        log.info(
            "serving the CRI on unix:%s, its streaming on %s", config.cri_socket, self.cri.streaming.base_url
        )

    async def _vm_service(self, capabilities: Capabilities) -> grpc.GenericRpcHandler:
        from auraed.system.kvm import KvmProbe
        from auraed.vms import setup
        from auraed.vms.guests import Guests, GuestTrust
        from auraed.vms.servicer import VmServicer

        config = self.config
        assert self.store is not None
        kvm = KvmProbe(capabilities.kvm_present, capabilities.kvm_usable, capabilities.kvm_detail, 0.0)
        vms = setup.build(config, self.store, kvm=kvm)
        await vms.recover()
        trust = GuestTrust(
            config.ca_crt,
            config.ca_key,
            config.state_dir / "pki",
            config.guest_keepalive_time,
            config.guest_keepalive_timeout,
        )
        self.guests = Guests(
            vms,
            trust,
            config.guest_image,
            config.guest_ready_timeout,
            self._metrics_sink(),
            template_memory_mib=config.vm_template_memory_mib,
        )
        if self.metrics is not None:
            from auraed.vms.model import State as VmState

            vm_states = [v for k, v in vars(VmState).items() if k.isupper()]
            self.metrics.add_states(
                "auraed_vms", "VMs by state", vm_states, lambda: [r.state for r in vms.all()]
            )
        return generic_handler(VMS, VmServicer(vms, self.guests, config.vm_debug_console))

    def _metrics_sink(self) -> MetricsSink:
        return self.metrics if self.metrics is not None else NO_METRICS

    def _metered(self, handler: grpc.GenericRpcHandler) -> list[grpc.GenericRpcHandler]:
        """``handler``, its calls counted when metrics are on (outermost: refusals count too)."""
        if self.metrics is None:
            return [handler]
        from auraed.metrics.prometheus import MeteredHandlers

        return [MeteredHandlers(self.metrics, [handler])]

    def _count_states(self) -> None:
        """Cells and containers by state, read from their owners at each scrape."""
        if self.metrics is None:
            return
        cells = self.cells
        assert cells is not None
        self.metrics.add_states(
            "auraed_cells", "Cells by state", ["allocating", "ready"], lambda: [r.state for r in cells.all()]
        )
        containers = self.containers
        if containers is not None:
            from auraed.containers.model import State as ContainerState

            states = [v for k, v in vars(ContainerState).items() if k.isupper()]
            self.metrics.add_states(
                "auraed_containers",
                "Containers by state",
                states,
                lambda: [r.state for r in containers.all()],
            )

    async def _serve_metrics(self) -> None:
        if self.metrics is None:
            return
        from auraed.metrics.endpoint import MetricsEndpoint

        host, _, port = self.config.metrics_listen.rpartition(":")
        self._metrics_endpoint = MetricsEndpoint(self.metrics.registry, host, int(port))
        try:
            bound = await self._metrics_endpoint.start()
        except OSError as exc:
            raise ConfigError(
                f"metrics_listen: cannot listen on {self.config.metrics_listen}: {exc.strerror}"
            ) from None
        log.info("serving metrics on http://%s:%d/metrics", host, bound)

    async def _serve_orka(self, credentials: grpc.ServerCredentials) -> None:
        """orka's WorkloadService on its own listener (mTLS for the scheduler's identity alone,
        unless configured plain), then the node agent joins the scheduler in the background."""
        from auraed.orka import setup as orka_setup
        from auraed.orka.servicer import SERVICE_NAME as WORKLOADS
        from auraed.orka.servicer import WorkloadServicer

        config = self.config
        assert self.store is not None and self.images is not None and self.containers is not None
        self.workloads = await orka_setup.build_workloads(
            config, self.store, self.images, self.containers, self.guests
        )
        servicer = WorkloadServicer(self.workloads, config.orka_workload_status_interval)
        handlers = [generic_handler(WORKLOADS, servicer)]
        server = grpc.aio.server(options=server_options(config))
        self._orka_server = server
        if config.orka_plaintext:
            log.warning(
                "the orka WorkloadService on %s is served without TLS, so without authorization: "
                "whoever reaches it runs containers on this node (orka_plaintext = true)",
                config.orka_listen,
            )
            guarded: grpc.GenericRpcHandler = GatedHandlers(handlers, self._gate)
            try:
                port = server.add_insecure_port(config.orka_listen)
            except RuntimeError as exc:
                raise ConfigError(f"orka_listen: cannot listen on {config.orka_listen}: {exc}") from exc
        else:
            policy = AuthorizationPolicy(
                default=(), identities={config.orka_scheduler_identity: (f"{WORKLOADS}/*",)}
            )
            guarded = AuthorizedHandlers(policy, handlers, self._gate)
            port = add_tcp_listener(server, config.orka_listen, credentials)
        server.add_generic_rpc_handlers(self._metered(guarded))
        await server.start()
        log.info(
            "serving orka's WorkloadService on %s (%s)",
            config.orka_listen,
            "plain" if config.orka_plaintext else f"mTLS, for {config.orka_scheduler_identity}",
        )
        assert self._cpu is not None
        self.agent = orka_setup.build_agent(config, self.store, port, self.fail, self._cpu)
        self.agent.start()

    async def _set_health(self, services: list[str], serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._serving = serving
        for name in services:
            await self.health.set(name, status)

    async def _stop_node_agent(self) -> None:
        if self.agent is not None:
            try:
                await self.agent.leave()  # first: the scheduler sends this node nothing more
            except Exception:
                log.exception("error while leaving the orka scheduler")
        if self.workloads is not None:
            await self.workloads.close()
        if self._orka_server is not None:
            await self._orka_server.stop(SERVER_STOP_GRACE)

    async def _shutdown(self) -> None:
        # First of all: no call may start anything while, and after, the subsystems stop.
        self._gate.close("auraed is shutting down")
        notify("STOPPING=1")
        with contextlib.suppress(Exception):
            await self._set_health([*self.services(), ""], serving=False)
        await self._stop_node_agent()
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.close()
        if self.cells is not None:
            try:
                await self.cells.shutdown(
                    self.config.stop_executables_on_shutdown, self.config.free_cells_on_shutdown
                )
            except Exception:
                log.exception("error while stopping cells")
        if self.containers is not None:
            try:
                if self.config.stop_containers_on_shutdown:
                    await self.containers.stop_all()
                await self.containers.close()
            except Exception:
                log.exception("error while stopping containers")
        if self.guests is not None:
            try:
                await self.guests.vms.shutdown(stop_vms=False)
                await self.guests.trust.close()
            except Exception:
                log.exception("error while closing VMs")
        if self.images is not None:
            self.images.close()
        await self._log_watch.close()
        if self._cgroups is not None:
            self._cgroups.prune("")  # the base, made on demand, unless cells or containers remain
        if self._supervisor is not None:
            self._supervisor.close()
        if self._cri_server is not None:
            await self._cri_server.stop(SERVER_STOP_GRACE)
        if self.cri is not None:
            await self.cri.close()
        if self._cri_socket_bound:
            remove_unix_socket(self.config.cri_socket)
        if self._server is not None:
            await self._server.stop(SERVER_STOP_GRACE)
        if self._socket_bound:
            remove_unix_socket(self.config.socket)
        if self.store is not None:
            self.store.close()
        log.info("auraed stopped")
