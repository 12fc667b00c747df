"""``auraed``: the daemon's entry point."""

from __future__ import annotations

import asyncio
import os
import sys

from auraed.errors import ConfigError


def main() -> None:
    if os.getpid() == 1:  # PID 1 (guest VM, bare metal, pid namespace): auraed/init/pid1.py
        from auraed.init import pid1

        pid1.main(sys.argv[1:])  # mounts, config disk, network, reaping, power off; never returns
    from auraed.config import load_config
    from auraed.server.daemon import Daemon

    try:
        config = load_config(sys.argv[1:])
    except ConfigError as exc:
        print(f"auraed: {exc.message}", file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(Daemon(config).run()))


if __name__ == "__main__":
    main()
