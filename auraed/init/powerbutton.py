"""The ACPI power button as PID 1 sees it: an evdev input device named "Power Button".

QEMU's ``system_powerdown`` (QMP) raises an ACPI power-button event; the kernel's ACPI button
driver turns it into a key press on an input device (``/sys/class/input/eventN/device/name`` is
"Power Button", ``/dev/input/eventN`` its node with devtmpfs). Reading it yields ``struct
input_event`` records (24 bytes on 64-bit: struct timeval, u16 type, u16 code, s32 value); a press
is EV_KEY / KEY_POWER / value 1. With Debian's cloud kernel both drivers are modules (``button``
and ``evdev``): :func:`load_modules` loads them from /lib/modules when the image ships them and
the initramfs did not load them already.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

INPUT_EVENT = struct.Struct("llHHi")  # native: timeval (2 x long), type, code, value
EV_KEY = 1
KEY_POWER = 116
POWER_BUTTON_NAME = "Power Button"
MODULES = ("kernel/drivers/input/evdev.ko", "kernel/drivers/acpi/button.ko")
_FINIT_MODULE = {"x86_64": 313, "aarch64": 273}
_MODULE_INIT_COMPRESSED_FILE = 4


class InputEventParser:
    """Splits a byte stream into (type, code, value) triples, keeping partial records."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> Iterator[tuple[int, int, int]]:
        buffer = self._pending + data
        usable = len(buffer) - len(buffer) % INPUT_EVENT.size
        self._pending = buffer[usable:]
        for _sec, _usec, kind, code, value in INPUT_EVENT.iter_unpack(buffer[:usable]):
            yield kind, code, value


def is_power_press(kind: int, code: int, value: int) -> bool:
    return kind == EV_KEY and code == KEY_POWER and value == 1


def encode_event(kind: int, code: int, value: int) -> bytes:
    """One struct input_event (for tests and tools)."""
    return INPUT_EVENT.pack(0, 0, kind, code, value)


def find_power_buttons(sys_dir: str = "/sys", dev_dir: str = "/dev") -> list[str]:
    """Device nodes of every input device named "Power Button" (PCs often have two)."""
    base = f"{sys_dir}/class/input"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.startswith("event"):
            continue
        try:
            with open(f"{base}/{name}/device/name") as handle:
                label = handle.read().strip()
        except OSError:
            continue
        if label == POWER_BUTTON_NAME:
            found.append(f"{dev_dir}/input/{name}")
    return found


def load_modules(
    modules_dirs: tuple[str, ...] | None = None, modules: tuple[str, ...] = MODULES
) -> list[str]:
    """finit_module(2) the ``modules`` (paths under [/usr]/lib/modules/<release>; the evdev and
    ACPI button modules by default).

    Already loaded (EEXIST) or built in (no file): nothing to do. Returns the files loaded; raises
    OSError for a module file that exists and fails to load.
    """
    import ctypes
    import errno

    uname = os.uname()
    number = _FINIT_MODULE.get(uname.machine)
    if number is None:
        return []
    directories = modules_dirs or (f"/lib/modules/{uname.release}", f"/usr/lib/modules/{uname.release}")
    libc = ctypes.CDLL(None, use_errno=True)
    loaded = []
    for module in modules:
        fd, path = _open_module(directories, module)
        if fd < 0:
            continue
        try:
            flags = 0 if path.endswith(".ko") else _MODULE_INIT_COMPRESSED_FILE
            if libc.syscall(number, fd, b"", flags) == 0:
                loaded.append(path)
            elif (err := ctypes.get_errno()) != errno.EEXIST:
                raise OSError(err, f"finit_module {path}: {os.strerror(err)}")
        finally:
            os.close(fd)
    return loaded


def _open_module(directories: tuple[str, ...], module: str) -> tuple[int, str]:
    for directory in directories:
        for suffix in ("", ".xz", ".zst"):
            path = f"{directory}/{module}{suffix}"
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC), path
            except OSError:
                continue
    return -1, ""


def open_device(path: str) -> int:
    """A non-blocking descriptor on an input device: it queues the presses from now on."""
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


class PowerButtonWatcher:
    """Calls ``on_press`` once per power-button press read from the given devices (non-blocking,
    through the event loop). A device that fails or ends is dropped, never raised."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_press: Callable[[str], None]) -> None:
        self._loop = loop
        self._on_press = on_press
        self._fds: dict[int, tuple[str, InputEventParser]] = {}

    @property
    def devices(self) -> list[str]:
        return [path for path, _ in self._fds.values()]

    def watch(self, path: str) -> None:
        self.adopt(path, open_device(path))

    def adopt(self, path: str, fd: int) -> None:
        """Watch ``fd`` (from :func:`open_device`), which this watcher now owns and closes."""
        self._fds[fd] = (path, InputEventParser())
        self._loop.add_reader(fd, self._readable, fd)

    def close(self) -> None:
        for fd in list(self._fds):
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _readable(self, fd: int) -> None:
        path, parser = self._fds[fd]
        try:
            data = os.read(fd, INPUT_EVENT.size * 64)
        except BlockingIOError:
            return
        except OSError:  # ENODEV: the device went away
            self._drop(fd)
            return
        if not data:  # end of stream (a pipe in tests): stop watching rather than spin
            self._drop(fd)
            return
        for event in parser.feed(data):
            if is_power_press(*event):
                self._on_press(path)
