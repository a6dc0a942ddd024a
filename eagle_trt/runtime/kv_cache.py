"""A KV cache for a batch of sequences, each with its own committed length.

Layout [L, B, Hkv, S, D] (head-major, the graphs' own: attention reads a layer's past in
place): sequence b owns slot b, its committed rows are 0..length[b]-1 in order (row index =
position), and a forward pass stages its new rows right after them. The
graph's new rows are held where the graph wrote them (`write` keeps a reference); after
verification `commit(rows)` copies each sequence's accepted rows straight into place (on the
CPU one numpy slice copy per run of rows, elsewhere one indexed copy per cache) and advances its
length (the rows a call rejects are never copied).
Sequences join (`add`) and leave (`remove`, which moves the last slot into the freed
one) between forward passes, so the live sequences always fill slots 0..B-1 and a batched call
binds one contiguous block. Rows grow in chunks when a sequence needs more (`reserve`).

A change of layout (more slots, more or fewer rows) copies only the committed rows, once. On
the CPU (numpy dtypes) it does so in place, inside the one storage, where every block moves the
same way (`_relayout_in_place`); elsewhere, and when the storage is too small, from one of two
storages into the other, which the layouts alternate between. A storage allocates only for a
larger layout than it holds (zeroed, half again as large as its last; on the CPU room for 4x
the layout, as address space that faults in only where layouts reach, and the old storage is
let go). Allocating and zeroing a new cache at each
change was most of the host work of a continuously batched run (8 streams: every join, every
chunk of rows and every fresh start copied the whole cache). Rows past a sequence's length
are masked but must be finite (a masked probability 0 times NaN is NaN): they hold zeros or
rows the graphs wrote earlier, never uninitialised memory.

in_place: the graph writes its new rows straight into the bound cache, right after each
sequence's committed rows (the fused-attention target graph, export/cpu_attention.py); `commit`
then moves the accepted rows down over the rejected ones inside the cache (host numpy caches
only), and `write` is given nothing."""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import Tensor

CHUNK = 64   # rows added at a time: a bound graph past is at most this much wider than needed
NUMPY_FLOATS = (torch.float32, torch.float16)   # the cache dtypes numpy has (not bfloat16)
_layout_ids = itertools.count()


def zeroed(numel: int, dtype: torch.dtype, device=None) -> Tensor:
    """A zeroed flat tensor. On the CPU its memory comes from calloc (through numpy), which takes
    large blocks from the OS already zeroed: nothing is written up front and pages fault in as
    rows are first used. torch.zeros writes every page at once: growing an 8-stream cache to
    ~100 MB that way took 5-460 ms of one join or step here (the first touch of fresh memory
    in a VM is slow), most of the batched loop's host time when it happened."""
    if torch.device(device or "cpu").type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(numel * itemsize, dtype=np.uint8)).view(dtype)


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = CHUNK,
                 dtype: torch.dtype = torch.float32, device=None, batch: int = 1, fixed: bool = False):
        """fixed: laid out once at `batch` slots of `capacity` rows and never again (no growth, no
        shrinking), so every address stays put: what a captured CUDA graph reads and writes
        (runtime/static.py). A sequence that does not fit is an error."""
        self.layout = (num_layers, kv_heads, head_dim)
        self.fixed = fixed
        self.dtype, self.device = dtype, device
        self.kv = self.k = self.v = self.kv_np = None   # kv [2, L, B, Hkv, S, D]; k, v = kv[0], kv[1]
        self.storages: list[Tensor | None] = [None, None]   # flat storages the layouts are views of, in turn
        self.active = 1                       # the storage the current layout is a view of
        self.owner = None                     # the backend that clears and reuses it (backend._new_cache)
        self.lengths: list[int] = []
        self._allocate(max(batch, 1), max(capacity, 1))
        self.staged = 0                       # rows staged per sequence by the last forward
        self.staged_slots = range(0)
        self.new_rows: Tensor | np.ndarray | None = None   # the last forward's K and V rows [2, L, b, Hkv, T, D]
        self.in_place = False                 # the graph stages its rows inside the cache (module docstring)

    def _allocate(self, batch: int, rows: int) -> None:
        """Lay the cache out as [L, batch, Hkv, rows, D], keeping every committed row: in place
        where the storage holds it (numpy caches, see _relayout_in_place), else in the other storage."""
        L, H, D = self.layout
        shape = (2, L, batch, H, rows, D)    # K and V in one block: a commit copies both at once
        b, s = min(batch, len(self.lengths)), min(rows, max(self.lengths, default=0))
        numel = math.prod(shape)
        current = self.storages[self.active]
        if self.kv_np is not None and current is not None and current.numel() >= numel and \
                self._relayout_in_place(shape, b, s):
            kv = current[:numel].view(shape)
        else:
            spare = 1 - self.active
            storage = self.storages[spare]
            if storage is None or storage.numel() < numel:
                # half again: the next chunks of rows fit without another one
                size = numel if storage is None else max(numel, storage.numel() * 3 // 2)
                self.storages[spare] = None      # let the old storage go before the new one is made
                self.storages[spare] = self._storage(numel, size)
            kv = self.storages[spare][:numel].view(shape)
            if b and s:
                kv[:, :, :b, :, :s] = self.kv[:, :, :b, :, :s]
            if self.kv_np is not None:           # numpy caches re-lay out in place: the old one is not needed
                self.storages[self.active] = None
            self.active = spare
        self.kv = kv
        self.shape = shape      # kv's shape as ints (binding by address reads it)
        self.k, self.v = kv[0], kv[1]
        self.capacity = rows    # rows per slot (an int kept: a tensor's shape costs ~5 us after a graph call)
        # the same memory as a numpy array, on the CPU where numpy has the dtype: a commit's slice
        # copies there cost a microsecond each, against 10-20 for a torch select / narrow / copy_
        # on caches the graph call has just flushed
        self.kv_np = kv.numpy() if kv.device.type == "cpu" and self.dtype in NUMPY_FLOATS else None
        self.layout_id = next(_layout_ids)   # unique to this layout: a binding of its memory is valid while it lasts

    def _relayout_in_place(self, shape: tuple, b: int, s: int) -> bool:
        """Move the committed rows (b slots, s rows) from the current layout to `shape` inside
        the same storage, when every block moves the same way: up when slots and rows grow (moved
        last block first), down when they shrink (first block first). A block then overlaps only
        its own old place and those of blocks already moved, so one numpy copy per layer's K or V
        (which copies through a temporary where it overlaps itself) is exact. A re-layout between
        two storages touches both (the layouts alternate): on a VM each first touch of memory
        costs 1-3 ms per MB, which the second storage paid once per growing layout. False: the
        move goes neither way (the caller uses the other storage)."""
        old = self.kv_np.shape
        if not b or not s:
            return True
        up = shape[2] >= old[2] and shape[4] >= old[4]
        if not up and not (shape[2] <= old[2] and shape[4] <= old[4]):
            return False
        new = self.storages[self.active][:math.prod(shape)].numpy().reshape(shape)
        groups = [(k, layer) for k in range(2) for layer in range(shape[1])]
        for k, layer in (reversed(groups) if up else groups):
            new[k, layer, :b, :, :s] = self.kv_np[k, layer, :b, :, :s]
        return True

    def _storage(self, numel: int, size: int) -> Tensor:
        """A new storage of `size` elements; on the CPU, room for layouts 4x this one's `numel`
        where the system gives that much address space: calloc memory costs nothing until a
        layout reaches it, so the cache grows without storages made and faulted in again (each
        new one faults in every page its first layout copies into: ~1 ms per MB on this VM)."""
        if torch.device(self.device or "cpu").type == "cpu" and size < 4 * numel:
            try:
                return zeroed(4 * numel, self.dtype, self.device)
            except (MemoryError, RuntimeError):     # more than the system commits to: what is needed
                pass
        return zeroed(size, self.dtype, self.device)

    def clear(self, capacity: int = CHUNK) -> None:
        """Drop every sequence; the storages stay for the next ones (no copy, no allocation
        while they are big enough)."""
        self.lengths = []
        self.staged, self.staged_slots, self.new_rows = 0, range(0), None
        if not self.fixed:
            self._allocate(self.k.shape[1], max(capacity, 1))

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def add(self, rows: int = 0) -> int:
        """A new empty sequence in the next slot, with room for `rows` rows; returns its slot."""
        if self.batch == self.k.shape[1]:     # slots double: a ramp-up of B sequences re-lays out log2(B) times
            if self.fixed:
                raise ValueError(f"all {self.batch} slots of this fixed-layout cache are taken")
            self._allocate(2 * self.batch, self.capacity)
        self.lengths.append(0)
        self.reserve(range(self.batch - 1, self.batch), rows)
        return self.batch - 1

    def take(self, other: KVCache, slot: int = 0) -> int:
        """A new sequence in the next slot holding the committed rows of `other`'s sequence `slot`
        (same layout); returns its slot."""
        n = other.lengths[slot]
        new = self.add(n)
        self.kv[:, :, new, :, :n] = other.kv[:, :, slot, :, :n].to(self.kv.device)
        self.lengths[new] = n
        return new

    def remove(self, slot: int) -> None:
        """Drop sequence `slot`; the last sequence moves into its slot (its new index is `slot`)."""
        last = self.batch - 1
        if slot != last:
            n = self.lengths[last]
            self.kv[:, :, slot, :, :n] = self.kv[:, :, last, :, :n]
            self.lengths[slot] = n
        self.lengths.pop()
        keep = -(-(max(self.lengths, default=0) + 1) // CHUNK) * CHUNK
        if self.capacity > keep + 2 * CHUNK and not self.fixed:   # a long sequence left: stop binding its rows for the others
            self._allocate(self.k.shape[1], keep)

    def reserve(self, slots: range, rows: int) -> None:
        """Make room for `rows` more rows after each sequence's committed ones."""
        need = max((self.lengths[b] for b in slots), default=0) + rows
        if need > self.capacity and self.fixed:
            raise ValueError(f"{need} rows do not fit this fixed-layout cache's {self.capacity} rows a slot")
        if need > self.capacity:
            self._allocate(self.k.shape[1], -(-need // CHUNK) * CHUNK)

    def stage(self, slots: range, T: int) -> None:
        """Reserve T rows after the committed ones of each sequence in `slots` for a forward pass."""
        self.reserve(slots, T)
        self.staged, self.staged_slots = T, slots

    def past(self, slots: range, width: int, layer: int) -> tuple[Tensor, Tensor]:
        """The first `width` rows of each sequence in `slots`: a [b, Hkv, width, D] view, contiguous
        when width is the capacity."""
        return self.k[layer, slots.start:slots.stop, :, :width], self.v[layer, slots.start:slots.stop, :, :width]

    def write(self, new_k: list[Tensor] | Tensor, new_v: list[Tensor] | Tensor | None = None) -> None:
        """The staged rows ([b, Hkv, T, D] per layer, or all layers as one [L, b, Hkv, T, D]
        tensor; new_v None: new_k is K and V as one [2, L, b, Hkv, T, D] block, as the graph
        backends' staging buffers are, or that block's numpy view on the CPU), kept as they are
        until `commit` copies the accepted ones into place: the caller must not overwrite them
        before it commits (the backends' staging buffers are rewritten only by their next call)."""
        if new_v is None:
            self.new_rows = new_k
        else:
            self.new_rows = torch.stack([new if isinstance(new, Tensor) else torch.stack(new) for new in (new_k, new_v)])

    def _flat(self, rows: list[int]) -> Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.k.device)

    def commit(self, rows: list[list[int]]) -> None:
        """Keep staged rows rows[i] (increasing indices into the last forward's T rows) of the i-th
        staged sequence as its next committed rows: copied from the written rows to right after
        its committed ones."""
        slots = self.staged_slots
        if len(rows) != len(slots):
            raise ValueError(f"commit got rows for {len(rows)} sequences, {len(slots)} were staged")
        if any(seq and not 0 <= min(seq) <= max(seq) < self.staged for seq in rows):   # every row, in C
            raise IndexError(f"commit rows {rows} outside the {self.staged} staged rows")
        new = None if self.in_place else self.new_rows
        if self.in_place and self.kv_np is None:
            raise RuntimeError("an in-place KV cache commits through numpy: a host cache of float32 or float16")
        if new is None and not self.in_place:
            raise RuntimeError("commit without the staged rows: the forward pass did not write its new KV rows")
        on_cpu = self.in_place or isinstance(new, np.ndarray) or (new.device.type == "cpu" and new.dtype == self.dtype)
        if self.kv_np is not None and on_cpu:
            # on the CPU: one numpy slice copy per run of consecutive rows (K and V of every
            # layer at once), ~1 us each; torch's indexed copies cost 10-100x that here. In
            # place, the staged rows are the cache's own after the committed ones: a run moves
            # down at most its own offset, a copy that may overlap itself (numpy copies it
            # through a temporary), and a run already in place is not copied
            new_np = None if self.in_place else np.asarray(new)
            for i, (b, seq) in enumerate(zip(slots, rows)):
                at, kv_np = self.lengths[b], self.kv_np[:, :, b]
                new_b = kv_np[:, :, :, at:] if self.in_place else new_np[:, :, i]   # [2, L, Hkv, rows, D]
                for j, r in _runs(seq):
                    if not (self.in_place and r[0] == j):
                        kv_np[:, :, :, at + j:at + j + len(r)] = new_b[:, :, :, r[0]:r[0] + len(r)]
        elif len(slots) == 1 and 0 < len(runs := _runs(rows[0])) <= 4:
            # one sequence, a few runs of rows (a prefill is one): slice copies, no index tensors
            b, at = slots.start, self.lengths[slots.start]
            kv, new = self.kv.select(2, b), new.select(2, 0)   # [2, L, Hkv, rows, D]; select / narrow: cheaper than [...]
            for j, r in runs:                        # consecutive rows of K and V go in one copy
                kv.narrow(3, at + j, len(r)).copy_(new.narrow(3, r[0], len(r)))
        elif any(rows):   # rows of (slot, head, row) flattened: index_select / index_copy_, 2x an indexed assignment
            _, L, _, H, S, D = self.kv.shape
            T = new.shape[4]
            heads = torch.arange(H, device=self.kv.device)[None]
            src = self._flat([i * H * T + r for i, seq in enumerate(rows) for r in seq])[:, None] + heads * T
            dst = self._flat([b * H * S + self.lengths[b] + j for b, seq in zip(slots, rows)
                              for j in range(len(seq))])[:, None] + heads * S
            kept = new.to(self.kv.device).reshape(2 * L, -1, D).index_select(1, src.view(-1))
            self.kv.view(2 * L, -1, D).index_copy_(1, dst.view(-1), kept)
        for b, r in zip(slots, rows):
            self.lengths[b] += len(r)
        self.staged, self.staged_slots, self.new_rows = 0, range(0), None


def _runs(rows: list[int]) -> list[tuple[int, list[int]]]:
    """Split increasing row indices into runs of consecutive ones: (offset in rows, the run)."""
    runs: list[tuple[int, list[int]]] = []
    for j, r in enumerate(rows):
        if runs and r == runs[-1][1][-1] + 1:
            runs[-1][1].append(r)
        else:
            runs.append((j, [r]))
    return runs
