"""The PyTorch engine of the decoding loop (loop.py): every tensor at a fixed shape and all state
on the device, so that a whole iteration replays as one CUDA graph (the way SGLang's EAGLE
worker and TensorRT-LLM's one-model path run on a GPU); on a CPU the same functions run as they
are. It calls the models directly.

State, laid out for `max_batch` slots of `capacity` rows (sequence b lives in slot b): the target
KV [2, L, B, Hkv, S, D] and drafter KV [2, 1, B, Hkv, S, D] (KVCache, fixed layout); lengths [B]
(target rows committed = the root's position) and drafted [B] (drafter rows); roots [B] (the last
committed token); the hand-off: states [B, R, A * Ht], ids [B, R], count [B], the rows the drafter
encodes next (the captured states of the rows the target accepted, paired with the tokens one
position later; R = the longest path an iteration accepts).

One iteration of the B running sequences (`iteration`), fixed shapes throughout:
  1. the drafter encodes its hand-off rows and expands each tree (tree.draft_trees, the
     function the drafter graph is exported from), reading its cache at full capacity;
  2. the target verifies root + N nodes (backend.verification_inputs) over its whole cache,
     rows past each sequence's length masked;
  3. greedy acceptance (verify.accept_greedy_batch, the target graph's own);
  4. commit: all T verified rows, in path order, written at rows lengths.. of each slot, lengths
     grown by the path's length (rows past it sit beyond the new length, masked: no shape
     depends on how much was accepted); the drafter's rows likewise;
  5. the hand-off for the next iteration, and the new roots.
It returns paths, lengths and tokens as one [B, 2T + 1] tensor: the one copy to the host an
iteration makes. A batch with sampled sequences splits at step 3 into two graphs, the host's
acceptance copied in between. Prefill runs outside the graphs, one request at a time. A request
that needs more rows than a slot holds lays the caches out again, larger, before it joins (new
CUDA graphs on a GPU: give a capacity there)."""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from ..config import ConfigError, TreeShape
from ..models.drafter import EagleDrafter
from ..models.target import LlamaTarget, causal_mask
from ..tree import DraftTree, draft_trees, root_only_tree
from ..verify import accept_greedy_batch
from .backend import attention_mask, verification_inputs
from .kv_cache import CHUNK, KVCache
from .loop import Engine, Sequence, Verified


CAPTURE_MODES = ("auto", "cuda-graph", "off")


class Replayer:
    """Runs the decoder's fixed-shape functions, keyed by (function, batch size): on a GPU a
    key's first call runs eagerly on a side stream (the warm-up capture wants; it is that
    iteration's real work), its second is captured as a CUDA graph and replayed, and every
    later one replays it (the outputs are the graph's own tensors, rewritten by each replay).
    Capture records without running, so the decoder's state advances exactly once a call.
    Elsewhere, or with capture off, the functions run as they are. compile: torch.compile each
    function (fullgraph: a graph break would be a host sync a capture cannot hold)."""

    def __init__(self, device: torch.device, capture: str = "auto", compile: bool = False, backend="inductor",
                 max_batch: int = 8):
        if capture not in CAPTURE_MODES:
            raise ConfigError(f"capture={capture!r}: expected one of {', '.join(CAPTURE_MODES)}")
        if capture == "cuda-graph" and device.type != "cuda":
            raise ConfigError(f"capture=cuda-graph needs a CUDA device; the models are on {device}")
        self.capture = device.type == "cuda" and capture != "off"
        self.compile, self.backend = compile, backend
        if compile:   # one compilation per batch size of each function (dynamo's default limit is 8)
            import torch._dynamo
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, max_batch + 1)
        self.graphs: dict = {}         # key -> (CUDAGraph, its outputs); None: warmed up, not captured yet
        self.compiled: dict = {}
        self.warmup_seconds = 0.0      # eager warm-up, compilation and capture, apart from decoding
        self.replays = 0
        self.events: list | None = None   # [] to time each replay on the GPU (CUDA events): see gpu_seconds

    def run(self, fn: Callable, B: int):
        key = (fn.__name__, B)
        if self.compile:
            if fn.__name__ not in self.compiled:
                self.compiled[fn.__name__] = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend)
            fn = self.compiled[fn.__name__]
        if not self.capture:
            return fn(B)
        if self.graphs.get(key) is not None:
            graph, out = self.graphs[key]
            if self.events is None:
                graph.replay()
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                self.events.append((start, end))
            self.replays += 1
            return out
        start = time.perf_counter()
        if key not in self.graphs:       # warm-up: this call's work, on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = fn(B)
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[key] = None
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(B)
            self.graphs[key] = (graph, out)
            graph.replay()
        torch.cuda.synchronize()
        self.warmup_seconds += time.perf_counter() - start
        return out

    def clear(self) -> None:
        """Forget every captured graph (the state they read was laid out again)."""
        self.graphs.clear()

    def gpu_seconds(self) -> float:
        """Seconds the GPU spent in the replays timed since the last call (synchronizes)."""
        if not self.events:
            return 0.0
        torch.cuda.synchronize()
        seconds = sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        self.events = []
        return seconds


class PrefillCache:
    """The last prompt's prefill (new KV rows, captured states, last-row logits), shared by engines
    over one target: `evaluate` runs every drafter and tree on a prompt back to back, and a long
    prompt's prefill is most of the time (~7k tokens: ~270 s of one core, 128 tokens after: ~25 s)."""

    def __init__(self):
        self.prompt: list[int] | None = None
        self.out = None

    def get(self, prompt: list[int], run: Callable):
        if self.prompt != prompt:
            self.prompt, self.out = None, run()
            self.prompt = list(prompt)
        return self.out


class StaticEngine(Engine):
    """Decoding on the PyTorch models at fixed shapes (module docstring), token for token what
    every other engine gives (tests/test_static.py). drafter None: plain decoding, captured the
    same way (the fair baseline on a GPU). capacity: rows a slot holds (a prompt, its new tokens,
    the rows an iteration stages); None: what the running requests need, laid out again when a
    request needs more or, the batch empty, less than half. capture: 'auto' (CUDA graphs on a
    GPU), 'cuda-graph' (required) or 'off'; compile: torch.compile the iteration too. prefills:
    a PrefillCache shared with other engines over the same target."""

    def __init__(self, target: LlamaTarget, drafter: EagleDrafter | None = None, shape: TreeShape | None = None,
                 max_batch: int = 8, capacity: int | None = None, capture: str = "auto", compile: bool = False,
                 compile_backend="inductor", prefills: PrefillCache | None = None):
        if (drafter is None) != (shape is None):
            raise ConfigError("a drafter needs its tree shape, and a tree shape a drafter")
        self.model, self.drafter = target.eval(), drafter.eval() if drafter is not None else None
        cfg, w = self.model.cfg, self.model.embed_tokens.weight
        self.device = w.device
        self.shape = shape.validate(drafter.cfg.draft_vocab_size) if drafter is not None else None
        self.nodes = self.shape.total_tokens if drafter is not None else 0
        self.rows = min(self.shape.depth, self.nodes) + 1 if drafter is not None else 1   # R: a path's rows at most
        self.staged = self.staged_rows(self.shape)
        self.max_context = cfg.max_position_embeddings
        self.max_batch = max_batch
        self.auto = capacity is None
        if capacity is not None and capacity <= self.staged:
            raise ConfigError(f"capacity {capacity} leaves no room for a sequence: an iteration stages {self.staged} rows")
        self.replayer = Replayer(self.device, capture, compile, compile_backend, max_batch)
        self.prefills = prefills
        i64 = dict(dtype=torch.int64, device=self.device)
        self.lengths, self.roots = torch.zeros(max_batch, **i64), torch.zeros(max_batch, **i64)
        self.handed = [0] * max_batch          # per slot: the hand-off rows the drafter encodes next (host)
        if drafter is not None:
            self.drafted, self.count = torch.zeros(max_batch, **i64), torch.zeros(max_batch, **i64)
            width = len(self.model.capture_streams) * cfg.hidden_size
            self.handoff_states = torch.zeros(max_batch, self.rows, width, dtype=w.dtype, device=self.device)
            self.handoff_ids = torch.zeros(max_batch, self.rows, **i64)
        T = self.nodes + 1
        # the host's acceptance of sampled sequences, copied in for the commit
        self.accepted_in = torch.zeros(max_batch, 2 * T + 1, **i64)   # [path | length | tokens] per sequence
        self.verified: dict[int, dict] = {}   # batch size -> the verification outputs the commit reads
        self.step_seconds = 0.0               # wall time inside iterations: with Replayer.gpu_seconds, the GPU's idle share
        self.tkv = self.dkv = None
        self._apart: tuple[Tensor, list] | None = None   # chunked prefill: the prompt's rows so far
        self._lay_out(capacity or CHUNK)

    @staticmethod
    def staged_rows(shape: TreeShape | None) -> int:
        """Rows past a sequence's end an iteration writes: the verified rows and the hand-off."""
        return 2 if shape is None else shape.total_tokens + 1 + min(shape.depth, shape.total_tokens) + 1

    def _lay_out(self, capacity: int) -> None:
        """The caches at `capacity` rows a slot, the committed rows of running sequences kept;
        captured graphs go (they read the old layout)."""
        cfg, dev = self.model.cfg, self.device
        old = (self.tkv, self.dkv)
        self.tkv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                           self.model.embed_tokens.weight.dtype, dev, batch=self.max_batch, fixed=True)
        if self.drafter is not None:
            dcfg = self.drafter.cfg
            self.dkv = KVCache(1, dcfg.num_key_value_heads, dcfg.head_dim, capacity, self.drafter.fc.weight.dtype, dev,
                               batch=self.max_batch, fixed=True)
        for new, was in zip((self.tkv, self.dkv), old):
            if was is not None and was.lengths:
                rows = min(max(was.lengths), capacity)
                new.kv[:, :, :len(was.lengths), :, :rows] = was.kv[:, :, :len(was.lengths), :, :rows]
                new.lengths = list(was.lengths)
        self.capacity = capacity
        self.row_numbers = torch.arange(capacity, device=dev)
        self.replayer.clear()

    # ---- fixed-shape device functions, one CUDA graph each per batch size ----

    def _verify(self, B: int, tree: DraftTree | None) -> dict[str, Tensor]:
        """Step 2: the target over root + nodes, its cache read at full capacity."""
        ids, positions, mask = verification_inputs(self.roots[:B], self.lengths[:B], tree)
        full = attention_mask(self.row_numbers < self.lengths[:B, None], mask)
        L = self.model.cfg.num_hidden_layers
        out = self.model(ids, positions, full, [self.tkv.k[i, :B] for i in range(L)],
                         [self.tkv.v[i, :B] for i in range(L)], torch.arange(ids.shape[1], device=self.device))
        return {"logits": out.logits, "captured": out.captured, "ids": ids, "mask": mask,
                "new_kv": torch.stack([torch.stack(out.new_k), torch.stack(out.new_v)])}   # [2, L, B, Hkv, T, D]

    def _draft(self, B: int) -> DraftTree:
        """Step 1: encode the hand-off rows and expand the trees; the drafter's rows committed."""
        drafter = self.drafter
        tree, new_k, new_v = draft_trees(drafter, self.handoff_states[:B].to(drafter.fc.weight.dtype),
                                         self.handoff_ids[:B], self.dkv.k[0, :B], self.dkv.v[0, :B], self.shape,
                                         self.drafted[:B], self.count[:B])
        self._write_rows(self.dkv, self.drafted[:B], torch.stack([new_k, new_v])[:, None].permute(2, 4, 0, 1, 3, 5))
        self.drafted[:B] += self.count[:B]
        return tree

    def _write_rows(self, cache: KVCache, at: Tensor, rows: Tensor) -> None:
        """rows [B, T, 2, L, Hkv, D] into each slot's rows at[b].. (a scatter: no shape depends on at)."""
        B, T = rows.shape[:2]
        slot = torch.arange(B, device=self.device)[:, None].expand(B, T)
        cache.kv[:, :, slot, :, at[:, None] + torch.arange(T, device=self.device)] = rows

    def draft_verify(self, B: int) -> dict[str, Tensor]:
        """Steps 1-3: the trees, their verification and its greedy acceptance."""
        tree = self._draft(B) if self.drafter is not None else None
        out = self._verify(B, tree)
        if tree is not None:
            out.update(tree_tokens=tree.tokens, tree_parents=tree.parents)
        out["path"], out["length"], out["tokens"] = accept_greedy_batch(out["logits"].argmax(-1), out["ids"], out["mask"])
        return out

    def _commit(self, B: int, out: dict[str, Tensor], path: Tensor, length: Tensor, tokens: Tensor) -> Tensor:
        """Steps 4-5 for accepted paths [B, T] (zero past each one's length), their lengths [B] and
        tokens [B, T]; returns them as one [B, 2T + 1] tensor."""
        slot = torch.arange(B, device=self.device)[:, None]
        self._write_rows(self.tkv, self.lengths[:B], out["new_kv"][:, :, slot, :, path])
        self.lengths[:B] += length
        if self.drafter is not None:
            R = self.rows
            self.handoff_states[:B] = out["captured"][slot, path[:, :R]]
            self.handoff_ids[:B] = tokens[:, :R]
            self.count[:B] = length
        self.roots[:B] = tokens.gather(1, (length - 1)[:, None])[:, 0]
        return torch.cat((path, length[:, None], tokens), 1)

    def iteration(self, B: int) -> Tensor:
        """One greedy iteration of slots 0..B-1, steps 1-5: what a GPU replays as one graph."""
        out = self.draft_verify(B)
        return self._commit(B, out, out["path"], out["length"], out["tokens"])

    def commit_accepted(self, B: int) -> Tensor:
        """Steps 4-5 with the acceptance the host copied in (batches with sampled sequences)."""
        T = self.nodes + 1
        a = self.accepted_in[:B]
        return self._commit(B, self.verified[B], a[:, :T], a[:, T], a[:, T + 1:])

    # ---- host side: requests joining and leaving, one replay and one copy an iteration ----

    def reset(self) -> None:
        self.tkv.clear()
        if self.drafter is not None:
            self.dkv.clear()

    def _fit(self, rows: int) -> None:
        """Lay the caches out again where a request needing `rows` rows does not fit, or (capacity
        None) where nothing runs and it needs less than half of them."""
        fits = -(-rows // CHUNK) * CHUNK
        if rows > self.capacity or (self.auto and not self.tkv.lengths and 2 * fits < self.capacity):
            self._lay_out(fits)

    @torch.no_grad()
    def prefill(self, prompt_ids, max_new_tokens, pick, start=0, end=None):
        """Prefill a request (outside the graphs) into the next slot; in chunks, its rows held
        apart from the caches (`_apart`: K / V [2, L, Hkv, n, D], captured blocks) until the last."""
        n, dev = len(prompt_ids), self.device
        end = n if end is None else end
        L = self.model.cfg.num_hidden_layers

        def run(start, end, kv):
            past = [kv[:, i, None, :, :start] for i in range(L)]
            out = self.model(torch.tensor([prompt_ids[start:end]], device=dev), torch.arange(start, end, device=dev)[None],
                             causal_mask(end - start, start, dev), [k for k, _ in past], [v for _, v in past],
                             torch.tensor([end - start - 1], device=dev))
            return torch.stack([torch.stack(out.new_k), torch.stack(out.new_v)])[:, :, 0], out.captured[0], \
                out.logits[0, -1]
        if start == 0 and end == n:
            empty = self.tkv.kv[:, :, 0, :, :0]
            new_kv, captured, logits = self.prefills.get(prompt_ids, lambda: run(0, n, empty)) \
                if self.prefills is not None else run(0, n, empty)
        else:
            if start == 0:
                cfg = self.model.cfg
                self._apart = (torch.zeros(2, L, cfg.num_key_value_heads, n, cfg.head_dim, dtype=self.tkv.dtype,
                                           device=dev), [])
            kv, held = self._apart
            rows, captured, logits = run(start, end, kv)
            kv[:, :, :, start:end] = rows
            held.append(captured)
            if end < n:
                return None
            new_kv, captured = kv, torch.cat(held)
            self._apart = None
        self._fit(n + max_new_tokens + self.staged)
        slot = self.tkv.add()
        if self.drafter is not None:
            self.dkv.add()          # the same slot: the two caches take and free slots together
        self.tkv.kv[:, :, slot, :, :n] = new_kv
        self.tkv.lengths[slot] = n
        first = int(logits.argmax()) if pick is None else pick(logits)
        self.lengths[slot], self.roots[slot] = n, first
        if self.drafter is not None:
            self._catch_up(slot, captured, list(prompt_ids[1:]) + [first])
        return first

    def _catch_up(self, slot: int, captured: Tensor, next_ids: list[int]) -> None:
        """The drafter encodes the prompt's rows but the last (its step 0 alone, no tree); the last
        is the first hand-off, paired with the first generated token."""
        drafter, dev = self.drafter, self.device
        n = len(next_ids) - 1
        if n:
            empty = self.dkv.k[0, slot:slot + 1, :, :0]
            out = drafter(drafter.project(captured[None, :n].to(drafter.fc.weight.dtype)),
                          torch.tensor([next_ids[:n]], device=dev), torch.arange(n, device=dev)[None],
                          causal_mask(n, 0, dev), empty, empty, logits=False)
            self.dkv.kv[:, 0, slot, :, :n] = torch.stack([out.new_k[0], out.new_v[0]])
        self.dkv.lengths[slot] = n
        self.drafted[slot], self.count[slot] = n, 1
        self.handed[slot] = 1
        self.handoff_states[slot, 0] = captured[n]
        self.handoff_ids[slot, 0] = next_ids[n]

    def leave(self, slot: int) -> None:
        """Free a slot: the last sequence moves into it (its rows, lengths and hand-off)."""
        last = self.tkv.batch - 1
        self.tkv.remove(slot)
        state = [self.lengths, self.roots]
        if self.drafter is not None:
            self.dkv.remove(slot)
            state += [self.drafted, self.count, self.handoff_states, self.handoff_ids]
        if slot != last:
            for t in state:
                t[slot] = t[last]
            self.handed[slot] = self.handed[last]

    @torch.no_grad()
    def iterate(self, batch: list[Sequence], greedy: bool) -> Verified:
        start, B, T = time.perf_counter(), len(batch), self.nodes + 1
        drafted = self.drafter is not None
        if greedy:      # the whole iteration, commit included, as one graph
            rows = self.replayer.run(self.iteration, B).tolist()     # the one copy to the host
            self._committed([row[T] for row in rows])
            self.step_seconds += time.perf_counter() - start
            return Verified(rows, T, self.nodes, drafted, committed=True)
        out = self.verified[B] = self.replayer.run(self.draft_verify, B)
        rows = torch.cat((out["path"], out["length"][:, None], out["tokens"]), 1).tolist()

        def tree(i: int) -> DraftTree:
            if self.drafter is None:
                return root_only_tree()
            return DraftTree(out["tree_tokens"][i].cpu(), out["tree_parents"][i].cpu(), out["mask"][i].cpu(),
                             torch.zeros(0), torch.zeros(0))
        self.step_seconds += time.perf_counter() - start
        return Verified(rows, T, self.nodes, drafted, logits=out["logits"], ids=out["ids"], tree=tree)

    @torch.no_grad()
    def commit(self, paths, tokens) -> None:
        """Steps 4-5 on the device with the host's acceptance (a batch with sampled sequences)."""
        start, B, T = time.perf_counter(), len(paths), self.nodes + 1
        self.accepted_in[:B] = torch.tensor([p + [0] * (T - len(p)) + [len(p)] + t + [0] * (T - len(t))
                                             for p, t in zip(paths, tokens)])
        self.replayer.run(self.commit_accepted, B)
        self._committed([len(p) for p in paths])
        self.step_seconds += time.perf_counter() - start

    def _committed(self, lengths: list[int]) -> None:
        """The host's copy of each slot's committed rows: the target's grew by the accepted
        path, the drafter's by the hand-off it encoded this iteration (1 after a prefill)."""
        for slot, length in enumerate(lengths):
            self.tkv.lengths[slot] += length
            if self.drafter is not None:
                self.dkv.lengths[slot] += self.handed[slot]
                self.handed[slot] = length
