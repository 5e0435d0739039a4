"""The OpenAI-compatible server end to end: a real uvicorn server on a free port over the debug
model (random weights, CPU), driven by the official ``openai`` client and by raw ``httpx``.

Texts are checked against the model itself: greedy output must equal ``openk3.generate`` (the
plain, unpaged decoding loop) token for token, alone or in a batch of concurrent requests."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

# the serving extras are test dependencies (CI has them); the device image does not
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from openk3 import build_model, preset  # noqa: E402
from openk3.generate import generate  # noqa: E402
from openk3.serve.chat import ChatTemplate, ChatTemplateError  # noqa: E402
from openk3.serve.config import EngineConfig  # noqa: E402
from openk3.serve.engine import AsyncEngine, LLMEngine  # noqa: E402
from openk3.serve.server import build_app  # noqa: E402
from openk3.tokenizer import ByteTokenizer  # noqa: E402
from tests.helpers import uvicorn_thread  # noqa: E402

MODEL, KEY = "openk3-debug", "sk-test"
MAX_MODEL_LEN = 512


class VisibleTokenizer(ByteTokenizer):
    """UTF-8 bytes in; every token id out as a character of its own (from U+4E00), so each
    generated token of the random model is visible text, one character long."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


TOK = VisibleTokenizer()


@pytest.fixture(scope="module")
def srv():
    model = build_model(preset("debug"), seed=0).eval()
    engine = LLMEngine(model, TOK, EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=256, physical_block_size=64, hash_block_size=16,
        kda_checkpoint_interval=64, max_model_len=MAX_MODEL_LEN, cuda_graphs=False),
        eos_token_ids=(), model_name=MODEL)  # no EOS: outputs run to max_tokens or a stop string
    async_engine = AsyncEngine(engine)
    with (uvicorn_thread(build_app(async_engine, MODEL, api_key=KEY)) as url,
          httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http):
        yield SimpleNamespace(url=url, http=http, model=model, engine=async_engine, client=openai.OpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30))
    async_engine.shutdown()


def reference(srv, prompt: str, max_tokens: int) -> str:
    """Greedy continuation by the plain decoding loop, as text."""
    return TOK.decode(generate(srv.model, TOK.encode(prompt), max_tokens, temperature=0.0))


def metric_families(srv) -> dict:
    """/metrics as Prometheus' own text parser reads it, by family name."""
    r = srv.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in prometheus_parser.text_string_to_metric_families(r.text)}


def metrics(srv) -> dict[str, float]:
    """Every sample of /metrics: {'name{labels}': value}."""
    out = {}
    for family in metric_families(srv).values():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def wait_idle(srv, timeout: float = 10.0) -> None:
    """Until nothing runs or waits and every cache block and state slot is free again."""
    eng = srv.engine.engine
    bm = eng.block_manager
    deadline = time.monotonic() + timeout
    while True:
        s = srv.engine.stats()
        if (s.num_running == s.num_waiting == 0 and bm.num_free_blocks == bm.num_blocks
                and bm.num_free_state_slots == bm.num_state_slots and not eng.requests):
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}, {bm.num_free_blocks} free blocks"
        time.sleep(0.05)


# Completions and chat.


def test_completion_is_the_greedy_continuation(srv):
    r = srv.client.completions.create(model=MODEL, prompt="Hello, world", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == reference(srv, "Hello, world", 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (12, 12, 24)
    by_ids = srv.client.completions.create(model=MODEL, prompt=TOK.encode("Hello, world"), max_tokens=12,
                                           temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_completion_stream_and_stop_string(srv):
    full = reference(srv, "Once upon", 20)
    chunks = list(srv.client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    raw = srv.http.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 20, "temperature": 0,
                                                  "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")  # "data: {json}" events, blank-line separated, then [DONE]
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == full
    stop = full[8:10]  # the text is cut before the stop string's first occurrence
    r = srv.client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, temperature=0,
                                      stop=[stop, "never"])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_renders_the_default_template(srv):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    r = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference(srv, prompt, 10)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 10

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=10,
                                                     temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_fills_the_context(srv):
    r = srv.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x" * 400}], "temperature": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN and body["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_within_the_limit(srv, monkeypatch):
    """No max_tokens: the rest of the context, but never past ``max_tokens_limit`` (a limit the
    client did not send cannot fail its request)."""
    monkeypatch.setattr(srv.engine.engine.inputs.config, "max_tokens_limit", 7)
    r = srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "temperature": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["usage"]["completion_tokens"] == 7 and body["choices"][0]["finish_reason"] == "length"


def test_null_and_empty_fields_mean_their_defaults(srv):
    """JSON null for the fields OpenAI declares nullable, and the empty value of a feature the
    engine lacks (``logit_bias: {}``, ``suffix: ""``, ``tool_choice: "auto"``), as if absent."""
    base = srv.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}).json()
    r = srv.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "n": None,
        "stream": None, "logprobs": None, "logit_bias": {}, "tool_choice": "auto",
        "response_format": {"type": "text"}, "stream_options": None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert body["choices"][0]["message"] == base["choices"][0]["message"]
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": None, "suffix": "",
                                               "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage"' not in r.text, r.text
    wait_idle(srv)


def test_huge_top_k_and_tiny_temperature(srv):
    """A top_k past the vocabulary keeps every token; a temperature too small for fp32 logits to
    be divided by samples the argmax, not NaN probabilities (which gave token 0 every time)."""
    greedy = srv.client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=0)
    for temperature in (1e-40, 1e-30):
        r = srv.client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=temperature,
                                          seed=3, extra_body={"top_k": 2**31 - 1})
        assert r.choices[0].text == greedy.choices[0].text


def test_model_card(srv):
    card = srv.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("gpt-4")


def test_logprobs(srv):
    ids = TOK.encode("Log me")
    with torch.inference_mode():
        first = torch.log_softmax(srv.model(torch.tensor([ids])).logits[0, -1].float(), -1)
    r = srv.client.completions.create(model=MODEL, prompt="Log me", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 6
    assert lp.text_offset == list(range(6))
    assert lp.token_logprobs[0] == pytest.approx(first.max().item(), abs=1e-4)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == pytest.approx(chosen) and chosen == pytest.approx(max(top.values()))

    streamed = list(srv.client.completions.create(model=MODEL, prompt="Log me", max_tokens=6, temperature=0,
                                                  logprobs=3, stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    # a stop string that never matches holds text back while the tokens' log-probs go out: the
    # streamed offsets still count the tokens' text
    streamed = list(srv.client.completions.create(model=MODEL, prompt="Log me", max_tokens=6, temperature=0,
                                                  logprobs=3, stream=True, stop=["never"]))
    assert [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset

    c = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Log me"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert "".join(e.token for e in content) == c.choices[0].message.content and len(content) == 5
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_concurrent_requests_match_requests_alone(srv):
    prompts = [f"Request number {i}: " + "abc" * i for i in range(6)]
    kinds = [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}]  # greedy, and seeded sampling

    def run(i: int) -> str:
        return srv.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16,
                                             **kinds[i % 2]).choices[0].text

    alone = [run(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(run, range(6)))
    assert together == alone
    assert alone[0] == reference(srv, prompts[0], 16)
    wait_idle(srv)


# The other endpoints.


def test_models_health_and_auth(srv):
    assert [m.id for m in srv.client.models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_exposition(srv):
    kinds = {name: f.type for name, f in metric_families(srv).items()}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert kinds["openk3_" + name] == "histogram", name
    for name in ("prompt_tokens", "generation_tokens", "requests_finished", "prefix_cache_queries",
                 "prefix_cache_hits", "prefix_cache_saved_tokens", "num_preemptions"):
        assert kinds["openk3_" + name] == "counter", name
    for name in ("num_requests_running", "num_requests_waiting", "cache_usage_ratio", "prefix_cache_hit_rate"):
        assert kinds["openk3_" + name] == "gauge", name


def test_metrics_move(srv):
    before = metrics(srv)
    for name in ("openk3_num_requests_running", "openk3_num_requests_waiting", "openk3_cache_usage_ratio",
                 "openk3_prefix_cache_hit_rate", "openk3_prefix_cache_saved_tokens_total",
                 "openk3_time_to_first_token_seconds_count", "openk3_inter_token_latency_seconds_count"):
        assert name in before, name
    for _ in range(2):  # 39 tokens: the first request leaves a KDA checkpoint at token 32
        srv.client.completions.create(model=MODEL, prompt="Count me in. " * 3, max_tokens=7, temperature=0)
    after = metrics(srv)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["openk3_generation_tokens_total"] == 14
    assert delta["openk3_time_to_first_token_seconds_count"] == 2
    assert delta["openk3_inter_token_latency_seconds_count"] == 12
    assert delta['openk3_requests_finished_total{finish_reason="length"}'] == 2
    assert delta["openk3_prefix_cache_hits_total"] >= 1  # the second prompt hits the first one's prefix
    assert delta["openk3_prefix_cache_saved_tokens_total"] >= 1
    # one step per token, plus a step for each prefill chunk that ends before its prompt does
    prefill = delta["openk3_engine_prefill_steps_total"]
    assert prefill >= 2 and delta["openk3_engine_steps_total"] == 14 + prefill - 2
    assert delta["openk3_engine_step_seconds_total"] > delta["openk3_engine_prefill_step_seconds_total"] > 0
    assert after['openk3_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[
        "openk3_time_to_first_token_seconds_count"]


# Bad input: HTTP 400 in OpenAI's error format, naming the parameter.

LONG = "x" * MAX_MODEL_LEN
BAD = [
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "seed": "x"}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": "2"}, "n"),
    ("completions", {"prompt": "hi", "n": 129}, "n"),
    ("completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"prompt": "hi", "top_k": 10**400}, "top_k"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt"),
    ("completions", {"prompt": [1, 10**6]}, "prompt"),
    ("completions", {"prompt": LONG}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"prompt": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 99}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": {"f": 1}}, "tools"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_parameter(srv, endpoint, body, param):
    r = srv.http.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_malformed_body_and_unknown_model(srv):
    for content in (b"{not json", b"[1, 2]", b""):
        r = srv.http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = srv.http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "unknown_field": [1]})
    assert r.status_code == 200  # unknown fields are ignored
    wait_idle(srv)


def test_engine_failure_is_a_server_error(srv, monkeypatch):
    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(srv.engine.engine.runner, "execute", boom)
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    events = r.text.split("\n\n")  # the status line went out before the failure: an error event
    assert r.status_code == 200 and events[-2:] == ["data: [DONE]", ""]
    assert "boom" in json.loads(events[-3][6:])["error"]["message"]
    monkeypatch.undo()
    wait_idle(srv)


# Disconnects free everything.


def test_streaming_client_disconnect_aborts(srv):
    before = metrics(srv)
    max_tokens = MAX_MODEL_LEN - 20
    body = {"prompt": "Go on and on", "max_tokens": max_tokens, "stream": True}
    with (httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}) as http,
          http.stream("POST", "/v1/completions", json=body) as r):
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]  # then the connection closes
    wait_idle(srv)
    delta = {k: v - before.get(k, 0.0) for k, v in metrics(srv).items()}
    assert delta['openk3_requests_finished_total{finish_reason="abort"}'] == 1
    assert delta["openk3_generation_tokens_total"] < max_tokens / 2


def test_non_streaming_client_disconnect_aborts(srv):
    before = metrics(srv)
    max_tokens = MAX_MODEL_LEN - 20
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", timeout=0.5, headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "Go on and on", "max_tokens": max_tokens})
    wait_idle(srv)
    delta = {k: v - before.get(k, 0.0) for k, v in metrics(srv).items()}
    assert delta['openk3_requests_finished_total{finish_reason="abort"}'] == 1
    assert delta["openk3_generation_tokens_total"] < max_tokens / 2


# Chat templates.


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages")])
def test_a_lone_surrogate_is_400_not_500(srv, endpoint, body, param):
    """Valid JSON ("\\ud800", as json.dumps writes it) but no text: tokenizers raised."""
    r = srv.http.post(f"/v1/{endpoint}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "not valid Unicode text" in r.json()["error"]["message"]


def test_a_malformed_content_part_is_named_not_the_string_branch(srv):
    """The 400 reported the union's first branch: 'content.str: Input should be a valid string'."""
    r = srv.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages.0.content.0.image_url.url: Field required"


def test_templates_render_as_transformers_does_and_see_the_tools(tmp_path):
    """Kimi K2's template writes tools | tojson(separators=...); that, {% break %}, strftime_now
    and {% generation %} failed, and a request's tools never reached the template."""
    msgs = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "x"}]
    assert ChatTemplate("{{ messages | tojson(separators=(',', ':')) }}").render(msgs[:1]) == \
        '[{"role":"user","content":"héllo"}]'
    assert ChatTemplate("{{ messages[0] | tojson(ensure_ascii=True, sort_keys=True) }}").render(msgs) == \
        '{"content": "h\\u00e9llo", "role": "user"}'
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}").render(msgs) == "héllo"
    assert ChatTemplate("{{ strftime_now('%Y') | length }}").render(msgs) == "4"
    assert ChatTemplate("{% generation %}{{ messages[1].content }}{% endgeneration %}").render(msgs) == "x"
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = "{% if tools %}[{{ tools | tojson }}]{% endif %}{{ messages[0].content }}"
    assert ChatTemplate(with_tools).render(msgs, tools=tools) == '[[{"type": "function", "function": {"name": "f"}}]]héllo'
    # through the server: the tools make the prompt longer by their rendering
    from fastapi.testclient import TestClient

    engine = LLMEngine(build_model(preset("debug"), seed=0).eval(), TOK, EngineConfig(
        max_num_seqs=2, physical_block_size=64, hash_block_size=16, kda_checkpoint_interval=64,
        max_model_len=512, cuda_graphs=False), eos_token_ids=())
    async_engine = AsyncEngine(engine)
    try:
        client = TestClient(build_app(async_engine, MODEL, chat_template=ChatTemplate(with_tools)))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        plain = client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        declared = client.post("/v1/chat/completions", json={**body, "tools": tools}).json()["usage"]["prompt_tokens"]
        assert (plain, declared) == (2, 2 + len(f"[{json.dumps(tools)}]"))
    finally:
        async_engine.shutdown()


def test_a_tokenizer_dirs_template_comes_before_the_checkpoints(tmp_path):
    """``serve --tokenizer DIR`` took DIR's tokenizer but the checkpoint's (or the default) template."""
    for name, tag in (("tok", "T"), ("ckpt", "C")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"chat_template": tag}))
    (tmp_path / "bare").mkdir()
    assert ChatTemplate.from_checkpoint(tmp_path / "tok", tmp_path / "ckpt").source == "T"
    assert ChatTemplate.from_checkpoint(tmp_path / "bare", tmp_path / "ckpt").source == "C"
    assert ChatTemplate.from_checkpoint(tmp_path / "bare").source == ChatTemplate().source


def test_checkpoint_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = ChatTemplate.from_checkpoint(tmp_path)
    assert t.render([{"role": "user", "content": "héllo"}]) == '<s>[user]"héllo"[assistant]'
    assert ChatTemplate.from_checkpoint(tmp_path / "missing").source == ChatTemplate().source
    with pytest.raises(ChatTemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])


def test_health_reports_a_stopped_engine():
    from fastapi.testclient import TestClient

    engine = LLMEngine(build_model(preset("debug"), seed=0).eval(), TOK, EngineConfig(
        max_num_seqs=2, physical_block_size=64, hash_block_size=16, kda_checkpoint_interval=64,
        max_model_len=128, cuda_graphs=False))
    async_engine = AsyncEngine(engine)
    client = TestClient(build_app(async_engine, MODEL))
    assert client.get("/health").status_code == 200
    async_engine.shutdown()
    assert client.get("/health").status_code == 503


# Scoring, several prompts and choices (what lm-evaluation-harness sends).


def _forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one plain forward pass: [len(ids) - 1]."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_a_forward_pass(srv, max_tokens):
    prompt = "def add(a, b):\n    return a + b\n" * 3  # crosses KDA checkpoints: several prefill chunks
    ids = TOK.encode(prompt)
    r = srv.http.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 2,
                                               "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(choice["text"]) == len(prompt) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _forward_logprobs(srv.model, ids)
    got = torch.tensor(lp["token_logprobs"][1:len(ids)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for top, value in zip(lp["top_logprobs"][1:len(ids)], got.tolist()):
        assert len(top) <= 2 and max(top.values()) >= value - 1e-4
    assert lp["text_offset"][:3] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    wait_idle(srv)


def test_echo_scoring_ignores_the_prefix_cache(srv):
    prompt = "cached " * 20
    for _ in range(2):  # the second request's prefix is cached, but its prompt must be scored
        r = srv.http.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1,
                                                   "max_tokens": 0})
        lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert None not in lp[1:] and len(lp) == len(TOK.encode(prompt))
    torch.testing.assert_close(torch.tensor(lp[1:]), _forward_logprobs(srv.model, TOK.encode(prompt)),
                               rtol=0, atol=1e-4)


def test_several_prompts_and_choices(srv):
    prompts = ["alpha", "beta gamma"]
    r = srv.http.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 5,
                                               "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts[:3])) > 1  # different seeds per choice
    again = srv.http.post("/v1/completions", json={"prompt": prompts[1], "n": 3, "max_tokens": 5,
                                                   "temperature": 1.0, "seed": 7}).json()
    assert [c["text"] for c in again["choices"]] == texts[3:]  # reproducible, prompt by prompt
    assert body["usage"]["prompt_tokens"] == len("alpha") + len("beta gamma")
    assert body["usage"]["completion_tokens"] == 30
    streamed = srv.client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5,
                                             temperature=1.0, seed=7, stream=True)
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert [by_index[i] for i in range(6)] == texts
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              n=2, max_tokens=4, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content
    wait_idle(srv)


def test_a_request_is_checked_once(srv, monkeypatch):
    """The server checks each prompt once, before its stream starts; its choices reach the engine
    without the ids checked again (a 32K prompt's check is ~0.5 ms of the event loop's time)."""
    inputs = srv.engine.inputs
    calls = []
    checked = inputs.checked
    monkeypatch.setattr(inputs, "checked", lambda *a: calls.append(a) or checked(*a))
    r = srv.http.post("/v1/completions", json={"prompt": ["alpha", "beta"], "n": 2, "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert len(calls) == 2
    calls.clear()
    r = srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3, "n": 3, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and len(calls) == 1
    monkeypatch.undo()
    wait_idle(srv)


def test_streamed_echo_starts_with_the_prompt(srv):
    chunks = list(srv.client.completions.create(model=MODEL, prompt="Echo me", echo=True, logprobs=1,
                                                max_tokens=3, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text.startswith("Echo me") and len(text) == len("Echo me") + 3
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len("Echo me") + 3
    wait_idle(srv)


# Graceful shutdown.


def test_shutdown_ends_streams_with_an_error_event_and_waiting_requests_with_503():
    """Once the grace period of a shutdown ends, a running stream gets an error event and
    [DONE], a waiting non-streaming request a 503, a new request a 503 at once; the engine
    frees everything they held."""
    from openk3.serve.server import SHUTDOWN_MESSAGE

    engine = LLMEngine(build_model(preset("debug"), seed=0).eval(), TOK, EngineConfig(
        max_num_seqs=4, physical_block_size=64, hash_block_size=16, kda_checkpoint_interval=64,
        max_model_len=MAX_MODEL_LEN, cuda_graphs=False), eos_token_ids=())
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, MODEL)
    body = {"prompt": "Go on and on", "max_tokens": MAX_MODEL_LEN - 20}
    try:
        with uvicorn_thread(app) as base:
            url = base + "/v1/completions"
            with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as http, \
                    http.stream("POST", url, json={**body, "stream": True}) as r:
                waiting = pool.submit(httpx.post, url, json=body, timeout=30)
                lines = r.iter_lines()
                assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]
                while len(async_engine._streams) < 2:  # the non-streaming request is in the engine too
                    time.sleep(0.01)
                loop = next(iter(async_engine._streams.values()))[0]
                loop.call_soon_threadsafe(app.state.draining.begin, 0.05)
                events = [line for line in lines if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                assert json.loads(events[-2][6:])["error"]["message"] == SHUTDOWN_MESSAGE
                assert waiting.result().status_code == 503
                assert httpx.post(url, json=body, timeout=30).status_code == 503
            deadline = time.monotonic() + 10
            while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
                assert time.monotonic() < deadline, "the engine kept what the cut requests held"
                time.sleep(0.02)
    finally:
        async_engine.shutdown()
