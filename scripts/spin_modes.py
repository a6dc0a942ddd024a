"""How ONNX Runtime's worker-thread spinning changes decoding speed on this machine: plain
autoregressive and speculative decoding on the same exported graphs, once per `spin` setting of
make_session (runtime/onnxruntime_backend.py), MT-bench prompts, greedy.

    python scripts/spin_modes.py [--tree 3,2,4] [--prompts 3] [--max-new-tokens 64] [--threads 2]

Prints tokens/s and the mean target-graph call per mode and setting. The defaults follow it:
speculative decoding alternates two sessions and uses "in-call"; the autoregressive baseline
runs one session call after call and uses the faster of the two for it ("always")."""
from __future__ import annotations

import argparse
import sys

from eagle_trt.api import prepare_models, real_prompt_ids
from eagle_trt.bench import drafter_graph, parse_tree
from eagle_trt.checkpoints import cache_dir
from eagle_trt.export import export_pipeline
from eagle_trt.runtime.decoder import SpeculativeDecoder, generate_autoregressive
from eagle_trt.runtime.onnxruntime_backend import SPIN_MODES, OrtDrafter, OrtTarget
from eagle_trt.runtime.timing import decoding_threads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default="3,2,4", help="depth,top_k,total_tokens")
    p.add_argument("--drafter-weights", default="int8", choices=("float32", "int8"))
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads per session")
    args = p.parse_args(argv)
    shape = parse_tree(args.tree)
    models = prepare_models(args.target, args.drafter, log=sys.stderr)
    folder = cache_dir() / "onnx" / models.target.folder.name
    target_graph = export_pipeline(models, shape, folder, log=sys.stderr, only=("target",))["target"]
    tree_graph = drafter_graph(models, shape, folder, args.drafter_weights)
    prompts = real_prompt_ids(models, args.prompts + 1)
    eos, vocab, context = models.eos_ids, models.target.config.vocab_size, models.target.config.max_position_embeddings
    print(f"{'spin':<9}{'mode':<13}{'tok/s':>7}{'target call ms':>16}")
    for spin in SPIN_MODES:
        target = OrtTarget(target_graph, context, args.threads, spin=spin)
        drafter = OrtDrafter(tree_graph, shape, args.threads, spin=spin)
        decoder = SpeculativeDecoder(target, drafter, eos, vocab)
        runs = {"autoregressive": lambda ids: generate_autoregressive(target, ids, args.max_new_tokens, eos),
                "speculative": lambda ids: decoder.generate(ids, args.max_new_tokens)}
        with decoding_threads():
            decoder.generate(prompts[0], 8)                         # warm-up, not measured
            generate_autoregressive(target, prompts[0], 8, eos)
            for mode, run in runs.items():
                tokens = seconds = 0.0
                graph0, calls0 = target.graph_seconds, target.graph_calls
                for ids in prompts[1:]:
                    result = run(ids)
                    tokens, seconds = tokens + len(result.tokens), seconds + result.seconds
                call_ms = 1e3 * (target.graph_seconds - graph0) / (target.graph_calls - calls0)
                print(f"{spin:<9}{mode:<13}{tokens / seconds:>7.1f}{call_ms:>16.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
