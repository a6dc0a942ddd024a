"""ONNX Runtime backend: the exported target graph and the drafter graph with the tree baked
in, two graph calls per iteration.

Host work is kept small: the KV caches are preallocated numpy buffers in the graphs' own
[1, S, Hkv, D] layout, so the committed prefix is bound as the `past` input without a copy
and the graph writes its new KV rows straight into the cache (outputs bound to the buffer)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..config import TreeShape
from ..tree import DraftTree
from .kv_cache import KVCache

TORCH_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}


class _Timed:
    """Counts calls and seconds spent inside graph runs, for the host-overhead share."""
    graph_seconds = 0.0
    graph_calls = 0

    def _run(self, io: ort.IOBinding) -> None:
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.graph_seconds += time.perf_counter() - start
        self.graph_calls += 1


def make_session(path: str | Path, threads: int | None = None,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                 config: dict[str, str] | None = None, spin: bool = False) -> ort.InferenceSession:
    """config: ONNX Runtime session config entries (e.g. the FP8 settings in eagle_trt.quant.run).

    spin=False: the session's worker threads sleep when a call ends instead of busy-waiting for
    the next one. Speculative decoding alternates two sessions (drafter, target), and each one's
    spinning workers took the cores from the other's: on 2 cores, spinning made verification
    ~50 ms instead of ~36 and speculative decoding ~35% slower. A session that runs alone call
    after call (plain autoregressive decoding) is faster with spin=True."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ONNX graph not found")
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    entries = dict(config or {})
    if not spin:
        entries.setdefault("session.intra_op.allow_spinning", "0")
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - name the file with ORT's reason
        raise ValueError(f"{path}: ONNX Runtime cannot load this graph ({exc})") from None


def bind_kv(io: ort.IOBinding, cache: KVCache, layer: int, past: tuple[str, str], new: tuple[str, str]) -> None:
    """Bind the committed prefix of `layer` as the past input and the staged rows as the output
    buffer, both as zero-copy numpy views of the cache's own tensors."""
    P, T = cache.length, cache.staged
    for buf, past_name, new_name in ((cache.k[layer], past[0], new[0]), (cache.v[layer], past[1], new[1])):
        array = buf.numpy()                       # [1, capacity, Hkv, D], shares memory with the cache
        io.bind_cpu_input(past_name, array[:, :P])
        staged = array[:, P:P + T]
        io.bind_output(new_name, "cpu", 0, array.dtype, list(staged.shape), staged.ctypes.data)


class OrtTarget(_Timed):
    """min_rows: pad calls with fewer new tokens to this many rows (copies of the last token that
    only see themselves; their KV rows are staged but never committed). ONNX Runtime's CPU
    kernels round a 1-row MatMul differently from a multi-row one, while every row of a
    >= 2-row call is bit-identical whatever the row count; with min_rows=2 a greedy
    token-by-token run takes exactly the arithmetic path of tree verification. fp32 does not
    need it, but FP8 activations turn such last-bit differences into different tokens."""

    def __init__(self, path: str | Path, max_context: int, threads: int | None = None, min_rows: int = 1,
                 **session_kwargs):
        self.session = make_session(path, threads, **session_kwargs)
        self.min_rows = min_rows
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.num_layers = sum(1 for n in inputs if n.startswith("past_key_"))
        shape = inputs["past_key_0"].shape   # [1, past_tokens, Hkv, D]
        self.kv_heads, self.head_dim = int(shape[2]), int(shape[3])
        self.dtype = TORCH_DTYPES[inputs["past_key_0"].type]
        self.max_context = max_context
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype)

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, input_ids, positions, mask, last_only=False):
        T, P = int(input_ids.shape[0]), self.cache.length
        rows = max(T, self.min_rows)
        if rows > T:
            input_ids = torch.cat((input_ids, input_ids[-1:].repeat(rows - T)))
            positions = torch.cat((positions, positions[-1:].repeat(rows - T)))
            mask = torch.block_diag(mask, torch.eye(rows - T)).bool()
        self.cache.stage(rows)
        full = np.ones((1, rows, P + rows), dtype=bool)
        full[0, :, P:] = mask.numpy()
        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", input_ids.numpy()[None].astype(np.int64))
        io.bind_cpu_input("position_ids", positions.numpy()[None].astype(np.int64))
        io.bind_cpu_input("attention_mask", full)
        io.bind_cpu_input("logits_index", np.array([T - 1] if last_only else np.arange(T), dtype=np.int64))
        # io.get_outputs() follows binding order: bind the two ORT-allocated outputs first.
        io.bind_output("logits", "cpu")
        io.bind_output("captured", "cpu")
        for i in range(self.num_layers):
            bind_kv(io, self.cache, i, (f"past_key_{i}", f"past_value_{i}"), (f"new_key_{i}", f"new_value_{i}"))
        self._run(io)
        logits, captured = io.get_outputs()[:2]
        return torch.from_numpy(logits.numpy()[0]), torch.from_numpy(captured.numpy()[0, :T])

    def commit(self, rows: list[int]) -> None:
        self.cache.commit(rows)


class OrtDrafter(_Timed):
    def __init__(self, path: str | Path, shape: TreeShape, threads: int | None = None, **session_kwargs):
        self.session = make_session(path, threads, **session_kwargs)
        self.shape = shape
        inputs = {i.name: i for i in self.session.get_inputs()}
        kv = inputs["past_key"].shape
        self.kv_heads, self.head_dim = int(kv[2]), int(kv[3])
        self.dtype = TORCH_DTYPES[inputs["past_key"].type]
        nodes = self.session.get_outputs()[0].shape[0]
        if isinstance(nodes, int) and nodes != shape.total_tokens:
            raise ValueError(f"{path}: drafter graph was exported for total_tokens {nodes}, "
                             f"not {shape.total_tokens}; re-export it for this tree shape")
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(1, self.kv_heads, self.head_dim, capacity, self.dtype)

    def draft(self, captured: torch.Tensor, input_ids: torch.Tensor) -> DraftTree:
        T = int(input_ids.shape[0])
        self.cache.stage(T)
        io = self.session.io_binding()
        io.bind_cpu_input("captured", captured[None].to(self.dtype).numpy())
        io.bind_cpu_input("input_ids", input_ids.numpy()[None].astype(np.int64))
        names = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores"]
        for name in names:   # bound first: io.get_outputs() follows binding order
            io.bind_output(name, "cpu")
        bind_kv(io, self.cache, 0, ("past_key", "past_value"), ("new_key", "new_value"))
        self._run(io)
        out = {name: torch.from_numpy(value.numpy()) for name, value in zip(names, io.get_outputs())}
        self.cache.commit(list(range(T)))
        return DraftTree(out["tree_tokens"], out["tree_parents"], out["tree_mask"], out["tree_depths"],
                         out["tree_scores"])
