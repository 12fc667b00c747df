"""``python -m auraed.system.userns_helper``: the child that makes a pod's user namespace and the
namespaces it owns, configures them as their root, and clones the pod's init (the conversation
with the daemon: auraed.system.userns)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from auraed.system import confine, namespaces
from auraed.system.pod_namespaces import IPC, NET, UTS, NamespaceError, configure_namespaces
from auraed.system.userns import CLONE_NEWUSER

KIND_FLAGS = {NET: namespaces.CLONE_NEWNET, IPC: namespaces.CLONE_NEWIPC, UTS: namespaces.CLONE_NEWUTS}
CLONE_PARENT = 0x00008000


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _expect(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"userns helper: expected {word!r} from the daemon, got {line!r}")


def _clone_as_sibling() -> int:
    """fork(2), but the child's parent is this process's parent (CLONE_PARENT): the daemon, which
    reaps it when the pod goes, as it reaps the init of a pod without a user namespace. A plain
    fork would leave it to whatever adopts orphans once this helper ends (an init that may never
    reap it). This process is single-threaded, so its raw clone is as safe as fork."""
    return confine.raw_syscall("clone", ctypes.c_ulong(CLONE_PARENT | signal.SIGCHLD), None, None, None, None)


def _start_init(init: list[str], name: str, init_id: int, mountpoint: Path) -> int:
    """Clone the PID namespace's PID 1 (the daemon's child), which confines itself and becomes
    ``init`` (a program and its arguments)."""
    pid = _clone_as_sibling()
    if pid:
        return pid
    try:
        path = confine.confine_thread(Path(init[0]), name, mountpoint, unprivileged_id=init_id)
        os.execve(path, [name, *init[1:]], {})
    except BaseException as exc:  # its stderr is closed by then: the daemon sees it end at once
        os.write(2, f"userns helper: the pod's init: {exc}\n".encode())
    finally:
        os._exit(127)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m auraed.system.userns_helper")
    parser.add_argument("--kinds", default="")
    parser.add_argument("--configuration", type=json.loads, default={})
    parser.add_argument("--name", default="init")
    parser.add_argument("--init-id", type=int, default=confine.UNPRIVILEGED_ID)
    parser.add_argument("--mountpoint", type=Path, default=Path("/tmp"))
    parser.add_argument("init", nargs="*")
    args = parser.parse_args(argv)
    flags = CLONE_NEWUSER | sum(KIND_FLAGS[kind] for kind in args.kinds.split(",") if kind)
    namespaces.unshare(flags | (namespaces.CLONE_NEWPID if args.init else 0))
    _say("ready")
    _expect("go")
    # The namespace's root from here (its ids are mapped now): caps kept, as root gains them.
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    settings = args.configuration
    try:
        configure_namespaces(
            settings.get("hostname", ""), settings.get("sysctls", {}), settings.get("network", False)
        )
    except NamespaceError as exc:
        _say("refused " + json.dumps({"kind": exc.kind.value, "message": exc.message}))
        return 1
    _say("configured")
    if args.init:
        _say(f"init {_start_init(args.init, args.name, args.init_id, args.mountpoint)}")
        _expect("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
