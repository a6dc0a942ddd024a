"""The speculative decoding loop over a batch of sequences, with continuous batching, and plain
autoregressive decoding as the same loop without a drafter. Backend-agnostic: see backend.py.

One iteration (`step`) for the B running sequences:
  1. the cost model (cost.py) picks n, the draft nodes each sequence verifies (all N without one);
  2. n > 0: one drafter call encodes every sequence's newly committed rows and drafts its tree;
  3. one target call verifies each root plus the n best nodes of its tree ([B, 1 + n] rows);
  4. per sequence: accept (greedy or sampled, its own seed), commit its accepted rows, stream
     its new tokens; a sequence that hits EOS or max_new_tokens, or whose client stopped,
     leaves at once and frees its slot.
Sequences join between iterations (`add`): the prompt is prefilled alone (B = 1 on its slot;
prompts differ too much in length to pad together, and a long prefill is compute-bound
anyway). The drafter sees a sequence's committed rows only when the batch next drafts: a
sequence with more pending rows than one iteration accepts (a new prompt, or rows from
iterations that decoded plainly) has all but its last row encoded alone first, so the batched
drafter call pads to a few rows, and a batch that never drafts does no drafter work at all.
`generate` is this loop with one sequence."""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from ..config import ConfigError, SamplingConfig
from ..models.target import causal_mask
from ..tree import DraftTree, rank_desc, rank_of
from ..verify import accept_sampled, sample_token
from .backend import DrafterBackend, KeptRows, TargetBackend
from .cost import CostModel, NodeTrim


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
                  context: str = "the target's context", source: str = "max_position_embeddings") -> None:
    if len(prompt_ids) == 0:
        raise ConfigError("the prompt is empty: nothing to condition on")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                          f"{context} of {max_context} tokens ({source})")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
        raise ConfigError(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


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


def _cat_rows(parts: list):
    """One sequence's pending state blocks as one (tensors, or numpy arrays from keep_states)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


def _pad_rows(parts: list, T: int):
    """[B, T, W] from blocks of at most T rows, zero-padded (padding rows are never committed nor seen)."""
    if not isinstance(parts[0], np.ndarray):
        return pad_sequence(parts, batch_first=True)
    out = np.zeros((len(parts), T, parts[0].shape[-1]), dtype=parts[0].dtype)
    for i, p in enumerate(parts):
        out[i, :len(p)] = p
    return out


@functools.cache
def root_only_tree() -> DraftTree:
    """The root alone (verifying it is one step of plain decoding), on the CPU where sampled
    acceptance reads it; made once: nothing writes it."""
    z = torch.zeros(0, dtype=torch.int64)
    return DraftTree(z, torch.full((1,), -1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool),
                     torch.zeros(1, dtype=torch.int64), z.float())


def _host_rows(path, length, tokens, ranks: Tensor | None) -> list[list[int]]:
    """Per sequence [*path, length, *tokens, *ranks] as Python ints: one transfer from a device
    (one concatenated tensor); on the CPU (tensors, or a backend's numpy arrays), where there is
    nothing to transfer, each part's lists joined in Python (cheaper than the concatenation)."""
    if isinstance(path, Tensor) and path.device.type != "cpu":
        parts = [path, length[:, None], tokens] + ([ranks.to(path.device, path.dtype)] if ranks is not None else [])
        return torch.cat(parts, 1).tolist()
    lists = [path.tolist(), [[n] for n in length.tolist()], tokens.tolist()]
    if ranks is not None:
        lists.append(ranks.tolist())
    return [[x for part in row for x in part] for row in zip(*lists)]


class Sequence:
    """One request's decoding state inside the batch."""

    def __init__(self, request: Request, gen: torch.Generator | None, start: float):
        self.request, self.gen, self.start = request, gen, start
        self.result = GenerationResult(tokens=[], prompt_tokens=len(request.prompt_ids))
        self.emitted = 0
        self.pending_states: list = []    # [r, A * H] target states (keep_states) of committed rows the drafter has not seen
        self.pending_ids: list[int] = []  # the ids one position later (the last is the root)
        self.stop: str | None = None

    def extend(self, new: list[int], eos_ids: set[int]) -> None:
        r = self.result
        now = time.perf_counter() - self.start
        kept, self.stop = _finish(len(r.tokens), new, self.request.max_new_tokens, eos_ids)
        r.tokens += kept
        on_tokens = self.request.on_tokens
        if len(r.tokens) > self.emitted:
            r.token_times += [now] * (len(r.tokens) - self.emitted)
            if on_tokens is not None and on_tokens(r.tokens[self.emitted:]) is False:
                self.stop = self.stop or "cancelled"
            self.emitted = len(r.tokens)
        if self.stop:
            r.stop_reason, r.seconds = self.stop, now


class DecodingLoop:
    """What every decoding loop shares: requests join (`add`), every running sequence advances
    one iteration per `step`, and the offline entry points below drive the two. `active[i]` is
    the sequence in slot i of the loop's caches."""

    def __init__(self, eos_ids: set[int] | list[int], vocab_size: int | None = None):
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size
        self.active: list[Sequence] = []

    def add(self, request: Request) -> Sequence:
        raise NotImplementedError

    def step(self) -> list[Sequence]:
        raise NotImplementedError

    def _leave(self, slot: int) -> None:
        raise NotImplementedError

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Drop a sequence between steps (its client went away)."""
        if seq in self.active:
            seq.stop = seq.result.stop_reason = reason
            seq.result.seconds = time.perf_counter() - seq.start
            self._leave(self.active.index(seq))

    def generate_batch(self, requests: list[Request], max_batch: int = 8) -> list[GenerationResult]:
        """Decode every request, at most max_batch at a time: a request joins as soon as a running
        one finishes (offline continuous batching; the Triton model feeds `add` from its queue)."""
        waiting, seqs = list(requests), []
        now = time.perf_counter()
        for r in waiting:
            r.submitted = r.submitted or now
        while waiting or self.active:
            while waiting and len(self.active) < max_batch:
                seqs.append(self.add(waiting.pop(0)))
            self.step()
        return [s.result for s in seqs]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
        """One sequence: on_tokens(ids) streams the tokens as they become final; returning False stops early."""
        return self.generate_batch([Request(prompt_ids, max_new_tokens, sampling or SamplingConfig(), on_tokens)], 1)[0]


class SpeculativeDecoder(DecodingLoop):
    """drafter=None: plain autoregressive decoding through the same loop.
    cost_model: choose per iteration how many draft nodes to verify (runtime/cost.py); None
    verifies every node of every tree.
    trim: without a cost model, verify per iteration only the nodes whose scores pay for their
    rows (runtime/cost.py NodeTrim; bench --node-trim).
    iteration: drafting and verification in one graph call (OrtIteration over these two
    backends: `run(states, ids, new_lengths, nodes=n)` returns the trees and verify's outputs),
    used for every iteration that drafts (whole trees only, with a graph composed before format
    3); with a cost model, once it has timed the two calls apart (CostModel.warming_up). It
    takes no trim (that picks the nodes between the calls)."""

    def __init__(self, target: TargetBackend, drafter: DrafterBackend | None, eos_ids: set[int] | list[int],
                 vocab_size: int | None = None, cost_model: CostModel | None = None, trim: NodeTrim | None = None,
                 iteration=None):
        if cost_model is not None and trim is not None:
            raise ConfigError("a decoder takes a cost model or a node trim, not both (the cost model picks n per batch)")
        if iteration is not None and trim is not None:
            raise ConfigError("node trim picks the nodes to verify between the drafter and target calls: it takes "
                              "no iteration graph")
        if iteration is not None and (iteration.target is not target or iteration.drafter is not drafter):
            raise ConfigError("the iteration graph's backends must be the decoder's target and drafter (they share "
                              "the KV caches)")
        super().__init__(eos_ids, vocab_size)
        self.iteration = iteration
        self.target, self.drafter = target, drafter
        self.cost_model = cost_model
        self.trim = trim if drafter is not None else None
        self.verified: list[int] = []         # draft nodes verified per sequence, per iteration
        self.kept: list | None = None         # the last step's keep_states (an iteration graph's hand-off)

    @property
    def nodes(self) -> int:
        return self.drafter.shape.total_tokens if self.drafter is not None else 0

    def _timed(self, call, record):
        if self.cost_model is None and self.trim is None:
            return call()
        start = time.perf_counter()
        out = call()
        record(time.perf_counter() - start)
        return out

    def _time_target(self, rows: int, seconds: float, prefill: bool = False) -> None:
        for timer in (self.cost_model, self.trim):
            if timer is not None:
                timer.time_target(rows, seconds, prefill)

    def _time_draft(self, batch: int, rows: int, seconds: float) -> None:
        if self.cost_model is not None:     # NodeTrim decides after drafting: it needs no drafter costs
            self.cost_model.time_draft(batch, rows, seconds)

    def reset(self) -> None:
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.active, self.kept = [], None

    def add(self, request: Request) -> Sequence:
        """Validate and prefill a request; it decodes from the next step on. Raises ConfigError
        for a request the decoder would refuse, before touching the caches."""
        sampling = (request.sampling or SamplingConfig()).validate()
        request.sampling = sampling
        check_request(request.prompt_ids, request.max_new_tokens, self.target.max_context, self.vocab_size)
        if not self.active:   # nothing running: start from fresh caches
            self.reset()
        seq = Sequence(request, torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
                       request.submitted or time.perf_counter())
        prompt, n = request.prompt_ids, len(request.prompt_ids)
        # No rows reserved ahead: the cache grows in chunks as sequences do, since a batched call
        # binds every row of the cache and reserving max_new_tokens up front widens every
        # sequence's attention to the longest request's end for the whole run.
        slot = self.target.add_sequence()
        here = range(slot, slot + 1)
        ids = torch.tensor([prompt], dtype=torch.int64)
        logits, captured = self._timed(
            lambda: self.target.forward(ids, torch.arange(n)[None], causal_mask(n, 0), here, last_only=True),
            lambda s: self._time_target(n, s, prefill=True))
        self.target.commit([list(range(n))])
        seq.result.target_calls = 1
        self.active.append(seq)
        first = self.target.greedy_next(logits)[0] if sampling.greedy else sample_token(logits[0, -1], sampling, seq.gen)
        # The drafter pairs the target state of token t with the id of token t + 1.
        # a copy: a backend's outputs are valid until its next call of the same shape
        seq.pending_states, seq.pending_ids = self.target.keep_states(captured, [list(range(n))]), prompt[1:] + [first]
        if self.drafter is not None:
            self.drafter.add_sequence()
        seq.extend([first], self.eos_ids)
        if seq.stop:
            self._leave(slot)
        return seq

    def _leave(self, slot: int) -> None:
        self.target.remove_sequence(slot)
        if self.drafter is not None:
            self.drafter.remove_sequence(slot)
        self.active[slot] = self.active[-1]
        self.active.pop()

    def _backlog(self, s: Sequence) -> int:
        """Pending rows beyond what one iteration accepts (a new prompt, plain steps): encoded alone."""
        return len(s.pending_ids) - 1 if len(s.pending_ids) > self.drafter.shape.depth + 1 else 0

    def _handed_off(self, batch: list[Sequence]) -> KeptRows | None:
        """The last step's hand-off (the iteration graph's own block of the accepted rows), where
        it is still exactly what this batch encodes: the same sequences in the same slots, each
        with only the rows that step accepted pending."""
        kept = self.kept
        if not isinstance(kept, KeptRows) or len(kept) != len(batch):
            return None
        if all(len(s.pending_states) == 1 and s.pending_states[0] is k for s, k in zip(batch, kept)):
            return kept
        return None

    def _draft(self, batch: list[Sequence], one_call: int = 0) -> tuple[DraftTree, float, tuple | None]:
        """The batch's trees, the seconds spent catching the drafter up on backlogs, and with
        one_call = n > 0 (the iteration graph verifying each tree's n best nodes) the
        verification's outputs (None: the target verifies)."""
        caught_up, rows, start = False, 0, time.perf_counter()
        for i, s in enumerate(batch):
            states = _cat_rows(s.pending_states)
            s.pending_states = [states]
            if self._backlog(s):                    # its tree is not needed
                rows += self._backlog(s)
                self.drafter.draft(states[None, :-1], [s.pending_ids[:-1]], None, range(i, i + 1))
                s.pending_states, s.pending_ids = [states[-1:]], s.pending_ids[-1:]
                caught_up = True
        catch_up = time.perf_counter() - start if caught_up else 0.0
        if caught_up and self.cost_model is not None:
            self.cost_model.time_catch_up(rows, catch_up)
        lengths = [len(s.pending_ids) for s in batch]
        T = max(lengths)
        handoff = self._handed_off(batch) if one_call else None
        if handoff is not None:         # in place, as the last iteration graph call gathered them
            states, ids = handoff.states, handoff.ids
        elif len(batch) == 1:           # one sequence: its rows as they are
            states, ids = batch[0].pending_states[0][None], [batch[0].pending_ids]
        else:                           # padded to T rows; padding rows are never committed nor seen
            states = _pad_rows([s.pending_states[0] for s in batch], T)
            ids = [s.pending_ids + [0] * (T - len(s.pending_ids)) for s in batch]
        verified = None
        if one_call:
            trees, *verified = self.iteration.run(states, ids, lengths, nodes=one_call)
        else:
            trees = self._timed(lambda: self.drafter.draft(states, ids, lengths),
                                lambda sec: self._time_draft(len(batch), T, sec))
        for s in batch:
            s.pending_states, s.pending_ids = [], []
            s.result.drafter_calls += 1
        return trees, catch_up, verified

    def step(self) -> list[Sequence]:
        """One iteration for every active sequence; returns those that finished in it."""
        batch = list(self.active)
        if not batch:
            return []
        B, start, catch_up = len(batch), time.perf_counter(), 0.0
        if self.cost_model is None or self.drafter is None:
            n = self.nodes
        else:
            behind = [s for s in batch if self._backlog(s)]
            left = [s.request.max_new_tokens - len(s.result.tokens) for s in behind]
            n = self.cost_model.choose(B, sum(self._backlog(s) for s in behind), sum(left) // max(len(left), 1))
        roots = [s.result.tokens[-1] for s in batch]
        # the verified trees, where the drafter made them: every node, or each tree's n best (one
        # batched selection); the verification inputs are built there too, so on a GPU the only
        # host-to-device copies are the roots and lengths
        verified = done = None
        if n > 0:
            # in one call where there is an iteration graph (once a cost model has timed the two
            # calls apart: it cannot split one); subtrees too where the graph takes verify_nodes
            one_call = n if (self.iteration is not None and (n == self.nodes or self.iteration.any_nodes)
                             and (self.cost_model is None or not self.cost_model.warming_up)) else 0
            full, catch_up, done = self._draft(batch, one_call)   # done: verified in the same call
            if self.trim is not None:
                n = self.trim.choose(full.scores, n)
            verified = full.top(n)
        self.verified.append(n)

        def tree(i: int) -> DraftTree:
            return verified.row(i) if verified is not None else root_only_tree()
        logits, captured, ids, mask = done or self._timed(lambda: self.target.verify(roots, verified),
                                                          lambda s: self._time_target(B * (1 + n), s))
        paths, news = [], []
        # greedy rows: the whole batch at once (inside the target graph where it has the accept_*
        # outputs), and one transfer to the host of every path, length and token (and, for the
        # cost model, each node's rank in its tree)
        path_t, length_t, tokens_t = self.target.accept_greedy(logits, ids, mask)
        K = path_t.shape[1]
        observe = self.cost_model is not None and verified is not None
        # the accepted nodes' score ranks for the cost model: on a device ranked there and sent
        # with the paths; on the CPU ranked in Python, accepted nodes only, from the scores as lists
        scores = verified.host_scores() if observe else None
        on_host = isinstance(scores, np.ndarray)
        score_rows = scores.tolist() if on_host else None
        greedy = _host_rows(path_t, length_t, tokens_t, rank_desc(scores) if observe and not on_host else None)
        ranks_at = K + 1 + tokens_t.shape[1]
        for i, (row, s) in enumerate(zip(greedy, batch)):
            sampling = s.request.sampling
            if sampling.greedy:
                length = row[K]
                path, new = row[:length], row[K + 1:K + 1 + length]
            else:
                path, bonus = accept_sampled(tree(i).to("cpu"), logits[i], sampling, s.gen)
                new = [int(ids[i, j]) for j in path[1:]] + [bonus]
            paths.append(path)
            news.append(new)
            if observe:
                self.cost_model.observe([rank_of(score_rows[i], j - 1) for j in path[1:]] if on_host
                                        else [row[ranks_at + j - 1] for j in path[1:]], n)
        self.target.commit(paths)
        if self.cost_model is not None:
            self.cost_model.time_iteration(B, n, time.perf_counter() - start - catch_up)
        if self.trim is not None:
            self.trim.time_iteration(sum(map(len, news)), time.perf_counter() - start - catch_up)
        finished = []
        kept = None
        if self.drafter is not None:   # what the drafter encodes when the batch next drafts
            greedy_paths = all(s.request.sampling.greedy for s in batch)   # then path_t is the index
            kept = self.target.keep_states(captured, paths, path_t if greedy_paths else None)
        self.kept = kept
        for i, (s, path, new) in enumerate(zip(batch, paths, news)):
            s.result.target_calls += 1
            s.result.accept_lengths.append(len(new))
            if kept is not None:
                s.pending_states.append(kept[i])
                s.pending_ids = s.pending_ids + new
            s.extend(new, self.eos_ids)
            if s.stop:
                finished.append(s)
        for s in finished:   # free slots at once; the last sequence moves into the freed slot
            self._leave(self.active.index(s))
        return finished


def generate_autoregressive(target: TargetBackend, prompt_ids: list[int], max_new_tokens: int,
                            eos_ids: set[int] | list[int], sampling: SamplingConfig | None = None,
                            vocab_size: int | None = None) -> GenerationResult:
    """Plain decoding with the same backend: one target call per token."""
    return SpeculativeDecoder(target, None, eos_ids, vocab_size).generate(prompt_ids, max_new_tokens, sampling)
