"""Max calibration: the largest |input| each nn.Linear sees on real prompts.

The prompts are ShareGPT first-turn user messages from the validation split (eagle_trt/data.py;
never MT-bench, which is the evaluation set, and never the drafter's training
split), rendered with the target's chat template. The target runs over each prompt; the
drafter is fed the target's REAL captured features exactly as the decoder feeds it after a
prefill (state of token t paired with the id of token t + 1, the target's greedy next token
last) and then expands a full draft tree, so tree-step inputs are calibrated too.

A calibration file is JSON {module path: amax}, one per model, written atomically."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..config import TreeShape, read_json
from ..data import first_turns, sharegpt_file
from ..models.drafter import EagleDrafter
from ..models.streamed import StreamedTarget, TargetCall
from ..models.target import LlamaTarget, causal_mask
from ..tree import draft_tree
from .config import QuantError
from .fakequant import linear_paths

def calibration_prompts(tokenizer, count: int = 16, max_tokens: int = 256, path: Path | None = None
                        ) -> list[tuple[str, list[int]]]:
    """(sample id, chat-rendered ids) of up to `count` validation-split ShareGPT first turns of at
    most `max_tokens` tokens, with any MT-bench question rejected."""
    out = [(sid, ids) for sid, _, ids in first_turns(tokenizer, "val", count, max_tokens, min_tokens=2, path=path)]
    if not out:
        raise QuantError(f"{path or sharegpt_file()}: no validation-split prompts of at most {max_tokens} tokens "
                         f"for calibration")
    return out


class AmaxRecorder:
    """Forward pre-hooks on every nn.Linear of a model, keeping the max |input| per module path."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.amax: dict[str, float] = {}
        self.handles = []

    def _hook(self, path: str):
        def record(_module, args):
            value = float(args[0].detach().abs().max()) if args[0].numel() else 0.0
            if not math.isfinite(value):
                raise QuantError(f"calibration: module '{path}' received a non-finite input")
            self.amax[path] = max(self.amax.get(path, 0.0), value)
        return record

    def __enter__(self):
        for path, module in linear_paths(self.model).items():
            self.handles.append(module.register_forward_pre_hook(self._hook(path)))
        return self

    def __exit__(self, *_):
        for h in self.handles:
            h.remove()
        self.handles.clear()


@contextmanager
def _recording(model: nn.Module):
    recorder = AmaxRecorder(model)
    with recorder, torch.inference_mode():
        yield recorder
    never = sorted(set(linear_paths(model)) - set(recorder.amax))
    if never:
        raise QuantError(f"calibration: module(s) {never} never ran on the calibration prompts")


def _target_pass(target: LlamaTarget, ids: list[int], last_only: bool = False):
    """A prefill of `ids` on the target's device (logits of the last row only, if asked)."""
    n, dev = len(ids), target.embed_tokens.weight.device
    past_k, past_v = target.empty_past(device=dev)
    return target(torch.tensor([ids], device=dev), torch.arange(n, device=dev)[None], causal_mask(n, 0, dev),
                  past_k, past_v, torch.tensor([n - 1], device=dev) if last_only else None)


def _prefills(target: LlamaTarget | StreamedTarget, prompts: list[list[int]], on_step: Callable[[], None] | None,
              keep: bool):
    """A prefill of each prompt (kept when `keep`: the captured states and the last row's logits):
    by a StreamedTarget all at once, part by part (on_step after each part), else one prompt after
    another (on_step after each prompt). Not kept, every row gets logits (lm_head's amax)."""
    step = on_step or (lambda: None)
    if isinstance(target, StreamedTarget):
        calls = [TargetCall(torch.tensor([ids]), torch.arange(len(ids))[None], causal_mask(len(ids), 0),
                            *target.empty_past(), torch.tensor([len(ids) - 1]) if keep else None) for ids in prompts]
        return target.forward_many(calls, keep_kv=False, keep_outputs=keep, on_part=lambda _: step())
    outs = []
    for ids in prompts:
        out = _target_pass(target, ids, last_only=keep)
        outs.append(out if keep else None)
        step()
    return outs


def calibration_steps(target: LlamaTarget | StreamedTarget, prompts: list[list[int]]) -> int:
    """How many times calibrate_target / calibrate_drafter call on_prompt (for a progress bar)."""
    return len(target.parts()) if isinstance(target, StreamedTarget) else len(prompts)


def calibrate_target(target: LlamaTarget | StreamedTarget, prompts: list[list[int]],
                     on_prompt: Callable[[], None] | None = None) -> dict[str, float]:
    """{module path: max |input|} for every Linear of the target over the prompts (on_prompt is
    called after each prompt, or after each part of a StreamedTarget, for progress)."""
    model = target.model if isinstance(target, StreamedTarget) else target
    with _recording(model) as rec:
        _prefills(target, prompts, on_prompt, keep=False)
    return dict(sorted(rec.amax.items()))


DEFAULT_TREE = TreeShape(depth=5, top_k=4, total_tokens=16)


def calibrate_drafter(drafter: EagleDrafter, target: LlamaTarget | StreamedTarget, prompts: list[list[int]],
                      shape: TreeShape = DEFAULT_TREE, on_prompt: Callable[[], None] | None = None) -> dict[str, float]:
    """{module path: max |input|} for every Linear of the drafter, fed the target's real
    captured states of each prompt and then expanding a draft tree of `shape`. The target's
    capture layers are set to the drafter's (as prepare_models does)."""
    target.set_capture(drafter.cfg.capture_for(target.cfg))
    shape = shape.validate(drafter.cfg.draft_vocab_size)
    w = drafter.fc.weight
    streamed = isinstance(target, StreamedTarget)
    with torch.inference_mode():
        outs = _prefills(target, prompts, on_prompt if streamed else None, keep=True)
    with _recording(drafter) as rec:
        for ids, out in zip(prompts, outs):
            next_id = int(out.logits[0, -1].argmax())
            pk, pv = drafter.empty_past()
            draft_tree(drafter, out.captured.to(w.device, w.dtype), torch.tensor([ids[1:] + [next_id]], device=w.device),
                       pk, pv, shape)
            if on_prompt is not None and not streamed:
                on_prompt()
    return dict(sorted(rec.amax.items()))


# ----------------------------------------------------------------------------- files

def save_calibration(path: str | Path, amax: dict[str, float]) -> Path:
    """JSON {module path: amax}, written to a temporary sibling and renamed into place."""
    path = Path(path)
    for key, value in amax.items():
        if not isinstance(key, str) or not math.isfinite(float(value)) or value < 0:
            raise QuantError(f"{path}: refusing to write amax {value!r} for module {key!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({k: float(v) for k, v in sorted(amax.items())}, indent=1))
    os.replace(tmp, path)
    return path


def load_calibration(path: str | Path) -> dict[str, float]:
    path = Path(path)
    data = read_json(path, QuantError, "calibration file", "a JSON object {module path: amax}")
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise QuantError(f"{path}: amax of module '{key}' must be a finite number >= 0, got {value!r}")
    return {k: float(v) for k, v in data.items()}


__all__ = ["AmaxRecorder", "calibrate_drafter", "calibrate_target", "calibration_prompts", "calibration_steps",
           "load_calibration",
           "save_calibration"]
