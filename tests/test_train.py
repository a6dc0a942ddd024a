"""Drafter training: feature cache, draft vocabulary, the training-time test (TTT) against the
runtime's own drafting, resumable training, the saved checkpoint in the runtime's decoding loop, and
the MT-bench guard. Fast tests use a tiny random target and synthetic token sequences."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import capturing, share, static, write_tiny_hf_target

from eagle_trt.checkpoints import load_drafter, load_target, save_drafter
from eagle_trt.config import CaptureLayers, TreeShape
from eagle_trt.models.target import causal_mask
from eagle_trt.train import features as features_mod
from eagle_trt.train.data import DataConfig, DataError, MTBenchGuard, Sample, iter_json_array, load_samples, to_messages
from eagle_trt.train.features import FeatureConfig, FeatureError, FeatureStore, extract_features
from eagle_trt.train.ttt import TrainConfig, TrainError, batch_indices, collate, new_drafter, train, ttt_forward
from eagle_trt.train.vocab import DraftVocab, build_draft_vocab, count_tokens

VOCAB, DRAFT_VOCAB = 96, 64


@pytest.fixture(scope="module")
def target(request, tmp_path_factory):
    return share(request, load_target(write_tiny_hf_target(tmp_path_factory.mktemp("train_target"), vocab=VOCAB, seed=5)))


@pytest.fixture(scope="module")
def capture(target):
    return CaptureLayers.eagle_default(target.config.num_hidden_layers)


@pytest.fixture(scope="module")
def samples(target) -> list[Sample]:
    """Sequences sampled from the target itself, so that they carry learnable structure;
    the first 6 tokens of each play the prompt (loss mask 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(3, VOCAB, (24, 4), generator=gen)
    with torch.no_grad():
        while x.shape[1] < 44:
            T = x.shape[1]
            pk, pv = target.model.empty_past(x.shape[0])
            logits = target.model(x, torch.arange(T)[None].expand(x.shape[0], T), causal_mask(T, 0), pk, pv,
                                  torch.tensor([T - 1])).logits[:, -1]
            x = torch.cat((x, torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=gen)), dim=1)
    lengths = torch.randint(24, 45, (24,), generator=gen).tolist()
    return [Sample(f"syn{i}", x[i, :L].tolist(), [0] * 6 + [1] * (L - 6)) for i, L in enumerate(lengths)]


@pytest.fixture(scope="module")
def store(target, capture, samples, tmp_path_factory):
    return extract_features(target, samples, tmp_path_factory.mktemp("feat"), capture, FeatureConfig(shard_size=8),
                            log=lambda _: None)


@pytest.fixture(scope="module")
def vocab(store) -> DraftVocab:
    items = [store.get(i, ("ids", "mask")) for i in range(len(store))]
    return build_draft_vocab(count_tokens([it["ids"] for it in items], [it["mask"] for it in items], VOCAB), DRAFT_VOCAB)


def make_drafter(target, vocab, capture, variant, seed=0):
    m = target.model
    return new_drafter(target.config, variant, vocab, capture, m.embed_tokens.weight, head_rows(target, vocab),
                       m.norm.weight.detach(), seed=seed)


def head_rows(target, vocab):
    return target.model.lm_head.weight.detach()[vocab.used].clone()


# ----------------------------------------------------------------------------- features

def test_features_round_trip(target, capture, samples, store):
    assert len(store) == len(samples) and store.lengths == [len(s.ids) for s in samples]
    model = capturing(target, capture).model
    for i in (0, 13, 23):
        got, s = store.get(i), samples[i]
        assert got["ids"].tolist() == s.ids and got["mask"].tolist() == s.loss_mask
        T = len(s.ids)
        grabbed: list[torch.Tensor] = []
        h = model.norm.register_forward_hook(lambda _m, _i, o, into=grabbed: into.append(o))
        with torch.no_grad():
            out = model(torch.tensor([s.ids]), torch.arange(T)[None], causal_mask(T, 0), *model.empty_past(1))
        h.remove()
        assert got["captured"].dtype == torch.float16 and got["captured"].shape == (T, 3 * target.config.hidden_size)
        torch.testing.assert_close(got["captured"].float(), out.captured[0], atol=2e-2, rtol=1e-3)
        torch.testing.assert_close(got["normed"].float(), grabbed[0][0], atol=2e-2, rtol=1e-3)
        assert got["argmax"].tolist() == out.logits[0].argmax(-1).tolist()
        # The cached normed state reproduces the target's logits through lm_head.
        torch.testing.assert_close(got["normed"].float() @ model.lm_head.weight.T, out.logits[0], atol=0.1, rtol=1e-2)


def test_features_resume_skips_finished_shards(target, capture, samples, tmp_path, monkeypatch):
    folder = tmp_path / "feat"
    extract_features(target, samples, folder, capture, FeatureConfig(shard_size=8), log=lambda _: None)
    shards = sorted(folder.glob("shard_*.safetensors"))
    assert len(shards) == 3 and not list(folder.glob(".*tmp"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[1].unlink()                                       # as if interrupted before shard 1 was written
    calls = []
    real = features_mod.target_features
    monkeypatch.setattr(features_mod, "target_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = extract_features(target, samples, folder, capture, FeatureConfig(shard_size=8), log=lambda _: None)
    assert len(calls) == 8                                   # only the missing shard was computed
    assert shards[0].stat().st_mtime_ns == mtimes[shards[0].name]
    assert shards[2].stat().st_mtime_ns == mtimes[shards[2].name]
    assert store.get(9)["ids"].tolist() == samples[9].ids
    calls.clear()
    extract_features(target, samples, folder, capture, FeatureConfig(shard_size=8), log=lambda _: None)
    assert calls == []
    # Another capture, or other samples in a finished shard, are refused with the file named.
    with pytest.raises(FeatureError, match="features.json"):
        extract_features(target, samples, folder, CaptureLayers((1, 2, 3)), FeatureConfig(shard_size=8))
    changed = [Sample("other", samples[0].ids, samples[0].loss_mask)] + samples[1:]
    with pytest.raises(FeatureError, match="shard_00000"):
        extract_features(target, changed, folder, capture, FeatureConfig(shard_size=8))
    with pytest.raises(FeatureError, match="capture"):
        FeatureStore(folder).check_target(target, CaptureLayers((1, 2, 3)))


# ----------------------------------------------------------------------------- vocabulary

def test_draft_vocab_and_d2t(tmp_path):
    seqs = [torch.tensor([5, 5, 5, 7, 7, 9, 1, 1, 1, 1]), torch.tensor([9, 9, 2, 2, 2, 2, 2])]
    masks = [torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0]), torch.ones(7, dtype=torch.uint8)]
    counts = count_tokens(seqs, masks, 12)
    assert counts[1] == 0 and counts[5] == 3 and counts[2] == 5 and counts[9] == 3
    v = build_draft_vocab(counts, 4)
    assert v.used.tolist() == [2, 5, 7, 9]                  # top 4 by count, sorted (5 and 9 tie)
    assert v.d2t.dtype == torch.int64 and v.d2t.tolist() == [2, 4, 5, 6]
    assert torch.equal(torch.arange(4) + v.d2t, v.used)
    assert v.t2d.dtype == torch.bool and v.t2d.nonzero().flatten().tolist() == [2, 5, 7, 9]
    assert v.coverage == pytest.approx(1.0)
    # Ties, never-seen ids included, go to the lower id.
    assert build_draft_vocab(counts, 6).used.tolist() == [0, 1, 2, 5, 7, 9]
    v.save(tmp_path / "v.safetensors")
    back = DraftVocab.load(tmp_path / "v.safetensors", 12)
    assert torch.equal(back.used, v.used) and torch.equal(back.d2t, v.d2t) and torch.equal(back.t2d, v.t2d)
    with pytest.raises(ValueError, match="vocab_size 50"):
        DraftVocab.load(tmp_path / "v.safetensors", 50)
    with pytest.raises(ValueError, match="1..12"):
        build_draft_vocab(counts, 13)


# ----------------------------------------------------------------------------- TTT

def runtime_chain_logits(drafter, item, j, steps):
    """Logits of drafting a chain from index j the way tree.draft_tree does: step 0 over the
    committed rows 0..j, then one frontier node per step that sees the context and its own
    ancestors, fed the previous step's feedback and the next data token."""
    ids, cap = item["ids"].long()[None], item["captured"].float()[None]
    with torch.no_grad():
        s0 = drafter(drafter.project(cap[:, : j + 1]), ids[:, 1: j + 2], torch.arange(j + 1)[None],
                     causal_mask(j + 1, 0), *drafter.empty_past(1))
        out, state = [s0.logits[0, -1]], s0.feedback[:, -1:]
        ks, vs = s0.new_k, s0.new_v
        for k in range(1, steps):
            mask = torch.ones(1, 1, ks.shape[2] + 1, dtype=torch.bool)
            step = drafter(state, ids[:, j + 1 + k: j + 2 + k], torch.tensor([[j + k]]), mask, ks, vs)
            ks, vs = torch.cat((ks, step.new_k), 2), torch.cat((vs, step.new_v), 2)
            out.append(step.logits[0, -1])
            state = step.feedback
    return out


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_equals_runtime_chain_drafting(target, store, vocab, capture, variant):
    """Masks, position shifts, input-id shifts and feedback in training match inference."""
    drafter = make_drafter(target, vocab, capture, variant, seed=1)
    items = [store.get(2), store.get(5)]
    with torch.no_grad():
        o = ttt_forward(drafter, collate(items), head_rows(target, vocab), 3, keep_logits=True)
    for b, item in enumerate(items):
        L = int(item["ids"].shape[0])
        for j in (0, 7, L - 4):
            ref = runtime_chain_logits(drafter, item, j, 3)
            for k in range(3):
                torch.testing.assert_close(o.logits[k][b, j], ref[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_anchored_ttt_equals_the_full_unroll_at_its_anchors(target, store, vocab, capture, variant):
    """Unrolling steps 1.. from a few positions only gives, at those positions, exactly the full
    unroll's logits: each chain sees step-0 rows and its own rows, nothing of other chains."""
    from eagle_trt.train.ttt import sample_anchors
    drafter = make_drafter(target, vocab, capture, variant, seed=1)
    batch = collate([store.get(2), store.get(5), store.get(7)])
    anchors = sample_anchors(batch, 0.25, seed=0, step=3)
    n = batch.ids.shape[1] - 1
    assert anchors.shape == (3, -(-n // 4)) and torch.all(anchors[:, 1:] > anchors[:, :-1])
    assert bool(batch.pred_mask.gather(1, anchors).all())      # predicted positions are drawn first
    assert torch.equal(anchors, sample_anchors(batch, 0.25, seed=0, step=3)) and sample_anchors(batch, 1.0, 0, 3) is None
    with torch.no_grad():
        full = ttt_forward(drafter, batch, head_rows(target, vocab), 3, keep_logits=True)
        part = ttt_forward(drafter, batch, head_rows(target, vocab), 3, keep_logits=True, anchors=anchors)
    torch.testing.assert_close(part.logits[0], full.logits[0])
    for k in (1, 2):
        picked = full.logits[k].gather(1, anchors[..., None].expand(-1, -1, full.logits[k].shape[-1]))
        torch.testing.assert_close(part.logits[k], picked, atol=1e-5, rtol=1e-5)
    assert 0 < part.counts[1] <= anchors.numel() and part.counts[0] == full.counts[0]


def test_feedback_is_prenorm_for_eagle3_and_postnorm_for_31(target, store, vocab, capture):
    """Same weights, only the feedback flag swapped: step 0 is unchanged, later steps change."""
    batch = collate([store.get(0), store.get(1)])
    head = head_rows(target, vocab)
    e3 = make_drafter(target, vocab, capture, "eagle3", seed=2)
    swapped = make_drafter(target, vocab, capture, "eagle3", seed=2)
    swapped.cfg.norm_output = True                # feed back z = norm(h2) instead of h2
    with torch.no_grad():
        a = ttt_forward(e3, batch, head, 3, keep_logits=True)
        b = ttt_forward(swapped, batch, head, 3, keep_logits=True)
    assert torch.equal(a.logits[0], b.logits[0])
    for k in (1, 2):
        assert (a.logits[k] - b.logits[k]).abs().max() > 1e-3
    # Step 1 at index 0 by hand: EAGLE-3 feeds h2 (pre-norm), the swapped flag feeds norm(h2).
    item = store.get(0)
    ids, cap = item["ids"].long()[None], item["captured"].float()[None]
    with torch.no_grad():
        s0 = e3(e3.project(cap[:, :1]), ids[:, 1:2], torch.zeros(1, 1, dtype=torch.long), causal_mask(1, 0),
                *e3.empty_past(1))
        h2 = s0.feedback
        args = (ids[:, 2:3], torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, 2, dtype=torch.bool), s0.new_k, s0.new_v)
        pre, post = e3(h2, *args).logits[0, 0], e3(e3.norm(h2), *args).logits[0, 0]
    assert (pre - post).abs().max() > 1e-3
    torch.testing.assert_close(a.logits[1][0, 0], pre, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.logits[1][0, 0], post, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained(target, store, vocab, capture, tmp_path_factory):
    runs = {}
    for variant in ("eagle3", "eagle3.1"):
        drafter = make_drafter(target, vocab, capture, variant)
        cfg = TrainConfig(variant=variant, steps=40, batch_size=4, lr=3e-3, warmup_steps=5, log_every=100,
                          save_every=20, eval_sequences=4)
        out = tmp_path_factory.mktemp(f"run-{variant}")
        result = train(drafter, store, head_rows(target, vocab), cfg, out, log=lambda _: None)
        runs[variant] = (drafter, result, out)
    return runs


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_loss_decreases(trained, variant):
    _, result, out = trained[variant]
    start, *steps = result.log        # step 0: where the starting weights stand, before any update
    assert start["step"] == 0 and start["cpu_s"] == 0 and len(start["eval_acc"]) == 3 and "loss" not in start
    assert result.finished and result.step == 40 and [e["step"] for e in steps] == list(range(1, 41))
    assert all(b["cpu_s"] > a["cpu_s"] for a, b in zip(steps, steps[1:]))   # training CPU time, counted up
    result = dataclasses.replace(result, log=steps)
    first = sum(e["loss"] for e in result.log[:5]) / 5
    last = sum(e["loss"] for e in result.log[-5:]) / 5
    assert last < first - 0.3, (first, last)
    for k in range(3):   # every TTT step improves, not only step 0
        assert sum(e["step_loss"][k] for e in result.log[-5:]) < sum(e["step_loss"][k] for e in result.log[:5])
    assert sum(e["acc"][0] for e in result.log[-5:]) > sum(e["acc"][0] for e in result.log[:5])
    assert "eval_acc" in result.log[-1] and len(result.log[-1]["eval_acc"]) == 3
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["step"] == 40 and saved["config"]["variant"] == variant


@pytest.mark.parametrize("length_groups", [1, 4])
def test_resumed_run_reproduces_uninterrupted_trajectory(target, store, vocab, capture, tmp_path, length_groups):
    cfg = TrainConfig(variant="eagle3.1", steps=12, batch_size=3, lr=2e-3, warmup_steps=3, log_every=100, save_every=4,
                      length_groups=length_groups)
    head = head_rows(target, vocab)
    full = train(make_drafter(target, vocab, capture, "eagle3.1"), store, head, cfg, tmp_path / "a", log=lambda _: None)
    first = train(make_drafter(target, vocab, capture, "eagle3.1"), store, head, cfg, tmp_path / "b", stop_at=6,
                  log=lambda _: None)
    assert first.step == 6 and not first.finished
    # A fresh process would build a fresh (here: differently initialised) drafter and resume.
    resumed_drafter = make_drafter(target, vocab, capture, "eagle3.1", seed=99)
    resumed = train(resumed_drafter, store, head, cfg, tmp_path / "b", resume=True, log=lambda _: None)
    assert resumed.finished and [e["step"] for e in resumed.log] == list(range(1, 13))
    assert [e["loss"] for e in resumed.log] == pytest.approx([e["loss"] for e in full.log], rel=1e-6, abs=1e-7)
    assert [e["acc"] for e in resumed.log] == [e["acc"] for e in full.log]
    with pytest.raises(TrainError, match="batch_size"):
        train(make_drafter(target, vocab, capture, "eagle3.1"), store, head,
              TrainConfig(variant="eagle3.1", steps=12, batch_size=2, length_groups=length_groups), tmp_path / "b",
              resume=True)
    with pytest.raises(TrainError, match="length_groups"):
        train(make_drafter(target, vocab, capture, "eagle3.1"), store, head,
              dataclasses.replace(cfg, length_groups=length_groups + 1), tmp_path / "b", resume=True)


def test_length_groups_regroup_the_same_sequences_with_less_padding():
    """--length-groups G: the G batches of a group hold exactly the sequences the plain stream
    gives those steps (each epoch still sees every sequence once), cut by length, so batches pad
    far less; the choice is a pure function of (seed, step), and G = 1 is the plain stream."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(8, 512, (203,), generator=gen).tolist()
    ids = list(range(200))                 # the last 3 held out, as train() does
    plain, grouped = TrainConfig(batch_size=4), TrainConfig(batch_size=4, length_groups=16)
    steps = range(3 * 16)
    a = [batch_indices(i, ids, plain, lengths) for i in steps]
    b = [batch_indices(i, ids, grouped, lengths) for i in steps]
    assert a == [batch_indices(i, ids, plain) for i in steps]                 # lengths change nothing at G = 1
    for g in range(3):
        chunk = slice(16 * g, 16 * (g + 1))
        assert sorted(sum(a[chunk], [])) == sorted(sum(b[chunk], []))
    assert b == [batch_indices(i, ids, grouped, lengths) for i in steps]     # deterministic: resumable
    assert b[:16] != sorted(b[:16], key=lambda batch: lengths[batch[0]])     # dealt out, not shortest first
    padded = lambda batches: sum(len(x) * max(lengths[i] for i in x) for x in batches)  # noqa: E731
    assert padded(b) < 0.75 * padded(a)
    with pytest.raises(TrainError, match="length_groups"):
        TrainConfig(length_groups=0).validate()
    with pytest.raises(TrainError, match="lengths"):
        batch_indices(0, ids, grouped)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_saved_drafter_is_lossless_in_the_decoding_loop(target, trained, samples, variant, tmp_path):
    drafter, _, _ = trained[variant]
    import copy
    folder = save_drafter(copy.deepcopy(drafter).to(torch.bfloat16), tmp_path / "drafter")
    weights = folder / "model.safetensors"
    from safetensors.torch import load_file
    tensors = load_file(str(weights))
    assert "embed_tokens.weight" not in tensors and "midlayer.self_attn.q_proj.weight" in tensors
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert tensors["lm_head.weight"].shape[0] == DRAFT_VOCAB
    loaded = load_drafter(folder, target)
    assert loaded.cfg.variant == variant and loaded.cfg.capture == drafter.cfg.capture
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    target = capturing(target, loaded)
    eos = target.config.eos_token_ids
    dec = static(target.model, loaded, TreeShape(depth=3, top_k=2, total_tokens=6), eos, max_batch=1)
    plain = static(target.model, eos=eos, max_batch=1)
    accepted = []
    for s in samples[:4]:
        prompt = s.ids[:8]
        res = dec.generate(prompt, 24)
        assert res.tokens == plain.generate(prompt, 24).tokens
        accepted += res.accept_lengths
    assert max(accepted) >= 2   # the trained drafter's drafts were really accepted somewhere


# ----------------------------------------------------------------------------- data

MT_Q = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."


class ByteChatTokenizer:
    """A byte-level tokenizer with a ChatML template: enough for rendering and masks."""
    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


def test_mtbench_guard_rejects_mtbench_questions(tmp_path):
    guard = MTBenchGuard([MT_Q, "What is 2+2?"])
    clean = [{"role": "user", "content": "Tell me about volcanoes."}, {"role": "assistant", "content": "Hot."}]
    hit = [{"role": "user", "content": "Please:  " + MT_Q.upper().replace(" ", "\n  ")}, clean[1]]
    assert guard.find(clean) is None and guard.find(hit) is not None
    guard.check(clean)
    with pytest.raises(DataError, match="MT-bench"):
        guard.check(hit, "sample 7")
    # The loader drops it; the file is a truncated ShareGPT dump, decoded item by item.
    items = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " * 3},
                                               {"from": "gpt", "value": f"answer number {i} " * 4}]}
             for i in range(6)]
    items[2]["conversations"][0]["value"] = MT_Q
    text = json.dumps(items, indent=1)
    (tmp_path / "dump.json").write_text(text[: text.index('"c5"') + 20])      # cut inside item 5
    assert [it["id"] for it in iter_json_array(tmp_path / "dump.json", chunk_chars=50)] == [f"c{i}" for i in range(5)]
    cfg = DataConfig(max_samples=10, max_len=400, min_assistant_tokens=4, val_fraction=0.0, path=str(tmp_path / "dump.json"))
    got, stats = load_samples(ByteChatTokenizer(), cfg, guard)
    assert [s.sample_id for s in got] == ["c0", "c1", "c3", "c4"]
    assert stats.mtbench_rejected == 1 and stats.rejected_ids == ["c2"]
    s = got[0]
    masked = bytes(t for t, m in zip(s.ids, s.loss_mask) if m).decode()
    assert masked == "answer number 0 " * 4 + "<|im_end|>\n"


def test_to_messages_roles():
    conv = {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"},
                              {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"}]}
    assert to_messages(conv) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.mark.slow
def test_sharegpt_package_renders_with_smollm2_template(smollm2_tokenizer):
    got, stats = load_samples(smollm2_tokenizer, DataConfig(max_samples=5, max_len=256))
    assert len(got) == 5 and stats.mtbench_rejected == 0
    for s in got:
        assert 0 < sum(s.loss_mask) < len(s.ids)
        first = s.loss_mask.index(1)
        assert smollm2_tokenizer.decode(s.ids[:first]).endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- self-distillation data

def test_batched_greedy_equals_one_prompt_at_a_time(target):
    """Left padding, the pad rows' self-attention and the dropping of finished rows must not
    change any answer: each batched answer equals the same prompt decoded alone."""
    from eagle_trt.train.regenerate import answer_batch
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 5, 12, 7)]
    alone = [answer_batch(target.model, [p], 20, set())[0] for p in prompts]
    # An EOS id that some answers hit early and others never: rows finish at different steps.
    counts = torch.bincount(torch.tensor([t for a in alone for t in a[:10]]), minlength=VOCAB)
    eos = int(counts.argmax())
    cut = [a[: a.index(eos) + 1] if eos in a else a for a in alone]
    assert any(len(c) < 20 for c in cut) and any(len(c) == 20 for c in cut), "need rows finishing at different steps"
    assert answer_batch(target.model, prompts, 20, {eos}) == cut


def test_concat_store_trains_on_both_caches_and_holds_out_the_last(target, capture, samples, store, tmp_path):
    from eagle_trt.train.features import ConcatStore
    other = extract_features(target, samples[:5], tmp_path / "other", capture, FeatureConfig(shard_size=2),
                             log=lambda _m: None)
    both = ConcatStore([other, store])
    assert len(both) == len(other) + len(store) and both.tokens == other.tokens + store.tokens
    assert torch.equal(both.get(0)["ids"], other.get(0)["ids"])
    assert torch.equal(both.get(len(both) - 1)["captured"], store.get(len(store) - 1)["captured"])
    assert both.folder == store.folder        # held-out evaluation sequences come from the last cache


def test_bf16_features_are_recorded_per_shard_and_close_to_float32(target, capture, samples, store, tmp_path):
    """--feature-precision bfloat16: the shard says so (and a mixed set counts both), the forward
    really ran in bf16 (the states differ from float32's), yet stays close to it; an unknown
    precision is refused by name."""
    from eagle_trt.train.features import ConcatStore, tokens_by_precision
    fast = extract_features(target, samples[:8], tmp_path / "bf16", capture,
                            FeatureConfig(shard_size=4, precision="bfloat16"), log=lambda _m: None)
    assert fast.precisions == ["bfloat16"] * 8 and store.precisions == ["float32"] * len(store)
    assert FeatureStore(tmp_path / "bf16").precisions == ["bfloat16"] * 8     # read back from the shards
    both = ConcatStore([fast, store])
    assert tokens_by_precision(both) == {"bfloat16": fast.tokens, "float32": store.tokens}
    a, b = store.get(3), fast.get(3)
    assert torch.equal(a["ids"], b["ids"]) and not torch.equal(a["captured"], b["captured"])
    rel = (a["captured"].float() - b["captured"].float()).norm() / a["captured"].float().norm()
    assert rel < 0.05, rel
    with pytest.raises(FeatureError, match="'float8'"):
        features_mod.target_features(target.model, samples[0].ids, precision="float8")


def test_auto_feature_precision_is_bf16_only_where_it_is_native(monkeypatch):
    """--feature-precision auto (the leg script's default): bf16 autocast ran 7x slower than
    float32 on an AVX2-only CPU, so auto picks it only on CUDA or a CPU with native bf16."""
    from eagle_trt import devices
    from eagle_trt.train.features import resolve_precision
    for native in (True, False):
        monkeypatch.setattr(devices, "cpu_has_bf16", lambda native=native: native)
        assert resolve_precision("auto", torch.device("cpu")) == ("bfloat16" if native else "float32")
    assert resolve_precision("auto", torch.device("cuda")) == "bfloat16"
    assert resolve_precision("float32", torch.device("cuda")) == "float32"
    with pytest.raises(FeatureError, match="'fp16'"):
        resolve_precision("fp16", torch.device("cpu"))


def test_target_layer_init_starts_as_that_layer(target):
    """--init target-layer: with the embedding half of q/k/v at zero, drafter step 0 on a state f
    computes exactly the copied target layer on f (the EAGLE-3 variant feeds back h2, the layer's
    output); fc starts as the identity on the last captured stream."""
    from eagle_trt.train.ttt import init_from_target_layer
    m, H = target.model, target.config.hidden_size
    vocab = build_draft_vocab(torch.ones(VOCAB), VOCAB)
    capture = CaptureLayers.eagle_default(target.config.num_hidden_layers)
    noise = new_drafter(target.config, "eagle3", vocab, capture, m.embed_tokens.weight.detach())
    d = new_drafter(target.config, "eagle3", vocab, capture, m.embed_tokens.weight.detach(), init_layer=m.layers[-1])
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1, 7, H, generator=g)
    ids = torch.randint(0, VOCAB, (1, 7), generator=g)
    pos, mask = torch.arange(7)[None], causal_mask(7, 0)
    pk, pv = d.empty_past(1)
    with torch.no_grad():
        out = d(f, ids, pos, mask, pk, pv).feedback
        cos, sin = m.rope(pos, f.dtype)
        ref, _, _ = m.layers[-1](f, cos, sin, mask, *m.empty_past(1)[0][:1], *m.empty_past(1)[1][:1])
        captured = torch.randn(1, 7, 3 * H, generator=g)
        assert torch.equal(d.project(captured), captured[..., -H:])
        assert not torch.allclose(noise(f, ids, pos, mask, pk, pv).feedback, ref, atol=1e-3)
    assert (out - ref).abs().max() < 1e-5
    init_from_target_layer(d, m.layers[0])      # another layer: the copy follows it
    assert torch.equal(d.midlayer.mlp.down_proj.weight, m.layers[0].mlp.down_proj.weight)


def test_online_features_equal_the_cache_and_train_the_same(target, capture, samples, store, vocab, tmp_path):
    """--features online computes each batch's features in the step (no disk): the same numbers
    as the cache, hence the same training trajectory, loss for loss."""
    from eagle_trt.train.features import OnlineFeatures
    online = OnlineFeatures(target, samples, capture)
    assert len(online) == len(store) and online.tokens == store.tokens
    for i in (0, 7, len(store) - 1):
        a, b = online.get(i), store.get(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i
    assert set(online.get(3, ("ids", "mask"))) == {"ids", "mask"}
    cfg = TrainConfig(variant="eagle3", steps=6, batch_size=3, lr=2e-3, warmup_steps=2, log_every=100, save_every=100)
    head = head_rows(target, vocab)
    cached = train(make_drafter(target, vocab, capture, "eagle3"), store, head, cfg, tmp_path / "a", log=lambda _: None)
    live = train(make_drafter(target, vocab, capture, "eagle3"), online, head, cfg, tmp_path / "b", log=lambda _: None)
    assert [e["loss"] for e in live.log] == [e["loss"] for e in cached.log]


def test_online_batches_are_one_padded_forward_equal_to_the_collated_cache(target, capture, samples, store):
    """fetch_batch on online features runs one right-padded target forward for the whole batch
    (what keeps a GPU busy) and yields the batch that collating the cached sequences gives."""
    from eagle_trt.train.features import OnlineFeatures
    from eagle_trt.train.ttt import collate, fetch_batch
    online = OnlineFeatures(target, samples, capture)
    idx = [5, 0, 9, 2]          # mixed lengths: padding inside the batch
    assert len({len(samples[i].ids) for i in idx}) > 1
    live, cached = fetch_batch(online, idx), collate([store.get(i) for i in idx])
    assert live.tokens == cached.tokens
    for name in ("ids", "argmax", "pred_mask"):
        assert torch.equal(getattr(live, name), getattr(cached, name)), name
    for name in ("captured", "normed"):       # fp16-rounded states: equal up to one fp16 step
        assert torch.allclose(getattr(live, name), getattr(cached, name), rtol=2e-3, atol=2e-3), name
    assert fetch_batch(store, idx).ids.equal(cached.ids)


def test_kept_online_features_skip_the_target_forward_and_train_the_same(target, capture, samples, store, vocab,
                                                                          tmp_path):
    """--keep-features-gb: a sequence's online features are computed once and kept on the device
    (up to the budget); later batches read them, with the numbers of a fresh forward, so the run
    trains as the uncached online run does, loss for loss."""
    from eagle_trt.train.features import OnlineFeatures
    from eagle_trt.train.ttt import fetch_batch
    forwards = []
    hook = target.model.norm.register_forward_hook(lambda _m, _i, out: forwards.append(out.shape[0]))
    try:
        one_token = 4 + 2 * capture_width(target) + 2 * target.config.hidden_size + 4
        budget = one_token * (len(samples[5].ids) + len(samples[0].ids))     # room for two of the four
        kept = OnlineFeatures(target, samples, capture, keep_bytes=budget)
        idx = [5, 0, 9, 2]
        first = fetch_batch(kept, idx)
        assert set(kept.kept) == {5, 0} and kept.kept_bytes == budget and forwards == [4]
        again = fetch_batch(kept, idx)
        assert forwards == [4, 2]                      # only the two that did not fit ran again
        fresh = fetch_batch(OnlineFeatures(target, samples, capture), idx)
        for name in ("ids", "captured", "normed", "argmax", "pred_mask"):
            assert torch.equal(getattr(first, name), getattr(fresh, name)), name
            assert torch.equal(getattr(again, name), getattr(fresh, name)), name
    finally:
        hook.remove()
    cfg = TrainConfig(variant="eagle3", steps=6, batch_size=3, lr=2e-3, warmup_steps=2, log_every=100, save_every=100)
    head = head_rows(target, vocab)
    plain = train(make_drafter(target, vocab, capture, "eagle3"), OnlineFeatures(target, samples, capture), head, cfg,
                  tmp_path / "a", log=lambda _: None)
    cached = train(make_drafter(target, vocab, capture, "eagle3"),
                   OnlineFeatures(target, samples, capture, keep_bytes=10 ** 9), head, cfg, tmp_path / "b",
                   log=lambda _: None)
    assert [e["loss"] for e in cached.log] == [e["loss"] for e in plain.log]


def capture_width(target) -> int:
    return 3 * target.config.hidden_size


def test_train_cli_with_online_features_writes_drafter_and_log(tmp_path, capsys):
    """python -m eagle_trt.train, as on a GPU (online features, 5 TTT steps), here on the CPU:
    nothing cached on disk but the draft vocabulary, and a train log that records the device,
    the data size and the tokens seen."""
    from test_build_support import write_tiny_target

    from eagle_trt.train.__main__ import main
    folder = write_tiny_target(tmp_path / "t")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Say {i} words about tea, please."},
                                               {"from": "gpt", "value": "Tea is a drink made from leaves. " * 3}]}
             for i in range(12)]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(convs))
    rc = main(["--target", str(folder), "--data", str(data), "--max-samples", "12", "--features", "online",
               "--device", "cpu", "--features-dir", str(tmp_path / "feat"), "--out", str(tmp_path / "run"),
               "--steps", "3", "--batch-size", "2", "--draft-vocab", "64", "--eval-sequences", "2",
               "--save-every", "3", "--init", "target-layer"])
    assert rc == 0, capsys.readouterr().err
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["features"]["mode"] == "online" and log["features"]["bytes"] == 0
    assert log["device"]["device"] == "cpu" and log["config"]["ttt_steps"] == 5
    assert log["features"]["sequences"] == log["data_stats"]["kept"] > 8 and log["log"][-1]["tokens_seen"] > 0
    assert len(log["log"][-1]["step_loss"]) == 5 and len(log["log"][-1]["eval_acc"]) == 5
    assert sorted(p.name for p in (tmp_path / "feat").iterdir()) == ["draft_vocab_64.safetensors"]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    assert main(["--target", str(folder), "--features", "online", "--features-only", "--device", "cpu"]) == 2
    for bad in (["--features", "cache", "--keep-features-gb", "1"], ["--features", "online", "--keep-features-gb", "1e6"]):
        assert main(["--target", str(folder), "--data", str(data), "--device", "cpu", "--out", str(tmp_path / "x")]
                    + bad) == 2
        assert "--keep-features-gb" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_answer_batch_features_equal_a_full_forward(target, capture):
    """The features written on the side of generation (every token fed once, the last one
    included) are those of one forward pass over prompt + answer, in the cache's fp16, and
    asking for them does not change any answer."""
    from eagle_trt.train.features import target_features
    from eagle_trt.train.regenerate import answer_batch
    target = capturing(target, capture)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 5, 12)]
    plain = answer_batch(target.model, prompts, 16, set())
    eos = int(torch.bincount(torch.tensor([t for a in plain for t in a[:6]]), minlength=VOCAB).argmax())
    plain = answer_batch(target.model, prompts, 16, {eos})
    tokens, feats = answer_batch(target.model, prompts, 16, {eos}, features=True)
    assert tokens == plain and any(len(t) < 16 for t in tokens) and any(len(t) == 16 for t in tokens)
    for p, t, f in zip(prompts, tokens, feats):
        ref = target_features(target.model, p + t)
        assert torch.equal(f["ids"], ref["ids"]) and torch.equal(f["argmax"], ref["argmax"])
        for name in ("captured", "normed"):
            assert f[name].dtype == torch.float16 and f[name].shape == ref[name].shape
            torch.testing.assert_close(f[name].float(), ref[name].float(), atol=2e-3, rtol=2e-3)


def test_sampled_answers_are_seeded_and_keep_the_targets_argmax_as_label(target, capture, tmp_path):
    """Sampled answers: the same seed draws the same answers, another seed and greedy decoding
    other ones; the features written beside them label each position with the target's argmax
    (a full forward's), not the sampled token; regenerate records the sampling and refuses it
    without a seed."""
    from eagle_trt.config import SamplingConfig
    from eagle_trt.train.features import target_features
    from eagle_trt.train.regenerate import DistillError, DistillSet, answer_batch, regenerate
    target = capturing(target, capture)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 10, 7)]
    hot = SamplingConfig(temperature=1.0, top_p=0.95, seed=0)
    draw = lambda seed, feats=False: answer_batch(target.model, prompts, 12, set(), feats, sampling=hot,  # noqa: E731
                                                  generator=torch.Generator().manual_seed(seed))
    first, again, other = draw(1), draw(1), draw(2)
    assert first == again and first != other and first != answer_batch(target.model, prompts, 12, set())
    tokens, feats = draw(1, True)
    assert tokens == first
    for p, t, f in zip(prompts, tokens, feats):
        ref = target_features(target.model, p + t)
        assert torch.equal(f["ids"], ref["ids"]) and torch.equal(f["argmax"], ref["argmax"])
    assert any(not torch.equal(f["argmax"][len(p) - 1:-1], f["ids"][len(p):]) for p, f in zip(prompts, feats))
    from test_build_support import write_tiny_target
    from eagle_trt.api import load_target_on
    tiny = load_target_on(write_tiny_target(tmp_path / "t"), "cpu", "float32")
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Name {i} teas."},
                                                                  {"from": "gpt", "value": "Green."}]}
                                for i in range(8)]))
    with pytest.raises(DistillError, match="seed"):
        regenerate(tiny, tmp_path / "noseed", "train", 4, 128, 4, 4, log=lambda _: None, data=data,
                   sampling=SamplingConfig(temperature=0.7))
    counts = regenerate(tiny, tmp_path / "sampled", "train", 4, 128, 4, 4, log=lambda _: None, data=data,
                        sampling=hot)
    assert counts["sequences"] >= 1
    made = DistillSet(tmp_path / "sampled").provenance
    assert made["settings"]["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 0}
    assert made["decoding"].startswith("sampled at temperature 1")


def test_chunks_answered_together_keep_their_answers_and_generators(target, tmp_path):
    """A batch spanning several chunks (a GPU's) gives each chunk the greedy answers it gets
    alone and draws each chunk's samples from its own generator; the set's provenance records
    which chunks were made that way."""
    from eagle_trt.config import SamplingConfig
    from eagle_trt.train.regenerate import DistillSet, answer_batch, read_chunk, regenerate, chunk_name
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 10, 7)]
    hot = SamplingConfig(temperature=1.0, top_p=0.95, seed=0)
    seeded = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    first = seeded(1)
    together = answer_batch(target.model, prompts, 12, set(), sampling=hot, generator=[first, first, seeded(2)])
    assert together[:2] == answer_batch(target.model, prompts[:2], 12, set(), sampling=hot, generator=seeded(1))
    assert together[2:] == answer_batch(target.model, prompts[2:], 12, set(), sampling=hot, generator=seeded(2))
    from test_build_support import write_tiny_target
    from eagle_trt.api import load_target_on
    tiny = load_target_on(write_tiny_target(tmp_path / "t"), "cpu", "float32")
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Name {i} teas."},
                                                                  {"from": "gpt", "value": "Green."}]}
                                for i in range(140)]))
    for name, batch in (("alone", 64), ("together", 128)):
        regenerate(tiny, tmp_path / name, "train", 140, 128, 4, batch, log=lambda _: None, data=data)
    alone, made = DistillSet(tmp_path / "alone"), DistillSet(tmp_path / "together")
    assert made.chunk_ids() == alone.chunk_ids() == [0, 1, 2]
    for c in made.chunk_ids():
        assert read_chunk(tmp_path / "together" / f"{chunk_name(c)}.npz") == \
            read_chunk(tmp_path / "alone" / f"{chunk_name(c)}.npz")
    assert "runs" not in alone.provenance and made.provenance["decoding"] == alone.provenance["decoding"]
    assert list(made.provenance["runs"].values()) == [[0, 1, 2]]
    # a set made where the tokenizer named other EOS ids keeps its own (--eos-ids)
    regenerate(tiny, tmp_path / "eos", "train", 8, 128, 4, 8, log=lambda _: None, data=data, eos_ids=[7])
    assert DistillSet(tmp_path / "eos").provenance["settings"]["eos_ids"] == [7]


def test_distillation_set_round_trip_and_features_reused(target, capture, tmp_path):
    """A chunk file keeps ids, prompt / answer split and sample ids exactly; features written on
    the side under the chunk's name are what extract_features finds done (nothing recomputed)."""
    from eagle_trt.train.regenerate import (DistillError, DistillSet, chunk_name, answer_batch, read_chunk,
                                            write_chunk, write_feature_shard)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 7, 5)]
    tokens, feats = answer_batch(target.model, prompts, 10, set(), features=True)
    items = [(f"p{i}", p, t) for i, (p, t) in enumerate(zip(prompts, tokens))]
    path = tmp_path / "set" / f"{chunk_name(0)}.npz"
    path.parent.mkdir()
    write_chunk(path, items)
    got = read_chunk(path)
    assert [(s.sample_id, s.ids, s.loss_mask) for s in got] == [(sid, p + t, [0] * len(p) + [1] * len(t))
                                                                 for sid, p, t in items]
    (tmp_path / "feat").mkdir()
    write_feature_shard(tmp_path / "feat" / f"{chunk_name(0)}.safetensors", target, got, feats)
    logs = []
    store = extract_features(target, [], tmp_path / "feat", capture, groups=[(chunk_name(0), got)], log=logs.append)
    assert "0 tokens computed" in logs[-1] and len(store) == 3
    assert torch.equal(store.get(1)["ids"], torch.tensor(items[1][1] + items[1][2], dtype=torch.int32))
    with pytest.raises(DistillError, match="no distillation set here"):
        DistillSet(tmp_path / "set")          # no provenance.json
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DistillError, match="not a readable distillation chunk"):
        read_chunk(path)


def test_prompts_exported_for_a_machine_without_the_dataset_answer_the_same(tmp_path):
    """regenerate --export-prompts writes the split's rendered prompts compactly; --prompts-from
    reads exactly first_turns' ids back (checked against target, split and prompt length), and
    a set generated from the file holds those prompts, in order."""
    from test_build_support import write_tiny_target

    from eagle_trt.api import load_target_on
    from eagle_trt.train.data import first_turns
    from eagle_trt.train.regenerate import DistillError, DistillSet, export_prompts, read_prompts, regenerate
    target = load_target_on(write_tiny_target(tmp_path / "t"), "cpu", "float32")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me {i} things about tea."},
                                               {"from": "gpt", "value": "Tea."}]} for i in range(40)]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(convs))
    path = tmp_path / "prompts.npz"
    n = export_prompts(target, path, "train", 30, 64, data=data)
    want = first_turns(target.tokenizer(), "train", 30, 64, path=data)
    assert n == len(want) > 20
    got = read_prompts(path, target, "train", 64)
    assert [(s, ids) for s, _, ids in got] == [(s, ids) for s, _, ids in want]
    with pytest.raises(DistillError, match="max_prompt_tokens 64"):
        read_prompts(path, target, "train", 128)
    with pytest.raises(DistillError, match="split 'train'"):
        read_prompts(path, target, "val", 64)
    counts = regenerate(target, tmp_path / "set", "train", 20, 64, 3, 8, prompts_file=path, log=lambda _: None)
    assert counts["sequences"] == 20
    chunk = DistillSet(tmp_path / "set").chunks()[0][1]
    assert [s.ids[:len(ids)] for s, (_, _, ids) in zip(chunk, want)] == [ids for _, _, ids in want[:20]]


def test_ship_refuses_a_run_below_the_shipped_drafter(tmp_path):
    """scripts/ship_drafters.py: a leg whose final held-out agreement is below the drafter it
    would replace stays in its run folder (exit message names both), unless --force."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ship_drafters", Path(__file__).parents[1] / "scripts/ship_drafters.py")
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)

    def run(folder: Path, acc: list[float]) -> Path:
        (folder / "drafter").mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (folder / "drafter" / name).write_text(f"{folder.name} {name}")
        log = {"finished": True, "step": 10, "args": {"eval_distill": "data/distill/smollm2-val"},
               "log": [{"step": 10, "loss": 1.0, "eval_loss": [1.0] * len(acc), "eval_acc": acc}]}
        (folder / "train_log.json").write_text(json.dumps(log))
        return folder
    dest = tmp_path / "shipped"
    ship.ship(run(tmp_path / "first", [0.70, 0.68, 0.66]), dest, None)
    with pytest.raises(SystemExit, match=r"below the shipped drafter's 0\.700 / 0\.680 / 0\.660"):
        ship.ship(run(tmp_path / "worse", [0.71, 0.66, 0.64, 0.60, 0.58]), dest, None)
    assert (dest / "model.safetensors").read_text() == "first model.safetensors"     # left as it was
    ship.ship(tmp_path / "worse", dest, "forced", force=True)
    assert (dest / "model.safetensors").read_text() == "worse model.safetensors"
    ship.ship(run(tmp_path / "better", [0.72, 0.68, 0.65]), dest, None)             # mean of 3 steps above 0.6700
    assert json.loads((dest / "train_log.json").read_text())["final_eval"]["eval_acc"] == [0.72, 0.68, 0.65]


def test_loop_cut_keeps_each_answer_through_its_first_run_of_repeats():
    from eagle_trt.train.loops import NGRAM, loop_cut_length, repeated
    prompt = list(range(10, 22))
    text = list(range(30, 50))                      # 20 distinct tokens, then a 3-token loop
    looped = text + [60, 61, 62] * 20
    ids, mask = prompt + looped, [0] * len(prompt) + [1] * len(looped)
    flags = repeated(ids)
    first = len(prompt) + len(text) + 3 + NGRAM - 1  # the first token that ends a seen 9-gram (period 3)
    assert not any(flags[:first]) and all(flags[first:])
    assert loop_cut_length(ids, mask, 5) == first + 5
    assert loop_cut_length(torch.tensor(ids), torch.tensor(mask), 5) == first + 5
    assert loop_cut_length(ids, mask, 10 ** 4) == len(ids)                 # no run that long: whole
    assert loop_cut_length(prompt + text, [0] * 12 + [1] * 20, 1) == 32    # no repeats at all
    in_prompt = [7, 8, 9] * 10                      # a loop in the prompt is not the answer's
    assert loop_cut_length(in_prompt + text, [0] * 30 + [1] * 20, 3) == 50
    with pytest.raises(ValueError, match="window"):
        loop_cut_length(ids, mask, 0)


def test_loop_cut_batches_train_the_same_from_the_cache_and_online(target, capture, samples, store, vocab, tmp_path):
    """A cut sequence is sliced where features are cached and masked where they are computed
    online; attention is causal, so both give the same loss, and the run counts fewer tokens."""
    from eagle_trt.train.features import OnlineFeatures
    from eagle_trt.train.ttt import fetch_batch
    online = OnlineFeatures(target, samples, capture)
    idx = [5, 0, 9, 2]
    lengths = [len(s.ids) - (7 if i in (0, 9) else 0) for i, s in enumerate(samples)]
    cached, live = fetch_batch(store, idx, lengths), fetch_batch(online, idx, lengths)
    assert cached.tokens == live.tokens == sum(lengths[i] for i in idx)
    assert cached.ids.shape[1] == max(lengths[i] for i in idx) < live.ids.shape[1]
    drafter = make_drafter(target, vocab, capture, "eagle3.1")
    a = ttt_forward(drafter, cached, head_rows(target, vocab), 2)
    b = ttt_forward(drafter, live, head_rows(target, vocab), 2)
    assert a.counts == b.counts and a.counts[0] < fetch_batch(store, idx).pred_mask.sum()
    for x, y in zip(a.losses, b.losses):
        assert torch.allclose(x, y, rtol=1e-3, atol=1e-3)
    with pytest.raises(TrainError, match="loop_cut"):
        TrainConfig(loop_cut=-1).validate()
    cfg = TrainConfig(variant="eagle3.1", steps=3, batch_size=3, lr=2e-3, warmup_steps=1, log_every=100,
                      save_every=100, loop_cut=2)
    logs = []
    result = train(make_drafter(target, vocab, capture, "eagle3.1"), store, head_rows(target, vocab), cfg,
                   tmp_path / "cut", log=logs.append)
    assert result.step == 3 and any("loop cut 2" in line for line in logs)


def test_evaluation_splits_agreement_into_loop_tokens_and_the_rest(target, capture, samples, store, vocab):
    """evaluate() reports the agreement on loop tokens and on the rest apart; weighted by their
    positions they give back the pooled number at every step, and a sequence that loops has
    loop positions counted."""
    from eagle_trt.train.ttt import evaluate
    from eagle_trt.train.features import OnlineFeatures
    looping = Sample("loop", samples[0].ids[:10] + [40, 41, 42, 43] * 8, [0] * 6 + [1] * 36)
    online = OnlineFeatures(target, [looping] + samples[:5], capture)
    cfg = TrainConfig(variant="eagle3.1", ttt_steps=3)
    out = evaluate(make_drafter(target, vocab, capture, "eagle3.1"), online, list(range(6)), head_rows(target, vocab), cfg)
    assert out["eval_positions"]["loop"] > 0 and out["eval_positions"]["text"] > 0
    alone = evaluate(make_drafter(target, vocab, capture, "eagle3.1"), online, [0], head_rows(target, vocab), cfg)
    assert alone["eval_positions"]["loop"] >= 15          # the loop's tokens from its second turn on
    # a drafter context cut to 2 prompt tokens still predicts every answer position
    from eagle_trt.train.ttt import context_start
    assert [context_start(m, k) for m, k in (([0] * 6 + [1] * 3, 2), ([0] * 6 + [1] * 3, 0), ([0, 1, 1], 5),
                                               ([0, 0, 0], 2))] == [4, 0, 0, 0]
    cut = evaluate(make_drafter(target, vocab, capture, "eagle3.1"), online, list(range(6)), head_rows(target, vocab),
                   cfg, prompt_context=2)
    assert cut["eval_positions"] == out["eval_positions"]
    # step 1: the split recombines into the pooled agreement
    n = out["eval_positions"]
    both = (out["eval_acc_loop"][0] * n["loop"] + out["eval_acc_text"][0] * n["text"]) / (n["loop"] + n["text"])
    assert both == pytest.approx(out["eval_acc"][0], abs=1e-9)


def test_later_user_turns_are_prompts_after_their_conversation_and_loops_stop_answers(tmp_path):
    """regenerate --turns later: each second and later user turn is a prompt rendered after the
    conversation before it; a conversation is dropped from the turn that brings an MT-bench
    question on. --stop-loops N ends an answer N repeating tokens into a loop: a prefix of the
    unstopped answer, whose own loop cut (train --loop-cut N) is the whole of it."""
    from test_build_support import write_tiny_target

    from eagle_trt.api import load_target_on
    from eagle_trt.data import mtbench_prompts
    from eagle_trt.train.data import first_turns, user_turns
    from eagle_trt.train.loops import loop_cut_length
    from eagle_trt.train.regenerate import DistillSet, answer_batch, regenerate
    target = load_target_on(write_tiny_target(tmp_path / "t"), "cpu", "float32")
    tok = target.tokenizer()
    turn = lambda who, text: {"from": who, "value": text}      # noqa: E731
    convs = [{"id": "c0", "conversations": [turn("human", "Name a tea."), turn("gpt", "Green tea."),
                                            turn("human", "Another?"), turn("gpt", "Black tea."),
                                            turn("human", "And a third?"), turn("gpt", "Oolong.")]},
             {"id": "c1", "conversations": [turn("human", "Hi."), turn("gpt", "Hello."),
                                            turn("human", mtbench_prompts()[0]), turn("gpt", "Sure."),
                                            turn("human", "Thanks."), turn("gpt", "Welcome.")]}]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(convs))
    later = user_turns(tok, "train", 10, 512, path=data, val_fraction=0.0, later=True)
    assert [sid for sid, _, _ in later] == ["c0#t2", "c0#t3"]
    messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in convs[0]["conversations"]]
    for (_, text, ids), end in zip(later, (2, 4)):
        want = tok.apply_chat_template(messages[:end + 1], add_generation_prompt=True)
        assert text == messages[end]["content"] and ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert [sid for sid, _, _ in first_turns(tok, "train", 10, 512, path=data, val_fraction=0.0)] == ["c0", "c1"]
    assert [sid for sid, _, _ in user_turns(tok, "train", 10, len(later[0][2]), path=data, val_fraction=0.0,
                                            later=True)] == ["c0#t2"]     # the third turn's prompt is longer

    with torch.no_grad():    # layers that add nothing: the next token depends on the last one only, so greedy cycles
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (5, 9, 6, 12)]
    full = answer_batch(target.model, prompts, 200, set())
    stopped = answer_batch(target.model, prompts, 200, set(), stop_loops=6)
    assert any(len(s) < len(f) for s, f in zip(stopped, full)), "no answer looped: the check would be vacuous"
    for p, s, f in zip(prompts, stopped, full):
        assert f[:len(s)] == s
        assert loop_cut_length(p + f, [0] * len(p) + [1] * len(f), 6) == len(p) + len(s)
    regenerate(target, tmp_path / "later", "train", 8, 512, 40, 4, log=lambda _: None, later_turns=True, stop_loops=6)
    settings = DistillSet(tmp_path / "later").provenance["settings"]
    assert settings["turns"] == "later" and settings["stop_loops"] == 6


def test_train_cli_trains_on_several_distillation_sets_as_one(tmp_path, capsys, monkeypatch):
    """--distill given twice: the first-turn set and a later-turn one, cached features of both,
    trained on as one store; the log names both sets."""
    from test_build_support import write_tiny_target

    from eagle_trt.api import load_target_on
    from eagle_trt.train.__main__ import main
    from eagle_trt.train.regenerate import regenerate
    monkeypatch.setenv("EAGLE_TRT_CACHE", str(tmp_path / "cache"))
    folder = write_tiny_target(tmp_path / "t")
    target = load_target_on(folder, "cpu", "float32")
    turn = lambda who, text: {"from": who, "value": text}      # noqa: E731
    convs = [{"id": f"c{i}", "conversations": [turn("human", f"Say {i} words about tea."), turn("gpt", "Tea."),
                                               turn("human", "And coffee?"), turn("gpt", "Coffee.")]}
             for i in range(10)]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(convs))
    sets = []
    for later in (False, True):
        sets.append(tmp_path / ("later" if later else "first"))
        regenerate(target, sets[-1], "train", 8, 128, 6, 4, log=lambda _: None, later_turns=later, data=data)
    rc = main(["--target", str(folder), "--features", "cache", "--device", "cpu", "--distill", str(sets[0]),
               "--distill", str(sets[1]), "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "2",
               "--draft-vocab", "64", "--eval-sequences", "2", "--save-every", "2"])
    assert rc == 0, capsys.readouterr().err
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert [d["dir"] for d in log["distill"]] == [str(s) for s in sets]
    assert log["features"]["sequences"] == sum(d["sequences"] for d in log["distill"]) == 16


def test_init_from_grows_the_draft_vocabulary_keeping_its_trained_rows(tmp_path, capsys):
    """--init-from with a larger --draft-vocab: the drafter's ids stay, the most frequent other
    answer tokens join with the target's head rows, and its trained rows (frozen here) keep their
    values at their new places; a smaller size is refused, naming both sizes."""
    from safetensors.torch import load_file
    from test_build_support import write_tiny_target

    from eagle_trt.checkpoints import load_target
    from eagle_trt.train.__main__ import main
    folder = write_tiny_target(tmp_path / "t")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Name {i} teas and coffees."},
                                               {"from": "gpt", "value": f"Green tea, black tea, {i} espresso. " * 3}]}
             for i in range(10)]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(convs))
    common = ["--target", str(folder), "--data", str(data), "--features", "online", "--device", "cpu",
              "--features-dir", str(tmp_path / "feat"), "--batch-size", "2", "--eval-sequences", "2"]
    assert main(common + ["--out", str(tmp_path / "a"), "--steps", "2", "--draft-vocab", "24",
                          "--save-every", "2"]) == 0, capsys.readouterr().err
    first = load_file(str(tmp_path / "a" / "drafter" / "model.safetensors"))
    assert main(common + ["--out", str(tmp_path / "b"), "--steps", "1", "--draft-vocab", "40", "--freeze-head",
                          "--init-from", str(tmp_path / "a" / "drafter"), "--save-every", "1"]) == 0, \
        capsys.readouterr().err
    grown = load_file(str(tmp_path / "b" / "drafter" / "model.safetensors"))
    old_ids = torch.arange(24) + first["d2t"]
    new_ids = torch.arange(40) + grown["d2t"]
    assert grown["lm_head.weight"].shape[0] == 40 and set(old_ids.tolist()) < set(new_ids.tolist())
    at = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(grown["lm_head.weight"][at], first["lm_head.weight"])
    added = ~grown["t2d"].new_zeros(new_ids.numel()).index_fill(0, at, True)
    head = load_target(folder, torch.float32).model.lm_head.weight.detach()
    assert torch.equal(grown["lm_head.weight"][added], head[new_ids[added]].to(grown["lm_head.weight"].dtype))
    assert main(common + ["--out", str(tmp_path / "c"), "--steps", "1", "--draft-vocab", "16",
                          "--init-from", str(tmp_path / "a" / "drafter")]) == 2
    err = capsys.readouterr().err
    assert "--draft-vocab 16" in err and "24" in err
    assert not (tmp_path / "c" / "drafter").exists()
