"""Log following: a follower woken by inotify (LogWatch) sees a line at once, ends promptly, and
leaves no watch behind; without a watch it polls."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auraed.observe import logfile
from auraed.observe.logfile import LogWatch, stream_lines
from auraed.system.cri_log import format_cri_timestamp

STREAMS = frozenset({"stdout", "stderr"})


def append(log: Path, content: str) -> None:
    with log.open("a") as file:
        file.write(f"{format_cri_timestamp(time.time_ns())} stdout F {content}\n")


@pytest.fixture
def slow_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Polls so rare that only inotify can deliver within the tests' deadlines."""
    monkeypatch.setattr(logfile, "POLL_LONGEST", 5.0)
    monkeypatch.setattr(logfile, "POLL_LONGEST_WATCHED", 5.0)


async def test_a_watched_follower_sees_a_line_at_once_and_ends_promptly(
    tmp_path: Path, slow_polls: None
) -> None:
    watch = LogWatch()
    log = tmp_path / "container.log"  # not there yet: a created container has no log
    ended = False
    lines = stream_lines(log, STREAMS, None, True, lambda: ended, watch=watch)
    try:
        first = asyncio.ensure_future(anext(lines))
        await asyncio.sleep(1.3)  # quiet: its next look is >1 s away (looks at 0.63, 1.27, 2.55 s)
        assert not first.done()
        written = time.monotonic()
        append(log, "ready")
        assert (await asyncio.wait_for(first, 2)).content == "ready"
        assert time.monotonic() - written < 0.5  # a poll would have taken 1.25 s more
        await asyncio.sleep(1.3)
        ended = True
        (tmp_path / "exit.json").write_text("{}")  # what a monitor writes when its process ended
        stopped = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(lines), 2)
        assert time.monotonic() - stopped < 0.5
    finally:
        await lines.aclose()
    assert watch.watched() == []
    await watch.close()


async def test_followers_of_one_directory_share_a_watch(tmp_path: Path, slow_polls: None) -> None:
    watch = LogWatch()
    log = tmp_path / "output.log"
    followers = [stream_lines(log, STREAMS, None, True, lambda: False, watch=watch) for _ in range(3)]
    pending = [asyncio.ensure_future(anext(f)) for f in followers]
    await asyncio.sleep(0.3)
    assert watch.watched() == [tmp_path]
    append(log, "to all")
    done = await asyncio.wait_for(asyncio.gather(*pending), 1)
    assert [line.content for line in done] == ["to all"] * 3
    for follower in followers:
        await follower.aclose()
    assert watch.watched() == []
    await watch.close()


async def test_without_a_watch_a_follower_polls(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    lines = stream_lines(log, STREAMS, None, True, lambda: False)
    try:
        first = asyncio.ensure_future(anext(lines))
        await asyncio.sleep(0.2)
        append(log, "polled")
        assert (await asyncio.wait_for(first, 1)).content == "polled"
    finally:
        await lines.aclose()


async def test_a_directory_that_cannot_be_watched_falls_back_to_polling(tmp_path: Path) -> None:
    watch = LogWatch()
    with watch.watching(tmp_path / "absent") as changed:
        assert changed is None
    assert watch.watched() == []
    await watch.close()


# --- reading a log: all of it in chunks, or its tail from the end ---------------------------------

Record = tuple[str, bool, str]  # stream, partial, content

records_strategy = st.lists(
    st.tuples(
        st.sampled_from(["stdout", "stderr"]),
        st.booleans(),
        st.text(alphabet="abc xyz", max_size=12),
    ),
    max_size=60,
)


def write_log(log: Path, records: list[Record], unfinished_tail: str = "") -> list[float]:
    """Records with times one second apart; ``unfinished_tail``: a record still being written."""
    times = [1_700_000_000.0 + i for i in range(len(records))]
    with log.open("w") as file:
        for when, (stream, partial, content) in zip(times, records, strict=True):
            file.write(
                f"{format_cri_timestamp(int(when * 1e9))} {stream} {'P' if partial else 'F'} {content}\n"
            )
        file.write(unfinished_tail)
    return times


def forward(
    records: list[Record], times: list[float], streams: frozenset[str]
) -> tuple[list[logfile.LogLine], dict[str, list[str]]]:
    """What a reader from the start gets: the whole lines, and the parts of lines not finished."""
    pending: dict[str, list[str]] = {}
    lines = []
    for when, (stream, partial, content) in zip(times, records, strict=True):
        pending.setdefault(stream, []).append(content)
        if not partial:
            parts = pending.pop(stream)
            if stream in streams:
                lines.append(logfile.LogLine(when, stream, "".join(parts)))
    return lines, {s: p for s, p in pending.items() if s in streams and p}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    records=records_strategy,
    tail=st.integers(min_value=0, max_value=70),
    streams=st.sampled_from([STREAMS, frozenset({"stdout"}), frozenset({"stderr"})]),
    since_index=st.none() | st.integers(min_value=0, max_value=60),
    block=st.sampled_from([7, 64, 1 << 16]),
)
def test_the_tail_read_from_the_end_is_the_tail_read_from_the_start(
    tmp_path: Path,
    *,
    records: list[Record],
    tail: int,
    streams: frozenset[str],
    since_index: int | None,
    block: int,
) -> None:
    log = tmp_path / "container.log"
    times = write_log(log, records, unfinished_tail="2023-11-14T22:13:20.000000000Z stdout F half")
    since = None if since_index is None else 1_700_000_000.0 + since_index
    expected, pending = forward(records, times, streams)
    if since is not None:
        expected = [line for line in expected if line.timestamp >= since]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logfile, "TAIL_BLOCK", block)  # records across block boundaries too
        lines, end, assembler = logfile.read_tail(log, streams, tail, since)
    assert lines == (expected[-tail:] if tail else [])
    assert end == log.stat().st_size - len("2023-11-14T22:13:20.000000000Z stdout F half")
    if since is None:  # the parts of unfinished lines, for a follower: on every stream, whole
        assert {s: list(p) for s, p in assembler.pending.items() if p} == pending


async def test_reading_all_of_a_log_and_following_on(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    records: list[Record] = [("stdout", False, "one"), ("stderr", True, "tw"), ("stdout", False, "three")]
    write_log(log, records)
    ended = False
    lines = stream_lines(log, STREAMS, None, True, lambda: ended)
    assert [(await anext(lines)).content for _ in range(2)] == ["one", "three"]
    with log.open("a") as file:  # the partial stderr record's line ends now
        file.write(f"{format_cri_timestamp(time.time_ns())} stderr F o\n")
    assert (await anext(lines)).content == "two"
    ended = True
    assert [line async for line in lines] == []
    # Not following: what is there now, then the end.
    assert [line.content async for line in stream_lines(log, STREAMS, None, False, lambda: False)] == [
        "one",
        "three",
        "two",
    ]


async def test_a_follower_at_the_end_reads_on_the_loop_and_catches_up_through_a_thread(
    tmp_path: Path, slow_polls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines written while a follower waits at the end are read without a worker thread; a burst
    longer than such a read is still delivered whole and in order, the rest through the thread."""
    threaded: list[object] = []
    real_to_thread = asyncio.to_thread

    async def counted(function: Any, *args: Any) -> Any:
        threaded.append(function)
        return await real_to_thread(function, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted)  # the module logfile calls it through
    monkeypatch.setattr(logfile, "FRESH_CHUNK", 200)  # a burst of ~60-byte records overflows it
    watch = LogWatch()
    log = tmp_path / "container.log"
    append(log, "before")
    ended = False
    lines = stream_lines(log, STREAMS, None, True, lambda: ended, watch=watch)
    try:
        assert (await anext(lines)).content == "before"
        assert len(threaded) == 1  # the first read, from the start of the log
        for count in range(3):
            append(log, f"fresh {count}")
            assert (await asyncio.wait_for(anext(lines), 2)).content == f"fresh {count}"
        assert len(threaded) == 1
        burst = [f"burst {index}" for index in range(40)]
        with log.open("a") as file:
            file.writelines(f"{format_cri_timestamp(time.time_ns())} stdout F {text}\n" for text in burst)
        assert [(await asyncio.wait_for(anext(lines), 2)).content for _ in burst] == burst
        assert len(threaded) > 1  # fell behind: caught up through the thread
        ended = True
        (tmp_path / "exit.json").write_text("{}")
        assert [line async for line in lines] == []
    finally:
        await lines.aclose()
        await watch.close()


def test_a_tail_keeps_the_start_of_another_stream_s_unfinished_line(tmp_path: Path) -> None:
    """stderr began a line before stdout's last two: a tail of one stdout line must still find
    stderr's start, or a follower gives only the rest of that line once it ends."""
    log = tmp_path / "container.log"
    write_log(log, [("stderr", True, "abc"), ("stdout", False, "older"), ("stdout", False, "x")])
    lines, _, assembler = logfile.read_tail(log, STREAMS, 1)
    assert [line.content for line in lines] == ["x"]
    assert {s: list(p) for s, p in assembler.pending.items() if p} == {"stderr": ["abc"]}


def test_batches_keep_the_order_and_stay_under_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["a" * 30, "é" * 15, "b" * 200, "c"]  # é is two bytes in UTF-8
    lines = [logfile.LogLine(float(n), "stdout", text) for n, text in enumerate(texts)]
    overhead = logfile.LINE_OVERHEAD

    def sizes(budget: int) -> list[int]:
        monkeypatch.setattr(logfile, "BATCH_BYTES", budget)
        batches = list(logfile.batches(lines))
        assert [line for batch in batches for line in batch] == lines
        return [len(batch) for batch in batches]

    # The first two together (30 + 30 bytes, and their overhead); the long line alone.
    assert sizes(60 + 2 * overhead) == [2, 1, 1]
    # Counted in bytes: by characters (30 + 15) they would fit.
    assert sizes(45 + 2 * overhead) == [1, 1, 1, 1]
    assert list(logfile.batches([])) == []


async def test_a_log_read_whole_comes_in_few_batches(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    write_log(log, [("stdout" if n % 3 else "stderr", False, f"line {n}") for n in range(20_000)])
    batches = [batch async for batch in logfile.stream_line_batches(log, STREAMS, None, False, lambda: True)]
    assert [line.content for batch in batches for line in batch] == [f"line {n}" for n in range(20_000)]
    assert len(batches) <= 2  # 20 000 short lines: ~1 MiB of log, read a MiB at a time


async def test_a_follower_goes_on_in_the_new_file_after_a_rotation(tmp_path: Path) -> None:
    """The kubelet renames the log away and asks for a new one (ReopenContainerLog): a follower
    reads what the old file still had, then the new file from its start."""
    watch = LogWatch()
    log = tmp_path / "container.log"
    append(log, "before")
    ended = False
    lines = stream_lines(log, STREAMS, None, True, lambda: ended, watch=watch)
    try:
        assert (await asyncio.wait_for(anext(lines), 5)).content == "before"
        append(log, "late in the old file")
        log.rename(tmp_path / "container.log.1")
        append(tmp_path / "container.log.1", "the writer had not reopened yet")
        append(log, "in the new file")
        seen = [(await asyncio.wait_for(anext(lines), 5)).content for _ in range(3)]
        assert seen == ["late in the old file", "the writer had not reopened yet", "in the new file"]
        ended = True
        assert [line async for line in lines] == []
    finally:
        await lines.aclose()
        await watch.close()


async def test_a_follower_by_parts_gets_each_record_from_where_it_started(tmp_path: Path) -> None:
    """What an attach reads: from the log's end when it began (the start of a line unfinished
    there is not replayed), each record as it comes, a line's parts marked partial; other
    streams passed by."""
    log = tmp_path / "container.log"
    earlier = tmp_path / "earlier.log"
    later = [("stdout", True, "ls"), ("stderr", False, "err"), ("stdout", False, ""), ("stdout", True, "$ ")]
    write_log(earlier, [("stdout", False, "before"), ("stdout", True, "$ ")])
    write_log(log, [("stdout", False, "before"), ("stdout", True, "$ "), *later])
    start = logfile.end_position(earlier, frozenset({"stdout"}))
    batches = logfile.stream_line_batches(
        log, frozenset({"stdout"}), 0, False, lambda: True, start=start, parts=True
    )
    parts = [(line.partial, line.content) async for batch in batches for line in batch]
    assert parts == [(True, "ls"), (False, ""), (True, "$ ")]


async def test_a_follower_cancelled_as_its_log_changes_ends() -> None:
    """An attach's client detaching cancels its follower, maybe just as the container writes
    (the watch's event set in the same turn of the loop): the follower must end, not go on."""
    changed = asyncio.Event()
    waiting = asyncio.ensure_future(logfile._wait(changed, 5.0))
    await asyncio.sleep(0)  # it waits for the event
    changed.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
