"""Ctrl-C ends `aer` even when what it was doing will not stop: the process ends with 130 after
EXIT_INTERRUPT_GRACE, its output flushed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from auraed.client.cli.calls import EXIT_INTERRUPT_GRACE, EXIT_INTERRUPTED
from tests.support.interrupt import interruptible

STUBBORN = """
import asyncio, os, signal, sys
from auraed.client.cli.calls import ends_soon_after_interrupt

async def main():
    with ends_soon_after_interrupt():
        print("ready", flush=True)
        while True:  # a tear-down that never ends: cancellation is swallowed
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                print("kept", end="")  # buffered: must still come out

asyncio.run(main())
"""


def test_an_interrupt_ends_the_process_even_when_the_work_ignores_it() -> None:
    process = subprocess.Popen(
        interruptible([sys.executable, "-c", STUBBORN]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=EXIT_INTERRUPT_GRACE + 10)
    finally:
        process.kill()
    assert process.returncode == EXIT_INTERRUPTED
    assert EXIT_INTERRUPT_GRACE - 0.5 < time.monotonic() - interrupted < EXIT_INTERRUPT_GRACE + 5
    assert (out, err) == ("kept", "")
