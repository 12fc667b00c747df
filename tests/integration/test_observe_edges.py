"""ObserveService at its edges, against a real auraed: what a workload or a request may push it to."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from auraed.api.aurae.observe import v0 as observe
from auraed.client import AuraeClient, ClientError
from auraed.observe.events import DaemonLogHandler, ObserveHub
from auraed.observe.logfile import CUT_MARK, MAX_LINE_CHARS, LogWatch
from auraed.observe.servicer import ObserveServicer
from tests.conftest import DaemonProcess
from tests.integration.test_cells import allocate, start, wait_exited

OBSERVE = "aurae.observe.v0.ObserveService"
# A line well past grpc's 4 MiB message limit, written without a newline until its end.
LONG_LINE_BYTES = 6 << 20


async def lines_of(
    client: AuraeClient, cell: str, name: str, tail: int | None = None, follow: bool = False
) -> list[str]:
    request = observe.ObserveServiceGetSubProcessStreamRequest(
        cell_name=cell, executable_name=name, tail=tail, follow=follow
    )
    return [i.item.line async for i in client.stream(OBSERVE, "GetSubProcessStream", request, timeout=60)]


async def test_a_line_longer_than_a_message_is_cut_and_the_lines_after_it_still_come(
    client: AuraeClient,
) -> None:
    """It used to be joined whole in the daemon's memory and sent as one message, which the
    client refused (RESOURCE_EXHAUSTED), ending the stream before the lines after it."""
    await allocate(client, "long")
    command = f"head -c {LONG_LINE_BYTES} /dev/zero | tr '\\0' a; echo; echo after"
    await start(client, "long", "writer", command)
    await wait_exited(client, "long", "writer", timeout=60)
    cut = "a" * MAX_LINE_CHARS + CUT_MARK
    assert await lines_of(client, "long", "writer") == [cut, "after"]
    assert await lines_of(client, "long", "writer", tail=2) == [cut, "after"]
    assert await lines_of(client, "long", "writer", tail=1) == ["after"]
    assert await lines_of(client, "long", "writer", tail=5, follow=True) == [cut, "after"]


async def test_a_signals_workload_without_its_cell_says_what_is_expected(client: AuraeClient) -> None:
    """ "sleeper" alone used to be refused as "workload: must not be empty"."""
    for workload in ("sleeper", "web/", "/sleeper"):
        request = observe.ObserveServiceGetPosixSignalsStreamRequest(workload=workload)
        with pytest.raises(ClientError) as raised:
            await anext(client.stream(OBSERVE, "GetPosixSignalsStream", request, timeout=10))
        assert raised.value.code == "INVALID_ARGUMENT"
        assert (
            raised.value.message == f"workload: expected CELL/EXECUTABLE, e.g. web/server, not {workload!r}"
        )


# Lines the daemon log keeps in the test below: more than it logs, so that none drop out of it.
DAEMON_LOG_LINES = 1_000_000
FOLLOW_TRIALS = 200
LINES_PER_TRIAL = 50


@contextlib.contextmanager
def logging_from_a_thread(hub: ObserveHub) -> Iterator[None]:
    """auraed's log handler on a logger that a worker thread logs numbered lines to, without end."""
    logger = logging.getLogger("tests.observe_edges.worker")
    handler = DaemonLogHandler(hub.daemon_log)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    stop = threading.Event()

    def work() -> None:
        for number in itertools.count():
            if stop.is_set():
                return
            logger.info("line %d", number)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
        logger.removeHandler(handler)


async def test_a_tail_then_follow_of_the_daemon_log_gives_each_line_once() -> None:
    """A line a worker thread logged as the stream began came from the tail and again live.

    The servicer is the daemon's own, called as grpc calls it; the race needs a thread logging
    at that very moment, which a test cannot make a whole daemon do on demand."""
    hub = ObserveHub.create(DAEMON_LOG_LINES)
    hub.daemon_log.bind(asyncio.get_running_loop())
    servicer = ObserveServicer(hub, lambda workload: None, LogWatch())
    request = observe.ObserveServiceGetAuraeDaemonLogStreamRequest(follow=True, tail=5)
    with logging_from_a_thread(hub):
        for _ in range(FOLLOW_TRIALS):
            # The servicer's method is an async generator; it is typed as the iterator grpc takes.
            stream = cast(AsyncGenerator[Any, None], servicer.get_aurae_daemon_log_stream(request, None))
            lines = [(await anext(stream)).item.line for _ in range(LINES_PER_TRIAL)]
            await stream.aclose()
            numbers = [int(line.rsplit(" ", 1)[1]) for line in lines]
            assert numbers == sorted(set(numbers)), numbers


# A log whose tail is large: BIG_TAIL_LINES lines of BIG_TAIL_WIDTH characters (~100 MB).
BIG_TAIL_LINES = 10_000
BIG_TAIL_WIDTH = 10_000
# What the daemon's peak memory may grow by while it sends that tail: a few read chunks; it used
# to hold the whole tail, twice over.
TAIL_MEMORY_BUDGET = 48 << 20


@contextlib.contextmanager
def peak_memory_since_reset(pid: int) -> Iterator[Callable[[], int]]:
    """Resets ``pid``'s peak resident size (clear_refs 5), then gives how far it rose since."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = resident(pid, "VmRSS")
    yield lambda: resident(pid, "VmHWM") - before


def resident(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


async def test_a_large_tail_is_sent_without_holding_it(daemon: DaemonProcess, client: AuraeClient) -> None:
    await allocate(client, "big")
    await start(client, "big", "writer", f"yes $(printf '%0{BIG_TAIL_WIDTH}d' 0) | head -n {BIG_TAIL_LINES}")
    await wait_exited(client, "big", "writer", timeout=60)
    assert daemon.process is not None
    with peak_memory_since_reset(daemon.process.pid) as grown:
        lines = await lines_of(client, "big", "writer", tail=BIG_TAIL_LINES)
        assert len(lines) == BIG_TAIL_LINES and lines[-1] == "0" * BIG_TAIL_WIDTH
        assert grown() < TAIL_MEMORY_BUDGET, f"the daemon grew by {grown() >> 20} MiB"
