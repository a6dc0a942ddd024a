"""ONNX exporters, the TensorRT op check, and the ONNX Runtime backend on tiny models.

The graphs are traced at one size (3 new tokens after 5 past) and run here at other sizes, so a
size that was baked in as a constant shows up as a failure."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from eagle_trt.build.engines import input_dims
from eagle_trt.checkpoints import random_drafter
from eagle_trt.api import load_pipeline, ort_cuda_available
from eagle_trt.config import ConfigError, TreeShape
from eagle_trt.export import (UnsupportedGraph, check_graph, export_drafter_step,
                              export_drafter_tree, export_target)
from eagle_trt.export.iteration import compose_iteration
from eagle_trt.export.opcheck import find_problems
from eagle_trt.graph_names import kv_heads_and_dim
from eagle_trt.parity import check_case, drafter_cases, iteration_case, target_case
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget
from eagle_trt.runtime.ort_binding import Binding, bind_past
from eagle_trt.runtime.sessions import SPIN_MODES, make_session
from eagle_trt.tree import DraftTree

from conftest import PlantedDrafter, capturing, two_call

SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)


@pytest.fixture(scope="module", params=["eagle3", "eagle3.1"])
def exported(request, tiny_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"graphs_{request.param}")
    drafter = random_drafter(tiny_target, request.param, seed=4, draft_vocab_size=48)
    target = capturing(tiny_target, drafter)
    graphs = {"target": export_target(target.model, folder / "target.onnx").path,
              "drafter_tree": export_drafter_tree(drafter, SHAPE, folder / "drafter_tree.onnx").path,
              "drafter_step_first": export_drafter_step(drafter, folder / "step_first.onnx", True).path,
              "drafter_step": export_drafter_step(drafter, folder / "step.onnx", False).path}
    return target, drafter, graphs


def test_graphs_match_pytorch_through_polygraphy(exported, tmp_path):
    target, drafter, graphs = exported
    prompts = [list(range(3, 40)), list(range(50, 61))]
    cases = [target_case(target.model, graphs["target"], "float32", prompts, SHAPE, drafter)]
    real = [(c["captured"], p[1:] + [int(c["logits"][0, -1].argmax())]) for c, p in zip(cases[0].reference[1::2], prompts)]
    cases += drafter_cases(drafter, SHAPE, graphs, "float32", real)
    iteration = compose_iteration(graphs["target"], graphs["drafter_tree"], tmp_path / "iteration.onnx").path
    cases.append(iteration_case(target.model, drafter, SHAPE, iteration, "float32",
                                [(c, ids) for c, (_, ids) in zip(cases[0].reference[1::2], real)]))
    assert len(cases[-1].feeds) == 4            # two real, a batch of two: whole trees and each tree's best node
    # the batch's target past taken from the target case's random feed (as the build's parity
    # stage does, not running the target over the prefix again): the same feeds and references
    given = iteration_case(target.model, drafter, SHAPE, iteration, "float32", [], prefix_feed=cases[0].feeds[0])
    assert all(np.array_equal(a[k], b[k]) for x, y in ((cases[-1].feeds[2:], given.feeds),
                                                      (cases[-1].reference[2:], given.reference))
               for a, b in zip(x, y) for k in a)
    for case in cases:
        report = check_case(case, tmp_path / "bundles")
        assert report.passed, [o for o in report.outputs if not o.passed]
        for o in report.outputs:
            if o.exact:
                assert o.max_abs == 0.0
            elif "logits" in o.output:
                assert o.max_abs <= 1e-4
    # Parity bundles in Polygraphy's format: inputs and reference outputs load back.
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json
    feeds = load_json(str(tmp_path / "bundles" / "target.inputs.json"))
    assert set(feeds[0]) >= {"input_ids", "attention_mask", "logits_index", "past_key_0"}
    ref = RunResults.load(str(tmp_path / "bundles" / "drafter_tree.reference.json"))
    assert "tree_tokens" in list(ref.values())[0][0]
    ref = RunResults.load(str(tmp_path / "bundles" / "iteration.reference.json"))
    assert {"drafter.tree_tokens", "input_ids", "accept_tokens", "new_key_0"} <= set(list(ref.values())[0][0])


def test_parity_check_catches_a_wrong_graph(exported, tmp_path):
    """The comparison can fail: a graph exported from different weights is flagged."""
    target, drafter, graphs = exported
    other = random_drafter(target, drafter.cfg.variant, seed=99, draft_vocab_size=48)
    export_drafter_step(other, tmp_path / "wrong.onnx", True)
    case = [c for c in drafter_cases(drafter, SHAPE, {"drafter_step_first": tmp_path / "wrong.onnx"}, "float32", [])][0]
    assert not check_case(case).passed
    # an iteration graph composed with another drafter's tree graph
    export_drafter_tree(other, SHAPE, tmp_path / "wrong_tree.onnx")
    wrong = compose_iteration(graphs["target"], tmp_path / "wrong_tree.onnx", tmp_path / "iteration.onnx").path
    report = check_case(iteration_case(target.model, drafter, SHAPE, wrong, "float32", []))
    assert not report.passed and not next(o for o in report.outputs if o.output == "drafter.tree_scores").passed


def test_parity_catches_a_wrong_acceptance_exported_into_the_graph(exported, tmp_path, monkeypatch):
    """A fault planted in the acceptance code the target graph is exported from (one node too
    many accepted): parity's reference walks the trees itself (a reference computed by the same
    code, as it was, would agree with the graph), so accept_length fails and nothing else does."""
    import eagle_trt.export.graphs as graphs
    from eagle_trt.verify import accept_greedy_batch
    target, drafter, _ = exported

    def one_too_many(best, ids, mask):
        path, length, tokens = accept_greedy_batch(best, ids, mask)
        return path, torch.clamp(length + 1, max=ids.shape[1]), tokens
    monkeypatch.setattr(graphs, "accept_greedy_batch", one_too_many)
    wrong = export_target(target.model, tmp_path / "wrong_accept.onnx").path
    monkeypatch.undo()
    report = check_case(target_case(target.model, wrong, "float32", [list(range(3, 40))], SHAPE, drafter))
    failed = {o.output for o in report.outputs if not o.passed}
    assert failed == {"accept_length"}, failed     # the right graph passes: test_graphs_match_pytorch_through_polygraphy


@pytest.mark.parametrize("acceptance", ["host", "graph"])
def test_onnxruntime_backends_decode_what_the_torch_reference_decodes(exported, acceptance):
    """Greedy acceptance on the host (torch) or inside the target graph: the same tokens."""
    target, drafter, graphs = exported
    ort_target = OrtTarget(graphs["target"], target.config.max_position_embeddings)
    assert ort_target.graph_accepts
    ort_target.graph_accepts = acceptance == "graph"
    ort_drafter = OrtDrafter(graphs["drafter_tree"], SHAPE)
    for seed in range(4):
        prompt = torch.randint(3, target.config.vocab_size, (9 + 11 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        ref = two_call(TorchTarget(target.model)).generate(prompt, 40)
        torch_tree = two_call(TorchTarget(target.model), TorchDrafter(drafter, SHAPE)).generate(prompt, 40)
        planted = PlantedDrafter(ort_drafter, len(prompt), ref.tokens, seed=seed)
        ort = two_call(ort_target, planted).generate(prompt, 40)
        assert ort.tokens == ref.tokens == torch_tree.tokens
        assert max(ort.accept_lengths) >= 3     # the planted paths were accepted: compaction ran
        assert two_call(ort_target).generate(prompt, 40).tokens == ref.tokens
        unplanted = two_call(ort_target, ort_drafter).generate(prompt, 40)
        assert unplanted.tokens == ref.tokens and unplanted.accept_lengths == torch_tree.accept_lengths
    ort_target.reset()
    ort_target.add_sequence()
    out = ort_target.forward(torch.tensor([[3, 4]]), torch.arange(2)[None], torch.ones(1, 2, 2).tril().bool())
    assert (out.accepted is not None) == (acceptance == "graph")


def test_session_spin_modes_decode_alike_and_a_wrong_one_is_refused(exported):
    """Spinning is a scheduling setting: every mode gives the same tokens; a typo is an error."""
    target, _, graphs = exported
    prompt = list(range(3, 20))
    runs = [two_call(OrtTarget(graphs["target"], target.config.max_position_embeddings, 1, spin=mode)).generate(
        prompt, 12).tokens for mode in SPIN_MODES]
    assert runs[0] == runs[1] == runs[2]
    with pytest.raises(ValueError, match="spin='sometimes'.*in-call"):
        make_session(graphs["target"], spin="sometimes")


def test_graphs_declare_head_major_kv_and_older_layouts_are_refused(exported):
    """Format 7 graphs take and return KV as [B, Hkv, rows, D]; a graph with the rows before the
    heads (format <= 6) is refused by name instead of being misread."""
    target, _, graphs = exported
    cfg = target.model.cfg
    dims = input_dims(graphs["target"])
    assert dims["past_key_0"] == ["batch", cfg.num_key_value_heads, "past_tokens", cfg.head_dim]
    assert kv_heads_and_dim(dims["past_key_0"], "t.onnx") == (cfg.num_key_value_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="old.onnx: KV input shape .*older eagle_trt.*re-export"):
        kv_heads_and_dim(["batch", "past_tokens", cfg.num_key_value_heads, cfg.head_dim], "old.onnx")


def test_target_graph_accepts_greedily_like_the_tree_walk(exported):
    """The target graph's accept_* outputs on ONNX Runtime, at sizes other than the traced ones:
    a batch of random trees whose tokens were planted to match the graph's own argmax at their
    parent half of the time (so paths go deep and siblings share tokens), padding rows after the
    tree that logits_index leaves out, and a prefill-style call that asks for the last row only.
    Each sequence's path, length and tokens equal the tree walk (verify.accept_greedy) on the
    logits the same call returned."""
    from test_verify import random_tree
    from eagle_trt.verify import accept_greedy
    target, _, graphs = exported
    cfg = target.model.cfg
    session = make_session(graphs["target"], threads=1)
    gen = torch.Generator().manual_seed(3)
    B, n, pad = 4, 9, 2
    trees = [random_tree(n, cfg.vocab_size, gen) for _ in range(B)]
    T = n + 1 + pad
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=gen)
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b, t in enumerate(trees):
        mask[b, : n + 1, : n + 1] = t.mask
        mask[b, n + 1:, n + 1:] = torch.eye(pad, dtype=torch.bool)
    depths = mask.sum(-1) - 1
    P = 5           # a past the tree sees: its mask block is the last T columns
    past = torch.randn(B, cfg.num_key_value_heads, P, cfg.head_dim, generator=gen).numpy()
    full = torch.cat((torch.ones(B, T, P, dtype=torch.bool), mask), 2)

    def run(index):
        feed = {"input_ids": ids.numpy(), "position_ids": (P + depths).numpy(), "attention_mask": full.numpy(),
                "logits_index": np.asarray(index, np.int64)}
        for i in range(cfg.num_hidden_layers):
            feed[f"past_key_{i}"] = feed[f"past_value_{i}"] = past
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    tree_rows = list(range(n + 1))
    for node in range(1, n + 1):        # node's logits depend on its ancestors only, fixed before it
        best = run(tree_rows)["logits"].argmax(-1)
        for b, t in enumerate(trees):
            if torch.rand((), generator=gen) < 0.5:
                ids[b, node] = int(best[b, int(t.parents[node])])
    out = run(tree_rows)
    lengths = []
    for b, t in enumerate(trees):
        tree = DraftTree(ids[b, 1: n + 1], t.parents, t.mask, t.depths, t.scores)
        path, bonus = accept_greedy(tree, torch.from_numpy(out["logits"][b]))
        length = int(out["accept_length"][b])
        assert out["accept_path"][b, :length].tolist() == path and length == len(path)
        assert out["accept_tokens"][b, :length].tolist() == [int(ids[b, j]) for j in path[1:]] + [bonus]
        lengths.append(length)
    assert max(lengths) >= 3, lengths       # the planted matches were followed
    last = run([n])                         # one row: the greedy next token after it
    assert last["accept_length"].tolist() == [1] * B and last["accept_path"].tolist() == [[0]] * B
    assert last["accept_tokens"][:, 0].tolist() == last["logits"][:, 0].argmax(-1).tolist()


def _outputs(out):
    return out.logits, out.captured


def test_onnxruntime_target_keeps_its_bindings_and_buffers(exported):
    """Every binding of a call shape is made once and reused: the past / new-KV bindings and the
    preallocated input and output buffers (one logits tensor for every one-token step, its
    values right at each call); a re-laid-out cache keeps the entries and rebinds their past."""
    target, _, graphs = exported
    ort_target, ref = OrtTarget(graphs["target"], 512), TorchTarget(target.model)
    ids = torch.randint(3, target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(7))
    eye = lambda n: torch.eye(n, dtype=torch.bool)[None]           # noqa: E731 - one-row steps see themselves
    for backend in (ort_target, ref):
        backend.reset()
        backend.add_sequence()
        backend.forward(ids[:, :5], torch.arange(5)[None], torch.ones(1, 5, 5).tril().bool())
        backend.commit([list(range(5))])
    addresses = set()
    for t in range(5, 40):      # one token at a time: one shape while the cache stays at 64 rows
        step = (ids[:, t:t + 1], torch.tensor([[t]]), eye(1))
        logits, captured = _outputs(ort_target.forward(*step))
        want, want_captured = _outputs(ref.forward(*step))
        addresses.add((logits.data_ptr(), captured.data_ptr()))
        assert torch.allclose(logits, want, atol=1e-4) and torch.allclose(captured, want_captured, atol=1e-4)
        for backend in (ort_target, ref):
            backend.commit([[0]])
    assert len(addresses) == 1                                     # the same buffers, call after call
    assert len(ort_target.bindings.entries) == 2                    # the prefill's shape and the step's
    step_entry = ort_target.bindings.entries[(0, 1, 1, 1)]
    long = torch.randint(3, target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(8))
    for backend in (ort_target, ref):                               # grows the cache: a new layout
        backend.forward(long, 40 + torch.arange(40)[None], torch.ones(1, 40, 40).tril().bool())
        backend.commit([list(range(40))])
    assert ort_target.cache.capacity == 128
    assert [key[2] for key in ort_target.bindings.entries] == [5, 1]   # the 40-row call's binding was a one-off
    step = (long[:, :1], torch.tensor([[80]]), eye(1))
    logits, captured = _outputs(ort_target.forward(*step))
    want, want_captured = _outputs(ref.forward(*step))
    assert ort_target.bindings.entries[(0, 1, 1, 1)] is step_entry   # kept; its past bound to the new layout
    assert step_entry.layout[0][0] == 128 and (logits.data_ptr(), captured.data_ptr()) in addresses   # (width, id) per cache
    assert torch.allclose(logits, want, atol=1e-4) and torch.allclose(captured, want_captured, atol=1e-4)
    # A second sequence's prefill binds no past, not the 128 masked rows the first one grew.
    for backend in (ort_target, ref):
        backend.commit([[0]])
        slot = backend.add_sequence()
        assert slot == 1
    prefill = (ids[:, :7], torch.arange(7)[None], torch.ones(1, 7, 7).tril().bool(), range(1, 2))
    logits, captured = _outputs(ort_target.forward(*prefill, last_only=True))
    want, want_captured = _outputs(ref.forward(*prefill, last_only=True))
    assert ort_target.bindings.entries[(1, 2, 7, 1)].layout[0][0] == 0
    assert torch.allclose(logits, want, atol=1e-4) and torch.allclose(captured, want_captured, atol=1e-4)


def test_onnxruntime_binding_by_address_matches_the_public_api(exported, monkeypatch):
    """Binding binds through the IOBinding's pybind object; where onnxruntime has none it
    takes IOBinding's public methods: the same outputs, bit for bit, prefill and steps."""
    target, _, graphs = exported
    ids = torch.randint(3, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    outputs = []
    for attribute in ("_iobinding", "no_such_attribute"):
        monkeypatch.setattr(Binding, "raw_attribute", attribute)
        ort_target = OrtTarget(graphs["target"], 512)
        ort_target.reset()
        ort_target.add_sequence()
        out = [ort_target.forward(ids[:, :8], torch.arange(8)[None], torch.ones(1, 8, 8).tril().bool()).logits.clone()]
        ort_target.commit([list(range(8))])
        for t in range(8, 12):
            out.append(ort_target.forward(ids[:, t:t + 1], torch.tensor([[t]]), torch.ones(1, 1, 1).bool()).logits.clone())
            ort_target.commit([[0]])
        entry = next(iter(ort_target.bindings.entries.values()))
        assert (entry.binding.raw is None) == (attribute != "_iobinding")
        outputs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    with pytest.raises(ValueError, match="not contiguous"):
        bind_past(entry.binding, ort_target.cache, range(1), 3, 0, ("past_key_0", "past_value_0"))


def test_kv_caches_stay_on_the_host_on_the_cpu_provider_and_a_gpu_for_them_needs_the_cuda_one(exported):
    """kv_device: where the ONNX Runtime backends keep their KV caches. On the CPU provider the
    host; a GPU is refused unless the session runs on ONNX Runtime's CUDA provider, which reads
    them there; a place that is neither is refused by name. --backend onnxruntime --device cuda
    without onnxruntime-gpu says so before loading anything."""
    _, _, graphs = exported
    assert OrtTarget(graphs["target"], 512).kv_device == torch.device("cpu")
    with pytest.raises(ValueError, match="not ONNX Runtime's CUDAExecutionProvider"):
        OrtTarget(graphs["target"], 512, kv_device="cuda")
    with pytest.raises(ValueError, match="kv_device mps"):
        OrtDrafter(graphs["drafter_tree"], SHAPE, kv_device="mps")
    if ort_cuda_available() is not None:
        with pytest.raises(ConfigError, match="no CUDAExecutionProvider .install onnxruntime-gpu"):
            load_pipeline("no-such-target", None, SHAPE, backend="onnxruntime", device="cuda")


def test_drafter_graph_rejects_another_tree_shape(exported):
    _, _, graphs = exported
    with pytest.raises(ValueError, match="total_tokens 10, not 12"):
        OrtDrafter(graphs["drafter_tree"], TreeShape(4, 3, 12))


def test_exported_graphs_pass_the_tensorrt_op_check(exported):
    for path in exported[2].values():
        check_graph(path)
        ops = {n.op_type for n in onnx.load(str(path)).graph.node}
        assert not ops & {"Loop", "If", "SequenceConstruct", "Sort"}


def _graph(nodes, inputs, outputs, initializers=(), opset=19):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_op_check_rejects_unsupported_graphs():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    det = _graph([helper.make_node("Det", ["x"], ["y"], name="det0")], [x], [y])
    assert any("'det0' (Det) is not supported" in p for p in find_problems(det))
    with pytest.raises(UnsupportedGraph, match="Det"):
        check_graph(det)

    big_k = helper.make_tensor("k", TensorProto.INT64, [1], [5000])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, [4, 5000])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [4, 5000])
    topk = _graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk0")], [x], [v, i], [big_k])
    assert any("k = 5000" in p for p in find_problems(topk))

    d = helper.make_tensor_value_info("d", TensorProto.DOUBLE, [4, 4])
    cast = _graph([helper.make_node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE, name="cast0")], [x], [d])
    problems = find_problems(cast)
    assert any("casts to DOUBLE" in p for p in problems) and any("'d' has type DOUBLE" in p for p in problems)

    custom = _graph([helper.make_node("Foo", ["x"], ["y"], domain="acme", name="foo0")], [x], [y])
    custom.opset_import.append(helper.make_opsetid("acme", 1))
    assert any("custom domain 'acme'" in p for p in find_problems(custom))

    fine = _graph([helper.make_node("Relu", ["x"], ["r"])], [x], [helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 4])])
    assert find_problems(fine) == []
    old = _graph([helper.make_node("Relu", ["x"], ["r"])], [x],
                 [helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 4])], opset=7)
    assert any("opset 7" in p for p in find_problems(old))


def test_failed_export_leaves_nothing_behind(tiny_target, tmp_path, monkeypatch):
    import eagle_trt.export.onnx_export as mod

    def broken_check(path, label=None):
        raise UnsupportedGraph("injected failure")
    monkeypatch.setattr(mod, "check_graph", broken_check)
    with pytest.raises(UnsupportedGraph):
        export_target(tiny_target.model, tmp_path / "out" / "target.onnx")
    assert list((tmp_path / "out").iterdir()) == []


def test_fp16_target_graph_and_its_iteration_graph_match_pytorch(tiny_target, tiny_drafter, tmp_path):
    """An fp16 target graph: parity with the fp16 PyTorch model, and its own logits (not the
    fp16 model's) within fp16 rounding of the fp32 model's. Composed with a float32 drafter
    graph, the iteration graph matches PyTorch (fp16 target, fp32 drafter) on every output,
    the hand-off casting the fp16 states to the drafter's float32."""
    import copy
    from eagle_trt.parity import parity_session
    model = copy.deepcopy(tiny_target.model).half()
    path = export_target(model, tmp_path / "target16.onnx", dtype="float16").path
    prompt = list(range(3, 30))
    case = target_case(model, path, "float16", [prompt])
    report = check_case(case)
    assert report.passed, [(o.output, o.max_abs) for o in report.outputs if not o.passed]
    feed = case.feeds[1]                                              # the real prefill
    graph_logits = parity_session(path, "float16").run(["logits"], feed)[0].astype(np.float32)
    ref32 = target_case(tiny_target.model, path, "float32", [prompt]).reference[1]["logits"]
    error = np.abs(graph_logits - ref32).max()
    assert 0 < error < 0.1, f"fp16 graph vs fp32 model: max abs {error}"
    drafter = tiny_drafter
    tree_graph = export_drafter_tree(drafter, SHAPE, tmp_path / "drafter_tree.onnx").path
    iteration = compose_iteration(path, tree_graph, tmp_path / "iteration.onnx").path
    real = [(case.reference[1], prompt[1:] + [int(case.reference[1]["logits"][0, -1].argmax())])]
    report = check_case(iteration_case(model, drafter, SHAPE, iteration, "float16", real))
    assert report.passed, [(o.output, o.max_abs) for o in report.outputs if not o.passed]
    outputs = {o.output for o in report.outputs}
    assert {"drafter.tree_tokens", "logits", "accept_path", "next_captured", "next_input_ids"} <= outputs
    declared = {o.name: o.type.tensor_type.elem_type for o in onnx.load(str(iteration), load_external_data=False).graph.output}
    assert declared["next_captured"] == TensorProto.FLOAT and declared["captured"] == TensorProto.FLOAT16


def test_fp16_graph_checked_against_the_fp32_model_within_twice_the_fp16_models_own_error(tiny_target, tmp_path):
    """GraphCase.exact: a float16 graph's float outputs against the float32 model on the same feeds,
    within twice the float16 PyTorch model's distance from it; a wrong graph fails, and so does a
    float16 reference that is no rounding of the float32 one."""
    import copy

    from conftest import write_tiny_hf_target

    from eagle_trt.checkpoints import load_target
    from eagle_trt.parity import target_outputs
    model = copy.deepcopy(tiny_target.model).half()
    path = export_target(model, tmp_path / "target16.onnx", dtype="float16").path
    case = target_case(model, path, "float16", [list(range(3, 30))])
    fp32 = [{k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in f.items()} for f in case.feeds]
    case.exact = target_outputs(tiny_target.model, fp32)
    report = check_case(case)
    assert report.passed, [(o.output, o.max_abs, o.atol) for o in report.outputs if not o.passed]
    assert all(0 < o.fp16_noise for o in report.outputs if o.output in ("logits", "captured", "new_key_0"))
    other = load_target(write_tiny_hf_target(tmp_path / "other", seed=7)).model.half()   # the wrong weights
    wrong = export_target(other, tmp_path / "wrong.onnx", dtype="float16").path
    failed = {o.output for o in check_case(dataclasses.replace(case, graph=wrong)).outputs if not o.passed}
    assert {"logits", "captured"} <= failed
    noisy = [dict(r, logits=r["logits"] * 2) for r in case.reference]
    failed = {o.output for o in check_case(dataclasses.replace(case, reference=noisy)).outputs if not o.passed}
    assert failed == {"logits"}


def test_export_pipeline_reexports_a_drafter_retrained_in_place(tiny_target, tiny_drafter, tmp_path):
    """Graphs are reused while their key matches; a drafter with new weights under the same
    source name (retrained into the same folder) gets a new drafter graph, the target's is kept."""
    from eagle_trt.api import Models
    from eagle_trt.export import export_pipeline
    first = tiny_drafter
    target = capturing(tiny_target, first)
    shape = TreeShape(depth=2, top_k=2, total_tokens=3)

    def export(drafter):
        paths = export_pipeline(Models(target, drafter, "drafters/mine", None), shape, tmp_path, log=None)
        return {name: p.stat().st_mtime_ns for name, p in paths.items()}
    before = export(first)
    assert export(first) == before                                     # nothing re-exported
    after = export(random_drafter(tiny_target, "eagle3.1", seed=5, draft_vocab_size=48))
    assert after["target"] == before["target"]
    assert after["drafter_tree"] != before["drafter_tree"]


def test_export_attaches_each_weight_once_into_one_named_data_file(tmp_path, monkeypatch):
    """Export traces placeholders and attaches the real weights tensor by tensor: with external
    data forced, one `<graph>.data` holds every weight once, named after the module's parameters
    (Linear weights transposed, `_t`), a tied lm_head reads the embedding table through a
    Transpose, and the graph computes what PyTorch does, in float32 and float16."""
    import onnxruntime as ort

    from conftest import write_tiny_hf_target
    from eagle_trt.checkpoints import load_target
    from eagle_trt.export.graph_files import MIN_EXTERNAL_TENSOR, graph_files
    from eagle_trt.models.target import causal_mask
    monkeypatch.setenv("EAGLE_TRT_EXTERNAL_DATA_BYTES", "0")
    target = load_target(write_tiny_hf_target(tmp_path / "tied", tie=True, layers=2))
    model = target.model
    assert model.lm_head.weight is model.embed_tokens.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for dtype, tol in (("float32", 1e-4), ("float16", 2e-2)):
        path = tmp_path / dtype / "target.onnx"
        export_target(model, path, dtype)
        data = path.with_name("target.onnx.data")
        assert graph_files(path) == [path, data] and sorted(p.name for p in path.parent.iterdir()) == \
            ["target.onnx", "target.onnx.data"]
        graph = onnx.load(str(path), load_external_data=False)
        names = {i.name for i in graph.graph.initializer}
        assert "model.embed_tokens.weight" in names and "model.lm_head.weight_t" not in names
        assert "model.layers.0.self_attn.q_proj.weight_t" in names
        assert not any(n.startswith("onnx::") for n in names)
        itemsize = 4 if dtype == "float32" else 2
        sizes = [v.numel() * itemsize for v in model.parameters()]      # tied: counted once
        assert data.stat().st_size == sum(n for n in sizes if n >= MIN_EXTERNAL_TENSOR)   # small ones stay inline
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # the model is untouched
        ids = torch.tensor([[5, 17, 42, 3]])
        args = {"input_ids": ids.numpy(), "position_ids": torch.arange(4)[None].numpy(),
                "attention_mask": causal_mask(4, 0).numpy(), "logits_index": np.arange(4)}
        np_dtype = np.float32 if dtype == "float32" else np.float16
        for i in range(model.cfg.num_hidden_layers):
            for kind in ("key", "value"):
                args[f"past_{kind}_{i}"] = np.zeros((1, model.cfg.num_key_value_heads, 0, model.cfg.head_dim), np_dtype)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(["logits"], args)[0].astype(np.float32)
        empty = [torch.zeros(1, model.cfg.num_key_value_heads, 0, model.cfg.head_dim)] * model.cfg.num_hidden_layers
        with torch.no_grad():
            want = model(ids, torch.arange(4)[None], causal_mask(4, 0), empty, empty).logits
        np.testing.assert_allclose(got, want.numpy(), rtol=tol, atol=tol)


def test_a_float16_tree_may_choose_among_tied_scores_but_its_scores_must_match(tmp_path):
    """Parity of a float16 drafter-tree graph: where its tree's nodes differ from the reference's
    but every node's score matches to float16 tolerance (candidates tied at float16 rounding), the
    graph's own tree passes and the feed is reported; where the scores differ, it fails. A float32
    tree is held to the reference's nodes exactly."""
    import onnx
    from onnx import TensorProto, helper

    from eagle_trt.parity import TREE_CHOICES, GraphCase, check_case

    def tree_graph(dtype: str):
        elem = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
        outputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [4]) for n in TREE_CHOICES]
        outputs.append(helper.make_tensor_value_info("tree_scores", elem, [4]))
        inputs = [helper.make_tensor_value_info(f"in_{v.name}", v.type.tensor_type.elem_type, [4]) for v in outputs]
        path = tmp_path / f"tree-{dtype}.onnx"
        onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", [i.name], [i.name[3:]])
                                                       for i in inputs], "tree", inputs, outputs),
                                    opset_imports=[helper.make_opsetid("", 19)], ir_version=9), str(path))
        return path
    tree = {n: np.array([1, 2, 3, 4]) for n in TREE_CHOICES}
    swapped = dict(tree, tree_tokens=np.array([1, 3, 2, 4]))      # nodes 2 and 3 swapped

    def check(dtype: str, reference_scores):
        np_dtype = np.float16 if dtype == "float16" else np.float32
        feed = {f"in_{n}": v for n, v in tree.items()} | {"in_tree_scores": np.array([-1, -2, -3, -4], np_dtype)}
        ref = swapped | {"tree_scores": np.array(reference_scores, np_dtype)}
        return check_case(GraphCase("drafter_tree", tree_graph(dtype), dtype, [feed], ["real"], [ref]))
    tied = check("float16", [-1, -2.01, -3, -4])
    assert tied.passed and tied.tie_flips == ["real"]
    apart = check("float16", [-1, -2.5, -3, -4])
    assert not apart.passed and apart.tie_flips == []
    exact = check("float32", [-1, -2, -3, -4])
    assert not exact.passed and exact.tie_flips == []
    assert [o.output for o in exact.outputs if not o.passed] == ["tree_tokens"]
