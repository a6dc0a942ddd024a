"""One generation over Triton's gRPC streaming API (`tritonclient.grpc.aio`), as the OpenAI front
end needs it: text pieces decoded from the streamed token ids, stop strings, the finish reason,
token counts and the metrics.

One gRPC stream per request: the request iterator yields the one request and ends, so Triton
closes the stream after the model's final flag. Leaving early (the HTTP client went away, a stop
string, an error) cancels the call, and Triton cancels the request: the model sees
`sender.is_cancelled()` and frees the batch slot at once."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from .protocol import ApiError, Limits, Params
from .metrics import Metrics

READY_TIMEOUT = 2.0     # seconds for a readiness check: Triton on the same host answers in milliseconds


def unavailable(message: str) -> ApiError:
    return ApiError(message, status=503, kind="service_unavailable")


class TritonBackend:
    """The model in a Triton repository, reached over gRPC: its tokenizer and eagle.json settings
    (read from the repository), one channel shared by all requests."""

    def __init__(self, repository: str | Path, grpc_url: str, model: str = "eagle_trt",
                 served_name: str | None = None, response_timeout: float = 600.0, metrics: Metrics | None = None):
        from transformers import AutoTokenizer
        folder = Path(repository) / model / "1"
        if not (folder / "eagle.json").is_file():
            raise FileNotFoundError(f"{folder / 'eagle.json'}: not an eagle_trt model in {repository} "
                                    f"(python -m eagle_trt.build writes it; --model names the model)")
        self.settings = json.loads((folder / "eagle.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
        self.url, self.model = grpc_url, model
        s = self.settings
        self.limits = Limits(self.tokenizer, served_name or model, s["max_context"], s["max_tokens"], s["vocab_size"])
        self.eos_ids = set(s["eos_ids"])
        # Generous (a request may wait for a batch slot behind long ones) but finite: a hung
        # server must not hang the HTTP client for ever.
        self.response_timeout = response_timeout
        self.metrics = metrics or Metrics()
        self.client = None

    async def open(self) -> None:
        """The gRPC channel, made in the running event loop (a grpc.aio channel belongs to one)."""
        import tritonclient.grpc.aio as grpcclient
        self.client = grpcclient.InferenceServerClient(self.url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready(client_timeout=READY_TIMEOUT)
                        and await self.client.is_model_ready(self.model, client_timeout=READY_TIMEOUT))
        except Exception:  # noqa: BLE001 - unreachable, timed out, shutting down: not ready
            return False

    def generate(self, params: Params) -> Generation:
        return Generation(self, params)


def _input(name: str, array: np.ndarray, dtype: str):
    import tritonclient.grpc.aio as grpcclient
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could still be the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class Generation:
    """One request's stream. `pieces()` yields the text each Triton response adds (possibly "");
    afterwards `finish_reason`, `completion_tokens` and `tokens` say how it ended. Errors are
    ApiError: 503 when Triton is unreachable or silent, 400 when the model refuses the request,
    500 when it fails after tokens went out."""

    def __init__(self, backend: TritonBackend, params: Params):
        self.backend, self.params = backend, params
        self.id = uuid.uuid4().hex
        self.tokens: list[int] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""     # what pieces() has yielded
        self.error: ApiError | None = None
        self.cancelled_in_triton = False   # the gRPC call was cancelled, not completed

    def _inputs(self) -> list:
        p = self.params
        inputs = [_input("input_ids", np.array(p.prompt_ids, dtype=np.int64), "INT64"),
                  _input("max_tokens", np.array([p.max_tokens], dtype=np.int32), "INT32"),
                  _input("temperature", np.array([p.temperature], dtype=np.float32), "FP32"),
                  _input("top_p", np.array([p.top_p], dtype=np.float32), "FP32"),
                  _input("top_k", np.array([p.top_k], dtype=np.int32), "INT32")]
        if p.seed is not None:
            inputs.append(_input("seed", np.array([p.seed], dtype=np.int64), "INT64"))
        if p.stop_token_ids:   # only when asked: a repository built before this input still serves the rest
            inputs.append(_input("stop_token_ids", np.array(p.stop_token_ids, dtype=np.int64), "INT64"))
        return inputs

    async def _responses(self) -> AsyncIterator[tuple[list[int], int | None, str]]:
        """(token ids, accepted, finish reason) per response; cancels the call when left early."""
        import grpc
        backend = self.backend
        if backend.client is None:
            raise self._failed(unavailable("the front end is not connected to Triton"))
        request = {"model_name": backend.model, "inputs": self._inputs(), "request_id": self.id}

        async def one_request():
            yield request
        call = backend.client.stream_infer(one_request())
        try:
            while True:
                try:
                    result, error = await asyncio.wait_for(call.__anext__(), backend.response_timeout)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise self._failed(unavailable(f"no response from Triton ({backend.url}) in "
                                                   f"{backend.response_timeout:.0f} s")) from None
                except grpc.aio.AioRpcError as exc:
                    raise self._failed(unavailable(f"Triton ({backend.url}) is not reachable: {exc.code().name}: "
                                                   f"{exc.details()}")) from None
                if error is not None:
                    message = error.message() if hasattr(error, "message") else str(error)
                    if self.tokens:
                        raise self._failed(ApiError(f"the model failed: {message}", status=500, kind="server_error"))
                    raise self._failed(ApiError(message or str(error)))
                ids = result.as_numpy("token_ids")
                accepted, finish = result.as_numpy("accepted"), result.as_numpy("finish_reason")
                yield ([] if ids is None else ids.reshape(-1).tolist(),
                       None if accepted is None else int(accepted.reshape(-1)[0]),
                       "" if finish is None else finish.reshape(-1)[0].decode())
        finally:
            # a completed call: nothing; else Triton cancels the request
            self.cancelled_in_triton = bool(call.cancel())

    def _failed(self, error: ApiError) -> ApiError:
        self.error = error
        return error

    def _visible(self, finish: str) -> list[int]:
        """The tokens whose text is the completion's: a stop token id ends it unseen (as EOS does)."""
        if finish == "stop" and self.tokens and self.tokens[-1] in self.params.stop_token_ids:
            return self.tokens[:-1]
        return self.tokens

    def _cut(self, text: str) -> tuple[int, int] | None:
        """Where the first stop string in `text` starts, and the tokens up to the one completing it."""
        stops = self.params.stop
        start = max(0, len(self.text) - max(len(s) for s in stops) + 1)
        found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
        if not found:
            return None
        at, stop = min(found)
        decode = self.backend.tokenizer.decode
        n = next(k for k in range(1, len(self.tokens) + 1)
                 if decode(self.tokens[:k], skip_special_tokens=True).find(stop, start) >= 0)
        return at, n

    def _text(self, finish: str) -> str:
        """The completion's text so far: all the ids decoded (pieces then add up to the decoded
        whole, whatever the tokenizer merges), cut at a stop string (which finishes it) or, while
        it runs, short of an unfinished character and of what could start a stop string."""
        text = self.backend.tokenizer.decode(self._visible(finish), skip_special_tokens=True)
        cut = self._cut(text) if self.params.stop else None
        if cut is not None:
            self.finish_reason, self.completion_tokens = "stop", cut[1]
            return text[:cut[0]]
        self.completion_tokens = len(self.tokens)
        if finish:
            self.finish_reason = finish
            return text
        if text.endswith("\ufffd"):   # an unfinished UTF-8 character: the token completing it comes next
            return self.text
        return text[:max(len(self.text), len(text) - _stop_hold(text, self.params.stop))]

    def push(self, ids: list[int], finish: str = "") -> str:
        """One response's token ids and finish reason ("" while it runs): the text they add."""
        self.tokens += ids
        text = self._text(finish)
        piece, self.text = text[len(self.text):], text
        return piece

    async def pieces(self) -> AsyncIterator[str]:
        m = self.backend.metrics
        m.submitted(len(self.params.prompt_ids))
        start = last = time.perf_counter()
        try:
            async with contextlib.aclosing(self._responses()) as responses:   # left early: cancelled at once
                async for ids, accepted, finish in responses:
                    now = time.perf_counter()
                    if not self.tokens and ids:
                        m.first_token(now - start)
                    m.tokens(len(ids), accepted, now - last if self.tokens and ids else None)
                    last = now
                    yield self.push(ids, finish)
                    if self.finish_reason and not finish:
                        return   # a stop string: leaving cancels the request in Triton
                    # The model's last response (its finish reason): read on to the call's end, not
                    # cancel it. Tritonserver before 24.12 can crash on a cancellation that races the
                    # call's completion (triton-inference-server/server#7368, fixed by #7840).
            if self.finish_reason:
                return
            # No finish reason on the stream (a repository built before that output): EOS or a stop id
            # ended it with "stop", else max_tokens did.
            last_id = self.tokens[-1] if self.tokens else None
            yield self.push([], "stop" if last_id in self.backend.eos_ids or last_id in self.params.stop_token_ids
                            else "length")
        finally:
            # a consumer that leaves early (client gone, task cancelled) ends here without a reason
            m.finished(self.finish_reason or ("cancelled" if self.error is None else "error"), bool(self.tokens))

    async def run(self) -> str:
        """The whole completion's text (not streamed)."""
        async for _ in self.pieces():
            pass
        return self.text
