"""``LLMEngine`` in a process of its own: the HTTP server's event loop and the engine's steps no
longer share one interpreter lock.

With ``AsyncEngine`` (a thread) the loop's per-chunk Python (HTTP, SSE, JSON: 40-75 us a chunk,
64 chunks a step at 64 streams) holds the lock the engine thread needs as soon as its GPU wait
ends, and CPython hands it over only after its switch interval (5 ms): the engine's steps
stretch by up to the loop's work per step (docs/serving.md, "Server host overhead"). vLLM's v1
engine splits the same way (the engine core in a background process, outputs sent once per
step).

The split::

    server process                                   engine process (spawned)
    ProcessEngine.generate: RequestInputs.checked     factory() -> LLMEngine
      ("add", id, ids as an int64 array, params,  ->  add / abort between steps
       images)                                        step() -> outputs
    reader thread: RequestOutput rebuilt from     <-  ("step", [delta per output], stats)
      the deltas, pushed to the streams               ("stats", stats) after an abort

Only what is new crosses the pipe: per output the new token ids, the new text, the new
log-probabilities, the finish state (and the prompt's log-probabilities once); the server keeps
each request's prompt ids, output ids, text and log-probabilities and rebuilds the full
``RequestOutput`` the streams expect (the same objects, field for field, as ``AsyncEngine``'s:
``tests/serve/test_engine_process.py``). Input checks, tokenisation and image packing run in
the server process (``RequestInputs``, sent over once at start-up with the tokenizer);
detokenisation and stop strings stay in the engine, where the sequence's state is.

Failure: a request the engine refuses, or a step that raises, fails the requests concerned with
the engine's message (``EngineError``, or ``InvalidRequest`` as raised); if the engine process
dies, every open stream fails with ``EngineError`` naming its exit code and ``is_alive`` turns
False (the server's ``/health`` answers 503). A factory that raises fails ``ProcessEngine(...)``
with the factory's ``ValueError`` (a bad config or checkpoint), or a ``RuntimeError`` holding
the engine's traceback.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.serve.engine import EngineStats, LLMEngine, Logprob, RequestOutput, StreamingEngine
from openk3.serve.multimodal import MultiModalInput
from openk3.serve.sampler import InvalidRequest, SamplingParams


class EngineError(RuntimeError):
    """The engine process failed a request, or died."""


@dataclass
class EngineInfo:
    """What the engine process tells the server once it is up."""

    inputs: object  # RequestInputs, with the tokenizer
    model_name: str
    device: str
    cache_bytes: dict[str, int]
    stats: EngineStats


@dataclass
class _Tracked:
    """The server's copy of a request's outputs so far (what the deltas add up to)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None


def _failure(e: BaseException) -> tuple:
    """An exception as plain data (custom exceptions do not always unpickle)."""
    if isinstance(e, InvalidRequest):
        return ("invalid", e.param, e.message)
    return ("error", f"{type(e).__name__}: {e}")


def _raised(failure: tuple) -> BaseException:
    return InvalidRequest(failure[1], failure[2]) if failure[0] == "invalid" else EngineError(failure[1])


def _engine_main(factory: Callable[[], LLMEngine], conn) -> None:
    """The engine process: build the engine, then add, abort and step until told to stop (or the
    server's end of the pipe closes). It ignores SIGINT and SIGTERM: a Ctrl-C in a terminal (or a
    service manager's SIGTERM) reaches every process of the group, and the server, draining its
    responses for a grace period, still needs its engine; the server stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        eng = factory()
        conn.send(("ready", EngineInfo(eng.inputs, eng.model_name, str(eng.runner.device),
                                       eng.runner.cache_bytes(), eng.snapshot_stats())))
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it
        conn.send(("error", (isinstance(e, ValueError), str(e), traceback.format_exc())))
        return
    # per request with an output sent (the prompt's log-probabilities went with the first): how
    # many of its log-probabilities were sent
    sent: dict[str, int] = {}
    try:
        while True:
            # wait for a command while idle; between steps, take whatever has arrived
            while conn.poll(None if not eng.has_unfinished() else 0):
                cmd, *args = conn.recv()
                if cmd == "add":
                    rid, packed, params, images = args
                    try:
                        eng._add(packed.tolist(), packed, params, rid, images)  # checked by the server
                    except Exception as e:  # noqa: BLE001 - fail this request only
                        conn.send(("failed", [(rid, _failure(e))]))
                elif cmd == "abort":  # the server's counters see it even if no step follows
                    eng.abort(args[0])
                    sent.pop(args[0], None)
                    conn.send(("stats", eng.snapshot_stats()))
                else:  # "stop"
                    return
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every request, keep serving
                failed = eng.abort_all()
                for rid in failed:
                    sent.pop(rid, None)
                conn.send(("failed", [(rid, _failure(e)) for rid in failed]))
                continue
            deltas = []
            for o in outputs:
                first, done = o.request_id not in sent, sent.get(o.request_id, 0)
                new_logprobs = None if o.logprobs is None else o.logprobs[done:]
                deltas.append((o.request_id, o.delta_token_ids, o.delta_text, new_logprobs, o.finished,
                               o.finish_reason, o.num_cached_tokens, o.prompt_logprobs if first else None))
                if o.finished:
                    sent.pop(o.request_id, None)
                else:
                    sent[o.request_id] = len(o.logprobs or ())
            conn.send(("step", deltas, eng.snapshot_stats()))
    except (EOFError, OSError):  # the server went away
        return


class ProcessEngine(StreamingEngine):
    """``LLMEngine`` in a spawned process (``StreamingEngine``: the streams, as ``AsyncEngine``'s).

    ``factory``: a picklable callable, run in the new process, that builds the engine (a
    top-level function or a ``functools.partial`` of one: the model is loaded there, never in the
    server's process). Blocks until the engine is up. If the factory raises, so does this: the
    same ``ValueError`` (bad config or checkpoint), or ``RuntimeError`` with the traceback."""

    def __init__(self, factory: Callable[[], LLMEngine]):
        super().__init__()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(factory, child), name="openk3-engine", daemon=True)
        self._proc.start()
        child.close()
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=10)
            raise RuntimeError(f"the engine process exited while starting (exit code "
                               f"{self._proc.exitcode})") from None
        if kind == "error":
            self._proc.join(timeout=10)
            bad_input, message, trace = info
            if bad_input:  # a config or checkpoint error: the message says it all
                raise ValueError(message)
            raise RuntimeError(f"the engine process failed to start:\n{trace}")
        self.info: EngineInfo = info
        self.inputs, self.model_name, self._stats = info.inputs, info.model_name, info.stats
        self._tracked: dict[str, _Tracked] = {}
        self._send_lock = threading.Lock()
        self._stopped = False
        self._reader = threading.Thread(target=self._read, name="openk3-engine-reader", daemon=True)
        self._reader.start()

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        """The engine process runs (False after ``shutdown`` or if it died)."""
        return not self._stopped and self._proc.is_alive() and self._reader.is_alive()

    def _send(self, msg: tuple) -> None:
        with self._send_lock:  # streams on several event loops may send at once
            self._conn.send(msg)

    def _submit(self, request_id: str, valid: tuple[list[int], array], params: SamplingParams,
                images: MultiModalInput | None) -> None:
        ids, packed = valid
        if not self.is_alive:
            raise EngineError("the engine process is not running")
        self._tracked[request_id] = _Tracked(ids, logprobs=[] if params.logprobs is not None else None)
        self._send(("add", request_id, packed, params, images))

    def abort(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        if self.is_alive:
            try:
                self._send(("abort", request_id))
            except OSError:  # the engine died meanwhile: it holds nothing any more
                pass

    def _output(self, delta: tuple) -> RequestOutput | None:
        rid, new_ids, new_text, new_logprobs, finished, reason, cached, prompt_logprobs = delta
        t = self._tracked.get(rid)
        if t is None:  # aborted by the server meanwhile
            return None
        t.token_ids += new_ids
        t.text += new_text
        if new_logprobs is not None:
            t.logprobs += new_logprobs
        if prompt_logprobs is not None:
            t.prompt_logprobs = prompt_logprobs
        if finished:
            del self._tracked[rid]
        return RequestOutput(rid, t.prompt_token_ids, list(t.token_ids), t.text, new_ids, new_text,
                             list(t.logprobs) if t.logprobs is not None else None, finished, reason, cached,
                             list(t.prompt_logprobs) if t.prompt_logprobs is not None else None)

    def _read(self) -> None:
        """The reader thread: each message of the engine process to the streams."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "step":
                    self._stats = msg[2]
                    outs = [(d[0], self._output(d)) for d in msg[1]]
                    self._push([(rid, o) for rid, o in outs if o is not None])
                elif msg[0] == "stats":
                    self._stats = msg[1]
                else:  # "failed"
                    for rid, _ in msg[1]:
                        self._tracked.pop(rid, None)
                    self._push([(rid, _raised(f)) for rid, f in msg[1]])
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            if not self._stopped:
                self.fail_all(EngineError(f"the engine process exited (exit code {self._proc.exitcode})"))

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()
        self._reader.join(timeout=5)
