"""The engines over a target and a drafter backend (backend.py: ONNX Runtime, TensorRT, Triton
BLS, and the PyTorch reference), for the decoding loop (loop.py).

`TwoCallEngine`, one iteration of the B running sequences:
  1. the cost model (cost.py) picks n, the draft nodes each sequence verifies (all N without one);
  2. n > 0: one drafter call encodes every sequence's newly committed rows and drafts its tree;
  3. one target call verifies each root and the n best nodes of its tree, and its greedy
     acceptance (the graph's own where it computed one) goes to the host in one transfer;
  4. commit: the accepted rows kept, their captured states held for the drafter.
The drafter sees a sequence's committed rows only when the batch next drafts; a backlog longer
than one iteration accepts (a new prompt, plain steps) is encoded alone first, so the batched
drafter call pads to a few rows. Prompts are prefilled alone (B = 1 on their slot).

`IterationEngine` runs steps 2 and 3 as one call of the iteration graph (OrtIteration) for every
iteration that drafts, and hands the accepted rows' states from one call to the next where the
graph gathered them."""
from __future__ import annotations

import copy
import time
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from ..models.target import causal_mask
from ..tree import DraftTree, rank_desc, rank_of, root_only_tree
from .backend import DrafterBackend, KeptRows, TargetBackend, Verification
from .cost import CostModel
from .loop import Engine, Sequence, Verified


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


def _host_rows(path, length, tokens, ranks) -> list[list[int]]:
    """Per sequence [*path, length, *tokens, *ranks] as Python ints: one transfer from a device
    (one concatenated tensor); on the CPU (tensors, or a backend's numpy arrays), where there is
    nothing to transfer, each part's lists joined in Python (cheaper than the concatenation)."""
    if isinstance(path, torch.Tensor) and path.device.type != "cpu":
        parts = [path, length[:, None], tokens] + ([ranks.to(path.device, path.dtype)] if ranks is not None else [])
        return torch.cat(parts, 1).tolist()
    lists = [path.tolist(), [[n] for n in length.tolist()], tokens.tolist()]
    if ranks is not None:
        lists.append(ranks.tolist())
    return [[x for part in row for x in part] for row in zip(*lists)]


class _Iteration(NamedTuple):
    """What iterate() verified, for commit (index: the greedy paths, None where one sampled;
    ranks_at / score_rows: where the cost model reads the accepted nodes' ranks)."""
    start: float
    catch_up: float
    nodes: int
    out: Verification
    index: object
    rows: list[list[int]]
    ranks_at: int | None
    score_rows: list | None


class TwoCallEngine(Engine):
    """drafter None: plain decoding (the target verifies each root alone).
    cost_model: choose per iteration how many draft nodes to verify (runtime/cost.py); None
    verifies every node of every tree."""

    def __init__(self, target: TargetBackend, drafter: DrafterBackend | None = None,
                 cost_model: CostModel | None = None):
        self.target, self.drafter = target, drafter
        self.cost_model = cost_model if drafter is not None else None
        self.nodes = drafter.shape.total_tokens if drafter is not None else 0
        self.max_context = target.max_context
        # per slot: the target states of committed rows the drafter has not encoded (blocks from
        # keep_states), and the ids one position later (the last is the root)
        self.pending_states: list[list] = []
        self.pending_ids: list[list[int]] = []
        self.handoff: KeptRows | None = None   # the last commit's states, where a graph gathered them as one block
        self._last: _Iteration | None = None   # what iterate() verified, for commit
        self._apart: TargetBackend | None = None   # chunked prefill: a copy of the target, its own cache
        self._held: list = []                  # chunked prefill: the prompt's captured states so far

    @property
    def backends(self) -> tuple:
        return tuple(b for b in (self.target, self.drafter) if b is not None)

    def _timed(self, call, record: str, *args):
        """call(), its seconds given to the cost model's `record` after `args` (where there is one)."""
        if self.cost_model is None:
            return call()
        start = time.perf_counter()
        out = call()
        getattr(self.cost_model, record)(*args, time.perf_counter() - start)
        return out

    # ---- the Engine interface ----

    def reset(self) -> None:
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.pending_states, self.pending_ids, self.handoff = [], [], None

    def prefill(self, prompt_ids, max_new_tokens, pick, start=0, end=None):
        # No rows reserved ahead: the cache grows in chunks as sequences do, since a batched call
        # binds every row of the cache and reserving max_new_tokens up front widens every
        # sequence's attention to the longest request's end for the whole run.
        n = len(prompt_ids)
        end = n if end is None else end
        if start == 0:
            self._held = []     # the prompt's captured states, block by block (the drafter's, at its join)
        if start == 0 and end == n:      # whole: straight into the next slot
            target = self.target
            slot = target.add_sequence()
        else:   # a chunk: on a copy of the target with a cache of its own, apart from the running batch
            if self._apart is None:
                self._apart = copy.copy(self.target)
            target, slot = self._apart, 0
            if start == 0:
                target.reset()
                target.add_sequence()
        rows = [list(range(end - start))]
        out = self._timed(lambda: target.forward(torch.tensor([prompt_ids[start:end]]), torch.arange(start, end)[None],
                                                 causal_mask(end - start, 0), range(slot, slot + 1), last_only=True),
                          "time_prefill", end - start)
        target.commit(rows)
        if self.drafter is not None:   # a copy: a backend's outputs are valid until its next call of the same shape
            self._held += target.keep_states(out, rows)
        if end < n:
            return None
        if target is not self.target:    # the last chunk: the held rows join the batch in the next slot
            self.target.add_prefilled(target)
        first = self.target.greedy_next(out)[0] if pick is None else pick(out.logits[0, -1])
        if self.drafter is not None:
            # The drafter pairs the target state of token t with the id of token t + 1
            self.drafter.add_sequence()
            self.pending_states.append(self._held)
            self.pending_ids.append(list(prompt_ids[1:]) + [first])
        self._held = []
        self.handoff = None
        return first

    def leave(self, slot: int) -> None:
        self.target.remove_sequence(slot)
        if self.drafter is not None:
            self.drafter.remove_sequence(slot)
            for pending in (self.pending_states, self.pending_ids):
                pending[slot] = pending[-1]
                pending.pop()
        self.handoff = None

    def iterate(self, batch: list[Sequence], greedy: bool) -> Verified:
        B, start, catch_up = len(batch), time.perf_counter(), 0.0
        if self.cost_model is None:
            n = self.nodes
        else:
            behind = [i for i in range(B) if self._backlog(i)]
            left = [batch[i].request.max_new_tokens - len(batch[i].result.tokens) for i in behind]
            n = self.cost_model.choose(B, sum(self._backlog(i) for i in behind), sum(left) // max(len(left), 1))
        roots = [s.result.tokens[-1] for s in batch]
        # each tree's n best nodes, where the drafter made them (the verification inputs are built
        # there: on a GPU the only host-to-device copies are the roots and lengths)
        verified = out = None
        if n > 0:
            full, catch_up, out = self._draft(B, n)   # out: verified in the same call
            verified = full.top(n)
        if out is None:
            out = self._timed(lambda: self.target.verify(roots, verified), "time_target", B * (1 + n))
        # greedy acceptance of the whole batch (the graph's own where it has one), one transfer to
        # the host of every path, length and token (and the nodes' ranks the cost model reads:
        # on a device ranked there, on the CPU in Python from the scores as lists)
        path, length, tokens = self.target.accept_greedy(out)
        observe = self.cost_model is not None and verified is not None
        scores = verified.host_scores() if observe else None
        score_rows = scores.tolist() if isinstance(scores, np.ndarray) else None
        rows = _host_rows(path, length, tokens, rank_desc(scores) if observe and score_rows is None else None)
        self._last = _Iteration(start, catch_up, n, out, path if greedy else None, rows,
                                2 * int(path.shape[1]) + 1 if observe else None, score_rows)

        def tree(i: int) -> DraftTree:
            return verified.row(i).to("cpu") if verified is not None else root_only_tree()
        return Verified(rows, int(path.shape[1]), n, n > 0, logits=out.logits, ids=out.ids, tree=tree)

    def commit(self, paths, tokens) -> None:
        it, self._last = self._last, None
        self.target.commit(paths)
        if it.ranks_at is not None:     # the accepted nodes' ranks in their trees
            for i, path in enumerate(paths):
                self.cost_model.observe([rank_of(it.score_rows[i], j - 1) for j in path[1:]] if it.score_rows is not None
                                        else [it.rows[i][it.ranks_at + j - 1] for j in path[1:]], it.nodes)
        if self.cost_model is not None:
            self.cost_model.time_iteration(len(paths), it.nodes, time.perf_counter() - it.start - it.catch_up)
        self.handoff = None
        if self.drafter is None:
            return
        # what the drafter encodes when the batch next drafts (greedy paths: the graph's own
        # accept_path indexes them, and an iteration graph's hand-off holds them already)
        kept = self.target.keep_states(it.out, paths, it.index)
        if isinstance(kept, KeptRows):
            self.handoff = kept
        for i, new in enumerate(tokens):
            self.pending_states[i].append(kept[i])
            self.pending_ids[i] = self.pending_ids[i] + new

    # ---- drafting ----

    def _backlog(self, slot: int) -> int:
        """Pending rows beyond what one iteration accepts (a new prompt, plain steps): encoded alone."""
        ids = self.pending_ids[slot]
        return len(ids) - 1 if len(ids) > self.drafter.shape.depth + 1 else 0

    def _catch_up(self, B: int) -> float:
        """Encode every sequence's backlog alone (its tree is not needed); the seconds it took."""
        caught_up, rows, start = False, 0, time.perf_counter()
        for i in range(B):
            states = _cat_rows(self.pending_states[i])
            self.pending_states[i] = [states]
            backlog = self._backlog(i)
            if backlog:
                rows += backlog
                self.drafter.draft(states[None, :-1], [self.pending_ids[i][:-1]], None, range(i, i + 1))
                self.pending_states[i], self.pending_ids[i] = [states[-1:]], self.pending_ids[i][-1:]
                caught_up = True
        seconds = time.perf_counter() - start if caught_up else 0.0
        if caught_up and self.cost_model is not None:
            self.cost_model.time_catch_up(rows, seconds)
        return seconds

    def _drafter_inputs(self, B: int, handoff: bool = False):
        """Every sequence's pending rows as one batch: states [B, T, W], ids [B, T], lengths;
        handoff: the last call's hand-off block where there is one (an iteration graph's input)."""
        lengths = [len(ids) for ids in self.pending_ids[:B]]
        T = max(lengths)
        if handoff and self.handoff is not None:   # in place, as the last iteration graph call gathered them
            states, ids = self.handoff.states, self.handoff.ids
        elif B == 1:                    # one sequence: its rows as they are
            states, ids = self.pending_states[0][0][None], [self.pending_ids[0]]
        else:                           # padded to T rows; padding rows are never committed nor seen
            states = _pad_rows([p[0] for p in self.pending_states[:B]], T)
            ids = [p + [0] * (T - len(p)) for p in self.pending_ids[:B]]
        return states, ids, lengths, T

    def _drafted(self, B: int) -> None:
        self.pending_states[:B], self.pending_ids[:B] = [[] for _ in range(B)], [[] for _ in range(B)]

    def _draft(self, B: int, n: int) -> tuple[DraftTree, float, Verification | None]:
        """The batch's trees, the seconds spent catching the drafter up on backlogs, and where the
        same call verified them, the verification (None: the target verifies)."""
        catch_up = self._catch_up(B)
        states, ids, lengths, T = self._drafter_inputs(B)
        trees = self._timed(lambda: self.drafter.draft(states, ids, lengths), "time_draft", B, T)
        self._drafted(B)
        return trees, catch_up, None


class IterationEngine(TwoCallEngine):
    """TwoCallEngine with an iteration graph (OrtIteration over the engine's two backends: its
    `run(states, ids, new_lengths, nodes=n)` drafts and verifies in one call), used for every
    iteration that drafts: whole trees, or any subtree where the graph takes verify_nodes (graphs
    composed from format 3 on); with a cost model, once it has timed the two calls apart
    (CostModel.warming_up: it cannot split one call). The graph gathers the accepted rows'
    states itself (the hand-off): the next call reads them where it wrote them, with nothing
    copied on the host, while the batch stays the same (no join, no leave, no plain step)."""

    def __init__(self, iteration, cost_model: CostModel | None = None):
        super().__init__(iteration.target, iteration.drafter, cost_model)
        self.iteration = iteration

    @property
    def backends(self) -> tuple:
        return (self.target, self.drafter, self.iteration)

    def _one_call(self, n: int) -> bool:
        return ((n == self.nodes or self.iteration.any_nodes)
                and (self.cost_model is None or not self.cost_model.warming_up))

    def _draft(self, B: int, n: int):
        if not self._one_call(n):
            return super()._draft(B, n)
        catch_up = self._catch_up(B)
        handed_off = self.handoff is not None
        states, ids, lengths, _ = self._drafter_inputs(B, handoff=True)
        trees, out = self.iteration.run(states, ids, lengths, nodes=n, handed_off=handed_off)
        self._drafted(B)
        return trees, catch_up, out
