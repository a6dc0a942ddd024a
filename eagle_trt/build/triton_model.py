"""Triton Python-backend model (decoupled): EAGLE speculative decoding, streamed.

Copied by `python -m eagle_trt.build` into `<repository>/<model>/1/model.py`; runs only inside
Triton's Python backend (it imports triton_python_backend_utils) with eagle_trt installed in
the backend's Python environment. Settings come from `eagle.json` beside it.

Requests: text_input (BYTES [1]) or input_ids (INT64 [-1]), and optional max_tokens (INT32),
temperature, top_p (FP32), top_k (INT32), seed (INT64). Each decoding iteration sends one
response with the newly final tokens: text_output (BYTES [1], the text they add) and token_ids
(INT64 [n]); an empty response flagged final closes the stream. Bad requests get one error
response; the model keeps serving.

Backends: "onnxruntime" runs the target and drafter-tree graphs in-process (OrtTarget /
OrtDrafter); "tensorrt" calls the `<model>_target` / `<model>_drafter` tensorrt_plan models
through BLS, keeping the KV caches here as torch tensors (on the GPU when there is one).
Each request runs in its own thread on one of `max_concurrent` decoder slots."""
import json
import queue
import threading
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from eagle_trt.config import ConfigError, SamplingConfig, TreeShape
from eagle_trt.runtime.decoder import SpeculativeDecoder, check_request
from eagle_trt.runtime.kv_cache import KVCache
from eagle_trt.tree import DraftTree

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


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


class BlsTarget:
    """TargetBackend over the target engine: the committed KV prefix goes in as past_*, the new
    rows come back and are staged in the cache here (commit compacts accepted rows)."""

    def __init__(self, s, device):
        self.model, self.layers = s["target_model"], s["target_kv"]["layers"]
        self.kv, self.dtype, self.device = s["target_kv"], TORCH_DTYPES[s["target_kv"]["dtype"]], device
        self.max_context = s["max_context"]
        self.cache = None

    def reset(self, capacity):
        self.cache = KVCache(self.layers, self.kv["heads"], self.kv["head_dim"], capacity, self.dtype, self.device)

    @property
    def length(self):
        return self.cache.length

    def forward(self, input_ids, positions, mask, last_only=False):
        T, P = int(input_ids.shape[0]), self.cache.length
        self.cache.stage(T)
        full = torch.ones(1, T, P + T, dtype=torch.bool)
        full[0, :, P:] = mask
        index = torch.tensor([T - 1] if last_only else list(range(T)), dtype=torch.int64)
        inputs = [pb_utils.Tensor("input_ids", input_ids[None].numpy().astype(np.int64)),
                  pb_utils.Tensor("position_ids", positions[None].numpy().astype(np.int64)),
                  pb_utils.Tensor("attention_mask", full.numpy()), pb_utils.Tensor("logits_index", index.numpy())]
        past_k, past_v = self.cache.past()
        for i in range(self.layers):
            inputs += [_dl(f"past_key_{i}", past_k[i]), _dl(f"past_value_{i}", past_v[i])]
        names = ["logits", "captured"] + [f"new_{kv}_{i}" for i in range(self.layers) for kv in ("key", "value")]
        response = _exec(self.model, inputs, names)
        for i in range(self.layers):
            self.cache.k[i, :, P:P + T] = _out(response, f"new_key_{i}").to(self.device)
            self.cache.v[i, :, P:P + T] = _out(response, f"new_value_{i}").to(self.device)
        logits = _out(response, "logits")[0].float().cpu()
        return logits, _out(response, "captured")[0]

    def commit(self, rows):
        self.cache.commit(rows)


class BlsDrafter:
    def __init__(self, s, shape, device):
        self.model, self.kv, self.shape, self.device = s["drafter_model"], s["drafter_kv"], shape, device
        self.dtype = TORCH_DTYPES[self.kv["dtype"]]
        self.cache = None

    def reset(self, capacity):
        self.cache = KVCache(1, self.kv["heads"], self.kv["head_dim"], capacity, self.dtype, self.device)

    def draft(self, captured, input_ids):
        T, P = int(input_ids.shape[0]), self.cache.length
        self.cache.stage(T)
        past_k, past_v = self.cache.past()
        inputs = [_dl("captured", captured[None].to(self.device, self.dtype)),
                  pb_utils.Tensor("input_ids", input_ids[None].numpy().astype(np.int64)),
                  _dl("past_key", past_k[0]), _dl("past_value", past_v[0])]
        names = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores", "new_key", "new_value"]
        response = _exec(self.model, inputs, names)
        self.cache.k[0, :, P:P + T] = _out(response, "new_key").to(self.device)
        self.cache.v[0, :, P:P + T] = _out(response, "new_value").to(self.device)
        self.cache.commit(list(range(T)))
        out = {n: _out(response, n).cpu() for n in names[:5]}
        return DraftTree(out["tree_tokens"], out["tree_parents"], out["tree_mask"], out["tree_depths"],
                         out["tree_scores"].float())


# ----------------------------------------------------------------------------- the model

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
        self.slots = queue.Queue()
        if s["backend"] == "tensorrt":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            for _ in range(s["max_concurrent"]):
                self.slots.put((BlsTarget(s, device), BlsDrafter(s, shape, device)))
        else:
            import copy

            from eagle_trt.quant.run import Fp8OrtDrafter, Fp8OrtTarget
            from eagle_trt.runtime.onnxruntime_backend import OrtDrafter, OrtTarget
            # FP8 graphs need ORT's FP8 settings (weight DQs folded once, 2-row padding): quant/run.py
            fp8 = {g: s["precision"][g] == "fp8" for g in ("target", "drafter_tree")}
            threads = s["threads"] or None
            target = (Fp8OrtTarget if fp8["target"] else OrtTarget)(folder / s["graphs"]["target"], s["max_context"], threads)
            drafter = (Fp8OrtDrafter if fp8["drafter_tree"] else OrtDrafter)(folder / s["graphs"]["drafter_tree"], shape,
                                                                             threads)
            # Sessions are shared (ORT runs concurrent calls on one session); each slot has its own caches.
            for _ in range(s["max_concurrent"]):
                self.slots.put((copy.copy(target), copy.copy(drafter)))
        self.workers = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            worker = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.lock:
                self.workers.add(worker)
            worker.start()

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
        # Everything the decoder would refuse is refused here, before the request waits for a slot.
        check_request(prompt, max_tokens, s["max_context"], s["vocab_size"])
        return prompt, max_tokens, sampling

    def _serve(self, request):
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            try:
                prompt, max_tokens, sampling = self._parse(request)
            except (RequestError, ConfigError) as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=final)
                return
            try:
                target, drafter = self.slots.get_nowait()
            except queue.Empty:
                pb_utils.Logger.log_info(f"eagle_trt: request waiting for a decoding slot (all "
                                         f"{self.settings['max_concurrent']} busy; serving.max_concurrent)")
                target, drafter = self.slots.get()
            try:
                stream = TextStream(self.tokenizer)

                def on_tokens(ids):
                    if sender.is_cancelled():
                        return False
                    piece = stream.push(ids)
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor("text_output", np.array([piece.encode("utf-8")], dtype=np.object_)),
                        pb_utils.Tensor("token_ids", np.array(ids, dtype=np.int64))]))
                    return True
                decoder = SpeculativeDecoder(target, drafter, self.settings["eos_ids"], self.settings["vocab_size"])
                result = decoder.generate(prompt, max_tokens, sampling, on_tokens=on_tokens)
                if result.stop_reason == "cancelled":
                    pb_utils.Logger.log_info(f"eagle_trt: request cancelled by the client after "
                                             f"{len(result.tokens)} of {max_tokens} tokens")
            finally:
                self.slots.put((target, drafter))
            sender.send(flags=final)   # cancelled streams too: the Python backend needs the final flag to unload
        except ConfigError as exc:   # e.g. prompt + max_tokens beyond the context
            self._fail(sender, str(exc))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the model down
            self._fail(sender, f"{type(exc).__name__}: {exc}")
        finally:
            with self.lock:
                self.workers.discard(threading.current_thread())

    @staticmethod
    def _fail(sender, message):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
            pass

    def finalize(self):
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(timeout=10)
