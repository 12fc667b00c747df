"""Logs replies read by clients: batched ones, and those of an auraed that sent a line a message
(a guest still running an older image, whose replies the host relays untouched)."""

from __future__ import annotations

from auraed.api.aurae.containers import v0 as pb
from auraed.client import log_lines
from auraed.wire import codec


def test_a_batched_reply_gives_its_lines_in_order() -> None:
    lines = [pb.LogLine(line="a", stream="stdout", timestamp=1.0), pb.LogLine(line="", stream="stderr")]
    assert log_lines(pb.ContainerServiceLogsResponse(lines=lines)) == lines


def test_a_reply_of_one_line_from_an_older_auraed_is_read_too() -> None:
    # As an older auraed encoded it: fields 1 to 3, an empty line included (it names its stream).
    for text in ("hello", ""):
        old = codec.encode(pb.ContainerServiceLogsResponse(line=text, stream="stderr", timestamp=2.5))
        reply = codec.decode(pb.ContainerServiceLogsResponse, old)
        assert log_lines(reply) == [pb.LogLine(line=text, stream="stderr", timestamp=2.5)]
    assert log_lines(pb.ContainerServiceLogsResponse()) == []
