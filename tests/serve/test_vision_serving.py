"""Images through the serving engine and the OpenAI chat endpoint, on a tiny vision-language
model (``debug-vl`` with random weights and a vocabulary wide enough for byte text), CPU, fp32.

Every greedy output is checked against ``openk3.generate`` (the plain, unpaged loop, the tower
run on the whole prompt at once) with the same images: chunked prefills that cut through an
image's placeholders, one-token chunks at image positions, batches mixing requests with and
without images, preemption, and prefix-cache hits keyed by image content."""

from __future__ import annotations

import base64
import dataclasses
import io
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from openk3 import build_model, preset
from openk3.generate import generate
from openk3.serve.config import EngineConfig
from openk3.serve.engine import AsyncEngine, LLMEngine
from openk3.serve.sampler import InvalidRequest, SamplingParams
from openk3.tokenizer import VisibleTokenizer
from openk3.vision.preprocess import pack_images
from tests.helpers import uvicorn_thread

PAD, BEGIN, CONTENT, END = 300, 301, 302, 303
MEDIA_TOKENS = {"<|media_pad|>": PAD, "<|media_begin|>": BEGIN, "<|media_content|>": CONTENT,
                "<|media_end|>": END}
GREEDY = SamplingParams(temperature=0, max_tokens=8)


class MediaTokenizer(VisibleTokenizer):
    """Bytes as text, plus the release's media tokens, so image blocks take the release format
    ``<|media_begin|>image {W}x{H}<|media_content|> pads <|media_end|>``."""

    def token_id(self, name: str) -> int | None:
        return MEDIA_TOKENS.get(name)


TOK = MediaTokenizer()


@pytest.fixture(scope="module")
def model():
    cfg = preset("debug-vl")
    cfg = cfg.replace(vocab_size=384, vision_config=dataclasses.replace(
        cfg.vision_config, media_placeholder_token_id=PAD))
    m = build_model(cfg, seed=0).eval()
    with torch.no_grad():  # non-uniform AttnRes mixing and a strong image signal
        for name, p in m.named_parameters():
            if name.endswith("_res.proj.weight"):
                p.normal_(0, 0.5)
        m.mm_projector.post_norm.weight.mul_(4)
    return m


def noise(seed: int, width: int, height: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).byte().numpy())


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_engine(model, **kw) -> LLMEngine:
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 8, "physical_block_size": 16, "hash_block_size": 8,
           "kda_checkpoint_interval": 16, "max_model_len": 256, "cuda_graphs": False}
    return LLMEngine(model, TOK, EngineConfig(**{**cfg, **kw}), eos_token_ids=())


def reference(model, out, images: list[Image.Image], max_tokens: int = 8) -> list[int]:
    return generate(model, out.prompt_token_ids, max_tokens, temperature=0.0,
                    images=pack_images(images, model.cfg.vision_config))


def block(width: int, height: int, tokens: int) -> list[int]:
    return [BEGIN] + TOK.encode(f"image {width}x{height}") + [CONTENT] + [PAD] * tokens + [END]


def assert_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_state_slots == bm.num_state_slots
    assert not eng.requests and not eng.scheduler.has_unfinished() and not eng.runner.images


def test_engine_matches_generate_with_images(model, tmp_path):
    """Chunks of 8 tokens cut through 12- and 6-token placeholder runs; one batch mixes a
    prepended image, a placeholder in the middle of token ids, two images (bytes and a path),
    and a text-only prompt."""
    a, b, c = noise(1, 112, 84), noise(2, 56, 84), noise(3, 56, 56)  # 12, 6 and 4 tokens
    c.save(tmp_path / "c.png")
    requests = [
        ({"prompt": "what is this?", "images": [a]}, [a]),
        ({"prompt": TOK.encode("see ") + [PAD] + TOK.encode(" here"), "images": [b]}, [b]),
        ("plain text, no image at all", []),
        ({"prompt": [1] + TOK.encode("two"), "images": [png_bytes(a), str(tmp_path / "c.png")]}, [a, c]),
    ]
    eng = make_engine(model)
    outs = eng.generate([r for r, _ in requests], GREEDY)
    assert outs[0].prompt_token_ids == block(112, 84, 12) + TOK.encode("what is this?")
    assert outs[1].prompt_token_ids == TOK.encode("see ") + [PAD] * 6 + TOK.encode(" here")  # in place
    assert outs[3].prompt_token_ids == [1] + block(112, 84, 12) + block(56, 56, 4) + TOK.encode("two")
    for out, (_, images) in zip(outs, requests):
        assert out.token_ids == (reference(model, out, images) if images else
                                 generate(model, out.prompt_token_ids, 8, temperature=0.0))
    assert eng.runner.num_images_encoded == 4  # once per image
    assert_free(eng)


def test_one_token_chunks_at_image_positions(model):
    """A budget of 2 tokens: a decoding request takes one, the image prompt advances one token a
    step, so image positions arrive as one-token chunks (they must not take the decode path)."""
    a = noise(4, 84, 56)
    eng = make_engine(model, max_num_batched_tokens=2)
    text, image = eng.generate(["hi", {"prompt": "x", "images": [a]}], GREEDY)
    assert text.token_ids == generate(model, TOK.encode("hi"), 8, temperature=0.0)
    assert image.token_ids == reference(model, image, [a])
    assert_free(eng)


def test_preemption_recomputes_images(model):
    images = [noise(10 + i, 84, 84) for i in range(3)]  # 9 tokens each
    prompts = [{"prompt": f"describe pic number {i}", "images": [im]} for i, im in enumerate(images)]  # 44 tokens
    eng = make_engine(model, num_blocks=7, max_num_batched_tokens=32, max_model_len=7 * 16 - 1)
    outs = eng.generate(prompts, GREEDY)
    assert eng.stats.num_preemptions > 0
    for out, im in zip(outs, images):
        assert out.token_ids == reference(model, out, [im])
    assert_free(eng)


def test_prefix_cache_is_keyed_by_image_content(model):
    """Same prompt ids, another image: no hit on image positions, another output; the same
    image again: a hit past the image (the tower does not run) and the same output."""
    a, b = noise(20, 112, 84), noise(21, 112, 84)
    eng = make_engine(model, max_num_batched_tokens=64)
    prompt = "a long enough question about this image"
    first, = eng.generate([{"prompt": prompt, "images": [a]}], GREEDY)
    other, = eng.generate([{"prompt": prompt, "images": [b]}], GREEDY)
    encoded = eng.runner.num_images_encoded
    again, = eng.generate([{"prompt": prompt, "images": [a]}], GREEDY)
    assert first.prompt_token_ids == other.prompt_token_ids == again.prompt_token_ids
    image_start = first.prompt_token_ids.index(PAD)
    assert other.num_cached_tokens <= image_start and other.token_ids != first.token_ids
    assert other.token_ids == reference(model, other, [b])
    assert again.num_cached_tokens > image_start + 12 and again.token_ids == first.token_ids
    assert eng.runner.num_images_encoded == encoded  # the hit covered the image
    assert_free(eng)


def test_bad_image_requests(model):
    eng = make_engine(model)
    a = noise(5, 56, 56)
    with pytest.raises(InvalidRequest, match=r"images\[1\].*not a readable image") as e:
        eng.add_request("x", GREEDY, images=[a, b"not an image"])
    assert e.value.param == "images"
    with pytest.raises(InvalidRequest, match="2 image placeholder tokens .* for 1 images") as e:
        eng.add_request([PAD, 5, PAD], GREEDY, images=[a])
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="over the limit"):
        make_engine(model, max_image_bytes=100).add_request("x", GREEDY, images=[png_bytes(a)])
    text_model = build_model(preset("debug"), seed=0).eval()
    text_engine = LLMEngine(text_model, TOK, EngineConfig(max_model_len=64, cuda_graphs=False))
    with pytest.raises(InvalidRequest, match="no vision tower"):
        text_engine.add_request("x", GREEDY, images=[a])
    assert not eng.requests and not eng.runner.images


# The OpenAI chat endpoint, over a real uvicorn server.

MAX_IMAGE_BYTES = 16384


@contextmanager
def serving(engine: LLMEngine):
    """The app over ``engine`` on a free port, with an ``httpx`` and an ``openai`` client (the
    serving extras are test dependencies; without them these tests skip)."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    from openk3.serve.server import build_app

    async_engine = AsyncEngine(engine)
    try:
        with uvicorn_thread(build_app(async_engine, "vl")) as url, httpx.Client(base_url=url, timeout=30) as http:
            yield SimpleNamespace(http=http, client=openai.OpenAI(base_url=url + "/v1", api_key="x",
                                                                  max_retries=0, timeout=30))
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def srv(model):
    with serving(make_engine(model, max_image_bytes=MAX_IMAGE_BYTES)) as s:
        yield s


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_chat_with_an_image_matches_generate(srv, model):
    """The image's block sits where its content part is, inside the ChatML turn."""
    a = noise(30, 84, 56)  # 6 tokens
    content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": data_url(a)}},
               {"type": "text", "text": " briefly."}]
    r = srv.client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                           max_tokens=6, temperature=0)
    ids = (TOK.encode("<|im_start|>user\nDescribe ") + block(84, 56, 6)
           + TOK.encode(" briefly.<|im_end|>\n<|im_start|>assistant\n"))
    want = generate(model, ids, 6, temperature=0.0, images=pack_images([a], model.cfg.vision_config))
    assert r.choices[0].message.content == TOK.decode(want)
    assert r.usage.prompt_tokens == len(ids)
    stream = srv.client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                                max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TOK.decode(want)


BAD_URLS = {
    "bad base64": ("data:image/png;base64,@@not-base64@@", "not valid base64"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"hello world").decode(), "not a readable image"),
    "http": ("https://example.com/cat.png", "not fetched"),
    "scheme": ("file:///etc/passwd", "only data URLs"),
    "media type": ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64"),
    "too large": (data_url(noise(31, 112, 112)), "over the limit"),
}


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_malformed_image_part_is_400_naming_it(srv, case):
    url, why = BAD_URLS[case]
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    r = srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages[0].content[1].image_url" in err["message"], err
    assert why in err["message"], err


def test_image_part_without_url_and_text_only_model(srv):
    r = srv.http.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and "messages[1].content[0].image_url is required" in r.json()["error"]["message"]
    text_model = build_model(preset("debug"), seed=0).eval()
    with serving(LLMEngine(text_model, TOK, EngineConfig(max_model_len=64, cuda_graphs=False))) as text_srv:
        content = [{"type": "image_url", "image_url": {"url": data_url(noise(1, 56, 56))}}]
        r = text_srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400
    assert "messages[0].content[0]: this model is text-only" in r.json()["error"]["message"]


def test_block_hashes_include_image_content():
    """Equal token ids: the hash blocks before the image agree, those holding it differ."""
    from openk3.serve.block_manager import BlockManager
    from openk3.serve.sequence import ImageSpan, Sequence

    ids = [7] * 10 + [PAD] * 4 + list(range(10, 28))  # 32 tokens: hash blocks 0-3, image in block 1
    a, b, c = (Sequence(name, ids, 4, image_spans=(ImageSpan(10, 4, digest),))
               for name, digest in (("a", b"A"), ("b", b"B"), ("c", b"A")))
    bm = BlockManager(EngineConfig(physical_block_size=16, hash_block_size=8, kda_checkpoint_interval=16), 8, 3)
    ha, hb, hc = (bm._hash_chain(s, 4) for s in (a, b, c))
    assert ha == hc and ha[0] == hb[0] and all(x != y for x, y in zip(ha[1:], hb[1:]))
