"""Ranks keep the host memory they free, as torch's CUDA caching allocator keeps GPU memory.

A training step frees and allocates the same large tensors every step: activations, gradient
buckets, the optimizer's temporaries (Adam's `sqrt(v)` and the division after it, over a whole
flat shard). glibc's malloc serves a block above its mmap threshold (128 KiB at first, rising
with the blocks freed, up to 32 MiB) straight from the kernel and unmaps it when it is freed,
and gives back free memory at the top of its heap beyond the trim threshold. So the next step
asks the kernel for the same pages again, and each first touch is a page fault that zeroes a
4 KiB page. On a GPU, torch's caching allocator keeps freed blocks for the next step; here
`keep_freed_memory()` asks glibc to do the same: every block from the heap (no mmap), and no
trimming, so that a freed block stays in the process for the next one to reuse.

Measured with `python -m zerolab.bench --pairs --steps 10 --no-measure` (the course GPT, 2
ranks, each stage in its own launch with its torch counterpart), page faults per step on the
busier rank, glibc's defaults (ZEROLAB_KEEP_FREED_MEMORY=0) -> kept, two runs of each: zerolab
DDP 7,444-8,672 -> 1, ZeRO-1 4,508-12,986 -> 0, ZeRO-2 6,708-6,964 -> 1-2, ZeRO-3 250-3,101 ->
1-2; torch DDP 1-7,648 -> 0, DDP + ZeroRedundancyOptimizer 0-1 -> 0, FSDP2 18,610-21,110 ->
402-4,106 (with the mmap threshold raised to 32 MiB instead of no mmap at all: the same, but
GPT-2 small's 154 MB embedding still cost ~188,000 faults a step). Which engine pays, and how
much, depends on the allocator's history (the sizes freed so far), not on the algorithm. Step
times of two runs cannot be compared on this shared machine (they drift by a fifth), but the
paired ratios can: in the later two runs, DDP 1.030 -> 1.006, ZeRO-1 1.059 -> 1.010, ZeRO-2
1.047 -> 1.026 of their counterparts, each within its run's interval, and ZeRO-3 0.751 ->
0.783 of FSDP2, outside it (FSDP2 lost the most faults). Memory measurements do not change:
zerolab counts live tensors, not resident pages; a rank's resident memory stays at its
high-water mark instead.

`zerolab.launch` applies it in every rank, `init_from_env` in a process torchrun started.
ZEROLAB_KEEP_FREED_MEMORY=0 in the environment leaves glibc's defaults (to measure the
difference). Elsewhere (not Linux, not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1  # free memory at the top of the heap beyond this goes back to the kernel
M_MMAP_MAX = -4  # how many blocks may come from mmap at once (0: none; glibc still falls back
#                  to mmap where the heap cannot grow, and for threads' own arenas)
NEVER_TRIM = 2**31 - 1  # the largest value an int parameter takes: 2 GiB of slack kept
SWITCH = "ZEROLAB_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse in this process. True if it accepted."""
    if os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; absent from some other C libraries
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on error. (Setting the trim threshold also stops glibc
    # from moving its thresholds by itself.)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
