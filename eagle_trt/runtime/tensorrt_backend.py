"""TensorRT backend: the target and drafter-tree engines built by `python -m eagle_trt.build`,
behind the same TargetBackend / DrafterBackend protocols as the PyTorch and ONNX Runtime ones.

Device buffers are torch CUDA tensors: the KV caches are preallocated KVCache tensors on the
GPU in the engines' [1, S, Hkv, D] layout, so the committed prefix is bound as `past_*` and
the engine writes its new rows straight into the staged rows of the cache (as the ONNX Runtime
backend does on the CPU). One execution context per optimization profile: the target engine
has prefill (0) and verification (1), the drafter engine one. Calls are enqueued on one CUDA
stream with set_input_shape / set_tensor_address / execute_async_v3.

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
from ..tree import DraftTree
from .kv_cache import KVCache

TORCH_OF = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool, trt.int8: torch.int8}


class Engine:
    """A deserialized plan with one execution context per optimization profile."""

    def __init__(self, plan: str | Path, stream: torch.cuda.Stream | None = None):
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
        self.stream = stream or torch.cuda.Stream()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]
        self.dtypes = {n: TORCH_OF[self.engine.get_tensor_dtype(n)] for n in self.names}
        self.contexts = []
        for index in range(self.engine.num_optimization_profiles):
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
        """Bind inputs (their shapes select the output shapes) and given output buffers, allocate
        the other outputs, enqueue and wait. Fills `outputs` with every output tensor."""
        context = self.contexts[profile]
        for name in self.inputs:
            t = inputs[name]
            if t.dtype != self.dtypes[name] or not t.is_cuda or not t.is_contiguous():
                raise TypeError(f"{self.path}: input '{name}' must be a contiguous CUDA {self.dtypes[name]} tensor, "
                                f"got {t.dtype} on {t.device}")
            context.set_input_shape(name, tuple(t.shape))
            context.set_tensor_address(name, t.data_ptr())
        for name in self.outputs:
            shape = tuple(context.get_tensor_shape(name))
            if name not in outputs:
                outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device="cuda")
            elif tuple(outputs[name].shape) != shape:
                raise ValueError(f"{self.path}: output '{name}' has shape {shape}, buffer {tuple(outputs[name].shape)}")
            context.set_tensor_address(name, outputs[name].data_ptr())
        torch.cuda.current_stream().synchronize()   # inputs written on the default stream are ready
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.path}: execute_async_v3 failed (see the TensorRT log)")
        self.stream.synchronize()


def _cuda(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device="cuda", dtype=dtype).contiguous()


class TrtTarget:
    def __init__(self, plan: str | Path, max_context: int, stream: torch.cuda.Stream | None = None):
        self.engine = Engine(plan, stream)
        e = self.engine
        self.num_layers = sum(1 for n in e.inputs if n.startswith("past_key_"))
        lo, _, _ = e.profile_range(0, "past_key_0")
        self.kv_heads, self.head_dim = lo[2], lo[3]
        self.dtype = e.dtypes["past_key_0"]
        self.max_context = max_context
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, "cuda")

    @property
    def length(self) -> int:
        return self.cache.length

    def _profile(self, T: int, P: int) -> int:
        shapes = {"input_ids": (1, T), "past_key_0": (1, P, self.kv_heads, self.head_dim)}
        fitting = [p for p in range(len(self.engine.contexts)) if self.engine.fits(p, shapes)]
        if fitting:   # the profile tuned for the nearest token count (prefill ~ a prompt, verify ~ the tree)
            return min(fitting, key=lambda p: abs(self.engine.profile_range(p, "input_ids")[1][1] - T))
        raise ValueError(f"{self.engine.path}: no optimization profile takes {T} new tokens after {P} committed "
                         f"ones; rebuild with larger engines.profiles")

    def forward(self, input_ids, positions, mask, last_only=False):
        T, P = int(input_ids.shape[0]), self.cache.length
        self.cache.stage(T)
        full = torch.ones(1, T, P + T, dtype=torch.bool)
        full[0, :, P:] = mask
        feeds = {"input_ids": _cuda(input_ids[None], torch.int64), "position_ids": _cuda(positions[None], torch.int64),
                 "attention_mask": _cuda(full, torch.bool),
                 "logits_index": _cuda(torch.tensor([T - 1] if last_only else list(range(T))), torch.int64)}
        outputs = {}
        for i in range(self.num_layers):   # past = committed prefix, new rows = staged rows: views, no copies
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = self.cache.k[i, :, :P], self.cache.v[i, :, :P]
            outputs[f"new_key_{i}"], outputs[f"new_value_{i}"] = self.cache.k[i, :, P:P + T], self.cache.v[i, :, P:P + T]
        self.engine.run(self._profile(T, P), feeds, outputs)
        # Verification runs on the host (a few hundred values); the captured states stay on the GPU.
        return outputs["logits"][0].float().cpu(), outputs["captured"][0]

    def commit(self, rows: list[int]) -> None:
        self.cache.commit(rows)


class TrtDrafter:
    def __init__(self, plan: str | Path, shape: TreeShape, stream: torch.cuda.Stream | None = None):
        self.engine = Engine(plan, stream)
        lo, _, _ = self.engine.profile_range(0, "past_key")
        self.kv_heads, self.head_dim = lo[2], lo[3]
        self.dtype = self.engine.dtypes["past_key"]
        self.shape = shape
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(1, self.kv_heads, self.head_dim, capacity, self.dtype, "cuda")

    def draft(self, captured: torch.Tensor, input_ids: torch.Tensor) -> DraftTree:
        T, P = int(input_ids.shape[0]), self.cache.length
        self.cache.stage(T)
        feeds = {"captured": _cuda(captured[None], self.engine.dtypes["captured"]),
                 "input_ids": _cuda(input_ids[None], torch.int64),
                 "past_key": self.cache.k[0, :, :P], "past_value": self.cache.v[0, :, :P]}
        outputs = {"new_key": self.cache.k[0, :, P:P + T], "new_value": self.cache.v[0, :, P:P + T]}
        self.engine.run(0, feeds, outputs)
        if int(outputs["tree_tokens"].shape[0]) != self.shape.total_tokens:
            raise ValueError(f"{self.engine.path}: engine drafts {outputs['tree_tokens'].shape[0]} nodes, the decoder "
                             f"expects total_tokens {self.shape.total_tokens}")
        self.cache.commit(list(range(T)))
        tree = {n: outputs[n].cpu() for n in ("tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores")}
        return DraftTree(tree["tree_tokens"], tree["tree_parents"], tree["tree_mask"], tree["tree_depths"],
                         tree["tree_scores"].float())


__all__ = ["Engine", "TrtDrafter", "TrtTarget"]
