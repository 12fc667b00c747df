"""Log following: a follower woken by inotify (LogWatch) sees a line at once, ends promptly, and
leaves no watch behind; without a watch it polls."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from auraed.observe import logfile
from auraed.observe.logfile import LogWatch, stream_lines
from auraed.system.monitor import format_cri_timestamp

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
        assert time.monotonic() - written < 0.2
        await asyncio.sleep(1.3)
        ended = True
        (tmp_path / "exit.json").write_text("{}")  # what a monitor writes when its process ended
        stopped = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(lines), 2)
        assert time.monotonic() - stopped < 0.2
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
