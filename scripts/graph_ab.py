"""Target graphs timed against each other on this machine: calls of each graph taking turns in one
process (a VM's speed drifts by tens of percent between minutes, so only interleaved calls compare),
one token count after another, a past of --context rows; with --floor also a graph of only the
first graph's weight MatMuls (what its other nodes add to). Prints the median and minimum ms a call.

    python scripts/graph_ab.py OLD/target.onnx NEW/target.onnx --floor --tokens 1,5 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
from eagle_trt.export.cpu_attention import fused_feeds  # noqa: E402
from eagle_trt.runtime.sessions import make_session  # noqa: E402


FLOOR = "weight MatMuls only"


def matmul_floor(graph: Path, folder: Path) -> Path:
    """A graph of `graph`'s weight MatMuls only, chained so that none can be skipped: the same
    weights read in the same order, nothing else."""
    model = onnx.load(str(graph))
    weights = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:      # a tied head: the embedding table transposed in the graph
        if node.op_type == "Transpose" and node.input[0] in weights:
            weights[node.output[0]] = numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(weights[node.input[0]]).T), node.output[0])
    hidden = next(numpy_helper.to_array(weights[n.input[1]]).shape[0] for n in model.graph.node
                  if n.op_type == "MatMul" and n.input[1] in weights)
    nodes, used, latest = [], [], {hidden: "x"}     # latest: the last output of each width
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            continue
        k, n = weights[node.input[1]].dims
        if k not in latest:
            continue
        out = f"{node.name}_out"
        nodes.append(helper.make_node("MatMul", [latest[k], node.input[1]], [out]))
        used.append(weights[node.input[1]])
        latest[n] = out
    graph_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", hidden])]
    graph_out = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes]
    floor = helper.make_model(helper.make_graph(nodes, "matmul_floor", graph_in, graph_out, used),
                              opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    path = folder / "floor.onnx"
    onnx.save(floor, str(path), save_as_external_data=True, location="floor.onnx.data")
    return path


def target_feeds(s: ort.InferenceSession, tokens: int, past: int) -> dict:
    gen = np.random.default_rng(0)
    feeds = {"input_ids": np.full((1, tokens), 1, np.int64),     # an id every vocabulary has
             "position_ids": np.arange(past, past + tokens)[None].astype(np.int64),
             "attention_mask": np.ones((1, tokens, past + tokens), bool), "logits_index": np.arange(tokens)}
    feeds["attention_mask"][0, :, past:] = np.tril(np.ones((tokens, tokens), bool))   # a chain, as verified
    for i in sorted(s.get_inputs(), key=lambda i: i.name):      # each past the same in every graph
        if i.name.startswith("past_"):
            shape = [1 if d == "batch" else past if d in ("past_tokens", "cache_rows") else d for d in i.shape]
            feeds[i.name] = gen.standard_normal(shape, dtype=np.float32)
    fused = any("cache_rows" in i.shape for i in s.get_inputs())     # export/cpu_attention.py's graph
    return fused_feeds(feeds) if fused else feeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graphs", type=Path, nargs="+", help="target graphs (eagle_trt's export)")
    p.add_argument("--floor", action="store_true", help="also time the first graph's weight MatMuls alone")
    p.add_argument("--tokens", default="1,5", help="new tokens a call, comma separated")
    p.add_argument("--context", type=int, default=200, help="rows of past")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30, help="turns per token count (5 calls a turn)")
    args = p.parse_args(argv)
    for g in args.graphs:
        if not g.is_file():
            print(f"error: {g}: no such graph", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        # the runtime's sessions: its optimization level and threads waiting as in a decoding call
        sessions = {str(g): make_session(g, args.threads) for g in args.graphs}
        if args.floor:
            sessions[FLOOR] = make_session(matmul_floor(args.graphs[0], Path(tmp)), args.threads)
        for tokens in (int(t) for t in args.tokens.split(",")):
            calls, first = {}, None
            for name, s in sessions.items():
                feeds = target_feeds(s, tokens, args.context) if name != FLOOR else \
                    {"x": np.random.default_rng(0).standard_normal((1, tokens, s.get_inputs()[0].shape[2]),
                                                                   dtype=np.float32)}
                calls[name] = (s, [s.get_outputs()[0].name], feeds)
                out = s.run(*calls[name][1:])[0]          # the warm-up call; then, on the same feeds,
                if name != FLOOR:                         # how far each graph lies from the first
                    first = out if first is None else first
                    print(f"{tokens} token(s): {name}: {calls[name][1][0]} max abs difference from the first "
                          f"graph's {float(np.abs(out - first).max()):.2e}")
            print_times(tokens, args.context, take_turns(calls, args.rounds, 5))
    return 0


def take_turns(calls: dict, rounds: int, repeats: int, alternate: bool = False) -> dict[str, list[float]]:
    """calls: name -> (session, output names, feeds). Each round runs each `repeats` times in turn
    (the order reversed every other round where `alternate`); ms a call per round and name."""
    times = {name: [] for name in calls}
    for r in range(rounds):
        order = list(calls.items())
        for name, (s, outputs, feeds) in (order[::-1] if alternate and r % 2 else order):
            start = time.perf_counter()
            for _ in range(repeats):
                s.run(outputs, feeds)
            times[name].append((time.perf_counter() - start) / repeats * 1e3)
    return times


def print_times(tokens: int, context: int, times: dict[str, list[float]]) -> None:
    for name, t in times.items():
        print(f"{tokens} token(s), past {context}: {name}: median {statistics.median(t):.2f} ms, min {min(t):.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
