"""The sessions' weights in 2 MB pages (Linux transparent huge pages) instead of 4 KB ones.

A CPU decoding step streams every weight once (SmolLM2: ~540 MB a token). ONNX Runtime holds its
weights in anonymous memory (its reordered Conv filters, its prepacked GEMM panels), which under
the common transparent_hugepage setting `madvise` stays in 4 KB pages unless asked: a TLB miss
every 4 KB, and the hardware prefetchers stop at each page's end. llama.cpp's weights are a
memory-mapped GGUF, which the page cache of ext4 / xfs partly backs with large folios (on the
2-core EPYC, 184 of the f32 file's 525 MB were PMD-mapped), so it gets some of that for free.

`collapse_filled_memory()` runs after each decoding CPU session is made (runtime/sessions.py; not
for the sessions that only check a graph): in this process's anonymous regions of at least
MIN_REGION, each 2 MB range whose 4 KB pages are at least FULL present (/proc/self/pagemap; so no
reserved-but-unused arena or thread stack is filled in, even where the kernel merged it with its
neighbours into one region) is marked MADV_HUGEPAGE and collapsed with MADV_COLLAPSE (Linux 6.1+; it
works whatever the `enabled` setting, short of `never`). The whole process, not only the regions the
session added: its weights may land in memory the process had freed (in a bench run right after an
export, those regions held 0.11 of the sessions' ~0.7 GB). The first call pays ~2.5 s per GB of
filled memory, later ones only for what was filled since: a range already in 2 MB pages costs the
kernel next to nothing.

On the 2-core AVX-512 EPYC (2026-11-29, SmolLM2's fused fp32 graph, one process, two sessions'
calls taking turns, `python scripts/huge_pages_ab.py`): a one-token call 2-5% faster, a
five-token one 0-4%. Nothing changes in what the graphs compute.

Off with EAGLE_TRT_HUGE_PAGES=0. Elsewhere than Linux, where /proc cannot be read or where the
kernel refuses, nothing is done and the pages stay as they were: never an error."""
from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 2 << 20
PAGE = 4096
MIN_REGION = 8 << 20      # weights come in regions of tens to hundreds of MB
FULL = 0.9                # present share of a 2 MB range's pages it needs: collapsing fills its holes
SWITCH = "EAGLE_TRT_HUGE_PAGES"


@dataclass
class Collapsed:
    """What collapse_filled_memory did in this process so far: the 2 MB ranges (their starts) it
    collapsed and those the kernel would not collapse (each call sees every range again)."""
    done: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return len(self.done) * HUGE_PAGE

    @property
    def refused_bytes(self) -> int:
        return len(self.refused) * HUGE_PAGE


COLLAPSED = Collapsed()


def enabled() -> bool:
    if os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux") or \
            os.sysconf("SC_PAGE_SIZE") != PAGE:
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _anonymous_regions() -> set[tuple[int, int]]:
    """(start, end) of this process's private writable anonymous regions."""
    regions = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            if fields[1].startswith("rw") and fields[1].endswith("p") and path in ("", "[heap]"):
                regions.add(tuple(int(x, 16) for x in fields[0].split("-")))
    return regions


def _full_ranges(lo: int, hi: int, pagemap: int) -> list[tuple[int, int]]:
    """The runs of 2 MB ranges within [lo, hi) whose pages are at least FULL present."""
    a, b = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
    if b - a < HUGE_PAGE:
        return []
    entries = np.frombuffer(os.pread(pagemap, (b - a) // PAGE * 8, a // PAGE * 8), np.uint64)
    present = ((entries >> np.uint64(63)) & np.uint64(1)).reshape(-1, HUGE_PAGE // PAGE)
    full = np.concatenate([[False], present.mean(axis=1) >= FULL, [False]])
    edges = np.flatnonzero(full[1:] != full[:-1])          # starts and ends of the runs, alternating
    return [(a + int(s) * HUGE_PAGE, a + int(e) * HUGE_PAGE) for s, e in zip(edges[::2], edges[1::2])]


def _collapse(regions: set[tuple[int, int]]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = time.perf_counter()
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for lo, hi in regions:
            if hi - lo < MIN_REGION:
                continue
            for a, b in _full_ranges(lo, hi, pagemap):
                libc.madvise(a, b - a, MADV_HUGEPAGE)        # later faults there get huge pages too
                chunks = set(range(a, b, HUGE_PAGE))         # (an already huge one costs the kernel nothing)
                if libc.madvise(a, b - a, MADV_COLLAPSE) == 0:
                    COLLAPSED.done |= chunks
                    COLLAPSED.refused -= chunks
                else:
                    COLLAPSED.refused |= chunks - COLLAPSED.done
    finally:
        os.close(pagemap)
    COLLAPSED.seconds += time.perf_counter() - start


def collapse_filled_memory() -> None:
    """Every filled 2 MB range of this process's anonymous memory into a 2 MB page (the module
    docstring)."""
    if not enabled():
        return
    try:
        _collapse(_anonymous_regions())
    except OSError:                 # /proc unreadable: leave the pages as they are
        pass


def summary() -> str:
    """One line on what was collapsed, for bench's report."""
    if not enabled():
        return f"weights in 4 KB pages ({SWITCH}=0, not Linux, or transparent huge pages 'never')"
    line = f"{COLLAPSED.bytes / 2**30:.2f} GB of filled memory (the sessions' weights among it) collapsed into 2 MB pages in {COLLAPSED.seconds:.1f} s"
    return line + (f" ({COLLAPSED.refused_bytes / 2**30:.2f} GB refused by the kernel)" if COLLAPSED.refused else "")
