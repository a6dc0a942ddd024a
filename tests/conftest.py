"""Shared fixtures: tiny random Llama targets written as real HF checkpoints, the real
SmolLM2-135M-Instruct target, real MT-bench prompts, and drafters that accept often."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from eagle_trt.checkpoints import LoadedTarget, load_target, random_drafter
from eagle_trt.config import CaptureLayers, DrafterConfig, TreeShape
from eagle_trt.data import mtbench_prompts
from eagle_trt.models.drafter import EagleDrafter

# One PyTorch thread per test process: `make test` runs two pytest-xdist workers, one per core.
# `_shared_fixtures_unchanged` sets it back after each test (a CLI run in-process sets its --threads).
torch.set_num_threads(1)


# ----------------------------------------------------------------------------- shared state
# Session- and module-wide fixtures are shared by every test that asks for them, in whatever
# order the tests run (make test's, a reversed one, a worker stealing another's tail). No test
# changes one: a test that needs a target to capture other layers takes its own model
# (`capturing`), and `_shared_fixtures_unchanged` fails any test that leaves a shared fixture
# other than it was made (its capture, mode, weights, dtype or device, its config; a list's
# items; a folder's files), naming the test and the fixture, and puts the capture back so that
# the next test starts from the shared state.

def capturing(target: LoadedTarget, capture: CaptureLayers | EagleDrafter) -> LoadedTarget:
    """`target` with a model of its own that captures `capture` (or the layers `drafter` reads):
    a shallow copy of the model, so the weights are the shared model's own tensors (nothing is
    copied) and the shared target keeps its capture. For reading only: `.to(...)` or training
    on the copy would change the shared weights (take a copy.deepcopy for that)."""
    if isinstance(capture, EagleDrafter):
        capture = capture.cfg.capture_for(target.config)
    model = copy.copy(target.model)
    model.set_capture(capture)
    return dataclasses.replace(target, model=model)


def _module_state(m: torch.nn.Module):
    """What a test could change in a model: each tensor (its storage, dtype, device, shape and
    in-place version: an optimizer step or a .to() moves one), train / eval mode, hooks, config."""
    tensors = [*m.named_parameters(), *m.named_buffers()]
    return ([(n, t.data_ptr(), t.dtype, t.device, tuple(t.shape), t._version) for n, t in tensors],
            [(sub.training, len(sub._forward_hooks), len(sub._forward_pre_hooks)) for sub in m.modules()],
            copy.deepcopy(getattr(m, "cfg", None)))


def _target_state(target: LoadedTarget):
    m = target.model
    return m.capture, tuple(m.capture_streams), copy.deepcopy(target.config), _module_state(m)


def _restore_target(target: LoadedTarget, state) -> None:
    target.model.set_capture(state[0])


def _folder_state(folder: Path):
    return sorted((str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns)
                  for f in folder.rglob("*") if f.is_file())


# name -> (the shared object, its state now, its state when made, how to put it back)
_SHARED: dict[str, tuple[object, Callable, object, Callable | None]] = {}


def share(request, value, name: str | None = None):
    """Register `value`, handed out by fixture `request`, as shared: each test must leave it in
    the state it has now (a LoadedTarget's capture, config and model; a model's; a folder's
    files; a deep copy of anything else). `name` tells several values of one fixture apart.
    Returns value."""
    restore = None
    if isinstance(value, LoadedTarget):
        state, restore = _target_state, _restore_target
    elif isinstance(value, torch.nn.Module):
        state = _module_state
    elif isinstance(value, Path):
        state = _folder_state
    else:
        state = copy.deepcopy
    name = name or request.fixturename + (f"[{request.param}]" if hasattr(request, "param") else "")
    _SHARED[name] = (value, state, state(value), restore)
    request.addfinalizer(lambda: _SHARED.pop(name, None))
    return value


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)        # a CLI run in-process sets its --threads
    changed = []
    for name, (value, state, before, restore) in list(_SHARED.items()):
        now = state(value)
        if now != before:
            what = sorted(set(map(str, now)) ^ set(map(str, before))) if isinstance(now, list) else []
            changed.append(name + (f" ({'; '.join(what[:4])})" if what else ""))
            if restore is not None:
                restore(value, before)
            _SHARED[name] = (value, state, state(value), restore)     # only this test fails
    if changed:
        pytest.fail(f"{request.node.nodeid} changed the shared fixture(s) {', '.join(changed)}: a later test would "
                    f"see it changed (take a copy, e.g. conftest.capturing)", pytrace=False)


# Test order for `make test`'s two pytest-xdist workers. --dist worksteal hands the first half
# of the collection to one worker and the second half to the other, and a worker that runs out
# steals from the tail of the other's queue. So each half starts with its minutes-long modules
# (those reading the transformers reference together, so one worker makes it and no worker waits
# on its lock) and ends with quick ones: steals then move quick tests, the workers finish
# together, and a module's fixtures are set up once. Modules stay contiguous; the order does not
# change what any test checks.
FIRST_HALF_HEAVY = ("test_lossless_greedy.py", "test_onnx_smollm2.py", "test_static.py", "test_bench_rows.py",
                    "test_cli.py")
SECOND_HALF_HEAVY = ("test_triton_serving.py", "test_openai_serving.py", "test_quant_smollm2.py", "test_evaluate.py",
                     "test_build_stages.py", "test_sampling.py", "test_families.py")
# Many small tests on session fixtures only: last among the quick ones, where the halves meet.
QUICK_LAST = ("test_tree.py", "test_build_config.py", "test_verify.py")


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the tests in the reverse of make test's order (modules and the tests inside each): "
                          "a test that passes only after another one has run fails")


@pytest.hookimpl(trylast=True)      # after -m deselection: the halves are of the tests that run
def pytest_collection_modifyitems(session, config, items):
    def module(item) -> str:
        return item.path.name
    first = [i for name in FIRST_HALF_HEAVY for i in items if module(i) == name]
    second = [i for name in SECOND_HALF_HEAVY for i in items if module(i) == name]
    quick = [i for i in items if module(i) not in FIRST_HALF_HEAVY + SECOND_HALF_HEAVY + QUICK_LAST]
    quick += [i for name in QUICK_LAST for i in items if module(i) == name]
    k = max(0, len(items) // 2 - len(first))
    items[:] = first + quick[:k] + second + quick[k:]
    if config.getoption("--reverse-order"):
        items.reverse()


# Serving tests need tritonclient and the tritonserver bundled in nvidia-pytriton (and the OpenAI
# front end's starlette, uvicorn, openai, httpx), all in the requirements: where one is missing
# they fail, naming it, so a broken install cannot pass as a green run of skips. A machine set
# up without them on purpose says so with this variable.
SKIP_SERVING = "EAGLE_TRT_SKIP_SERVING"


def serving_missing() -> str | None:
    """What the serving tests need and this environment lacks (None: nothing)."""
    try:
        import tritonclient.grpc  # noqa: F401
    except ImportError as exc:
        return f"tritonclient is missing (import tritonclient.grpc: {exc})"
    for name in ("starlette", "uvicorn", "openai", "httpx"):    # the OpenAI front end and its tests
        try:
            __import__(name)
        except ImportError as exc:
            return f"{name} is missing (import {name}: {exc})"
    from eagle_trt.build.local_triton import TritonUnavailable, bundled_tritonserver
    try:
        bundled_tritonserver()
    except TritonUnavailable as exc:
        return str(exc).splitlines()[0]
    return None


def require_serving() -> None:
    """Fail (or, with EAGLE_TRT_SKIP_SERVING=1, skip) where serving_missing() names something."""
    problem = serving_missing()
    if problem is None:
        return
    if os.environ.get(SKIP_SERVING) == "1":
        pytest.skip(f"{problem} ({SKIP_SERVING}=1)", allow_module_level=True)
    pytest.fail(f"{problem}: the serving tests need it (make setup installs it; {SKIP_SERVING}=1 skips them "
                f"on purpose)", pytrace=False)


# The repository the serving tests (test_triton_serving.py, test_openai_serving.py) serve: built
# once per test process, served by a tritonserver each module starts.
SERVING_NEW_TOKENS = 16


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The default config with a small tree, one ORT thread, no parity (tested elsewhere):
    (config, manifest); the repository is manifest.artifact("triton")."""
    from eagle_trt.build import build, config_from_dict
    data = {"name": "serving", "tree": {"depth": 3, "top_k": 2, "total_tokens": 4},
            "engines": {"profiles": {"verify": {"opt_tokens": 5, "max_tokens": 5}}},
            "parity": {"enabled": False},
            "serving": {"threads": 1, "max_tokens": SERVING_NEW_TOKENS, "max_concurrent": 8}}
    cfg = config_from_dict(data, "serving test")
    return cfg, build(cfg, tmp_path_factory.mktemp("serving") / "out", log=None)


@pytest.fixture(scope="session")
def offline(built, mtbench):
    """Greedy tokens of the offline runtime on the very graphs the repository serves: the first
    16 MT-bench prompts with the chat template, SERVING_NEW_TOKENS each; `decoder` decodes more."""
    from transformers import AutoTokenizer

    from eagle_trt.api import encode_prompt
    from eagle_trt.build.triton import served_graphs
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.ort_engines import open_backends
    cfg, m = built
    resolved = json.loads(m.artifact("validate/resolved.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolved["target"]["folder"], local_files_only=True)
    graphs = served_graphs(m.artifact("triton"), "eagle_trt")
    assert graphs["drafter_tree"].name == "drafter_tree.int8.onnx"     # serving.drafter_weights: auto on fp32
    assert graphs["iteration"].name == "iteration.onnx"     # serving.iteration_graph: auto; the server's whole
    # trees go through it, this two-call decoder's do not: the streams must still be equal
    two_graphs = {g: graphs[g] for g in ("target", "drafter_tree")}
    engine = open_backends(two_graphs, cfg.tree.shape, resolved["target"]["max_context"], threads=1).engine()
    decoder = DecodingLoop(engine, resolved["target"]["eos_ids"], resolved["target"]["vocab_size"])
    prompts = mtbench[:16]
    ids = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    return {"prompts": prompts, "ids": ids, "tokens": [decoder.generate(i, SERVING_NEW_TOKENS).tokens for i in ids],
            "tokenizer": tokenizer, "decoder": decoder}


HF_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM")}


def write_tiny_hf_target(folder: Path, *, vocab: int = 96, hidden: int = 64, layers: int = 6, heads: int = 4,
                         kv_heads: int = 2, rope_scaling: dict | None = None, tie: bool = False,
                         seed: int = 0, max_pos: int = 512, family: str = "llama", extra: dict | None = None,
                         std: float = 0.15) -> Path:
    """A random checkpoint of `family` saved by transformers itself (config.json + model.safetensors).
    Weights are larger than the init default (std), so logits are far from uniform; biases and
    q/k norm weights are random too, so that each family feature changes the outputs."""
    import transformers
    config_cls, model_cls = (getattr(transformers, name) for name in HF_FAMILIES[family])
    torch.manual_seed(seed)
    rope = {"rope_scaling": rope_scaling} if family == "llama" else {}
    if family != "llama" and rope_scaling:
        rope = {"rope_parameters": dict(rope_scaling, rope_theta=10000.0)}
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                     rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     **({"rope_theta": 10000.0} if family == "llama" else {}), **rope, **(extra or {}))
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_target_dir(request, tmp_path_factory) -> Path:
    return share(request, write_tiny_hf_target(tmp_path_factory.mktemp("tiny_target")))


@pytest.fixture(scope="session")
def tiny_target(request, tiny_target_dir) -> LoadedTarget:
    return share(request, load_target(tiny_target_dir))


def random_prompts(vocab: int, lengths, seed: int = 7) -> list[list[int]]:
    """Prompts of random ids in [3, vocab) (0-2 are the tiny targets' special ids), one generator."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


# Mixed prompt lengths for batched decoding: one-token prompts, long and short ones side by side;
# and max_new_tokens for each, so that sequences leave a batch at different iterations.
PROMPT_LENGTHS = (5, 31, 12, 1, 47, 9, 20, 3, 16, 26)
LIMITS = (40, 25, 33, 40, 17, 40, 8, 29, 40, 36)
TINY_SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)       # the tiny graphs' tree


@pytest.fixture(scope="session")
def tiny_drafter(request, tiny_target) -> EagleDrafter:
    """A random EAGLE 3.1 drafter for the tiny target (48 draft ids), the one its ONNX tests export."""
    return share(request, random_drafter(tiny_target, "eagle3.1", seed=4, draft_vocab_size=48))


@pytest.fixture(scope="session")
def tiny_graphs(request, tiny_target, tiny_drafter, tmp_path_factory):
    """(target, drafter, graphs, prompts): the tiny target captured for `tiny_drafter`, the
    drafter, their target and drafter-tree graphs (TINY_SHAPE), and 10 prompts of PROMPT_LENGTHS:
    what the batching, binding and iteration-graph tests decode."""
    from eagle_trt.export import export_drafter_tree, export_target
    target = capturing(tiny_target, tiny_drafter)
    folder = tmp_path_factory.mktemp("tiny_graphs")
    graphs = {"target": export_target(target.model, folder / "target.onnx").path,
              "drafter_tree": export_drafter_tree(tiny_drafter, TINY_SHAPE, folder / "drafter_tree.onnx").path}
    prompts = random_prompts(tiny_target.config.vocab_size, PROMPT_LENGTHS)
    for name, value in (("target", target), ("folder", folder), ("prompts", prompts)):
        share(request, value, f"tiny_graphs {name}")
    return target, tiny_drafter, graphs, prompts


@pytest.fixture(scope="session")
def tiny_iteration_graph(tiny_graphs, tmp_path_factory) -> Path:
    """tiny_graphs' two graphs composed into one (export/iteration.py)."""
    from eagle_trt.export.iteration import compose_iteration
    _, _, graphs, _ = tiny_graphs
    return compose_iteration(graphs["target"], graphs["drafter_tree"],
                             tmp_path_factory.mktemp("tiny_iteration") / "iteration.onnx").path


def two_call(target, drafter=None, eos=(), vocab_size=None, **engine):
    """A decoding loop on the two-call engine over these backends (drafter None: plain decoding);
    engine: TwoCallEngine's cost_model / trim."""
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.two_call import TwoCallEngine
    return DecodingLoop(TwoCallEngine(target, drafter, **engine), eos, vocab_size)


def on_graph(iteration, eos=(), vocab_size=None, **engine):
    """A decoding loop on the iteration-graph engine over an OrtIteration (its two backends)."""
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.two_call import IterationEngine
    return DecodingLoop(IterationEngine(iteration, **engine), eos, vocab_size)


def static(model, drafter=None, shape=None, eos=(), vocab_size=None, **engine):
    """A decoding loop on the PyTorch engine (runtime/static.py) over these models."""
    from eagle_trt.runtime.loop import DecodingLoop
    from eagle_trt.runtime.static import StaticEngine
    return DecodingLoop(StaticEngine(model, drafter, shape, **engine), eos, vocab_size)


def tiny_backends(tiny_graphs, backend: str):
    """A fresh (target, drafter) backend pair over tiny_graphs: "torch" or "onnxruntime"."""
    from eagle_trt.runtime.backend import TorchDrafter, TorchTarget
    from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget
    target, drafter, graphs, _ = tiny_graphs
    if backend == "torch":
        return TorchTarget(target.model), TorchDrafter(drafter, TINY_SHAPE)
    return (OrtTarget(graphs["target"], target.config.max_position_embeddings),
            OrtDrafter(graphs["drafter_tree"], TINY_SHAPE))


@pytest.fixture(scope="session")
def smollm2(request) -> LoadedTarget:
    return share(request, load_target("smollm2"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer()


@pytest.fixture(scope="session")
def smollm2_onnx_dir(request, smollm2, smollm2_tokenizer) -> Path:
    """SmolLM2's target graph, captured at the EAGLE default layers (those of every drafter the
    tests use, the shipped ones included), and the greedy accept graph: exported once for every
    test that runs SmolLM2 on ONNX Runtime, in export_pipeline's layout. Read it in place, or
    give a CLI a copy (`onnx_dir_copy`), where export_pipeline finds them current. It lives in
    the cache, exported under a lock: the second test worker (and the next run) finds it
    current instead of exporting again. One folder per version of the exporting code: a
    checkout with other code sharing the cache (another branch on the same machine) exports
    into its own folder instead of replacing these graphs while a run reads them; folders no
    run has used for a week are removed."""
    import hashlib
    import time
    from eagle_trt.api import Models
    from eagle_trt.checkpoints import cache_dir, cache_lock
    from eagle_trt.codehash import code_digest
    from eagle_trt.config import TreeShape
    from eagle_trt.export import EXPORTER, GRAPH_FORMAT, export_pipeline
    drafter = random_drafter(smollm2, "eagle3.1", seed=1, draft_vocab_size=64)
    graphs = cache_dir() / "test-graphs"
    version = hashlib.sha256(f"{GRAPH_FORMAT} {code_digest(EXPORTER)}".encode()).hexdigest()[:16]
    folder = graphs / f"smollm2-{version}"
    with cache_lock(folder):
        export_pipeline(Models(capturing(smollm2, drafter), drafter, "random", smollm2_tokenizer), TreeShape(3, 2, 4),
                        folder, log=None, only=("target",))
        os.utime(folder)                        # used now
        for old in graphs.glob("smollm2*"):
            if old.is_dir() and old != folder and time.time() - old.stat().st_mtime > 7 * 86400:
                shutil.rmtree(old, ignore_errors=True)
    return share(request, folder)


def onnx_dir_copy(shared: Path, dst: Path) -> Path:
    """A folder of its own for a test that exports into it: the shared graphs hard-linked (an
    export replaces a file by rename, never writes into a linked one; copied where the cache is
    on another file system) and export.json copied."""
    dst.mkdir(parents=True)
    for f in shared.iterdir():
        if f.is_file() and not f.name.startswith("."):
            try:
                (shutil.copy2 if f.name == "export.json" else os.link)(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    return dst


@pytest.fixture(scope="session")
def mtbench(request) -> list[str]:
    return share(request, mtbench_prompts())


# Greedy losslessness is checked on this many real prompts and new tokens.
NUM_PROMPTS, NEW_TOKENS = 20, 64
SOLO_PROMPTS = 8      # of them decoded one at a time where a batched pass decodes them all


@pytest.fixture(scope="session")
def mtbench_ids(request, smollm2_tokenizer, mtbench) -> list[list[int]]:
    out = []
    for text in mtbench[:NUM_PROMPTS]:
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return share(request, out)


@pytest.fixture(scope="session")
def hf_greedy(request, smollm2, mtbench_ids) -> list[list[int]]:
    """transformers' own greedy continuations of the prompts. Computed once per cache (about 2
    minutes): both test workers need it, so the first computes it under a lock and the other
    reads the file, keyed by everything that decides the tokens (library versions, the
    checkpoint's files, the prompts, the length)."""
    import hashlib
    import transformers
    from transformers import LlamaForCausalLM
    from eagle_trt.checkpoints import cache_dir, cache_lock
    from eagle_trt.export import _files_stamp
    eos = list(smollm2.config.eos_token_ids)
    key = json.dumps([transformers.__version__, torch.__version__, _files_stamp(smollm2.folder), mtbench_ids,
                      NEW_TOKENS, eos])
    path = cache_dir() / "test-references" / f"hf-greedy-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    with cache_lock(path):
        if path.is_file():
            return share(request, json.loads(path.read_text()))
        hf = LlamaForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.float32).eval()
        refs = []
        with torch.no_grad():
            for ids in mtbench_ids:
                out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
                refs.append(out[0, len(ids):].tolist())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(refs))
        os.replace(tmp, path)
    return share(request, refs)


def oracle_drafter(target: LoadedTarget, variant: str, noise: float = 0.02, seed: int = 0,
                   draft_vocab_size: int | None = None) -> EagleDrafter:
    """A drafter built from the target's own last hidden state: fc copies the output of the
    last decoder layer (layer_output convention), attention and MLP are small noise, and
    norm / lm_head are the target's. Its drafts follow the target's distribution one position
    early (the state of token t predicts t + 1, the drafter is asked for t + 2), which on tiny
    models with small vocabularies still puts real target mass on drafted children (accept
    lengths ~1.5 in the sampling tests). Every flag of the variant stays active."""
    t = target.config
    L, H = t.num_hidden_layers, t.hidden_size
    is31 = variant == "eagle3.1"
    vd = draft_vocab_size or t.vocab_size
    cfg = DrafterConfig(hidden_size=H, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
                        draft_vocab_size=vd, target_hidden_size=H, rms_norm_eps=t.rms_norm_eps,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
                        max_position_embeddings=t.max_position_embeddings,
                        capture=CaptureLayers((1, L // 2 - 1, L - 1), "layer_output"),
                        fc_norm=is31, norm_output=is31)
    d = EagleDrafter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(noise * torch.randn(p.shape, generator=gen))
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm"):
                p.fill_(1.0)
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * H:] = torch.eye(H)
        d.norm.weight.copy_(target.model.norm.weight)
        if vd == t.vocab_size:
            d.lm_head.weight.copy_(target.model.lm_head.weight)
        else:   # the vd most frequent ids are unknown here: take the first vd ids
            d.lm_head.weight.copy_(target.model.lm_head.weight[:vd])
    d.embed_tokens.weight = target.model.embed_tokens.weight
    d.embed_shared = True
    return d.eval()


def seeded_cost_model(per_row: float, fixed: float, accepted: list[float]):
    """A CostModel past its warm-up whose timings are `fixed + per_row * rows` a target call
    (1 to 40 rows), with drafter timings and acceptance (`accepted[n]`: tokens a step with n
    nodes) given."""
    from eagle_trt.runtime.cost import CostModel
    m = CostModel(nodes=len(accepted) - 1, draft_rows_per_seq=6, warmup=1)
    for rows in range(1, 41):
        m.time_target(rows, fixed + per_row * rows)
    for batch in (1, 8):
        m.time_iteration(batch, 0, fixed + per_row * batch)
    m.time_draft(1, 1, 0.005)
    m.time_draft(8, 2, 0.008)
    m.gains = [0.0] + [b - a for a, b in zip(accepted, accepted[1:])]
    m.observed, m.full_trees = [1.0] * len(accepted), 1
    return m


def rel_l2(a, b) -> float:
    """|a - b| / |b| (L2 norms, in float32)."""
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return float((a - b).norm() / b.norm())


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


class PlantedDrafter:
    """Wraps a real drafter backend and overwrites the first root-to-leaf path of each tree
    with a known continuation (up to a random depth), so trees are accepted several tokens
    deep. The real EAGLE drafter still builds every tree (shape, siblings, masks, KV); only
    the tokens on one path are replaced. Used to exercise acceptance and KV compaction in
    losslessness tests, where the right answer comes from transformers, not from us.

    Batched like the backend it wraps: `expect(prompt_len, continuation)` queues what the next
    added sequence will decode, and the per-slot records follow the backend's slot moves."""

    def __init__(self, inner, prompt_len: int | None = None, continuation: list[int] | None = None, seed: int = 0):
        import random
        self.inner, self.shape = inner, inner.shape
        self.rng = random.Random(seed)
        self.queued: list[tuple[int, list[int]]] = []
        self.slots: list[tuple[int, list[int]]] = []
        if continuation is not None:
            self.expect(prompt_len, continuation)

    def expect(self, prompt_len: int, continuation: list[int]) -> None:
        self.queued.append((prompt_len, continuation))

    def reset(self, capacity: int = 64) -> None:
        self.inner.reset(capacity)
        self.slots = []

    def add_sequence(self, rows: int = 0) -> int:
        self.slots.append(self.queued.pop(0))
        return self.inner.add_sequence(rows)

    def remove_sequence(self, slot: int) -> None:
        self.inner.remove_sequence(slot)
        self.slots[slot] = self.slots[-1]
        self.slots.pop()

    def draft(self, captured, input_ids, new_lengths=None, slots=None):
        trees = self.inner.draft(captured, input_ids, new_lengths, slots)
        slots = slots if slots is not None else range(self.inner.batch)
        tokens = trees.tokens.clone()   # the drafter returns inference-mode tensors (and may reuse its tree)
        plant_depth = [self.rng.randint(0, self.shape.depth) for _ in slots]
        for i, slot in enumerate(slots):
            prompt_len, continuation = self.slots[slot]
            generated = self.inner.lengths[slot] - (prompt_len - 1)     # tokens committed after the prompt
            plant_path(tokens[i], trees.parents[i].tolist(), continuation[generated:], plant_depth[i], self.rng)
        return dataclasses.replace(trees, tokens=tokens)


def plant_path(tokens, parents: list[int], continuation: list[int], depth: int, rng) -> None:
    """Overwrite one root-to-leaf path of a tree (its node tokens `tokens`, the root left out,
    and `parents`) with `continuation`, up to `depth` nodes: each step to the best child or its
    first sibling, as `rng` picks (PlantedDrafter, test_static's PlantedStatic)."""
    node = 0
    for d in range(min(depth, len(continuation))):
        children = [c for c, p in enumerate(parents) if p == node]
        if not children:
            break
        node = rng.choice(children[:2])
        tokens[node - 1] = continuation[d]


def check_planted_greedy(target, drafter, prompts: list[list[int]], references: list[list[int]], eos,
                         batch: int = 0) -> None:
    """Greedy speculative decoding with `PlantedDrafter` around `drafter` must reproduce each
    reference (transformers' greedy output, or the graph's own) exactly; the drafts must really be accepted (vacuity guard), and every iteration
    is one drafter call plus one target call. batch > 0: then all prompts again through one
    continuously batched decoder with at most `batch` sequences at a time, and the one-at-a-time
    pass takes only the first SOLO_PROMPTS (the batched pass checks every prompt's tokens; a
    batch of 1 is the same code, so more solo prompts prove nothing new and cost minutes)."""
    from eagle_trt.runtime.loop import Request
    accepted = []
    solo = prompts[:SOLO_PROMPTS] if batch else prompts
    for i, (ids, ref) in enumerate(zip(solo, references)):
        planted = PlantedDrafter(drafter, len(ids), ref, seed=i)
        res = two_call(target, planted, eos).generate(ids, NEW_TOKENS)
        assert res.tokens == ref, f"prompt {i}: speculative output diverges from the reference greedy output"
        assert res.target_calls == 1 + res.drafter_calls
        accepted += res.accept_lengths
    if batch:   # the same prompts decoded together, joining and leaving a running batch of `batch`
        planted = PlantedDrafter(drafter, seed=len(prompts))
        for ids, ref in zip(prompts, references):
            planted.expect(len(ids), ref)
        # Mixed max_new_tokens: sequences leave at different iterations and others take their slots.
        limits = [NEW_TOKENS - 9 * (i % 3) for i in range(len(prompts))]
        results = two_call(target, planted, eos).generate_batch(
            [Request(ids, n) for ids, n in zip(prompts, limits)], max_batch=batch)
        for i, (res, ref, n) in enumerate(zip(results, references, limits)):
            assert res.tokens == ref[:n], f"prompt {i} in a batch of {batch}: output diverges from the reference"
        assert max(a for r in results for a in r.accept_lengths) >= 4
    assert sum(accepted) / len(accepted) > 2.0, "drafts were not accepted: the check would be vacuous"
    assert max(accepted) >= 4



def chain_feed(cfg, batch: int, tokens: int, past: int, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """A portable target graph's feed: random ids, `tokens` new rows in a causal chain after `past`
    random rows of KV per layer (what a verification of a chain sees)."""
    causal = np.concatenate([np.ones((tokens, past), bool), np.tril(np.ones((tokens, tokens), bool))], axis=1)
    feed = {"input_ids": gen.integers(3, cfg.vocab_size, (batch, tokens)),
            "position_ids": np.tile(np.arange(past, past + tokens), (batch, 1)),
            "attention_mask": np.broadcast_to(causal, (batch, tokens, past + tokens)).copy(),
            "logits_index": np.arange(tokens)}
    for i in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            feed[f"past_{kind}_{i}"] = gen.standard_normal((batch, cfg.num_key_value_heads, past, cfg.head_dim),
                                                           dtype=np.float32)
    return feed
