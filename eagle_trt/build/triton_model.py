"""Triton Python-backend model (decoupled): EAGLE speculative decoding, streamed.

Copied by `python -m eagle_trt.build` into `<repository>/<model>/1/model.py`; runs only inside
Triton's Python backend (it imports triton_python_backend_utils) with eagle_trt installed in
the backend's Python environment. Settings come from `eagle.json` beside it.

Requests: text_input (BYTES [1]) or input_ids (INT64 [-1]), and optional max_tokens (INT32),
temperature, top_p (FP32), top_k (INT32), seed (INT64), stop_token_ids (INT64 [-1]: ids that end
the sequence as EOS does, sent as its last token). Each decoding iteration sends one response
with the newly final tokens: text_output (BYTES [1], the text they add), token_ids (INT64 [n]),
accepted (INT32 [1]: the tokens the iteration made for this sequence before any cut at
max_tokens, 0 for the prefill's first token) and finish_reason (BYTES [1]: "" while it runs,
"stop" or "length" with its last tokens); an empty response flagged final closes the stream.
Bad requests get one error response; the model keeps serving.

Engines: "onnxruntime" runs the target, drafter-tree and iteration graphs in-process
(runtime/ort_engines.py); "tensorrt" calls the `<model>_target` / `<model>_drafter`
tensorrt_plan models through BLS, keeping the KV caches here as torch tensors (on the GPU when
there is one); "torch" runs the checkpoints in the repository on the PyTorch engine at fixed
shapes, each iteration one CUDA graph on a GPU (runtime/static.py, serving.runtime: torch).

Continuous batching: `execute` validates each request and queues it; one scheduler thread runs
the decoding loop (runtime/loop.py), admitting queued requests into the running batch
(up to `max_concurrent`) between iterations, prefilling their prompts `prefill_chunk` tokens a
step between the running batch's iterations, streaming every sequence's tokens after each
iteration, and closing a stream the moment its sequence finishes or its client cancels."""
import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from eagle_trt.config import ConfigError, SamplingConfig, TreeShape
from eagle_trt.graph_names import ACCEPT_OUTPUTS
from eagle_trt.runtime.backend import DrafterBackend, TargetBackend, Verification, tree_from_outputs
from eagle_trt.runtime.cost import CostModel
from eagle_trt.runtime.kv_cache import CHUNK
from eagle_trt.runtime.loop import DecodingLoop, Request, check_request
from eagle_trt.runtime.two_call import TwoCallEngine

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
FINISH_REASONS = {"eos": b"stop", "max_new_tokens": b"length"}   # the loop's stop reasons, as OpenAI names them


class RequestError(ValueError):
    pass


class TextStream:
    """Incremental detokenization: the text each new batch of tokens adds, holding back an
    incomplete UTF-8 sequence until the token that completes it arrives."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids):
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece


# ----------------------------------------------------------------------------- BLS backends (TensorRT plans)

def _dl(name, tensor):
    if tensor.numel() == 0:   # an empty past (first call): a host array, no zero-size DLPack capsule
        return pb_utils.Tensor(name, np.zeros(tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")))
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(tensor.contiguous()))


def _out(response, name):
    return torch.utils.dlpack.from_dlpack(pb_utils.get_output_tensor_by_name(response, name).to_dlpack())


def _exec(model, inputs, outputs):
    response = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()
    if response.has_error():
        raise RuntimeError(f"{model}: {response.error().message()}")
    return response


class BlsTarget(TargetBackend):
    """TargetBackend over the target engine: a block of sequences' past goes in as past_*, the
    new rows come back and are staged in the batched cache here (commit compacts accepted rows)."""

    def __init__(self, s, device):
        self.model, self.layers = s["target_model"], s["target_kv"]["layers"]
        self.kv, self.dtype, self.device = s["target_kv"], TORCH_DTYPES[s["target_kv"]["dtype"]], device
        self.max_context = s["max_context"]

    def reset(self, capacity=CHUNK):
        self._new_cache(self.layers, self.kv["heads"], self.kv["head_dim"], capacity, self.dtype, self.device)

    def _run(self, input_ids, positions, mask, logits_index, slots, width):
        # the trees (so these inputs) may be on the GPU, where the drafter engine returned them
        inputs = [pb_utils.Tensor("input_ids", input_ids.cpu().numpy().astype(np.int64)),
                  pb_utils.Tensor("position_ids", positions.cpu().numpy().astype(np.int64)),
                  pb_utils.Tensor("attention_mask", mask.cpu().numpy()),
                  pb_utils.Tensor("logits_index", logits_index.numpy())]
        for i in range(self.layers):
            past_k, past_v = self._past(slots, width, i)
            inputs += [_dl(f"past_key_{i}", past_k), _dl(f"past_value_{i}", past_v)]
        kv = [f"new_{kv}_{i}" for i in range(self.layers) for kv in ("key", "value")]
        response = _exec(self.model, inputs, ["logits", "captured", *ACCEPT_OUTPUTS, *kv])
        new = [_out(response, n).to(self.device) for n in kv]
        logits = _out(response, "logits").float().cpu()
        accepted = tuple(_out(response, n) for n in ACCEPT_OUTPUTS)   # the engine's own acceptance
        return Verification(logits, _out(response, "captured"), accepted=accepted), new[0::2], new[1::2]


class BlsDrafter(DrafterBackend):
    def __init__(self, s, shape, device):
        self.model, self.kv, self.shape, self.device = s["drafter_model"], s["drafter_kv"], shape, device
        self.dtype = TORCH_DTYPES[self.kv["dtype"]]

    def reset(self, capacity=CHUNK):
        self._new_cache(1, self.kv["heads"], self.kv["head_dim"], capacity, self.dtype, self.device)

    def _run(self, captured, input_ids, past_lengths, new_lengths, slots, width):
        past_k, past_v = self._past(slots, width, 0)
        inputs = [_dl("captured", captured.to(self.device, self.dtype)),
                  pb_utils.Tensor("input_ids", np.asarray(input_ids, dtype=np.int64)),
                  _dl("past_key", past_k), _dl("past_value", past_v),
                  pb_utils.Tensor("past_lengths", np.asarray(past_lengths, dtype=np.int64)),
                  pb_utils.Tensor("new_lengths", np.asarray(new_lengths, dtype=np.int64))]
        names = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores", "new_key", "new_value"]
        response = _exec(self.model, inputs, names)
        out = {n: _out(response, n) for n in names}
        return tree_from_outputs(out), out["new_key"].to(self.device), out["new_value"].to(self.device)


# ----------------------------------------------------------------------------- the model

def torch_engine(folder, s, shape):
    """The torch runtime: the checkpoints in the repository on the PyTorch engine, every
    iteration of the running batch one fixed-shape step, replayed as a CUDA graph on a GPU
    (runtime/static.py); the whole tree is verified (a captured graph has one shape)."""
    from eagle_trt.api import load_target_on
    from eagle_trt.checkpoints import load_drafter
    from eagle_trt.config import CaptureLayers
    from eagle_trt.runtime.static import StaticEngine
    target = load_target_on(str(folder / "target"), s["torch_device"],
                            None if s["torch_dtype"] == "auto" else s["torch_dtype"])
    drafter = load_drafter(folder / "drafter", target)
    target.model.set_capture(CaptureLayers(tuple(s["capture"]["layer_ids"]), s["capture"]["convention"]))
    return StaticEngine(target.model, drafter, shape, max_batch=s["max_concurrent"], capacity=s["capacity"])


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config needs model_transaction_policy "
                                                "{ decoupled: true }")
        folder = Path(args["model_repository"]) / args["model_version"]
        s = json.loads((folder / "eagle.json").read_text())
        self.settings = s
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
        shape = TreeShape(*s["tree"])
        # One running batch per model instance: requests join it between iterations and leave it
        # when done; with the graphs the cost model decides per iteration how much of each tree
        # to verify.
        cost = CostModel(shape.total_tokens, shape.top_k * (shape.depth - 1)) if s.get("cost_model", True) else None
        if s["backend"] == "torch":
            engine = torch_engine(folder, s, shape)
        elif s["backend"] == "tensorrt":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            engine = TwoCallEngine(BlsTarget(s, device), BlsDrafter(s, shape, device), cost)
        else:   # the iteration graph for each iteration that drafts (any subtree), where the build made one
            from eagle_trt.runtime.ort_engines import open_backends
            graphs = {g: folder / f for g, f in s["graphs"].items()}
            engine = open_backends(graphs, shape, s["max_context"], threads=s["threads"] or None,
                                   precision=s["precision"]).engine(cost)
        # Prompts are prefilled in the scheduler's steps, prefill_chunk tokens a step, where the engine
        # prefills with a past (the TensorRT plans' prefill profile has none: whole prompts there)
        chunk = s.get("prefill_chunk", 0) if s["backend"] != "tensorrt" else 0
        self.decoder = DecodingLoop(engine, s["eos_ids"], s["vocab_size"], prefill_chunk=chunk or s["max_context"])
        self.incoming = queue.Queue()
        self.waiting_logged = 0
        self.stopping = threading.Event()
        self.scheduler = threading.Thread(target=self._schedule, name="eagle_trt-batch", daemon=True)
        self.scheduler.start()

    def execute(self, requests):
        """Validate each request at once (errors go back before anything waits), then hand it to
        the batch scheduler."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = self._parse(request)
            except (RequestError, ConfigError) as exc:
                self._fail(sender, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - a request must never take the model down
                self._fail(sender, f"{type(exc).__name__}: {exc}")
                continue
            prompt, max_tokens, sampling, stop_ids = parsed
            self.incoming.put((sender, Request(prompt, max_tokens, sampling, submitted=time.perf_counter(),
                                               stop_ids=stop_ids)))

    def _parse(self, request):
        s = self.settings

        def scalar(name, kind, default):
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is None:
                return default
            a = t.as_numpy().reshape(-1)
            if a.size != 1:
                raise RequestError(f"{name}: expected one value, got {a.size}")
            return kind(a[0])
        text, ids = (pb_utils.get_input_tensor_by_name(request, n) for n in ("text_input", "input_ids"))
        if (text is None) == (ids is None):
            raise RequestError("give exactly one of text_input (BYTES) and input_ids (INT64)")
        if ids is not None:
            prompt = [int(i) for i in ids.as_numpy().reshape(-1)]
        else:
            values = text.as_numpy().reshape(-1)
            if values.size != 1:
                raise RequestError(f"text_input: expected one string, got {values.size}")
            raw = values[0]
            try:
                prompt_text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError as exc:
                raise RequestError(f"text_input: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") \
                    from None
            from eagle_trt.api import encode_prompt
            use_chat = s["chat"] and bool(getattr(self.tokenizer, "chat_template", None))
            prompt = encode_prompt(self.tokenizer, prompt_text, use_chat)
        max_tokens = scalar("max_tokens", int, s["max_tokens"])
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens}")
        sampling = SamplingConfig(scalar("temperature", float, 0.0), scalar("top_p", float, 1.0),
                                  scalar("top_k", int, 0), scalar("seed", int, None)).validate()
        stop = pb_utils.get_input_tensor_by_name(request, "stop_token_ids")
        stop_ids = tuple(int(i) for i in stop.as_numpy().reshape(-1)) if stop is not None else ()
        # Everything the decoder would refuse is refused here, before the request waits for anything.
        check_request(prompt, max_tokens, s["max_context"], s["vocab_size"], stop_ids=stop_ids)
        return prompt, max_tokens, sampling, stop_ids

    def _streamer(self, sender, sequence: list):
        """The sequence's on_tokens: one response per iteration. sequence: [the Sequence], filled
        in as add() returns (queued for its prefill, it streams nothing before)."""
        stream = TextStream(self.tokenizer)

        def on_tokens(ids):
            if sender.is_cancelled():
                return False
            seq = sequence[0]
            accepted = seq.result.accept_lengths[-1] if seq.result.accept_lengths else 0
            piece = stream.push(ids)
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([piece.encode("utf-8")], dtype=np.object_)),
                pb_utils.Tensor("token_ids", np.array(ids, dtype=np.int64)),
                pb_utils.Tensor("accepted", np.array([accepted], dtype=np.int32)),
                pb_utils.Tensor("finish_reason", np.array([FINISH_REASONS.get(seq.stop, b"")], dtype=np.object_))]))
            return True
        return on_tokens

    def _admit(self, senders):
        """Move waiting requests into the running batch while it has room."""
        limit = self.settings["max_concurrent"]
        while self.decoder.running < limit:
            try:
                sender, request = self.incoming.get(timeout=0.05 if not self.decoder.running else 0)
            except queue.Empty:
                return
            if sender.is_cancelled():
                self._close(sender)
                continue
            sequence = []
            request.on_tokens = self._streamer(sender, sequence)
            try:
                seq = self.decoder.add(request)   # queued: its prefill (and first token) come in the steps
            except ConfigError as exc:   # e.g. prompt + max_tokens beyond the context
                self._fail(sender, str(exc))
                continue
            sequence.append(seq)
            senders[id(seq)] = sender
        for seq in list(self.decoder.prefilling):   # a client gone during a long prefill: stop it there
            if senders[id(seq)].is_cancelled():
                self.decoder.cancel(seq)
                self._close(senders.pop(id(seq)), seq)
        waiting = self.incoming.qsize()
        if waiting > self.waiting_logged:   # once per newly waiting request, not every iteration
            pb_utils.Logger.log_info(f"eagle_trt: {waiting} request(s) waiting for a batch slot (all {limit} busy; "
                                     f"serving.max_concurrent)")
        self.waiting_logged = waiting

    def _schedule(self):
        senders = {}
        while not self.stopping.is_set():
            try:
                self._admit(senders)
                for seq in self.decoder.step():
                    self._close(senders.pop(id(seq)), seq)
            except Exception as exc:  # noqa: BLE001 - fail the running batch, keep serving new requests
                message = f"{type(exc).__name__}: {exc}"
                pb_utils.Logger.log_error(f"eagle_trt: decoding failed for the running batch: {message}")
                for sender in senders.values():
                    self._fail(sender, message)
                senders.clear()
                self.decoder.clear()
        for sender in senders.values():
            self._fail(sender, "the model is unloading")
        while not self.incoming.empty():
            self._fail(self.incoming.get()[0], "the model is unloading")

    @staticmethod
    def _close(sender, seq=None):
        """Final flag for a finished sequence (seq) or a request cancelled before it ran (None)."""
        if seq is None or seq.stop == "cancelled":
            done = f"after {len(seq.result.tokens)} of {seq.request.max_new_tokens} tokens" if seq else \
                "while waiting for a batch slot"
            pb_utils.Logger.log_info(f"eagle_trt: request cancelled by the client {done}")
        try:   # cancelled streams too: the Python backend needs the final flag to unload
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
            pass

    @staticmethod
    def _fail(sender, message):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
            pass

    def finalize(self):
        self.stopping.set()
        self.scheduler.join(timeout=30)
