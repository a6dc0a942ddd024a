"""Speculative decoding on the PyTorch backend with every tensor at a fixed shape and all state on
the device, so that a whole iteration replays as one CUDA graph (the way SGLang's EAGLE worker
and TensorRT-LLM's one-model path run on a GPU). On a CPU the same functions run as they are.

State, allocated once for `max_batch` slots of `capacity` rows (sequence b lives in slot b):
    target KV  [2, L, B, Hkv, S, D] and drafter KV [2, 1, B, Hkv, S, D]  (KVCache, fixed layout)
    lengths [B]   target rows committed (= the root's position); drafted [B]: drafter rows
    roots [B]     the last committed token, which the target has not seen yet
    hand-off      states [B, R, A * Ht], ids [B, R], count [B]: the rows the drafter encodes next
                  (the target's captured states of the rows it accepted, paired with the tokens
                  one position later; R = the longest path an iteration accepts)

One iteration of the B running sequences (`_iteration`), fixed shapes throughout:
  1. the drafter encodes its hand-off rows and expands each tree (tree.draft_trees, the
     function the drafter graph is exported from), reading its cache at full capacity;
  2. the target verifies root + N nodes (backend.verification_inputs, as every backend does)
     with attention over its whole cache, rows past each sequence's length masked;
  3. greedy acceptance (verify.accept_greedy_batch, the target graph's own);
  4. commit: all T verified rows, in path order, are written at rows lengths.. of each slot and
     lengths grow by the path's length: rows past it sit beyond the new length, masked, and are
     overwritten later (no tensor shape depends on how much was accepted); the drafter's rows
     likewise;
  5. the hand-off for the next iteration, and the new roots.
It returns tokens and lengths packed as one [B, T + 1] tensor: the one copy to the host an
iteration makes (streaming and stop checks). Sampled sequences accept on the host instead
(verify.accept_sampled with their own seeded generators, exactly as SpeculativeDecoder does):
the iteration then splits at step 3 into two graphs, the host's paths copied in between.

Prefill runs outside the graphs, one request at a time as it joins (prompt lengths differ). A
sequence that leaves frees its slot and the last one moves into it, so the running sequences
are always slots 0..B-1 and there is one graph per batch size."""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from ..config import ConfigError, SamplingConfig, TreeShape
from ..models.target import causal_mask
from ..tree import DraftTree, draft_trees
from ..verify import accept_greedy_batch, accept_sampled, sample_token
from .backend import TorchDrafter, TorchTarget, attention_mask, verification_inputs
from .decoder import DecodingLoop, Request, Sequence, check_request, root_only_tree
from .kv_cache import KVCache

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

    def gpu_seconds(self) -> float:
        """Seconds the GPU spent in the replays timed since the last call (synchronizes)."""
        if not self.events:
            return 0.0
        torch.cuda.synchronize()
        seconds = sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        self.events = []
        return seconds


class StaticDecoder(DecodingLoop):
    """SpeculativeDecoder's loop (add / step / generate_batch) on fixed-shape device state, with
    the same results token for token (tests/test_static.py). drafter=None: plain decoding, run
    and captured the same way (the fair baseline on a GPU). capacity: rows per slot (a prompt,
    its new tokens and the rows an iteration stages); capture: 'auto' (CUDA graphs on a GPU),
    'cuda-graph' (required) or 'off'; compile: torch.compile the iteration too."""

    def __init__(self, target: TorchTarget, drafter: TorchDrafter | None, eos_ids, vocab_size: int | None = None,
                 max_batch: int = 8, capacity: int = 2048, capture: str = "auto", compile: bool = False,
                 compile_backend="inductor"):
        super().__init__(eos_ids, vocab_size)
        self.target, self.drafter = target, drafter
        self.model, self.device = target.model, target.device
        cfg, w = self.model.cfg, self.model.embed_tokens.weight
        self.max_batch, self.capacity = max_batch, capacity
        self.shape = drafter.shape if drafter is not None else None
        self.nodes = self.shape.total_tokens if drafter is not None else 0
        self.rows = min(self.shape.depth, self.nodes) + 1 if drafter is not None else 1   # R: a path's rows at most
        staged = self.staged_rows(self.shape)
        self.max_context = min(target.max_context, capacity - staged)
        if self.max_context < 1:
            raise ConfigError(f"capacity {capacity} leaves no room for a sequence: an iteration stages {staged} rows")
        self.replayer = Replayer(self.device, capture, compile, compile_backend, max_batch)
        dev, i64 = self.device, dict(dtype=torch.int64, device=self.device)
        self.tkv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, w.dtype, dev,
                           batch=max_batch, fixed=True)
        self.lengths, self.roots = torch.zeros(max_batch, **i64), torch.zeros(max_batch, **i64)
        self.row_numbers = torch.arange(capacity, device=dev)
        if drafter is not None:
            dcfg, dw = drafter.model.cfg, drafter.model.fc.weight
            self.dkv = KVCache(1, dcfg.num_key_value_heads, dcfg.head_dim, capacity, dw.dtype, dev, batch=max_batch,
                               fixed=True)
            self.drafted, self.count = torch.zeros(max_batch, **i64), torch.zeros(max_batch, **i64)
            width = len(self.model.capture_streams) * cfg.hidden_size
            self.handoff_states = torch.zeros(max_batch, self.rows, width, dtype=w.dtype, device=dev)
            self.handoff_ids = torch.zeros(max_batch, self.rows, **i64)
        T = self.nodes + 1
        # the host's acceptance of sampled sequences, copied in for the commit
        self.accepted_in = torch.zeros(max_batch, 2 * T + 1, **i64)   # [path | length | tokens] per sequence
        self.verified: dict[int, dict] = {}   # batch size -> the verification outputs the commit reads
        self.step_seconds = 0.0               # wall time inside step(): with Replayer.gpu_seconds, the GPU's idle share

    @staticmethod
    def staged_rows(shape: TreeShape | None) -> int:
        """Rows past a sequence's end an iteration writes: the verified rows and the hand-off."""
        if shape is None:
            return 2
        return shape.total_tokens + 1 + min(shape.depth, shape.total_tokens) + 1

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
        drafter = self.drafter.model
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
        tokens [B, T]; returns tokens and lengths as one [B, T + 1] tensor."""
        slot = torch.arange(B, device=self.device)[:, None]
        self._write_rows(self.tkv, self.lengths[:B], out["new_kv"][:, :, slot, :, path])
        self.lengths[:B] += length
        if self.drafter is not None:
            R = self.rows
            self.handoff_states[:B] = out["captured"][slot, path[:, :R]]
            self.handoff_ids[:B] = tokens[:, :R]
            self.count[:B] = length
        self.roots[:B] = tokens.gather(1, (length - 1)[:, None])[:, 0]
        return torch.cat((tokens, length[:, None]), 1)

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
        self.active = []
        self.tkv.clear()
        if self.drafter is not None:
            self.dkv.clear()

    @torch.no_grad()
    def add(self, request: Request) -> Sequence:
        """Validate and prefill a request (outside the graphs) into the next slot."""
        sampling = (request.sampling or SamplingConfig()).validate()
        request.sampling = sampling
        check_request(request.prompt_ids, request.max_new_tokens, self.max_context, self.vocab_size,
                      "the static cache's context", f"capacity {self.capacity} rows a slot, less the "
                      f"{self.capacity - self.max_context} an iteration stages")
        if len(self.active) >= self.max_batch:
            raise ConfigError(f"the batch is full: {self.max_batch} sequences (max_batch)")
        if not self.active:
            self.reset()
        seq = Sequence(request, torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
                       request.submitted or time.perf_counter())
        prompt, n, dev = request.prompt_ids, len(request.prompt_ids), self.device
        slot = self.tkv.add()
        if self.drafter is not None:
            self.dkv.add()          # the same slot: the two caches take and free slots together
        L = self.model.cfg.num_hidden_layers
        empty = [self.tkv.k[i, slot:slot + 1, :, :0] for i in range(L)]
        out = self.model(torch.tensor([prompt], device=dev), torch.arange(n, device=dev)[None],
                         causal_mask(n, 0, dev), empty, empty, torch.tensor([n - 1], device=dev))
        self.tkv.kv[:, :, slot, :, :n] = torch.stack([torch.stack(out.new_k), torch.stack(out.new_v)])[:, :, 0]
        self.tkv.lengths[slot] = n
        logits = out.logits[0, -1]
        first = int(logits.argmax()) if sampling.greedy else sample_token(logits, sampling, seq.gen)
        self.lengths[slot], self.roots[slot] = n, first
        if self.drafter is not None:
            self._catch_up(slot, out.captured[0], prompt[1:] + [first])
        seq.result.target_calls = 1
        self.active.append(seq)
        seq.extend([first], self.eos_ids)
        if seq.stop:
            self._leave(slot)
        return seq

    def _catch_up(self, slot: int, captured: Tensor, next_ids: list[int]) -> None:
        """The drafter encodes the prompt's rows but the last (its step 0 alone, no tree); the last
        is the first hand-off, paired with the first generated token."""
        drafter, dev = self.drafter.model, self.device
        n = len(next_ids) - 1
        if n:
            empty = self.dkv.k[0, slot:slot + 1, :, :0]
            out = drafter(drafter.project(captured[None, :n].to(drafter.fc.weight.dtype)),
                          torch.tensor([next_ids[:n]], device=dev), torch.arange(n, device=dev)[None],
                          causal_mask(n, 0, dev), empty, empty, logits=False)
            self.dkv.kv[:, 0, slot, :, :n] = torch.stack([out.new_k[0], out.new_v[0]])
        self.dkv.lengths[slot] = n
        self.drafted[slot], self.count[slot] = n, 1
        self.handoff_states[slot, 0] = captured[n]
        self.handoff_ids[slot, 0] = next_ids[n]

    def _leave(self, slot: int) -> None:
        """Free a slot: the last sequence moves into it (its rows, lengths and hand-off)."""
        last = len(self.active) - 1
        self.tkv.remove(slot)
        state = [self.lengths, self.roots]
        if self.drafter is not None:
            self.dkv.remove(slot)
            state += [self.drafted, self.count, self.handoff_states, self.handoff_ids]
        if slot != last:
            for t in state:
                t[slot] = t[last]
        self.active[slot] = self.active[-1]
        self.active.pop()

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        batch = list(self.active)
        if not batch:
            return []
        start = time.perf_counter()
        B, T = len(batch), self.nodes + 1
        if all(s.request.sampling.greedy for s in batch):
            rows = self.replayer.run(self.iteration, B).tolist()     # the one copy to the host
        else:
            rows = self._sampled_step(batch)
        finished = []
        for slot, (s, row) in enumerate(zip(batch, rows)):
            length = row[T]
            self.tkv.lengths[slot] += length
            if self.drafter is not None:      # the drafter encoded the last iteration's rows (1 after prefill)
                self.dkv.lengths[slot] += s.result.accept_lengths[-1] if s.result.accept_lengths else 1
                s.result.drafter_calls += 1
            s.result.target_calls += 1
            s.result.accept_lengths.append(length)
            s.extend(row[:length], self.eos_ids)
            if s.stop:
                finished.append(s)
        for s in finished:
            self._leave(self.active.index(s))
        self.step_seconds += time.perf_counter() - start
        return finished

    def _sampled_step(self, batch: list[Sequence]) -> list[list[int]]:
        """Draft and verify on the device, accept on the host (each sampled sequence with its own
        generator, as SpeculativeDecoder does; greedy ones take the device's paths), commit on
        the device."""
        B, T = len(batch), self.nodes + 1
        out = self.verified[B] = self.replayer.run(self.draft_verify, B)
        greedy = torch.cat((out["path"], out["length"][:, None], out["tokens"]), 1).tolist()
        accepted = []
        for i, s in enumerate(batch):
            row = greedy[i]
            if not s.request.sampling.greedy:
                tree = root_only_tree() if self.drafter is None else DraftTree(
                    out["tree_tokens"][i].cpu(), out["tree_parents"][i].cpu(), out["mask"][i].cpu(),
                    torch.zeros(0), torch.zeros(0))
                path, bonus = accept_sampled(tree, out["logits"][i], s.request.sampling, s.gen)
                ids = out["ids"][i].tolist()
                new = [ids[j] for j in path[1:]] + [bonus]
                row = path + [0] * (T - len(path)) + [len(path)] + new + [0] * (T - len(new))
            accepted.append(row)
        self.accepted_in[:B] = torch.tensor(accepted)
        return self.replayer.run(self.commit_accepted, B).tolist()
