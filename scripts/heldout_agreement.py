"""How well do drafters agree with the target at every draft step? Held-out top-1 agreement and
loss at every TTT step, on a distillation set's features (the numbers a training run logs as
eval_acc / eval_loss), for any number of steps (a tree of depth 5 uses 5).

    python scripts/heldout_agreement.py eagle_trt/drafters/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3 \
        [--ttt-steps 5] [--eval-distill data/distill/smollm2-val] [--threads 2]

--workload mtbench (or humaneval) evaluates on the target's own greedy answers to that
workload's first --prompts prompts instead (--max-new-tokens each, generated once into the
cache in the distillation set's format; an evaluation set, never training data): the same
teacher-forced agreement as the held-out ShareGPT set, on the prompts `evaluate` and `bench`
measure acceptance on. --target-confidence also prints the target's own mean top-1
probability on the answer tokens: how predictable its greedy text is at all. --split-loops
also prints evaluate()'s agreement on answer tokens that repeat their sequence's own earlier
9-grams (loops, eagle_trt/train/loops.py) apart from the rest: greedy answers of a small
target loop, and the easy loop tokens lift the overall number (37% of the held-out ShareGPT
positions, 10% of MT-bench's). Each drafter's line also says how many of the answer tokens its draft
vocabulary holds (a token outside it can never be drafted); --vocab-sizes 8192,16384 adds how
many the N most frequent answer tokens of --vocab-from's distillation sets would hold.
--prompt-context N evaluates with at most N prompt tokens in the
drafter's own context: how much it reads the prompt itself (docs/training.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle_trt.checkpoints import CheckpointError, cache_dir, load_drafter, load_target
from eagle_trt.models.target import causal_mask
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.loop import DecodingLoop
from eagle_trt.runtime.static import StaticEngine
from eagle_trt.train.__main__ import distilled_features
from eagle_trt.train.regenerate import FORMAT, PROVENANCE, DistillSet, _target_key, chunk_name, write_chunk
from eagle_trt.train.ttt import TrainConfig, auto_autocast, evaluate
from eagle_trt.train.vocab import build_draft_vocab, count_tokens
from eagle_trt.workloads import build


def workload_answers(target, workload: str, prompts: int, max_new_tokens: int) -> Path:
    """The target's greedy answers to a workload's first prompts, as a one-chunk distillation
    set in the cache (made once)."""
    folder = cache_dir() / "workload-answers" / f"{target.folder.name}-{workload}-{prompts}x{max_new_tokens}"
    if (folder / PROVENANCE).is_file():
        return folder
    eos = set(target.config.eos_token_ids)
    tok = target.tokenizer()
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    items = []
    plain = DecodingLoop(StaticEngine(target.model, max_batch=1), eos)
    for i, ids in enumerate(build(tok, workload, prompts)):
        answer = plain.generate(ids, max_new_tokens).tokens
        items.append((f"{workload}-{i}", ids, answer))
        print(f"  {workload} {i + 1}/{prompts}: {len(answer)} answer tokens", file=sys.stderr, flush=True)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    write_chunk(tmp / f"{chunk_name(0)}.npz", items)
    (tmp / PROVENANCE).write_text(json.dumps({
        "format": FORMAT, "target": _target_key(target),
        "prompts": f"the first {prompts} prompts of the {workload} workload (eagle_trt.workloads): an evaluation set",
        "decoding": "greedy (eagle_trt plain decoding, PyTorch)",
        "settings": {"max_new_tokens": max_new_tokens}}, indent=1))
    tmp.rename(folder)
    return folder


def answer_tokens(folder: Path) -> torch.Tensor:
    """Every answer token of a distillation set (the positions its samples train on), in order."""
    parts = [torch.tensor(sample.ids)[torch.tensor(sample.loss_mask, dtype=torch.bool)]
             for _, samples in DistillSet(folder).chunks() for sample in samples]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@torch.no_grad()
def target_confidence(target, folder: Path) -> float:
    """Mean probability of the target's top-1 token at every answer position of the set."""
    backend, total, count = TorchTarget(target.model), 0.0, 0
    for _, samples in DistillSet(folder).chunks():
        for sample in samples:
            n = len(sample.ids)
            backend.reset()
            backend.add_sequence()
            logits = backend.forward(torch.tensor([sample.ids]), torch.arange(n)[None], causal_mask(n, 0)).logits
            answer = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)       # rows predicting answer tokens
            top = logits[0, :-1][answer].float().softmax(-1).max(-1).values
            total, count = total + float(top.sum()), count + int(answer.sum())
    return total / max(count, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--eval-distill", type=Path, default=Path("data/distill/smollm2-val"))
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--workload", default=None, help="evaluate on the target's greedy answers to this workload "
                   "(mtbench, humaneval, ...) instead of --eval-distill")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target-confidence", action="store_true")
    p.add_argument("--split-loops", action="store_true", help="agreement on loop tokens and on the rest, apart")
    p.add_argument("--prompt-context", type=int, default=0, metavar="N",
                   help="with at most N prompt tokens in the drafter's own context (the target features "
                        "keep the whole prompt): how much the drafter reads the prompt; 0: whole prompts")
    p.add_argument("--vocab-sizes", default="", help="comma-separated draft vocabulary sizes: the share of the "
                   "answer tokens the N most frequent answer tokens of --vocab-from cover")
    p.add_argument("--vocab-from", type=Path, nargs="+", default=None,
                   help="distillation sets counted for --vocab-sizes (default: data/distill/smollm2-sharegpt*)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    if args.workload:
        args.eval_distill = workload_answers(target, args.workload, args.prompts, args.max_new_tokens)
    if args.target_confidence:
        print(f"target confidence on {args.eval_distill}: mean top-1 probability "
              f"{target_confidence(target, args.eval_distill):.3f}")
    answers = answer_tokens(args.eval_distill)
    V = target.config.vocab_size
    if args.vocab_sizes:
        sets = args.vocab_from or sorted(Path("data/distill").glob("smollm2-sharegpt*"))
        counts = count_tokens([answer_tokens(folder) for folder in sets], None, V)
        for size in (int(x) for x in args.vocab_sizes.split(",")):
            kept = build_draft_vocab(counts, min(size, V)).t2d
            print(f"the {size} most frequent answer tokens of {', '.join(str(f) for f in sets)} hold "
                  f"{float(kept[answers].float().mean()):.2%} of the {answers.numel()} answer tokens")
    head = target.model.lm_head.weight.detach()
    for folder in args.drafters:
        try:
            drafter = load_drafter(folder, target, torch.float32)
        except CheckpointError as exc:
            print(f"error: {folder}: {exc}", file=sys.stderr)
            return 2
        store = distilled_features(target, drafter.cfg.capture_for(target.config), args.eval_distill)
        variant = "eagle3.1" if drafter.cfg.norm_output else "eagle3"
        # the training runs evaluate under the autocast they train with (bf16 on these CPUs)
        cfg = TrainConfig(variant=variant, ttt_steps=args.ttt_steps, autocast=auto_autocast(drafter.fc.weight.device))
        used = drafter.to_target_ids(torch.arange(drafter.cfg.draft_vocab_size))
        out = evaluate(drafter, store, list(range(len(store))), head[used].clone(), cfg, args.prompt_context)
        print(f"{folder}: {variant}, {len(store)} sequences, {store.tokens} tokens, {args.ttt_steps} TTT steps\n"
              f"  agreement {' / '.join(f'{x:.3f}' for x in out['eval_acc'])}\n"
              f"  loss      {' / '.join(f'{x:.4f}' for x in out['eval_loss'])}\n"
              f"  draft vocabulary: {drafter.cfg.draft_vocab_size} ids hold "
              f"{float(drafter.t2d.cpu()[answers].float().mean()):.2%} of the answer tokens")
        if args.split_loops:
            for name in ("loop", "text"):
                print(f"  {name:<9} {' / '.join(f'{x:.3f}' for x in out[f'eval_acc_{name}'])}  "
                      f"({out['eval_positions'][name]} positions at step 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
