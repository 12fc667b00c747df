"""What aer's commands take: the types of their arguments (checked by argparse, so that a bad value
is a usage error) and the building blocks of the parser, which every command shares."""

from __future__ import annotations

import argparse
import ipaddress
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import betterproto2

from auraed.api.aurae.containers import v0 as containers_pb

M = TypeVar("M", bound=betterproto2.Message)


def _in_range(value: int, bits: int, text: str) -> int:
    if not 0 <= value < 1 << bits:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (0..{(1 << bits) - 1})")
    return value


def unsigned(bits: int) -> Callable[[str], int]:
    """An argparse type for a non-negative integer that fits ``bits`` bits."""

    def parse_unsigned(text: str) -> int:
        try:
            return _in_range(int(text), bits, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None

    return parse_unsigned


def octal_mode(text: str) -> int:
    """An argparse type for permission bits in octal: 644, 0644, 0o644."""
    try:
        value = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None
    if value > 0o7777:
        raise argparse.ArgumentTypeError(f"not permission bits: {text!r} (at most 7777)")
    return value


SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
SIZE_PATTERN = re.compile(r"(\d+)\s*(?:([kmgtp])i?)?b?", re.IGNORECASE)


def size(text: str) -> int:
    """Bytes, or a number with a binary K, M, G, T or P suffix: 64M, 1G, 512Ki, 64MiB."""
    match = SIZE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a suffix as in 64M, 1G, 512Ki")
    return _in_range(int(match[1]) * SIZE_UNITS[(match[2] or "").lower()], 64, text)


def seconds(text: str) -> float:
    """A non-negative, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is out of range")
    return value


def grace_ms(text: str) -> int:
    """Seconds (may be fractional) as whole milliseconds, for a uint32 field."""
    milliseconds = round(seconds(text) * 1000)
    if milliseconds >= 1 << 32:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is out of range")
    return milliseconds


def ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def command_line(text: str) -> list[str]:
    """A command split as sh would: ``--entrypoint "sh -c 'echo hi'"``."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # an unclosed quote, a trailing backslash
        raise argparse.ArgumentTypeError(f"cannot split {text!r} as sh would: {exc}") from None


def env_var(text: str) -> str:
    key_value(text)
    return text


def bind_mount(text: str) -> containers_pb.Mount:
    """SRC:DST[:ro|rw], a bind mount; a relative SRC is made absolute here."""
    parts = text.split(":")
    mode = parts.pop() if len(parts) == 3 and parts[2] in ("ro", "rw") else "rw"
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected SRC:DST[:ro], not {text!r}")
    source = str(Path(parts[0]).expanduser().absolute())
    return containers_pb.Mount(source=source, destination=parts[1], read_only=mode == "ro")


SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def since(text: str) -> float:
    """Seconds ago ("90", "10m", "2h", "1d"), or a Unix time when a plain number past 1e9."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not seconds ago (90, 10m, 2h, 1d) or a Unix time: {text!r}")
    value = float(match[1])
    if not match[2] and value >= 1e9:
        return value
    return time.time() - value * SINCE_UNITS[match[2]]


def message_if_any(cls: Callable[..., M], **limits: Any) -> M | None:
    """``cls`` of the limits given (those not None), or None without any: no controller at all."""
    given = {key: value for key, value in limits.items() if value is not None}
    return cls(**given) if given else None


def add_global_options(parser: argparse.ArgumentParser, suppress: bool, deadline: bool = True) -> None:
    """The options every command takes, before or after the command's name.

    Subcommands repeat them with SUPPRESS defaults so that they only override the top level when given.
    Without ``deadline`` the command has its own --timeout (``container stop``); the deadline of
    its call is then only given before the command's name.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global options")
    group.add_argument(
        "--config",
        type=Path,
        default=default(None),
        metavar="PATH",
        help="client config (default: $AURAE_CONFIG, ~/.aurae/config, /etc/aurae/config)",
    )
    group.add_argument(
        "--address", default=default(None), metavar="ADDR", help="auraed address: unix:/path or host:port"
    )
    group.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    group.add_argument(
        "--vm",
        default=default(None),
        metavar="NAME",
        help="run container and image commands in this VM's guest (the host sends it the image: a "
        "create or run then has no default deadline; --timeout bounds it)",
    )
    if deadline:
        group.add_argument(
            "--timeout", type=seconds, default=default(None), metavar="SECONDS", help="deadline of each call"
        )


def add_command(
    subparsers: Any,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
    deadline: bool = True,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text, description=help_text)
    add_global_options(parser, suppress=True, deadline=deadline)
    parser.set_defaults(handler=handler)
    return parser


def add_group(subparsers: Any, name: str, help_text: str) -> Any:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")
