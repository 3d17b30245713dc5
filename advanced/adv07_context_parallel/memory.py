"""Peak memory of one process over one region of code, from the kernel's own accounting.

A CPU has no `torch.cuda.max_memory_allocated`. Linux keeps, per process, the high-water mark of
its resident memory (VmHWM in /proc/self/status), and writing "5" to /proc/self/clear_refs
resets that mark to the current size. So:

    before = rss_bytes(); reset_peak()
    ... the prefill ...
    extra = peak_bytes() - before     # the most memory the prefill held at once, beyond what
                                      # was resident before: activations, K/V written, workspaces

Pages count once they are touched: a pool allocated with zeros is (mostly) not resident until
K/V are written into it, so rank 0's figure includes the K/V the prefill writes.

One trap: memory freed by an earlier prefill stays in the C allocator's heap, resident, and is
handed out again without the resident size growing, so a second measurement would read ~0.
`exact_rss()` makes every allocation of 64 KiB or more its own mmap, returned to the kernel the
moment it is freed (glibc's mallopt(M_MMAP_THRESHOLD); a fixed threshold also stops glibc from
raising it by itself). Each large tensor then costs a few page faults, a small price in a
benchmark and the reason it is an option. Where the file
cannot be written (not Linux, a locked-down container) `reset_peak` returns False and the
caller reports no figure rather than a wrong one.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3    # glibc's mallopt parameter number


def exact_rss(threshold: int = 64 * 1024) -> bool:
    """Large allocations straight from (and back to) the kernel; False where not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMeter:
    """with PeakMeter() as m: ...; m.extra -> bytes above the starting resident size (or None)."""

    def __enter__(self) -> "PeakMeter":
        self.before, self.ok, self.extra = rss_bytes(), reset_peak(), None
        return self

    def __exit__(self, *exc) -> None:
        peak = peak_bytes()
        if self.ok and peak is not None and self.before is not None:
            self.extra = max(0, peak - self.before)
