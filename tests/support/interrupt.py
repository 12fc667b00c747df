"""Children that a test interrupts with SIGINT, as Ctrl-C would.

A suite started with SIGINT ignored (``nohup hack/test &``, a CI runner in the background) hands
that disposition to every child it starts: an ignored signal stays ignored across exec, and
Python then installs no KeyboardInterrupt handler at all, so the child never sees the test's
SIGINT. Such a child gets SIGINT's default disposition back before it runs.
"""

from __future__ import annotations

from collections.abc import Sequence


def interruptible(command: Sequence[str]) -> list[str]:
    """``command`` started with SIGINT's default disposition, whatever the suite's is.

    coreutils' env resets it and execs the command, which keeps env's pid: the test's SIGINT
    reaches the command itself. Not a ``preexec_fn``: Python code between fork and exec is unsafe
    in a process with threads, which the suite has.
    """
    return ["env", "--default-signal=INT", *command]
