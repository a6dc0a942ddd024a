"""Peak resident memory of `python -m eagle_trt.build` against the target's weight bytes, on a
synthetic real-size checkpoint (issue 53: every stage of the default build bounded by the
target's weights in its base precision plus a fixed overhead).

    python scripts/build_memory.py [--out DIR] [--shape 0.83b|llama3.1-8b|llama3.1-70b] [--layers N]
                                   [--configs default,reduced] [--precisions fp32,fp8] [--threads 2] [--resume]

Writes a random Llama of --shape (0.83b: hidden 2048, 12 layers, GQA 32 / 8, intermediate 8192,
tied embeddings, vocabulary 49152; llama3.1-8b: Llama-3.1-8B's shape, hidden 4096, 32 layers,
GQA 32 / 8, intermediate 14336, vocabulary 128256, untied; llama3.1-70b: Llama-3.1-70B's width,
hidden 8192, GQA 64 / 8, intermediate 28672, 80 layers unless --layers cuts it) with SmolLM2's tokenizer, bf16
safetensors shards in transformers' layout (made once and reused, one shard in memory at a
time), then builds it once per config and precision, each in a fresh interpreter:

- `default`: the default config's stages with only the target and its precision set (a random
  EAGLE 3.1 drafter, the default tree, FP8 calibrated on 16 prompts, parity on 2 prompts,
  engines skipped without TensorRT, the Triton repository with its int8 drafter graph and
  iteration graph where the default serving settings make them);
- `reduced`: calibration on 4 prompts and parity on 1 (the earlier measurements).

Each build's own peak RSS (VmHWM; it counts memory-mapped files, page cache the kernel can drop)
and peak anonymous memory (sampled each second) are the numbers, with each stage's wall time and
exact peak RSS (VmHWM, reset through /proc/self/clear_refs as the stage starts), the stage that
peaks, the disk the output takes, and the bound the build is held to: its peak RSS at most the
target's weights in the base precision of its graphs plus 2 GB. Prints a table and writes
`memory.json` into --out."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "0.83b": dict(vocab_size=49152, hidden_size=2048, num_hidden_layers=12, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True,
                  max_position_embeddings=2048, rope_theta=10000.0),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# Llama-3.1-70B's width (80 layers on the Hub; cut with --layers, since the build's peak does not grow with depth)
SHAPES["llama3.1-70b"] = dict(SHAPES["llama3.1-8b"], hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                              intermediate_size=28672)
SHARD_BYTES = {"0.83b": "500MB", "llama3.1-8b": "5GB", "llama3.1-70b": "5GB"}   # as on the Hub
OVERHEAD_BOUND = 2e9       # bytes the build may use beyond one copy of the weights in their base precision
BASE_BYTES = {"fp32": 4, "fp16": 2}

# Runs the build CLI in this interpreter and reports its own peak RSS (the build starts no processes).
PROBE = """
import json, runpy, sys, threading, time
sys.argv = ["eagle_trt.build"] + sys.argv[1:]
start = time.time()

peak_anon = [0]
peak_rss = [0]   # the build's peak RSS: the max of VmHWM over every span between two resets
stages = []      # per stage: wall seconds and exact peak RSS (VmHWM, reset when the stage starts)


def status_kb(*keys):
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in keys}
    return [kb[k] for k in keys]


def sample():   # anonymous memory every second (the max), and RSS every 30 s into the log
    n = 0
    while True:
        time.sleep(1)
        anon, file = status_kb("RssAnon", "RssFile")
        peak_anon[0] = max(peak_anon[0], anon * 1024)
        n += 1
        if n % 30 == 0:
            print(f"[rss {(anon + file) / 1e6:.2f} GB (anonymous {anon / 1e6:.2f}) at "
                  f"{time.time() - start:.0f} s]", file=sys.stderr, flush=True)
threading.Thread(target=sample, daemon=True).start()

from eagle_trt.build import pipeline
stage_run = pipeline.Build.run


def reset_peak():
    # "5" resets VmHWM to the current RSS (getrusage's ru_maxrss with it): the next read is this span's
    peak_rss[0] = max(peak_rss[0], status_kb("VmHWM")[0] * 1024)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measured_run(self, name, *args, **kwargs):
    reset_peak()
    t0 = time.time()
    try:
        return stage_run(self, name, *args, **kwargs)
    finally:
        status = self.results[name].status if name in self.results else "failed"
        stages.append({"stage": name, "status": status, "seconds": time.time() - t0,
                       "peak_rss_bytes": status_kb("VmHWM")[0] * 1024})
pipeline.Build.run = measured_run
code = 0
try:
    runpy.run_module("eagle_trt.build", run_name="__main__")
except SystemExit as exc:
    code = exc.code or 0
except BaseException:   # a crash still reports how far memory got
    import traceback
    traceback.print_exc()
    code = 1
reset_peak()
print("MEMORY " + json.dumps({"exit": code, "seconds": time.time() - start, "peak_anonymous_bytes": peak_anon[0],
                              "peak_rss_bytes": peak_rss[0], "stages": stages}))
"""


# ----------------------------------------------------------------------------- the checkpoint

def _random_tensor(shape: tuple, gen):
    """transformers' initialization: normal(0, 0.02) matrices, RMSNorm weights of ones."""
    import torch
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)


def write_checkpoint(folder: Path, shape: dict, shard_size: str) -> Path:
    """A random Llama of `shape` with SmolLM2's tokenizer files, as transformers' save_pretrained
    lays it out (its config, its tensor names from a meta-device LlamaForCausalLM, shards planned
    by huggingface_hub as save_pretrained plans them, safetensors with format=pt), one shard
    materialized at a time: an 8B model is never in memory. Written beside `folder` and renamed."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_trt.checkpoints import resolve_target
    cfg = LlamaConfig(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg).to(torch.bfloat16)
    state = {k: v for k, v in skeleton.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=shard_size)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for i, (file, names) in enumerate(split.filename_to_tensors.items()):
        tensors = {n: _random_tensor(tuple(state[n].shape), gen) for n in names}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        print(f"  wrote {file} ({i + 1}/{len(split.filename_to_tensors)})", flush=True)
        del tensors
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * 2 for v in state.values())},
                 "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg.save_pretrained(str(tmp))
    for f in resolve_target("smollm2").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(folder)
    return folder


def parameter_count(folder: Path) -> int:
    """Parameters of the checkpoint, from its weights files' headers."""
    from eagle_trt.tensor_files import TensorFiles
    files = TensorFiles(folder)
    return sum(math.prod(files.shape(name)) for name in files.entries)


# ----------------------------------------------------------------------------- the builds

def precision_section(precision: str) -> tuple[dict, str]:
    """precision: fp32, fp16, fp8 (an FP8 target on an fp32 base) or fp8-fp16 (on an fp16 base,
    what the 8B configs build). Returns the config's precision section and the base precision."""
    fmt, base = precision.split("-") if "-" in precision else (precision, "fp32")
    target = {"format": fmt, "base": base} if fmt == "fp8" else {"format": fmt}
    base = base if fmt == "fp8" else fmt
    return {"target": target, "drafter": {"format": "fp16" if base == "fp16" else "fp32"}}, base


def build_config(target: Path, config: str, precision: str, out: Path) -> dict:
    """`default`: the default config with only the target and its precision set; `reduced`:
    calibration on 4 prompts, parity on 1, no engines."""
    section, _ = precision_section(precision)
    data = {"name": f"memory-{config}-{precision}", "target": {"source": str(target)}, "precision": section,
            "outputs": {"dir": str(out / f"build-{config}-{precision}")}}
    if config == "reduced":
        data.update(calibration={"prompts": 4}, parity={"prompts": 1}, engines={"enabled": False})
    elif config != "default":
        raise SystemExit(f"--configs: unknown config {config!r} (default, reduced)")
    return data


def disk_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk, hard links counted once."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def run_build(cfg_path: Path, log: Path, env: dict, force: bool) -> dict:
    with open(log, "w") as err:
        done = subprocess.run([sys.executable, "-c", PROBE, "--config", str(cfg_path)] + (["--force"] if force else []),
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("MEMORY ")), None)
    if line is None:
        raise SystemExit(f"{cfg_path}: the build process did not report its memory (exit {done.returncode}); see {log}")
    return json.loads(line[len("MEMORY "):])


def summarize(m: dict, params: int, base: str) -> dict:
    weights = params * BASE_BYTES[base]
    ran = [s for s in m["stages"] if s["status"] == "ran"]
    peak_stage = max(ran, key=lambda s: s["peak_rss_bytes"])["stage"] if ran else None
    return dict(m, base=base, base_weight_bytes=weights, peak_over_base_weights=m["peak_rss_bytes"] / weights,
                overhead_bytes=m["peak_rss_bytes"] - weights, peak_stage=peak_stage,
                within_bound=m["peak_rss_bytes"] <= weights + OVERHEAD_BOUND)


def print_table(rows: list[dict]) -> None:
    print(f"{'build':<22}{'stage':<10}{'status':<9}{'seconds':>9}{'peak RSS GB':>13}{'x base weights':>16}")
    for m in rows:
        label = f"{m['config']} {m['precision']}"
        for st in m["stages"]:
            print(f"{label:<22}{st['stage']:<10}{st['status']:<9}{st['seconds']:>9.0f}"
                  f"{st['peak_rss_bytes'] / 1e9:>13.2f}{st['peak_rss_bytes'] / m['base_weight_bytes']:>16.2f}")
        print(f"{label:<22}{'(build)':<10}{'exit ' + str(m['exit']):<9}{m['seconds']:>9.0f}"
              f"{m['peak_rss_bytes'] / 1e9:>13.2f}{m['peak_over_base_weights']:>16.2f}  peak in {m['peak_stage']}; "
              f"anonymous {m['peak_anonymous_bytes'] / 1e9:.2f} GB; bound {m['base_weight_bytes'] / 1e9:.2f} + 2 GB "
              f"{'held' if m['within_bound'] else 'EXCEEDED'}; output {m['disk_bytes'] / 1e9:.1f} GB on disk")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path.home() / "build-memory")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.83b")
    p.add_argument("--configs", default="default", help="comma-separated: default, reduced")
    p.add_argument("--precisions", default="fp32,fp8",
                   help="comma-separated: fp32, fp16, fp8 (fp32 base), fp8-fp16 (fp16 base)")
    p.add_argument("--threads", type=int, default=2, help="OMP / ONNX Runtime threads of each build")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the synthetic target (default: the shape's)")
    p.add_argument("--resume", action="store_true",
                   help="no --force: stages already built for these inputs are kept (a rerun after an interruption)")
    args = p.parse_args(argv)
    import yaml
    args.out.mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    name = f"synthetic-{args.shape}" + (f"-{args.layers}-layers" if args.layers is not None else "")
    print(f"writing or reusing {args.out / name}", flush=True)
    target = write_checkpoint(args.out / name, shape, SHARD_BYTES[args.shape])
    params, checkpoint_bytes = parameter_count(target), disk_bytes(target)
    print(f"target {target}: {params / 1e9:.3f} B parameters, {checkpoint_bytes / 1e9:.2f} GB on disk", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    for config in args.configs.split(","):
        for precision in args.precisions.split(","):
            data = build_config(target, config, precision, args.out)
            cfg_path = args.out / f"memory-{config}-{precision}.yaml"
            cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
            log = args.out / f"build-{config}-{precision}.log"
            print(f"  {config} {precision}: building (progress in {log})", flush=True)
            start = time.time()
            m = run_build(cfg_path, log, env, force=not args.resume)
            m = summarize(m, params, precision_section(precision)[1])
            m.update(config=config, precision=precision, wall_seconds=time.time() - start,
                     disk_bytes=disk_bytes(Path(data["outputs"]["dir"])))
            rows.append(m)
            print(f"  {config} {precision}: exit {m['exit']}, {m['seconds']:.0f} s, peak RSS "
                  f"{m['peak_rss_bytes'] / 1e9:.2f} GB = {m['peak_over_base_weights']:.2f}x the {m['base']} weights "
                  f"(+{m['overhead_bytes'] / 1e9:.2f} GB), in {m['peak_stage']}", flush=True)
    report = {"target": str(target), "shape": shape, "parameters": params, "checkpoint_disk_bytes": checkpoint_bytes,
              "threads": args.threads, "builds": rows}
    (args.out / "memory.json").write_text(json.dumps(report, indent=2))
    print_table(rows)
    return 0 if all(m["exit"] == 0 and m["within_bound"] for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
