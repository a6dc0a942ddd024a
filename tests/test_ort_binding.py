"""ONNX Runtime's bound buffers (runtime/ort_binding.py, OrtTarget.verify): inputs bound again
before each call where a bind copies them (the CUDA provider's way, made on the CPU provider),
KV caches committed by torch as a GPU's are, and the inputs OrtTarget.verify writes in place
equal to those the general path builds."""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import torch
from conftest import TINY_SHAPE, on_graph, tiny_backends, two_call

from eagle_trt.runtime import kv_cache
from eagle_trt.runtime.backend import TargetBackend, TorchTarget
from eagle_trt.runtime.loop import Request
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from eagle_trt.runtime.ort_binding import Binding

SHAPE = TINY_SHAPE


def test_inputs_are_bound_again_before_each_call_where_the_bind_copies_them(tiny_graphs, tiny_iteration_graph, monkeypatch):
    """With a device provider (CUDA), ONNX Runtime copies a bound input to the device when it is
    bound (IOBinding::BindInput), so a graph bound once reads its host buffers as they were at
    the bind. Here each input bind on the CPU provider reads a copy of the host memory taken at
    the bind, as that copy would: bound once, decoding goes wrong; binding every input again
    before each call (what Binding does for device providers) decodes the target's own
    greedy tokens, with two graph calls an iteration and with one; so does it with the KV caches
    committed by torch as on a GPU (kv_device cuda keeps them there, read where they are)."""
    target_model, _, _, prompts = tiny_graphs
    prompts = prompts[:4]
    plain = two_call(TorchTarget(target_model.model))
    refs = [plain.generate(p, 20).tokens for p in prompts]
    bind = Binding._bind

    def bind_a_copy(self, name, dtype, shape, address, output, where=("cpu", 0)):
        if not output:
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            copy = torch.empty(max(size, 1), dtype=torch.uint8)
            ctypes.memmove(copy.data_ptr(), address, size)
            self.__dict__.setdefault("copies", {})[name] = copy
            address = copy.data_ptr()
        bind(self, name, dtype, shape, address, output, where)
    monkeypatch.setattr(Binding, "_bind", bind_a_copy)
    tokens = {}
    for rebind, one_call in itertools.product((False, True), (False, True)):
        monkeypatch.setattr(Binding, "always_rebind", rebind)
        target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
        decoder = on_graph(OrtIteration(tiny_iteration_graph, target, drafter)) if one_call else two_call(target, drafter)
        try:
            results = decoder.generate_batch(
                [Request(p, 20) for p in prompts], max_batch=4)
            tokens[rebind, one_call] = [r.tokens for r in results]
        except (IndexError, ValueError, RuntimeError) as exc:     # stale lengths can break the bookkeeping
            tokens[rebind, one_call] = repr(exc)
    assert tokens[True, False] == refs and tokens[True, True] == refs
    assert tokens[False, False] != refs and tokens[False, True] != refs
    # the caches as a GPU holds them (kv_device cuda): no numpy view, the new rows staged as
    # tensors and committed by torch's indexed copies, as on the device
    monkeypatch.setattr(kv_cache, "NUMPY_FLOATS", ())
    for one_call in (False, True):
        target, drafter = tiny_backends(tiny_graphs, "onnxruntime")
        decoder = on_graph(OrtIteration(tiny_iteration_graph, target, drafter)) if one_call else two_call(target, drafter)
        results = decoder.generate_batch(
            [Request(p, 20) for p in prompts], max_batch=4)
        assert target.cache.kv_np is None and not isinstance(target.bindings.entries[next(iter(
            target.bindings.entries))].staged, np.ndarray)
        assert [r.tokens for r in results] == refs
    monkeypatch.setattr(Binding, "always_rebind", False)
    assert not Binding(target.session).rebind         # the CPU provider reads the host memory itself


def test_ort_verify_writes_the_inputs_the_general_path_builds(tiny_graphs):
    """OrtTarget.verify writes ids, positions and mask straight into its bound buffers (numpy);
    TargetBackend.verify builds them as tensors and goes through forward. Same outputs, for full
    trees, the cost model's subtrees and plain steps, over sequences of different lengths; and
    the same accepted rows' states from OrtTarget.keep_states (numpy) as from the tensor gather."""
    target_model, _, graphs, prompts = tiny_graphs
    fast, general = (OrtTarget(graphs["target"], target_model.config.max_position_embeddings) for _ in range(2))
    drafter = OrtDrafter(graphs["drafter_tree"], SHAPE)
    for backend in (fast, general, drafter):
        backend.reset()

    def prefill(p):
        for backend in (fast, general):
            slot = backend.add_sequence()
            backend.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.ones(len(p), len(p)).tril().bool()[None],
                            range(slot, slot + 1), last_only=True)
            backend.commit([list(range(len(p)))])

    for p in prompts[:3]:
        prefill(p)
        drafter.add_sequence()
    states = torch.randn(3, 2, drafter.captured_width, generator=torch.Generator().manual_seed(0))
    trees = drafter.draft(states, [[5, 6], [7, 8], [9, 10]])
    roots = [11, 12, 13]
    # each call shape twice: its mask buffer written whole, then only where lengths moved; a
    # sequence leaving and a shorter one joining in between moves a slot's length back
    for rnd in range(2):
        for tree in (trees, trees.top(3), None):
            got = fast.verify(roots, tree)
            want = TargetBackend.verify(general, roots, tree)
            for name in ("logits", "captured", "ids", "mask"):
                a, b = getattr(got, name), getattr(want, name)
                assert torch.equal(a, b.to(a.dtype)), (rnd, name)
            # the accepted rows' states: numpy slices / fancy indexing against the tensor gather
            paths = [[0, 2], [0, 1], [0]] if tree is not None and tree.size > 2 else [[0]] * 3
            for kept, gathered in zip(fast.keep_states(got, paths), TargetBackend.keep_states(general, want, paths)):
                assert torch.equal(torch.from_numpy(kept), gathered)
            rows = [[0], [0, 1], [0]] if tree is not None else [[0]] * 3
            fast.commit(rows)
            general.commit(rows)
        for backend in (fast, general):
            backend.remove_sequence(0)
        prefill(prompts[3][:5])
    assert fast.lengths == general.lengths
    assert torch.equal(fast.cache.k[:, :3, :, :max(fast.lengths)], general.cache.k[:, :3, :, :max(general.lengths)])
