"""Python API: load a target and a drafter, tokenize, run the speculative decoder."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from .checkpoints import LoadedTarget, load_drafter, load_target, random_drafter, save_drafter
from .config import ConfigError, SamplingConfig, TreeShape
from .models.drafter import EagleDrafter
from .runtime.backend import TorchDrafter, TorchTarget
from .runtime.decoder import SpeculativeDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"


def default_drafter_path(target_spec: str) -> Path | None:
    """The drafter shipped for the embedded default target, when there is one."""
    path = SHIPPED_DRAFTERS / "smollm2-eagle3.1"
    return path if target_spec == "smollm2" and (path / "config.json").is_file() else None


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not text or not text.strip():
        raise ConfigError("the prompt is empty: nothing to condition on")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat was given but the target's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Pipeline:
    target: LoadedTarget
    drafter: EagleDrafter
    drafter_source: str
    tokenizer: object
    decoder: SpeculativeDecoder

    def generate(self, prompt: str, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 chat: bool = False) -> dict:
        ids = encode_prompt(self.tokenizer, prompt, chat)
        result = self.decoder.generate(ids, max_new_tokens, sampling)
        out = result.as_dict()
        out["text"] = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        out["drafter"] = self.drafter_source
        out["drafter_variant"] = self.drafter.cfg.variant
        return out


def load_pipeline(target_spec: str, drafter_path: str | None, shape: TreeShape, dtype: str = "float32",
                  log: TextIO | None = None) -> Pipeline:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    t0 = time.perf_counter()
    target = load_target(target_spec, DTYPES[dtype])
    if drafter_path is None:
        drafter_path = default_drafter_path(str(target_spec))
    if drafter_path is None:
        # No trained drafter for this target: write a random EAGLE 3.1 one and load it back
        # through the ordinary checkpoint path, so the demo exercises the real loader.
        tmp = Path(tempfile.mkdtemp(prefix="eagle_trt_random_drafter_")) / "drafter"
        save_drafter(random_drafter(target, "eagle3.1", draft_vocab_size=min(8192, target.config.vocab_size)), tmp)
        drafter_path, source = tmp, f"random EAGLE 3.1 (untrained) at {tmp}"
    else:
        source = str(drafter_path)
    drafter = load_drafter(drafter_path, target, DTYPES[dtype])
    target.model.set_capture(drafter.cfg.capture_for(target.config))
    tokenizer = target.tokenizer()
    eos = set(target.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    decoder = SpeculativeDecoder(TorchTarget(target.model), TorchDrafter(drafter, shape), eos,
                                 vocab_size=target.config.vocab_size)
    if log is not None:
        print(f"loaded target {target.folder} and drafter {source} ({drafter.cfg.variant}) "
              f"in {time.perf_counter() - t0:.1f}s", file=log)
    return Pipeline(target, drafter, source, tokenizer, decoder)
