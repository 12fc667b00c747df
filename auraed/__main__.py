"""``auraed``: the daemon's entry point."""

from __future__ import annotations

import asyncio
import sys

from auraed.errors import ConfigError


def main() -> None:
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
