"""TensorRT backend: the target and drafter-tree engines built by `python -m eagle_trt.build`,
behind the same TargetBackend / DrafterBackend protocols as the PyTorch and ONNX Runtime ones.

Device buffers are torch CUDA tensors: the batched KV caches (runtime/kv_cache.py) live on the
GPU in the engines' [B, Hkv, S, D] layout, so a block of sequences' past is bound as `past_*`
without a copy, and the commit copies the accepted ones of the new rows the engine returns into
place on the GPU. The target engine's greedy acceptance (accept_* outputs) and the drafter's
trees stay on the GPU too: the decoder builds the next verification inputs there and copies
only the accepted paths, lengths and tokens to the host, once per iteration (sampled
acceptance reads the logits rows it needs). One execution context per optimization profile:
the target engine has prefill (0, batch 1) and verification (1, batch up to
engines.max_batch), the drafter engine one. Calls are enqueued with set_input_shape /
set_tensor_address (only where they changed since the context's last call) / execute_async_v3,
into output buffers made once per input shapes, on torch's current CUDA stream (or a given one, ordered
against it by stream waits on the GPU): an engine call itself never makes the host wait. The
decoder's copy of the accepted tokens does, and so may its few small host-to-device copies
(roots, lengths, commit indices: pageable copies), which is not measured: no GPU has run this.

CUDA graphs (`cuda_graphs=True`, opt-in, never run): a call whose shapes and addresses were seen
before is replayed from a CUDA graph of its execute_async_v3 instead of enqueued again (TensorRT
10 allows capturing enqueueV3 once the context has run with those shapes). Addresses repeat
because the small inputs are copied into the engine's own buffers per input shapes, and the KV
pasts are views of a cache that moves only when it is re-laid out; the graphs are captured on
the engine's own stream (a legacy default stream cannot capture). A capture TensorRT refuses
is logged once and that call shape runs uncaptured.

Importable only where TensorRT is installed (an NVIDIA GPU and driver are needed to run it)."""
from __future__ import annotations

from pathlib import Path

try:
    import tensorrt as trt
except ImportError as exc:   # the message names what is missing, not just the module
    raise ImportError(f"eagle_trt.runtime.tensorrt_backend needs TensorRT 10.x (pip install tensorrt, on a "
                      f"machine with an NVIDIA GPU and driver; or the NGC image in docker/): {exc}") from exc

import torch

from ..config import TreeShape
from ..graph_names import ACCEPT_OUTPUTS
from .backend import DrafterBackend, TargetBackend, Verification, tree_from_outputs
from .kv_cache import CHUNK

TORCH_OF = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool, trt.int8: torch.int8}


class Engine:
    """A deserialized plan with one execution context per optimization profile."""

    def __init__(self, plan: str | Path, stream: torch.cuda.Stream | None = None, cuda_graphs: bool = False):
        """stream: where the calls are enqueued (default: torch's current stream, the one the
        decoder's tensor ops run on, so no synchronisation is needed between them; with
        cuda_graphs, a stream of the engine's own). cuda_graphs: replay repeated call shapes
        from CUDA graphs (module docstring)."""
        plan = Path(plan)
        if not plan.is_file():
            raise FileNotFoundError(f"{plan}: TensorRT plan not found")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{plan}: TensorRT engines need a CUDA GPU; torch.cuda.is_available() is False")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise ValueError(f"{plan}: TensorRT cannot deserialize this plan (built by another TensorRT version "
                             f"or for another GPU?)")
        self.path = plan
        self.stream = stream or (torch.cuda.Stream() if cuda_graphs else torch.cuda.current_stream())
        self.graphs: CallGraphs | None = CallGraphs(self) if cuda_graphs else None
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]
        self.dtypes = {n: TORCH_OF[self.engine.get_tensor_dtype(n)] for n in self.names}
        self.contexts = []
        self.bound: list[dict] = []       # per context: what was last set (input shape and address, output address)
        self.output_sets: dict[tuple, dict[str, torch.Tensor]] = {}
        self.keep_outputs = 16
        for index in range(self.engine.num_optimization_profiles):
            self.bound.append({})
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        self.stream.synchronize()

    def profile_range(self, profile: int, name: str) -> tuple[tuple, tuple, tuple]:
        return tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(name, profile))

    def fits(self, profile: int, shapes: dict[str, tuple]) -> bool:
        for name, shape in shapes.items():
            lo, _, hi = self.profile_range(profile, name)
            if any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
                return False
        return True

    def run(self, profile: int, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        """Bind inputs (their shapes select the output shapes) and enqueue, without waiting.
        Fills `outputs` with every output tensor: given buffers, else this engine's own buffers
        for these input shapes, made once and reused, so outputs are valid until the next call
        with the same shapes (as the ONNX Runtime backend's). A context keeps its shapes and
        addresses from call to call (TensorRT 10), so only those that changed are set again:
        a verification call of the same shape as the last re-sets its few small inputs, not
        the 4L KV pasts and new-row outputs."""
        context, bound = self.contexts[profile], self.bound[profile]
        for name in self.inputs:
            t = inputs[name]
            if t.dtype != self.dtypes[name] or not t.is_cuda or not t.is_contiguous():
                raise TypeError(f"{self.path}: input '{name}' must be a contiguous CUDA {self.dtypes[name]} tensor, "
                                f"got {t.dtype} on {t.device}")
        shapes = tuple(tuple(inputs[name].shape) for name in self.inputs)
        if self.graphs is not None:      # small inputs into this shape's own buffers: addresses repeat
            inputs = self.graphs.stage(profile, shapes, inputs)   # on torch's stream, before the wait below
        for name, shape in zip(self.inputs, shapes):
            t = inputs[name]
            last = bound.get(name)
            if last is None or last[0] != shape:
                context.set_input_shape(name, shape)
            if last != (shape, t.data_ptr()):
                context.set_tensor_address(name, t.data_ptr())
                bound[name] = (shape, t.data_ptr())
        own = self._output_buffers(profile, shapes)
        for name in self.outputs:
            buf = outputs.setdefault(name, own[name])
            if tuple(buf.shape) != tuple(own[name].shape):
                raise ValueError(f"{self.path}: output '{name}' has shape {tuple(own[name].shape)}, buffer "
                                 f"{tuple(buf.shape)}")
            if bound.get(name) != buf.data_ptr():
                context.set_tensor_address(name, buf.data_ptr())
                bound[name] = buf.data_ptr()
        current = torch.cuda.current_stream()
        if self.stream != current:        # a stream of its own: ordered against torch's on the GPU
            self.stream.wait_stream(current)
        signature = None if self.graphs is None else self.graphs.signature(profile, inputs, outputs)
        if signature is None or not self.graphs.replay(signature):
            if not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError(f"{self.path}: execute_async_v3 failed (see the TensorRT log)")
            if signature is not None:
                self.graphs.seen(signature, profile)
        if self.stream != current:
            current.wait_stream(self.stream)
            for t in outputs.values():    # made on torch's stream, written on ours: not reused too early
                t.record_stream(self.stream)

    def _output_buffers(self, profile: int, shapes: tuple) -> dict[str, torch.Tensor]:
        """This engine's output buffers for one set of input shapes (already set on the context),
        the least recently used set dropped past `keep_outputs`."""
        key = (profile, shapes)
        own = self.output_sets.pop(key, None)
        if own is None:
            context = self.contexts[profile]
            own = {name: torch.empty(tuple(context.get_tensor_shape(name)), dtype=self.dtypes[name], device="cuda")
                   for name in self.outputs}
            if len(self.output_sets) >= self.keep_outputs:
                self.output_sets.pop(next(iter(self.output_sets)))
        self.output_sets[key] = own
        return own


class CallGraphs:
    """An engine's CUDA graphs, one per call signature (profile, and every input's and output's
    shape and address): captured the second time a signature runs (the first run leaves the
    context set up for it; one-off shapes such as a prefill are never captured), replayed
    after. Small inputs (all but the KV pasts) are copied into buffers kept per input shapes,
    so that their addresses repeat. At most `keep` graphs and input-buffer sets are held."""

    def __init__(self, engine: "Engine", keep: int = 16):
        self.engine, self.keep = engine, keep
        self.inputs: dict[tuple, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}   # None: seen once
        self.refused: set[tuple] = set()

    def stage(self, profile: int, shapes: tuple, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = (profile, shapes)
        own = self.inputs.pop(key, None)
        if own is None:
            own = {n: torch.empty_like(t) for n, t in inputs.items() if not n.startswith("past_")}
            if len(self.inputs) >= self.keep:
                self.inputs.pop(next(iter(self.inputs)))
        self.inputs[key] = own
        # On torch's current stream, where the inputs were made: the engine's stream waits for it
        # before running, and torch's waits for the engine's after each call, so the last call
        # has read these buffers before they are written again.
        for name, buf in own.items():
            buf.copy_(inputs[name], non_blocking=True)
        return {**inputs, **own}

    @staticmethod
    def signature(profile: int, inputs, outputs) -> tuple:
        """What a captured graph depends on: the profile, every tensor's shape and address."""
        return (profile, *((n, tuple(t.shape), t.data_ptr()) for n, t in (*inputs.items(), *outputs.items())))

    def replay(self, key: tuple) -> bool:
        graph = self.graphs.get(key)
        if graph is None:
            return False
        with torch.cuda.stream(self.engine.stream):
            graph.replay()
        return True

    def seen(self, key: tuple, profile: int) -> None:
        """After an uncaptured run of signature `key`: the first time, remember it; the second, capture."""
        if key not in self.graphs:
            if len(self.graphs) >= self.keep:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = None
            return
        if key in self.refused:
            return
        graph = torch.cuda.CUDAGraph()
        stream = self.engine.stream
        try:
            with torch.cuda.graph(graph, stream=stream):
                if not self.engine.contexts[profile].execute_async_v3(stream.cuda_stream):
                    raise RuntimeError("execute_async_v3 failed during capture")
        except RuntimeError as exc:   # TensorRT or CUDA refused: this call shape stays uncaptured
            self.refused.add(key)
            self.engine.logger.log(trt.Logger.WARNING, f"{self.engine.path}: CUDA graph capture refused ({exc}); "
                                                       f"running this call shape without one")
            return
        self.graphs[key] = graph


def _cuda(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device="cuda", dtype=dtype).contiguous()


def _profile(engine: Engine, shapes: dict[str, tuple], tokens: int) -> int:
    """The profile whose ranges take these shapes, tuned for the nearest token count (prefill ~ a
    prompt, verify ~ the tree)."""
    fitting = [p for p in range(len(engine.contexts)) if engine.fits(p, shapes)]
    if fitting:
        return min(fitting, key=lambda p: abs(engine.profile_range(p, "input_ids")[1][1] - tokens))
    raise ValueError(f"{engine.path}: no optimization profile takes the shapes {shapes}; rebuild with larger "
                     f"engines.profiles or engines.max_batch")


class TrtTarget(TargetBackend):
    def __init__(self, plan: str | Path, max_context: int, stream: torch.cuda.Stream | None = None,
                 cuda_graphs: bool = False):
        self.engine = Engine(plan, stream, cuda_graphs)
        e = self.engine
        self.num_layers = sum(1 for n in e.inputs if n.startswith("past_key_"))
        lo, _, _ = e.profile_range(0, "past_key_0")
        self.kv_heads, self.head_dim = lo[1], lo[3]           # [B, Hkv, past_tokens, D]
        self.dtype = e.dtypes["past_key_0"]
        self.max_context = max_context

    def reset(self, capacity: int = CHUNK) -> None:
        self._new_cache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, "cuda")

    def _run(self, input_ids, positions, mask, logits_index, slots, width):
        B, T = input_ids.shape
        feeds = {"input_ids": _cuda(input_ids, torch.int64), "position_ids": _cuda(positions, torch.int64),
                 "attention_mask": _cuda(mask, torch.bool), "logits_index": _cuda(logits_index, torch.int64)}
        for i in range(self.num_layers):   # past: contiguous views of the cache, no copies
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = self._past(slots, width, i)
        outputs = {}
        shapes = {"input_ids": (B, T), "past_key_0": (B, self.kv_heads, width, self.head_dim)}
        self.engine.run(_profile(self.engine, shapes, T), feeds, outputs)
        # Everything stays on the GPU: greedy acceptance comes out of the engine (its accept_*
        # outputs), and only the accepted paths and tokens are copied to the host by the decoder;
        # sampled acceptance reads the logits rows it needs.
        accepted = tuple(outputs[n] for n in ACCEPT_OUTPUTS) if ACCEPT_OUTPUTS[0] in outputs else None
        new = [outputs[f"new_{kv}_{i}"] for i in range(self.num_layers) for kv in ("key", "value")]
        return Verification(outputs["logits"], outputs["captured"], accepted=accepted), new[0::2], new[1::2]


class TrtDrafter(DrafterBackend):
    def __init__(self, plan: str | Path, shape: TreeShape, stream: torch.cuda.Stream | None = None,
                 cuda_graphs: bool = False):
        self.engine = Engine(plan, stream, cuda_graphs)
        lo, _, _ = self.engine.profile_range(0, "past_key")
        self.kv_heads, self.head_dim = lo[1], lo[3]
        self.dtype = self.engine.dtypes["past_key"]
        self.shape = shape

    def reset(self, capacity: int = CHUNK) -> None:
        self._new_cache(1, self.kv_heads, self.head_dim, capacity, self.dtype, "cuda")

    def _run(self, captured, input_ids, past_lengths, new_lengths, slots, width):
        past_k, past_v = self._past(slots, width, 0)
        feeds = {"captured": _cuda(captured, self.engine.dtypes["captured"]),
                 "input_ids": _cuda(torch.as_tensor(input_ids), torch.int64), "past_key": past_k, "past_value": past_v,
                 "past_lengths": _cuda(torch.tensor(past_lengths), torch.int64),
                 "new_lengths": _cuda(torch.tensor(new_lengths), torch.int64)}
        outputs = {}
        self.engine.run(0, feeds, outputs)
        if int(outputs["tree_tokens"].shape[-1]) != self.shape.total_tokens:
            raise ValueError(f"{self.engine.path}: engine drafts {outputs['tree_tokens'].shape[-1]} nodes, the decoder "
                             f"expects total_tokens {self.shape.total_tokens}")
        return tree_from_outputs(outputs), outputs["new_key"], outputs["new_value"]


__all__ = ["CallGraphs", "Engine", "TrtDrafter", "TrtTarget"]
