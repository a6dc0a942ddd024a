"""The OpenAI-compatible front end (`python -m eagle_trt.serve`, eagle_trt/server/app.py) with the
official `openai` client, over a real tritonserver (the binary nvidia-pytriton bundles, CPU,
127.0.0.1) serving the repository test_triton_serving.py serves: chat and completions, streamed
and not, equal to the offline runtime's greedy tokens; usage; every refused field answered 400
with OpenAI's error object; stop strings and stop token ids; a client that disconnects
mid-stream (Triton cancels the request); Triton stopped under a running front end (503 at
once); the metrics; the command line as a subprocess."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SERVING_NEW_TOKENS as NEW_TOKENS
from conftest import require_serving

require_serving()   # tritonclient, the bundled tritonserver, the front end's packages: missing, it fails naming it
import httpx  # noqa: E402
import openai  # noqa: E402

from eagle_trt.api import encode_prompt  # noqa: E402
from eagle_trt.build.local_triton import LocalTriton, free_port  # noqa: E402
from eagle_trt.server.app import HttpServer, create_app  # noqa: E402
from eagle_trt.server.metrics import parse_metrics  # noqa: E402
from eagle_trt.server.triton_stream import TritonBackend  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "eagle_trt"
COMPLETION_PROMPT = "The three primary colors are"
CANCELLED = "eagle_trt: request cancelled by the client"   # after N tokens, or while it waited for a slot


@pytest.fixture(scope="module")
def repository(built) -> Path:
    return built[1].artifact("triton")


@pytest.fixture(scope="module")
def triton(repository):
    with LocalTriton(repository) as server:
        yield server


@pytest.fixture(autouse=True)
def shared_triton_alive(request):
    """A test on the module's server fails at once, with the server's exit status and log, if that
    server is gone (not with the front end's 503s)."""
    if {"triton", "front", "client"} & set(request.fixturenames):
        death = request.getfixturevalue("triton").death()
        if death:
            pytest.fail(f"the module's server is gone before this test: {death}")
    yield


@pytest.fixture(scope="module")
def front(repository, triton):
    with HttpServer(create_app(TritonBackend(repository, triton.grpc_url, MODEL))) as http:
        yield http


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def completion(offline):
    """The completions prompt (no chat template, no special tokens) and its offline greedy tokens."""
    ids = encode_prompt(offline["tokenizer"], COMPLETION_PROMPT, chat=False)
    return ids, offline["decoder"].generate(ids, NEW_TOKENS).tokens


def decode(offline, tokens: list[int]) -> str:
    return offline["tokenizer"].decode(tokens, skip_special_tokens=True)


def finish_of(offline, tokens: list[int]) -> str:
    return "stop" if tokens[-1] in offline["decoder"].eos_ids else "length"


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def metrics(front) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{front.url}/metrics", timeout=10).text)


def requests_total(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("eagle_trt_requests_total{"))


def test_chat_equals_the_offline_greedy_tokens(client, offline):
    """Not streamed, then streamed with usage: the text is the offline tokens decoded, the usage
    counts them and the chat-templated prompt."""
    tokens = offline["tokens"][0]
    r = client.chat.completions.create(model=MODEL, messages=chat(offline["prompts"][0]), temperature=0,
                                       max_tokens=NEW_TOKENS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == decode(offline, tokens)
    assert r.choices[0].finish_reason == finish_of(offline, tokens)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(offline["ids"][0]), len(tokens))
    assert r.usage.total_tokens == len(offline["ids"][0]) + len(tokens)

    tokens = offline["tokens"][1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat(offline["prompts"][1]), temperature=0,
                                                 max_tokens=NEW_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:-2]]
    assert len(content) > 1 and all(content), "text must arrive as a stream of pieces, not one blob"
    assert "".join(content) == decode(offline, tokens)
    reasons = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert reasons == [None] * (len(chunks) - 2) + [finish_of(offline, tokens)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens == len(offline["ids"][1])
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_python_m_eagle_trt_generate(client, offline, capsys):
    """The command-line generator, greedy, on the same prompt (the PyTorch engine with the shipped
    drafter, not the served graphs): the same tokens as the chat completion."""
    import json

    from eagle_trt.generate import main as generate
    prompt = offline["prompts"][2]
    assert generate(["--prompt", prompt, "--chat", "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    r = client.chat.completions.create(model=MODEL, messages=chat(prompt), temperature=0, max_tokens=NEW_TOKENS)
    assert r.usage.completion_tokens == len(want["tokens"])
    assert r.choices[0].message.content == decode(offline, want["tokens"])
    assert want["tokens"] == offline["tokens"][2]


def test_completions_equal_the_offline_greedy_tokens(client, offline, completion):
    """A text prompt (no chat template) not streamed, the same prompt as token ids streamed, and
    the repository's default max_tokens (serving.max_tokens) when the request gives none."""
    ids, tokens = completion
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == decode(offline, tokens)
    assert r.choices[0].finish_reason == finish_of(offline, tokens)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    chunks = list(client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=NEW_TOKENS,
                                            stream=True))
    assert all(c.object == "text_completion" for c in chunks) and len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == decode(offline, tokens)
    assert chunks[-1].choices[0].finish_reason == finish_of(offline, tokens)
    assert chunks[-1].choices[0].text == ""


def test_stop_strings_cut_the_text_before_them(client, offline, completion):
    """The text ends before the first stop string (a word from the middle of the offline text),
    streamed or not; usage counts the tokens up to the one completing it."""
    _, tokens = completion
    full = decode(offline, tokens)
    word = next(w for w in full.split()[2:] if len(w) > 3)
    stop = " " + word
    cut = full[:full.index(stop)]
    needed = next(k for k in range(1, len(tokens) + 1) if stop in decode(offline, tokens[:k]))
    assert 0 < len(cut) and needed < len(tokens), "the check needs a stop string inside the completion"
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=NEW_TOKENS,
                                  stop=["never appears here", stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert r.usage.completion_tokens == needed
    chunks = list(client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0,
                                            max_tokens=NEW_TOKENS, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Chat with a stop string too: the same cut on the chat output.
    text = decode(offline, offline["tokens"][0])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    r = client.chat.completions.create(model=MODEL, messages=chat(offline["prompts"][0]), temperature=0,
                                       max_tokens=NEW_TOKENS, stop=[stop])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text[:text.index(stop)], "stop")


def test_stop_token_ids_end_the_completion(client, offline, completion):
    """vLLM's stop_token_ids and token ids inside `stop`: the completion ends at the first such
    token, which usage counts and the text leaves out."""
    _, tokens = completion
    k = 3
    stop_id = tokens[k]
    k = tokens.index(stop_id)     # its first occurrence
    for extra in ({"extra_body": {"stop_token_ids": [stop_id]}}, {"stop": [stop_id]}):
        r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=NEW_TOKENS,
                                      **extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (decode(offline, tokens[:k]), "stop"), extra
        assert r.usage.completion_tokens == k + 1
    chunks = list(client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0,
                                            max_tokens=NEW_TOKENS, stream=True,
                                            extra_body={"stop_token_ids": [stop_id]}))
    assert "".join(c.choices[0].text for c in chunks) == decode(offline, tokens[:k])
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_finished_request_completes_its_grpc_call_and_a_stop_string_cancels_it(repository, triton, offline):
    """The front end reads a request's call to its end after the model's last response instead of
    cancelling it (a cancellation racing the completion crashes tritonserver before 24.12:
    server#7368), and cancels it when a stop string ends the text early."""
    import asyncio

    from eagle_trt.server.protocol import Params

    async def generation(params: Params):
        backend = TritonBackend(repository, triton.grpc_url, MODEL)
        await backend.open()
        try:
            gen = backend.generate(params)
            await gen.run()
            return gen
        finally:
            await backend.close()
    ids, tokens = offline["ids"][0], offline["tokens"][0]
    done = asyncio.run(generation(Params(ids, NEW_TOKENS, temperature=0)))
    assert done.tokens == tokens and done.finish_reason == finish_of(offline, tokens)
    assert not done.cancelled_in_triton, "a finished request's call was cancelled, not completed"
    stop = decode(offline, tokens[3:5])
    cut = asyncio.run(generation(Params(ids, NEW_TOKENS, temperature=0, stop=[stop])))
    assert cut.finish_reason == "stop" and cut.cancelled_in_triton


def test_streamed_text_holds_back_unfinished_characters_and_stop_string_starts(repository):
    """Token ids pushed one response at a time (Generation.push, what each Triton response goes
    through): a character split over byte tokens waits for its last byte, the start of a stop
    string waits until it is known not to be one, a stop string spanning responses cuts the text
    before it, and the pieces add up to the ids decoded."""
    from eagle_trt.server.protocol import Params
    backend = TritonBackend(repository, "127.0.0.1:1", MODEL)
    tok = backend.tokenizer
    text = "Smile \U0001F99C wide: the world, the sky"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    emoji = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(emoji) >= 2, "the emoji must span byte tokens for this check"
    gen = backend.generate(Params(ids, 64))
    pieces = [gen.push([i]) for i in ids[:-1]] + [gen.push(ids[-1:], "length")]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == text
    assert (gen.finish_reason, gen.completion_tokens) == ("length", len(ids))

    gen = backend.generate(Params(ids, 64, stop=["world, the s", "wide:x"]))
    pieces = [gen.push([i]) for i in ids]
    assert "".join(pieces) == "Smile \U0001F99C wide: the " and gen.finish_reason == "stop"
    assert gen.completion_tokens == len(ids)     # ' sky' completes the stop string
    wide = ids.index(tok(" wide", add_special_tokens=False)["input_ids"][0])
    assert "".join(pieces[:wide + 2]) == "Smile \U0001F99C ", "'wide:' could start 'wide:x': held back"
    assert pieces[wide + 2] == "wide: the", "then let go"


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CHAT_REFUSALS = [   # (create() arguments, param, what the message says)
    ({"n": 2}, "n", "only n=1"),
    ({"logprobs": True}, "logprobs", "logprobs are not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "tools"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions", "functions"),
    ({"function_call": "auto"}, "function_call", "function_call"),
    ({"logit_bias": {"50": 1}}, "logit_bias", "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty", "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE]}]},
     "messages[0].content[1]", "only text content parts"),
    ({"messages": []}, "messages", "empty array"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].role", "'tool' is not supported"),
    ({"extra_body": {"guided_json": {}}}, "guided_json", "Unrecognized request argument supplied: guided_json"),
    ({"temperature": -0.5}, "temperature", "expected a value >= 0"),
    ({"temperature": "hot"}, "temperature", "Invalid type for 'temperature': expected a number"),
    ({"top_p": 0}, "top_p", "expected a value > 0"),
    ({"top_p": 1.5}, "top_p", "expected a value <= 1"),
    ({"max_tokens": 0}, "max_tokens", "expected a value >= 1"),
    ({"max_tokens": 2.5}, "max_tokens", "expected an integer"),
    ({"max_tokens": 10 ** 6}, "max_tokens", "maximum context length is"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", "expected a value >= 1"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream' is enabled"),
    ({"stop": [""]}, "stop", "must not be empty"),
    ({"extra_body": {"stop_token_ids": [10 ** 7]}}, "stop_token_ids", "outside the vocabulary"),
    ({"extra_body": {"top_k": -2}}, "top_k", "expected a value >= -1"),
    ({"seed": "7"}, "seed", "expected an integer"),
]
COMPLETION_REFUSALS = [
    ({"prompt": ["one prompt", "another"]}, "prompt", "2 prompts in one request"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [5, 10 ** 7]}, "prompt", "token id 10000000 is outside the vocabulary"),
    ({"echo": True}, "echo", "echo"),
    ({"best_of": 2}, "best_of", "best_of"),
    ({"suffix": "and so on"}, "suffix", "suffix"),
    ({"logprobs": 1}, "logprobs", "logprobs"),
    ({"extra_body": {"messages": chat("hi")}}, "messages", "Unrecognized request argument supplied: messages"),
]


@pytest.mark.parametrize("kind, arguments, param, message",
                         [("chat", *c) for c in CHAT_REFUSALS] + [("completions", *c) for c in COMPLETION_REFUSALS],
                         ids=[f"chat-{c[1]}-{i}" for i, c in enumerate(CHAT_REFUSALS)] +
                             [f"completions-{c[1]}-{i}" for i, c in enumerate(COMPLETION_REFUSALS)])
def test_what_is_not_implemented_is_refused_with_openais_error(client, kind, arguments, param, message):
    arguments = dict(arguments)
    if kind == "chat":
        arguments.setdefault("messages", chat("Hello"))
        create = client.chat.completions.create
    else:
        arguments.setdefault("prompt", "Hello")
        create = client.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        if "max_completion_tokens" not in arguments:
            arguments.setdefault("max_tokens", 4)
        create(model=MODEL, **arguments)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param and message in error["message"], error


def test_bad_bodies_and_a_wrong_model(client, front):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=chat("Hello"))
    assert caught.value.status_code == 404 and caught.value.body["code"] == "model_not_found"
    for body, message in ((b"{not json", "could not parse the JSON body"),
                          (b'["a list"]', "must be a JSON object"),
                          (b'{"messages": [{"role": "user", "content": "hi"}]}', "must provide a model")):
        r = httpx.post(f"{front.url}/v1/chat/completions", content=body, timeout=10)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.get(f"{front.url}/v1/embeddings", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_models_health_and_metrics(client, front, offline):
    """/v1/models names the served model, /health is 200, and a request moves the counters."""
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{front.url}/health", timeout=10).status_code == 200
    text = httpx.get(f"{front.url}/metrics", timeout=10).text
    for name, kind in (("eagle_trt_requests_total", "counter"), ("eagle_trt_prompt_tokens_total", "counter"),
                       ("eagle_trt_generation_tokens_total", "counter"), ("eagle_trt_requests_running", "gauge"),
                       ("eagle_trt_requests_waiting", "gauge"),
                       ("eagle_trt_accepted_tokens_per_iteration", "histogram"),
                       ("eagle_trt_time_to_first_token_seconds", "histogram"),
                       ("eagle_trt_inter_token_latency_seconds", "histogram")):
        assert f"# TYPE {name} {kind}\n" in text, name
    before = metrics(front)
    tokens = offline["tokens"][2]
    client.chat.completions.create(model=MODEL, messages=chat(offline["prompts"][2]), temperature=0,
                                   max_tokens=NEW_TOKENS)
    after = metrics(front)
    assert requests_total(after) == requests_total(before) + 1
    assert after["eagle_trt_prompt_tokens_total"] - before["eagle_trt_prompt_tokens_total"] == len(offline["ids"][2])
    assert after["eagle_trt_generation_tokens_total"] - before["eagle_trt_generation_tokens_total"] == len(tokens)
    ttft = "eagle_trt_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    accepted = "eagle_trt_accepted_tokens_per_iteration"
    iterations = after[f"{accepted}_count"] - before[f"{accepted}_count"]
    assert 1 <= iterations <= len(tokens) - 1     # every response after the first: one iteration each
    assert after[f"{accepted}_sum"] - before[f"{accepted}_sum"] >= len(tokens) - 1
    assert after['eagle_trt_accepted_tokens_per_iteration_bucket{le="+Inf"}'] == after[f"{accepted}_count"]
    itl = "eagle_trt_inter_token_latency_seconds_count"
    assert after[itl] - before[itl] == len(tokens) - 1      # one observation per token after the first
    assert after["eagle_trt_requests_running"] == after["eagle_trt_requests_waiting"] == 0


def test_client_disconnecting_mid_stream_cancels_the_request_in_triton(client, front, triton, offline):
    """An HTTP client that goes away after two chunks, and one that stops waiting for a plain
    reply: the front end cancels its gRPC stream, the model logs the cancellation and frees the
    slot, and the next request is served."""
    cancelled = triton.log.count(CANCELLED)
    before = metrics(front)
    body = {"model": MODEL, "messages": chat(offline["prompts"][3]), "temperature": 0, "max_tokens": 400,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{front.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 2:
                    break
    deadline = time.monotonic() + 30
    while triton.log.count(CANCELLED) == cancelled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert triton.log.count(CANCELLED) == cancelled + 1, "the abandoned request kept decoding in Triton"
    after = metrics(front)
    assert after['eagle_trt_requests_total{finish_reason="cancelled"}'] == \
        before['eagle_trt_requests_total{finish_reason="cancelled"}'] + 1
    assert after["eagle_trt_requests_running"] == 0
    assert after["eagle_trt_generation_tokens_total"] - before["eagle_trt_generation_tokens_total"] < 400
    # Not streamed: a client that gives up waiting for the whole reply is noticed too. It leaves
    # once the reply's first token has reached the front end, so the request is decoding in Triton
    # (a timed-out client could leave before Triton has it, or after a short reply has finished).
    ttft = "eagle_trt_time_to_first_token_seconds_count"
    first_tokens = metrics(front)[ttft]
    payload = json.dumps(dict(body, stream=False)).encode()
    with socket.create_connection((front.host, front.port), timeout=30) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 30
        while metrics(front)[ttft] == first_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics(front)[ttft] == first_tokens + 1, "the plain request's first token never came"
    deadline = time.monotonic() + 30
    while triton.log.count(CANCELLED) == cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert triton.log.count(CANCELLED) == cancelled + 2, "the abandoned plain request kept decoding in Triton"
    r = client.chat.completions.create(model=MODEL, messages=chat(offline["prompts"][0]), temperature=0,
                                       max_tokens=NEW_TOKENS)
    assert r.choices[0].message.content == decode(offline, offline["tokens"][0])
    assert triton.alive() and metrics(front)["eagle_trt_requests_running"] == 0


def test_triton_stopped_under_the_front_end_answers_503_at_once(repository):
    """Its own tritonserver and front end: with Triton stopped, the front end stays up and
    answers 503 (service_unavailable) in well under a second, streamed or not, and /health 503."""
    triton = LocalTriton(repository).__enter__()
    try:
        with HttpServer(create_app(TritonBackend(repository, triton.grpc_url, MODEL))) as http:
            client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert httpx.get(f"{http.url}/health", timeout=10).status_code == 200
            client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=2, temperature=0)
            triton.__exit__(None, None, None)
            assert not triton.alive()
            assert httpx.get(f"{http.url}/health", timeout=10).status_code == 503
            for stream in (False, True):
                start = time.monotonic()
                with pytest.raises(openai.InternalServerError) as caught:
                    client.chat.completions.create(model=MODEL, messages=chat("Hello"), max_tokens=4, stream=stream)
                assert time.monotonic() - start < 2.0, "the front end waited for a Triton that is gone"
                assert caught.value.status_code == 503
                error = caught.value.body
                assert error["type"] == "service_unavailable" and "not reachable" in error["message"], error
            assert httpx.get(f"{http.url}/v1/models", timeout=10).status_code == 200    # still up
            assert metrics_at(http.url)['eagle_trt_requests_total{finish_reason="error"}'] == 2
    finally:
        triton.__exit__(None, None, None)


def metrics_at(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.append(int(entry))
    return out


def test_the_command_line_serves_and_stops_on_sigterm(repository, offline, tmp_path):
    """`python -m eagle_trt.serve` as a subprocess: it starts its own tritonserver, answers under
    --served-model-name (and 404 under the Triton model's name), and SIGTERM stops it and its
    tritonserver."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "eagle_trt.serve", "--repository", str(repository),
                                 "--port", str(port), "--served-model-name", "smollm2-eagle"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "python -m eagle_trt.serve did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2-eagle", messages=chat(offline["prompts"][0]),
                                           temperature=0, max_tokens=NEW_TOKENS)
        assert r.model == "smollm2-eagle"
        assert r.choices[0].message.content == decode(offline, offline["tokens"][0])
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=MODEL, messages=chat("Hello"), max_tokens=2)
        servers = [p for p in children(proc.pid)
                   if "tritonserver" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert len(servers) == 1, "the command started no tritonserver of its own"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert not Path(f"/proc/{servers[0]}").exists(), "tritonserver outlived the command"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
