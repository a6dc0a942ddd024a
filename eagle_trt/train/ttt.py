"""EAGLE-3 / EAGLE 3.1 drafter training with the training-time test (TTT).

For a sequence x_0..x_{T-1} with captured target states c_j, the drafter runs K steps over
the indices j = 0..T-2 at once, exactly as the runtime drafts a chain from each j:

    step 0:  state_j = fc(norms(c_j)),   id x_{j+1},   position j,   sees step-0 rows 0..j
    step k:  state_j = feedback_j of step k-1 (z for EAGLE 3.1, h2 for EAGLE-3),
             id x_{j+1+k}, position j+k, sees step-0 rows 0..j and its own rows of steps 1..k
             (the attention mask over the concatenated KV of all steps is [causal | I | ... | I])
    target:  the target's distribution at position j+1+k (the next token x_{j+2+k}),
             restricted to the draft vocabulary and renormalized

loss = sum_k decay^k * soft-CE_k, each averaged over the positions whose predicted token is
assistant text (and, as in EAGLE-3, whose target top-1 lies in the draft vocabulary).
Accuracy per step: the drafter's top-1 (mapped through d2t) equals the target's greedy token.
Gradients flow through the fed-back states; the shared embedding and the target head rows
used for the soft targets are frozen.
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..config import CaptureLayers, DrafterConfig, TargetConfig
from ..devices import native_bf16
from ..models.drafter import EagleDrafter
from ..models.target import causal_mask
from .features import FeatureStore
from .loops import loop_cut_length, repeated
from .vocab import DraftVocab

STATE_FILE = "train_state.pt"


class TrainError(ValueError):
    """A training option or a saved training state does not fit this run."""


@dataclass
class TrainConfig:
    variant: str = "eagle3.1"        # eagle3.1: fc_norm + norm_output; eagle3: neither
    ttt_steps: int = 3
    step_decay: float = 0.8          # weight of step k is decay**k (EAGLE-3 reference: 0.8)
    steps: int = 1000
    batch_size: int = 4
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1        # cosine decay to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    autocast: str = "none"           # "bf16": bfloat16 autocast (CUDA; CPUs with AVX-512 BF16 / AMX too)
    log_every: int = 10
    save_every: int = 100
    eval_sequences: int = 0          # the last N cached sequences are held out and evaluated at saves
    mask_out_of_vocab: bool = True   # skip positions whose target top-1 is not in the draft vocabulary
    ttt_share: float = 1.0           # share of positions unrolled past step 0 (anchored TTT; 1 = all)
    freeze_head: bool = False        # lm_head stays the target's rows of the draft vocabulary
    length_groups: int = 1           # batches drawn together and cut by length (less padding; 1 = off)
    loop_cut: int = 0                # train each sequence only through its first N looping tokens (loops.py; 0 = off)

    def validate(self) -> TrainConfig:
        if self.variant not in ("eagle3", "eagle3.1"):
            raise TrainError(f"variant must be 'eagle3' or 'eagle3.1', got {self.variant!r}")
        for name in ("ttt_steps", "steps", "batch_size", "log_every", "save_every", "length_groups"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.loop_cut < 0:
            raise TrainError(f"loop_cut must be >= 0 (0: off), got {self.loop_cut}")
        if not self.lr > 0:
            raise TrainError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.ttt_share <= 1:
            raise TrainError(f"ttt_share must be in (0, 1], got {self.ttt_share}")
        if self.autocast not in ("none", "bf16"):
            raise TrainError(f"autocast must be 'none' or 'bf16', got {self.autocast!r}")
        return self

    # Options that change the trajectory: a resumed run must keep them.
    TRAJECTORY_KEYS = ("variant", "ttt_steps", "step_decay", "batch_size", "seed", "eval_sequences",
                       "mask_out_of_vocab", "weight_decay", "ttt_share", "freeze_head", "length_groups", "loop_cut")


# ----------------------------------------------------------------------------- model setup

INITS = ("noise", "target-layer")


def init_from_target_layer(drafter: EagleDrafter, layer: torch.nn.Module) -> None:
    """Start the decoder layer from a (late) target decoder layer instead of noise: the hidden
    half of q/k/v takes the layer's projections and the embedding half starts at zero, so step
    0 begins as that layer applied to fc's output; o_proj, the MLP and the norms are copied;
    fc starts as the identity on the last captured stream (the deepest, closest to the
    output). Tensors whose shapes differ (another layer family) keep their noise."""
    H = drafter.cfg.hidden_size
    attn, src = drafter.midlayer.self_attn, layer.self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w, t = getattr(attn, name).weight, getattr(src, name).weight
            if w[:, H:].shape == t.shape:
                w.zero_()
                w[:, H:] = t
        pairs = [(attn.o_proj.weight, src.o_proj.weight), (drafter.midlayer.hidden_norm.weight, layer.input_layernorm.weight),
                 (drafter.midlayer.input_layernorm.weight, layer.input_layernorm.weight),
                 (drafter.midlayer.post_attention_layernorm.weight, layer.post_attention_layernorm.weight)]
        pairs += [(getattr(drafter.midlayer.mlp, n).weight, getattr(layer.mlp, n).weight)
                  for n in ("gate_proj", "up_proj", "down_proj")]
        for dst, t in pairs:
            if dst.shape == t.shape:
                dst.copy_(t)
        if drafter.cfg.target_hidden_size == H:
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -H:] = torch.eye(H)


def new_drafter(target_cfg: TargetConfig, variant: str, vocab: DraftVocab, capture: CaptureLayers,
                embed: Tensor, head_rows: Tensor | None = None, norm_weight: Tensor | None = None,
                seed: int = 0, std: float = 0.02, init_layer: torch.nn.Module | None = None) -> EagleDrafter:
    """A fresh drafter shaped like one target layer. The embedding is the target's (frozen,
    shared); lm_head starts from the target's head rows of the draft vocabulary, norm from its
    final norm, and the decoder layer from noise or, given `init_layer`, from that target layer."""
    t = target_cfg
    is31 = variant == "eagle3.1"
    cfg = DrafterConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        draft_vocab_size=vocab.size, target_hidden_size=t.hidden_size, num_aux_hidden_states=len(capture.layer_ids),
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings, capture=capture, fc_norm=is31, norm_output=is31)
    drafter = EagleDrafter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name == "embed_tokens.weight":
                continue
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                p.fill_(1.0)
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
        if head_rows is not None:
            drafter.lm_head.weight.copy_(head_rows)
        if norm_weight is not None:
            drafter.norm.weight.copy_(norm_weight)
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
    if init_layer is not None:
        init_from_target_layer(drafter, init_layer)
    drafter.embed_tokens.weight = torch.nn.Parameter(embed.detach(), requires_grad=False)
    drafter.embed_shared = True
    return drafter


# ----------------------------------------------------------------------------- batches

@dataclass
class Batch:
    ids: Tensor        # [B, T] int64, right-padded with 0
    captured: Tensor   # [B, T, A*Ht] float32
    normed: Tensor     # [B, T, H] float32
    argmax: Tensor     # [B, T] int64: the target's greedy token after position p
    pred_mask: Tensor  # [B, T] bool: the target's prediction at position p is for assistant text
    tokens: int

    def to(self, device) -> "Batch":
        return Batch(self.ids.to(device), self.captured.to(device), self.normed.to(device), self.argmax.to(device),
                     self.pred_mask.to(device), self.tokens)


def collate(items: list[dict]) -> Batch:
    T = max(int(it["ids"].shape[0]) for it in items)
    B = len(items)
    A = items[0]["captured"].shape[-1]
    H = items[0]["normed"].shape[-1]
    dev = items[0]["captured"].device      # where the features are (the GPU with online features)
    ids = torch.zeros(B, T, dtype=torch.int64, device=dev)
    captured, normed = torch.zeros(B, T, A, device=dev), torch.zeros(B, T, H, device=dev)
    argmax = torch.zeros(B, T, dtype=torch.int64, device=dev)
    pred_mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for b, it in enumerate(items):
        L = int(it["ids"].shape[0])
        ids[b, :L] = it["ids"].long()
        captured[b, :L] = it["captured"].float()
        normed[b, :L] = it["normed"].float()
        argmax[b, :L] = it["argmax"].long()
        pred_mask[b, : L - 1] = it["mask"][1:L].bool()   # position p predicts token p + 1
    return Batch(ids, captured, normed, argmax, pred_mask, sum(int(it["ids"].shape[0]) for it in items))


def context_start(mask: Tensor | list[int], keep: int) -> int:
    """Where a sequence starts when at most `keep` prompt tokens stay before its first answer
    token (mask 1); 0 for keep = 0 (everything) or a sequence without answer tokens."""
    mask = mask.tolist() if isinstance(mask, Tensor) else list(mask)
    if not keep or 1 not in mask:
        return 0
    return max(0, mask.index(1) - keep)


def fetch_batch(store, indices: list[int], lengths: list[int] | None = None) -> Batch:
    """The training batch of `indices`: one padded target forward where the store computes
    features online (OnlineFeatures.padded), else collate() of the cached sequences.
    `lengths` (indexed like the store): train on each sequence's first lengths[i] tokens only
    (attention is causal, so the tokens after a cut change nothing before it)."""
    padded = getattr(store, "padded", None)
    if padded is None:
        items = [store.get(i) for i in indices]
        if lengths is not None:
            items = [{k: v[:lengths[i]] for k, v in it.items()} for i, it in zip(indices, items)]
        return collate(items)
    f = padded(indices)
    pred_mask = torch.zeros_like(f["mask"])
    pred_mask[:, :-1] = f["mask"][:, 1:]        # position p predicts token p + 1
    tokens = f["tokens"]
    if lengths is not None:
        cut = torch.tensor([lengths[i] for i in indices], device=pred_mask.device)
        pred_mask &= torch.arange(pred_mask.shape[1], device=pred_mask.device)[None] < (cut - 1)[:, None]
        tokens = int(cut.sum())
    return Batch(f["ids"].long(), f["captured"].float(), f["normed"].float(), f["argmax"].long(), pred_mask, tokens)


# ----------------------------------------------------------------------------- TTT forward

@dataclass
class TTTOutput:
    losses: list[Tensor]       # per step, scalar
    accs: list[float]          # per step, top-1 agreement with the target's greedy token
    counts: list[int]          # positions counted per step
    logits: list[Tensor] = field(default_factory=list)   # per step [B, T-1, Vd] when asked for
    # per step [B, rows] bool: the rows counted, and those where the drafter's top-1 is the target's
    counted: list[Tensor] = field(default_factory=list)
    hits: list[Tensor] = field(default_factory=list)

    def total(self, decay: float) -> Tensor:
        return sum(decay ** k * l for k, l in enumerate(self.losses))


def _rows(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, n, ...] at rows idx [B, m] -> [B, m, ...]."""
    return torch.gather(x, 1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


def ttt_forward(drafter: EagleDrafter, batch: Batch, head_rows: Tensor, steps: int,
                mask_out_of_vocab: bool = True, keep_logits: bool = False, anchors: Tensor | None = None) -> TTTOutput:
    """anchors [B, m] (sorted indices j < T-1): steps 1.. are unrolled from these positions only
    ("anchored" TTT): each chain sees only step-0 rows and its own rows, so a chain's numbers are
    those of the full unroll at j, for a fraction of the unroll's cost. Step 0 covers every j."""
    B, T = batch.ids.shape
    n = T - 1                                    # drafter indices j = 0..T-2
    if n < 1:
        raise TrainError("training sequences need at least 2 tokens")
    dtype, dev = drafter.fc.weight.dtype, drafter.fc.weight.device
    batch = batch.to(dev)
    pad = lambda x: torch.cat((x, x.new_zeros(B, steps, *x.shape[2:])), dim=1)
    ids, argmax, pred_mask = pad(batch.ids), pad(batch.argmax), pad(batch.pred_mask)
    with torch.no_grad():   # soft targets: the target's distribution over the draft vocabulary
        target_p = pad(torch.softmax(batch.normed.float() @ head_rows.to(dev).float().T, dim=-1))
    t2d = drafter.t2d
    hidden = drafter.project(batch.captured[:, :n].to(dtype))
    positions = torch.arange(n, device=dev)[None].expand(B, n)
    causal, eye = causal_mask(n, 0, dev)[0], torch.eye(n, dtype=torch.bool, device=dev)
    if anchors is not None:
        anchors = anchors.to(dev)
        m = anchors.shape[1]
        anchor_causal, anchor_eye = causal[anchors], torch.eye(m, dtype=torch.bool, device=dev).expand(B, m, m)
    past_k, past_v = drafter.empty_past(B)
    out = TTTOutput([], [], [])
    for k in range(steps):
        sl = slice(1 + k, 1 + k + n)             # position p = j + 1 + k
        if k == 0 or anchors is None:
            at = lambda x: x[:, sl]                                      # noqa: E731
            mask = torch.cat([causal] + [eye] * k, dim=1)[None].expand(B, n, (k + 1) * n)
            pos = positions + k
        else:
            at = lambda x: _rows(x[:, sl], anchors)                      # noqa: E731
            mask = torch.cat([anchor_causal] + [anchor_eye] * k, dim=2)
            pos = anchors + k
        step = drafter(hidden, at(ids), pos, mask, past_k, past_v)
        past_k, past_v = torch.cat((past_k, step.new_k), 2), torch.cat((past_v, step.new_v), 2)
        logp = torch.log_softmax(step.logits.float(), dim=-1)
        ce = -(at(target_p) * logp).sum(-1)                               # [B, rows]
        counted = at(pred_mask)
        valid = counted & t2d[at(argmax)] if mask_out_of_vocab else counted
        out.losses.append((ce * valid).sum() / valid.sum().clamp(min=1))
        with torch.no_grad():   # summed after the loop: a host sync inside it splits a compiled graph
            out.hits.append((drafter.to_target_ids(step.logits.argmax(-1)) == at(argmax)) & counted)
            out.counted.append(counted)
        if keep_logits:
            out.logits.append(step.logits)
        hidden = step.feedback                   # z (EAGLE 3.1) or h2 (EAGLE-3), same index j
        if k == 0 and anchors is not None:
            hidden = _rows(hidden, anchors)
    out.counts = [int(c.sum()) for c in out.counted]
    out.accs = [float(h.sum()) / max(c, 1) for h, c in zip(out.hits, out.counts)]
    return out


def sample_anchors(batch: Batch, share: float, seed: int, step: int) -> Tensor | None:
    """ceil(share * n) sorted positions per sequence for anchored TTT, drawn among each
    sequence's predicted (assistant) positions first; a function of (seed, step), so a resumed
    run draws the same ones. None when share >= 1 (unroll everywhere)."""
    if share >= 1:
        return None
    B, T = batch.ids.shape
    n = T - 1
    m = max(1, math.ceil(share * n))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
    # random keys; predicted positions always rank before padding and prompt positions
    keys = torch.rand(B, n, generator=gen) + (~batch.pred_mask[:, :n].cpu()).float()
    return torch.sort(torch.topk(keys, m, dim=1, largest=False).indices, dim=1).values


# ----------------------------------------------------------------------------- training loop

def lr_at(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warm-up, then cosine decay over the steps, or over `progress` (0..1, e.g. the share
    of a time budget spent) when given."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if progress is None:
        progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max(progress, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_indices(step: int, train_ids: list[int], cfg: TrainConfig, lengths: list[int] | None = None) -> list[int]:
    """The sequences of a step: a pure function of (seed, step), so a resumed run sees the
    same batches as an uninterrupted one. Each epoch is a fresh seeded permutation.
    cfg.length_groups = G > 1 (with `lengths`, indexed like the store): the G batches of steps
    G*g .. G*g+G-1 are drawn as one, sorted by length, cut into G batches and dealt out in a
    seeded order, so a batch pads to similar lengths (the padded tokens are computed for nothing)."""
    B, G = cfg.batch_size, cfg.length_groups
    if G <= 1:
        return _stream(step * B, B, train_ids, cfg.seed)
    if lengths is None:
        raise TrainError(f"length_groups={G} needs the sequences' lengths (a store with .lengths)")
    group, slot = divmod(step, G)
    drawn = sorted(_stream(group * G * B, G * B, train_ids, cfg.seed), key=lambda i: lengths[i])
    order = torch.randperm(G, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + group + 11)).tolist()
    return drawn[order[slot] * B:(order[slot] + 1) * B]


def _stream(first: int, count: int, train_ids: list[int], seed: int) -> list[int]:
    """Entries first .. first+count-1 of the endless sequence of seeded epoch permutations."""
    n, out = len(train_ids), []
    for flat in range(first, first + count):
        epoch, i = divmod(flat, n)
        out.append(train_ids[_epoch_order(seed, epoch, n)[i]])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def trainable_state(drafter: EagleDrafter) -> dict[str, Tensor]:
    return {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class TrainResult:
    log: list[dict]
    step: int
    finished: bool


def auto_autocast(device: torch.device) -> str:
    """The autocast `--autocast auto` picks: bf16 on CUDA and on CPUs with native bf16
    (AVX-512 BF16 / AMX), else none."""
    return "bf16" if native_bf16(device) else "none"


def autocast(drafter: EagleDrafter, cfg: TrainConfig):
    """bf16 autocast on the drafter's device when cfg.autocast says so; the weights, the
    optimizer state and the losses stay float32."""
    return torch.autocast(drafter.fc.weight.device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def evaluate(drafter: EagleDrafter, store: FeatureStore, ids: list[int], head_rows: Tensor,
             cfg: TrainConfig, prompt_context: int = 0) -> dict:
    """Loss and top-1 agreement per TTT step over the sequences `ids`, and the agreement apart
    on loop tokens (an answer token ending a 9-gram seen earlier in its sequence, loops.py) and
    on the rest ("text"): the held-out set's loops are easy copies that lift the pooled number.
    prompt_context N: the drafter's own context cut to N prompt tokens before the answer (the
    target features keep the whole prompt): how much the drafter reads the prompt itself."""
    drafter.eval()
    K = cfg.ttt_steps
    losses, accs, counts = [0.0] * K, [0.0] * K, [0] * K
    hits = {"loop": [0] * K, "text": [0] * K}
    seen = {"loop": [0] * K, "text": [0] * K}
    with torch.no_grad():
        for i in ids:
            item = store.get(i)
            start = context_start(item["mask"], prompt_context)
            loop = repeated(item["ids"].tolist())[start:]    # n-grams seen before the start still count
            batch = collate([{k: v[start:] for k, v in item.items()}])
            with autocast(drafter, cfg):
                o = ttt_forward(drafter, batch, head_rows, K, cfg.mask_out_of_vocab)
            n = batch.ids.shape[1] - 1
            # row j of step k predicts token j + 2 + k (zero-padded past the end, never counted there)
            loop = torch.tensor(loop + [False] * (K + 1), device=o.hits[0].device)
            for k in range(K):
                losses[k] += float(o.losses[k]) * o.counts[k]
                accs[k] += o.accs[k] * o.counts[k]
                counts[k] += o.counts[k]
                for name, sel in (("loop", loop[2 + k:2 + k + n]), ("text", ~loop[2 + k:2 + k + n])):
                    hits[name][k] += int((o.hits[k][0] & sel).sum())
                    seen[name][k] += int((o.counted[k][0] & sel).sum())
    drafter.train()
    return {"eval_loss": [l / max(c, 1) for l, c in zip(losses, counts)],
            "eval_acc": [a / max(c, 1) for a, c in zip(accs, counts)],
            **{f"eval_acc_{name}": [h / max(c, 1) for h, c in zip(hits[name], seen[name])] for name in hits},
            "eval_positions": {name: seen[name][0] for name in seen}}


def train(drafter: EagleDrafter, store: FeatureStore, head_rows: Tensor, cfg: TrainConfig, out_dir: str | Path,
          resume: bool = False, stop_at: int | None = None, time_budget_s: float | None = None,
          log: Callable[[str], None] = print, eval_store: FeatureStore | None = None,
          start_cpu_s: float = 0.0, schedule_over_budget: bool = False) -> TrainResult:
    """Train in place. Saves `out_dir/train_state.pt` (model, optimizer, step, RNG, log)
    atomically every `save_every` steps and when stopping early (stop_at, time budget,
    Ctrl-C); `resume` continues from it. Batches are a function of (seed, step), so a
    resumed run follows the same trajectory as an uninterrupted one.

    Held-out evaluation: every sequence of `eval_store` when given (a fixed set, so curves of
    runs on different data compare), else the last cfg.eval_sequences of `store`. Each log
    entry carries `cpu_s`, the training CPU seconds (all threads, evaluation excluded) the
    weights have seen, counted from `start_cpu_s` (what the starting weights had seen).
    schedule_over_budget: the cosine decay runs over `time_budget_s` of this call's wall time
    (cfg.steps stays a cap), so a run given a few hours ends at the low learning rate."""
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    held = 0 if eval_store is not None else cfg.eval_sequences
    if len(store) - held < 1:
        raise TrainError(f"{store.folder}: {len(store)} cached sequences, {held} held out for eval: nothing to train on")
    train_ids, eval_ids = list(range(len(store) - held)), list(range(len(store) - held, len(store)))
    if eval_store is not None:
        eval_ids = list(range(len(eval_store)))
    eval_on = eval_store if eval_store is not None else store
    lengths = getattr(store, "lengths", None)
    cut_lengths = None
    if cfg.loop_cut:      # evaluation keeps whole sequences, so curves of runs with and without compare
        cut_lengths = [loop_cut_length(it["ids"], it["mask"], cfg.loop_cut)
                       for it in (store.get(i, ("ids", "mask")) for i in range(len(store)))]
        kept = sum(cut_lengths[i] for i in train_ids)
        cut = sum(cut_lengths[i] < lengths[i] for i in train_ids) if lengths is not None else "?"
        log(f"train: loop cut {cfg.loop_cut}: {cut} of {len(train_ids)} sequences cut, {kept} tokens trained on")
        lengths = cut_lengths
    drafter.lm_head.weight.requires_grad_(not cfg.freeze_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    history: list[dict] = []
    step = 0
    if resume and state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        for key in TrainConfig.TRAJECTORY_KEYS:
            if state["config"].get(key, getattr(TrainConfig(), key)) != getattr(cfg, key):
                raise TrainError(f"{state_path}: saved run has {key}={state['config'].get(key)!r}, this run "
                                 f"{getattr(cfg, key)!r}; resume with the same options or use another --out")
        if not torch.equal(state["model"]["d2t"], drafter.d2t.cpu()):     # the state is loaded on the CPU
            raise TrainError(f"{state_path}: saved run used another draft vocabulary")
        drafter.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        step, history = state["step"], state["log"]
        log(f"train: resumed from {state_path} at step {step}")
    elif resume:
        log(f"train: no {state_path} yet, starting from step 0")

    def save() -> None:
        _atomic_torch_save({"model": trainable_state(drafter), "optimizer": opt.state_dict(), "step": step,
                            "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(), "log": history,
                            "config": asdict(cfg)}, state_path)
        tmp = out / ".train_log.json.tmp"
        tmp.write_text(json.dumps({"config": asdict(cfg), "step": step, "log": history}, indent=1))
        os.replace(tmp, out / "train_log.json")

    def run_eval(entry: dict) -> None:
        entry.update(evaluate(drafter, eval_on, eval_ids, head_rows, cfg))
        log(f"train: eval at step {step}: loss {' '.join(f'{x:.4f}' for x in entry['eval_loss'])}  "
            f"acc {'/'.join(f'{x:.3f}' for x in entry['eval_acc'])}  "
            f"(text {'/'.join(f'{x:.3f}' for x in entry['eval_acc_text'])})")

    if not history and eval_ids:       # where the starting weights stand
        history.append({"step": 0, "tokens_seen": 0, "cpu_s": start_cpu_s})
        run_eval(history[-1])
    cpu_s = history[-1].get("cpu_s", start_cpu_s) if history else start_cpu_s
    drafter.train()
    start, tokens, window = time.perf_counter(), 0, []
    wall_base = history[-1].get("wall_s", 0.0) if history else 0.0     # wall seconds of earlier runs (GPU time)
    cpu_mark = time.process_time()
    stop = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
    first_step, updating = step, False
    try:
        while step < stop:
            if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                log(f"train: time budget of {time_budget_s:.0f} s reached at step {step}")
                break
            batch = fetch_batch(store, batch_indices(step, train_ids, cfg, lengths), cut_lengths)
            spent = (time.perf_counter() - start) / time_budget_s if schedule_over_budget and time_budget_s else None
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg, spent)
            with autocast(drafter, cfg):
                o = ttt_forward(drafter, batch, head_rows, cfg.ttt_steps, cfg.mask_out_of_vocab,
                                anchors=sample_anchors(batch, cfg.ttt_share, cfg.seed, step))
            loss = o.total(cfg.step_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            updating = True             # weights and step counter disagree until the entry is logged
            opt.step()
            step += 1
            tokens += batch.tokens
            seen = (history[-1].get("tokens_seen", 0) if history else 0) + batch.tokens
            now = time.process_time()
            cpu_s, cpu_mark = cpu_s + now - cpu_mark, now
            entry = {"step": step, "tokens_seen": seen, "cpu_s": round(cpu_s, 6),
                     "wall_s": round(wall_base + time.perf_counter() - start, 3), "loss": float(loss.detach()),
                     "step_loss": [float(x.detach()) for x in o.losses],
                     "acc": o.accs, "grad_norm": float(gnorm), "lr": opt.param_groups[0]["lr"]}
            history.append(entry)
            updating = False
            window.append(entry)
            if step % cfg.log_every == 0 or step == stop:
                acc = "/".join(f"{sum(e['acc'][k] for e in window) / len(window):.3f}" for k in range(cfg.ttt_steps))
                mean_loss = sum(e["loss"] for e in window) / len(window)
                elapsed = time.perf_counter() - start
                eta_min = (cfg.steps - step) * elapsed / max(step - first_step, 1) / 60
                if time_budget_s is not None:     # a budget ends the run first when it is shorter
                    eta_min = min(eta_min, max(time_budget_s - elapsed, 0.0) / 60)
                log(f"train: step {step}/{cfg.steps}  loss {mean_loss:.4f}  acc {acc}  lr {entry['lr']:.2e}  "
                    f"{tokens / elapsed:.0f} tok/s  eta {eta_min:.1f} min")
                window = []
            if step % cfg.save_every == 0 or step == stop:
                if eval_ids:
                    run_eval(entry)
                save()
                cpu_mark = time.process_time()    # evaluation and saving are not training time
    except KeyboardInterrupt:
        if not updating:        # interrupted mid-update: the last periodic checkpoint stands
            log(f"train: interrupted at step {step}; saving {state_path}")
            save()
        raise
    if step < stop:   # stopped by the time budget: where the weights stand, then save
        if eval_ids and history and "eval_acc" not in history[-1] and history[-1]["step"] == step:
            run_eval(history[-1])
        save()
    drafter.eval()
    return TrainResult(history, step, step >= cfg.steps)


__all__ = ["Batch", "TTTOutput", "TrainConfig", "TrainError", "TrainResult", "batch_indices", "collate", "context_start",
           "evaluate", "fetch_batch",
           "lr_at", "new_drafter", "sample_anchors", "train", "trainable_state", "ttt_forward", "autocast", "auto_autocast", "INITS", "init_from_target_layer"]
