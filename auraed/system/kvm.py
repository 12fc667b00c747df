"""Probe whether /dev/kvm can really run guests, instead of trusting that the device node exists.

Stdlib only. ``probe_kvm`` builds two throw-away VMs with the raw KVM ioctl API and runs a tiny
guest program in each, first in 16-bit real mode (where firmware starts) and then in 64-bit long
mode with paging (where cloud-hypervisor/firecracker enter a Linux kernel). The program:

1. ``burst``: executes ``out`` 1000 times in a row, so we can time a bare IO exit round trip;
2. ``loop``: counts 2**21 iterations with a memory increment, doing an ``out`` every 4096
   iterations (512 exits) so each KVM_RUN in this phase times exactly one 4096-iteration chunk;
3. reports the counter with a last ``out`` and executes ``hlt``.

KVM is *usable* only if every ioctl succeeds, the guest exits exactly with the expected IO exits
(port, direction, size, value) then ``KVM_EXIT_HLT``, the counter in guest memory and the guest's
RAX/RIP are right, the guest is not crawling, and everything finishes within ``timeout_s``.

The crawl rule, from measurements: with hardware virtualization guest code runs at native speed;
the same loop compiled natively runs at 2.5 ns per iteration on the development machines (5 ms
for the whole loop), and an IO exit round trip costs a few microseconds. On those machines
/dev/kvm is a nested, pagetable-based KVM (kvm_pvm; no vmx/svm in the CPU flags) that emulates
guest code: a bare IO exit takes ~8 us (median; 10-27 us while other jobs load the 2 cores),
in the range of real KVM, but a loop iteration takes 3.5 us (real mode) to 4.0 us (long mode),
~1500x native (up to 8 us under load), so a kernel boot crawls. So:

- the median 4096-iteration chunk must run at <= ``MAX_NS_PER_ITERATION`` (100 ns: 40x above
  native speed, so a loaded host still passes, and 35x below the crawling one). The verdict is
  given early when the first ``EARLY_CHUNKS`` chunks are all slower than the limit, so a crawling
  host is rejected in ~0.15 s instead of running into the timeout;
- the median KVM_RUN time of a bare IO exit must be <= ``MAX_US_PER_EXIT`` (50 us: bare-metal
  KVM is ~1-3 us, nested VMX ~5-20 us). The median, because preemption on a busy host inflates
  the mean (a loaded run here averaged 41 us with a 27 us median). It does not trip on the
  development machines; it catches a host whose every device access would be pathologically slow.

Watchdog: the guests run in a short-lived child interpreter (``python -I -S`` on this file),
not in a thread of the caller. A thread stuck in KVM_RUN cannot be stopped from Python: on the
development machines a guest with a slightly odd register state made KVM_RUN spin in the kernel
for as long as we let it, at 100% of a CPU, and never return; an abandoned daemon thread would
burn that CPU and keep the VM's fds open for the daemon's lifetime. Signals do interrupt KVM_RUN,
but a library cannot install process-wide handlers (only the main thread may, and they would
clobber the application's). The child owns its main thread, so it arms ``setitimer`` for the
deadline (the handler raises, KVM_RUN returns EINTR, the child reports how far the guest got),
and the parent kills it if it is still alive ``_GRACE_S`` after the deadline; the kernel then
frees every VM resource. Cost: one interpreter start (~20-30 ms). ``probe_kvm`` blocks: call it
from a worker thread in async code.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

DEFAULT_DEVICE = Path("/dev/kvm")

MAX_NS_PER_ITERATION = 100.0
MAX_US_PER_EXIT = 50.0
EARLY_CHUNKS = 8

_KVM_API_VERSION = 12
_BURST = 1000
_ITERATIONS = 1 << 21
_CHUNK = 1 << 12
_GRACE_S = 0.5
_CHILD_FLAG = "--auraed-kvm-probe-child"


def _io(nr: int) -> int:
    return (0xAE << 8) | nr


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (0xAE << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (0xAE << 8) | nr


_REGS_SIZE = 18 * 8  # struct kvm_regs: rax..r15, rip, rflags
_SREGS_SIZE = 312  # struct kvm_sregs on x86_64

KVM_GET_API_VERSION = _io(0x00)
KVM_CREATE_VM = _io(0x01)
KVM_GET_VCPU_MMAP_SIZE = _io(0x04)
KVM_CREATE_VCPU = _io(0x41)
KVM_SET_USER_MEMORY_REGION = _iow(0x46, 32)
KVM_RUN = _io(0x80)
KVM_GET_REGS = _ior(0x81, _REGS_SIZE)
KVM_SET_REGS = _iow(0x82, _REGS_SIZE)
KVM_GET_SREGS = _ior(0x83, _SREGS_SIZE)
KVM_SET_SREGS = _iow(0x84, _SREGS_SIZE)

_EXIT_IO = 2
_EXIT_HLT = 5
_EXIT_INTERNAL_ERROR = 17
_EXIT_FAIL_ENTRY = 9
_EXIT_NAMES = {
    0: "KVM_EXIT_UNKNOWN",
    1: "KVM_EXIT_EXCEPTION",
    2: "KVM_EXIT_IO",
    3: "KVM_EXIT_HYPERCALL",
    4: "KVM_EXIT_DEBUG",
    5: "KVM_EXIT_HLT",
    6: "KVM_EXIT_MMIO",
    7: "KVM_EXIT_IRQ_WINDOW_OPEN",
    8: "KVM_EXIT_SHUTDOWN (triple fault)",
    9: "KVM_EXIT_FAIL_ENTRY",
    10: "KVM_EXIT_INTR",
    16: "KVM_EXIT_NMI",
    17: "KVM_EXIT_INTERNAL_ERROR",
    24: "KVM_EXIT_SYSTEM_EVENT",
}
_INTERNAL_SUBERRORS = {
    1: "emulation failure",
    2: "simultaneous exceptions",
    3: "error during event delivery",
    4: "unexpected exit reason",
}
_IO_OUT = 1

# struct kvm_run: exit_reason at 8; the exit union at 32.
_RUN_REASON = struct.Struct("<I")
_RUN_IO = struct.Struct("<BBHIQ")  # direction, size, port, count, data_offset
_RUN_INTERNAL = struct.Struct("<II4Q")  # suberror, ndata, data[0..3]
_RUN_FAIL_ENTRY = struct.Struct("<QI")  # hardware_entry_failure_reason, cpu
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SEGMENT = struct.Struct("<QIHBBBBBBBBBB")  # struct kvm_segment, 24 bytes
_MEMORY_REGION = struct.Struct("<IIQQQ")  # slot, flags, guest_phys_addr, memory_size, userspace_addr

# Guest physical layout (one 2 MiB slot, lazily backed by anonymous memory).
_MEM_SIZE = 2 << 20
_COUNTER = 0x500
_PARAMS = 0x600  # u32 iterations, u32 chunk mask, u32 burst count
_GDT = 0x800
_CODE = 0x1000
_PML4, _PDPT, _PD = 0x2000, 0x3000, 0x4000
_STACK = 0x8000
_PORT_LOOP, _PORT_DONE, _PORT_BURST = 0x10, 0x11, 0x12

# The guest program, assembled with GNU as (.code16 / .code64) from:
#   [16-bit only: xor %ax,%ax; mov %ax,%ds]
#   mov (0x608),%ecx
#   burst: mov %ecx,%eax; out %eax,$0x12; dec %ecx; jnz burst
#   mov (0x600),%ecx; movl $0,(0x500)
#   loop: incl (0x500); test (0x604),%ecx; jnz skip; mov %ecx,%eax; out %eax,$0x10
#   skip: dec %ecx; jnz loop
#   mov (0x500),%eax; out %eax,$0x11; hlt
_CODE_REAL = bytes.fromhex(
    "31c08ed8668b0e08066689c866e712664975f6668b0e000666c7060005000000"
    "0066ff06000566850e040675066689c866e710664975ea66a1000566e711f4"
)
_CODE_LONG = bytes.fromhex(
    "8b0c250806000089c8e712ffc975f88b0c2500060000c70425000500000000"
    "0000ff042500050000850c2504060000750489c8e710ffc975e88b042500050000e711f4"
)


def _median(values: list[float]) -> float:
    """statistics.median, without importing statistics (fractions, decimal, random: PID 1 of
    every guest imports this module, and every import costs ~10x under TCG)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class KvmProbe:
    """Outcome of ``probe_kvm``.

    ``present``: the device node exists. ``usable``: guests really run on it (see the module
    docstring for the rule). ``detail``: why, with the measurements. ``elapsed_s``: probe wall time.
    """

    present: bool
    usable: bool
    detail: str
    elapsed_s: float


class _ProbeFailed(Exception):
    pass


class _Deadline(Exception):
    pass


@dataclass(frozen=True)
class _StageStats:
    mode: str
    burst_exit_us: float  # median KVM_RUN time of a bare IO exit
    ns_per_iteration: float  # median over 4096-iteration chunks
    exits: int
    elapsed_s: float

    def describe(self) -> str:
        return (
            f"{self.mode}: {self.exits} IO exits, {self.burst_exit_us:.1f} us per bare exit (median), "
            f"{_ITERATIONS} loop iterations at {self.ns_per_iteration:.1f} ns each, "
            f"{self.elapsed_s * 1e3:.1f} ms"
        )


def probe_kvm(device: Path = DEFAULT_DEVICE, timeout_s: float = 2.0) -> KvmProbe:
    """Check that ``device`` runs real guests quickly; never raises, returns within ~timeout_s."""
    start = time.monotonic()
    deadline = start + timeout_s

    def done(present: bool, usable: bool, detail: str) -> KvmProbe:
        return KvmProbe(present, usable, detail, time.monotonic() - start)

    try:  # O_NONBLOCK: a wrong path (a FIFO, a tty) must not block the caller here
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return done(False, False, f"{device} does not exist")
    except OSError as exc:
        return done(os.path.lexists(device), False, f"cannot open {device}: {_strerror(exc)}")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION, 0)
    except OSError as exc:
        return done(True, False, f"{device} is not a KVM device: KVM_GET_API_VERSION: {_strerror(exc)}")
    finally:
        os.close(fd)
    if version != _KVM_API_VERSION:
        return done(True, False, f"KVM API version {version}, expected {_KVM_API_VERSION}")

    script = Path(__file__)
    if not sys.executable or not script.is_file():
        return done(True, False, "cannot start the probe helper (no sys.executable or module file)")
    cmd = [sys.executable, "-I", "-S", str(script), _CHILD_FLAG, os.fsdecode(device), repr(deadline)]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return done(True, False, f"cannot start the probe helper: {_strerror(exc)}")
    wait_s = max(0.0, deadline - time.monotonic()) + _GRACE_S
    try:
        out, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return done(
            True,
            False,
            f"the guest did not finish within {timeout_s:g} s and the probe helper ignored its own "
            "deadline; killed it (KVM_RUN stuck in the kernel?)",
        )
    try:
        report = json.loads(out.decode().strip().splitlines()[-1])
        return done(True, bool(report["usable"]), str(report["detail"]))
    except (ValueError, IndexError, KeyError, TypeError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return done(True, False, f"probe helper failed (exit {proc.returncode}): {tail[0]}")


def _strerror(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _ioctl_int(fd: int, request: int, arg: int, name: str) -> int:
    try:
        return fcntl.ioctl(fd, request, arg)
    except OSError as exc:
        raise _ProbeFailed(f"{name} failed: {_strerror(exc)}") from None


def _ioctl_buf(fd: int, request: int, buf: bytearray, name: str) -> None:
    try:
        fcntl.ioctl(fd, request, buf, True)
    except OSError as exc:
        raise _ProbeFailed(f"{name} failed: {_strerror(exc)}") from None


def _probe_guests(device: Path, deadline: float) -> tuple[bool, str]:
    """Run both guest stages in this process. Arms a SIGALRM watchdog when on the main thread."""
    start = time.monotonic()
    armed = False
    previous: object = None
    if threading.current_thread() is threading.main_thread():

        def on_alarm(signum: int, frame: FrameType | None) -> None:
            raise _Deadline

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.001))
        armed = True
    fd = -1
    stats: list[_StageStats] = []
    try:
        try:
            fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            return False, f"cannot open {device}: {_strerror(exc)}"
        run_size = _ioctl_int(fd, KVM_GET_VCPU_MMAP_SIZE, 0, "KVM_GET_VCPU_MMAP_SIZE")
        for mode in ("real mode", "long mode"):
            stats.append(_run_stage(fd, run_size, mode, deadline))
    except (_ProbeFailed, _Deadline) as exc:
        # _Deadline lands here when the watchdog fires outside KVM_RUN (during VM setup, say).
        reason = str(exc) or f"no verdict before the deadline ({time.monotonic() - start:.2f} s)"
        passed = "".join(f"; passed {s.describe()}" for s in stats)
        return False, f"KVM present but unusable: {reason}{passed}"
    finally:
        _disarm(armed, previous)
        if fd >= 0:
            os.close(fd)
    total = time.monotonic() - start
    return True, f"KVM usable (API {_KVM_API_VERSION}, {total * 1e3:.0f} ms): " + "; ".join(
        s.describe() for s in stats
    )


def _disarm(armed: bool, previous: object) -> None:
    if armed:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if callable(previous) or isinstance(previous, int):
            signal.signal(signal.SIGALRM, previous)


def _run_stage(kvm_fd: int, run_size: int, mode: str, deadline: float) -> _StageStats:
    """Create a VM + vCPU, run the guest program in ``mode``, check it; tear everything down."""
    start = time.monotonic()
    code = _CODE_REAL if mode == "real mode" else _CODE_LONG
    with contextlib.ExitStack() as stack:
        # LIFO teardown: unmap kvm_run, close the vCPU, close the VM, then unmap guest memory.
        mem = mmap.mmap(-1, _MEM_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        stack.callback(mem.close)
        view = (ctypes.c_char * _MEM_SIZE).from_buffer(mem)
        mem_addr = ctypes.addressof(view)
        del view  # release the buffer export, or mem.close() would fail
        mem[_CODE : _CODE + len(code)] = code
        mem[_PARAMS : _PARAMS + 12] = struct.pack("<III", _ITERATIONS, _CHUNK - 1, _BURST)

        vm = _ioctl_int(kvm_fd, KVM_CREATE_VM, 0, "KVM_CREATE_VM")
        stack.callback(os.close, vm)
        region = bytearray(_MEMORY_REGION.pack(0, 0, 0, _MEM_SIZE, mem_addr))
        _ioctl_buf(vm, KVM_SET_USER_MEMORY_REGION, region, "KVM_SET_USER_MEMORY_REGION")
        vcpu = _ioctl_int(vm, KVM_CREATE_VCPU, 0, "KVM_CREATE_VCPU")
        stack.callback(os.close, vcpu)
        try:
            run = mmap.mmap(vcpu, run_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise _ProbeFailed(f"mmap of kvm_run failed: {_strerror(exc)}") from None
        stack.callback(run.close)

        sregs = bytearray(_SREGS_SIZE)
        _ioctl_buf(vcpu, KVM_GET_SREGS, sregs, "KVM_GET_SREGS")
        if mode == "real mode":
            _setup_real_mode(sregs)
        else:
            _setup_long_mode(sregs, mem)
        _ioctl_buf(vcpu, KVM_SET_SREGS, sregs, "KVM_SET_SREGS")
        regs = bytearray(_REGS_SIZE)
        _U64.pack_into(regs, 6 * 8, _STACK)  # rsp
        _U64.pack_into(regs, 16 * 8, _CODE)  # rip
        _U64.pack_into(regs, 17 * 8, 0x2)  # rflags (bit 1 is reserved, always set)
        _ioctl_buf(vcpu, KVM_SET_REGS, regs, "KVM_SET_REGS")

        checker = _run_guest(vcpu, run, mode, deadline)

        counter = _U32.unpack_from(mem, _COUNTER)[0]
        if counter != _ITERATIONS:
            raise _ProbeFailed(f"{mode}: guest memory holds {counter}, expected {_ITERATIONS}")
        _ioctl_buf(vcpu, KVM_GET_REGS, regs, "KVM_GET_REGS")
        rax, rip = _U64.unpack_from(regs, 0)[0], _U64.unpack_from(regs, 16 * 8)[0]
        if rax != _ITERATIONS or rip != _CODE + len(code):
            raise _ProbeFailed(f"{mode}: guest ended with rax={rax:#x} rip={rip:#x}")
    elapsed = time.monotonic() - start
    return _StageStats(mode, checker.burst_us(), checker.ns_per_iteration(), checker.exits, elapsed)


def _setup_real_mode(sregs: bytearray) -> None:
    # Reset state is real mode with CS base 0xffff0000; point CS at 0 so RIP is a physical address.
    _U64.pack_into(sregs, 0, 0)  # cs.base
    struct.pack_into("<H", sregs, 12, 0)  # cs.selector


def _setup_long_mode(sregs: bytearray, mem: mmap.mmap) -> None:
    # Identity-map the first 2 MiB with one large page; flat 64-bit code and data segments.
    _U64.pack_into(mem, _PML4, _PDPT | 0x3)
    _U64.pack_into(mem, _PDPT, _PD | 0x3)
    _U64.pack_into(mem, _PD, 0x83)  # present | writable | 2 MiB page
    struct.pack_into("<3Q", mem, _GDT, 0, 0x00AF9B000000FFFF, 0x00CF93000000FFFF)
    #                       base limit selector type present dpl db s l g avl unusable pad
    _SEGMENT.pack_into(sregs, 0, 0, 0xFFFFFFFF, 0x08, 11, 1, 0, 0, 1, 1, 1, 0, 0, 0)  # cs
    for index in range(1, 6):  # ds es fs gs ss
        _SEGMENT.pack_into(sregs, index * 24, 0, 0xFFFFFFFF, 0x10, 3, 1, 0, 1, 1, 0, 1, 0, 0, 0)
    struct.pack_into("<QH", sregs, 192, _GDT, 3 * 8 - 1)  # gdt base, limit
    cr0 = 0x80050033  # PG | AM | WP | NE | ET | MP | PE
    struct.pack_into("<4Q", sregs, 224, cr0, 0, _PML4, 0x20)  # cr0, cr2, cr3, cr4 = PAE
    _U64.pack_into(sregs, 224 + 5 * 8, 0x500)  # efer = LME | LMA


class _ExitChecker:
    """Checks each IO exit against the program's exact sequence and keeps the timings."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.start = time.monotonic()
        self.burst_left = _BURST
        self.loop_next = _ITERATIONS  # the value the next loop ``out`` must carry
        self.finished = False
        self.exits = 0
        self.burst_times: list[float] = []
        self.chunk_times: list[float] = []

    def progress(self) -> str:
        text = (
            f"{self.exits} of {_BURST + _ITERATIONS // _CHUNK + 1} IO exits after "
            f"{time.monotonic() - self.start:.2f} s, {_ITERATIONS - self.loop_next} loop iterations done"
        )
        if self.chunk_times:
            text += f" at {self.ns_per_iteration():.0f} ns each"
        return text

    def fail(self, what: str) -> _ProbeFailed:
        return _ProbeFailed(f"{self.mode}: {what} ({self.progress()})")

    def io(self, port: int, value: int, elapsed: float) -> None:
        self.exits += 1
        if self.burst_left and port == _PORT_BURST and value == self.burst_left:
            if self.burst_left != _BURST:  # the first entry is cold; time only steady-state exits
                self.burst_times.append(elapsed)
            self.burst_left -= 1
            if not self.burst_left and self.burst_us() > MAX_US_PER_EXIT:
                raise self.fail(
                    f"IO exits are slow: median {self.burst_us():.1f} us per bare exit "
                    f"(limit {MAX_US_PER_EXIT:g} us)"
                )
        elif not self.burst_left and port == _PORT_LOOP and value == self.loop_next and value > 0:
            if value != _ITERATIONS:  # each later KVM_RUN covers exactly one chunk
                self.chunk_times.append(elapsed)
                if len(self.chunk_times) == EARLY_CHUNKS:
                    self.check_speed(min(self.chunk_times), "at best")
            self.loop_next -= _CHUNK
        elif not self.loop_next and not self.finished and port == _PORT_DONE:
            if value != _ITERATIONS:
                raise self.fail(f"guest counted {value}, expected {_ITERATIONS}")
            self.finished = True
        else:
            raise self.fail(f"unexpected OUT {value:#x} to port {port:#x}")

    def burst_us(self) -> float:
        return _median(self.burst_times) * 1e6

    def ns_per_iteration(self) -> float:
        return _median(self.chunk_times) / _CHUNK * 1e9

    def check_speed(self, chunk_s: float, label: str) -> None:
        ns = chunk_s / _CHUNK * 1e9
        if ns > MAX_NS_PER_ITERATION:
            raise self.fail(
                f"guest crawls: {_CHUNK}-iteration loop chunks took {chunk_s * 1e3:.1f} ms ({label}), "
                f"{ns:.0f} ns per iteration (limit {MAX_NS_PER_ITERATION:g} ns; it runs natively at "
                f"~2.5 ns) while bare IO exits took {self.burst_us():.1f} us (median), so guest instructions "
                "are being emulated"
            )


def _run_guest(vcpu: int, run: mmap.mmap, mode: str, deadline: float) -> _ExitChecker:
    """KVM_RUN until HLT, checking every exit; returns the checker holding the timings."""
    checker = _ExitChecker(mode)
    perf = time.perf_counter
    ioctl = fcntl.ioctl
    try:
        while True:
            if time.monotonic() > deadline:
                raise checker.fail("guest did not finish before the deadline")
            t0 = perf()
            try:
                ioctl(vcpu, KVM_RUN, 0)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise checker.fail(f"KVM_RUN failed: {_strerror(exc)}") from None
            elapsed = perf() - t0
            reason = _RUN_REASON.unpack_from(run, 8)[0]
            if reason == _EXIT_HLT and checker.finished:
                break
            if reason == _EXIT_HLT:
                raise checker.fail("guest halted early")
            if reason != _EXIT_IO:
                raise checker.fail(f"unexpected {_describe_exit(reason, run)}")
            direction, size, port, count, offset = _RUN_IO.unpack_from(run, 32)
            if direction != _IO_OUT or size != 4 or count != 1 or offset + 4 > len(run):
                raise checker.fail(f"malformed IO exit dir={direction} size={size} count={count}")
            checker.io(port, _U32.unpack_from(run, offset)[0], elapsed)
    except _Deadline:
        raise checker.fail("no verdict in time: KVM_RUN still running at the deadline") from None
    checker.check_speed(_median(checker.chunk_times), "median")
    return checker


def _describe_exit(reason: int, run: mmap.mmap) -> str:
    name = _EXIT_NAMES.get(reason, f"exit reason {reason}")
    if reason == _EXIT_INTERNAL_ERROR:
        suberror, ndata, *data = _RUN_INTERNAL.unpack_from(run, 32)
        words = " ".join(f"{d:#x}" for d in data[: min(ndata, 4)])
        what = _INTERNAL_SUBERRORS.get(suberror, f"suberror {suberror}")
        return f"{name} ({what}{': ' + words if words else ''})"
    if reason == _EXIT_FAIL_ENTRY:
        hw_reason, cpu = _RUN_FAIL_ENTRY.unpack_from(run, 32)
        return f"{name} (hardware entry failure reason {hw_reason:#x} on cpu {cpu})"
    return name


def _child_main(argv: list[str]) -> int:
    # The signal mask survives exec: make sure the watchdog's SIGALRM can reach us.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    try:
        usable, detail = _probe_guests(Path(argv[0]), float(argv[1]))
    except _Deadline:  # the watchdog fired in the instant before _probe_guests disarmed it
        usable, detail = False, "KVM present but unusable: no verdict before the deadline"
    sys.stdout.write(json.dumps({"usable": usable, "detail": detail}) + "\n")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == [_CHILD_FLAG]:
    sys.exit(_child_main(sys.argv[2:]))
