"""``aer``'s entry point: the command line itself is auraed.client.cli."""

from __future__ import annotations

import os


def main() -> None:
    # grpc reads its log level when it is first imported. Its INFO lines (a refused TLS handshake,
    # say) would only repeat, in grpc's developers' words, the error aer prints.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from auraed.client.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
