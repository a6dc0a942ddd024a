"""The decoding loop over a batch of sequences, with continuous batching; what an iteration
computes is an engine's.

The loop owns what every engine shares: admission (a request is checked, then prefilled into the
next slot), each sequence's bookkeeping, stop checks (EOS, a request's stop ids, max_new_tokens,
a client that stopped), streaming (`on_tokens`) and sampled acceptance (verify.accept_sampled on
the host, each sequence with its own seeded generator). Sequences join between iterations and
leave the moment they finish, the last slot moving into the freed one: `active[i]` is slot i.

Chunked prefill (`prefill_chunk`): admitted prompts wait in `prefilling` (first come, first
served), and each `step` prefills at most `prefill_chunk` of their tokens before the running
batch's iteration, so a long prompt delays the running streams by one chunk at a time, not by
its whole length. The engine holds a prompt's prefilled rows apart from the running batch until
its last chunk puts it in the next slot; how a prompt is cut does not change its tokens.

An `Engine` owns the caches and the graph calls: `prefill` a prompt into the next slot,
`iterate` the running batch (draft and verify; it returns `Verified`, and where every sequence is
greedy it may commit its own acceptance, a whole iteration in one graph), `commit` the accepted
rows, `leave` a slot. The engines: `static.StaticEngine` (PyTorch at fixed shapes, one CUDA
graph an iteration on a GPU), `two_call.TwoCallEngine` (a drafter and a target backend called in
turn: ONNX Runtime, TensorRT, Triton BLS; the cost model) and `two_call.IterationEngine`
(ONNX Runtime's iteration graph). Without a drafter an engine decodes plainly."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..config import ConfigError, SamplingConfig
from ..tree import DraftTree
from ..verify import accept_sampled, sample_token


@dataclass
class GenerationResult:
    tokens: list[int]                      # generated ids, prompt excluded
    accept_lengths: list[int] = field(default_factory=list)  # tokens per verify call, bonus included
    target_calls: int = 0                  # prefill included
    drafter_calls: int = 0                 # drafting iterations (encoding the prompt is part of prefill)
    seconds: float = 0.0
    prompt_tokens: int = 0
    stop_reason: str = ""                  # "eos", "max_new_tokens" or "cancelled" (on_tokens said stop)
    token_times: list[float] = field(default_factory=list)   # seconds from submission to each token being final

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def as_dict(self) -> dict:
        return dict(asdict(self), mean_accept_length=self.mean_accept_length)


def check_request(prompt_ids: list[int], max_new_tokens: int, max_context: int, vocab_size: int | None = None,
                  context: str = "the target's context", source: str = "max_position_embeddings",
                  stop_ids: tuple[int, ...] = ()) -> None:
    if len(prompt_ids) == 0:
        raise ConfigError("the prompt is empty: nothing to condition on")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                          f"{context} of {max_context} tokens ({source})")
    for what, ids in (("prompt token id", prompt_ids), ("stop id", stop_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None) if vocab_size is not None else None
        if bad is not None:
            raise ConfigError(f"{what} {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _finish(done: int, new: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], str | None]:
    """What a sequence with `done` tokens (none of them EOS: it would have stopped) keeps of
    `new`, and why it stops (None: it goes on). Only the new tokens are looked at."""
    new = new[:max_new_tokens - done]
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1], "eos"
    return new, "max_new_tokens" if done + len(new) >= max_new_tokens else None


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    on_tokens: Callable[[list[int]], bool | None] | None = None   # streams final tokens; False stops early
    submitted: float | None = None   # perf_counter() when the request arrived: result times count from it
    stop_ids: tuple[int, ...] = ()   # ids that end the sequence as EOS does (kept as its last token)


class Sequence:
    """One request's decoding state inside the batch (the engine holds its caches)."""

    def __init__(self, request: Request, gen: torch.Generator | None, start: float, eos_ids: set[int]):
        self.request, self.gen, self.start = request, gen, start
        self.eos_ids = eos_ids | set(request.stop_ids) if request.stop_ids else eos_ids
        self.result = GenerationResult(tokens=[], prompt_tokens=len(request.prompt_ids))
        self.emitted = 0
        self.stop: str | None = None

    def extend(self, new: list[int]) -> None:
        r = self.result
        now = time.perf_counter() - self.start
        kept, self.stop = _finish(len(r.tokens), new, self.request.max_new_tokens, self.eos_ids)
        r.tokens += kept
        on_tokens = self.request.on_tokens
        if len(r.tokens) > self.emitted:
            r.token_times += [now] * (len(r.tokens) - self.emitted)
            if on_tokens is not None and on_tokens(r.tokens[self.emitted:]) is False:
                self.stop = self.stop or "cancelled"
            self.emitted = len(r.tokens)
        if self.stop:
            r.stop_reason, r.seconds = self.stop, now


@dataclass
class Verified:
    """An iteration's verification of the running batch, as an engine hands it to the loop.
    greedy: per sequence [*path (K), length, *tokens (K), ...] as host ints, the engine's greedy
    acceptance (the accepted verified rows, root first; the tokens they add, bonus last); width K.
    committed: the engine committed those itself. For sampled sequences: logits [B, T, V], ids
    [B, T] (root, then the tree's tokens) and tree(i), sequence i's verified tree on the host."""
    greedy: list[list[int]]
    width: int
    nodes: int                   # draft nodes verified per sequence (0: a step of plain decoding)
    drafted: bool                # the drafter drafted this iteration
    committed: bool = False
    logits: Tensor | None = None
    ids: Tensor | None = None
    tree: Callable[[int], DraftTree] | None = None


class Engine:
    """What the loop asks of an engine (see the module docstring). `nodes`: draft nodes a tree
    has (0: plain decoding); `max_context`: the longest prompt + new tokens it takes;
    `max_batch`: the most sequences it runs at once (None: no bound); `backends`: the graph
    sessions whose calls it times (graph_seconds; runtime/timing.py)."""
    nodes: int = 0
    max_context: int
    max_batch: int | None = None
    backends: tuple = ()

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, prompt_ids: list[int], max_new_tokens: int, pick: Callable[[Tensor], int] | None,
                start: int = 0, end: int | None = None) -> int | None:
        """Prefill rows start..end of a new sequence's prompt (end None: to its end). The rows
        before `start` are this engine's previous calls for the same prompt, held apart from the
        running batch (iterations run between the calls); the call that reaches the prompt's end
        puts the sequence in the next slot and returns its first token: the greedy one (pick
        None), else pick(the last row's logits [V]). Earlier calls return None."""
        raise NotImplementedError

    def iterate(self, batch: list[Sequence], greedy: bool) -> Verified:
        raise NotImplementedError

    def commit(self, paths: list[list[int]], tokens: list[list[int]]) -> None:
        """Keep each sequence's accepted rows (paths[i], verified rows root first) and tokens."""
        raise NotImplementedError

    def leave(self, slot: int) -> None:
        raise NotImplementedError


class DecodingLoop:
    """Requests join (`add`), every running sequence advances one iteration per `step`, and the
    offline entry points below drive the two; `engine` computes the iterations. verified: the
    draft nodes verified per sequence, per iteration (what a cost model chose). prefill_chunk:
    prompt tokens prefilled per step (module docstring); None: a prompt is prefilled whole by `add`."""

    def __init__(self, engine: Engine, eos_ids: set[int] | list[int], vocab_size: int | None = None,
                 prefill_chunk: int | None = None):
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ConfigError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
        self.engine = engine
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size
        self.prefill_chunk = prefill_chunk
        self.active: list[Sequence] = []
        self.prefilling: list[Sequence] = []   # admitted, prompt not fully prefilled (chunked prefill)
        self.prefilled = 0                     # prompt rows of prefilling[0] the engine holds
        self.verified: list[int] = []

    @property
    def running(self) -> int:
        """Sequences admitted and not finished: decoding, or waiting for their prefill."""
        return len(self.active) + len(self.prefilling)

    def add(self, request: Request) -> Sequence:
        """Validate a request and prefill it (prefill_chunk None), else queue it for the steps to
        prefill; it decodes from the step after its prefill ends. Raises ConfigError for a request
        the engine would refuse, before touching the caches."""
        sampling = (request.sampling or SamplingConfig()).validate()
        request.sampling = sampling
        check_request(request.prompt_ids, request.max_new_tokens, self.engine.max_context, self.vocab_size,
                      stop_ids=request.stop_ids)
        limit = self.engine.max_batch
        if limit is not None and self.running >= limit:
            raise ConfigError(f"the batch is full: {limit} sequences (max_batch)")
        seq = Sequence(request, torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
                       request.submitted or time.perf_counter(), self.eos_ids)
        if self.prefill_chunk is None:
            self._prefill(seq, 0, len(request.prompt_ids))
        else:
            self.prefilling.append(seq)
        return seq

    def _prefill(self, seq: Sequence, start: int, end: int) -> bool:
        """Prefill rows start..end of seq's prompt; at its end the sequence joins the batch with
        its first token. Returns whether it joined."""
        request, sampling = seq.request, seq.request.sampling
        last = end == len(request.prompt_ids)
        if last and not self.active:   # nothing running: start from fresh caches (a chunked prompt's
            self.engine.reset()          # earlier rows are held apart from them)
        pick = None if sampling.greedy else (lambda logits: sample_token(logits, sampling, seq.gen))
        first = self.engine.prefill(request.prompt_ids, request.max_new_tokens, pick, start, end)
        if not last:
            return False
        seq.result.target_calls = 1
        self.active.append(seq)
        seq.extend([first])
        if seq.stop:
            self._leave(len(self.active) - 1)
        return True

    def _prefill_chunk(self) -> list[Sequence]:
        """Up to prefill_chunk prompt tokens of the waiting sequences, first come first served;
        returns those that finished at their first token."""
        budget, finished = self.prefill_chunk, []
        while self.prefilling and budget > 0:
            seq = self.prefilling[0]
            start = self.prefilled
            end = min(len(seq.request.prompt_ids), start + budget)
            budget -= end - start
            if not self._prefill(seq, start, end):
                self.prefilled = end
                break
            self.prefilled = 0
            self.prefilling.pop(0)
            if seq.stop:
                finished.append(seq)
        return finished

    def step(self) -> list[Sequence]:
        """A chunk of the waiting prompts' prefill (chunked prefill), then one iteration for every
        running sequence; returns those that finished in it."""
        joined = self._prefill_chunk() if self.prefilling else []
        batch = list(self.active)
        if not batch:
            return joined
        v = self.engine.iterate(batch, all(s.request.sampling.greedy for s in batch))
        K, paths, news = v.width, [], []
        for i, (row, s) in enumerate(zip(v.greedy, batch)):
            sampling = s.request.sampling
            if sampling.greedy:
                length = row[K]
                path, new = row[:length], row[K + 1:K + 1 + length]
            else:
                path, bonus = accept_sampled(v.tree(i), v.logits[i], sampling, s.gen)
                ids = v.ids[i].tolist()
                new = [ids[j] for j in path[1:]] + [bonus]
            paths.append(path)
            news.append(new)
        if not v.committed:
            self.engine.commit(paths, news)
        self.verified.append(v.nodes)
        finished = []
        for s, new in zip(batch, news):
            r = s.result
            r.target_calls += 1
            r.drafter_calls += v.drafted
            r.accept_lengths.append(len(new))
            s.extend(new)
            if s.stop:
                finished.append(s)
        for s in finished:   # free slots at once; the last sequence moves into the freed slot
            self._leave(self.active.index(s))
        return joined + finished

    def _leave(self, slot: int) -> None:
        self.engine.leave(slot)
        self.active[slot] = self.active[-1]
        self.active.pop()

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Drop a sequence between steps (its client went away)."""
        if seq in self.active:
            self._leave(self.active.index(seq))
        elif seq in self.prefilling:   # its held rows are dropped with the next prompt's first chunk
            if seq is self.prefilling[0]:
                self.prefilled = 0
            self.prefilling.remove(seq)
        else:
            return
        seq.stop = seq.result.stop_reason = reason
        seq.result.seconds = time.perf_counter() - seq.start

    def clear(self) -> None:
        """Forget every sequence, running or waiting for its prefill (a failed batch); the next
        `add` starts from fresh caches."""
        self.active.clear()
        self.prefilling.clear()
        self.prefilled = 0

    def generate_batch(self, requests: list[Request], max_batch: int = 8) -> list[GenerationResult]:
        """Decode every request, at most max_batch at a time: a request joins as soon as a running
        one finishes (offline continuous batching; the Triton model feeds `add` from its queue)."""
        max_batch = min(max_batch, self.engine.max_batch or max_batch)
        waiting, seqs = list(requests), []
        now = time.perf_counter()
        for r in waiting:
            r.submitted = r.submitted or now
        while waiting or self.running:
            while waiting and self.running < max_batch:
                seqs.append(self.add(waiting.pop(0)))
            self.step()
        return [s.result for s in seqs]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
        """One sequence: on_tokens(ids) streams the tokens as they become final; returning False stops early."""
        return self.generate_batch([Request(prompt_ids, max_new_tokens, sampling or SamplingConfig(), on_tokens)], 1)[0]
