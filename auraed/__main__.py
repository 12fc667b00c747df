"""``auraed``: the daemon's entry point, where the Daemon is composed (also for PID 1)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING

from auraed.errors import ConfigError

if TYPE_CHECKING:
    from auraed.config import DaemonConfig
    from auraed.server.daemon import Daemon
    from auraed.server.system_service import Machine


def build_daemon(config: DaemonConfig, machine: Machine | None = None) -> Daemon:
    """The Daemon; ``machine`` is PID 1's, when auraed is the init (auraed/init/pid1.py)."""
    # Imported here, not at the top: PID 1 calls this only after its boot (mounts, config disk,
    # stop signals), and the server's imports take seconds in a guest under emulation.
    from auraed.server.daemon import Daemon

    return Daemon(config, machine)


def main() -> None:
    if os.getpid() == 1:  # PID 1 (guest VM, bare metal, pid namespace): auraed/init/pid1.py
        from auraed.init import pid1

        # mounts, config disk, network, reaping, power off; never returns
        pid1.main(sys.argv[1:], build_daemon)
    from auraed.config import load_config

    try:
        config = load_config(sys.argv[1:])
    except ConfigError as exc:
        print(f"auraed: {exc.message}", file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(build_daemon(config).run()))


if __name__ == "__main__":
    main()
