"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) checked by hand into what one
Triton request asks for (`Params`).

Checked by hand, not by pydantic, so that every refusal is OpenAI's error object with a message
that names the field. What the server does not implement (n > 1, logprobs, tools, penalties,
images, ...) is refused with status 400, never silently ignored; a field OpenAI does not define
either gets OpenAI's own "Unrecognized request argument supplied"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..api import encode_prompt
from ..config import ConfigError

INT64 = (-(2 ** 63), 2 ** 63 - 1)
INT32_MAX = 2 ** 31 - 1     # max_tokens and top_k go to Triton as INT32


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What the repository's eagle.json says about requests, and the tokenizer."""
    tokenizer: object
    served_name: str
    max_context: int
    max_tokens: int            # serving.max_tokens: the default
    vocab_size: int


@dataclass
class Params:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0   # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0             # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


# Fields of each endpoint: OpenAI's, vLLM's top_k and stop_token_ids. Those refused when they
# ask for something, with why.
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "top_k", "user", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty"}
FIELDS = {"completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                            "tool_choice", "functions", "function_call", "parallel_tool_calls"}}


def _refusals(kind: str):
    """(field, is it asking for something this server does not do, message) in checking order."""
    def set_(v):
        return v is not None and v is not False and v != [] and v != {} and v != ""
    logprobs = set_ if kind == "chat" else (lambda v: v is not None)    # completions: an int, 0 included
    return [("n", lambda v: v is not None and v != 1, "only n=1 is supported (one choice per request)"),
            ("best_of", lambda v: v is not None and v != 1, "best_of > 1 is not supported"),
            ("logprobs", logprobs, "logprobs are not supported"),
            ("top_logprobs", lambda v: v is not None, "top_logprobs is not supported (logprobs are not)"),
            ("echo", set_, "echo is not supported"),
            ("suffix", set_, "suffix is not supported"),
            ("tools", set_, "tools are not supported"),
            ("tool_choice", lambda v: v not in (None, "none"), "tool_choice is not supported (tools are not)"),
            ("parallel_tool_calls", lambda v: v is not None, "parallel_tool_calls is not supported (tools are not)"),
            ("functions", set_, "functions are not supported"),
            ("function_call", lambda v: v not in (None, "none"), "function_call is not supported"),
            ("logit_bias", set_, "logit_bias is not supported"),
            ("presence_penalty", lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported (only 0)"),
            ("frequency_penalty", lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported (only 0)"),
            ("response_format", lambda v: v is not None and v != {"type": "text"},
             "response_format is not supported (only {\"type\": \"text\"})")]


# ----------------------------------------------------------------------------- typed fields

def _type_name(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), "null" if v is None else type(v).__name__)


def _wrong_type(name: str, expected: str, v) -> ApiError:
    return ApiError(f"Invalid type for '{name}': expected {expected}, but got {_type_name(v)} instead.", name)


def _number(body, name, default, lo=None, hi=None, lo_open=False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _wrong_type(name, "a number", v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        bound = f"{'>' if lo_open else '>='} {lo}"
        raise ApiError(f"Invalid '{name}': expected a value {bound}, but got {v} instead.", name)
    if hi is not None and v > hi:
        raise ApiError(f"Invalid '{name}': expected a value <= {hi}, but got {v} instead.", name)
    return float(v)


def _integer(body, name, default, lo=None, hi=None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _wrong_type(name, "an integer", v)
    if lo is not None and v < lo:
        raise ApiError(f"Invalid '{name}': expected a value >= {lo}, but got {v} instead.", name)
    if hi is not None and v > hi:
        raise ApiError(f"Invalid '{name}': expected a value <= {hi}, but got {v} instead.", name)
    return v


def _boolean(body, name, default=False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _wrong_type(name, "a boolean", v)
    return v


def _token_ids(v, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise _wrong_type(name, "an array of token ids (integers)", v)
    bad = next((t for t in v if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"Invalid '{name}': token id {bad} is outside the vocabulary (0..{vocab_size - 1}).", name)
    return list(v)


def _stops(body, vocab_size: int) -> tuple[list[str], list[int]]:
    """`stop`: a string or a list of strings and token ids; vLLM's `stop_token_ids`: ids."""
    v = body.get("stop")
    items = [] if v is None else [v] if isinstance(v, (str, int)) and not isinstance(v, bool) else v
    if not isinstance(items, list) or any(isinstance(s, bool) or not isinstance(s, (str, int)) for s in items):
        raise _wrong_type("stop", "a string or an array of strings (or token ids)", v)
    if any(s == "" for s in items):
        raise ApiError("Invalid 'stop': a stop string must not be empty.", "stop")
    strings = [s for s in items if isinstance(s, str)]
    ids = _token_ids([s for s in items if isinstance(s, int)], "stop", vocab_size)
    if body.get("stop_token_ids") is not None:
        ids += _token_ids(body["stop_token_ids"], "stop_token_ids", vocab_size)
    return strings, sorted(set(ids))


# ----------------------------------------------------------------------------- prompts

def _chat_ids(messages, tokenizer) -> list[int]:
    """The target's own chat template over the messages, with the assistant's turn opened."""
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise ApiError("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages")
    rendered = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _wrong_type(where, "an object", m)
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise ApiError(f"Invalid '{where}': '{extra[0]}' is not supported (only role and content).",
                           f"{where}.{extra[0]}")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"Invalid '{where}.role': {role!r} is not supported (system, developer, user or "
                           f"assistant).", f"{where}.role")
        if isinstance(content, list):   # content parts: only text, joined
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                    raise ApiError(f"Invalid '{where}.content[{j}]': only text content parts are supported, "
                                   f"got {kind!r}.", f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise _wrong_type(f"{where}.content", "a string or an array of text parts", content)
        # OpenAI's developer messages are the system prompt of the older chat models
        rendered.append({"role": "system" if role == "developer" else role, "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("the target's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. roles must alternate)
        raise ApiError(f"Invalid 'messages': the chat template refused them: {exc}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _completion_ids(prompt, limits: Limits) -> list[int]:
    """A string, or a list of token ids; a list of one string or one id list is one prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return encode_prompt(limits.tokenizer, prompt, chat=False)
        except ConfigError as exc:
            raise ApiError(f"Invalid 'prompt': {exc}.", "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(f"Invalid 'prompt': {len(prompt)} prompts in one request; this server takes one.", "prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError("Invalid 'prompt': empty, nothing to condition on.", "prompt")
        return _token_ids(prompt, "prompt", limits.vocab_size)
    if prompt is None:
        raise ApiError("you must provide a prompt parameter", "prompt")
    raise _wrong_type("prompt", "a string or an array of token ids", prompt)


# ----------------------------------------------------------------------------- the request

def parse_request(body, kind: str, limits: Limits) -> Params:
    """A request body of `kind` ("completions" or "chat") -> Params, or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise ApiError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model")
    if model is None:
        raise ApiError("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if model != limits.served_name:
        raise ApiError(f"The model `{model}` does not exist (this server serves `{limits.served_name}`).", "model",
                       status=404, code="model_not_found")
    for name, asks, why in _refusals(kind):
        if name in body and asks(body[name]):
            raise ApiError(f"Invalid '{name}': {why}.", name)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise ApiError(f"Unrecognized request argument supplied: stream_options.{extra[0]}",
                           f"stream_options.{extra[0]}")
        include_usage = _boolean(options, "include_usage")
    if not isinstance(body.get("user"), (str, type(None))):
        raise _wrong_type("user", "a string", body["user"])
    temperature = _number(body, "temperature", 1.0, lo=0, hi=2)
    top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
    top_k = _integer(body, "top_k", 0, lo=-1, hi=INT32_MAX)   # vLLM's -1: off, as 0
    seed = _integer(body, "seed", None, *INT64)
    stop, stop_ids = _stops(body, limits.vocab_size)
    limit_name = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise ApiError("give max_completion_tokens or max_tokens, not both", "max_tokens")
        limit_name = "max_completion_tokens"
    max_tokens = _integer(body, limit_name, None, lo=1, hi=INT32_MAX)
    if kind == "chat":
        if "messages" not in body:
            raise ApiError("you must provide a messages parameter", "messages")
        prompt, prompt_name = _chat_ids(body["messages"], limits.tokenizer), "messages"
    else:
        prompt, prompt_name = _completion_ids(body.get("prompt"), limits), "prompt"
    room = limits.max_context - len(prompt)
    if max_tokens is None:    # the repository's default, cut to what the context leaves
        max_tokens = min(limits.max_tokens, room)
    if room < 1 or max_tokens > room:
        raise ApiError(f"This model's maximum context length is {limits.max_context} tokens. However, you requested "
                       f"{len(prompt) + max(max_tokens, 1)} tokens ({len(prompt)} in the {prompt_name}, "
                       f"{max(max_tokens, 1)} in the completion). Please reduce the length of the {prompt_name} "
                       f"or completion.", prompt_name if room < 1 else limit_name)
    return Params(prompt, max_tokens, temperature, top_p, max(top_k, 0), seed, stop, stop_ids, stream, include_usage)
