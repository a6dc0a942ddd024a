"""runtime/huge_pages.py: the process's filled memory is collapsed into 2 MB pages and keeps its
bytes, memory it only maps is left alone, EAGLE_TRT_HUGE_PAGES=0 turns it off, an unreadable /proc
is no error; make_session runs it after making a CPU session."""
from __future__ import annotations

import pytest

from eagle_trt.runtime import huge_pages


def _fresh(mb: int, fill: bool):
    """A new private anonymous mapping of `mb` MB (never memory some earlier test used), written
    through if `fill`; with its address."""
    import ctypes
    import mmap
    region = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if fill:
        region.write(b"\1" * len(region))
    return region, ctypes.addressof(ctypes.c_char.from_buffer(region))


def _huge_kb(address: int, size: int) -> int:
    """AnonHugePages of the region holding the middle of [address, address + size) (madvise splits
    off a mapping's unaligned ends as regions of their own)."""
    middle = address + size // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= middle < hi
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1])
    raise AssertionError("the mapping is not in /proc/self/smaps")


needs_thp = pytest.mark.skipif(not huge_pages.enabled(), reason=huge_pages.summary())


def _kernel_collapses() -> bool:
    """Whether this kernel takes MADV_COLLAPSE (Linux 6.1+) on a filled 2 MB range of our own."""
    import ctypes
    import mmap
    region = mmap.mmap(-1, 3 * huge_pages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * len(region))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % huge_pages.HUGE_PAGE
    try:
        region.madvise(huge_pages.MADV_COLLAPSE, offset, huge_pages.HUGE_PAGE)
        return True
    except OSError:
        return False


@needs_thp
def test_filled_memory_is_collapsed_reserved_memory_is_not(monkeypatch):
    monkeypatch.setattr(huge_pages, "COLLAPSED", huge_pages.Collapsed())
    if not _kernel_collapses():
        pytest.skip("this kernel refuses MADV_COLLAPSE (Linux 6.1+)")
    reserved, at = _fresh(48, fill=False)               # mapped, never touched
    filled, address = _fresh(48, fill=True)             # (the kernel may merge the two into one region)
    huge_pages.collapse_filled_memory()
    assert _huge_kb(address, len(filled)) >= 40 << 10
    assert _huge_kb(at, len(reserved)) == 0           # collapsing would have filled it in
    assert filled[:] == b"\1" * len(filled)          # the same bytes, now in other pages
    assert "collapsed into 2 MB pages" in huge_pages.summary()


@needs_thp
def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(huge_pages, "COLLAPSED", huge_pages.Collapsed())
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    filled, address = _fresh(48, fill=True)
    huge_pages.collapse_filled_memory()
    assert huge_pages.COLLAPSED.bytes == 0 and _huge_kb(address, len(filled)) == 0
    assert huge_pages.SWITCH in huge_pages.summary()


@needs_thp
def test_a_cpu_session_collapses_what_it_allocates(tiny_graphs, monkeypatch):
    """make_session collapses after making a CPU session, unless told not to (a tiny graph's
    weights are too small to see: the call is what is checked here)."""
    from eagle_trt.runtime.sessions import make_session
    calls = []
    real = huge_pages._collapse
    monkeypatch.setattr(huge_pages, "_collapse", lambda regions: (calls.append(regions), real(regions)))
    make_session(tiny_graphs[2]["target"], 1)
    assert len(calls) == 1
    make_session(tiny_graphs[2]["target"], 1, huge_pages=False)      # a session that only checks a graph
    assert len(calls) == 1


def test_an_unreadable_proc_leaves_the_pages_alone(monkeypatch):
    """Where /proc cannot be read (a locked-down container), sessions are made as before."""
    def unreadable():
        raise PermissionError("/proc/self/maps")
    monkeypatch.setattr(huge_pages, "_anonymous_regions", unreadable)
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    huge_pages.collapse_filled_memory()
