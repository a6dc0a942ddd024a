"""Lossless speculative SAMPLING (DESIGN.md section 2, "Verification").

The exact distribution of the first three generated tokens is computed by enumerating every
continuation with the target model and `target_probs`; thousands of decoding-loop runs
(tree drafts, sibling rejection, residual and bonus samples) must fit it by a chi-square test.
A deliberately broken acceptance rule must fail the very same test, so the test has power.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

import eagle_trt.runtime.loop as loop_mod
from conftest import capturing, oracle_drafter, share, static, two_call, write_tiny_hf_target
from eagle_trt import verify
from eagle_trt.checkpoints import LoadedTarget, load_target, random_drafter
from eagle_trt.config import CaptureLayers, SamplingConfig, TreeShape
from eagle_trt.models.target import causal_mask
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.loop import DecodingLoop, Request
from eagle_trt.verify import NUCLEUS_FIRST, children_lists, draw, target_distribution, target_probs

VOCAB = 12
PROMPT = [1, 5, 7, 3]
NEW = 3
SHAPE = TreeShape(depth=3, top_k=3, total_tokens=8)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def small_target(request, tmp_path_factory) -> LoadedTarget:
    folder = write_tiny_hf_target(tmp_path_factory.mktemp("small_vocab"), vocab=VOCAB, hidden=32, layers=4, heads=4,
                                  kv_heads=2, seed=3)
    return share(request, load_target(folder))


def _oracle(target: LoadedTarget, variant: str = "eagle3.1", noise: float = 0.05, seed: int = 1):
    d = oracle_drafter(target, variant, noise=noise, seed=seed)
    # The oracle's fc reads only the third chunk (output of the last layer); name distinct
    # layers for the two unused chunks so that the capture is valid at any depth.
    L = target.config.num_hidden_layers
    d.cfg.capture = CaptureLayers((0, 1, L - 1), "layer_output")
    return d


def _random(target: LoadedTarget, variant: str = "eagle3", seed: int = 4, draft_vocab_size: int | None = 8):
    d = random_drafter(target, variant, seed=seed, draft_vocab_size=draft_vocab_size, std=0.3)
    d.cfg.capture = CaptureLayers((0, 1, 2), "layer_input")
    return d


def _decoder(target: LoadedTarget, drafter, shape: TreeShape = SHAPE, **engine) -> DecodingLoop:
    """The two-call engine over the PyTorch reference backends (engine: its cost model or trim)."""
    return two_call(TorchTarget(capturing(target, drafter).model), TorchDrafter(drafter, shape), [],
                    target.config.vocab_size, **engine)


def _greedy(target: LoadedTarget, prompt: list[int], n: int) -> list[int]:
    return two_call(TorchTarget(target.model)).generate(prompt, n).tokens


# ----------------------------------------------------------------------------- exact distribution


@torch.no_grad()
def _next_probs(target: LoadedTarget, prefixes: list[list[int]], sampling: SamplingConfig) -> torch.Tensor:
    """[len(prefixes), V] processed next-token distributions, one batched forward."""
    model = target.model
    ids = torch.tensor(prefixes)
    B, L = ids.shape
    mask = causal_mask(L, 0).expand(B, L, L)
    out = model(ids, torch.arange(L)[None].expand(B, L), mask, *model.empty_past(batch=B))
    logits = out.logits[:, -1].double()
    # guard: the float32 logits of the verify pass differ from these by rounding only; make
    # sure no top-k / top-p cut sits within rounding distance of a token (else fragile)
    _check_cut_margins(logits, sampling)
    return target_probs(logits, sampling).double()


def _check_cut_margins(logits: torch.Tensor, sampling: SamplingConfig, tol: float = 1e-4) -> None:
    z = logits / sampling.temperature
    if sampling.top_k:
        s = torch.sort(z, dim=-1, descending=True).values
        assert ((s[:, sampling.top_k - 1] - s[:, sampling.top_k]) > tol).all()
        z = z.masked_fill(z < s[:, sampling.top_k - 1:sampling.top_k], float("-inf"))
    if sampling.top_p < 1:
        cum = torch.softmax(z, -1).sort(dim=-1, descending=True).values.cumsum(-1)
        assert ((cum - sampling.top_p).abs() > tol).all()


def exact_joint(target: LoadedTarget, prompt: list[int], sampling: SamplingConfig, n: int = NEW) -> torch.Tensor:
    """P(first n generated tokens), shape [V] * n, by enumeration (autoregressive definition)."""
    V = target.config.vocab_size
    joint = _next_probs(target, [prompt], sampling)[0]
    for step in range(1, n):
        prefixes = [prompt + list(idx) for idx in torch.cartesian_prod(*[torch.arange(V)] * step).reshape(-1, step)
                    .tolist()]
        cond = _next_probs(target, prefixes, sampling).reshape(*([V] * step), V)
        joint = joint[..., None] * cond
    assert math.isclose(float(joint.sum()), 1.0, abs_tol=1e-5)   # fp32 target_probs
    return joint / joint.sum()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled (smallest first) into bins of
    expected count >= 5. Observations in cells of probability zero fail outright."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = float(counts.sum())
    impossible = int(counts[probs == 0].sum())
    assert impossible == 0, f"{impossible} samples fell in cells the target gives probability 0"
    expected = probs * n
    order = torch.argsort(expected).tolist()
    f_obs, f_exp = [], []
    acc_o = acc_e = 0.0
    for i in order:
        if expected[i] == 0:
            continue
        acc_o += float(counts[i])
        acc_e += float(expected[i])
        if acc_e >= 5:
            f_obs.append(acc_o)
            f_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:   # leftover small mass joins the last (largest) bin
        f_obs[-1] += acc_o
        f_exp[-1] += acc_e
    assert len(f_obs) >= 5, "too few cells for a meaningful test"
    return float(chisquare(f_obs, f_exp).pvalue)


@dataclass
class SampleRun:
    counts: torch.Tensor
    accept_lengths: list[int]
    stats: dict


def sample_speculative(dec: DecodingLoop, sampling: SamplingConfig, runs: int, seed0: int,
                       monkeypatch=None, rule=None, max_batch: int = 16) -> SampleRun:
    """`runs` independent generations (distinct seeds), continuously batched `max_batch` at a
    time (each sequence draws from its own seeded generator, so batching changes no sample's
    law; 4x fewer seconds per sample than one at a time). The acceptance rule (the package's
    own unless `rule` is given) is wrapped to record which kind of step produced tokens."""
    V = VOCAB
    counts = torch.zeros([V] * NEW, dtype=torch.int64)
    stats = {"non_first_child_accepted": 0, "residual_after_rejection": 0, "bonus_at_leaf": 0, "calls": 0}
    real = rule or verify.accept_sampled

    def spy(tree, logits, sampling_cfg, generator):
        path, tok = real(tree, logits, sampling_cfg, generator)
        children = children_lists(tree.parents.tolist())
        stats["calls"] += 1
        for node in path[1:]:
            if children[int(tree.parents[node])][0] != node:
                stats["non_first_child_accepted"] += 1
        if children[path[-1]]:
            stats["residual_after_rejection"] += 1
        else:
            stats["bonus_at_leaf"] += 1
        return path, tok

    monkeypatch.setattr(loop_mod, "accept_sampled", spy)
    accept = []
    requests = [Request(PROMPT, NEW, SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k,
                                                    seed=seed0 + i)) for i in range(runs)]
    results = ([dec.generate(r.prompt_ids, NEW, r.sampling) for r in requests] if max_batch == 1
               else dec.generate_batch(requests, max_batch))
    for res in results:
        assert len(res.tokens) == NEW and res.stop_reason == "max_new_tokens"
        counts[tuple(res.tokens)] += 1
        accept += res.accept_lengths
    return SampleRun(counts, accept, stats)


def _assert_not_vacuous(run: SampleRun) -> None:
    assert any(a > 1 for a in run.accept_lengths), "no draft token was ever accepted"
    assert any(a >= 3 for a in run.accept_lengths), "never accepted two levels deep"
    assert run.stats["non_first_child_accepted"] > 0, "sibling after a rejection never accepted"
    assert run.stats["residual_after_rejection"] > 0, "residual sample never drawn"


# ----------------------------------------------------------------------------- lossless sampling

CASES = {   # name: (sampling, drafter, runs, max_batch); one case decodes one sequence at a time
    "t1.0": (SamplingConfig(temperature=1.0), "oracle", 1000, 16),
    "t0.7_p0.9": (SamplingConfig(temperature=0.7, top_p=0.9), "oracle", 800, 1),
    "t1.3_k5": (SamplingConfig(temperature=1.3, top_k=5), "oracle", 800, 16),
    "t1.3_k5_random_drafter": (SamplingConfig(temperature=1.3, top_k=5), "random", 800, 16),
    "t0.6_k4": (SamplingConfig(temperature=0.6, top_k=4), "oracle", 700, 16),   # the setup of the broken rules
}
NEGATIVE_CASE = "t0.6_k4"
P_VALUES: dict[str, float] = {}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(small_target, monkeypatch, case):
    sampling, kind, runs, max_batch = CASES[case]
    drafter = _oracle(small_target) if kind == "oracle" else _random(small_target)
    dec = _decoder(small_target, drafter)
    exact = exact_joint(small_target, PROMPT, sampling)
    run = sample_speculative(dec, sampling, runs, seed0=10_000 * (1 + list(CASES).index(case)),
                             monkeypatch=monkeypatch, max_batch=max_batch)
    _assert_not_vacuous(run)
    p = chi_square_p(run.counts, exact)
    P_VALUES[case] = p
    print(f"{case}: p = {p:.4g}, mean accept {sum(run.accept_lengths) / len(run.accept_lengths):.3f}, {run.stats}")
    assert p > 1e-3, f"speculative samples do not follow the target distribution (p = {p:.3g})"


@pytest.mark.parametrize("loop", ["two-call", "static"])
def test_sampling_is_lossless_per_sequence_inside_a_batch(small_target, loop):
    """Two sampling settings and greedy requests interleaved in one continuously batched decoder
    (8 sequences at a time, each its own settings and seed): each setting's samples fit its exact
    distribution, and every greedy sequence equals greedy decoding. static: the PyTorch engine
    at fixed shapes (runtime/static.py), whose batches with sampled sequences accept on the host
    between its draft-and-verify and commit graphs."""
    settings = {"t1.0": CASES["t1.0"][0], "t0.6_k4": CASES["t0.6_k4"][0]}
    exact = {name: exact_joint(small_target, PROMPT, cfg) for name, cfg in settings.items()}
    drafter = _oracle(small_target)
    if loop == "static":
        dec = static(capturing(small_target, drafter).model, drafter, SHAPE, [], small_target.config.vocab_size,
                     capacity=32)
    else:
        dec = _decoder(small_target, drafter)
    greedy = _greedy(small_target, PROMPT, NEW)
    requests, kinds = [], []
    for i in range(700):
        for name, cfg in settings.items():
            requests.append(Request(PROMPT, NEW, SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=90_000 + i)))
            kinds.append(name)
        if i % 10 == 0:
            requests.append(Request(PROMPT, NEW, SamplingConfig()))
            kinds.append("greedy")
    results = dec.generate_batch(requests, max_batch=8)
    counts = {name: torch.zeros([VOCAB] * NEW, dtype=torch.int64) for name in settings}
    for kind, res in zip(kinds, results):
        if kind == "greedy":
            assert res.tokens == greedy
        else:
            counts[kind][tuple(res.tokens)] += 1
    assert max(a for r in results for a in r.accept_lengths) >= 3, "drafts were not accepted deep: vacuous"
    for name in settings:
        p = chi_square_p(counts[name], exact[name])
        print(f"batched {name}: p = {p:.4g}")
        assert p > 1e-3, f"{name} inside a batch does not follow the target distribution (p = {p:.3g})"


def broken_accept_no_renormalise(tree, logits, sampling, generator):
    """WRONG on purpose: tries each child with its probability under the *unmodified* p and,
    after rejecting them all, samples from the unmodified p (drafted tokens keep their mass)."""
    tokens = [-1] + tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path, node = [0], 0
    while True:
        p = target_probs(logits[node], sampling)
        accepted = None
        for child in children[node]:
            if torch.rand((), generator=generator).item() < p[tokens[child]].item():
                accepted = child
                break
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        path.append(accepted)
        node = accepted


def broken_accept_residual_only_zeroed(tree, logits, sampling, generator):
    """WRONG on purpose, subtler: zeroes rejected tokens (so the residual is right) but does
    not renormalise p before trying the next sibling, so later siblings are under-accepted."""
    tokens = [-1] + tree.tokens.tolist()
    children = children_lists(tree.parents.tolist())
    path, node = [0], 0
    while True:
        p = target_probs(logits[node], sampling)
        accepted = None
        for child in children[node]:
            x = tokens[child]
            if torch.rand((), generator=generator).item() < p[x].item():
                accepted = child
                break
            p[x] = 0.0
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("rule", [broken_accept_no_renormalise, broken_accept_residual_only_zeroed],
                         ids=["no_renormalise", "no_sibling_rescale"])
def test_broken_acceptance_rule_is_detected(small_target, monkeypatch, rule):
    """Same setup, sample size and test as the passing case NEGATIVE_CASE, wrong rule: the
    target keeps 4 tokens and the oracle drafts 3 children, so drafted tokens carry most of
    the mass and any mistake in the rejection / residual bookkeeping shows."""
    sampling, kind, runs, max_batch = CASES[NEGATIVE_CASE]
    dec = _decoder(small_target, _oracle(small_target))
    exact = exact_joint(small_target, PROMPT, sampling)
    run = sample_speculative(dec, sampling, runs, seed0=5, monkeypatch=monkeypatch, rule=rule, max_batch=max_batch)
    _assert_not_vacuous(run)
    p = chi_square_p(run.counts, exact)
    P_VALUES[f"broken:{rule.__name__}"] = p
    print(f"{rule.__name__}: p = {p:.4g}")
    assert p < 1e-6, f"the chi-square test cannot tell a biased acceptance rule apart (p = {p:.3g})"


def test_exact_enumeration_matches_autoregressive_sampling(small_target):
    """Sanity of the oracle distribution itself: the plain autoregressive sampler fits it."""
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_joint(small_target, PROMPT, sampling)
    plain = two_call(TorchTarget(small_target.model), None, [], small_target.config.vocab_size)
    counts = torch.zeros([VOCAB] * NEW, dtype=torch.int64)
    for res in plain.generate_batch([Request(PROMPT, NEW, SamplingConfig(1.0, seed=50_000 + i)) for i in range(600)],
                                    max_batch=16):
        counts[tuple(res.tokens)] += 1
    assert chi_square_p(counts, exact) > 1e-3


# ----------------------------------------------------------------------------- target_probs


def _ref_target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Plain-Python reference: temperature, keep the k largest, then the smallest
    most-probable-first prefix whose mass reaches top_p (at least one token), renormalise."""
    z = (logits.double() / temperature).tolist()
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k else order
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    if top_p < 1.0:
        kept, cum = [], 0.0
        for i in keep:
            kept.append(i)
            cum += w[i] / total
            if cum >= top_p:
                break
        keep = kept
    total = sum(w[i] for i in keep)
    out = torch.zeros(len(z), dtype=torch.float64)
    for i in keep:
        out[i] = w[i] / total
    return out


def _safe_logits(gen: torch.Generator, V: int, temperature: float, top_p: float, rows: int = 64) -> torch.Tensor:
    """Random logit rows whose top-p cut is not within rounding distance of a boundary."""
    out = []
    while len(out) < rows:
        x = 2.5 * torch.randn(V, generator=gen)
        cum = torch.softmax(x.double() / temperature, -1).sort(descending=True).values.cumsum(0)
        if top_p < 1 and (cum - top_p).abs().min() < 1e-4:
            continue
        out.append(x)
    return torch.stack(out)


def test_target_probs_temperature():
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.3, 0.7, 1.0, 1.3, 4.0):
        p = target_probs(x, SamplingConfig(temperature=t))
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.double(), torch.softmax(x.double() / t, -1), atol=1e-6, rtol=1e-5)
    # lower temperature sharpens: the top token gains mass
    top = x.argmax(-1, keepdim=True)
    hi = target_probs(x, SamplingConfig(temperature=2.0)).gather(-1, top)
    lo = target_probs(x, SamplingConfig(temperature=0.5)).gather(-1, top)
    assert (lo > hi).all()


@pytest.mark.parametrize("k", [1, 2, 5, 19, 20, 25])
def test_target_probs_top_k_keeps_exactly_k(k):
    V = 20
    x = torch.randn(32, V, generator=torch.Generator().manual_seed(k)) * 2
    p = target_probs(x, SamplingConfig(temperature=0.8, top_k=k))
    kept = p > 0
    assert (kept.sum(-1) == min(k, V)).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, torch.topk(x, min(k, V), -1).indices, True))
    for row in range(x.shape[0]):
        torch.testing.assert_close(p[row].double(), _ref_target_probs(x[row], 0.8, k, 1.0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_p", [1e-6, 0.1, 0.5, 0.8, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_target_probs_top_p_smallest_prefix(top_p, temperature):
    gen = torch.Generator().manual_seed(int(top_p * 1000) + int(temperature * 10))
    x = _safe_logits(gen, 16, temperature, top_p)
    p = target_probs(x, SamplingConfig(temperature=temperature, top_p=top_p))
    base = torch.softmax(x.double() / temperature, -1)
    for row in range(x.shape[0]):
        kept = (p[row] > 0).nonzero().flatten().tolist()
        order = torch.argsort(base[row], descending=True).tolist()
        cum = base[row][order].cumsum(0)
        m = int((cum < top_p).sum()) + 1         # smallest prefix reaching top_p
        assert sorted(kept) == sorted(order[:m]), (row, kept, order[:m])
        assert len(kept) >= 1
        torch.testing.assert_close(p[row].double(), _ref_target_probs(x[row], temperature, 0, top_p),
                                   atol=1e-6, rtol=1e-5)


def test_target_probs_top_p_always_keeps_one_and_order_of_operations():
    # one dominant token: any top_p keeps it, tiny top_p keeps only it
    x = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    p = target_probs(x, SamplingConfig(temperature=1.0, top_p=1e-9))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # temperature is applied before top-p: logits [2, 1, 0], top_p 0.8
    x = torch.tensor([[2.0, 1.0, 0.0]])
    # T = 1: probs .665 .245 .090 -> {0, 1};  T = 3: probs .457 .328 .235 -> all three
    assert (target_probs(x, SamplingConfig(temperature=1.0, top_p=0.8)) > 0).sum() == 2
    assert (target_probs(x, SamplingConfig(temperature=3.0, top_p=0.8)) > 0).sum() == 3
    # top-k before top-p, top-p on the renormalised top-k distribution (transformers' order):
    # top-2 of [2, 1, 0] renormalised is .731 .269, so top_p 0.7 keeps one token
    assert (target_probs(x, SamplingConfig(temperature=1.0, top_k=2, top_p=0.7)) > 0).sum() == 1
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        x = 2 * torch.randn(12, generator=gen)
        k, tp, t = int(torch.randint(1, 12, (), generator=gen)), float(torch.rand((), generator=gen)), 0.9
        base = _ref_target_probs(x, t, k, 1.0)
        cum = base.sort(descending=True).values.cumsum(0)
        if (cum - tp).abs().min() < 1e-4:
            continue
        torch.testing.assert_close(target_probs(x, SamplingConfig(temperature=t, top_k=k, top_p=tp)).double(),
                                   _ref_target_probs(x, t, k, tp), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [8.0, 3.0, 1.0, 0.3], ids=lambda s: f"logit_std{s}")
def test_target_probs_top_p_large_vocabulary(scale):
    """A real vocabulary's size: the nucleus is cut from the largest probabilities (torch.topk),
    looking further while their mass falls short. From a few tokens (peaked) to most of the
    vocabulary (flat), every row equals the smallest most-probable-first prefix reaching top_p."""
    V, top_p = 6000, 0.9
    gen = torch.Generator().manual_seed(int(scale * 10))
    x = _safe_logits(gen, V, 1.0, top_p, rows=4) * scale / 2.5
    base = torch.softmax(x.double(), -1)
    p = target_probs(x, SamplingConfig(temperature=1.0, top_p=top_p))
    sizes = []
    for row in range(x.shape[0]):
        order = torch.argsort(base[row], descending=True)
        m = int((base[row][order].cumsum(0) < top_p).sum()) + 1
        kept = torch.zeros(V, dtype=torch.bool)
        kept[order[:m]] = True
        if (base[row][order[m - 1]] - base[row][order[m]]).abs() > 1e-12:   # no tie at the cut
            assert torch.equal(p[row] > 0, kept), row
        expected = torch.where(kept, base[row], 0.0)
        torch.testing.assert_close(p[row].double(), expected / expected.sum(), atol=1e-6, rtol=1e-4)
        sizes.append(m)
    probs, support = target_distribution(x, SamplingConfig(temperature=1.0, top_p=top_p))
    assert torch.equal(probs, p) and all(set((p[r] > 0).nonzero().flatten().tolist()) <= set(support[r].tolist())
                                         for r in range(x.shape[0]))
    if scale == 8.0:
        assert max(sizes) < NUCLEUS_FIRST      # found in the first look
    if scale == 0.3:
        assert min(sizes) > 8 * NUCLEUS_FIRST  # past the second: the sorted whole


def test_target_probs_top_k_keeps_ties_with_the_kth():
    """transformers' TopKLogitsWarper drops only logits below the k-th largest: ties stay."""
    x = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 2.0])
    p = target_probs(x, SamplingConfig(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [True, False, True, True, False, True]
    torch.testing.assert_close(p[2:4], p[[5, 5]])


def test_draw_follows_the_probabilities_and_never_draws_a_zero():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.35, 0.0, 0.25, 0.15, 0.1, 0.1, 0.05, 0.0])
    counts = torch.zeros(len(probs), dtype=torch.int64)
    for _ in range(4000):
        counts[draw(probs * 3.0, gen)] += 1        # unnormalised weights: the same distribution
    assert chi_square_p(counts, probs) > 1e-3
    # given the support (target_distribution's, most probable first): only those entries are
    # looked at, in that order, with the same distribution; an index with no mass there is never drawn
    support = torch.tensor([1, 3, 4, 5, 6, 7, 0])
    counts = torch.zeros(len(probs), dtype=torch.int64)
    for _ in range(4000):
        counts[draw(probs, gen, support)] += 1
    assert chi_square_p(counts, probs) > 1e-3
    # the check can fail: draws from other probabilities are rejected
    skewed = torch.zeros(len(probs), dtype=torch.int64)
    for _ in range(4000):
        skewed[draw(torch.tensor([0.0, 0.25, 0.0, 0.35, 0.15, 0.1, 0.1, 0.05, 0.0]), gen)] += 1
    assert chi_square_p(skewed, probs) < 1e-6
    assert draw(torch.tensor([0.0, 0.0, 2.0, 0.0]), gen) == 2


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("kind", ["oracle", "random"])
@pytest.mark.parametrize("shape", [SHAPE, TreeShape.chain(4), TreeShape(4, 2, 7)],
                         ids=lambda s: f"D{s.depth}k{s.top_k}N{s.total_tokens}")
def test_greedy_speculative_equals_autoregressive(small_target, kind, shape):
    drafter = _oracle(small_target) if kind == "oracle" else _random(small_target)
    dec = _decoder(small_target, drafter, shape)
    accepted_any = False
    for prompt in ([1, 5, 7, 3], [4], [2, 9, 9, 0, 11, 6, 8]):
        res = dec.generate(prompt, 24)
        assert res.tokens == _greedy(small_target, prompt, 24)
        assert sum(res.accept_lengths) + 1 >= 24
        accepted_any |= any(a > 1 for a in res.accept_lengths)
    if kind == "oracle":
        assert accepted_any
