"""How much memory does a build of a real-size target need? Peak resident memory of
`python -m eagle_trt.build` against the target's weight bytes, on a synthetic real-size checkpoint (issue 21: an 8B build must fit a 32 GB host).

    python scripts/build_memory.py [--out ~/build-memory] [--precisions fp32,fp16,fp8,fp8-fp16] [--threads 2]

Writes a random Llama with `transformers` (default: the 0.83 B shape of issue 21, hidden 2048,
12 layers, GQA 32 / 8, intermediate 8192, tied embeddings, SmolLM2's tokenizer, bf16
safetensors in ~500 MB shards; made once and reused), then builds it once per precision (the
target in that precision, a random EAGLE 3.1 drafter, the default tree, parity on 1 prompt,
no engines, FP8 calibrated on 4 prompts), each in a fresh interpreter whose own peak RSS
(VmHWM; it counts memory-mapped graph weights, which are page cache the kernel can drop)
and its peak anonymous memory (sampled each second; a call that holds the GIL, such as the
ONNX export, is not sampled inside) are the numbers, with each stage's wall time and exact
peak RSS (VmHWM, reset through /proc/self/clear_refs as the stage starts). Prints a table and
writes `memory.json` into --out."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, tie_word_embeddings=True)
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


def sample():   # anonymous memory every second (the max), and RSS every 5 s into the log
    n = 0
    while True:
        time.sleep(1)
        anon, file = status_kb("RssAnon", "RssFile")
        peak_anon[0] = max(peak_anon[0], anon * 1024)
        n += 1
        if n % 5 == 0:
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


def write_checkpoint(folder: Path, layers: int = SHAPE["num_hidden_layers"]) -> Path:
    """A random Llama of SHAPE (with `layers` decoder layers) with SmolLM2's tokenizer files,
    bf16 safetensors shards."""
    if (folder / "config.json").is_file():
        return folder
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_trt.checkpoints import resolve_target
    smol = resolve_target("smollm2")
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, **(SHAPE | {"num_hidden_layers": layers}))
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp), max_shard_size="500MB")
    for f in smol.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(folder)
    return folder


def weight_bytes(folder: Path) -> tuple[int, int]:
    """(parameters, their fp32 bytes) from the checkpoint's safetensors headers."""
    from safetensors import safe_open
    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                count = 1
                for d in shape:
                    count *= d
                n += count
    return n, 4 * n


def build_config(target: Path, precision: str, out: Path) -> dict:
    """precision: fp32, fp16, fp8 (an FP8 target on an fp32 base) or fp8-fp16 (on an fp16 base,
    what the 8B configs build)."""
    fmt, base = precision.split("-") if "-" in precision else (precision, "fp32")
    target_fmt = {"format": fmt, "base": base} if fmt == "fp8" else {"format": fmt}
    return {"name": f"memory-{precision}", "target": {"source": str(target)},
            "precision": {"target": target_fmt, "drafter": {"format": "fp16" if "fp16" in precision else "fp32"}},
            "calibration": {"prompts": 4}, "parity": {"prompts": 1}, "engines": {"enabled": False},
            "outputs": {"dir": str(out / f"build-{precision}")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path.home() / "build-memory")
    p.add_argument("--precisions", default="fp32,fp16,fp8,fp8-fp16",
                   help="comma-separated: fp32, fp16, fp8 (fp32 base), fp8-fp16 (fp16 base)")
    p.add_argument("--threads", type=int, default=2, help="OMP / ONNX Runtime threads of each build")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                   help="decoder layers of the synthetic target (12: 0.83 B; two sizes separate a fixed "
                        "overhead from what grows with the weights)")
    args = p.parse_args(argv)
    import os

    import yaml
    args.out.mkdir(parents=True, exist_ok=True)
    name = "synthetic-0.83b" if args.layers == SHAPE["num_hidden_layers"] else f"synthetic-{args.layers}-layers"
    target = write_checkpoint(args.out / name, args.layers)
    params, fp32_bytes = weight_bytes(target)
    print(f"target {target}: {params / 1e9:.3f} B parameters, {fp32_bytes / 1e9:.2f} GB in fp32", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    for precision in args.precisions.split(","):
        cfg = args.out / f"memory-{precision}.yaml"
        cfg.write_text(yaml.safe_dump(build_config(target, precision, args.out), sort_keys=False))
        start, log = time.time(), args.out / f"build-{precision}.log"
        print(f"  {precision}: building (progress in {log})", flush=True)
        with open(log, "w") as err:
            done = subprocess.run([sys.executable, "-c", PROBE, "--config", str(cfg), "--force"],
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("MEMORY ")), None)
        if line is None:
            raise SystemExit(f"{precision}: the build process did not report its memory (exit {done.returncode}); "
                             f"see {log}")
        m = json.loads(line[len("MEMORY "):])
        m.update(precision=precision, wall_seconds=time.time() - start,
                 peak_over_fp32_weights=m["peak_rss_bytes"] / fp32_bytes)
        rows.append(m)
        print(f"  {precision}: exit {m['exit']}, {m['seconds']:.0f} s, peak RSS {m['peak_rss_bytes'] / 1e9:.2f} GB "
              f"= {m['peak_over_fp32_weights']:.2f}x the fp32 weights (anonymous, sampled: "
              f"{m['peak_anonymous_bytes'] / 1e9:.2f} GB)", flush=True)
    report = {"target": str(target), "shape": SHAPE | {"num_hidden_layers": args.layers}, "parameters": params,
              "fp32_weight_bytes": fp32_bytes, "threads": args.threads, "builds": rows}
    (args.out / "memory.json").write_text(json.dumps(report, indent=2))
    print(f"{'precision':<10}{'stage':<10}{'seconds':>9}{'peak RSS GB':>13}{'x fp32 weights':>16}{'anonymous GB':>14}")
    for m in rows:
        for st in m["stages"]:
            if st["status"] == "ran":
                print(f"{m['precision']:<10}{st['stage']:<10}{st['seconds']:>9.0f}{st['peak_rss_bytes'] / 1e9:>13.2f}"
                      f"{st['peak_rss_bytes'] / fp32_bytes:>16.2f}")
        print(f"{m['precision']:<10}{'(build)':<10}{m['seconds']:>9.0f}{m['peak_rss_bytes'] / 1e9:>13.2f}"
              f"{m['peak_over_fp32_weights']:>16.2f}{m['peak_anonymous_bytes'] / 1e9:>14.2f}")
    return 0 if all(m["exit"] == 0 for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
