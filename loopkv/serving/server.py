"""An OpenAI-compatible completion server on transformers' continuous-batching engine with LoopKV storage.

``loopkv serve MODEL --plan plan.json`` runs :class:`CompletionServer`; from Python::

    with CompletionServer(model, plan, tokenizer=tokenizer, max_slots=8, max_len=4096, pool_pages=1024) as server:
        server.serve_forever()      # Ctrl-C ends it; server.close() from another thread too

Routes: ``POST /v1/completions`` (``prompt`` as text or a list of token ids, ``max_tokens``; greedy decoding),
``GET /v1/models``, ``GET /health``. Each HTTP request runs in a thread of the standard library's
``ThreadingHTTPServer``, adds its prompt to the engine's ``ContinuousBatchingManager`` as it arrives and waits for its
result; one dispatcher thread takes the engine's results and hands each to its request. Why a server of loopkv's own
rather than ``transformers serve``: docs/design.md, "Serving".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from loopkv.format import PAGE

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # a request body larger than this is refused (413) before it is read
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ENGINE_START_SECONDS = 600  # how long the engine may take to build its cache before start-up fails
# OpenAI completion fields the server accepts only at their neutral value (what leaving them out means): the engine
# decodes greedily with one generation config for all requests, returns one choice and no log-probabilities
NEUTRAL = {"temperature": (0,), "top_p": (1,), "n": (1,), "best_of": (1,), "stream": (False,), "echo": (False,),
           "logprobs": (), "stop": (), "suffix": (), "frequency_penalty": (0,), "presence_penalty": (0,),
           "logit_bias": ({},), "stream_options": ()}
INFORMATIONAL = ("model", "user", "seed")  # accepted; "model" must name the served model, the others change nothing


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and a message naming the problem and the fix."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def parse_prompt(prompt, *, tokenizer, vocab_size: int) -> list[int]:
    """A completion request's ``prompt`` (text, tokenized with ``tokenizer``, or a list of token ids) as token ids."""
    if prompt == "":
        raise RequestError(400, "prompt is empty; send at least one character or token id", "prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(400, "this server has no tokenizer; send the prompt as a list of token ids", "prompt")
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(400, "one prompt per request: send a string or one list of token ids", "prompt")
    else:
        raise RequestError(400, "prompt must be a string or a list of integer token ids", "prompt")
    if not ids:
        raise RequestError(400, "prompt is empty (no tokens); send at least one token", "prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"prompt has token id {bad} but the model's vocabulary is ids 0 to {vocab_size - 1}",
                           "prompt")
    return ids


def parse_completion(body, *, name: str, tokenizer, vocab_size: int, max_len: int, pool_pages: int):
    """``(token ids, max_tokens)`` of a ``/v1/completions`` body, or :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object such as {\"prompt\": \"...\"}")
    for field, value in body.items():
        if field in NEUTRAL:
            if value is not None and value not in NEUTRAL[field]:
                neutral = " or ".join(json.dumps(v) for v in NEUTRAL[field]) or "null"
                raise RequestError(400, f"{field}={json.dumps(value)} is not supported: this server decodes greedily, "
                                   f"one choice per request; send {field} {neutral} or leave it out", field)
        elif field not in INFORMATIONAL and field not in ("prompt", "max_tokens"):
            raise RequestError(400, f"unknown field {field!r}; /v1/completions takes prompt, max_tokens, model", field)
    if body.get("model") not in (None, name):
        raise RequestError(404, f"model {body['model']!r} is not served here; this server serves {name!r}", "model")
    if "prompt" not in body:
        raise RequestError(400, "prompt is missing; send \"prompt\": text or a list of token ids", "prompt")
    ids = parse_prompt(body["prompt"], tokenizer=tokenizer, vocab_size=vocab_size)
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(400, f"max_tokens must be a positive integer, got {json.dumps(max_tokens)}", "max_tokens")
    limit = min(max_len, pool_pages * PAGE)
    if len(ids) + max_tokens > limit:
        raise RequestError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                           f"tokens, but this server holds at most {limit} per request (max_len={max_len}, "
                           f"{pool_pages} pages of {PAGE}); shorten the prompt or lower max_tokens", "prompt")
    return ids, max_tokens


class CompletionServer:
    """Serve ``model`` with LoopKV storage for ``plan`` over HTTP on ``host:port`` (``port=0``: any free port).

    ``max_slots`` requests decode at once, each at most ``max_len`` tokens (prompt + output), their history pages from a
    pool of ``pool_pages`` (``loopkv.serving.transformers_cb.pool_pages_within`` turns a KV budget into pages);
    ``max_batch_tokens``, ``chunked_prefill`` (a prompt the step does not hold whole is prefilled in chunks, exactly,
    through a scratch of ``max_len`` tokens) and other keywords go to
    :func:`~loopkv.serving.transformers_cb.engine_config`. ``tokenizer`` (optional) turns
    text prompts into ids and generated ids into text; ``name`` is the model id clients see. The socket is bound and
    the engine running when the constructor returns; :meth:`serve_forever` answers requests until :meth:`close`.
    """

    def __init__(self, model, plan, *, max_slots: int, max_len: int, pool_pages: int, tokenizer=None,
                 name: str = "loopkv", host: str = "127.0.0.1", port: int = 8000,
                 max_batch_tokens: int | None = None, chunked_prefill: bool = False, **engine):
        from transformers import GenerationConfig

        from loopkv.serving.transformers_cb import check_model, engine_cache, engine_config

        check_model(model)
        plan.validate_for(model.config)
        for arg, value in (("max_slots", max_slots), ("max_len", max_len), ("pool_pages", pool_pages)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive integer, got {value!r}")
        self.model, self.plan, self.tokenizer, self.name = model, plan, tokenizer, name
        self.max_slots, self.max_len, self.pool_pages = max_slots, max_len, pool_pages
        self.vocab_size = model.config.vocab_size
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._serving = threading.Event()
        cb = engine_config(pool_pages=pool_pages, max_batch_tokens=max_batch_tokens, max_len=max_len,
                           max_slots=max_slots, chunked_prefill=chunked_prefill, **engine)
        eos = model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        generation = GenerationConfig(max_new_tokens=DEFAULT_MAX_TOKENS, do_sample=False,
                                      eos_token_id=-1 if eos is None else eos,
                                      pad_token_id=model.generation_config.pad_token_id)
        try:  # bind first: a busy port fails before the engine starts
            self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port} ({err.strerror or err}); pass another port or host, "
                             "or stop what holds it") from err
        self.httpd.daemon_threads = True
        self._attention = model.config._attn_implementation
        if self._attention == "loopkv":  # the engines refuse the name; loopkv's Ouro takes its attention from the cache
            model.set_attn_implementation("sdpa")
        self.manager = None
        try:
            with engine_cache(plan, max_slots=max_slots, max_len=max_len, chunked_prefill=chunked_prefill) as built:
                self.manager = model.init_continuous_batching(generation_config=generation,
                                                              continuous_batching_config=cb)
                self.manager.warmup()  # builds the engine cache: every decode bucket captured before any request
                self.manager.start()
                deadline = time.monotonic() + ENGINE_START_SECONDS
                while not built and self.manager.is_running() and time.monotonic() < deadline:
                    time.sleep(0.01)  # the engine builds its cache in its own thread; the swap must last until then
            if not built:
                error = self.manager.background_thread_status.fatal_error
                raise RuntimeError(f"transformers' engine did not build its cache ({error or 'timed out'})")
        except BaseException:
            self._stop_engine()
            self.httpd.server_close()
            raise
        self.engine = built[0]
        self._dispatcher = threading.Thread(target=self._dispatch, name="loopkv-serve-results", daemon=True)
        self._dispatcher.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Answer requests until :meth:`close` (from another thread) or Ctrl-C (then call :meth:`close`)."""
        self._serving.set()
        try:
            self.httpd.serve_forever(poll_interval=0.1)
        finally:
            self._serving.clear()

    def close(self) -> None:
        """Stop answering, fail the requests still waiting (503), stop the engine and give the model its attention
        implementation back. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._serving.is_set():
            self.httpd.shutdown()  # serve_forever runs in another thread: wait for it to return
        self.httpd.server_close()
        self._fail_pending("the server is shutting down")
        self._stop_engine()
        self._dispatcher.join(timeout=5)

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def healthy(self) -> tuple[bool, str]:
        if self._closed.is_set():
            return False, "shutting down"
        if not self.manager.is_running():
            return False, f"the engine stopped ({self.manager.background_thread_status.fatal_error})"
        return True, "ok"

    def in_flight(self) -> int:
        """Requests added to the engine and not answered yet."""
        with self._lock:
            return len(self._pending)

    def complete(self, ids: list[int], max_tokens: int):
        """Add one request to the engine and wait for its ``GenerationOutput`` (or the 503 of :meth:`close`)."""
        request_id = f"cmpl-{next(self._ids)}"
        future: Future = Future()
        with self._lock:
            if self._closed.is_set():
                raise RequestError(503, "the server is shutting down; retry on another server")
            self._pending[request_id] = future
        if self.manager.add_request(ids, request_id=request_id, max_new_tokens=max_tokens) is None:
            with self._lock:  # the engine refused it: stopping or dead (it logs why)
                self._pending.pop(request_id, None)
            raise RequestError(503, f"the engine is not accepting requests ({self.healthy()[1]})")
        return request_id, future.result()

    def completion(self, body) -> dict:
        """The OpenAI ``text_completion`` object answering a ``/v1/completions`` body (or :class:`RequestError`)."""
        ids, max_tokens = parse_completion(body, name=self.name, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                           max_len=self.max_len, pool_pages=self.pool_pages)
        request_id, result = self.complete(ids, max_tokens)
        if result.error:
            raise RequestError(500, f"the engine failed this request: {result.error}")
        tokens = list(result.generated_tokens)
        stopped = bool(tokens) and tokens[-1] in self._eos
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": [{"index": 0, "text": text, "token_ids": tokens, "logprobs": None,
                             "finish_reason": "stop" if stopped or len(tokens) < max_tokens else "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                          "total_tokens": len(ids) + len(tokens)}}

    def models(self) -> dict:
        stored = self.plan.bytes_per_token(self.model.config).stored_kib
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": 0, "owned_by": "loopkv",
            "loopkv": {"max_slots": self.max_slots, "max_len": self.max_len, "pool_pages": self.pool_pages,
                       "stored_kib_per_token": round(stored, 3)}}]}

    # ------------------------------------------------------------------------------------------- engine side
    def _dispatch(self) -> None:
        """Hand each result the engine delivers to the request waiting for it, until the engine stops."""
        while True:
            result = self.manager.get_result(timeout=0.1)
            if result is None:
                if not self.manager.is_running():
                    self._fail_pending(f"the engine stopped ({self.manager.background_thread_status.fatal_error})")
                    return
                continue
            if result.error or result.is_finished():
                with self._lock:
                    future = self._pending.pop(result.request_id, None)
                if future is not None:
                    future.set_result(result)

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RequestError(503, f"{reason}; the request was not finished"))

    def _stop_engine(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, hard_stop=True)
            self.model.destroy_cached_continuous_batching_manager()
        if self._attention == "loopkv":
            self.model.set_attn_implementation(self._attention)


def _handler(server: CompletionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "loopkv"

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/health":
                ok, reason = server.healthy()
                self._send(200 if ok else 503, {"status": "ok", "requests": server.in_flight()} if ok
                           else {"status": "unhealthy", "reason": reason})
            elif self.path == "/v1/models":
                self._send(200, server.models())
            elif self.path == "/v1/completions":
                self._error(RequestError(405, "use POST for /v1/completions"))
            else:
                self._error(RequestError(404, f"no route {self.path}; routes: POST /v1/completions, GET /v1/models, "
                                              "GET /health"))

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/completions":
                self._error(RequestError(404 if self.path not in ("/v1/models", "/health") else 405,
                                         f"no POST route {self.path}; POST /v1/completions"))
                return
            try:
                self._send(200, server.completion(self._body()))
            except RequestError as err:
                self._error(err)
            except Exception as err:  # noqa: BLE001 (a bug must answer 500 and leave the server serving)
                logger.exception("loopkv serve: request failed")
                self._error(RequestError(500, f"internal error: {type(err).__name__}: {err}"))

        def _body(self):
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True  # a body may follow, unread
                raise RequestError(411, "send the JSON body with a Content-Length header") from None
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # the unread body stays in the socket
                raise RequestError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES}")
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise RequestError(400, f"the body is not valid JSON ({err}); send a JSON object") from None

        def _error(self, err: RequestError):
            kind = "invalid_request_error" if err.status < 500 else "server_error"
            self._send(err.status, {"error": {"message": err.message, "type": kind, "param": err.param,
                                              "code": HTTPStatus(err.status).phrase}})

        def _send(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client left: nothing to tell it
                self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
            logger.info("%s %s", self.address_string(), format % args)

    return Handler


def from_arguments(model, plan, spec: str, *, max_slots: int, max_len: int, pool_pages: int | None,
                   kv_budget_gib: float | None, host: str, port: int, max_batch_tokens: int | None = None,
                   chunked_prefill: bool = False):
    """The :class:`CompletionServer` of ``loopkv serve``: ``spec`` (``small``, a checkpoint folder or a cached Hub id)
    names the model and holds its tokenizer; the pool is ``pool_pages``, what ``kv_budget_gib`` buys (after the
    prompt scratch, with ``chunked_prefill``), or by default pages for every slot at ``max_len``."""
    from loopkv.serving.engine_cache import blocks_for
    from loopkv.serving.transformers_cb import pool_pages_within

    if spec == "small":
        from loopkv.models.small import SMALL_DIR as folder
    else:
        from loopkv.models.checkpoints import checkpoint_folder

        folder = checkpoint_folder(spec)
    if kv_budget_gib is not None:
        pool_pages = pool_pages_within(plan, model.config, kv_budget_gib=kv_budget_gib, max_slots=max_slots,
                                       max_len=max_len, dtype=model.dtype, chunked_prefill=chunked_prefill)
    elif pool_pages is None:
        pool_pages = max_slots * blocks_for(max_len)
    return CompletionServer(model, plan, tokenizer=load_tokenizer(folder), name=spec, max_slots=max_slots,
                            max_len=max_len, pool_pages=pool_pages, max_batch_tokens=max_batch_tokens,
                            chunked_prefill=chunked_prefill, host=host, port=port)


def banner(server: CompletionServer, plan_path: str) -> str:
    """The line ``loopkv serve`` prints once it listens."""
    stored = server.plan.bytes_per_token(server.model.config).stored_kib
    text = "text or token-id prompts" if server.tokenizer is not None else "token-id prompts (no tokenizer)"
    return (f"loopkv serve: {server.name} with {plan_path} ({stored:.2f} KiB stored per token), {server.max_slots} "
            f"slots of up to {server.max_len} tokens, {server.pool_pages} pages; {text}; listening on {server.url} "
            "(Ctrl-C stops)")


def load_tokenizer(folder):
    """The tokenizer saved in checkpoint ``folder``, or None when it has none (the server then takes token ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None


def serve_until_stopped(server: CompletionServer) -> None:
    """``server.serve_forever()`` until Ctrl-C or SIGTERM (in the main thread), then :meth:`CompletionServer.close`."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if main:
            signal.signal(signal.SIGTERM, previous)
