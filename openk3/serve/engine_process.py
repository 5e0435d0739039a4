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

Several servers (``openk3 serve --api-servers N``, ``api_servers.py``): ``EngineProcess`` gives
the engine a connection per server beside its owner's (stop, counters); each server's requests
are its own (its aborts touch only those, each step sends it only its requests' deltas and
everyone the counters), and a server whose connection closes has its requests aborted.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import signal
import threading
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

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


def _engine_main(factory: Callable[[], LLMEngine], control: Connection, clients: list[Connection]) -> None:
    """The engine process: build the engine, then add, abort and step until told to stop on
    ``control`` (or its other end closes). Each of ``clients`` is a server's (a front-end's):
    the requests it adds are its own, its aborts touch only those, and each step sends it its
    requests' deltas with the engine's counters; a client whose end closes has its requests
    aborted. It ignores SIGINT and SIGTERM: a Ctrl-C in a terminal (or a service manager's
    SIGTERM) reaches every process of the group, and the server, draining its responses for a
    grace period, still needs its engine; the server stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        eng = factory()
        control.send(("ready", EngineInfo(eng.inputs, eng.model_name, str(eng.runner.device),
                                          eng.runner.cache_bytes(), eng.snapshot_stats())))
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it
        control.send(("error", (isinstance(e, ValueError), str(e), traceback.format_exc())))
        return
    # per request with an output sent (the prompt's log-probabilities went with the first): how
    # many of its log-probabilities were sent
    sent: dict[str, int] = {}
    owner: dict[str, Connection] = {}  # the client that added each request
    live = list(clients)

    def drop(conn: Connection) -> None:
        """A client went away: its requests are aborted, its connection closed."""
        if conn not in live:  # dropped already (a failed send, then its message)
            return
        live.remove(conn)
        for rid in [r for r, c in owner.items() if c is conn]:
            eng.abort(rid)
            del owner[rid]
            sent.pop(rid, None)
        conn.close()

    def send(conn: Connection, msg: tuple) -> None:
        try:
            conn.send(msg)
        except OSError:  # the client died between its last message and this one
            drop(conn)

    def send_stats() -> None:
        """The counters to every client: each server's /metrics reads its last copy (an abort
        or a client's leaving told only the aborting client, and the others' gauges went stale)."""
        stats = eng.snapshot_stats()
        for conn in list(live):
            send(conn, ("stats", stats))

    while True:
        # wait for a command while idle; between steps, take whatever has arrived
        while ready := wait([control, *live], None if not eng.has_unfinished() else 0):
            for conn in ready:
                if conn is not control and conn not in live:
                    continue
                try:
                    cmd, *args = conn.recv()
                except (EOFError, OSError):
                    cmd, args = "close", ()
                if cmd == "close":  # a client left (or died): its requests are aborted
                    if conn is control:  # the server went away
                        return
                    drop(conn)
                    send_stats()
                    continue
                if cmd == "add":
                    rid, packed, params, images = args
                    try:
                        eng._add(packed.tolist(), packed, params, rid, images)  # checked by the server
                        owner[rid] = conn
                    except Exception as e:  # noqa: BLE001 - fail this request only
                        send(conn, ("failed", [(rid, _failure(e))]))
                elif cmd == "abort":  # the client's counters see it even if no step follows
                    if owner.get(args[0]) is conn:
                        eng.abort(args[0])
                        del owner[args[0]]
                        sent.pop(args[0], None)
                    send_stats()
                elif cmd == "stats":
                    send(conn, ("stats", eng.snapshot_stats()))
                else:  # "stop"
                    return
        try:
            outputs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail every request, keep serving
            # every request a client is owed an answer for: those a step finished before the
            # failure have left the engine already, and their outputs never went
            eng.abort_all()
            failed: dict[Connection, list] = {}
            for rid, conn in owner.items():
                failed.setdefault(conn, []).append((rid, _failure(e)))
            owner.clear()
            sent.clear()
            for conn, items in failed.items():
                send(conn, ("failed", items))
            send_stats()
            continue
        deltas: dict[Connection, list] = {conn: [] for conn in live}
        for o in outputs:
            rid = o.request_id
            first, done = rid not in sent, sent.get(rid, 0)
            new_logprobs = None if o.logprobs is None else o.logprobs[done:]
            deltas[owner[rid]].append((rid, o.delta_token_ids, o.delta_text, new_logprobs, o.finished,
                                       o.finish_reason, o.num_cached_tokens, o.prompt_logprobs if first else None))
            if o.finished:
                sent.pop(rid, None)
                del owner[rid]
            else:
                sent[rid] = len(o.logprobs or ())
        stats = eng.snapshot_stats()
        for conn, items in deltas.items():  # every client: its outputs (maybe none), the counters
            send(conn, ("step", items, stats))


class EngineProcess:
    """``LLMEngine`` in a spawned process with a connection for each of ``clients`` servers
    (``connections``: hand each to a ``ProcessEngine.connect``) and one for its owner
    (``stop``, ``stats``). Blocks until the engine is up; a factory that raises raises here
    (its ``ValueError``, or ``RuntimeError`` with the traceback).

    ``factory``: a picklable callable, run in the new process, that builds the engine (a
    top-level function or a ``functools.partial`` of one: the model is loaded there, never in
    this process)."""

    def __init__(self, factory: Callable[[], LLMEngine], clients: int = 1):
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._control, control = ctx.Pipe()
        pairs = [ctx.Pipe() for _ in range(clients)]
        self.process = ctx.Process(target=_engine_main, args=(factory, control, [c for _, c in pairs]),
                                   name="openk3-engine", daemon=True)
        self.process.start()
        for conn in (control, *(c for _, c in pairs)):
            conn.close()
        self.connections = [c for c, _ in pairs]
        try:
            kind, info = self._control.recv()
        except EOFError:
            kind, info = "exited", None
        except BaseException:  # Ctrl-C while the engine loads: end it, or exit waits for it
            self.process.kill()
            self.process.join(timeout=10)
            for conn in (self._control, *self.connections):
                conn.close()
            raise
        if kind != "ready":
            self.process.join(timeout=10)
            for conn in (self._control, *self.connections):
                conn.close()
        if kind == "exited":
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})")
        if kind == "error":
            bad_input, message, trace = info
            if bad_input:  # a config or checkpoint error: the message says it all
                raise ValueError(message)
            raise RuntimeError(f"the engine process failed to start:\n{trace}")
        self.info: EngineInfo = info
        # an engine left running at interpreter exit: multiprocessing's own exit handler sends it
        # SIGTERM, which it ignores, then joins it for ever while this process still holds its
        # control connection open; this handler (registered later, so run first) stops it
        atexit.register(self.stop)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters now (between its steps)."""
        self._control.send(("stats",))
        return self._control.recv()[1]

    def stop(self) -> None:
        """Stop the engine (its clients' open streams fail) and wait for the process to end."""
        atexit.unregister(self.stop)
        try:
            self._control.send(("stop",))
        except OSError:
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._control.close()


class ProcessEngine(StreamingEngine):
    """``LLMEngine`` in another process (``StreamingEngine``: the streams, as ``AsyncEngine``'s).

    ``ProcessEngine(factory)`` spawns the engine (``EngineProcess``, one client: this) and stops
    it at ``shutdown``; ``ProcessEngine.connect(connection, info)`` is one of several servers in
    front of an ``EngineProcess`` (``openk3 serve --api-servers N``, ``api_servers.py``), whose
    ``shutdown`` closes only its connection (the engine aborts its requests)."""

    def __init__(self, factory: Callable[[], LLMEngine]):
        self._process = EngineProcess(factory)
        self._proc = self._process.process
        self._start(self._process.connections[0], self._process.info)

    @classmethod
    def connect(cls, connection: Connection, info: EngineInfo) -> ProcessEngine:
        """A client of an ``EngineProcess`` started elsewhere (``connection``: one of its
        ``connections``, ``info``: its ``info``)."""
        self = cls.__new__(cls)
        self._process = self._proc = None
        self._start(connection, info)
        return self

    def _start(self, connection: Connection, info: EngineInfo) -> None:
        StreamingEngine.__init__(self)
        self._conn, self.info = connection, info
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
        return (not self._stopped and self._reader.is_alive()
                and (self._process is None or self._process.is_alive()))

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
        if finished:  # (an abort on the event loop may have taken it meanwhile)
            self._tracked.pop(rid, None)
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
            if self._stopped:
                return
            if self._proc is not None:
                self._proc.join(timeout=5)
                self.fail_all(EngineError(f"the engine process exited (exit code {self._proc.exitcode})"))
            else:
                self.fail_all(EngineError("the engine process exited (its connection closed)"))
        except Exception as e:  # noqa: BLE001 - a dead reader would leave every stream waiting
            self.fail_all(EngineError(f"the engine's reader failed: {e!r}"))
            raise

    def shutdown(self) -> None:
        """Stop the engine process (``ProcessEngine(factory)``), or leave it (``connect``: the
        engine aborts this client's requests and closes its end, which ends the reader)."""
        if self._stopped:
            return
        self._stopped = True
        if self._process is not None:
            self._process.stop()
        else:
            with contextlib.suppress(OSError):
                self._send(("close",))
        self._reader.join(timeout=5)
        self._conn.close()
