"""The batched KV cache (runtime/kv_cache.py): slots in a head-major layout, compaction of the
accepted rows, slot moves when a sequence leaves, and re-layouts (more slots, more rows, fewer
rows) in place inside one storage or between two, every row where it belongs afterwards."""
from __future__ import annotations

import pytest
import torch

from eagle_trt.runtime.kv_cache import CHUNK, KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_slots_compaction_and_moves(dtype):
    # float32: the commits' numpy slice copies; bfloat16 (no numpy dtype): the torch paths a GPU takes
    cache = KVCache(2, 2, 1, capacity=4, dtype=dtype)             # 2 layers, 2 KV heads: [L, B, Hkv, S, D]
    assert (cache.kv_np is None) == (dtype == torch.bfloat16)
    for _ in range(3):
        cache.add()
    cache.stage(range(3), 3)
    rows = torch.arange(3 * 3, dtype=dtype).reshape(3, 1, 3, 1) + 1   # sequence b, row t: 3b + t + 1
    rows = torch.cat((rows, -rows), 1)                            # head 1 holds the negated rows
    cache.write([rows, rows * 10], [rows, rows])
    cache.commit([[0, 2], [0, 1, 2], [1]])
    assert cache.lengths == [2, 3, 1]
    assert cache.k[0, 0, 0, :2, 0].tolist() == [1, 3]             # row 2 compacted into place
    assert cache.k[0, 0, 1, :2, 0].tolist() == [-1, -3]           # in every head
    assert cache.k[1, 2, :, :1, 0].tolist() == [[80], [-80]]      # sequence 2 kept only its row 1
    cache.remove(0)                                               # the last sequence moves into slot 0
    assert cache.lengths == [1, 3] and cache.k[0, 0, :, :1, 0].tolist() == [[8], [-8]]
    cache.stage(range(1, 2), 70)                                  # grows in chunks, keeps the rows
    assert cache.capacity == 2 * CHUNK and cache.k[0, 1, 1, :3, 0].tolist() == [-4, -5, -6]
    with pytest.raises(IndexError, match="outside the 70 staged rows"):
        cache.commit([[70]])
    cache.stage(range(1, 2), 2)                                   # one sequence, a run of rows: the slice path
    cache.write([rows[1:2]] * 2, [rows[1:2]] * 2)
    cache.commit([[0, 1]])
    assert cache.k[0, 1, 1, :5, 0].tolist() == [-4, -5, -6, -4, -5]
    cache.stage(range(1, 2), 3)                                   # rows that skip one: a copy per run
    cache.write([rows[1:2]] * 2, [rows[1:2]] * 2)
    cache.commit([[0, 2]])
    assert cache.k[0, 1, 1, :7, 0].tolist() == [-4, -5, -6, -4, -5, -4, -6] and cache.lengths == [1, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_relayouts_reuse_storage_and_keep_rows(dtype):
    # float32: re-layouts in place inside one storage (numpy); bfloat16: between two storages in turn
    cache = KVCache(2, 2, 1, capacity=4, dtype=dtype)
    for b in range(5):                                             # slots double: 1 -> 2 -> 4 -> 8
        cache.add()
        cache.stage(range(b, b + 1), 2)
        cache.write([torch.full((1, 2, 2, 1), b + 1.0, dtype=dtype)] * 2, [torch.full((1, 2, 2, 1), -b - 1.0, dtype=dtype)] * 2)
        cache.commit([[0, 1]])
    assert cache.k.shape[1] == 8 and cache.lengths == [2] * 5
    cache.stage(range(4, 5), 3 * CHUNK)                            # more rows: a larger layout, zeroed
    assert cache.storages[cache.active].numel() >= cache.kv.numel() == 2 * cache.k.numel()
    assert cache.capacity == 4 * CHUNK
    assert cache.k[:, :5, :, :2, 0].tolist() == [[[[b + 1.0] * 2] * 2 for b in range(5)]] * 2
    assert cache.v[1, 3, 0, :3, 0].tolist() == [-4, -4, 0]
    cache.remove(0)                                                # no more rows needed: the layout shrinks
    cache.remove(0)
    cache.remove(0)
    assert cache.capacity == CHUNK
    assert cache.lengths == [2, 2] and cache.k[0, :2, 1, :2, 0].tolist() == [[3, 3], [2, 2]]   # each removal moved the last in
    assert cache.v[:, :2, 0, :2, 0].tolist() == [[[-3, -3], [-2, -2]]] * 2
    cache.clear()                                                  # a fresh start keeps the storages
    assert cache.lengths == [] and cache.k.shape[1] == 8
    assert all(torch.isfinite(t).all() for t in cache.storages if t is not None)
    cache.add()
    grown = None
    in_place = dtype == torch.float32
    for _ in range(3):       # once the storages are big enough, no allocation
        before = cache.active
        cache.reserve(range(0, 1), 4 * CHUNK)                      # a larger layout
        assert (cache.active == before) == in_place and cache.capacity == 4 * CHUNK
        cache.remove(0)                                            # and back
        cache.add()
        assert cache.active == before and cache.capacity == CHUNK
        assert grown is None or all(a is b for a, b in zip(cache.storages, grown))
        grown = list(cache.storages)
    assert (cache.storages[1 - cache.active] is None) == in_place  # in place: one storage


def test_kv_cache_relayout_in_place_moves_every_row():
    """Growing and shrinking inside one storage: more rows, then fewer, each row of each slot,
    layer and head where it belongs afterwards (blocks overlap their old places; more slots in
    place: the test above)."""
    cache = KVCache(3, 2, 2, capacity=CHUNK, batch=2)              # room for 4x the first layout
    storage = cache.storages[cache.active]
    for b in range(2):
        cache.add()

    def expected(b, n):    # [2, L, Hkv, n, D]: distinct values per K/V, layer, slot, head, row and dim
        k = torch.arange(2 * 3 * 2 * n * 2, dtype=torch.float32).reshape(2, 3, 2, n, 2)
        return k * 10 + 1000 * (b + 1)
    for b, n in enumerate((40, 23)):
        cache.stage(range(b, b + 1), n)
        cache.write(expected(b, n)[:, :, None])
        cache.commit([list(range(n))])
    cache.reserve(range(0, 1), 3 * CHUNK)                          # 64 -> 256 rows: blocks move up
    assert cache.storages[cache.active] is storage and cache.capacity == 4 * CHUNK
    for b, n in enumerate((40, 23)):
        assert torch.equal(cache.kv[:, :, b, :, :n], expected(b, n))
    cache.lengths[0] = 20                                          # rows beyond are dropped by a shrink
    cache.remove(1)
    assert cache.storages[cache.active] is storage and cache.capacity == CHUNK   # 256 -> 64 rows: down
    assert torch.equal(cache.kv[:, :, 0, :, :20], expected(0, 40)[:, :, :, :20])
    assert torch.isfinite(cache.kv).all()
