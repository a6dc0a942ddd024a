"""An OpenAI-compatible HTTP front end over the Triton deployment: `/v1/models`,
`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events or not), `/health` and
`/metrics`. `python -m eagle_trt.serve` runs it (eagle_trt/serve.py).

Starlette on uvicorn: FastAPI is Starlette plus pydantic, and requests are validated by hand here
(protocol.py) to answer OpenAI's error object with specific messages, so pydantic would be
one more dependency for nothing; vLLM's server runs on the same ASGI stack underneath. Each
request is one gRPC stream to Triton (triton_stream.py); a client that disconnects cancels the
task that reads it, and with it the request in Triton."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import ApiError, parse_request
from .triton_stream import Generation, TritonBackend

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, awaitable):
    """Await `awaitable`, cancelling it if the HTTP client disconnects first (ClientGone).
    Streamed responses get this from Starlette; a plain response and the wait before a stream's
    first token would otherwise keep a request running in Triton for nobody."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    if not work.done() or work.cancelled():
        raise ClientGone
    return work.result()


# ----------------------------------------------------------------------------- response bodies

def _usage(gen: Generation) -> dict:
    n, prompt = gen.completion_tokens, len(gen.params.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


class Reply:
    """OpenAI's response objects for one request: a chat completion or a text completion."""

    def __init__(self, kind: str, model: str, gen: Generation):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + gen.id     # the Triton request's id too
        self.created, self.model = int(time.time()), model

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, gen: Generation) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(gen)}
        choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": _usage(gen)}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False,
              usage: dict | None = None, include_usage: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = self._head("text_completion")
        body["choices"] = [] if usage is not None else [choice]
        if include_usage:   # as OpenAI: null on every chunk but the last
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"


# ----------------------------------------------------------------------------- the app

def create_app(backend: TritonBackend) -> Starlette:
    """The ASGI app over `backend` (its gRPC channel opens and closes with the app's lifespan)."""
    started = int(time.time())
    name = backend.limits.served_name

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await backend.open()
        try:
            yield
        finally:
            await backend.close()

    async def models(request: Request) -> Response:
        card = {"id": name, "object": "model", "created": started, "owned_by": "eagle_trt"}
        if "model" in request.path_params:
            if request.path_params["model"] != name:
                return error_response(ApiError(f"The model `{request.path_params['model']}` does not exist.",
                                               "model", status=404, code="model_not_found"))
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        ok = await backend.ready()
        return PlainTextResponse("ok" if ok else "Triton is not ready", status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(backend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, kind: str) -> Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error_response(ApiError("We could not parse the JSON body of your request. (HINT: This likely "
                                           "means you aren't using your HTTP library correctly.)"))
        try:
            params = parse_request(body, kind, backend.limits)
        except ApiError as exc:
            return error_response(exc)
        gen = backend.generate(params)
        reply = Reply(kind, name, gen)
        pieces = gen.pieces()
        try:   # up to the first response, errors are still an HTTP status
            first = await unless_disconnected(request, pieces.__anext__())
            if not params.stream:
                await unless_disconnected(request, _drain(pieces))
                return JSONResponse(reply.whole(gen))
        except ClientGone:
            return Response(status_code=499)   # nobody reads it
        except ApiError as exc:
            return error_response(exc)
        except StopAsyncIteration:   # no response at all (cannot happen with a model that streams)
            return error_response(ApiError("Triton closed the stream without a response", status=500,
                                           kind="server_error"))
        return StreamingResponse(_events(gen, reply, pieces, first), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                                       kind=kind))

    routes = [Route("/v1/models", models), Route("/v1/models/{model:path}", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/health", health), Route("/metrics", metrics)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.backend = backend
    return app


async def _drain(pieces) -> None:
    async for _ in pieces:
        pass


async def _events(gen: Generation, reply: Reply, pieces, first: str):
    """The server-sent events of a streamed completion: OpenAI's chunks, then `data: [DONE]`.
    A disconnect cancels this (Starlette), and closing `pieces` cancels the request in Triton."""
    usage = gen.params.include_usage
    try:
        if reply.chat:
            yield reply.chunk(None, role=True, include_usage=usage)
        for piece in ([first] if first else []):
            yield reply.chunk(piece, include_usage=usage)
        async for piece in pieces:
            if piece:
                yield reply.chunk(piece, include_usage=usage)
        yield reply.chunk(None, finish=gen.finish_reason, include_usage=usage)
        if usage:
            yield reply.chunk(None, usage=_usage(gen), include_usage=True)
    except ApiError as exc:   # after the 200: the error goes in the stream, as vLLM does
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- running it

class HttpServer:
    """uvicorn serving `app` on a thread (tests, scripts/openai_load.py); `with` starts and stops it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn
        from ..build.local_triton import free_port
        self.app, self.host, self.port = app, host, port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="eagle_trt-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *_):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        return False


@contextlib.contextmanager
def serving(repository: str | Path, model: str = "eagle_trt", served_name: str | None = None,
            host: str = "127.0.0.1", port: int | None = None):
    """tritonserver on the repository (LocalTriton) and the front end over it on a thread:
    yields (LocalTriton, HttpServer)."""
    from ..build.local_triton import LocalTriton
    backend = TritonBackend(repository, "", model, served_name)   # reads the repository before starting anything
    with LocalTriton(repository) as triton:
        backend.url = triton.grpc_url
        with HttpServer(create_app(backend), host, port) as http:
            yield triton, http
