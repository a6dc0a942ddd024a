"""--device on every CLI that runs PyTorch models, the runtime keeping tensors on the model's
device, and training with bf16 autocast. The suite runs on CPU machines: the CUDA tests run
where PyTorch sees a GPU and are skipped, with the reason, everywhere else."""
from __future__ import annotations

import pytest
import torch

from eagle_trt.api import SHIPPED_DRAFTERS
from eagle_trt.checkpoints import load_target, random_drafter
from eagle_trt.config import ConfigError, TreeShape
from eagle_trt.devices import resolve_device, resolve_dtype
from eagle_trt.runtime.backend import TorchDrafter, TorchTarget

from conftest import share, two_call, write_tiny_hf_target

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="PyTorch sees no CUDA device on this machine")
no_cuda = pytest.mark.skipif(CUDA, reason="checks the error on machines without a CUDA device")
SHAPE = TreeShape(depth=4, top_k=3, total_tokens=10)


def test_auto_device_and_dtype_follow_the_machine():
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if CUDA else "cpu")
    assert resolve_dtype(None, dev) == ("bfloat16" if CUDA else "float32")
    assert resolve_dtype("float16", dev) == "float16"
    with pytest.raises(ConfigError, match="device must be one of"):
        resolve_device("tpu")


@no_cuda
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="PyTorch sees no CUDA device"):
        resolve_device("cuda")


CLIS = {
    "generate": ("eagle_trt.generate", ["--prompt", "hi"]),
    "evaluate": ("eagle_trt.evaluate", ["--drafter", f"d={SHIPPED_DRAFTERS / 'smollm2-eagle3.1'}"]),
    "diagnose": ("eagle_trt.diagnose", ["--drafter", f"d={SHIPPED_DRAFTERS / 'smollm2-eagle3.1'}", "--out", "{tmp}"]),
    "bench": ("eagle_trt.bench", ["--out", "{tmp}"]),
    "train": ("eagle_trt.train.__main__", ["--target", "smollm2", "--out", "{tmp}"]),
    "regenerate": ("eagle_trt.train.regenerate", ["--out", "{tmp}/r.json"]),
}


@no_cuda
@pytest.mark.parametrize("cli", list(CLIS))
def test_every_cli_refuses_cuda_without_a_gpu_in_one_line(cli, tmp_path, capsys):
    import importlib
    module, args = CLIS[cli]
    main = importlib.import_module(module).main
    code = main(["--device", "cuda"] + [a.replace("{tmp}", str(tmp_path / "out")) for a in args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "PyTorch sees no CUDA device" in err, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    target = load_target(write_tiny_hf_target(tmp_path_factory.mktemp("dev"), family="qwen3", extra=dict(head_dim=16),
                                              layers=4, std=0.25, vocab=128))
    drafter = random_drafter(target, "eagle3.1", seed=1, draft_vocab_size=64)
    target.model.set_capture(drafter.cfg.capture_for(target.config))
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 33)]
    share(request, target, "tiny target")
    share(request, drafter, "tiny drafter")
    return target, drafter, prompts


@needs_cuda
def test_cuda_speculative_greedy_equals_cuda_autoregressive_and_the_cpu(tiny):
    """On CUDA in float32 the two-call loop over the PyTorch reference backends is token-identical
    to plain decoding on CUDA and to the CPU run; every tensor of the loop stays on the GPU (the
    models are moved, not copied)."""
    import copy
    target, drafter, prompts = tiny
    cpu = two_call(TorchTarget(target.model), TorchDrafter(drafter, SHAPE))
    model, d = copy.deepcopy(target.model).cuda(), copy.deepcopy(drafter).cuda()
    d.embed_tokens.weight = model.embed_tokens.weight
    gpu = two_call(TorchTarget(model), TorchDrafter(d, SHAPE))
    for ids in prompts:
        ref = two_call(TorchTarget(model)).generate(ids, 40).tokens
        assert gpu.generate(ids, 40).tokens == ref == cpu.generate(ids, 40).tokens


@needs_cuda
def test_answer_batch_on_cuda_equals_the_cpu(tiny):
    import copy

    from eagle_trt.train.regenerate import answer_batch
    target, _, prompts = tiny
    gpu = copy.deepcopy(target.model).cuda()
    assert answer_batch(gpu, prompts, 24, set()) == answer_batch(target.model, prompts, 24, set())


def _train_steps(tiny, autocast: str, device: str, steps: int = 12) -> list[dict]:
    from eagle_trt.train.ttt import TrainConfig, new_drafter, train
    from eagle_trt.train.vocab import build_draft_vocab, count_tokens
    target, _, prompts = tiny
    store = _store(target, prompts)
    counts = count_tokens([store.get(i)["ids"] for i in range(len(store))],
                          [store.get(i)["mask"] for i in range(len(store))], target.config.vocab_size)
    vocab = build_draft_vocab(counts, 64)
    m = target.model
    drafter = new_drafter(target.config, "eagle3.1", vocab, m.capture, m.embed_tokens.weight.detach(),
                          m.lm_head.weight.detach()[vocab.used].clone(), m.norm.weight.detach()).to(device)
    cfg = TrainConfig(steps=steps, batch_size=2, lr=3e-3, warmup_steps=2, autocast=autocast, log_every=100,
                      save_every=100, ttt_steps=5)
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        return train(drafter, store, m.lm_head.weight.detach()[vocab.used].clone(), cfg, out, log=lambda _: None).log


class _ListStore:
    def __init__(self, items):
        self.items, self.folder = items, "<memory>"

    def __len__(self):
        return len(self.items)

    def get(self, i, names=None):
        return self.items[i]

    @property
    def tokens(self):
        return sum(int(it["ids"].shape[0]) for it in self.items)


def _store(target, prompts):
    from eagle_trt.train.features import target_features
    items = []
    for ids in prompts * 2:
        f = target_features(target.model, ids)
        f["mask"] = torch.ones(len(ids), dtype=torch.uint8)
        items.append(f)
    return _ListStore(items)


@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_training_logs_five_ttt_steps_and_learns_on_cpu(tiny, autocast):
    log = _train_steps(tiny, autocast, "cpu")
    assert all(len(e["step_loss"]) == 5 and len(e["acc"]) == 5 for e in log)
    seen = [e["tokens_seen"] for e in log]
    assert seen[0] > 0 and all(b > a for a, b in zip(seen, seen[1:]))   # cumulative tokens, for the train log
    assert log[-1]["loss"] < log[0]["loss"], [e["loss"] for e in log]


@needs_cuda
def test_training_on_cuda_with_bf16_autocast_learns(tiny):
    log = _train_steps(tiny, "bf16", "cuda")
    assert log[-1]["loss"] < log[0]["loss"]


@needs_cuda
def test_build_calibrates_and_checks_parity_on_cuda(tmp_path):
    """`device: cuda` in a build config: calibration, the fake-quant reference and parity's
    PyTorch references run on the GPU, and the FP8 build's parity stage passes."""
    import json

    from eagle_trt.build import build, config_from_dict
    from test_build_support import tiny_config, write_tiny_target
    data = tiny_config(write_tiny_target(tmp_path / "target"), precision={"target": {"format": "fp8", "base": "fp32"}})
    m = build(config_from_dict(dict(data, device="cuda"), "tiny.yaml"), tmp_path / "out", log=None)
    assert m.data["status"] == "ok"
    report = json.loads((tmp_path / "out" / "parity" / "report.json").read_text())
    assert report["passed"] and report["quantized"]["target"]["passed"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_training_with_online_features_resumes_on_its_device(tiny, device, tmp_path):
    """What the first GPU leg (scripts/gpu_train.sh) runs: online features, one padded target
    forward per batch on the device, and a run stopped and resumed (its saved state loads on the
    CPU) follows the uninterrupted run's losses."""
    import copy

    from eagle_trt.train.data import Sample
    from eagle_trt.train.features import OnlineFeatures
    from eagle_trt.train.ttt import TrainConfig, new_drafter, train
    from eagle_trt.train.vocab import build_draft_vocab, count_tokens
    target, _, prompts = tiny
    target = copy.deepcopy(target)
    target.model.to(device)
    samples = [Sample(f"s{i}", ids, [0] * 4 + [1] * (len(ids) - 4)) for i, ids in enumerate(prompts * 3)]
    store = OnlineFeatures(target, samples, target.model.capture)
    counts = count_tokens([torch.tensor(s.ids) for s in samples], [torch.tensor(s.loss_mask) for s in samples],
                          target.config.vocab_size)
    vocab = build_draft_vocab(counts, 64)
    m = target.model
    head = m.lm_head.weight.detach()[vocab.used].clone()
    cfg = TrainConfig(steps=6, batch_size=3, lr=3e-3, warmup_steps=2, log_every=100, save_every=100, ttt_steps=3)

    def run(out, **kw):
        torch.manual_seed(0)
        drafter = new_drafter(target.config, "eagle3.1", vocab, m.capture, m.embed_tokens.weight.detach().cpu(),
                              head.cpu(), m.norm.weight.detach().cpu()).to(device)
        return train(drafter, store, head, cfg, out, log=lambda _: None, **kw).log

    whole = run(tmp_path / "a")
    run(tmp_path / "b", stop_at=3)
    resumed = run(tmp_path / "b", resume=True)
    assert [e["step"] for e in resumed] == list(range(1, 7))
    assert all("wall_s" in e for e in resumed)
    assert [e["loss"] for e in resumed] == pytest.approx([e["loss"] for e in whole], rel=1e-4)
