"""`specheads serve`: a real server process on loopback, checked against plain greedy decoding.

The target is the tiny one with random weights (conftest `varied_target_dir`), whose greedy text
differs from prompt to prompt. The server batches concurrent requests (`--max-batch 4` here, so that with 8 clients rows join
while others are mid-flight); every answer must equal the same request sent alone."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from unittest.mock import ANY

import pytest
from random_models import make_head, make_target
from servers import start_server
from test_verify import random_prompts

from specheads.data.prompts import encode_chat
from specheads.serve.engine import Engine, Guarded
from specheads.serve.metrics import parse_metrics
from specheads.serve.server import ServeOptions, build_app, serve_in_thread
from specheads.serve.transport import ServeError
from specheads.session import Session, eos_ids
from specheads.target import Target
from specheads.verify.eagle3_proposers import Eagle3Proposer, Eagle3StaticTreeProposer, SampledEagle3Proposer
from specheads.verify.loop import decode_batch, greedy_decode
from specheads.verify.loop import request as loop_request
from specheads.verify.ngram_proposers import NullProposer

PROMPTS = ["def add(a, b):\n    \"\"\"Sum.\"\"\"", "def read_config(path):", "class Stack:"]
PREFIX = 'vllm:spec_decode_num_'


def post(url: str, body: dict, raw: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = resp.read().decode()
    return data if raw else json.loads(data)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def sse_events(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def server(varied_target_dir, varied_export_dir):
    proc, url = start_server(["--target", str(varied_target_dir), "--draft", str(varied_export_dir),
                              "--device", "cpu", "--max-batch", "4"])
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def target(varied_target_dir):
    return Target.load(str(varied_target_dir), device="cpu")


def reference(target, prompt: str, n: int) -> list[int]:
    """Plain greedy decoding of one chat turn (the tokens a temperature-0 request must give)."""
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": prompt}])
    return greedy_decode(target, ids, n, eos_ids(target)).tokens


def text_of(target, tokens: list[int]) -> str:
    eos = set(eos_ids(target))
    return target.tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)


def test_greedy_chat_equals_plain_greedy_streamed_or_not(server, target):
    for prompt in PROMPTS:
        ref = reference(target, prompt, 24)
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24, "temperature": 0}
        out = post(f"{server}/v1/chat/completions", body)
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": text_of(target, ref)}
        assert out["usage"]["completion_tokens"] == len(ref)
        assert out["choices"][0]["finish_reason"] == ("stop" if ref[-1] in eos_ids(target) else "length")
        events = sse_events(post(f"{server}/v1/chat/completions",
                                 {**body, "stream": True, "stream_options": {"include_usage": True}},
                                 raw=True))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == \
            text_of(target, ref)
        assert chunks[-2]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_completions_token_prompt_stop_string_and_seed(server, target):
    ids = target.tokenizer("def parse(text):")["input_ids"]
    ref = greedy_decode(target, ids, 20, eos_ids(target)).tokens
    full = text_of(target, ref)
    out = post(f"{server}/v1/completions", {"prompt": ids, "max_tokens": 20, "temperature": 0})
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == full
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert greedy_decode(target, ids, 20, eos_ids(target)).tokens == ref  # deterministic
    sampled = {"prompt": "def parse(text):", "max_tokens": 24, "temperature": 1.0, "seed": 7}
    full = post(f"{server}/v1/completions", sampled)
    text = full["choices"][0]["text"]
    assert post(f"{server}/v1/completions", sampled)["choices"][0]["text"] == text  # same seed
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2, text
    cut = post(f"{server}/v1/completions", {**sampled, "stop": [stop, "never-there"]})
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    events = sse_events(post(f"{server}/v1/completions", {**sampled, "stop": stop, "stream": True}, raw=True))
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tiny_temperatures_sample_the_greedy_text(server, target):
    """At 1e-300 .. 1e-3 the warped target is one-hot on its argmax: speculative sampling must
    give the greedy text (it gave garbage once: the warp overflowed float32)."""
    prompt = PROMPTS[0]
    greedy = text_of(target, reference(target, prompt, 16))
    for temperature in (1e-300, 1e-40, 1e-20, 1e-3):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                "temperature": temperature, "seed": 11}
        out = post(f"{server}/v1/chat/completions", body)
        assert out["choices"][0]["message"]["content"] == greedy, temperature
        events = sse_events(post(f"{server}/v1/chat/completions", {**body, "stream": True}, raw=True))
        streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert streamed == greedy, temperature


def test_metrics_count_drafts_with_vllm_names(server):
    before = parse_metrics(get(f"{server}/metrics"))
    out = post(f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "def f(x):"}],
                                                 "max_tokens": 32, "temperature": 0})
    after = parse_metrics(get(f"{server}/metrics"))

    def delta(name: str) -> float:
        keys = [k for k in after if k.startswith(name + "{")]
        assert keys, name
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    drafts = delta(PREFIX + "drafts_total")
    accepted = delta(PREFIX + "accepted_tokens_total")
    per_pos = [after[k] - before.get(k, 0.0) for k in sorted(
        (k for k in after if k.startswith(PREFIX + "accepted_tokens_per_pos_total")),
        key=lambda k: int(k.split('position="')[1].split('"')[0]))]
    assert drafts >= 1 and len(per_pos) == 3  # the export's k = 3
    assert delta(PREFIX + "draft_tokens_total") >= accepted == sum(per_pos)
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # cumulative: position p needs p-1
    assert delta("vllm:generation_tokens_total") == out["usage"]["completion_tokens"]
    # every new token is an accepted draft, a bonus token or the prefill's token
    assert out["usage"]["completion_tokens"] <= accepted + drafts + 1 + 32


def concurrently(calls: list) -> list:
    """Run the zero-argument `calls` at once, one thread each (released together) -> their results."""
    results, start = [None] * len(calls), threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def answer(url: str, body: dict) -> tuple[str, dict]:
    """(text, usage) of a chat request, read from the stream when it streams."""
    if not body.get("stream"):
        out = post(f"{url}/v1/chat/completions", body)
        return out["choices"][0]["message"]["content"], out["usage"]
    chunks = [json.loads(e) for e in sse_events(post(f"{url}/v1/chat/completions", body, raw=True))[:-1]]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]), chunks[-1]["usage"]


def test_concurrent_requests_equal_each_request_alone(server, target):
    """8 clients at once on 4 rows: greedy answers equal plain greedy, seeded sampled ones equal
    the same request alone, streamed or not (rows of other lengths join and leave around them)."""
    prompts = PROMPTS + ["def mean(xs):", "import os\n", "for i in range(10):", "x = [", "# sort a list"]
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 6 + 5 * i,
               "temperature": 0.8 if i in (2, 5) else 0, "seed": i,
               "stream": i % 2 == 1, "stream_options": {"include_usage": True}} for i, p in enumerate(prompts)]
    together = concurrently([lambda b=b: answer(server, b) for b in bodies])
    for i, (body, (text, usage)) in enumerate(zip(bodies, together)):
        assert (text, usage) == answer(server, body), i  # the same request alone
        if body["temperature"] == 0:
            ref = reference(target, body["messages"][0]["content"], body["max_tokens"])
            assert text == text_of(target, ref) and usage["completion_tokens"] == len(ref), i


def test_models_health_and_errors(server):
    card = json.loads(get(f"{server}/v1/models"))["data"][0]
    assert card["id"] == "tiny" and card["specheads"]["speculation"]["kind"] == "chain"
    assert "embedding_sketch" not in card["specheads"]["target"] and card["specheads"]["target"]["tokenizer_sha256"]
    assert json.loads(get(f"{server}/health")) == {"status": "ok"}
    bad = [({"prompt": "x", "n": 2}, "'n'", 400), ({"prompt": "x", "model": "other"}, "does not exist", 404),
           ({"prompt": "x", "temperature": -1}, "temperature", 400), ({"prompt": "x " * 400}, "context", 400),
           ({"prompt": ""}, "prompt", 400)]
    for body, words, status in bad:
        with pytest.raises(urllib.error.HTTPError) as err:
            post(f"{server}/v1/completions", body)
        assert err.value.code == status and words in json.loads(err.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as err:
        get(f"{server}/v1/nothing")
    assert err.value.code == 404


def test_no_draft_server_in_process_is_plain_greedy(target):
    with serve_in_thread(Engine(Session(target), model_name="plain")) as url:
        before = parse_metrics(get(f"{url}/metrics"))
        ref = reference(target, PROMPTS[1], 20)
        body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 20,
                "temperature": 0, "stream": True}
        chunks = [json.loads(e) for e in sse_events(post(f"{url}/v1/chat/completions", body, raw=True))[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text_of(target, ref)
        after = parse_metrics(get(f"{url}/metrics"))
        key = PREFIX + 'drafts_total{engine="0",model_name="plain"}'
        assert after[key] == before[key] == 0


POISON = 7  # a prompt holding this id gets a proposer that fails mid-decode


class Exploding(NullProposer):
    """Drafts nothing; fails at its third verified step when its prompt holds POISON."""

    def __init__(self):
        self.poisoned, self.steps = False, 0

    def start(self, prompt_ids, first_token, out=None) -> None:
        self.poisoned = POISON in prompt_ids.tolist()

    def accept(self, inputs, following, out=None, start: int = 0) -> None:
        self.steps += 1
        if self.poisoned and self.steps == 3:
            raise RuntimeError("the proposer exploded")


class ExplodingSession(Session):
    def proposer(self, sampled: bool = False, spec=None):
        return Exploding()


def failing_on_call(cls, hook: str, call: int):
    """A subclass of proposer class `cls` whose `hook` raises on its `call`-th call."""
    def failing(self, *args):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == call:
            raise RuntimeError(f"{hook} failed")
        return getattr(cls, hook)(self, *args)
    return type(f"Failing{cls.__name__}", (cls,), {hook: failing})


def test_a_guarded_proposer_that_fails_drafts_nothing_in_every_hook_shape():
    """Chain, tree and sampled proposers failing mid-decode: the error is kept, the row decodes
    on without drafts (greedy rows still equal plain greedy) and the other rows are untouched."""
    big = make_target()
    head = make_head(big)
    p = random_prompts(4, seed=21)
    made = [Guarded(failing_on_call(Eagle3Proposer, "propose", 2)(head, big)),
            Guarded(failing_on_call(Eagle3StaticTreeProposer, "propose_tree", 3)(head, big, [(0,), (1,), (0, 0)])),
            Guarded(failing_on_call(SampledEagle3Proposer, "propose_sampled", 2)(head, big))]
    reqs = [loop_request(big, made[0], p[0], 16, 3), loop_request(big, made[1], p[1], 16),
            loop_request(big, made[2], p[2], 16, 3, rule="exact", seed=1),
            loop_request(big, Guarded(Eagle3Proposer(head, big)), p[3], 16, 3)]
    got = decode_batch(big, reqs)
    assert [str(g.error) for g in made] == ["propose failed", "propose_tree failed", "propose_sampled failed"]
    assert reqs[3].proposer.error is None
    for i in (0, 1, 3):
        assert got[i].tokens == greedy_decode(big, p[i], 16).tokens, i
    assert len(got[2].tokens) == 16


def status_and_body(url: str, body: dict) -> tuple[int, dict]:
    try:
        return 200, post(f"{url}/v1/completions", body)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_failing_request_leaves_the_others_and_the_server_serving(target):
    prompts = [[11, 12, 13, 14], [20, 21, POISON, 22], [30, 31, 32], [40, 41, 42, 43, 44]]
    with serve_in_thread(Engine(ExplodingSession(target), "plain"), options=ServeOptions(max_batch=4)) as url:
        bodies = [{"prompt": ids, "max_tokens": 20, "temperature": 0} for ids in prompts]
        results = concurrently([lambda b=b: status_and_body(url, b) for b in bodies])
        code, err = results[1]
        assert code == 500 and "the proposer exploded" in err["error"]["message"]
        for ids, (code, out) in zip(prompts, results):
            if POISON not in ids:
                assert code == 200 and out["choices"][0]["text"] == text_of(target, greedy_decode(
                    target, ids, 20, eos_ids(target)).tokens)
        assert status_and_body(url, bodies[0]) == (200, {**results[0][1], "id": ANY, "created": ANY})


def test_bad_max_batch_is_refused_naming_the_flag(varied_target_dir):
    with pytest.raises(ServeError, match="--max-batch must be an integer >= 1"):
        ServeOptions(max_batch=0)
    target = Target.load(str(varied_target_dir), device="cpu")
    target.config._attn_implementation = "flash_attention_2"  # ignores the per-row masks batching needs
    with pytest.raises(ServeError, match="--max-batch 8: .*flash_attention_2"):
        build_app(Engine(Session(target)))
    app = build_app(Engine(Session(target)), options=ServeOptions(max_batch=1))  # one at a time: fine
    app.state.service.close()
