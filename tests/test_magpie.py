"""Magpie (data/magpie.py): the pre-query template on real and hand-written chat templates, seeded
and resumable sampling on the tiny target, golden cleaning, and the prompts file it writes read by
the prompts reader and by `specheads regenerate`, end to end through the CLI."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from refusals import cli, refused
from transformers import AutoTokenizer

from specheads.data.magpie import (
    FilterOptions,
    MagpieError,
    MagpieOptions,
    clean,
    cut_sample,
    end_of_turn,
    pre_query,
    pre_query_text,
    run_magpie,
    samples_path,
)
from specheads.data.prompts import encode_chat, read_prompts, user_turn
from specheads.data.regenerate_run import read_rows, run_regenerate
from specheads.data.regenerate_turns import LocalBackend, RegenOptions
from specheads.data.resume import index_path
from specheads.target import Target

# ChatML-like with a default system turn, written with the tiny tokenizer's special tokens
DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' -%}<|system|>You are a helpful assistant.<|end|>{{ '\\n' }}{%- endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# Llama-2-like: the user turn ends in plain text, no special token
INST = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}[INST] {{ m['content'] }} [/INST]"
        "{%- else -%} {{ m['content'] }}<|endoftext|>{%- endif -%}{%- endfor -%}")
PERMISSIVE = FilterOptions(min_chars=1, keep_truncated=True)
SMALL = MagpieOptions(n=12, batch_size=4, max_new_tokens=6)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


def tokenizer(tiny_target_dir, template: str | None):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.chat_template = template
    return tok


# --- the pre-query template ------------------------------------------------------------------------


def test_pre_query_of_the_tiny_target_is_where_the_user_content_starts(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    pre = pre_query(tok)
    assert pre.text == "<|user|>"  # golden: the template's user-turn opening
    content = "def add(a, b): return their sum"
    full = tok.apply_chat_template(user_turn(content), tokenize=False, add_generation_prompt=True)
    assert full.startswith(pre.text) and full[len(pre.text):].startswith(content)
    assert encode_chat(tok, user_turn(content))[: len(pre.ids)] == pre.ids  # the ids every chat prompt starts with
    assert pre.stop_ids == [tok.convert_tokens_to_ids("<|end|>")] and pre.stop_text == "<|end|>"


def test_pre_query_holds_the_default_or_given_system_turn(tiny_target_dir):
    tok = tokenizer(tiny_target_dir, DEFAULT_SYSTEM)
    assert pre_query_text(tok) == "<|system|>You are a helpful assistant.<|end|>\n<|user|>"
    assert pre_query_text(tok, system="Be brief.") == "<|system|>Be brief.<|end|>\n<|user|>"
    full = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *user_turn("hello there")],
                                   tokenize=False, add_generation_prompt=True)
    assert full.startswith(pre_query_text(tok, "Be brief.") + "hello there")
    tok.eos_token = "<|endoftext|>"  # an eos other than the end-of-turn marker: a sample stops at either
    assert pre_query(tok).stop_ids == [tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]


def test_a_plain_text_end_of_turn_stops_at_eos_and_cuts_the_text(tiny_target_dir):
    tok = tokenizer(tiny_target_dir, INST)
    assert end_of_turn(tok) == (" [/INST]", None)
    pre = pre_query(tok, eos_ids=[0])
    assert pre.text == "[INST] " and pre.stop_ids == [tok.eos_token_id, 0] and pre.stop_text == "[/INST]"


def test_a_sample_ends_at_the_end_of_turn(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    pre, ids = pre_query(tok), tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    rest = tok("never read", add_special_tokens=False)["input_ids"]
    assert cut_sample(tok, ids + pre.stop_ids + rest, pre) == {"text": "def add(a, b):", "truncated": False,
                                                                "tokens": len(ids)}
    assert cut_sample(tok, ids, pre)["truncated"]  # no end of turn within max_new_tokens
    inst = tokenizer(tiny_target_dir, INST)
    text = cut_sample(inst, inst("sum two [/INST] numbers", add_special_tokens=False)["input_ids"], pre_query(inst))
    assert text["text"] == "sum two " and not text["truncated"]


@pytest.mark.parametrize("template,needle", [
    (None, "has no chat template"),
    ("{%- for m in messages -%}<|user|>{{ m['content'] | upper }}{%- endfor -%}", "verbatim"),
    ("{%- for m in messages -%}{{ m['content'][-1] }}|{{ m['content'] }}{%- endfor -%}", "message-dependent"),
    ("{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}", "empty"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_templates_without_a_user_turn_opening_are_refused(tiny_target_dir, template, needle):
    with pytest.raises(MagpieError, match=needle):
        pre_query(tokenizer(tiny_target_dir, template))


# --- options and cleaning --------------------------------------------------------------------------


@pytest.mark.parametrize("make,needle", [
    (lambda: MagpieOptions(n=0), "--n 0"),
    (lambda: MagpieOptions(temperature=0.0), "--temperature 0.0: must be > 0"),
    (lambda: MagpieOptions(top_p=1.5), "--top-p 1.5"),
    (lambda: MagpieOptions(batch_size=0), "--batch-size 0"),
    (lambda: FilterOptions(min_chars=50, max_chars=10), "--min-chars 50"),
    (lambda: FilterOptions(near_jaccard=0.0), "--near-jaccard 0.0"),
])
def test_bad_options_are_refused_by_flag(make, needle):
    with pytest.raises(MagpieError, match=needle):
        make()


def sample(text: str, truncated: bool = False) -> dict:
    return {"text": text, "truncated": truncated, "tokens": 1}


def test_cleaning_drops_what_it_should():
    samples = [sample("  Write a poem about the sea.  "), sample("write a poem   about the SEA."),
               sample("Write a poem about the sea please."), sample("Write a poem about dogs and cats."),
               sample(""), sample("   \n"), sample("Hi"), sample("x" * 3000), sample("Explain\x07 the bell"),
               sample("broken \ufffd bytes here"), sample("A complete prompt cut off", truncated=True),
               sample("Please write a poem about the sea.")]
    kept, counts = clean(samples, FilterOptions(min_chars=5, max_chars=100))
    assert kept == [(0, "Write a poem about the sea."), (3, "Write a poem about dogs and cats."),
                    (11, "Please write a poem about the sea.")]  # another opening: not compared (documented)
    assert asdict(counts) == {"generated": 12, "kept": 3, "dropped": {
        "empty": 2, "non_printable": 2, "too_short": 1, "too_long": 1, "truncated": 1, "duplicate": 1,
        "near_duplicate": 1}}
    kept, _ = clean(samples, FilterOptions(min_chars=5, max_chars=100, keep_truncated=True, near_jaccard=0.9))
    assert [i for i, _ in kept] == [0, 2, 3, 10, 11]


# --- sampling and the files ------------------------------------------------------------------------


def test_same_seed_same_file_and_batches_differ(target, tmp_path):
    outs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / name / "prompts.jsonl"
        run_magpie(target, out, MagpieOptions(**{**asdict(SMALL), "seed": seed}), PERMISSIVE, quiet=True)
        outs[name] = (out.read_bytes(), samples_path(out).read_bytes())
    assert outs["a"] == outs["b"] and outs["a"] != outs["c"]
    batches = [[s["text"] for s in json.loads(line)["samples"]] for line in outs["a"][1].decode().splitlines()]
    assert len(batches) == 3 and len({tuple(b) for b in batches}) == 3  # every batch its own seed


def test_a_killed_run_resumes_to_the_same_file(target, tmp_path):
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    run_magpie(target, whole, SMALL, PERMISSIVE, quiet=True)
    run_magpie(target, cut, SMALL, PERMISSIVE, quiet=True)
    first = index_path(samples_path(cut)).read_text().splitlines()[0]  # as if killed after one batch
    index_path(samples_path(cut)).write_text(first + "\n")
    cut.unlink()
    run_magpie(target, cut, SMALL, PERMISSIVE, quiet=True)
    assert cut.read_bytes() == whole.read_bytes()
    assert samples_path(cut).read_bytes() == samples_path(whole).read_bytes()
    with pytest.raises(MagpieError, match="other magpie"):
        run_magpie(target, cut, MagpieOptions(**{**asdict(SMALL), "temperature": 0.5}), PERMISSIVE, quiet=True)


@pytest.mark.parametrize("system,max_new,needles", [
    ("word " * 2000, 6, ["--system prompt of 10000 characters", "but the target's context is 256", "shorten --system"]),
    (None, 300, ["--max-new-tokens 300 more exceed the target's context of 256", "--max-new-tokens 2"]),
])
def test_a_pre_query_that_leaves_no_room_is_refused_with_the_numbers(target, tmp_path, system, max_new, needles):
    """A system prompt longer than the context (or a sample that cannot fit after it) is refused before
    any sampling, naming the token counts, and nothing is written."""
    opts = MagpieOptions(**{**asdict(SMALL), "system": system, "max_new_tokens": max_new})
    with pytest.raises(MagpieError) as err:
        run_magpie(target, tmp_path / "out.jsonl", opts, PERMISSIVE, quiet=True)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert not list(tmp_path.iterdir())


def test_a_file_not_ours_is_refused_untouched(target, tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"prompt": "my own"}\n')
    with pytest.raises(MagpieError, match="not a `specheads magpie` output"):
        run_magpie(target, out, SMALL, PERMISSIVE, quiet=True)
    assert out.read_text() == '{"prompt": "my own"}\n' and len(list(tmp_path.iterdir())) == 1


def test_the_prompts_file_is_read_by_prompts_and_regenerate(target, tmp_path):
    out = tmp_path / "prompts.jsonl"
    counts = run_magpie(target, out, SMALL, PERMISSIVE, quiet=True)
    prompts = read_prompts(out)
    assert len(prompts) == counts.kept > 0 and all(p.id.startswith("magpie-s0-") for p in prompts)
    rows = read_rows(out)
    assert [r.id for r in rows] == [p.id for p in prompts]
    assert all(r.messages == [{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": ""}]
               for r, p in zip(rows, prompts))
    opts = RegenOptions(max_new_tokens=4)
    report = run_regenerate(out, tmp_path / "regen.jsonl", LocalBackend(target, opts, 4), opts, quiet=True)
    assert report.finished == counts.kept and report.turns == counts.kept


def test_regenerate_reads_multi_turn_prompt_rows(tmp_path):
    path = tmp_path / "mt.jsonl"
    path.write_text(json.dumps({"question_id": 81, "turns": ["first?", "second?"]}) + "\n")
    (row,) = read_rows(path)
    assert row.id == "81" and [(m["role"], m["content"]) for m in row.messages] == [
        ("user", "first?"), ("assistant", ""), ("user", "second?"), ("assistant", "")]


# --- the command -----------------------------------------------------------------------------------


def test_cli_end_to_end(tiny_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    r = cli(["magpie", "--target", tiny_target_dir, "--out", out, "--n", "8", "--batch-size", "4",
             "--max-new-tokens", "6", "--min-chars", "1", "--keep-truncated", "--device", "cpu"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(r.stdout)
    assert counts["generated"] == 8 and counts["kept"] + sum(counts["dropped"].values()) == 8
    assert f"magpie: generated 8, kept {counts['kept']}" in r.stderr
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["counts"] == counts and meta["magpie"]["n"] == 8 and meta["pre_query"] == "<|user|>"
    assert len(read_prompts(out)) == counts["kept"]


def test_cli_refuses_a_target_without_a_chat_template(tiny_target_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_target_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    work = tmp_path / "work"
    work.mkdir()
    refused(["magpie", "--target", plain, "--out", work / "p.jsonl", "--n", "4", "--device", "cpu"],
            ["has no chat template", "use a chat (instruct) model"], work, watch=(plain,))
    assert not (work / "p.jsonl").exists()
