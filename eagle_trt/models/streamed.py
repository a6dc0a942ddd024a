"""A target whose weights stay in its checkpoint files: what the build runs on, whatever the
target's size.

`StreamedTarget` is a LlamaTarget on the meta device (its structure and buffers, no weights)
that is given real weights one part at a time, for as long as a `with` block needs them:
the embedding, one decoder layer, the final norm and lm_head, each read from the safetensors
shards (tensor_files.py) in the dtype asked for and dropped at the end of the block.

`forward_many` runs a list of calls through the model part by part: every call through the
embedding, then every call through layer 0, layer 1, ..., then the head, with the module's own
arithmetic (LlamaTarget.begin / step / finish), so its outputs are the loaded model's bit for bit
while at most one part's weights are in memory. Calibration and parity's references run on it:
a real-size target is never in memory as a whole, let alone twice.

`fake_quant` makes it the fake-quant reference instead: each quantized Linear of a part becomes
its QuantLinear as the part is read, and goes with it. The quantization code hands that function
in (quant.fakequant.LinearQuantizer), and the checkpoint helpers come from tensor_files.py, so
models/ imports neither quant nor checkpoints: the exported graphs' cache keys (codehash.py)
follow the model's code, not the quantizer's or the loaders'."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import CaptureLayers, TargetConfig, read_json
from ..tensor_files import HF_PREFIX, CheckpointError, TensorFiles, check_shapes, load_tokenizer, parameters_on_meta
from .target import LlamaTarget, TargetOutput

@dataclass
class TargetCall:
    """The inputs of one LlamaTarget forward call (past as [B, Hkv, P, D] per layer)."""
    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    past_k: list[Tensor]
    past_v: list[Tensor]
    logits_index: Tensor | None = None


@dataclass(frozen=True)
class WeightRef:
    """A weight by identity (`key`: one key, one stored tensor), shape and a way to read it: a
    module's own tensor, or one still in a checkpoint file (export/weights.py writes either)."""
    key: object
    shape: tuple[int, ...]
    read: Callable[[], Tensor]


class StreamedTarget:
    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.folder = Path(folder)
        self.config = TargetConfig.from_hf(read_json(self.folder / "config.json"), str(self.folder / "config.json"))
        self.files = TensorFiles(self.folder)
        with parameters_on_meta():
            # its buffers (RoPE's inv_freq) in `dtype`, as a loaded model's and the exported graph's
            self.model = LlamaTarget(self.config).to(dtype).eval()
        self.dtype, self.device = dtype, torch.device(device)
        # while a fake-quant reference: (module path, Linear) -> what runs in its place, None to keep it
        self.fake_quant: Callable[[str, nn.Linear], nn.Module | None] | None = None
        names = {HF_PREFIX.sub("", k): k for k in self.files.entries}
        if self.config.tie_word_embeddings:
            names.pop("lm_head.weight", None)    # tied: the embedding is the head
        expected = {k: tuple(p.shape) for k, p in self.model.named_parameters()}
        optional = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        check_shapes(expected, {k: self.files.shape(v) for k, v in names.items()}, self.files.source, optional,
                     names)
        if self.config.tie_word_embeddings:
            names["lm_head.weight"] = names["embed_tokens.weight"]
        self.keys = names                         # module parameter name -> the file's name for it
        self._param_names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}

    # ------------------------------------------------------------------ parts

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def set_capture(self, capture: CaptureLayers) -> None:
        self.model.set_capture(capture)

    @property
    def capture_streams(self) -> tuple[int, ...]:
        return self.model.capture_streams

    def read(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The parameter `name` (a module name: layers.0.mlp.up_proj.weight) from the files."""
        return self.files.read(self.keys[name], dtype or self.dtype, self.device)

    def weight_ref(self, param: Tensor) -> WeightRef | None:
        """The file tensor behind one of the meta model's parameters (None for anything else)."""
        name = self._param_names.get(id(param))
        if name is None:
            return None
        key = self.keys[name]
        return WeightRef(key, self.files.shape(key), lambda: self.files.read(key, self.dtype))

    @contextmanager
    def loaded(self, *parts: str) -> Iterator[LlamaTarget]:
        """The model with the parameters of the modules `parts` ('embed_tokens', 'layers.3',
        'norm', 'lm_head') read from the files, for the with block; meta again after it."""
        saved: list[tuple[nn.Module, str, nn.Parameter]] = []
        swapped: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for part in parts:
                for sub_name, sub in self.model.get_submodule(part).named_modules():
                    prefix = f"{part}.{sub_name}" if sub_name else part
                    for attr, p in list(sub._parameters.items()):
                        if p is not None and p.is_meta:
                            saved.append((sub, attr, p))
                            sub._parameters[attr] = nn.Parameter(self.read(f"{prefix}.{attr}"), requires_grad=False)
            if self.fake_quant is not None:
                swapped = self._quantize_parts(parts)
            yield self.model
        finally:
            for parent, name, module in reversed(swapped):
                setattr(parent, name, module)
            for sub, attr, p in reversed(saved):
                sub._parameters[attr] = p

    def _quantize_parts(self, parts: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Module]]:
        """Each Linear of the parts replaced by what fake_quant makes of it (its QuantLinear; None:
        kept); returns (parent, attribute, the Linear) to put back."""
        swapped = []
        for part in parts:
            for sub_name, sub in list(self.model.get_submodule(part).named_modules()):
                path = f"{part}.{sub_name}" if sub_name else part
                quantized = self.fake_quant(path, sub) if isinstance(sub, nn.Linear) else None
                if quantized is None:
                    continue
                parent_path, _, attr = path.rpartition(".")
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                swapped.append((parent, attr, sub))
                setattr(parent, attr, quantized)
        return swapped

    def parts(self) -> list[tuple[str, ...]]:
        """The parts in forward order, each a tuple of module names loaded together."""
        return [("embed_tokens",)] + [(f"layers.{i}",) for i in range(self.num_layers)] + [("norm", "lm_head")]

    @property
    def cfg(self) -> TargetConfig:       # as LlamaTarget.cfg
        return self.config

    def tokenizer(self):
        return load_tokenizer(self.folder)

    # ------------------------------------------------------------------ forward, part by part

    def forward_many(self, calls: list[TargetCall], keep_kv: bool = True, keep_outputs: bool = True,
                     on_part: Callable[[str], None] | None = None) -> list[TargetOutput | None]:
        """LlamaTarget.forward of every call, computed part by part (module docstring). keep_kv
        False: the new KV rows are dropped as they are made; keep_outputs False: so is each
        call's output (calibration records what its hooks see, and needs neither)."""
        m, dev = self.model, self.device
        with torch.no_grad():
            with self.loaded("embed_tokens"):
                states = [m.begin(c.input_ids.to(dev), c.position_ids.to(dev), c.attention_mask.to(dev),
                                  [k.to(dev) for k in c.past_k], [v.to(dev) for v in c.past_v]) for c in calls]
            _done(on_part, "embed_tokens")
            for i in range(self.num_layers):
                with self.loaded(f"layers.{i}"):
                    for s in states:
                        m.step(i, s)
                        if not keep_kv:
                            s.new_k[-1] = s.new_v[-1] = None
                        s.past_k[i] = s.past_v[i] = None     # read: not needed again
                _done(on_part, f"layers.{i}")
            out = []
            with self.loaded("norm", "lm_head"):
                for c in calls:
                    o = m.finish(states.pop(0), None if c.logits_index is None else c.logits_index.to(dev))
                    out.append(o if keep_outputs else None)
            _done(on_part, "lm_head")
        return out

    def __call__(self, input_ids, position_ids, attention_mask, past_k, past_v, logits_index=None) -> TargetOutput:
        """One call, as LlamaTarget's forward (part by part)."""
        return self.forward_many([TargetCall(input_ids, position_ids, attention_mask, list(past_k), list(past_v),
                                             logits_index)])[0]

    def empty_past(self, batch: int = 1, dtype: torch.dtype | None = None, device=None):
        return self.model.empty_past(batch, dtype or self.dtype, device or self.device)

    def with_dtype(self, dtype: torch.dtype) -> "StreamedTarget":
        """The same files and capture, read as `dtype`, with a model of its own (its buffers in
        `dtype`; without weights, copying it copies almost nothing)."""
        other = object.__new__(StreamedTarget)
        other.__dict__.update(self.__dict__)
        other.dtype = dtype
        other.model = copy.deepcopy(self.model).to(dtype)
        other._param_names = {id(p): n for n, p in other.model.named_parameters(remove_duplicate=False)}
        return other

    def describe(self) -> str:
        return f"{self.folder} ({self.num_layers} layers, read part by part as {str(self.dtype).removeprefix('torch.')})"


def _done(on_part, name: str) -> None:
    if on_part is not None:
        on_part(name)


__all__ = ["CheckpointError", "StreamedTarget", "TargetCall", "WeightRef"]
