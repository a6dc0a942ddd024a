"""Target features for drafter training, computed once by our own LlamaTarget and cached.

Per sequence of T tokens the cache holds (fp16 unless said otherwise):
    ids       [T]        int32  token ids
    mask      [T]        uint8  1 where the token is assistant text
    captured  [T, A*H]          the captured residual-stream states (drafter step-0 input)
    normed    [T, H]            the target's final hidden state after its final norm; the
                                target distribution over the draft vocabulary is
                                softmax(normed @ lm_head.weight[used].T)
    argmax    [T]        int32  the target's greedy next token over the FULL vocabulary
                                (drafts are accepted against it; it also tells whether the
                                target's choice lies in the draft vocabulary)

Each shard records the precision its target forward ran in (`precision`: float32, the
reference, or bfloat16 autocast: 2.6x the tokens per second on a CPU with native bf16, at 98%
greedy-token agreement with float32; docs/training.md). Shards written before the key existed
are float32.

Sequences are grouped into safetensors shards written atomically (temp file, then rename).
A shard already on disk whose fingerprint (sample ids and tokens) matches is skipped, so an
interrupted extraction resumes where it stopped. `features.json` names the target and the
captured streams; a cache folder built for another target or other captured layers is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoints import LoadedTarget
from ..config import CaptureLayers
from ..devices import native_bf16
from ..models.target import causal_mask
from .data import Sample

FORMAT = FEATURE_FORMAT = "eagle-trt-features/1"
MANIFEST = "features.json"
FP16_MAX = 65504.0
PRECISIONS = ("float32", "bfloat16")     # the target forward that computes a shard's features


class FeatureError(ValueError):
    """A feature cache does not match the target, the captured layers or the samples."""


def resolve_precision(precision: str, device: torch.device) -> str:
    """A feature precision for `device`: "auto" is bfloat16 where bf16 is native (CUDA, CPUs with
    AVX-512 BF16 / AMX: 2.6x float32's tokens/s), float32 elsewhere."""
    if precision == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if precision not in PRECISIONS:
        raise FeatureError(f"feature precision {precision!r}: expected auto or one of {', '.join(PRECISIONS)}")
    return precision


def target_identity(target: LoadedTarget, capture: CaptureLayers) -> dict:
    cfg_text = (Path(target.folder) / "config.json").read_bytes() if target.folder else b""
    return {
        "format": FORMAT,
        "target": Path(target.folder).name,
        "target_config_sha256": hashlib.sha256(cfg_text).hexdigest()[:16],
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
        "num_hidden_layers": target.config.num_hidden_layers,
        "capture_layer_ids": list(capture.layer_ids),
        "capture_convention": capture.convention,
        "capture_streams": list(capture.streams()),
    }


def shard_fingerprint(samples: list[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.sample_id.encode())
        h.update(torch.tensor(s.ids, dtype=torch.int32).numpy().tobytes())
        h.update(bytes(s.loss_mask))
    return h.hexdigest()[:24]


def atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@torch.inference_mode()
def padded_features(model, seqs: list[list[int]], sample_ids: list[str] | None = None,
                    precision: str = "float32") -> dict[str, torch.Tensor]:
    """Sequences right-padded into one target forward, on the target's device, in the cache's
    dtypes: ids [B, T] int32, captured [B, T, A] and normed [B, T, H] fp16, argmax [B, T] int32.
    Rows past a sequence's end are zero; attention is causal, so padding never reaches a real
    row. precision "bfloat16" runs the forward under bf16 autocast (the weights stay float32)."""
    if precision not in PRECISIONS:
        raise FeatureError(f"feature precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    dev = model.embed_tokens.weight.device
    B, T = len(seqs), max(len(s) for s in seqs)
    x = torch.zeros(B, T, dtype=torch.int64)
    for b, s in enumerate(seqs):
        x[b, :len(s)] = torch.tensor(s, dtype=torch.int64)
    x = x.to(dev)                       # one host-to-device copy for the batch
    valid = (torch.arange(T, device=dev)[None] < torch.tensor([len(s) for s in seqs], device=dev)[:, None])
    grabbed: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: grabbed.append(out))
    try:
        past_k, past_v = model.empty_past(B, device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            out = model(x, torch.arange(T, device=dev)[None].expand(B, T), causal_mask(T, 0, dev), past_k, past_v)
    finally:
        handle.remove()
    keep = valid[..., None]
    captured, normed = out.captured.float() * keep, grabbed[-1].float() * keep
    for name, t in (("captured", captured), ("normed", normed)):
        peak = t.abs().amax(dim=(1, 2))
        if not bool((peak < FP16_MAX).all()):
            b = int(peak.argmax())
            sid = sample_ids[b] if sample_ids else f"<sample {b}>"
            raise FeatureError(f"sample {sid}: target {name} state reaches {float(peak[b]):.4g}, beyond fp16 range")
    return {"ids": x.to(torch.int32), "captured": captured.to(torch.float16), "normed": normed.to(torch.float16),
            "argmax": (out.logits.argmax(-1) * valid).to(torch.int32)}


def target_features(model, ids: list[int], sample_id: str = "<sample>", to_host: bool = True,
                    precision: str = "float32") -> dict[str, torch.Tensor]:
    """One sequence through the target (padded_features at batch 1), on the host or (to_host=False)
    on the target's device."""
    feats = {k: v[0] for k, v in padded_features(model, [ids], [sample_id], precision).items()}
    return {k: v.cpu() for k, v in feats.items()} if to_host else feats


@dataclass
class FeatureConfig:
    shard_size: int = 64          # sequences per shard file
    log_every_s: float = 30.0
    precision: str = "float32"    # target forward of the shards computed now (PRECISIONS)


def extract_features(target: LoadedTarget, samples: list[Sample], out_dir: str | Path, capture: CaptureLayers,
                     cfg: FeatureConfig | None = None, log: Callable[[str], None] = print,
                     groups: list[tuple[str, list[Sample]]] | None = None) -> FeatureStore:
    """Compute (or resume computing) the feature cache of `samples` under `out_dir`.
    Sets the target's capture layers to `capture`. `groups` (shard name, samples) replaces the
    default shards of cfg.shard_size sequences (a distillation set's chunks keep their names)."""
    cfg = cfg or FeatureConfig()
    if groups is not None:
        samples = [s for _, g in groups for s in g]
        cfg = replace(cfg, shard_size=0)      # 0: named groups
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    identity = target_identity(target, capture)
    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        diff = {k: (old.get("identity", {}).get(k), v) for k, v in identity.items() if old.get("identity", {}).get(k) != v}
        if diff:
            raise FeatureError(f"{manifest_path}: this feature cache was built for another target or other captured "
                               f"layers (cached vs requested: {diff}); use another --features-dir")
        if old.get("shard_size") != cfg.shard_size:
            raise FeatureError(f"{manifest_path}: cache uses shard_size {old.get('shard_size')}, requested {cfg.shard_size}")
    model = target.model.eval()
    model.set_capture(capture)
    if groups is None:
        groups = [(f"shard_{n:05d}", samples[i: i + cfg.shard_size])
                  for n, i in enumerate(range(0, len(samples), cfg.shard_size))]
    shards, done_tokens, computed = [], 0, 0
    total_tokens = sum(len(s.ids) for s in samples)
    start = last_log = time.perf_counter()
    for n, (name, group) in enumerate(groups):
        path = out / f"{name}.safetensors"
        fp = shard_fingerprint(group)
        entry = {"file": path.name, "fingerprint": fp, "sequences": len(group), "tokens": sum(len(s.ids) for s in group)}
        shards.append(entry)
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                have = (f.metadata() or {}).get("fingerprint")
            if have != fp:
                raise FeatureError(f"{path}: shard holds other samples (fingerprint {have}, expected {fp}); the data "
                                   f"options changed since it was written; use another --features-dir")
            done_tokens += entry["tokens"]
            continue
        tensors: dict[str, torch.Tensor] = {}
        in_shard = 0
        for k, s in enumerate(group):
            feats = target_features(model, s.ids, s.sample_id, precision=cfg.precision)
            feats["mask"] = torch.tensor(s.loss_mask, dtype=torch.uint8)
            tensors.update({f"{k}.{name}": t.contiguous() for name, t in feats.items()})
            computed += len(s.ids)
            in_shard += len(s.ids)
            now = time.perf_counter()
            if now - last_log >= cfg.log_every_s:
                last_log = now
                rate = computed / (now - start)
                left = total_tokens - done_tokens - in_shard
                log(f"features ({cfg.precision}): shard {n + 1}/{len(groups)}  {done_tokens + in_shard}/{total_tokens} tokens  "
                    f"{rate:.0f} tok/s  eta {left / max(rate, 1e-9) / 60:.1f} min")
        meta = {"format": FORMAT, "fingerprint": fp, "sample_ids": json.dumps([s.sample_id for s in group]),
                "precision": cfg.precision}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")     # two runs may fill one cache at once
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        done_tokens += entry["tokens"]
        atomic_json(manifest_path, {"identity": identity, "shard_size": cfg.shard_size, "shards": shards})
    atomic_json(manifest_path, {"identity": identity, "shard_size": cfg.shard_size, "shards": shards})
    elapsed = time.perf_counter() - start
    log(f"features: {len(samples)} sequences, {total_tokens} tokens in {out} ({len(groups)} shards; "
        f"{computed} tokens computed in {elapsed:.1f} s this run)")
    return FeatureStore(out, num_shards=len(groups))


class FeatureStore:
    """Read access to a feature cache; tensors are memory-mapped from the shards on demand."""

    def __init__(self, folder: str | Path, num_shards: int | None = None):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise FeatureError(f"{path}: no feature cache here (run feature extraction first)")
        self.manifest = json.loads(path.read_text())
        self.identity = self.manifest["identity"]
        shards = self.manifest["shards"][: num_shards] if num_shards is not None else self.manifest["shards"]
        self.index: list[tuple[int, int]] = []
        self.lengths: list[int] = []
        self.precisions: list[str] = []     # per sequence: the target forward its features came from
        self._files = []
        for n, entry in enumerate(shards):
            f = self.folder / entry["file"]
            if not f.is_file():
                raise FeatureError(f"{f}: shard listed in {path} is missing (extraction interrupted? run it again)")
            handle = safe_open(str(f), "pt")
            self._files.append(handle)
            precision = (handle.metadata() or {}).get("precision", "float32")
            self.precisions += [precision] * entry["sequences"]
            for k in range(entry["sequences"]):
                self.index.append((n, k))
                self.lengths.append(int(handle.get_slice(f"{k}.ids").get_shape()[0]))

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int, names: tuple[str, ...] = ("ids", "mask", "captured", "normed", "argmax")) -> dict:
        n, k = self.index[i]
        return {name: self._files[n].get_tensor(f"{k}.{name}") for name in names}

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def check_target(self, target: LoadedTarget, capture: CaptureLayers) -> None:
        want = target_identity(target, capture)
        diff = {k: (self.identity.get(k), v) for k, v in want.items() if self.identity.get(k) != v}
        if diff:
            raise FeatureError(f"{self.folder / MANIFEST}: features do not fit this target / drafter capture "
                               f"(cached vs requested: {diff})")


class OnlineFeatures:
    """The FeatureStore interface without a cache: each sequence's target features are computed
    when a batch asks for them, on the target's device, and never leave it. A disk cache costs
    4.6 KB per token (46 GB for 10 M tokens) and a GPU computes features faster than a disk
    serves them; the numbers equal the cache's (same fp16 rounding), so a run trains the same
    either way."""

    def __init__(self, target: LoadedTarget, samples: list[Sample], capture: CaptureLayers, precision: str = "float32",
                 keep_bytes: int = 0):
        self.model, self.precision = target.model.eval(), precision
        self.model.set_capture(capture)
        self.samples, self.folder = samples, Path("<online>")
        self.identity = target_identity(target, capture)
        self.lengths = [len(s.ids) for s in samples]
        self.precisions = [precision] * len(samples)
        # keep_bytes > 0: each sequence's features stay on the device once computed (up to this
        # many bytes, 4.6 KB a token), so epochs after the first skip the target forward
        self.keep_bytes, self.kept, self.kept_bytes = keep_bytes, {}, 0

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, i: int, names: tuple[str, ...] = ("ids", "mask", "captured", "normed", "argmax")) -> dict:
        s = self.samples[i]
        out = {"ids": torch.tensor(s.ids, dtype=torch.int32), "mask": torch.tensor(s.loss_mask, dtype=torch.uint8)}
        if set(names) - set(out):
            with torch.inference_mode():
                out.update(target_features(self.model, s.ids, s.sample_id, to_host=False, precision=self.precision))
        return {name: out[name] for name in names}

    def padded(self, indices: list[int]) -> dict:
        """A batch's features from one padded target forward (what a GPU needs to be busy), plus
        the loss masks [B, T] bool; training reads this instead of collating get() per sequence."""
        samples = [self.samples[i] for i in indices]
        if self.keep_bytes:
            out = self._padded_from_kept(indices)
        else:
            out = padded_features(self.model, [s.ids for s in samples], [s.sample_id for s in samples], self.precision)
        mask = torch.zeros(out["ids"].shape, dtype=torch.bool)
        for b, s in enumerate(samples):
            mask[b, :len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
        return out | {"mask": mask.to(out["ids"].device), "tokens": sum(len(s.ids) for s in samples)}

    def _padded_from_kept(self, indices: list[int]) -> dict:
        """padded() through the kept features: one target forward for the sequences not kept
        yet (kept from then on while keep_bytes allows), the batch padded from per-sequence rows."""
        missing = [i for i in dict.fromkeys(indices) if i not in self.kept]
        fresh: dict[int, dict] = {}
        if missing:
            f = padded_features(self.model, [self.samples[i].ids for i in missing],
                                [self.samples[i].sample_id for i in missing], self.precision)
            for b, i in enumerate(missing):
                row = {k: v[b, :self.lengths[i]] for k, v in f.items()}
                size = sum(v.numel() * v.element_size() for v in row.values())
                if self.kept_bytes + size <= self.keep_bytes:
                    row = {k: v.clone() for k, v in row.items()}     # not a view of the whole batch
                    self.kept[i], self.kept_bytes = row, self.kept_bytes + size
                fresh[i] = row
        rows = [self.kept.get(i) or fresh[i] for i in indices]
        return {k: torch.nn.utils.rnn.pad_sequence([r[k] for r in rows], batch_first=True) for k in rows[0]}

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def check_target(self, target: LoadedTarget, capture: CaptureLayers) -> None:
        if target_identity(target, capture) != self.identity:
            raise FeatureError("online features were set up for another target or other captured layers")


class ConcatStore:
    """Several feature caches read as one (e.g. ShareGPT answers plus the target's own answers).
    The last store comes last, so held-out evaluation sequences are taken from it."""

    def __init__(self, stores: list[FeatureStore]):
        if not stores:
            raise FeatureError("no feature caches given")
        first = stores[0]
        for s in stores[1:]:
            if s.identity != first.identity:
                raise FeatureError(f"{s.folder / MANIFEST} and {first.folder / MANIFEST} come from different "
                                   f"targets or capture layers; they cannot be trained on together")
        self.stores, self.folder, self.identity = stores, stores[-1].folder, first.identity
        self.index = [(n, i) for n, s in enumerate(stores) for i in range(len(s))]
        self.lengths = [length for s in stores for length in s.lengths]
        self.precisions = [p for s in stores for p in s.precisions]

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int, names: tuple[str, ...] = ("ids", "mask", "captured", "normed", "argmax")) -> dict:
        n, k = self.index[i]
        return self.stores[n].get(k, names)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def check_target(self, target: LoadedTarget, capture: CaptureLayers) -> None:
        for s in self.stores:
            s.check_target(target, capture)


def tokens_by_precision(store) -> dict[str, int]:
    """Tokens of a store (FeatureStore, OnlineFeatures, ConcatStore) by the precision of the
    target forward that computed their features."""
    return {p: sum(n for n, q in zip(store.lengths, store.precisions) if q == p) for p in sorted(set(store.precisions))}


__all__ = ["ConcatStore", "FEATURE_FORMAT", "OnlineFeatures", "FeatureConfig", "FeatureError", "FeatureStore", "PRECISIONS",
           "extract_features", "padded_features", "resolve_precision", "target_features", "target_identity",
           "tokens_by_precision"]
