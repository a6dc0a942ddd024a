"""`make demo`: build the embedded default (SmolLM2-135M-Instruct + its EAGLE 3.1 drafter), then
generate with the built graphs and measure speculative against autoregressive decoding on the
same backend (ONNX Runtime), in the same run; finally stream one request through the built
Triton repository when the bundled server (nvidia-pytriton) is installed.

    python -m eagle_trt.build.demo [--output DIR] [--max-new-tokens N] [--no-serve]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROMPTS = [
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about autumn leaves.",
]
WARM_UP = "Say hello."      # not measured
# The speed-up is measured by `python -m eagle_trt.bench --build` on the first 10 MT-bench first
# turns x 128 tokens (3 short prompts x 64 tokens gave 1.44x where bench gave 1.16x on the same
# graphs: easy prompts accept more and a short run weighs the prefill more).
SPEED_PROMPTS, SPEED_TOKENS = 10, 128


def offline(manifest, cfg, max_new_tokens: int) -> tuple[bool, list[int], object]:
    """Speculative vs autoregressive on the built graphs; prints per-prompt lines and the speed-up."""
    import gc
    import json

    from transformers import AutoTokenizer

    from ..api import encode_prompt
    from ..runtime.timing import OrtDecoding
    from .triton import served_graphs
    resolved = json.loads(manifest.artifact("validate/resolved.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolved["target"]["folder"], local_files_only=True)
    eos = set(resolved["target"]["eos_ids"]) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    # the graphs the Triton repository serves (the drafter's with int8 weights: serving.drafter_weights),
    # with the same sessions, thread settings and warm-up as python -m eagle_trt.bench (runtime/timing.py)
    graphs = served_graphs(manifest.artifact("triton"), cfg.serving.model_name) or {   # or engines: the exported graphs
        g: manifest.artifact(f"export/{g}.onnx") for g in ("target", "drafter_tree")}
    ort = OrtDecoding.open(graphs, cfg.tree.shape, resolved["target"]["max_context"], eos,
                           resolved["target"]["vocab_size"])
    ort.warm_up(encode_prompt(tokenizer, WARM_UP, chat=True))
    identical, first = True, []
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt, chat=True)
        spec = ort.speculative(ids, max_new_tokens)
        ar = ort.autoregressive(ids, max_new_tokens)
        same = spec.tokens == ar.tokens
        identical &= same
        first = first or spec.tokens
        print(f"> {prompt}\n{tokenizer.decode(spec.tokens, skip_special_tokens=True)}\n"
              f"  [{len(spec.tokens)} tokens, mean accept length {spec.mean_accept_length:.2f}, "
              f"{spec.seconds:.2f}s speculative vs {ar.seconds:.2f}s autoregressive, identical: {same}]\n")
    del ort       # its plain session's threads spin between calls: gone before the measurement runs
    gc.collect()
    speed = measure_speed(Path(manifest.output))
    identical &= speed["identical"]
    print(f"all outputs token-identical to autoregressive greedy decoding: {identical}")
    return identical, first, tokenizer


def bench_command(output: Path, out: Path) -> list[str]:
    """The speed measurement: python -m eagle_trt.bench on the build's own served graphs, in a
    process of its own, with bench's defaults otherwise (all cores, each prompt's fastest of 2)."""
    return [sys.executable, "-m", "eagle_trt.bench", "--build", str(output), "--workloads", "mtbench",
            "--prompts", str(SPEED_PROMPTS), "--max-new-tokens", str(SPEED_TOKENS), "--out", str(out)]


def measure_speed(output: Path) -> dict:
    """Speculative against autoregressive decoding on the built graphs, measured by bench itself
    (a fresh interpreter: the build's memory and threads do not weigh on it), so that make demo
    and python -m eagle_trt.bench report one measurement, not two ways of taking it."""
    import json
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as tmp:
        cmd = bench_command(output, Path(tmp))
        print(f"speed: the first {SPEED_PROMPTS} MT-bench prompts x {SPEED_TOKENS} tokens, measured by\n  "
              f"{' '.join(['python'] + cmd[1:-2])}", flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        if done.returncode != 0:
            print(done.stdout[-3000:], file=sys.stderr)
            raise RuntimeError(f"the speed measurement failed (exit {done.returncode}): {' '.join(cmd)}")
        report = json.loads((Path(tmp) / "bench.json").read_text())
    r = report["results"][0]
    modes = r["modes"]
    sps, aps = modes["speculative"]["tokens_per_second"], modes["autoregressive"]["tokens_per_second"]
    iteration = ", one call an iteration: the iteration graph" if report["iteration_graph"] else ""
    print(f"drafter: {report['drafter']} ({report['drafter_variant']}, {report['drafter_weights']} weights{iteration}); "
          f"tree {tuple(report['tree'])}; mean accept length {r['mean_accept_length']:.2f}")
    print(f"speculative {sps:.1f} tok/s, autoregressive {aps:.1f} tok/s (ONNX Runtime CPU, same graphs, same run, "
          f"plain decoding in its fastest setting; transformers {modes['transformers']['tokens_per_second']:.1f}): "
          f"speed-up {sps / aps:.2f}x")
    return {"speculative": sps, "autoregressive": aps,
            "identical": r["speculative_equals_autoregressive"] == r["prompts"]}


def served(manifest, cfg, max_new_tokens: int, expected: list[int]) -> bool:
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    from .local_triton import LocalTriton
    start = time.perf_counter()
    with LocalTriton(manifest.artifact("triton")) as server:
        print(f"\nTriton {server.grpc_url} ready in {time.perf_counter() - start:.1f}s; streaming one request:")
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([PROMPTS[0].encode()], dtype=np.object_))
        limit = grpcclient.InferInput("max_tokens", [1], "INT32")
        limit.set_data_from_numpy(np.array([max_new_tokens], dtype=np.int32))
        client.async_stream_infer(cfg.serving.model_name, [text, limit], enable_empty_final_response=True)
        tokens = []
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise RuntimeError(f"Triton: {error}")
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            tokens += result.as_numpy("token_ids").tolist()
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
        client.stop_stream()
    same = tokens == expected
    print(f"\n[{len(tokens)} streamed tokens, identical to the offline run: {same}]")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.build.demo", description=__doc__.splitlines()[0])
    p.add_argument("--output", default=None, help="build output folder (default: artifacts/<config name>)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-serve", action="store_true", help="skip the Triton request")
    args = p.parse_args(argv)
    from ..config import ConfigError
    from . import build, load_config
    try:
        cfg = load_config(None)
        manifest = build(cfg, args.output)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    identical, first, _ = offline(manifest, cfg, args.max_new_tokens)
    ok = identical
    if not args.no_serve:
        import importlib.util
        if importlib.util.find_spec("pytriton") and importlib.util.find_spec("tritonclient"):
            ok &= served(manifest, cfg, args.max_new_tokens, first)
        else:
            print("\n(nvidia-pytriton / tritonclient not installed: no Triton request)")
    out = Path(manifest.output)
    print(f"\nartifacts: {out}\n  manifest  {out / 'manifest.json'}\n  graphs    {out / 'export'}\n"
          f"  parity    {out / 'parity'} (report.json, Polygraphy bundles)\n  triton    {out / 'triton'} "
          f"(serve: python -m eagle_trt.build.local_triton --repository {out / 'triton'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
