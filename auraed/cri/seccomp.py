"""Seccomp profiles a kubelet names by path (SecurityProfile Localhost), as an OCI seccomp section.

The files are in the format Docker (moby) reads, which is what the kubelet's seccomp directory
holds: the OCI runtime spec's ``linux.seccomp`` plus what moby adds to it, which is translated
here as moby translates it:

* ``name`` for a rule of one syscall (the older spelling of ``names``);
* ``archMap``: architectures with their sub-architectures, of which the native ones are kept;
  a profile that names no architecture gets the native ones (those of auraed's own profile);
* ``includes`` / ``excludes`` on a rule: it applies only when the container holds (or lacks) the
  capabilities listed, runs on (or off) the architectures listed, on a kernel at least (below)
  ``minKernel``;
* ``comment``: ignored.

Every value is checked (actions, operators, architectures, flags, numbers), so that a bad profile
is refused at CreateContainer naming what is wrong, not by the runtime at start.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from auraed.containers.oci_spec import seccomp_architectures
from auraed.containers.request import MAX_UINT64
from auraed.cri.errors import CriError
from auraed.system.request_files import FileTooLarge, NotRegularFile, read_regular

MAX_ERRNO = 4095  # errno values the kernel can return (MAX_ERRNO in include/linux/err.h)
MAX_SYSCALL_ARGS = 6

ACTIONS = frozenset(
    {
        "SCMP_ACT_KILL",
        "SCMP_ACT_KILL_PROCESS",
        "SCMP_ACT_KILL_THREAD",
        "SCMP_ACT_TRAP",
        "SCMP_ACT_ERRNO",
        "SCMP_ACT_TRACE",
        "SCMP_ACT_ALLOW",
        "SCMP_ACT_LOG",
        "SCMP_ACT_NOTIFY",
    }
)
OPERATORS = frozenset(
    {
        "SCMP_CMP_NE",
        "SCMP_CMP_LT",
        "SCMP_CMP_LE",
        "SCMP_CMP_EQ",
        "SCMP_CMP_GE",
        "SCMP_CMP_GT",
        "SCMP_CMP_MASKED_EQ",
    }
)
FLAGS = frozenset(
    {
        "SECCOMP_FILTER_FLAG_TSYNC",
        "SECCOMP_FILTER_FLAG_LOG",
        "SECCOMP_FILTER_FLAG_SPEC_ALLOW",
        "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV",
    }
)
_ARCH = re.compile(r"SCMP_ARCH_[A-Z0-9_]+")
_SYSCALL = re.compile(r"[a-z_][a-z0-9_]*")
_KERNEL = re.compile(r"([0-9]+)\.([0-9]+)")
# uname's machine -> Go's GOARCH, the names moby's "arches" filters use.
_GO_ARCH = {"x86_64": "amd64", "i686": "386", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}


@dataclass(frozen=True)
class Target:
    """What a profile's conditional rules are checked against: the container and its host."""

    capabilities: frozenset[str]  # the container's bounding set, "CAP_" names
    machine: str  # os.uname().machine
    kernel: tuple[int, int]  # (major, minor) of the running kernel

    @classmethod
    def here(cls, capabilities: frozenset[str]) -> Target:
        uname = os.uname()
        found = _KERNEL.match(uname.release)
        return cls(capabilities, uname.machine, (int(found[1]), int(found[2])) if found else (0, 0))


def load_profile(path: str, where: str, target: Target, max_bytes: int) -> dict[str, Any]:
    """The OCI seccomp section of the moby-format profile at ``path`` (absolute), a regular file
    of at most ``max_bytes`` (auraed.system.request_files: a FIFO or a device is refused without
    waiting on it); errors name ``where`` (the request's field) and the file."""
    if not path.startswith("/"):
        raise CriError.invalid(where, f"{path[:200]!r} is not an absolute path")
    try:
        data = read_regular(path, max_bytes)
    except FileNotFoundError:
        raise CriError.not_found(f"{where}: seccomp profile {path}") from None
    except (NotRegularFile, FileTooLarge) as exc:
        raise CriError.invalid(where, f"seccomp profile {exc.strerror}") from None
    except OSError as exc:
        raise CriError.invalid(where, f"cannot read {path}: {exc.strerror}") from None
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CriError.invalid(where, f"{path} is not JSON: {exc}") from None
    return oci_section(document, f"{where}: {path}", target)


def oci_section(profile: object, where: str, target: Target) -> dict[str, Any]:
    """A moby-format profile (the parsed JSON) as the OCI spec's linux.seccomp."""
    doc = _object(profile, where, "the profile")
    default_action = _action(doc.get("defaultAction"), f"{where}: defaultAction")
    section: dict[str, Any] = {
        "defaultAction": default_action,
        "architectures": _architectures(doc, where, target.machine),
    }
    if doc.get("defaultErrnoRet") is not None:
        section["defaultErrnoRet"] = _errno(doc["defaultErrnoRet"], f"{where}: defaultErrnoRet")
    flags = _strings(doc.get("flags"), f"{where}: flags")
    for flag in flags:
        if flag not in FLAGS:
            raise CriError.invalid(f"{where}: flags", f"{flag[:80]!r} is not a seccomp filter flag")
    if flags:
        section["flags"] = flags
    for key in ("listenerPath", "listenerMetadata"):
        if doc.get(key):
            section[key] = _string(doc[key], f"{where}: {key}")
    rules = doc.get("syscalls")
    if rules is None:
        rules = []
    if not isinstance(rules, list):
        raise CriError.invalid(f"{where}: syscalls", "must be a list")
    section["syscalls"] = [
        rule
        for index, raw in enumerate(rules)
        if (rule := _rule(raw, f"{where}: syscalls[{index}]", target)) is not None
    ]
    return section


# ------------------------------------------------------------------------------------- parts


def _architectures(doc: Mapping[str, Any], where: str, machine: str) -> list[str]:
    listed = _strings(doc.get("architectures"), f"{where}: architectures")
    arch_map = doc.get("archMap")
    if listed and arch_map:
        raise CriError.invalid(where, "architectures and archMap are both given; use one of them")
    native = seccomp_architectures(machine)
    if arch_map:
        if not isinstance(arch_map, list):
            raise CriError.invalid(f"{where}: archMap", "must be a list")
        listed = []
        for index, entry in enumerate(arch_map):
            field = f"{where}: archMap[{index}]"
            arch = _string(_object(entry, field, "an entry").get("architecture"), f"{field}.architecture")
            subs = _strings(entry.get("subArchitectures"), f"{field}.subArchitectures")
            if native and arch == native[0]:
                listed.extend([arch, *subs])
    for index, arch in enumerate(listed):
        if not _ARCH.fullmatch(arch):
            raise CriError.invalid(
                f"{where}: architectures[{index}]", f"{arch[:80]!r} is not a SCMP_ARCH_ name"
            )
    return list(dict.fromkeys(listed)) or native


def _rule(raw: object, where: str, target: Target) -> dict[str, Any] | None:
    """One syscall rule in OCI form; None when its conditions leave it out for ``target``."""
    rule = _object(raw, where, "a rule")
    names = _strings(rule.get("names"), f"{where}.names")
    name = rule.get("name")
    if name is not None:
        if names:
            raise CriError.invalid(where, "name and names are both given; use one of them")
        names = [_string(name, f"{where}.name")]
    if not names:
        raise CriError.invalid(f"{where}.names", "must name at least one syscall")
    for index, syscall in enumerate(names):
        if not _SYSCALL.fullmatch(syscall):
            raise CriError.invalid(f"{where}.names[{index}]", f"{syscall[:80]!r} is not a syscall name")
    out: dict[str, Any] = {"names": names, "action": _action(rule.get("action"), f"{where}.action")}
    if rule.get("errnoRet") is not None:
        out["errnoRet"] = _errno(rule["errnoRet"], f"{where}.errnoRet")
    arguments = rule.get("args")
    if arguments:
        if not isinstance(arguments, list):
            raise CriError.invalid(f"{where}.args", "must be a list")
        out["args"] = [_argument(arg, f"{where}.args[{i}]") for i, arg in enumerate(arguments)]
    applies = _matches(rule.get("includes"), f"{where}.includes", target, every=True)
    excluded = _matches(rule.get("excludes"), f"{where}.excludes", target, every=False)
    return out if applies and not excluded else None


def _matches(raw: object, where: str, target: Target, *, every: bool) -> bool:
    """Whether ``target`` meets a moby filter. ``every``: an ``includes``, met when all its
    conditions hold (no conditions: met); else an ``excludes``, met when any holds (none: not)."""
    if raw is None:
        return every
    condition = _object(raw, where, "a filter")
    results: list[bool] = []
    caps = _strings(condition.get("caps"), f"{where}.caps")
    if caps:
        held = {("" if c.upper().startswith("CAP_") else "CAP_") + c.upper() for c in caps}
        results.append(held <= target.capabilities if every else bool(held & target.capabilities))
    arches = _strings(condition.get("arches"), f"{where}.arches")
    if arches:
        results.append(_GO_ARCH.get(target.machine, target.machine) in arches)
    min_kernel = condition.get("minKernel")
    if min_kernel is not None:
        found = _KERNEL.fullmatch(_string(min_kernel, f"{where}.minKernel"))
        if found is None:
            raise CriError.invalid(f"{where}.minKernel", f"{min_kernel[:40]!r} is not MAJOR.MINOR")
        results.append(target.kernel >= (int(found[1]), int(found[2])))
    return all(results) if every else any(results)


def _argument(raw: object, where: str) -> dict[str, Any]:
    arg = _object(raw, where, "an argument")
    index = arg.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_SYSCALL_ARGS:
        raise CriError.invalid(f"{where}.index", f"must be an integer 0..{MAX_SYSCALL_ARGS - 1}")
    op = arg.get("op")
    if not isinstance(op, str) or op not in OPERATORS:
        raise CriError.invalid(f"{where}.op", f"{str(op)[:80]!r} is not a seccomp comparison")
    out: dict[str, Any] = {"index": index, "op": op}
    for key in ("value", "valueTwo"):
        value = arg.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_UINT64:
            raise CriError.invalid(f"{where}.{key}", "must be an unsigned 64-bit integer")
        out[key] = value
    return out


def _action(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in ACTIONS:
        raise CriError.invalid(where, f"{str(value)[:80]!r} is not a seccomp action")
    return value


def _errno(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ERRNO:
        raise CriError.invalid(where, f"must be an errno number 0..{MAX_ERRNO}")
    return value


def _object(value: object, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise CriError.invalid(where, f"{what} must be a JSON object")
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise CriError.invalid(where, "must be a non-empty string")
    return value


def _strings(value: object, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise CriError.invalid(where, "must be a list of strings")
    return list(value)
