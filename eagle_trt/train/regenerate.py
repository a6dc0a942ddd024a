"""Self-distillation data: the target's own greedy answers to ShareGPT first-turn prompts.

    python -m eagle_trt.train.regenerate --target smollm2 --out cache/smollm2-regen.json \\
        --max-prompts 1500 --max-new-tokens 256

A drafter is judged on how well it predicts the target's greedy continuation, and a small
target's greedy text is far more predictable than the ChatGPT answers in ShareGPT. Training
on the target's own answers (as SpecForge and HASS do) moves the training contexts to the
distribution the drafter meets at inference. Prompts keep the MT-bench guard and the
train split of `data.py`; the output is a ShareGPT JSON file for `train --data`.

Generation is batched greedy decoding with left padding and a preallocated KV cache on --device
(CUDA when present, bf16 there). Finished
batches are appended to OUT.partial.jsonl, so an interrupted run resumes where it stopped;
the JSON file appears (atomically) only when every prompt is answered."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from ..api import load_target_on
from ..config import ConfigError
from ..devices import add_device_options
from .data import first_turns


@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]) -> list[list[int]]:
    """Greedy continuations of a batch of prompts (left padded), each cut after its first EOS.

    One preallocated KV cache [layers, B, L + max_new_tokens, Hkv, D] on the model's device:
    each step reads the committed prefix as views and writes one row in place. Finished rows
    keep their slots until half of the batch is done, then the live rows are compacted (one
    copy), so long batches do not pay for rows that stopped early."""
    dev, dtype, cfg = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype, model.cfg
    B, L = len(prompts), max(len(p) for p in prompts)
    S = L + max_new_tokens
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    valid = torch.zeros(B, S, dtype=torch.bool, device=dev)     # which cache rows hold real tokens
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p, device=dev)
        valid[b, L - len(p):L] = True
    pos = (valid[:, :L].long().cumsum(1) - 1).clamp(min=0)
    cache = torch.zeros(2, cfg.num_hidden_layers, B, S, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
    # Pad rows attend to themselves only, so no softmax row is empty (an empty row gives NaN
    # states whose keys would poison the real rows through 0 * NaN).
    eye = torch.eye(L, dtype=torch.bool, device=dev)[None]
    mask = (torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :L]) | eye
    empty = [cache[0, i, :, :0] for i in range(cfg.num_hidden_layers)]
    out = model(ids, pos, mask, empty, empty, logits_index=torch.full((1,), L - 1, device=dev))
    for i in range(cfg.num_hidden_layers):
        cache[0, i, :, :L], cache[1, i, :, :L] = out.new_k[i], out.new_v[i]
    next_tok: Tensor = out.logits[:, -1].argmax(-1)
    tokens: list[list[int]] = [[] for _ in range(B)]
    rows = list(range(B))                   # batch row -> prompt index
    live = torch.ones(B, dtype=torch.bool, device=dev)
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        for r, (b, t, alive) in enumerate(zip(rows, next_tok.tolist(), live.tolist())):   # one transfer a step
            if alive:
                tokens[b].append(t)
                if t in eos_ids:
                    live[r] = False
        if step == max_new_tokens - 1 or not bool(live.any()):
            break
        if int(live.sum()) <= len(rows) // 2:   # compact: drop the finished rows' slots
            keep = live.nonzero().flatten()
            rows = [rows[r] for r in keep.tolist()]
            cache, valid = cache[:, :, keep], valid[keep]
            next_tok, last_pos, live = next_tok[keep], last_pos[keep], live[keep]
        n = L + step                            # rows committed so far
        last_pos = last_pos + 1
        valid[:, n] = True
        past_k = [cache[0, i, :, :n] for i in range(cfg.num_hidden_layers)]
        past_v = [cache[1, i, :, :n] for i in range(cfg.num_hidden_layers)]
        out = model(next_tok[:, None], last_pos[:, None], valid[:, None, :n + 1], past_k, past_v)
        for i in range(cfg.num_hidden_layers):
            cache[0, i, :, n], cache[1, i, :, n] = out.new_k[i][:, 0], out.new_v[i][:, 0]
        next_tok = out.logits[:, -1].argmax(-1)
    return tokens


def regenerate(target, prompts: list[tuple[str, str, list[int]]], out: Path, max_new_tokens: int,
               batch_size: int, answered_only: bool = False) -> Path:
    """Answer `prompts` (resuming from OUT.partial.jsonl) and write OUT. answered_only: write
    OUT from the answers so far without generating more (to cut a long run short)."""
    tok = target.tokenizer()
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int) and i >= 0}
    partial = out.with_name(out.name + ".partial.jsonl")
    done: dict[str, dict] = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                break                       # a line cut by an interruption: regenerate from here
            done[item["id"]] = item
    todo = [] if answered_only else sorted((p for p in prompts if p[0] not in done), key=lambda p: len(p[2]))
    print(f"regenerate: {len(done)} answered before, {len(todo)} to go, batch {batch_size}, "
          f"max {max_new_tokens} new tokens", flush=True)
    t0, new_tokens = time.perf_counter(), 0
    with open(partial, "a") as f:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            answers = greedy_batch(target.model, [p[2] for p in batch], max_new_tokens, eos)
            for (sid, text, _), ans in zip(batch, answers):
                reply = tok.decode([t for t in ans if t not in eos], skip_special_tokens=True).strip()
                item = {"id": sid, "conversations": [{"from": "human", "value": text},
                                                     {"from": "gpt", "value": reply}]}
                f.write(json.dumps(item) + "\n")
                done[sid] = item
                new_tokens += len(ans)
            f.flush()
            dt = time.perf_counter() - t0
            print(f"regenerate: {len(done)}/{len(prompts)} prompts, {new_tokens / dt:.0f} new tok/s", flush=True)
    items = [done[p[0]] for p in prompts if p[0] in done]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(items))
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.train.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", type=Path, required=True, help="ShareGPT-style JSON file to write")
    p.add_argument("--max-prompts", type=int, default=1500)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    add_device_options(p)
    p.add_argument("--answered-only", action="store_true",
                   help="write OUT from the answers already in OUT.partial.jsonl and stop")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_target_on(args.target, args.device, args.dtype)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = first_turns(target.tokenizer(), "train", args.max_prompts, args.max_prompt_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {regenerate(target, prompts, args.out, args.max_new_tokens, args.batch_size, args.answered_only)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
