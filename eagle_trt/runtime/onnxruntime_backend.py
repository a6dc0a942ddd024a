"""ONNX Runtime backend: the exported target graph (greedy acceptance at its end) and the
drafter graph with the tree baked in, two graph calls per iteration.

Host work is kept small: the KV caches are torch tensors in the graphs' own [B, Hkv, S, D]
layout, bound as the `past` inputs through zero-copy numpy views; the graph writes its new
rows into a preallocated staging tensor, from which the commit copies only the accepted rows
into place (one indexed copy per cache). Those bindings (4L for the target, 4 for the drafter)
are made once per call shape and kept (`Bindings`, runtime/ort_binding.py): the past is bound
at the cache's full capacity, so the shape changes only when the cache grows. The call's other
inputs and outputs are preallocated tensors of the same binding, bound by address: a call
copies its few small inputs into place and reads its outputs where the graph wrote them (valid
until the next call of the same shape), so it makes no bindings and allocates nothing. On ONNX
Runtime's CUDA provider the caches and the logits live on the GPU (`kv_device_for`)."""
from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..config import TreeShape
from ..graph_names import (ACCEPT_OUTPUTS, DRAFT_TREE_OUTPUTS, DRAFTER_KV_NAMES, HANDOFF, LOSSLESS_TREES,
                           PADS_ONE_ROW, PREFIX, VERIFY_NODES, kv_heads_and_dim, target_kv_names)
from .backend import DrafterBackend, KeptRows, TargetBackend, Verification, logits_rows
from .kv_cache import CHUNK
from .ort_binding import Bindings, Bound
from .sessions import make_session

TORCH_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}
ONNX_TORCH_DTYPES = {**TORCH_DTYPES, "tensor(int64)": torch.int64, "tensor(bool)": torch.bool}


class _Timed:
    """Counts calls and seconds spent inside graph runs, for the host-overhead share. A copy
    (copy.copy: the per-request decoders of bench --concurrency) shares the session and gets
    its own cache and bindings, so copies can run side by side."""
    graph_seconds = 0.0
    graph_calls = 0
    kv_device = torch.device("cpu")     # where the KV caches, their new rows and the logits live (kv_device_for)

    def __copy__(self):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.cache, other.bindings = None, self.bindings.empty_copy()
        return other

    def _run_graph(self, bound: Bound) -> None:
        bound.binding.refresh()
        if self.kv_device.type == "cuda":   # the caches' commits are queued on torch's stream; the
            torch.cuda.current_stream(self.kv_device).synchronize()   # graph, on its own, reads them
        start = time.perf_counter()
        self.session.run_with_iobinding(bound.io)
        self.graph_seconds += time.perf_counter() - start
        self.graph_calls += 1


def fixed_output_specs(session: ort.InferenceSession, names) -> dict[str, tuple[torch.dtype, list]]:
    outputs = {o.name: o for o in session.get_outputs()}
    return {n: (ONNX_TORCH_DTYPES[outputs[n].type], list(outputs[n].shape)) for n in names}


def kv_device_for(session: ort.InferenceSession, kv_device: str | torch.device | None) -> torch.device:
    """Where a backend on `session` keeps its KV caches and its logits (PyTorch tensors, bound by
    address), the large tensors of a call. None: on the GPU where the session runs on ONNX
    Runtime's CUDA provider and PyTorch has a GPU, so the pasts, new rows and logits never cross
    to the host (the greedy path reads the graph's acceptance instead; a call copies only its
    small inputs and outputs); else host memory, which a CUDA session copies across each call."""
    providers = session.get_providers()
    on_cuda = "CUDAExecutionProvider" in providers
    if kv_device is None:
        return torch.device("cuda") if on_cuda and torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(kv_device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv_device {device}: the KV caches live in host memory (cpu) or on a CUDA GPU (cuda)")
    if device.type == "cuda" and not on_cuda:
        raise ValueError(f"kv_device {device}: the session runs on {providers}, not ONNX Runtime's "
                         f"CUDAExecutionProvider, which reads the caches where they are")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"kv_device {device}: this PyTorch ({torch.__version__}) has no CUDA device to hold "
                         f"the caches; use kv_device cpu (the caches then cross to the GPU at each call)")
    return device


def verification(bound: Bound, accepts: bool) -> Verification:
    """A call's outputs where the graph wrote them; the graph's acceptance (accepts) as numpy
    views of its buffers: `tolist` costs ~1 us on them, 5-10 on the tensors after a graph call."""
    out, arrays = bound.buffers, bound.arrays
    return Verification(out["logits"], out["captured"], accepted=tuple(arrays[n] for n in ACCEPT_OUTPUTS)
                        if accepts else None, captured_host=arrays.get("captured"))


@functools.lru_cache(maxsize=64)
def _row_numbers(width: int) -> np.ndarray:
    return np.arange(width)


class OrtTarget(_Timed, TargetBackend):
    """min_rows: pad calls with fewer new tokens to this many rows (copies of the last token that
    only see themselves; their KV rows are staged but never committed). ONNX Runtime's CPU
    kernels round a 1-row MatMul differently from a multi-row one, while every row of a
    >= 2-row call is bit-identical whatever the row count; with min_rows=2 a greedy
    token-by-token run takes exactly the arithmetic path of tree verification. fp32 does not
    need it, but FP8 activations turn such last-bit differences into different tokens.
    The fused 4-bit graph with int8 activations pads its one-row calls inside itself
    (`pads_one_row`: a cache keeps room for the second row it writes) and is lossless for chain
    trees only (`lossless_trees`); both read from its metadata (graph_names)."""

    def __init__(self, path: str | Path, max_context: int, threads: int | None = None, min_rows: int = 1,
                 kv_device: str | torch.device | None = None, **session_kwargs):
        self.path = Path(path)
        self.session = make_session(path, threads, **session_kwargs)
        meta = self.session.get_modelmeta().custom_metadata_map
        self.pads_one_row = meta.get(PADS_ONE_ROW) == "1"
        self.lossless_trees = meta.get(LOSSLESS_TREES, "any")
        self.kv_device = kv_device_for(self.session, kv_device)
        self.min_rows = min_rows
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.num_layers = sum(1 for n in inputs if n.startswith("past_key_"))
        self.kv_heads, self.head_dim = kv_heads_and_dim(inputs["past_key_0"].shape, str(path))
        self.dtype = TORCH_DTYPES[inputs["past_key_0"].type]
        self.max_context = max_context
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.logits_dtype, self.captured_dtype = (TORCH_DTYPES[outputs[n].type] for n in ("logits", "captured"))
        self.vocab_size, self.captured_width = int(outputs["logits"].shape[-1]), int(outputs["captured"].shape[-1])
        # the fused-attention graph (export/cpu_attention.py) writes its new KV rows into the
        # past it is bound to: its present outputs are the cache itself, committed in place
        self.in_place = "present_key_0" in outputs
        if self.in_place and (self.kv_device.type != "cpu" or self.dtype not in (torch.float32, torch.float16)):
            raise ValueError(f"{path}: the fused-attention target graph keeps its KV cache in host memory "
                             f"(float32), not {self.kv_device} / {self.dtype}")
        names = target_kv_names(self.num_layers, self.in_place)
        self.bindings = Bindings(self.session, [names], self._buffers, self._width_buffers, in_place=self.in_place)
        self.graph_accepts = set(ACCEPT_OUTPUTS) <= set(outputs)   # graphs exported before format 5 do not

    def reset(self, capacity: int = CHUNK) -> None:
        self._new_cache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, self.kv_device)

    def forward(self, input_ids, positions, mask, slots=None, last_only=False):
        B, T = input_ids.shape
        index = logits_rows(T, last_only)      # of the rows asked for, not the padding
        if T < self.min_rows:
            pad = self.min_rows - T
            input_ids = torch.cat((input_ids, input_ids[:, -1:].repeat(1, pad)), 1)
            positions = torch.cat((positions, positions[:, -1:].repeat(1, pad)), 1)
            eye = torch.eye(pad, dtype=torch.bool).expand(B, pad, pad)
            mask = torch.stack([torch.block_diag(m, e) for m, e in zip(mask.bool(), eye)])
        out = self._forward(input_ids, positions, mask, slots, index)
        if T < self.min_rows:
            out.captured, out.captured_host = out.captured[:, :T], None
        return out

    def _buffers(self, bound: Bound, b: int, T: int, K: int) -> None:
        for name, shape in (("input_ids", [b, T]), ("position_ids", [b, T]), ("logits_index", [K])):
            bound.buffer(name, torch.int64, shape, output=False)
        # the rows that get logits follow from the shape: all T, or the last (logits_rows)
        bound.buffers["logits_index"].copy_(logits_rows(T, K == 1 and T > 1))
        bound.buffer("logits", self.logits_dtype, [b, K, self.vocab_size], output=True, device=self.kv_device)
        bound.buffer("captured", self.captured_dtype, [b, T, self.captured_width], output=True)
        if self.graph_accepts:
            for name, shape in zip(ACCEPT_OUTPUTS, ([b, K], [b], [b, K])):
                bound.buffer(name, torch.int64, shape, output=True)

    @staticmethod
    def _width_buffers(bound: Bound, b: int, T: int, width: int) -> None:
        mask = bound.buffer("attention_mask", torch.bool, [b, T, width + T], output=False)
        bound.buffers["tree_mask"] = mask[:, :, width:]   # a view verify returns (not bound)
        bound.mask_lengths = None                          # a new buffer: verify writes all of it

    def _stage(self, slots: range | None, T: int) -> tuple[range, list[int], int]:
        if self.pads_one_row and T < 2:     # the graph writes a second KV row after the new one
            self.cache.reserve(slots if slots is not None else range(self.cache.batch), 2)
        return super()._stage(slots, T)

    def _check_batch(self, slots: range, T: int) -> None:
        """ONNX Runtime's GroupQueryAttention CPU kernel takes several new rows after a past only
        at batch 1: the fused-attention graph verifies and prefills one sequence a call (and the
        one that pads one-row calls to two rows takes every call so)."""
        rows = max(T, 2) if self.pads_one_row else T
        if self.in_place and rows > 1 and len(slots) > 1:
            padded = " (one padded to 2)" if rows > T else ""
            raise ValueError(f"the fused-attention target graph {self.path.name} takes {T} new row(s){padded} for one "
                             f"sequence a call, not {len(slots)} (ONNX Runtime's GroupQueryAttention CPU kernel): "
                             f"decode batches on the portable target graph")

    def _run(self, input_ids, positions, mask, logits_index, slots, width):
        self._check_batch(slots, int(input_ids.shape[1]))
        bound = self.bindings.get(slots, [(self.cache, int(input_ids.shape[1]), width)], int(logits_index.shape[0]))
        bound.feed(input_ids=input_ids, position_ids=positions, attention_mask=mask)
        bound.mask_lengths = None       # the whole mask written: verify's next call rewrites it all too
        return self._call(bound)

    def _call(self, bound: Bound):
        self._run_graph(bound)
        return verification(bound, self.graph_accepts), bound.staged, None     # K and V rows as one block

    def keep_states(self, out, paths, index=None):
        """numpy arrays, copied from the captured buffer's own array in one copy for the batch:
        a slice where every path is the same run of rows (plain steps: each sequence's one row),
        else one gather of every path's rows; each sequence's rows are a view of that copy
        (torch's index_select and reshapes cost ~130 us here right after a graph call, and a
        copy per sequence 4x the one copy). After an iteration graph call with greedy paths
        (index given: the graph's own accept_path), views of the rows the graph gathered itself
        (its hand-off, KeptRows)."""
        if out.handoff is not None and index is not None:
            states, ids = out.handoff
            return KeptRows([states[i, :len(p)] for i, p in enumerate(paths)], states, ids)
        array = out.captured_host if out.captured_host is not None else out.captured.numpy()
        first, rows = paths[0][0], len(paths[0])
        if all(p[0] == first and len(p) == rows and p[-1] - first == rows - 1 for p in paths):
            return list(array[:len(paths), first:first + rows].copy())
        kept = array[[i for i, p in enumerate(paths) for _ in p], [r for p in paths for r in p]]
        ends = list(itertools.accumulate(map(len, paths)))
        return [kept[end - len(p):end] for p, end in zip(paths, ends)]

    def verify(self, roots, tree):
        """TargetBackend.verify with the inputs written straight into the call's bound buffers,
        in numpy: the ids, positions and mask are never built as tensors of their own."""
        T = 1 + (tree.size if tree is not None else 0)
        if T < self.min_rows:                     # padded rows: the general path
            return super().verify(roots, tree)
        slots, lengths, width = self._stage(None, T)
        self._check_batch(slots, T)
        bound = self.bindings.get(slots, [(self.cache, T, width)], T)
        a = bound.arrays
        ids, positions, mask = a["input_ids"], a["position_ids"], a["attention_mask"]
        past = lengths[0] if len(lengths) == 1 else np.array(lengths)[:, None]
        ids[:, 0] = roots
        if T > 1:
            tokens, tree_mask, depths = tree.host_arrays()
            ids[:, 1:] = tokens
            np.add(depths, past, out=positions)
            mask[:, :, width:] = tree_mask
        else:
            positions[:] = past
            mask[:, :, width:] = True
        # committed rows visible: only the rows committed since this buffer's last call change
        # (one slice fill per sequence, where a full comparison over the width costs 2-3x that)
        done = bound.mask_lengths
        if done is None or len(done) != len(lengths):
            np.less(_row_numbers(width), np.array(lengths)[:, None, None], out=mask[:, :, :width])
        else:
            for i, (old, new) in enumerate(zip(done, lengths)):
                if new != old:
                    mask[i, :, min(old, new):max(old, new)] = new > old
        bound.mask_lengths = lengths
        out, new_kv, _ = self._call(bound)
        self.cache.write(new_kv)
        out.ids, out.mask = bound.buffers["input_ids"], bound.buffers["tree_mask"]
        return out


class OrtDrafter(_Timed, DrafterBackend):
    def __init__(self, path: str | Path, shape: TreeShape, threads: int | None = None,
                 kv_device: str | torch.device | None = None, **session_kwargs):
        self.session = make_session(path, threads, **session_kwargs)
        self.kv_device = kv_device_for(self.session, kv_device)
        self.shape = shape
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "past_lengths" not in inputs:
            raise ValueError(f"{path}: drafter graph has no batch inputs (past_lengths, new_lengths): it was exported "
                             f"by an older eagle_trt; re-export it (python -m eagle_trt.build --force export)")
        self.kv_heads, self.head_dim = kv_heads_and_dim(inputs["past_key"].shape, str(path))
        self.dtype = TORCH_DTYPES[inputs["past_key"].type]
        nodes = self.session.get_outputs()[0].shape[-1]
        if isinstance(nodes, int) and nodes != shape.total_tokens:
            raise ValueError(f"{path}: drafter graph was exported for total_tokens {nodes}, "
                             f"not {shape.total_tokens}; re-export it for this tree shape")
        self.bindings = Bindings(self.session, [[DRAFTER_KV_NAMES]], self._buffers)
        self.tree_outputs = fixed_output_specs(self.session, DRAFT_TREE_OUTPUTS[:5])
        self.captured_width = int(inputs["captured"].shape[-1])
        self.captured_dtype = TORCH_DTYPES[inputs["captured"].type]

    def reset(self, capacity: int = CHUNK) -> None:
        self._new_cache(1, self.kv_heads, self.head_dim, capacity, self.dtype, self.kv_device)

    def _buffers(self, bound: Bound, b: int, T: int) -> None:
        bound.buffer("captured", self.captured_dtype, [b, T, self.captured_width], output=False)
        bound.buffer("input_ids", torch.int64, [b, T], output=False)
        for name in ("past_lengths", "new_lengths"):
            bound.buffer(name, torch.int64, [b], output=False)
        for name, (dtype, shape) in self.tree_outputs.items():
            bound.buffer(name, dtype, [b if isinstance(d, str) else d for d in shape], output=True)

    def _run(self, captured, input_ids, past_lengths, new_lengths, slots, width):
        bound = self.bindings.get(slots, [(self.cache, int(captured.shape[1]), width)])
        bound.feed(captured=captured, input_ids=input_ids, past_lengths=past_lengths, new_lengths=new_lengths)
        self._run_graph(bound)
        return bound.draft_tree(), bound.staged, None   # [2, 1, b, Hkv, T, D]


class OrtIteration(_Timed):
    """One speculative iteration as one graph call (the iteration graph, export/iteration.py):
    the drafter encodes each sequence's newly committed rows and drafts its tree, the target
    verifies root + tree and accepts, inside one session. Nothing crosses the host between the
    two halves: no tree read back, no verification inputs built, one binding, one call.

    It works on the target's and drafter's own backends (their caches, slots and bookkeeping),
    so the decoder uses it for every iteration that drafts, whatever subtree it verifies
    (`nodes`: the iteration graph's verify_nodes), and the two-call path for the rest
    (prefills, plain steps, catching the drafter up on a long backlog). Its outputs are read as the
    backends' own: the target's accept_greedy and keep_states see this call's buffers.

    The hand-off: the graph gathers the accepted rows' states and tokens into the shape of its
    own drafter inputs (next_captured, next_input_ids). Each binding has two buffers of each and
    two sides (TwinBinding) that read and write them crossed over, used in turn, so the next
    call takes this one's hand-off where the graph wrote it, with no bind made (keep_states
    hands the decoder views of it, and the decoder passes the block back when the batch is the
    same): the accepted states are never copied on the host.
    handoff=False (or a graph composed before the hand-off) copies the inputs in every call."""

    def __init__(self, path: str | Path, target: OrtTarget, drafter: OrtDrafter, threads: int | None = None,
                 handoff: bool = True, **session_kwargs):
        self.session = make_session(path, threads, **session_kwargs)
        self.target, self.drafter = target, drafter
        if target.kv_device != drafter.kv_device:
            raise ValueError(f"the target keeps its KV cache on {target.kv_device}, the drafter on "
                             f"{drafter.kv_device}: one iteration graph call reads both, from one place")
        self.kv_device = target.kv_device
        inputs = {i.name for i in self.session.get_inputs()}
        if not {PREFIX + "captured", "past_lengths", "past_key_0"} <= inputs:
            raise ValueError(f"{path}: not an iteration graph (inputs {sorted(inputs)[:6]}...): make one with "
                             f"eagle_trt.export.iteration.compose_iteration")
        self.nodes = drafter.shape.total_tokens
        # graphs composed before format 3 verify every node; later ones any number (verify_nodes)
        self.any_nodes = VERIFY_NODES in inputs
        self.tree_outputs = fixed_output_specs(self.session, [PREFIX + n for n in DRAFT_TREE_OUTPUTS[:5]])
        if self.tree_outputs[PREFIX + "tree_tokens"][1][1] != self.nodes:
            raise ValueError(f"{path}: its tree has {self.tree_outputs[PREFIX + 'tree_tokens'][1][1]} nodes, the "
                             f"drafter backend's shape {self.nodes}: compose it from this drafter's graph")
        # drafter rows per call at least depth + 1 (what one iteration accepts at most; the rest
        # padding): one binding per batch size instead of one per accept length, so a re-layout
        # of the target's cache rebinds its 2L pasts once, not once per length
        self.min_rows = drafter.shape.depth + 1
        self.has_handoff = set(HANDOFF) <= {o.name for o in self.session.get_outputs()}
        self.handoff = handoff and self.has_handoff
        self.handoffs = 0     # calls whose drafter inputs were the last call's hand-off, in place
        names = [target_kv_names(target.num_layers, target.in_place), [tuple(PREFIX + n for n in DRAFTER_KV_NAMES)]]
        if target.in_place != any(o.name == "present_key_0" for o in self.session.get_outputs()):
            raise ValueError(f"{path}: composed from {'a portable' if target.in_place else 'the fused-attention'} "
                             f"target graph, but the target backend runs the other: compose it from the target's graph")
        self.bindings = Bindings(self.session, names, self._buffers, twin=self.has_handoff, in_place=target.in_place)
        self.handoff_buffers: dict[tuple[int, int], tuple] = {}   # (batch, rows) -> (pairs, numpy views, turns)

    def __copy__(self):
        other = super().__copy__()
        other.handoff_buffers = {}      # its own bindings cross buffers of their own
        return other

    def _buffers(self, bound: Bound, b: int, T: int, Tp: int) -> None:
        t, d, p = self.target, self.drafter, PREFIX
        drafter_inputs = ((p + "captured", d.captured_dtype, [b, Tp, d.captured_width]), (p + "input_ids", torch.int64, [b, Tp]))
        if self.has_handoff:     # two of each, read and written in turn by the TwinBinding's sides,
            # one set per batch size whatever the nodes verified (T): a step verifying another
            # subtree than the last still reads the last one's hand-off in place
            if (b, Tp) not in self.handoff_buffers:
                pairs = [[torch.zeros(shape, dtype=dtype) for _ in range(2)] for _, dtype, shape in drafter_inputs]
                views = [tuple(pair[side].numpy() for pair in pairs) for side in range(2)]   # one set: run
                self.handoff_buffers[b, Tp] = pairs, views, [0]                               # compares by identity
            pairs, bound.handoff, bound.binding.turns = self.handoff_buffers[b, Tp]
            for (given, _, _), handed, (first, second) in zip(drafter_inputs, HANDOFF, pairs):
                bound.binding.bind_crossed(given, handed, first, second)
        else:                    # padding ids zero: valid ids
            for name, dtype, shape in drafter_inputs:
                bound.buffer(name, dtype, shape, output=False).zero_()
            bound.handoff = [tuple(bound.arrays[name] for name, _, _ in drafter_inputs)]
        for name in (p + "past_lengths", p + "new_lengths", "past_lengths"):
            bound.buffer(name, torch.int64, [b], output=False)
        if self.any_nodes:      # the nodes verified follow from the shape, as logits_index does the target's
            bound.buffer(VERIFY_NODES, torch.int64, [1], output=False).fill_(T - 1)
        for name, (dtype, shape) in self.tree_outputs.items():
            bound.buffer(name, dtype, [b if isinstance(x, str) else x for x in shape], output=True)
        bound.buffer("input_ids", torch.int64, [b, T], output=True)
        bound.buffer("logits", t.logits_dtype, [b, T, t.vocab_size], output=True, device=self.kv_device)
        bound.buffer("captured", t.captured_dtype, [b, T, t.captured_width], output=True)
        for name, shape in zip(ACCEPT_OUTPUTS, ([b, T], [b], [b, T])):
            bound.buffer(name, torch.int64, shape, output=True)

    def run(self, captured, input_ids, new_lengths: list[int], slots: range | None = None, nodes: int | None = None,
            handed_off: bool = False):
        """DrafterBackend.draft(captured, input_ids, new_lengths) and then TargetBackend.verify of
        each sequence's root (its last valid input id) and its tree's `nodes` best nodes (None:
        all), in one call. Returns the whole trees and what verify returns: logits, captured, input
        ids and the verified tree's mask, as a Verification (with the graph's hand-off where it
        makes one). handed_off: captured and input_ids are the last call's hand-off (KeptRows.states
        / .ids, the caller knows the batch is the same), read where the graph wrote them: nothing
        is copied."""
        t, d, p = self.target, self.drafter, PREFIX
        nodes = self.nodes if nodes is None else min(nodes, self.nodes)
        if nodes < 1 or (nodes < self.nodes and not self.any_nodes):
            raise ValueError(f"the iteration graph verifies 1..{self.nodes} nodes" if self.any_nodes else
                             f"this iteration graph (composed before format 3) verifies whole trees only, not "
                             f"{nodes} of {self.nodes} nodes: compose it again (python -m eagle_trt.build --force export)")
        Tp, T = int(captured.shape[1]), 1 + nodes
        rows = max(Tp, self.min_rows)
        slots, drafted, d_width = d._stage(slots, rows)
        slots, committed, t_width = t._stage(slots, T)
        t._check_batch(slots, T)
        bound = self.bindings.get(slots, [(t.cache, T, t_width), (d.cache, rows, d_width)])
        side = bound.binding.side if self.has_handoff else 0
        given_states, given_ids = bound.handoff[side]    # the drafter inputs this call reads
        if handed_off:
            if captured is not given_states:     # the caller's bookkeeping and the binding's sides disagree
                raise RuntimeError("the hand-off given is not the block this call reads")
            self.handoffs += 1                   # the last call's hand-off, where it wrote it
        else:
            given_states[:, :Tp] = captured      # rows past Tp: an earlier call's (finite), never seen
            given_ids[:, :Tp] = input_ids
        bound.feed(**{p + "past_lengths": drafted, p + "new_lengths": new_lengths, "past_lengths": committed})
        self._run_graph(bound)
        out = verification(bound, True)
        if self.handoff:     # what it wrote is what the other side reads: the next call's inputs
            bound.binding.turn()
            out.handoff = bound.handoff[bound.binding.side]
        d.commit_new_rows(bound.staged_all[1], None, new_lengths)
        t.cache.write(bound.staged_all[0])       # committed by the engine, once it has accepted
        tree = bound.draft_tree(PREFIX)
        out.ids, out.mask = bound.buffers["input_ids"], tree.top(nodes).mask
        return tree, out
