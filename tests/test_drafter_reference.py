"""The EAGLE-3 / EAGLE 3.1 drafter step against an independent reference written from
DESIGN.md section 2 with plain torch functional ops on a dict of weights.

Nothing from eagle_trt.models is used by the reference: its own RMSNorm, RoPE (HF
rotate_half convention, theta from the config), GQA attention (repeat_interleave of the KV
heads, boolean mask), SiLU MLP. Every weight is random, norm weights included, so that a
norm applied in the wrong place, or skipped, shows up.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from eagle_trt.config import ConfigError, DrafterConfig
from eagle_trt.models.drafter import EagleDrafter

TOL = 1e-5

# A deliberately lopsided shape: drafter hidden != target hidden, head_dim != hidden/heads,
# GQA with 2 query heads per KV head, a reduced draft vocabulary, non-default theta and eps.
H, HT, A = 32, 40, 3
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 12
INTER, VOCAB, DRAFT_VOCAB = 56, 50, 20
THETA, EPS = 5000.0, 1e-6


def hf_config(**flags) -> dict:
    d = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HT,
        "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 256,
    }
    d.update(flags)
    return d


def make_cfg(fc_norm=False, norm_before_fc=False, norm_output=False, norm_before_residual=False) -> DrafterConfig:
    return DrafterConfig.from_hf(hf_config(fc_norm=fc_norm, norm_before_fc=norm_before_fc, norm_output=norm_output,
                                           norm_before_residual=norm_before_residual), "test")


def random_weights(cfg: DrafterConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the SafeAILab layout names, random; norms around 1 but not 1."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=0.2: s * torch.randn(*shape, generator=g)  # noqa: E731
    norm = lambda n: 1.0 + 0.3 * torch.randn(n, generator=g)          # noqa: E731
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {
        "embed_tokens.weight": rnd(VOCAB, H, s=1.0),
        "fc.weight": rnd(H, A * HT),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": rnd(q_out, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, q_out),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": rnd(INTER, H),
        "midlayer.mlp.up_proj.weight": rnd(INTER, H),
        "midlayer.mlp.down_proj.weight": rnd(H, INTER),
        "norm.weight": norm(H),
        "lm_head.weight": rnd(DRAFT_VOCAB, H),
    }
    if cfg.fc_norm:
        for i in range(A):
            w[f"fc_norm.{i}.weight"] = norm(HT)
    if cfg.norm_before_fc:
        w["input_norm.weight"] = norm(A * HT)
    used = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    w["d2t"] = used - torch.arange(DRAFT_VOCAB)          # offsets, int64
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    w["t2d"] = t2d
    return w


def build_drafter(cfg: DrafterConfig, w: dict[str, torch.Tensor]) -> EagleDrafter:
    d = EagleDrafter(cfg)
    d.load_state_dict(w, strict=True)
    assert int(d.d2t.abs().sum()) > 0, "d2t should be non-trivial"
    return d.eval()


# ----------------------------------------------------------------------------- the reference

def ref_rmsnorm(x, weight):
    return weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + EPS))


def ref_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def ref_rope(x, pos):
    """x [B, heads, T, D], pos [B, T]."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = pos.to(torch.float32)[..., None] * inv_freq          # [B, T, D/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None]               # [B, 1, T, D]
    return x * torch.cos(ang) + ref_rotate_half(x) * torch.sin(ang)


def ref_attention(w, u, pos, mask, past_k, past_v):
    """KV tensors in and out use the graphs' [B, Hkv, S, D] layout."""
    B, T, _ = u.shape
    p = "midlayer.self_attn."
    q = F.linear(u, w[p + "q_proj.weight"]).reshape(B, T, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
    k = F.linear(u, w[p + "k_proj.weight"]).reshape(B, T, KV_HEADS, HEAD_DIM).permute(0, 2, 1, 3)
    v = F.linear(u, w[p + "v_proj.weight"]).reshape(B, T, KV_HEADS, HEAD_DIM).permute(0, 2, 1, 3)
    q, k = ref_rope(q, pos), ref_rope(k, pos)
    keys = torch.cat((past_k, k), dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    vals = torch.cat((past_v, v), dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    scores = torch.where(mask[:, None], scores, torch.tensor(float("-inf")))
    out = torch.softmax(scores, dim=-1) @ vals                  # [B, heads, T, D]
    out = out.permute(0, 2, 1, 3).reshape(B, T, HEADS * HEAD_DIM)
    return F.linear(out, w[p + "o_proj.weight"]), k, v


def ref_project(w, cfg, captured):
    """Steps 1-3: g = concat of captured states (optionally normed) -> f = fc(g)."""
    if cfg.fc_norm:
        chunks = [captured[..., i * HT:(i + 1) * HT] for i in range(A)]
        captured = torch.cat([ref_rmsnorm(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], dim=-1)
    elif cfg.norm_before_fc:
        captured = ref_rmsnorm(captured, w["input_norm.weight"])
    return captured @ w["fc.weight"].T


def ref_step(w, cfg, f, ids, pos, mask, past_k, past_v):
    """Steps 4-8 of one drafter step; returns every intermediate the test needs."""
    e = w["embed_tokens.weight"][ids]
    hn = ref_rmsnorm(f, w["midlayer.hidden_norm.weight"])
    u = torch.cat((ref_rmsnorm(e, w["midlayer.input_layernorm.weight"]), hn), dim=-1)
    attn, k, v = ref_attention(w, u, pos, mask, past_k, past_v)
    h1 = attn + (hn if cfg.norm_before_residual else f)
    x = ref_rmsnorm(h1, w["midlayer.post_attention_layernorm.weight"])
    mlp = F.linear(F.silu(F.linear(x, w["midlayer.mlp.gate_proj.weight"])) * F.linear(x, w["midlayer.mlp.up_proj.weight"]),
                   w["midlayer.mlp.down_proj.weight"])
    h2 = h1 + mlp
    z = ref_rmsnorm(h2, w["norm.weight"])
    logits = z @ w["lm_head.weight"].T
    return {"logits": logits, "h2": h2, "z": z, "k": k, "v": v,
            "feedback": z if cfg.norm_output else h2}


def maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- single step

def tree_inputs(seed=1, B=2, P=3, T=4):
    g = torch.Generator().manual_seed(seed)
    captured = 2.0 * torch.randn(B, T, A * HT, generator=g)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    # Tree-like positions: siblings share a position; different per batch row.
    pos = torch.tensor([[P, P + 1, P + 1, P + 2], [P + 5, P + 6, P + 7, P + 7]])
    past_k = torch.randn(B, KV_HEADS, P, HEAD_DIM, generator=g)
    past_v = torch.randn(B, KV_HEADS, P, HEAD_DIM, generator=g)
    # Non-causal boolean mask [B, T, P + T]: random, each row sees itself, some past rows hidden.
    mask = torch.rand(B, T, P + T, generator=g) > 0.4
    mask[:, torch.arange(T), P + torch.arange(T)] = True
    mask[0, 2, P + 1] = False   # a sibling does not see its sibling...
    mask[0, 1, P + 3] = True    # ...and a row sees a later (non-causal) column
    mask[1, 0, :P] = False      # a row that sees no past at all
    assert not torch.equal(mask, torch.tril(torch.ones(T, P + T, dtype=torch.bool), diagonal=P).expand(B, -1, -1))
    return captured, ids, pos, mask, past_k, past_v


FLAG_COMBOS = [
    dict(fc_norm=fcn, norm_before_fc=nbf, norm_output=no, norm_before_residual=nbr)
    for (fcn, nbf), no, nbr in itertools.product([(False, False), (True, False), (False, True)], [False, True],
                                                  [False, True])
]


@pytest.mark.parametrize("flags", FLAG_COMBOS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "plain")
def test_step_matches_reference(flags):
    cfg = make_cfg(**flags)
    w = random_weights(cfg, seed=hash(tuple(flags.values())) % 1000)
    drafter = build_drafter(cfg, w)
    captured, ids, pos, mask, past_k, past_v = tree_inputs()
    with torch.no_grad():
        f = drafter.project(captured)
        out = drafter(f, ids, pos, mask, past_k, past_v)
    f_ref = ref_project(w, cfg, captured)
    ref = ref_step(w, cfg, f_ref, ids, pos, mask, past_k, past_v)
    assert maxdiff(f, f_ref) <= TOL
    assert out.logits.shape == (2, 4, DRAFT_VOCAB)
    assert maxdiff(out.logits, ref["logits"]) <= TOL
    assert maxdiff(out.feedback, ref["feedback"]) <= TOL
    assert maxdiff(out.new_k, ref["k"]) <= TOL
    assert maxdiff(out.new_v, ref["v"]) <= TOL


def test_flags_change_the_output():
    """Each flag must actually do something with these weights (else the sweep proves little)."""
    captured, ids, pos, mask, past_k, past_v = tree_inputs()
    base = make_cfg()
    w = random_weights(make_cfg(fc_norm=True), seed=3)
    w.update({"input_norm.weight": 1.0 + 0.3 * torch.randn(A * HT)})
    results = {}
    for name, flags in {"plain": {}, "fc_norm": {"fc_norm": True}, "norm_before_fc": {"norm_before_fc": True},
                        "norm_before_residual": {"norm_before_residual": True}}.items():
        cfg = make_cfg(**flags)
        ws = {k: v for k, v in w.items() if not (k.startswith("fc_norm") and not cfg.fc_norm)
              and not (k == "input_norm.weight" and not cfg.norm_before_fc)}
        d = build_drafter(cfg, ws)
        with torch.no_grad():
            results[name] = d(d.project(captured), ids, pos, mask, past_k, past_v).logits
    for name in ("fc_norm", "norm_before_fc", "norm_before_residual"):
        assert maxdiff(results[name], results["plain"]) > 1e-3, name
    assert base.variant == "eagle3"


@pytest.mark.parametrize("extra", [{"fc_norm": True, "norm_before_fc": True},
                                   {"fc_norm": True, "eagle_config": {"norm_before_fc": True}}])
def test_fc_norm_and_norm_before_fc_are_exclusive(extra):
    with pytest.raises(ConfigError, match="exclusive"):
        DrafterConfig.from_hf(hf_config(**extra), "drafter/config.json")


def test_config_flags_parsed():
    assert make_cfg(fc_norm=True, norm_output=True).variant == "eagle3.1"
    assert make_cfg().variant == "eagle3"
    # ModelOpt spelling of the 3.1 output norm.
    cfg = DrafterConfig.from_hf(dict(hf_config(), eagle_config={"return_hidden_post_norm": True}), "x")
    assert cfg.norm_output is True
    # A checkpoint without any 3.1 flag is plain EAGLE-3.
    plain = DrafterConfig.from_hf(hf_config(), "x")
    assert (plain.fc_norm, plain.norm_before_fc, plain.norm_output, plain.norm_before_residual) == (False,) * 4


# ----------------------------------------------------------------------------- multi-step feedback

def run_chain(drafter: EagleDrafter, captured, ids0, chain_ids):
    """Step 0 over T committed tokens (causal, no past), then one token per later step with
    the previous step's feedback at the last position in place of f. Returns per-step outputs."""
    B, T = ids0.shape
    pk, pv = drafter.empty_past(B)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None].expand(B, -1, -1)
    outs = []
    with torch.no_grad():
        out = drafter(drafter.project(captured), ids0, torch.arange(T)[None].expand(B, -1), causal, pk, pv)
        outs.append(out)
        pk, pv = torch.cat((pk, out.new_k), 2), torch.cat((pv, out.new_v), 2)
        hidden = out.feedback[:, -1:]
        for step, tok in enumerate(chain_ids, start=1):
            S = pk.shape[2]
            mask = torch.ones(B, 1, S + 1, dtype=torch.bool)
            out = drafter(hidden, tok, torch.full((B, 1), T - 1 + step), mask, pk, pv)
            outs.append(out)
            pk, pv = torch.cat((pk, out.new_k), 2), torch.cat((pv, out.new_v), 2)
            hidden = out.feedback[:, -1:]
    return outs


def ref_chain(w, cfg, captured, ids0, chain_ids):
    B, T = ids0.shape
    pk = torch.zeros(B, KV_HEADS, 0, HEAD_DIM)
    pv = torch.zeros(B, KV_HEADS, 0, HEAD_DIM)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None].expand(B, -1, -1)
    r = ref_step(w, cfg, ref_project(w, cfg, captured), ids0, torch.arange(T)[None].expand(B, -1), causal, pk, pv)
    steps = [r]
    for step, tok in enumerate(chain_ids, start=1):
        pk, pv = torch.cat((pk, r["k"]), 2), torch.cat((pv, r["v"]), 2)
        fed = (r["z"] if cfg.norm_output else r["h2"])[:, -1:]   # 3.1 feeds post-norm z, EAGLE-3 pre-norm h2
        r = ref_step(w, cfg, fed, tok, torch.full((B, 1), T - 1 + step), torch.ones(B, 1, pk.shape[2] + 1, dtype=torch.bool),
                     pk, pv)
        steps.append(r)
    return steps


def chain_inputs(seed=7, B=2, T=5):
    g = torch.Generator().manual_seed(seed)
    captured = 2.0 * torch.randn(B, T, A * HT, generator=g)
    ids0 = torch.randint(0, VOCAB, (B, T), generator=g)
    chain_ids = [torch.randint(0, VOCAB, (B, 1), generator=g) for _ in range(2)]
    return captured, ids0, chain_ids


@pytest.mark.parametrize("norm_output", [False, True], ids=["eagle3-h2", "eagle3.1-z"])
@pytest.mark.parametrize("fc_norm", [False, True])
def test_multistep_feedback(norm_output, fc_norm):
    cfg = make_cfg(fc_norm=fc_norm, norm_output=norm_output)
    w = random_weights(cfg, seed=11)
    drafter = build_drafter(cfg, w)
    captured, ids0, chain_ids = chain_inputs()
    outs = run_chain(drafter, captured, ids0, chain_ids)
    refs = ref_chain(w, cfg, captured, ids0, chain_ids)
    assert len(outs) == 3
    for step, (o, r) in enumerate(zip(outs, refs)):
        fed, other = ("z", "h2") if norm_output else ("h2", "z")
        assert maxdiff(o.feedback, r[fed]) <= TOL, f"step {step}: feedback is not {fed}"
        assert maxdiff(o.feedback, r[other]) > 1e-2, f"step {step}: feedback looks like {other}"
        assert maxdiff(o.logits, r["logits"]) <= TOL, f"step {step}: logits differ from the reference chain"


def test_feedback_variant_changes_later_steps():
    """Same weights, EAGLE-3 vs EAGLE 3.1 feedback: step 0 agrees, step 2 must differ, and each
    matches only its own reference chain (so a swapped feedback would be caught)."""
    cfg3, cfg31 = make_cfg(norm_output=False), make_cfg(norm_output=True)
    w = random_weights(cfg3, seed=5)
    d3, d31 = build_drafter(cfg3, w), build_drafter(cfg31, w)
    captured, ids0, chain_ids = chain_inputs(seed=8)
    o3, o31 = run_chain(d3, captured, ids0, chain_ids), run_chain(d31, captured, ids0, chain_ids)
    assert maxdiff(o3[0].logits, o31[0].logits) <= TOL
    assert maxdiff(o3[2].logits, o31[2].logits) > 1e-2
    r3, r31 = ref_chain(w, cfg3, captured, ids0, chain_ids), ref_chain(w, cfg31, captured, ids0, chain_ids)
    assert maxdiff(o3[2].logits, r3[2]["logits"]) <= TOL
    assert maxdiff(o31[2].logits, r31[2]["logits"]) <= TOL
    assert maxdiff(o3[2].logits, r31[2]["logits"]) > 1e-2
    assert maxdiff(o31[2].logits, r3[2]["logits"]) > 1e-2


def test_step_batch_rows_independent():
    """Row b of a batched step equals the same row run alone (no cross-batch leakage)."""
    cfg = make_cfg(fc_norm=True, norm_output=True)
    w = random_weights(cfg, seed=2)
    d = build_drafter(cfg, w)
    captured, ids, pos, mask, pk, pv = tree_inputs()
    with torch.no_grad():
        full = d(d.project(captured), ids, pos, mask, pk, pv).logits
        one = d(d.project(captured[1:]), ids[1:], pos[1:], mask[1:], pk[1:], pv[1:]).logits
    assert maxdiff(full[1:], one) <= TOL


# ----------------------------------------------------------------------------- d2t

def test_to_target_ids_uses_offsets():
    cfg = make_cfg()
    w = random_weights(cfg, seed=4)
    d = build_drafter(cfg, w)
    used = torch.nonzero(w["t2d"]).flatten()           # sorted target ids in the draft vocabulary
    draft = torch.arange(DRAFT_VOCAB)
    assert torch.equal(d.to_target_ids(draft), used)
    assert torch.equal(d.to_target_ids(draft), draft + w["d2t"])
    assert not torch.equal(d.to_target_ids(draft), w["d2t"])   # not an absolute table
    # Arbitrary shapes (e.g. [B, k] top-k ids) map element-wise.
    ids = torch.tensor([[3, 0, 19], [7, 7, 1]])
    assert torch.equal(d.to_target_ids(ids), ids + w["d2t"][ids])
    assert d.to_target_ids(ids).dtype == torch.int64
    # A hand-made table: draft 0 -> 5, 1 -> 6, 2 -> 40.
    d.d2t.zero_()
    d.d2t[:3] = torch.tensor([5, 5, 38])
    assert d.to_target_ids(torch.tensor([0, 1, 2, 3])).tolist() == [5, 6, 40, 3]
