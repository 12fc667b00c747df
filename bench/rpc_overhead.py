"""RPC overhead: sequential DiscoveryService.Discover calls to a real auraed over its mTLS unix socket.

    .venv/bin/python bench/rpc_overhead.py [--calls 2000] [--warmup 100] [--json-only]

The peer is a bare grpc.aio server, in its own process like auraed, on a unix socket with the same
mTLS credentials, serving one generic unary method that returns the very bytes auraed answers
Discover with. It is the floor grpc + TLS + asyncio impose on any Python server; whatever auraed
needs beyond it is our overhead. Six series run interleaved on one channel per server (so a
change of load on the machine hits all of them alike):

* ``auraed``         - the way users call it: AuraeClient.call, auraed.wire.codec on both ends;
* ``auraed_raw``     - the same server, but the client sends and keeps raw bytes: the server's share;
* ``bare_rpc_layer`` - a bare server serving a fixed DiscoveryService reply through auraed's
                       rpc layer (auraed.server.rpc.generic_handler: request check, auraed.wire.codec
                       reply encoding) behind its authorization handler: auraed's path minus the daemon;
* ``bare_encode``    - the bare server behind the authorization, encoding the reply with auraed.wire.codec
                       on every call (as auraed does);
* ``bare_authz``     - the bare server behind auraed's AuthorizedHandlers;
* ``bare``           - the bare server, raw bytes both ends: the floor.

Target (issue): auraed p50 < 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import subprocess
import sys
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from common import (
    Daemon,
    client_config,
    exit_on_sigterm,
    machine_info,
    make_pki,
    print_json,
    print_lines,
    print_table,
    ratio,
    stop_process,
    summarize,
    temp_dir,
    verdict,
)

from auraed.api.aurae.discovery import v0 as pb
from auraed.client import AuraeClient
from auraed.client.client import channel_for
from auraed.config import AuthorizationPolicy
from auraed.pki import PkiPaths
from auraed.server import rpc
from auraed.server.authz import AuthorizedHandlers, is_allowed
from auraed.server.listeners import server_credentials
from auraed.wire import codec

DISCOVERY = "aurae.discovery.v0.DiscoveryService"
DISCOVER_PATH = f"/{DISCOVERY}/Discover"
BARE_SERVICE = "bench.Bare"
BARE_PATH = f"/{BARE_SERVICE}/Discover"
TARGET_P50_MS = 1.0
# Peer servers: series name -> serve_bare mode, from most of auraed's path to none of it.
PEERS = (("bare_rpc_layer", "rpc"), ("bare_encode", "encode"), ("bare_authz", "authz"), ("bare", "bare"))
ROUNDS = 10
MICRO_REPEAT = 2000

Call = Callable[[], Awaitable[Any]]


# ------------------------------------------------------------------------------ the bare peer


class FixedDiscovery:
    """A DiscoveryService servicer answering a fixed reply, served through auraed's own rpc layer."""

    def __init__(self, payload: bytes) -> None:
        self._response = codec.decode(pb.DiscoveryServiceDiscoverResponse, payload)

    async def discover(self, request: Any, context: Any) -> pb.DiscoveryServiceDiscoverResponse:
        return self._response


async def serve_bare(socket: Path, pki_dir: Path, payload: bytes, mode: str) -> None:
    """A peer server. ``bare``: one unary method answering the pre-serialized payload, bytes in and
    out. ``authz``: the same behind auraed's AuthorizedHandlers (default policy). ``encode``:
    behind the authorization, encoding the reply with auraed.wire.codec on every call. ``rpc``:
    DiscoveryService through auraed.server.rpc.generic_handler (request check, auraed.wire.codec
    encoding of the reply) behind the authorization: auraed's request path without the daemon.
    """

    response = codec.decode(pb.DiscoveryServiceDiscoverResponse, payload)

    async def discover(request: bytes, context: Any) -> bytes:
        return payload

    async def discover_encoding(request: bytes, context: Any) -> bytes:
        return codec.encode(response)

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    if mode == "rpc":
        generic = rpc.generic_handler(DISCOVERY, FixedDiscovery(payload))
    else:
        # No (de)serializers: bytes in and out.
        handler = grpc.unary_unary_rpc_method_handler(discover_encoding if mode == "encode" else discover)
        generic = grpc.method_handlers_generic_handler(BARE_SERVICE, {"Discover": handler})
    server.add_generic_rpc_handlers(
        [generic if mode == "bare" else AuthorizedHandlers(AuthorizationPolicy(), [generic])]
    )
    credentials = server_credentials(pki_dir / "ca.crt", pki_dir / "server.crt", pki_dir / "server.key")
    server.add_secure_port(f"unix:{socket}", credentials)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print("serving", flush=True)
    await stopping.wait()
    await server.stop(0)


def start_bare(socket: Path, pki: PkiPaths, payload: bytes, mode: str) -> subprocess.Popen[bytes]:
    payload_file = socket.with_name("payload.bin")
    payload_file.write_bytes(payload)
    args = [
        sys.executable, __file__, "--bare-server",
        "--socket", str(socket), "--pki-dir", str(pki.ca_crt.parent), "--payload", str(payload_file),
        "--mode", mode,
    ]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if line.strip() != b"serving":
        stop_process(process)
        raise RuntimeError(f"the bare server did not start (exit {process.poll()})")
    return process


# ------------------------------------------------------------------------------ measuring


async def timed(call: Call, count: int, into: list[float]) -> None:
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        await call()
        into.append(clock() - start)


async def measure(series: Mapping[str, Call], calls: int, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in series}
    for call in series.values():
        await timed(call, warmup, [])
    per_round = [calls // ROUNDS + (1 if r < calls % ROUNDS else 0) for r in range(ROUNDS)]
    for count in per_round:
        for name, call in series.items():
            await timed(call, count, samples[name])
    return samples


def micro(function: Callable[[], object], repeat: int = MICRO_REPEAT) -> float:
    """Mean microseconds per call of an in-process function (best of three runs)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            function()
        best = min(best, time.perf_counter() - start)
    return round(best / repeat * 1e6, 2)


async def codec_costs(payload: bytes, client: AuraeClient) -> dict[str, float]:
    """What auraed's own per-call steps cost, measured here in-process, in microseconds.

    Encoding the reply and checking the request run in the daemon, parsing the reply and
    building the call in AuraeClient; the authorization check runs before every call.
    """
    response = codec.decode(pb.DiscoveryServiceDiscoverResponse, payload)
    request_cls = pb.DiscoveryServiceDiscoverRequest
    policy = AuthorizationPolicy()

    async def behavior(request: bytes, context: Any) -> bytes:
        return request

    handlers = {"Discover": grpc.unary_unary_rpc_method_handler(behavior)}
    authorized = AuthorizedHandlers(policy, [grpc.method_handlers_generic_handler(DISCOVERY, handlers)])
    details = types.SimpleNamespace(method=DISCOVER_PATH, invocation_metadata=())

    def client_setup() -> object:
        client._response_class(DISCOVERY, "Discover")
        return client._callable("unary_unary", DISCOVERY, "Discover")

    def authz() -> object:
        authorized.service(details)  # the guarded handler's look-up
        return is_allowed(policy, ["aurae-client"], DISCOVER_PATH)

    return {
        "server_response_encode_us": micro(lambda: codec.encode(response)),
        "betterproto2_encode_us": micro(lambda: bytes(response)),
        "server_request_check_and_parse_us": micro(lambda: rpc._parse(request_cls, b"")),
        "server_authz_guard_us": micro(authz),
        "client_response_parse_us": micro(lambda: codec.decode(pb.DiscoveryServiceDiscoverResponse, payload)),
        "betterproto2_parse_us": micro(lambda: pb.DiscoveryServiceDiscoverResponse.parse(payload)),
        "client_request_encode_us": micro(lambda: codec.encode(request_cls())),
        "client_call_setup_us": micro(client_setup),
    }


async def run(args: argparse.Namespace, root: Path, pki: PkiPaths, daemon: Daemon) -> dict[str, Any]:
    servers: list[subprocess.Popen[bytes]] = []
    channels: list[grpc.aio.Channel] = []
    client = daemon.client()
    channels.append(client.channel)
    try:
        raw_discover = client.channel.unary_unary(DISCOVER_PATH)
        payload: bytes = await raw_discover(b"")
        bare_calls: dict[str, Call] = {}
        modes = (
            ("bare_rpc_layer", "rpc"),
            ("bare_encode", "encode"),
            ("bare_authz", "authz"),
            ("bare", "bare"),
        )
        for name, mode in modes:
            socket = root / f"{name}.sock"
            servers.append(await asyncio.to_thread(start_bare, socket, pki, payload, mode))
            channels.append(channel_for(client_config(pki, socket)))
            path = DISCOVER_PATH if mode == "rpc" else BARE_PATH
            bare_calls[name] = functools.partial(channels[-1].unary_unary(path), b"")
        request = pb.DiscoveryServiceDiscoverRequest()

        async def via_client() -> Any:
            return await client.call(DISCOVERY, "Discover", request)

        reply = await via_client()
        assert isinstance(reply, pb.DiscoveryServiceDiscoverResponse) and reply.healthy
        for call in bare_calls.values():
            assert await call() == payload
        series: dict[str, Call] = {
            "auraed": via_client,
            "auraed_raw": functools.partial(raw_discover, b""),
            **bare_calls,
        }
        samples = await measure(series, args.calls, args.warmup)
        costs = await codec_costs(payload, client)
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            stop_process(server)
    stats = {name: summarize(values) for name, values in samples.items()}
    return {"payload_bytes": len(payload), "stats": stats, "codec_us": costs}


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    stats = measured["stats"]
    auraed, raw, rpc_layer, encode, bare_authz, bare = (
        stats[k] for k in ("auraed", "auraed_raw", "bare_rpc_layer", "bare_encode", "bare_authz", "bare")
    )
    passed = auraed["p50_ms"] < TARGET_P50_MS
    result: dict[str, Any] = {
        "benchmark": "rpc_overhead",
        "machine": machine_info(),
        "calls": args.calls,
        "warmup": args.warmup,
        "payload_bytes": measured["payload_bytes"],
        **stats,
        "in_process_us": measured["codec_us"],
        "ratio_p50_auraed_over_bare": ratio(auraed["p50_ms"], bare["p50_ms"]),
        "ratio_p50_auraed_raw_over_bare": ratio(raw["p50_ms"], bare["p50_ms"]),
        "server_overhead_p50_ms": round(raw["p50_ms"] - bare["p50_ms"], 4),
        "split_p50_ms": {
            "authorization": round(bare_authz["p50_ms"] - bare["p50_ms"], 4),
            "reply_encoding": round(encode["p50_ms"] - bare_authz["p50_ms"], 4),
            "rpc_layer_rest": round(rpc_layer["p50_ms"] - encode["p50_ms"], 4),
            "rest_of_daemon": round(raw["p50_ms"] - rpc_layer["p50_ms"], 4),
            "client_decoding": round(auraed["p50_ms"] - raw["p50_ms"], 4),
        },
        "client_overhead_p50_ms": round(auraed["p50_ms"] - raw["p50_ms"], 4),
        "target": {"auraed_p50_ms_below": TARGET_P50_MS, "result": verdict(passed)},
    }
    if not args.json_only:
        rows = [
            [name, s["p50_ms"], s["p90_ms"], s["p99_ms"], s["mean_ms"], s["max_ms"]]
            for name, s in (
                ("auraed (AuraeClient)", auraed),
                ("auraed (raw bytes)", raw),
                ("bare + auraed's rpc layer + authz", rpc_layer),
                ("bare + authz + codec encode", encode),
                ("bare + auraed's authorization", bare_authz),
                ("bare", bare),
            )
        ]
        print_table(
            f"Discover, {args.calls} sequential calls each, mTLS over a unix socket "
            f"({measured['payload_bytes']} B reply)",
            ["series", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms"],
            rows,
        )
        costs = measured["codec_us"]
        print_lines(
            [
                f"ratio p50 auraed/bare: {result['ratio_p50_auraed_over_bare']}x "
                f"(server share {result['server_overhead_p50_ms']} ms, "
                f"client share {result['client_overhead_p50_ms']} ms)",
                "p50 split (ms): "
                + ", ".join(f"{name} {value}" for name, value in result["split_p50_ms"].items()),
                f"in-process per call: server encodes the reply {costs['server_response_encode_us']} us "
                f"(betterproto2: {costs['betterproto2_encode_us']}), client decodes it "
                f"{costs['client_response_parse_us']} us (betterproto2: {costs['betterproto2_parse_us']}); "
                f"request check+parse {costs['server_request_check_and_parse_us']} us, authz guard "
                f"{costs['server_authz_guard_us']} us, client call set-up {costs['client_call_setup_us']} us",
                f"target auraed p50 < {TARGET_P50_MS} ms: {verdict(passed)} ({auraed['p50_ms']} ms)",
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000, help="measured calls per series (default 2000)")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up calls per series (default 100)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pki-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--payload", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--mode", choices=("bare", "authz", "encode", "rpc"), default="bare", help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.bare_server:
        asyncio.run(serve_bare(args.socket, args.pki_dir, args.payload.read_bytes(), args.mode))
        return
    if args.calls < ROUNDS or args.warmup < 0:
        parser.error(f"--calls must be at least {ROUNDS} and --warmup not negative")

    exit_on_sigterm()
    with temp_dir("auraed-bench-rpc-") as root:
        pki = make_pki(root)
        daemon = Daemon(root / "daemon", pki)
        try:
            daemon.start()
            measured = asyncio.run(run(args, root, pki, daemon))
        except Exception:
            with contextlib.suppress(Exception):
                sys.stderr.write(daemon.log()[-4000:])
            raise
        finally:
            daemon.cleanup()
    print_json(report(args, measured))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
