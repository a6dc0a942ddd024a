"""The speculative decoding loop (one drafter call and one target call per iteration) and the
plain autoregressive loop it is measured against. Backend-agnostic: see backend.py."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..config import ConfigError, SamplingConfig
from ..models.target import causal_mask
from ..verify import accept_greedy, accept_sampled, sample_token
from .backend import DrafterBackend, TargetBackend


@dataclass
class GenerationResult:
    tokens: list[int]                      # generated ids, prompt excluded
    accept_lengths: list[int] = field(default_factory=list)  # tokens per verify call, bonus included
    target_calls: int = 0                  # prefill included
    drafter_calls: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    stop_reason: str = ""                  # "eos", "max_new_tokens" or "cancelled" (on_tokens said stop)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def as_dict(self) -> dict:
        return dict(asdict(self), mean_accept_length=self.mean_accept_length)


def check_request(prompt_ids: list[int], max_new_tokens: int, max_context: int, vocab_size: int | None = None) -> None:
    if len(prompt_ids) == 0:
        raise ConfigError("the prompt is empty: nothing to condition on")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"target's context of {max_context} tokens (max_position_embeddings)")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
        raise ConfigError(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], str | None]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], "eos"
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], "max_new_tokens"
    return tokens, None


class SpeculativeDecoder:
    def __init__(self, target: TargetBackend, drafter: DrafterBackend, eos_ids: set[int] | list[int],
                 vocab_size: int | None = None):
        self.target, self.drafter = target, drafter
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
        """on_tokens(ids) streams the tokens as they become final; returning False stops early."""
        sampling = (sampling or SamplingConfig()).validate()
        check_request(prompt_ids, max_new_tokens, self.target.max_context, self.vocab_size)
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        start = time.perf_counter()
        n, N = len(prompt_ids), self.drafter.shape.total_tokens
        capacity = n + max_new_tokens + N + 1
        self.target.reset(capacity)
        self.drafter.reset(capacity)

        prompt = torch.tensor(prompt_ids, dtype=torch.int64)
        logits, captured = self.target.forward(prompt, torch.arange(n), causal_mask(n, 0)[0], last_only=True)
        self.target.commit(list(range(n)))
        out = [sample_token(logits[-1], sampling, gen)]
        result = GenerationResult(tokens=out, target_calls=1, prompt_tokens=n)
        # The drafter pairs the target state of token t with the id of token t + 1.
        pending_states, pending_ids = captured, torch.tensor(prompt_ids[1:] + out, dtype=torch.int64)

        emitted = 0
        while True:
            out, stop = _finish(out, max_new_tokens, self.eos_ids)
            if on_tokens is not None and len(out) > emitted:
                if on_tokens(out[emitted:]) is False:
                    stop = stop or "cancelled"
                emitted = len(out)
            if stop:
                break
            tree = self.drafter.draft(pending_states, pending_ids)
            result.drafter_calls += 1
            root = out[-1]
            ids = torch.cat((torch.full((1,), root, dtype=torch.int64, device=tree.tokens.device), tree.tokens))
            logits, captured = self.target.forward(ids, self.target.length + tree.depths, tree.mask)
            result.target_calls += 1
            if sampling.greedy:
                path, bonus = accept_greedy(tree, logits)
            else:
                path, bonus = accept_sampled(tree, logits, sampling, gen)
            self.target.commit(path)
            node_ids = ids.tolist()   # one transfer, not one per accepted node
            new = [node_ids[i] for i in path[1:]] + [bonus]
            result.accept_lengths.append(len(new))
            out = out + new
            pending_states, pending_ids = captured[path], torch.tensor(new, dtype=torch.int64)

        result.tokens, result.stop_reason = out, stop
        result.seconds = time.perf_counter() - start
        return result


def generate_autoregressive(target: TargetBackend, prompt_ids: list[int], max_new_tokens: int,
                            eos_ids: set[int] | list[int], sampling: SamplingConfig | None = None,
                            vocab_size: int | None = None) -> GenerationResult:
    """Plain decoding with the same backend: one target call per token."""
    sampling = (sampling or SamplingConfig()).validate()
    check_request(prompt_ids, max_new_tokens, target.max_context, vocab_size)
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = set(eos_ids)
    start = time.perf_counter()
    target.reset(len(prompt_ids) + max_new_tokens + 1)
    ids = torch.tensor(prompt_ids, dtype=torch.int64)
    positions = torch.arange(len(prompt_ids))
    result = GenerationResult(tokens=[], prompt_tokens=len(prompt_ids))
    while True:
        logits, _ = target.forward(ids, positions, causal_mask(len(ids), 0)[0], last_only=True)
        target.commit(list(range(len(ids))))
        result.target_calls += 1
        result.tokens.append(sample_token(logits[-1], sampling, gen))
        result.tokens, stop = _finish(result.tokens, max_new_tokens, eos)
        if stop:
            result.stop_reason = stop
            break
        ids = torch.tensor(result.tokens[-1:])
        positions = torch.tensor([target.length])
    result.seconds = time.perf_counter() - start
    return result
