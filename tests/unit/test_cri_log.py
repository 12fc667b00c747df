"""The CRI log writer the monitors use (auraed.system.cri_log), fed as a pipe's reads would
feed it: what it logs at once, what it holds back until the next read, how a line ends."""

from __future__ import annotations

from pathlib import Path

from auraed.system.cri_log import LOG_LINE_MAX, CriLogWriter, LogStream, parse_cri_log_line


def logged(tmp_path: Path, reads: list[bytes], *, crlf: bool = False) -> list[tuple[bool, str]]:
    """(partial, content) of each record written for ``reads``, then the stream's EOF."""
    writer = CriLogWriter(str(tmp_path / "out.log"))
    writer.open()
    stream = LogStream(-1, b"stdout", crlf=crlf)
    try:
        for data in reads:
            writer.feed(stream, data)
        writer.finish(stream)
    finally:
        writer.close()
    text = (tmp_path / "out.log").read_bytes().decode()  # every record is whole UTF-8
    return [(partial, content) for _, _, partial, content in map(parse_cri_log_line, text.splitlines())]


def test_a_read_that_ends_mid_line_is_logged_at_once(tmp_path: Path) -> None:
    assert logged(tmp_path, [b"$ ", b"ls\nbin\n$ "]) == [
        (True, "$ "),
        (False, "ls"),
        (False, "bin"),
        (True, "$ "),
        (False, ""),
    ]


def test_a_character_cut_by_a_read_waits_for_its_other_bytes(tmp_path: Path) -> None:
    word = "naïve €".encode()
    cut = word.index("€".encode()) + 1  # inside the euro sign's three bytes
    assert logged(tmp_path, [word[:3], word[3:cut], word[cut:] + b"\n"]) == [
        (True, "na"),  # "ï" is two bytes: the read ended after its first
        (True, "ïve "),
        (False, "€"),
    ]


def test_a_terminals_line_end_cut_by_a_read_is_still_one(tmp_path: Path) -> None:
    assert logged(tmp_path, [b"abc\r", b"\ndef\r\n"], crlf=True) == [
        (True, "abc"),
        (False, ""),
        (False, "def"),
    ]


def test_a_long_line_is_cut_between_characters(tmp_path: Path) -> None:
    line = b"a" * (LOG_LINE_MAX - 1) + "é".encode() + b"b\n"  # the 2-byte é straddles the limit
    assert logged(tmp_path, [line]) == [(True, "a" * (LOG_LINE_MAX - 1)), (False, "éb")]
