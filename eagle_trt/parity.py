"""Parity of exported graphs against the PyTorch models, through Polygraphy.

For each graph: feeds (fresh random and real), the PyTorch reference outputs, ONNX Runtime
outputs from Polygraphy's OnnxrtRunner, and Polygraphy's comparator with a tolerance stated per
output and dtype; integer / boolean outputs (the draft tree) must be identical. Each graph's
feeds and reference outputs are also written as a parity bundle in Polygraphy's JSON format, so
a machine with TensorRT can check an engine against the PyTorch reference:

    polygraphy run target.onnx --trt --load-inputs target.inputs.json \\
        --load-outputs target.reference.json --atol ... --rtol ...

`python -m eagle_trt.parity` prints the report and writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import TreeShape
from .export.graphs import DraftTreeGraph, DrafterStepGraph, TargetGraph, target_graph_outputs
from .graph_names import ACCEPT_OUTPUTS, DRAFT_TREE_OUTPUTS, HANDOFF, PREFIX, VERIFY_NODES, target_io_names
from .models.drafter import EagleDrafter
from .models.streamed import StreamedTarget, TargetCall
from .models.target import LlamaTarget, causal_mask
from .parity_sessions import WeightsFed, parity_session  # noqa: F401 - parity's sessions
from .runtime.sessions import PROVIDERS

# Allowed error per output kind and dtype, as (atol, rtol); an element passes when within
# either (Polygraphy's element-wise rule). Logits use absolute bounds. The captured states and
# KV rows carry the target's massive activations (SmolLM2: |x| up to ~2.5e4 on the first token),
# so their atol is relative to the largest reference magnitude of that output ("scaled").
# fp32 logits: the floor is the summation order of the lm_head's 576-term dot products on logits
# of ~40, which depends on the CPU's kernels: 9.5e-5 on an AVX-512 machine, 1.17e-4 on an
# AVX2-only AMD EPYC (SmolLM2, PyTorch vs ONNX Runtime), so the gate is 2e-4.
TOLERANCES = {
    "float32": {"logits": (2e-4, 1e-4), "scores": (1e-4, 1e-4), "feedback": (1e-4, 1e-4),
                "captured": ("scaled", 1e-5), "kv": ("scaled", 1e-5)},
    "float16": {"logits": (5e-2, 5e-2), "scores": (2e-2, 2e-2), "feedback": (2e-2, 2e-2),
                "captured": ("scaled", 5e-3), "kv": ("scaled", 5e-3)},
}
EXACT_OUTPUTS = {"tree_tokens", "tree_parents", "tree_mask", "tree_depths", "accept_path", "accept_length",
                 "accept_tokens"}
# the iteration graph's, its verified ids and the ids it hands to its next call
EXACT_OUTPUTS |= {PREFIX + n for n in EXACT_OUTPUTS} | {"input_ids", "next_input_ids"}


def tolerance_for(output: str, dtype: str, reference: list[dict[str, np.ndarray]] | None = None
                  ) -> tuple[float, float]:
    table = TOLERANCES[dtype]
    kind = "kv" if ("key" in output or "value" in output) else \
        next(k for k in ("logits", "captured", "scores", "feedback") if k in output)
    atol, rtol = table[kind]
    if atol == "scaled":
        atol = rtol * max(_largest(reference, output), 1.0)
    return atol, rtol


@dataclass
class GraphCase:
    name: str                  # also the bundle's file stem
    graph: Path
    dtype: str
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)          # "random" / "real: ..."
    reference: list[dict[str, np.ndarray]] = field(default_factory=list)
    # A float16 graph's case may carry the float32 model's outputs on the same feeds (the same
    # weights, computed in float32): its float outputs are then checked against those, within the
    # table's tolerance or twice the float16 model's own distance from them (check_case).
    exact: list[dict[str, np.ndarray]] = field(default_factory=list)


@dataclass
class OutputReport:
    output: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    exact: bool
    passed: bool
    fp16_noise: float = 0.0    # the float16 PyTorch model's largest distance from the float32 one (case.exact)


@dataclass
class GraphReport:
    name: str
    graph: str
    dtype: str
    inputs: list[str]
    outputs: list[OutputReport]
    polygraphy_passed: bool
    seconds: float
    tie_flips: list[str] = field(default_factory=list)    # feeds whose float16 tree chose among tied scores

    @property
    def passed(self) -> bool:
        return self.polygraphy_passed and all(o.passed for o in self.outputs)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _device(module) -> torch.device:
    """Where the module's weights are (the CPU for a module without any; a StreamedTarget's own device)."""
    if isinstance(module, StreamedTarget):
        return module.device
    weight = next(module.parameters(), None)
    return torch.device("cpu") if weight is None else weight.device


def _run(module: torch.nn.Module, feed: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """The module's outputs on the feed, computed on the module's device, as numpy arrays."""
    dev = _device(module)
    with torch.no_grad():
        outs = module(*(torch.from_numpy(v).to(dev) for v in feed.values()))
    return {n: _np(o) for n, o in zip(names, outs)}


def target_outputs(model: LlamaTarget | StreamedTarget, feeds: list[dict[str, np.ndarray]],
                   on_part=None) -> list[dict[str, np.ndarray]]:
    """The target graph's outputs (TargetGraph) on each feed, computed by the PyTorch model: by a
    StreamedTarget part by part, for all the feeds in one pass over its weights (on_part(name)
    after each part, for progress)."""
    _, names = target_io_names(model.cfg.num_hidden_layers)
    if not isinstance(model, StreamedTarget):
        module = TargetGraph(model).eval()
        return [_run(module, f, names) for f in feeds]
    t = [{k: torch.from_numpy(v).to(model.device) for k, v in f.items()} for f in feeds]
    layers = range(model.cfg.num_hidden_layers)
    calls = [TargetCall(f["input_ids"], f["position_ids"], f["attention_mask"], [f[f"past_key_{i}"] for i in layers],
                        [f[f"past_value_{i}"] for i in layers], f["logits_index"]) for f in t]
    outs = model.forward_many(calls, on_part=on_part)
    with torch.no_grad():
        return [{n: _np(o) for n, o in zip(names, target_graph_outputs(out, f["input_ids"], f["attention_mask"],
                                                                        f["logits_index"]))}
                for out, f in zip(outs, t)]


def _target_feed(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past: list,
                 logits_index: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    feed = {"input_ids": _np(ids), "position_ids": _np(positions), "attention_mask": _np(mask),
            "logits_index": _np(logits_index) if logits_index is not None else np.arange(ids.shape[1], dtype=np.int64)}
    for i, (k, v) in enumerate(past):
        feed[f"past_key_{i}"], feed[f"past_value_{i}"] = _np(k), _np(v)
    return feed


def _new_kv(out: dict[str, np.ndarray], layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(out[f"new_key_{i}"]), torch.from_numpy(out[f"new_value_{i}"])) for i in range(layers)]


# ----------------------------------------------------------------------------- cases

def target_case(model: LlamaTarget | StreamedTarget, graph: Path, dtype: str, real_prompts: list[list[int]],
                tree_shape: TreeShape | None = None, drafter: EagleDrafter | None = None, seed: int = 0,
                on_part=None) -> GraphCase:
    """Random feeds (random ids, random past) and real ones: a prompt's prefill and the tree
    verification step that follows it (past = the prefill's KV, mask = a real draft tree). The
    references are computed in two passes over the model (target_outputs): the prefills and
    the random case's prefix, then the steps that start from them."""
    cfg = model.cfg
    L = cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    # Random: T random tokens after a past of P random tokens (the past KV is the model's own,
    # so activations have realistic magnitudes), with a random tree-like hole in the mask.
    T, P = 7, 13
    prefix_ids, random_ids = (torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in (P, T))
    batch_ids = torch.randint(0, cfg.vocab_size, (2, T), generator=gen)
    empty = list(zip(*model.empty_past()))
    prefills = [_target_feed(torch.tensor([p]), torch.arange(len(p))[None], causal_mask(len(p), 0), empty)
                for p in real_prompts]
    first = target_outputs(model, [_target_feed(prefix_ids, torch.arange(P)[None], causal_mask(P, 0), empty,
                                                torch.tensor([P - 1]))] + prefills, on_part)
    prefix_kv, prefill_refs = _new_kv(first[0], L), first[1:]

    random_mask = causal_mask(T, P).clone()
    random_mask[0, 3, P + 1] = False
    steps = [("random", _target_feed(random_ids, torch.arange(P, P + T)[None], random_mask, prefix_kv))]
    for prompt, ref in zip(real_prompts, prefill_refs):
        if tree_shape is None or drafter is None:
            continue
        n = len(prompt)
        from .tree import draft_tree
        k0, v0 = drafter.empty_past()
        root = int(ref["logits"][0, -1].argmax())
        with torch.no_grad():
            w = drafter.fc.weight
            tree, _, _ = draft_tree(drafter, torch.from_numpy(ref["captured"]).to(w.device, w.dtype),
                                    torch.tensor([prompt[1:] + [root]], device=w.device), k0, v0, tree_shape)
            tree = tree.to("cpu")
        tids = torch.cat((torch.tensor([root]), tree.tokens))[None]
        mask = torch.cat((torch.ones(tree.size + 1, n, dtype=torch.bool), tree.mask), 1)[None]
        steps.append((f"real tree verification ({tree.size + 1} nodes after {n} tokens)",
                      _target_feed(tids, (n + tree.depths)[None], mask, _new_kv(ref, L))))
    # Last, since callers take the real cases at reference[1::2]: a batch of two, the second sequence
    # with only P - 4 valid past rows (the rest masked, as a batched runtime binds a shorter
    # sequence's past) and its own tokens and positions.
    bmask = random_mask.repeat(2, 1, 1)
    bmask[1, :, P - 4:P] = False
    bpos = torch.stack((torch.arange(P, P + T), torch.arange(P - 4, P - 4 + T)))
    steps.append(("batch of 2 (past 13 and 9 rows)",
                  _target_feed(batch_ids, bpos, bmask, [(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in prefix_kv])))
    second = target_outputs(model, [f for _, f in steps], on_part)

    case = GraphCase("target", graph, dtype)
    verified = iter(zip(steps[1:-1], second[1:-1]))
    order = [(steps[0][0], steps[0][1], second[0])]
    for prompt, feed, ref in zip(real_prompts, prefills, prefill_refs):
        order.append((f"real prefill ({len(prompt)} tokens)", feed, ref))
        if tree_shape is not None and drafter is not None:
            (label, vfeed), vref = next(verified)
            order.append((label, vfeed, vref))
    order.append((steps[-1][0], steps[-1][1], second[-1]))
    for label, feed, ref in order:
        case.labels.append(label)
        case.feeds.append(feed)
        case.reference.append(ref)
    return case


def drafter_cases(drafter: EagleDrafter, tree_shape: TreeShape, graphs: dict[str, Path], dtype: str,
                  real_captured: list[tuple[np.ndarray, list[int]]], seed: int = 0) -> list[GraphCase]:
    """Tree graph: real target states of a prompt (empty past) and random states with a random past.
    Step graphs: the first step (fc) and a later step (fed-back state), random and real."""
    c = drafter.cfg
    gen = torch.Generator().manual_seed(seed)
    wdt = drafter.fc.weight.dtype
    kv = lambda n: torch.randn(1, c.num_key_value_heads, n, c.head_dim, generator=gen).to(wdt)  # noqa: E731
    width = c.num_aux_hidden_states * c.target_hidden_size
    cases = []
    if "drafter_tree" in graphs:
        case = GraphCase("drafter_tree", graphs["drafter_tree"], dtype)
        module = DraftTreeGraph(drafter, tree_shape).eval()
        names = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores", "new_key", "new_value"]
        one = lambda T, P: (torch.tensor([P]), torch.tensor([T]))  # noqa: E731 - every row valid
        feeds = [("random", torch.randn(1, 5, width, generator=gen).to(wdt) * 3,
                  torch.randint(0, c.vocab_size, (1, 5), generator=gen), kv(11), kv(11), *one(5, 11)),
                 # Two sequences with their own past and new lengths, padded as the batched runtime pads.
                 ("batch of 2 (past 11 and 6, new 5 and 2 rows)", torch.randn(2, 5, width, generator=gen).to(wdt) * 3,
                  torch.randint(0, c.vocab_size, (2, 5), generator=gen), torch.cat((kv(11), kv(11))),
                  torch.cat((kv(11), kv(11))), torch.tensor([11, 6]), torch.tensor([5, 2]))]
        for captured, ids in real_captured:
            feeds.append((f"real ({len(ids)} committed tokens)", torch.from_numpy(captured).to(wdt),
                          torch.tensor([ids]), kv(0), kv(0), *one(len(ids), 0)))
        for label, cap, ids, pk, pv, past_lengths, new_lengths in feeds:
            feed = {"captured": _np(cap), "input_ids": _np(ids), "past_key": _np(pk), "past_value": _np(pv),
                    "past_lengths": _np(past_lengths), "new_lengths": _np(new_lengths)}
            case.feeds.append(feed)
            case.labels.append(label)
            case.reference.append(_run(module, feed, names))
        cases.append(case)
    for name, first in (("drafter_step_first", True), ("drafter_step", False)):
        if name not in graphs:
            continue
        case = GraphCase(name, graphs[name], dtype)
        module = DrafterStepGraph(drafter, first).eval()
        T, P = 4, 9
        hidden = torch.randn(1, T, width if first else c.hidden_size, generator=gen).to(wdt)
        mask = causal_mask(T, P).clone()
        mask[0, 1, P] = False   # a tree-like hole: row 1 does not see row 0
        feed = {"hidden": _np(hidden), "input_ids": _np(torch.randint(0, c.vocab_size, (1, T), generator=gen)),
                "position_ids": _np(torch.arange(P, P + T)[None]), "attention_mask": _np(mask),
                "past_key": _np(kv(P)), "past_value": _np(kv(P))}
        case.feeds.append(feed)
        case.labels.append("random")
        case.reference.append(_run(module, feed, ["logits", "feedback", "new_key", "new_value"]))
        cases.append(case)
    return cases


class IterationReference(nn.Module):
    """The iteration graph (export/iteration.py) in PyTorch: the drafter tree graph, the glue that
    builds the verification inputs from its trees and the committed lengths, the target graph,
    and the hand-off (the accepted rows' states and tokens in the shape of the drafter's inputs).
    `draft` and `handoff` are the parts before and after the target graph, so that a target read
    part by part verifies every feed in one pass (iteration_case)."""

    def __init__(self, target: LlamaTarget | StreamedTarget, drafter: EagleDrafter, shape: TreeShape):
        super().__init__()
        self.drafter_tree, self.target = DraftTreeGraph(drafter, shape), target

    def draft(self, captured, draft_ids, draft_past_key, draft_past_value, draft_past_lengths, new_lengths,
              past_lengths, verify_nodes, *past) -> tuple[tuple, dict[str, np.ndarray]]:
        """The drafter tree graph's outputs and the target graph's feed the glue makes of them."""
        tree = self.drafter_tree(captured, draft_ids, draft_past_key, draft_past_value, draft_past_lengths, new_lengths)
        n = int(verify_nodes.min(torch.tensor(tree[0].shape[1]))[0])    # the tree's n best: its first n nodes
        tokens, tree_mask, depths = tree[0][:, :n], tree[2][:, :n + 1, :n + 1], tree[3][:, :n + 1]
        ids = torch.cat((draft_ids.gather(1, (new_lengths - 1)[:, None]), tokens), 1)   # root: the last valid id
        mask = verification_mask(past_lengths, past[0].shape[2], tree_mask)
        return tree, _target_feed(ids, past_lengths[:, None] + depths, mask, list(zip(past[0::2], past[1::2])))

    @staticmethod
    def handoff(tree: tuple, verify: dict[str, np.ndarray], verified: dict[str, np.ndarray], captured) -> tuple:
        """Every output of the iteration graph, from the parts' outputs."""
        ids = torch.from_numpy(verify["input_ids"])
        out = [torch.from_numpy(v) for v in verified.values()]
        pad = torch.zeros(ids.shape[0], captured.shape[1], dtype=torch.int64)   # paths shorter than Tp
        path, tokens = (torch.cat((x, pad), 1)[:, :captured.shape[1]] for x in (out[2], out[4]))
        states = out[1].gather(1, path[:, :, None].expand(-1, -1, out[1].shape[-1]))
        return (*(t.cpu() for t in tree), ids, *out, states.to(captured.dtype), tokens)


def verification_mask(past_lengths: torch.Tensor, past_rows: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """The iteration graph's glue mask: each sequence's committed rows of a past of `past_rows`,
    then its tree's own mask, for every row of the tree."""
    committed = torch.arange(past_rows, device=tree_mask.device)[None] < past_lengths[:, None]
    return torch.cat((committed[:, None].expand(-1, tree_mask.shape[1], -1), tree_mask), 2)


def iteration_case(target: LlamaTarget | StreamedTarget, drafter: EagleDrafter, shape: TreeShape, graph: Path,
                   dtype: str, real: list[tuple[dict[str, np.ndarray], list[int]]], seed: int = 0,
                   on_part=None, prefix_feed: dict[str, np.ndarray] | None = None) -> GraphCase:
    """The iteration graph: real feeds (the iteration after a prompt's prefill: the drafter
    encodes the prompt's captured states, the target's past is the prefill's KV; `real` are the
    target case's prefill references with their drafter ids) and a batch of two with random
    drafter states and pasts, each sequence with its own committed and new lengths. Every feed's
    drafter part and glue run first, then the target on all of them at once (target_outputs).
    The batch's target past is the KV of a random 13-token prefix; prefix_feed: the target
    case's random feed (target_case with the same seed: the same prefix), whose past it is, so
    the target is not run over it again (a pass over a StreamedTarget's every weight)."""
    cfg, c = target.cfg, drafter.cfg
    _, target_names = target_io_names(cfg.num_hidden_layers)
    names = [PREFIX + n for n in DRAFT_TREE_OUTPUTS] + ["input_ids"] + target_names + list(HANDOFF)
    module = IterationReference(target, drafter, shape).eval()
    case = GraphCase("iteration", graph, dtype)
    gen = torch.Generator().manual_seed(seed)
    wdt = drafter.fc.weight.dtype
    drafts = []      # (tree outputs, the target's feed, captured) per feed

    def add(label, captured, ids, draft_past, draft_lengths, new_lengths, lengths, past, nodes=shape.total_tokens):
        feed = {PREFIX + "captured": _np(captured), PREFIX + "input_ids": _np(ids), PREFIX + "past_key": _np(draft_past[0]),
                PREFIX + "past_value": _np(draft_past[1]), PREFIX + "past_lengths": _np(draft_lengths),
                PREFIX + "new_lengths": _np(new_lengths), "past_lengths": _np(lengths),
                VERIFY_NODES: np.array([nodes], dtype=np.int64)}
        for i, (k, v) in enumerate(past):
            feed[f"past_key_{i}"], feed[f"past_value_{i}"] = _np(k), _np(v)
        case.feeds.append(feed)
        case.labels.append(label)
        dev = _device(drafter)
        with torch.no_grad():
            tree, verify = module.draft(*(torch.from_numpy(v).to(dev) for v in feed.values()))
        drafts.append((tree, verify, captured))

    empty = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim, dtype=wdt)
    for prefill, ids in real:
        n = len(ids)
        add(f"real (the iteration after a {n}-token prefill)", torch.from_numpy(prefill["captured"]).to(wdt),
            torch.tensor([ids]), (empty, empty), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]),
            _new_kv(prefill, cfg.num_hidden_layers))
    P, Pd, Tp = 13, 11, 4
    prefix_ids = torch.randint(0, cfg.vocab_size, (1, P), generator=gen)   # drawn either way: the batch's draws follow
    if prefix_feed is not None:
        prefix_kv = [(torch.from_numpy(prefix_feed[f"past_key_{i}"]), torch.from_numpy(prefix_feed[f"past_value_{i}"]))
                     for i in range(cfg.num_hidden_layers)]
    else:
        dev = _device(target)
        with torch.no_grad():
            prefix = target(prefix_ids.to(dev), torch.arange(P, device=dev)[None], causal_mask(P, 0, dev),
                            *target.empty_past(device=dev))
        prefix_kv = list(zip(prefix.new_k, prefix.new_v))
    width = c.num_aux_hidden_states * c.target_hidden_size
    batch = (torch.randn(2, Tp, width, generator=gen).to(wdt) * 3, torch.randint(0, c.vocab_size, (2, Tp), generator=gen),
             tuple(torch.randn(2, c.num_key_value_heads, Pd, c.head_dim, generator=gen).to(wdt) for _ in range(2)),
             torch.tensor([Pd, Pd - 5]), torch.tensor([Tp, 2]), torch.tensor([P, P - 4]),
             [(k.cpu().repeat(2, 1, 1, 1), v.cpu().repeat(2, 1, 1, 1)) for k, v in prefix_kv])
    label = "batch of 2 (past 13 and 9 rows; drafter past 11 and 6, new 4 and 2 rows)"
    add(label, *batch)
    add(label + ", each tree's best node alone (verify_nodes 1: paths shorter than the drafter rows)", *batch, nodes=1)
    verified = target_outputs(target, [verify for _, verify, _ in drafts], on_part)
    for (tree, verify, captured), out in zip(drafts, verified):
        case.reference.append({n: _np(o) for n, o in zip(names, module.handoff(tree, verify, out, captured))})
    return case


# ----------------------------------------------------------------------------- checking

def graph_acceptance(feed: dict[str, np.ndarray], got) -> dict[str, np.ndarray]:
    """What a target graph's accept_* outputs must be: greedy acceptance on the graph's own logits,
    computed by walking each tree (walk_acceptance), not by the tensor code the graph's acceptance
    was exported from, so a fault in that code shows here. Acceptance is exact integer logic on
    top of the logits, and the logits are checked against PyTorch within their tolerance; where
    two logits are closer than that, the graph's argmax may differ from PyTorch's, which is a
    logits rounding, not an acceptance error (the other outputs' tolerances say how close)."""
    feed = {k: np.asarray(v) for k, v in feed.items()}
    logits = np.asarray(got["logits"])
    if "attention_mask" in feed:       # rows that got logits, and their block of the new rows' mask
        rows = feed["logits_index"]
        T = feed["input_ids"].shape[1]
        ids = feed["input_ids"][:, rows]
        tree_mask = feed["attention_mask"][:, :, -T:][:, rows][:, :, rows]
    else:                              # the iteration graph: its verification inputs are its own
        ids = np.asarray(got["input_ids"])
        T = ids.shape[1]                  # the verified nodes (verify_nodes): the tree's first T - 1
        tree_mask = np.asarray(got[PREFIX + "tree_mask"])[:, :T, :T]
    out = walk_acceptance(logits.argmax(-1), ids, tree_mask)
    return dict(zip(ACCEPT_OUTPUTS, out))


def walk_acceptance(best: np.ndarray, ids: np.ndarray, tree_mask: np.ndarray) -> tuple[np.ndarray, ...]:
    """Greedy acceptance of a batch of trees by verify.accept_greedy's walk, one tree at a time:
    best [B, T] the target's argmax per row, ids [B, T] the rows' tokens (row 0 the root),
    tree_mask [B, T, T] each row's ancestors. Each node's parent is its ancestor one level up (a
    row that does not reach the root, such as padding, has none). Returns path [B, T] (zero past
    its length), length [B] and tokens [B, T] (best at each path entry), the graph's layout."""
    from .tree import DraftTree
    from .verify import accept_greedy
    B, T = ids.shape
    path_out, length_out = np.zeros((B, T), np.int64), np.zeros(B, np.int64)
    for b in range(B):
        mask = tree_mask[b].astype(bool)
        depth = mask.sum(-1) - 1
        parents = [-1] + [next((k for k in range(T) if mask[j, k] and depth[k] == depth[j] - 1), -1)
                          if mask[j, 0] else -1 for j in range(1, T)]
        tree = DraftTree(torch.from_numpy(ids[b, 1:].copy()), torch.tensor(parents), torch.from_numpy(mask),
                         torch.from_numpy(depth), torch.zeros(T - 1))
        path, _ = accept_greedy(tree, torch.nn.functional.one_hot(torch.from_numpy(best[b]), int(best[b].max()) + 1))
        path_out[b, :len(path)], length_out[b] = path, len(path)
    return path_out, length_out, np.take_along_axis(best, path_out, 1).astype(np.int64)


def check_case(case: GraphCase, bundle_dir: Path | None = None, provider: str = "cpu") -> GraphReport:
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator, IterationResult, RunResults, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    start = time.perf_counter()
    runner = OnnxrtRunner(parity_session(case.graph, case.dtype, provider), name="onnxruntime")
    ort_results = Comparator.run([runner], data_loader=case.feeds)
    ort_iters = list(ort_results.values())[0]
    names = list(case.reference[0])
    float_names = [n for n in names if n not in EXACT_OUTPUTS]
    tols = {n: tolerance_for(n, case.dtype, case.reference) for n in float_names}
    noise = {}
    if case.exact:     # floats against the float32 model, integers against the float16 one
        noise = {n: _largest_difference(case.reference, case.exact, n) for n in float_names}
        tols = {n: (max(t[0], FP16_NOISE_FACTOR * noise[n]), t[1]) for n, t in tols.items()}
    compared = case.exact or case.reference
    expected = [dict(c, **{n: r[n] for n in names if n in EXACT_OUTPUTS}) for c, r in zip(compared, case.reference)]
    expected = [dict(r, **graph_acceptance(f, g)) if ACCEPT_OUTPUTS[0] in r else r
                for r, f, g in zip(expected, case.feeds, ort_iters)]
    flips = _float16_tree_ties(case, expected, ort_iters, tols) if case.dtype == "float16" else []
    reference = RunResults([("pytorch", [IterationResult(outputs=r, runner_name="pytorch") for r in expected])])
    results = RunResults(list(reference.items()) + list(ort_results.items()))
    atol = {n: t[0] for n, t in tols.items()}
    rtol = {n: t[1] for n, t in tols.items()}
    atol.update({n: 0.0 for n in names if n in EXACT_OUTPUTS})
    rtol.update({n: 0.0 for n in names if n in EXACT_OUTPUTS})
    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol))

    outputs = []
    for name in names:
        max_abs = max_rel = 0.0
        for ref, got in zip(expected, ort_iters):
            a, b = ref[name], np.asarray(got[name])
            if a.shape != b.shape:
                max_abs = max_rel = float("inf")
                break
            if a.size:
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                max_abs = max(max_abs, float(diff.max()))
                max_rel = max(max_rel, float((diff / (np.abs(a.astype(np.float64)) + 1e-6)).max()))
        exact = name in EXACT_OUTPUTS
        tol = (0.0, 0.0) if exact else tols[name]
        # Pass if within atol, or within rtol of the value (Polygraphy's rule: either bound).
        passed = max_abs == 0.0 if exact else all(
            np.all(np.abs(r[name].astype(np.float64) - np.asarray(g[name], np.float64))
                   <= tol[0] + tol[1] * np.abs(r[name].astype(np.float64)))
            for r, g in zip(expected, ort_iters))
        if name in noise and noise[name] > FP16_NOISE_MAX * max(_largest(case.exact, name), 1.0):
            passed = False     # the float16 reference is not a rounding of the float32 one: no yardstick
        outputs.append(OutputReport(name, max_abs, max_rel, tol[0], tol[1], exact, bool(passed), noise.get(name, 0.0)))
    if bundle_dir is not None:   # the PyTorch outputs, acceptance included, for an engine to be checked against
        write_bundle(case, RunResults([("pytorch", [IterationResult(outputs=r, runner_name="pytorch")
                                                    for r in case.reference])]), bundle_dir)
    return GraphReport(case.name, str(case.graph), case.dtype, case.labels, outputs, bool(accuracy),
                       time.perf_counter() - start, flips)


TREE_CHOICES = ("tree_tokens", "tree_parents", "tree_mask", "tree_depths")


def _float16_tree_ties(case: GraphCase, expected: list[dict], got: list, tols: dict) -> list[str]:
    """A float16 drafter-tree graph may choose other nodes than the float16 PyTorch model where
    candidates' scores tie to float16 rounding (ONNX Runtime rounds in other places: a random
    70B-wide drafter's trees differed on 4 of 4 feeds, their scores within tolerance). Where a
    feed's tree differs and every node's score matches the reference's within the scores'
    tolerance, the graph's own choice is what its tree is held to (as acceptance is recomputed
    from a target graph's own logits); a tree whose scores differ fails. Returns those feeds'
    labels (reported)."""
    if "tree_scores" not in tols or not all(n in expected[0] for n in TREE_CHOICES):
        return []
    atol, rtol = tols["tree_scores"]
    flips = []
    for i, (ref, out) in enumerate(zip(expected, got)):
        mine = {n: np.asarray(out[n]) for n in TREE_CHOICES}
        if all(np.array_equal(ref[n], mine[n]) for n in TREE_CHOICES):
            continue
        want, have = ref["tree_scores"].astype(np.float64), np.asarray(out["tree_scores"], np.float64)
        if want.shape == have.shape and np.all(np.abs(want - have) <= atol + rtol * np.abs(want)):
            expected[i] = dict(ref, **mine)
            flips.append(case.labels[i])
    return flips


# A float16 graph checked against the float32 model (GraphCase.exact) may be off by twice what the
# float16 PyTorch model itself is off by on the same feeds: both round every layer's activations
# to float16, in different places (ONNX Runtime's CPU computes float16 nodes in float32 and casts
# back, PyTorch rounds after each op), and the rounding grows with depth: on a 32-layer 8B target
# the two float16 results were 0.07 apart in the logits while the graph was 0.04 from the float32
# model and PyTorch's float16 model 0.07. A wrong graph is off by the activations' own size.
FP16_NOISE_FACTOR = 2.0
FP16_NOISE_MAX = 0.05      # a float16 reference further than 5% of the outputs' size from float32 is refused


def _largest(refs: list[dict[str, np.ndarray]], name: str) -> float:
    return max((float(np.abs(r[name]).max()) for r in refs if r[name].size), default=0.0)


def _largest_difference(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]], name: str) -> float:
    return max((float(np.abs(x[name].astype(np.float64) - y[name].astype(np.float64)).max())
                for x, y in zip(a, b) if x[name].size), default=0.0)


def write_bundle(case: GraphCase, reference, bundle_dir: Path) -> None:
    from polygraphy.json import save_json
    bundle_dir.mkdir(parents=True, exist_ok=True)
    save_json(case.feeds, str(bundle_dir / f"{case.name}.inputs.json"))
    reference.save(str(bundle_dir / f"{case.name}.reference.json"))


def format_report(reports: list[GraphReport]) -> str:
    lines = [f"{'graph':<20}{'output':<22}{'max abs':>12}{'max rel':>12}{'atol':>10}  result"]
    for rep in reports:
        shown = [o for o in rep.outputs if "key_" not in o.output and "value_" not in o.output]
        kv = [o for o in rep.outputs if o not in shown]
        if kv:   # per-layer KV outputs collapse into one line
            worst = max(kv, key=lambda o: o.max_abs)
            shown.append(OutputReport(f"kv ({len(kv)})", worst.max_abs, max(o.max_rel for o in kv), worst.atol,
                                      worst.rtol, False, all(o.passed for o in kv)))
        for o in shown:
            tol = "exact" if o.exact else f"{o.atol:.0e}"
            lines.append(f"{rep.name:<20}{o.output:<22}{o.max_abs:>12.3e}{o.max_rel:>12.3e}{tol:>10}  "
                         f"{'ok' if o.passed else 'FAIL'}")
        lines.append(f"{rep.name:<20}{'(polygraphy)':<22}{'':>34}  {'ok' if rep.polygraphy_passed else 'FAIL'}"
                     f"   inputs: {'; '.join(rep.inputs)}")
        if rep.tie_flips:
            lines.append(f"{rep.name:<20}{'(float16 ties)':<22}{'':>34}  trees chose among tied scores on: "
                         f"{'; '.join(rep.tie_flips)}")
    return "\n".join(lines)


def report_json(reports: list[GraphReport]) -> dict:
    return {"passed": all(r.passed for r in reports),
            "graphs": [dict(asdict(r), passed=r.passed) for r in reports]}


def main(argv: list[str] | None = None) -> int:
    from .api import prepare_models   # heavy imports after argument parsing
    from .export import export_pipeline
    p = argparse.ArgumentParser(prog="python -m eagle_trt.parity", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="drafter folder (default: shipped or random EAGLE 3.1)")
    p.add_argument("--out", default="artifacts/parity", help="folder for graphs, bundles and report.json")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--prompts", type=int, default=2, help="real MT-bench prompts to use as inputs")
    p.add_argument("--iteration-graph", action="store_true",
                   help="also compose and check the iteration graph (export/iteration.py: both graphs in one)")
    p.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu",
                   help="ONNX Runtime's execution provider the graphs run on (cuda: onnxruntime-gpu's)")
    args = p.parse_args(argv)
    try:
        shape = TreeShape(args.depth, args.tree_top_k, args.total_tokens).validate()
        models = prepare_models(args.target, args.drafter, log=sys.stderr)
        out = Path(args.out)
        graphs = export_pipeline(models, shape, out / "graphs", args.dtype, step_graphs=True, log=sys.stderr)
        if args.iteration_graph:
            graphs.update(export_pipeline(models, shape, out / "graphs", args.dtype, log=sys.stderr, only=("iteration",)))
        reports = run_parity(models, shape, graphs, args.dtype, args.prompts, out / "bundles", args.provider)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(reports))
    data = report_json(reports)
    (out / "report.json").write_text(json.dumps(data, indent=2))
    print(f"\nreport: {out / 'report.json'}; bundles: {out / 'bundles'}; "
          f"{'ALL PASSED' if data['passed'] else 'FAILURES'}")
    return 0 if data["passed"] else 1


def run_parity(models, shape: TreeShape, graphs: dict[str, Path], dtype: str, num_prompts: int,
               bundle_dir: Path | None, provider: str = "cpu") -> list[GraphReport]:
    from .api import real_prompt_ids
    prompts = real_prompt_ids(models, num_prompts)
    target = models.target.model.to(torch.float32 if dtype == "float32" else torch.float16)
    drafter = models.drafter.to(target.embed_tokens.weight.dtype)
    cases = [target_case(target, graphs["target"], dtype, prompts, shape, drafter)]
    real = [(c["captured"], p[1:] + [int(c["logits"][0, -1].argmax())])
            for c, p in zip(cases[0].reference[1::2], prompts)]
    cases += drafter_cases(drafter, shape, graphs, dtype, real)
    if "iteration" in graphs:
        cases.append(iteration_case(target, drafter, shape, graphs["iteration"], dtype,
                                    [(c, ids) for c, (_, ids) in zip(cases[0].reference[1::2], real)],
                                    prefix_feed=cases[0].feeds[0]))
    return [check_case(c, bundle_dir, provider) for c in cases]


if __name__ == "__main__":
    sys.exit(main())
