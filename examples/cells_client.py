"""A short auraed client: allocate a cell, run a command in it, print its output, free the cell.

    python examples/cells_client.py [--config ~/.aurae/config]

The config is the Aurae-style client config `aer pki init` writes ([auth] ca_crt, client_crt,
client_key; [system] socket).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from auraed.api.aurae.cells import v0 as cells
from auraed.api.aurae.observe import v0 as observe
from auraed.client import AuraeClient, ClientError, load_client_config


async def run(config_path: Path | None) -> None:
    async with AuraeClient.connect(load_client_config(config_path)) as client:
        cell_service = client.service("aurae.cells.v0.CellService")
        await cell_service.allocate(
            cells.CellServiceAllocateRequest(
                cell=cells.Cell(
                    name="example", memory=cells.MemoryController(max=64 << 20), isolate_process=True
                )
            )
        )
        try:
            executable = cells.Executable(name="hello", shell_command="echo hello from $(hostname), pid $$")
            await cell_service.start(
                cells.CellServiceStartRequest(cell_name="example", executable=executable)
            )
            request = observe.ObserveServiceGetSubProcessStreamRequest(
                cell_name="example", executable_name="hello", follow=True
            )
            async for item in client.service("aurae.observe.v0.ObserveService").get_sub_process_stream(
                request
            ):
                print(item.item.line)
        finally:
            await cell_service.free(cells.CellServiceFreeRequest(cell_name="example"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=None, help="client config (default: ~/.aurae/config)")
    args = parser.parse_args()
    try:
        asyncio.run(run(args.config))
    except ClientError as error:
        raise SystemExit(f"example: {error}") from None


if __name__ == "__main__":
    main()
