"""data/prompts.py: the prompts file's rows and the one chat prompt encoder every caller uses."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specheads.data.prompts import NoChatTemplate, PromptsError, encode_chat, encode_text, read_prompts, user_turn
from specheads.eval.offline import samples_from_rows
from specheads.eval.online import eval_prompt_ids
from specheads.generate import GenerateError, encode_prompt

PROMPTS = ["def add(a, b):", "  leading spaces and a trailing newline\n", "naïve café – ünïcode 😀",
           "looks special: <|im_start|>user", "x = 1\n" * 20]


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def test_offline_parity_samples_are_tokenised_like_the_online_prompts(tok):
    """The offline tau of `--parity` is taken on exactly the ids the online eval decoded from."""
    rows = [{"id": str(i), "turn": 0, "prompt": p, "plain_ids": [7, 8]} for i, p in enumerate(PROMPTS)]
    offline = [s.input_ids[:-2] for s in samples_from_rows(tok, rows)]
    online = [eval_prompt_ids(tok, user_turn(p)) for p in PROMPTS]
    assert offline == online
    # the two-step style offline used before (render text, tokenize it without special tokens)
    # gave the same ids on this tokenizer: the move changed no sample
    for p, ids in zip(PROMPTS, online):
        text = tok.apply_chat_template(user_turn(p), tokenize=False, add_generation_prompt=True)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids


def test_encode_chat_renders_for_the_answer(tok):
    msgs = [{"role": "system", "content": "be brief"}, *user_turn("def f():")]
    ids = encode_chat(tok, msgs)
    assert ids == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert len(ids) > len(encode_chat(tok, user_turn("def f():")))
    assert encode_text(tok, "def f():") == tok("def f():")["input_ids"]
    assert encode_prompt(tok, "def f():", chat=False) == encode_text(tok, "def f():")
    assert encode_prompt(tok, "def f():", chat=True) == encode_chat(tok, user_turn("def f():"))


def test_no_chat_template_is_refused_in_each_callers_words(tiny_target_dir):
    bare = AutoTokenizer.from_pretrained(tiny_target_dir)
    bare.chat_template = None
    with pytest.raises(NoChatTemplate, match="no chat template"):
        encode_chat(bare, user_turn("hi"))
    with pytest.raises(PromptsError, match="specheads eval renders prompts as chat turns"):
        eval_prompt_ids(bare, user_turn("hi"))
    with pytest.raises(GenerateError, match="pass --no-chat"):
        encode_prompt(bare, "hi", chat=True)
    assert encode_prompt(bare, "hi", chat=False) == bare("hi")["input_ids"]
    from types import SimpleNamespace

    from specheads.serve.engine import Engine, RequestError

    session = SimpleNamespace(target=SimpleNamespace(tokenizer=bare), head=None, spec=None, eos=[])
    with pytest.raises(RequestError, match="no chat template: use /v1/completions"):
        Engine(session).chat_ids(user_turn("hi"))


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"turns": ["b", "c"], "id": 7}\n{"prompt": "d"}\n')
    rows = read_prompts(path)
    assert [(r.id, r.turns) for r in rows] == [("1", ["a"]), ("7", ["b", "c"]), ("4", ["d"])]
    assert len(read_prompts(path, limit=2)) == 2
    path.write_text('{"prompt": "a"}\n{"txt": "b"}\n')
    with pytest.raises(PromptsError, match=r"p.jsonl:2: no prompt in this row of the prompts file \(JSON lines\).*"
                                           r"found 'txt'"):
        read_prompts(path)
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(PromptsError, match="non-empty"):
        read_prompts(path)
    path.write_text("not json\n")
    with pytest.raises(PromptsError, match="not valid JSON"):
        read_prompts(path)
    with pytest.raises(PromptsError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_every_prompt_shape_in_a_json_array_or_json_lines(tmp_path):
    """One reader for every verb: prompt, turns, OpenAI messages (first user turn), question,
    Alpaca instruction (+ input) and text rows, in a JSON array or in JSON lines."""
    import json

    rows = [{"prompt": "a"}, {"turns": ["b", "c"]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "d"},
                          {"role": "assistant", "content": "x"}, {"role": "user", "content": "later"}]},
            {"question": "e"}, {"instruction": "f", "input": "g"}, {"instruction": "h", "input": ""}, {"text": "i"}]
    want = [["a"], ["b", "c"], ["d"], ["e"], ["f\n\ng"], ["h"], ["i"]]
    array, lines = tmp_path / "p.json", tmp_path / "p.jsonl"
    array.write_text(json.dumps(rows, indent=1))
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.turns for r in read_prompts(array)] == want == [r.turns for r in read_prompts(lines)]


def test_a_bad_row_names_the_container_and_the_keys_found(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('[{"prompt": "a"}, {"query": "b", "lang": "en"}]')
    with pytest.raises(PromptsError, match=r"p.json: JSON array item 1: no prompt in this row of the prompts file "
                                           r"\(a JSON array\).*found 'query', 'lang'"):
        read_prompts(path)
    path.write_text('[{"messages": [{"role": "assistant", "content": "x"}]}]')
    with pytest.raises(PromptsError, match="JSON array item 0: 'messages' holds no user message"):
        read_prompts(path)
    path.write_text('["just a string"]')
    with pytest.raises(PromptsError, match=r"\(a JSON array\) must be a JSON object.*got a str"):
        read_prompts(path)


def test_regenerate_answers_a_json_array_of_prompt_and_question_rows(tmp_path):
    """regenerate reads the prompts file through the same reader: each user turn, then the answer to write."""
    import json

    from specheads.data.regenerate_run import read_rows

    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a", "id": "x"}, {"question": "b", "id": "y"}]))
    rows = read_rows(path)
    assert [(r.id, r.messages) for r in rows] == [
        ("x", [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]),
        ("y", [{"role": "user", "content": "b"}, {"role": "assistant", "content": ""}])]
