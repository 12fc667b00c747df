"""A scheduler of our own, serving orka's scheduler.agent services as orka's scheduler does.

Run as a process (``python -m tests.support.orka_scheduler --listen 127.0.0.1:PORT --events F``),
so tests can start, kill and restart it under a daemon. Like orka's (staging: scheduler/src/grpc/
agent_lifecycle_service.rs, managers/node_agent/manager.rs): a join's record is the node's
address, the IP the join came from and the port it sent; JoinCluster of a known id is
ALREADY_EXISTS and leaves the record as it was; LeaveCluster forgets the id and always answers;
a NodeStatus of an unknown id ends the stream with NOT_FOUND. It writes what it sees, one JSON
object a line, to the events file: ``listening``, ``join`` (id, port, peer, code, and ``held``:
the address it holds for the id after the join), ``leave``, ``status`` (id, total, free, load),
``stream_end``, each with its time (``t``, time.time()).

For the tests: ``--refuse-joins N`` answers the first N joins UNAVAILABLE, ``--known ID=HOST:PORT``
starts knowing a node at that address (as a scheduler that was not restarted does; a stale one
if the node is elsewhere now), ``--end-stream-after N`` ends each status stream after N statuses,
``--tls-cert``/``--tls-key`` serve TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from auraed.api.scheduler import agent as pb
from auraed.server.rpc import generic_handler
from auraed.wire.handlers import Context


def peer_ip(peer: str) -> str:
    """The IP of grpc's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"), as orka takes
    the join's remote address; an IPv6 one between brackets, ready for ":port"."""
    _, _, address = peer.partition(":")
    return address.rpartition(":")[0]


class Scheduler:
    def __init__(self, args: argparse.Namespace) -> None:
        self._events = Path(args.events).open("a", encoding="utf-8")  # noqa: SIM115 - the process's life
        # id -> "ip:port" where the scheduler would call the node (orka's NodeAgent.address)
        self._known: dict[str, str] = {
            node: address for node, _, address in (known.partition("=") for known in args.known)
        }
        self._refuse_joins = args.refuse_joins
        self._end_stream_after = args.end_stream_after

    def event(self, kind: str, **fields: Any) -> None:
        self._events.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")
        self._events.flush()

    # -- LifecycleService ----------------------------------------------------------------------

    async def join_cluster(self, request: pb.ConnectionRequest, context: Context) -> pb.Empty:
        peer = context.peer()
        seen = {"id": request.id, "port": request.port, "peer": peer}
        if self._refuse_joins > 0:
            self._refuse_joins -= 1
            self.event("join", **seen, code="UNAVAILABLE", held=self._known.get(request.id))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready to take agents yet")
        if request.id in self._known:
            # orka's add_agent: the first join's record stays, whatever this one came from.
            self.event("join", **seen, code="ALREADY_EXISTS", held=self._known[request.id])
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"Agent already exists: `{request.id}`")
        self._known[request.id] = f"{peer_ip(peer)}:{request.port}"
        self.event("join", **seen, code="OK", held=self._known[request.id])
        return pb.Empty()

    async def leave_cluster(self, request: pb.DisconnectionNotice, context: Context) -> pb.Empty:
        self._known.pop(request.id, None)
        self.event("leave", id=request.id)
        return pb.Empty()

    # -- StatusUpdateService -------------------------------------------------------------------

    async def update_node_status(self, requests: AsyncIterator[pb.NodeStatus], context: Context) -> pb.Empty:
        count = 0
        async for status in requests:
            if status.id not in self._known:
                self.event("stream_end", id=status.id, code="NOT_FOUND")
                await context.abort(grpc.StatusCode.NOT_FOUND, f"Agent not found: `{status.id}`")
            memory = status.memory or pb.NodeStatusMemory()
            cpu = status.cpu_load or pb.NodeStatusCpuLoad()
            self.event("status", id=status.id, total=memory.total, free=memory.free, load=cpu.load)
            count += 1
            if self._end_stream_after and count >= self._end_stream_after:
                self.event("stream_end", id=status.id, code="OK")
                return pb.Empty()
        self.event("stream_end", code="OK")
        return pb.Empty()


async def serve(args: argparse.Namespace) -> None:
    scheduler = Scheduler(args)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            generic_handler("scheduler.agent.LifecycleService", scheduler),
            generic_handler("scheduler.agent.StatusUpdateService", scheduler),
        ]
    )
    if args.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())]
        )
        server.add_secure_port(args.listen, credentials)
    else:
        server.add_insecure_port(args.listen)
    await server.start()
    scheduler.event("listening", address=args.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--known", action="append", default=[])
    parser.add_argument("--refuse-joins", type=int, default=0)
    parser.add_argument("--end-stream-after", type=int, default=0)
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
