"""The daemon's Prometheus metrics: one registry per daemon, nothing global.

- RPCs by service, method and status code, with latency histograms, counted by a wrapping
  handler (:class:`MeteredHandlers`) around each server's handlers, as authorization is (no
  interceptors: auraed.server.authz says why).
- Cells, containers, VMs and pods by state, read from the domain objects when scraped
  (:meth:`DaemonMetrics.add_states`): nothing is kept twice, so the figures cannot drift.
- Image pulls and the bytes they downloaded, and VM boot durations, as the subsystems report them
  through the :class:`~auraed.metrics.sink.MetricsSink` this is.
- The node's memory and CPU time, from auraed.system.node, which the orka node agent's NodeStatus
  reads too.

Only the daemon imports this module, and only with its endpoint configured.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from auraed.metrics.sink import MetricsSink
from auraed.system import node
from auraed.wire.handlers import Context, first_handler, handler_parts

# Seconds: an RPC of auraed's takes from well under a millisecond (Status) to minutes (a pull, a
# followed stream), so the buckets span both.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# A VM boots in well under a second with KVM and takes tens of seconds under TCG.
BOOT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


class _States:
    """Gauges of things by state, read from their owners at each scrape."""

    def __init__(self) -> None:
        self._sources: list[tuple[str, str, tuple[str, ...], Callable[[], Iterable[str]]]] = []

    def add(
        self, name: str, documentation: str, states: Sequence[str], source: Callable[[], Iterable[str]]
    ) -> None:
        self._sources.append((name, documentation, tuple(states), source))

    def collect(self) -> Iterator[Metric]:
        for name, documentation, states, source in self._sources:
            family = GaugeMetricFamily(name, documentation, labels=["state"])
            tally = Tally(source())
            # Every known state, 0 included, so that a query sees a series drop to nothing.
            for state in dict.fromkeys([*states, *sorted(tally)]):
                family.add_metric([state], tally.get(state, 0))
            yield family


class _Node:
    """The node's memory and CPU time, as the kernel counts them (auraed.system.node)."""

    def collect(self) -> Iterator[Metric]:
        memory = node.read_memory()
        yield GaugeMetricFamily(
            "auraed_node_memory_total_bytes", "Memory of the node (MemTotal)", memory.total
        )
        yield GaugeMetricFamily(
            "auraed_node_memory_available_bytes",
            "Memory available without swapping (MemAvailable): what NodeStatus reports as free",
            memory.available,
        )
        cpu = node.read_cpu_times()
        family = CounterMetricFamily(
            "auraed_node_cpu_seconds",
            "CPU time of every CPU since boot, busy or idle; NodeStatus's load is busy's share of both",
            labels=["mode"],
        )
        family.add_metric(["busy"], cpu.busy / node.USER_HZ)
        family.add_metric(["idle"], cpu.idle / node.USER_HZ)
        yield family


class DaemonMetrics(MetricsSink):
    """Every metric of one daemon, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._rpcs = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by service, method and status code",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=self.registry,
        )
        self._rpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Seconds from an RPC's start to its end (a stream's last message), by service and method",
            ["grpc_service", "grpc_method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._pulls = Counter(
            "auraed_image_pulls",
            'Image pulls ended, by result ("ok" or the error\'s kind)',
            ["result"],
            registry=self.registry,
        )
        self._pull_bytes = Counter(
            "auraed_image_pull_bytes", "Bytes of layers downloaded from registries", registry=self.registry
        )
        self._boots = Histogram(
            "auraed_vm_boot_seconds",
            "Seconds from launching a VM's VMM until it was ready (a guest: its auraed serving)",
            buckets=BOOT_BUCKETS,
            registry=self.registry,
        )
        self._clones = Histogram(
            "auraed_vm_clone_seconds",
            "Seconds from launching a cloned guest's VMM (restoring it from its template) until it served",
            buckets=BOOT_BUCKETS,
            registry=self.registry,
        )
        self._states = _States()
        self.registry.register(self._states)
        self.registry.register(_Node())

    def add_states(
        self, name: str, documentation: str, states: Sequence[str], source: Callable[[], Iterable[str]]
    ) -> None:
        """A gauge ``name`` by state: ``source()`` gives each thing's state when scraped."""
        self._states.add(name, documentation, states, source)

    def rpc_finished(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        service, _, name = method.lstrip("/").rpartition("/")
        self._rpcs.labels(service, name, code.name).inc()
        self._rpc_seconds.labels(service, name).observe(seconds)

    # -- the sink --------------------------------------------------------------------------

    def image_pull_finished(self, result: str) -> None:
        self._pulls.labels(result).inc()

    def image_bytes_downloaded(self, count: int) -> None:
        self._pull_bytes.inc(count)

    def vm_booted(self, seconds: float) -> None:
        self._boots.observe(seconds)

    def vm_cloned(self, seconds: float) -> None:
        self._clones.observe(seconds)


def _code(context: Context, otherwise: grpc.StatusCode) -> grpc.StatusCode:
    """The status the call ended with: what a servicer or a wrapper set (an abort), else ``otherwise``."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    # Some grpc builds report the code as its integer value.
    return next((c for c in grpc.StatusCode if c.value[0] == code), otherwise)


class MeteredHandlers(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Serves what ``inner`` serves, each call counted in ``metrics`` with its code and duration.

    Outermost, around authorization, so refused calls count too. Each handler is wrapped once and
    reused, as AuthorizedHandlers does.
    """

    def __init__(self, metrics: DaemonMetrics, inner: Sequence[grpc.GenericRpcHandler]) -> None:
        self._metrics = metrics
        self._inner = tuple(inner)
        self._wrapped: dict[tuple[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = first_handler(self._inner, details)
        if handler is None:
            return None
        key = (details.method, handler)
        wrapped = self._wrapped.get(key)
        if wrapped is None:
            wrapped = self._wrapped[key] = self._wrap(handler, details.method)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner, factory = handler_parts(handler)
        finished = self._metrics.rpc_finished
        if inspect.isasyncgenfunction(inner):

            async def generator(request: Any, context: Context) -> Any:
                start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
                try:
                    async for item in inner(request, context):
                        yield item
                    code = _code(context, grpc.StatusCode.OK)
                except (asyncio.CancelledError, GeneratorExit):
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    finished(method, code, time.perf_counter() - start)

            behavior: Callable[..., Any] = generator
        else:

            async def coroutine(request: Any, context: Context) -> Any:
                start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
                try:
                    reply = await inner(request, context)
                    code = _code(context, grpc.StatusCode.OK)
                    return reply
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    finished(method, code, time.perf_counter() - start)

            behavior = coroutine
        return factory(behavior, handler.request_deserializer, handler.response_serializer)
