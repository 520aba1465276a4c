"""``loopkv serve`` (loopkv/serving/server.py): real HTTP on loopback. Completions sent at the same time equal the same
prompts generated alone through a LoopKVCache with the same plan; bad requests get a 4xx naming the problem and the
server keeps serving; close() and Ctrl-C stop it with nothing left running."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from packaging.version import Version

import loopkv
from loopkv.cli import main
from loopkv.serving import transformers_cb
from loopkv.serving.server import CompletionServer

HAVE = Version(Version(transformers.__version__).base_version)
pytestmark = pytest.mark.skipif(not transformers_cb.SUPPORTED[0] <= HAVE < transformers_cb.SUPPORTED[1],
                                reason=f"the engine of transformers {transformers.__version__} is not the one "
                                       "loopkv's shim follows")
MAX_LEN = 512


def tiny_byte_ouro():
    """A tiny random Ouro over the small model's byte vocabulary (so its tokenizer serves text), no EOS."""
    from loopkv.models.ouro import OuroConfig, OuroForCausalLM
    from loopkv.models.small import VOCAB_SIZE

    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=2,
                     max_position_embeddings=4096, rope_theta=10000.0)
    model = OuroForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_byte_ouro()


@pytest.fixture(scope="module")
def plan():
    return loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["int2", "int4"], tau=14.0)


@pytest.fixture(scope="module")
def tokenizer():
    from loopkv.models.small import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def server(model, plan, tokenizer):
    srv = CompletionServer(model, plan, tokenizer=tokenizer, name="tiny", max_slots=2, max_len=MAX_LEN,
                           pool_pages=24, port=0)
    thread = threading.Thread(target=srv.serve_forever)
    thread.start()
    yield srv
    srv.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def request(url: str, method: str, path: str, body: bytes | dict | None = None, *, timeout: float = 120):
    """``(status, decoded JSON)`` of one HTTP request to ``url`` (``http://host:port``)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def alone(model, plan, prompt: list[int], new: int) -> list[int]:
    """``prompt`` generated greedily by itself through a batch-1 LoopKVCache with ``plan``."""
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=MAX_LEN,
                               dtype=torch.float32, device="cpu")
    out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_concurrent_completions_equal_each_prompt_generated_alone(server, model, plan, tokenizer):
    """Two requests sent at once (one long enough for quantized history pages, 330 tokens): each completion's tokens
    are what generate gives its prompt alone with the same plan, and the pool is empty again; a text prompt is the
    tokenizer's ids."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (330,), generator=g).tolist(), torch.randint(3, 250, (9,), generator=g).tolist()]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: request(server.url, "POST", "/v1/completions",
                                                  {"model": "tiny", "prompt": p, "max_tokens": 12}), prompts))
    for prompt, (status, body) in zip(prompts, answers, strict=True):
        assert status == 200, body
        (choice,) = body["choices"]
        assert choice["token_ids"] == alone(model, plan, prompt, 12)
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                                 "total_tokens": len(prompt) + 12}
    assert server.engine.cache.pages_in_use == 0  # every page back in the pool once both are answered
    assert server.engine.free_block_count() == server.engine.num_blocks
    text = "def fibonacci(n):"
    status, body = request(server.url, "POST", "/v1/completions", {"prompt": text, "max_tokens": 5})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == alone(model, plan, tokenizer(text)["input_ids"], 5)
    assert body["usage"]["prompt_tokens"] == len(tokenizer(text)["input_ids"])


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"max_tokens": 3}, 400, "prompt is missing"),
    ({"prompt": [5] * 500, "max_tokens": 20}, 400, "at most 512 per request"),
    ({"prompt": [5, 400]}, 400, "token id 400"),
    ({"prompt": [[5], [6]]}, 400, "one prompt per request"),
    ({"prompt": [5], "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ({"prompt": [5], "temperature": 0.8}, 400, "decodes greedily"),
    ({"prompt": [5], "stream": True}, 400, "send stream false"),
    ({"prompt": [5], "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ({"prompt": [5], "model": "gpt-4"}, 404, "this server serves 'tiny'"),
])
def test_a_bad_request_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, model, plan, body, status,
                                                                                   says):
    got, answer = request(server.url, "POST", "/v1/completions", body)
    assert got == status
    assert says in answer["error"]["message"]
    got, answer = request(server.url, "POST", "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 3})
    assert got == 200
    assert answer["choices"][0]["token_ids"] == alone(model, plan, [7, 8, 9], 3)


def test_models_health_and_unknown_routes(server, plan, model):
    status, body = request(server.url, "GET", "/v1/models")
    assert status == 200
    (entry,) = body["data"]
    assert entry["id"] == "tiny"
    assert entry["loopkv"]["stored_kib_per_token"] == pytest.approx(plan.bytes_per_token(model.config).stored_kib,
                                                                    abs=1e-3)
    assert request(server.url, "GET", "/health") == (200, {"status": "ok", "requests": 0})
    assert request(server.url, "GET", "/v2/nothing")[0] == 404
    assert request(server.url, "GET", "/v1/completions")[0] == 405


def test_close_answers_the_waiting_request_and_stops_everything(model, plan):
    """close() while a request decodes: the request gets a 503, serve_forever returns, the engine's thread ends, the
    port is released and the model has its attention implementation back."""
    model.set_attn_implementation("loopkv")
    srv = CompletionServer(model, plan, max_slots=1, max_len=MAX_LEN, pool_pages=16, port=0)
    assert model.config._attn_implementation != "loopkv"  # the engines refuse the name while serving
    thread = threading.Thread(target=srv.serve_forever)
    thread.start()
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        request(srv.url, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 500})))
    client.start()
    while srv.in_flight() == 0 and client.is_alive():
        threading.Event().wait(0.01)
    port = srv.httpd.server_address[1]
    srv.close()
    client.join(timeout=30)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert not srv.manager.is_running()
    (status, body), = answers
    assert status == 503
    assert "shutting down" in body["error"]["message"]
    assert model.config._attn_implementation == "loopkv"
    model.set_attn_implementation("sdpa")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, plan):
    path = tmp_path_factory.mktemp("serve")
    model.save_pretrained(path / "ckpt")
    plan.to_json(path / "plan.json")
    return path


def test_cli_serve_refuses_bad_input_with_one_line(checkpoint, capsys):
    ckpt, plan = str(checkpoint / "ckpt"), str(checkpoint / "plan.json")
    wrong = checkpoint / "wrong.json"
    loopkv.Plan.uniform(loops=3, layers=2, option="int4").to_json(wrong)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            (["--plan", str(checkpoint / "missing.json")], "missing.json does not exist"),
            (["--plan", plan, "--port", "70000"], "--port 70000"),
            (["--plan", plan, "--max-slots", "0"], "--max-slots 0"),
            (["--plan", plan, "--kv-budget-gib", "-1"], "--kv-budget-gib"),
            (["--plan", str(wrong)], "loops=3 but the model has total_ut_steps=2"),
            (["--plan", plan, "--port", str(busy.getsockname()[1])], "cannot listen on 127.0.0.1"),
            (["--plan", plan, "--kv-budget-gib", "0.00001"], "does not cover"),
            (["--plan", plan, "--chunked-prefill", "--max-batch-tokens", "8"], "max_batch_tokens=8 is too small"),
        ]
        for flags, says in cases:
            assert main(["serve", ckpt, *flags]) == 2, flags
            err = capsys.readouterr().err.split("\n")  # before the error, the loading bars redraw one line
            assert err[-1] == ""
            assert err[-2].startswith("loopkv serve: error: ")
            assert says in err[-2]
            assert "Traceback" not in "".join(err)


def test_cli_serve_answers_over_http_and_ctrl_c_stops_it(checkpoint, model, plan):
    """The documented command, as a process, with chunked prefill (2 slots and 64 prompt tokens per step): it prints
    where it listens, answers a 150-token prompt, prefilled in three chunks, with the completion generate gives it
    alone, and SIGINT ends it with status 0 and no traceback."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, "-m", "loopkv.cli", "serve", str(checkpoint / "ckpt"), "--plan",
                             str(checkpoint / "plan.json"), "--port", "0", "--max-slots", "2", "--max-len",
                             str(MAX_LEN), "--chunked-prefill", "--max-batch-tokens", "66"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() else "")
        url = line.split("listening on ")[1].split()[0]
        prompt = [9 + i % 50 for i in range(150)]
        status, body = request(url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 6})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == alone(model, plan, prompt, 6)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err
        assert "loopkv serve: stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
