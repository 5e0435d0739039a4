"""``ProcessEngine``: the engine in a spawned process gives the streams exactly what
``AsyncEngine`` (the engine on a thread) gives them, fails requests and dies loudly, and serves
the OpenAI app."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from openk3 import build_model, preset
from openk3.serve.config import EngineConfig
from openk3.serve.engine import AsyncEngine, LLMEngine
from openk3.serve.engine_process import EngineError, EngineProcess, ProcessEngine
from openk3.serve.sampler import InvalidRequest, SamplingParams
from openk3.tokenizer import VisibleTokenizer

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=64, physical_block_size=64, hash_block_size=16,
              kda_checkpoint_interval=64, max_model_len=256, cuda_graphs=False)


def debug_engine(fail: str | None = None) -> LLMEngine:
    """The engine both sides build (the process runs this as its factory)."""
    if fail is not None:
        raise ValueError(fail)
    model = build_model(preset("debug"), seed=0).eval()
    return LLMEngine(model, VisibleTokenizer(), EngineConfig(**CONFIG), eos_token_ids=(), model_name="dbg")


@pytest.fixture(scope="module")
def engines():
    process = ProcessEngine(debug_engine)
    thread = AsyncEngine(debug_engine())
    yield process, thread
    process.shutdown()
    thread.shutdown()


REQUESTS = [  # prompt, params: greedy and seeded sampling, stop strings, log-probabilities
    ([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6)),
    ([9] * 70, SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=2)),
    ([1, 2, 3], SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=1, logprobs=0)),
    ([4, 4], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0)),
]


async def _collect(engine, prompt, params, rid):
    return [o async for o in engine.generate(prompt, params, rid)]


async def _run_all(engine, tag: str, requests=REQUESTS):
    return await asyncio.gather(*(_collect(engine, p, sp, f"{tag}{i}") for i, (p, sp) in enumerate(requests)))


def _rounded(lps):
    """Log-probabilities to 1e-4: the two engines batch the requests as they arrive, and CPU
    matmuls of other batch sizes differ in the last bits."""
    if lps is None:
        return None
    return [None if lp is None else (lp.token_id, round(lp.logprob, 4), {i: round(v, 4) for i, v in lp.top.items()})
            for lp in lps]


def _final(outputs):
    """The last output, with the per-step deltas' sums (how a consumer sees them)."""
    last = outputs[-1]
    return (last.prompt_token_ids, last.token_ids, last.text, _rounded(last.logprobs),
            _rounded(last.prompt_logprobs), last.finished, last.finish_reason,
            sum((o.delta_token_ids for o in outputs), []), "".join(o.delta_text for o in outputs))


def test_outputs_equal_the_thread_engines(engines):
    process, thread = engines
    assert process.model_name == "dbg" and process.inputs.max_model_len == thread.inputs.max_model_len
    by_process = asyncio.run(_run_all(process, "p"))
    by_thread = asyncio.run(_run_all(thread, "t"))
    for a, b in zip(by_process, by_thread):
        assert _final(a) == _final(b) and a[-1].finished
    assert len(by_process[1][-1].logprobs) == 5 and len(by_process[2][-1].prompt_logprobs) == 3
    assert by_process[3][-1].token_ids == [] and by_process[3][-1].prompt_logprobs[0] is None
    # the stop string cuts the text in the engine; the server's copy is the same text
    full = by_thread[2][-1].text
    stop = SamplingParams(temperature=0, max_tokens=10, stop=[full[3:5]])
    a, b = asyncio.run(_collect(process, [1, 2, 3], stop, "ps")), asyncio.run(_collect(thread, [1, 2, 3], stop, "ts"))
    assert _final(a) == _final(b) and a[-1].finish_reason == "stop" and a[-1].text == full[:full.find(full[3:5])]


def test_bad_input_is_refused_in_the_server_process(engines):
    process, _ = engines
    with pytest.raises(InvalidRequest, match="prompt: token ids must be integers"):
        asyncio.run(_collect(process, [1, 10**6], SamplingParams(max_tokens=2), "bad"))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        asyncio.run(_collect(process, [1, 2], SamplingParams(max_tokens=1000), "long"))


def test_an_abandoned_stream_aborts_its_request(engines):
    process, _ = engines

    async def first_then_leave():
        stream = process.generate([3, 3, 3], SamplingParams(temperature=0, max_tokens=100), "gone")
        first = await anext(stream)
        await stream.aclose()
        return first

    before = process.stats().generation_tokens
    os.kill(process._proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the server stops its engine, not the signal
    os.kill(process._proc.pid, signal.SIGTERM)
    assert asyncio.run(first_then_leave()).delta_token_ids
    for _ in range(200):  # the abort reaches the engine between its steps
        stats = process.stats()
        if stats.num_running == stats.num_waiting == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert stats.num_running == stats.num_waiting == 0 and stats.generation_tokens - before < 50


def test_a_factory_that_raises_fails_the_constructor():
    with pytest.raises(ValueError, match="^no such checkpoint$"):  # as ``openk3 serve`` reports it
        ProcessEngine(functools.partial(debug_engine, fail="no such checkpoint"))


def test_a_dead_engine_fails_open_streams_and_reports_it():
    process = ProcessEngine(debug_engine)
    try:
        async def stream_then_kill():
            stream = process.generate([3, 3], SamplingParams(temperature=0, max_tokens=200), "k")
            await anext(stream)
            os.kill(process._proc.pid, signal.SIGKILL)
            async for _ in stream:
                pass

        with pytest.raises(EngineError, match="exited"):
            asyncio.run(stream_then_kill())
        assert not process.is_alive
        with pytest.raises(EngineError, match="not running"):
            asyncio.run(_collect(process, [1], SamplingParams(max_tokens=1), "late"))
    finally:
        process.shutdown()


def test_the_openai_server_over_the_process_engine(engines):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from openk3.serve.server import build_app
    from tests.helpers import uvicorn_thread

    process, thread = engines
    expected = asyncio.run(_collect(thread, VisibleTokenizer().encode("Hello"),
                                    SamplingParams(temperature=0, max_tokens=10), "ref"))[-1].text
    with uvicorn_thread(build_app(process, "dbg")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="dbg", prompt="Hello", max_tokens=10, temperature=0, stream=True))
        assert text == expected
        assert client.models.list().data[0].max_model_len == process.inputs.max_model_len


def test_several_clients_of_one_engine_process(engines):
    """``openk3 serve --api-servers 2``'s engine: each client's requests are its own (outputs
    equal the thread engine's, another client's abort of its id does nothing), and a client
    that goes away has its requests aborted while the other's keep running."""
    _, thread = engines
    owner = EngineProcess(debug_engine, clients=2)
    a, b = (ProcessEngine.connect(c, owner.info) for c in owner.connections)
    try:
        async def both():
            return await asyncio.gather(_run_all(a, "a"), _run_all(b, "b", REQUESTS[::-1]))

        by_a, by_b = asyncio.run(both())
        expected = asyncio.run(_run_all(thread, "r"))
        assert [_final(x) for x in by_a] == [_final(x) for x in expected]
        assert [_final(x) for x in by_b] == [_final(x) for x in expected[::-1]]

        async def a_runs_b_aborts_its_id_then_a_leaves():
            stream = a.generate([3, 3, 3], SamplingParams(temperature=0, max_tokens=100), "mine")
            await anext(stream)
            b.abort("mine")  # not b's request: ignored
            out = await anext(stream)
            a.shutdown()  # a's server leaves with its request running
            return out

        assert not asyncio.run(a_runs_b_aborts_its_id_then_a_leaves()).finished
        for _ in range(200):  # a's request is aborted between the engine's steps
            stats = owner.stats()
            if stats.num_running == stats.num_waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert stats.num_running == stats.num_waiting == 0 and stats.generation_tokens < 200
        assert _final(asyncio.run(_collect(b, *REQUESTS[0], "after"))) == _final(expected[0])
    finally:
        b.shutdown()
        a.shutdown()
        owner.stop()
    assert not owner.is_alive()


def test_a_process_that_exits_without_stopping_its_engine_ends():
    """An ``EngineProcess`` never stopped: the interpreter's exit stops it. (multiprocessing's
    exit handler sends its daemon SIGTERM, which the engine ignores, then joined it for ever.)"""
    code = ("from openk3.serve.engine_process import EngineProcess\n"
            "from tests.serve.test_engine_process import debug_engine\n"
            "if __name__ == '__main__':\n"
            "    engine = EngineProcess(debug_engine)  # held to the end\n"
            "    print('engine up', flush=True)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         start_new_session=True)
    assert run.returncode == 0 and "engine up" in run.stdout, run.stdout + run.stderr


def failing_engine() -> LLMEngine:
    """``debug_engine`` whose output for request "B" raises: a step fails after request "A"
    (one token) finished inside it (no step runs before both are in)."""
    eng = debug_engine()
    real = eng._output

    def output(r, stream):
        if r.seq.request_id == "B":
            raise RuntimeError("detokenizer blew up")
        return real(r, stream)

    eng._output = output
    real_step = eng.step
    eng.step = lambda: real_step() if len(eng.requests) >= 2 else []  # A and B in one step
    return eng


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_failed_step_fails_a_request_it_had_finished(kind):
    """Only the requests the engine still held were failed: one the failing step had finished
    already was never answered, and its client waited for ever."""
    engine = ProcessEngine(failing_engine) if kind == "process" else AsyncEngine(failing_engine())
    try:
        async def both():
            async def one(rid, n):
                try:
                    return [o async for o in engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=n), rid)]
                except Exception as e:  # noqa: BLE001 - what the client gets
                    return e
            return await asyncio.wait_for(asyncio.gather(one("A", 1), one("B", 4)), timeout=30)

        a, b = asyncio.run(both())
        assert all("detokenizer blew up" in str(r) for r in (a, b)), (a, b)
    finally:
        engine.shutdown()


def test_an_abort_racing_a_final_output_leaves_the_reader_running(engines, monkeypatch):
    """The reader thread deleted a finished request's entry that an abort had just popped: a
    KeyError ended the thread, and every stream of that server waited for ever."""
    process, _ = engines

    class Racing(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if key == "race" and value is not None:
                self.pop(key)  # the event loop's abort, between the reader's get and its del
            return value

    monkeypatch.setattr(process, "_tracked", Racing(process._tracked))
    asyncio.run(_collect(process, [3, 4], SamplingParams(temperature=0, max_tokens=1), "race"))
    assert process._reader.is_alive()
    after = asyncio.wait_for(_collect(process, *REQUESTS[0], "after"), timeout=30)
    assert _final(asyncio.run(after)) is not None


def test_every_client_sees_the_counters_after_another_clients_abort():
    """After an abort the new counters went only to the aborting client: another server's
    /metrics kept reporting the aborted request as running."""
    owner = EngineProcess(debug_engine, clients=2)
    a, b = (ProcessEngine.connect(c, owner.info) for c in owner.connections)
    try:
        async def a_leaves_mid_stream():
            stream = a.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=200), "r0")
            await anext(stream)
            await anext(stream)
            await stream.aclose()  # the client went away: aborted

        asyncio.run(a_leaves_mid_stream())
        for _ in range(200):
            if owner.stats().num_running == 0 and b.stats().num_running == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert owner.stats().num_running == 0 and b.stats().num_running == 0
    finally:
        b.shutdown()
        a.shutdown()
        owner.stop()


def test_ctrl_c_while_the_engine_loads_ends_it(monkeypatch):
    """A KeyboardInterrupt while waiting for "ready" left the engine running, and the
    interpreter's exit joined it for ever."""
    from multiprocessing.connection import Connection

    real, calls = Connection.recv, []

    def interrupted(self):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Connection, "recv", interrupted)
    started = []
    real_init = EngineProcess.__init__

    def keep(self, *args, **kw):
        started.append(self)
        return real_init(self, *args, **kw)

    monkeypatch.setattr(EngineProcess, "__init__", keep)
    try:
        with pytest.raises(KeyboardInterrupt):
            EngineProcess(debug_engine)
        assert not started[0].process.is_alive()
    finally:  # a regression must fail here, not hang the interpreter's exit
        if started[0].process.is_alive():
            started[0].process.kill()
