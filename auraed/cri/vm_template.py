"""The vm pods' guest template, kept ready from the daemon's start (``cri_vm_boot = "template"``).

A template costs a guest's boot (seconds under TCG); made at a node's first vm pod, that pod would
pay it. So it is made in the background as soon as the daemon has started and the guest image
exists, and made again when the image changes (its files replaced or rewritten: one inotify
watch on the image's directory through the daemon's LogWatch, a slow poll where there is none).
A pod that arrives while it is being made waits for it (Templates.ensure holds the template's
lock), which is never later than its own cold boot started then would serve; a template that
cannot be made is logged, not fatal: pods then boot cold (Guests.boot says why), and it is tried
again when the image changes (each pod also tries, as before).

The template is the pods' ``auto`` template (vms/templates.py): on q35 one per guest image, made at
its base size with the node's whole room, every pod's guest a clone grown to its size as it is
restored. Where pods cannot be clones (cri_vm_machine = "microvm") that is said once, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from auraed.errors import AuraeError
from auraed.observe.logfile import LogWatch
from auraed.vms.guests import GUEST_IMAGE_FILES, Guests
from auraed.vms.model import VmSpec

log = logging.getLogger(__name__)

IMAGE_POLL = 10.0
"""Seconds between looks at the guest image without an inotify watch on its directory."""
IMAGE_POLL_WATCHED = 300.0
"""With a watch: a look this often all the same (a change the watch cannot see, a file replaced
in a directory bind-mounted over)."""
IMAGE_SETTLE = 1.0
"""Seconds the image's directory must stay unchanged before the template is made from it: a copy
of the image still being written is not booted."""

Stamp = tuple[tuple[int, int, int, int, int], ...]


def image_stamp(directory: Path) -> Stamp | None:
    """What identifies the guest image's files as they are now (inode, size, times); None while
    one is missing."""
    stamps = []
    for name in GUEST_IMAGE_FILES.values():
        try:
            info = os.stat(directory / name)
        except OSError:
            return None
        stamps.append((info.st_ino, info.st_dev, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(stamps)


class PodTemplate:
    """Keeps vm pods' template made: ``template_spec`` gives a pod's guest spec as it is made
    for (None: pods boot cold, nothing to keep)."""

    def __init__(
        self, guests: Guests, template_spec: Callable[[], VmSpec | None], log_watch: LogWatch | None
    ) -> None:
        self._guests = guests
        self._template_spec = template_spec
        self._log_watch = log_watch
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._template_spec() is None:
            return
        self._task = asyncio.get_running_loop().create_task(self._keep(), name="vm-pod-template")

    async def close(self) -> None:
        """Stop keeping it; a template being made is given up (its VMM ended, made again at the
        next start or pod)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _keep(self) -> None:
        spec = self._template_spec()
        assert spec is not None
        problem = self._guests.template_problem(spec, spec.backend)
        if problem:
            log.info("vm pods boot cold, not from a guest template: %s", problem)
            return
        directory = self._guests.image_dir
        watching = self._log_watch.watching if self._log_watch is not None else _unwatched
        with watching(directory) as changed:
            made_from: Stamp | None = None
            while True:
                if changed is not None:
                    changed.clear()
                stamp = await asyncio.to_thread(image_stamp, directory)
                if stamp is None and made_from is None:
                    log.info(
                        "vm pods' guest template: no guest image at %s yet; made once there is one", directory
                    )
                    made_from = ()
                elif stamp is not None and stamp != made_from:
                    made_from = stamp
                    await self._make(spec)
                    continue  # the image may have changed while the template was made
                await _changed(changed)

    async def _make(self, spec: VmSpec) -> None:
        started = asyncio.get_running_loop().time()
        image = self._guests.image_dir
        log.info("vm pods' guest template: making it ready in the background (guest image %s)", image)
        try:
            template = await self._guests.ensure_template(spec)
        except AuraeError as exc:
            log.warning(
                "vm pods' guest template could not be made: %s; pods boot cold until it is (tried again "
                "at each pod, and when the guest image changes)",
                exc.message,
            )
            return
        except Exception:  # never the daemon's end: pods boot cold
            log.exception("vm pods' guest template could not be made")
            return
        took = asyncio.get_running_loop().time() - started
        room = template.room
        log.info(
            "vm pods' guest template %s is ready (build %d, %s, room for %s; %.1f s): pods are its clones",
            template.name,
            template.build,
            template.shape.describe(),
            f"{room.max_vcpus} vCPUs and {room.max_memory_mib} MiB" if room else "no growth",
            took,
        )


@contextlib.contextmanager
def _unwatched(directory: Path) -> Iterator[asyncio.Event | None]:
    """No watch (no LogWatch): the image is polled."""
    yield None


async def _changed(changed: asyncio.Event | None) -> None:
    """Until the image's directory changed and then stayed quiet for IMAGE_SETTLE, or a poll's time."""
    if changed is None:
        await asyncio.sleep(IMAGE_POLL)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(IMAGE_POLL_WATCHED):
            await changed.wait()
    while changed.is_set():
        changed.clear()
        await asyncio.sleep(IMAGE_SETTLE)
