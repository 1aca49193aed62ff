"""Chat-template tokenisation: golden assistant-only masks, their verification, truncation, collate.

The tokenizer is a tiny byte-level BPE trained here in memory, so the test needs no download.
"""
import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specheads.data.conversations import Conversation, Message
from specheads.data.tokenize import (
    TemplateError,
    TokenizedSample,
    TokenizeStats,
    assistant_mask_from_generation_markers,
    collate,
    tokenize_all,
    tokenize_conversation,
)

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
           "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "You are a helpful assistant. Hello there! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. What is two plus two? Two plus two is four.",
    "Speculative decoding drafts several tokens and the target model verifies them in one pass.",
    "Please answer briefly. Sure, here is a short answer with a list: one, two, three.",
    "system user assistant: Hello! Hello there. Hello, how are you? Sure. Yes, sure.",
] * 30

# The project's built-in target template (role tags, <|end|> closes every turn, then a newline).
SIMPLE = ("{%- for message in messages -%}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{{ '\\n' }}"
          "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
# Same render, with the assistant content and its end token inside {% generation %} markers.
SIMPLE_MARKED = ("{%- for message in messages -%}<|{{ message['role'] }}|>"
                 "{%- if message['role'] == 'assistant' -%}"
                 "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
                 "{%- else -%}{{ message['content'] }}<|end|>{%- endif -%}{{ '\\n' }}"
                 "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
# Llama-3 style: bos, role headers, a blank line, <|eot_id|> ends a turn while eos is <|end_of_text|>.
LLAMA3 = ("{{- bos_token -}}{%- for message in messages -%}"
          "<|start_header_id|>{{ message['role'] }}<|end_header_id|>{{ '\\n\\n' }}{{ message['content'] }}<|eot_id|>"
          "{%- endfor -%}"
          "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{%- endif -%}")

TWO_TURNS = Conversation("golden", [
    Message("system", "You are a helpful assistant."),
    Message("user", "Hello there!"),
    Message("assistant", "Hello! How are you?"),
    Message("user", "What is two plus two?"),
    Message("assistant", "Two plus two is four."),
])


@pytest.fixture(scope="module")
def backend():
    """A 600-token byte-level BPE with the chat special tokens, trained in memory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def make_tok(backend):
    """Factory: a PreTrainedTokenizerFast over a copy of the backend with the given template and eos."""
    def make(template=SIMPLE, eos="<|end|>", bos="<|endoftext|>"):
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()),
                                      eos_token=eos, bos_token=bos, pad_token="<|pad|>")
        tok.chat_template = template
        return tok
    return make


def supervised(tok, sample):
    """The decoded string of every supervised token, in order."""
    return [tok.decode([i]) for i, m in zip(sample.input_ids, sample.loss_mask) if m]


def runs(mask):
    """Maximal runs of 1s in a mask as (start, length)."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - start))
            start = None
    return out


# ---------------------------------------------------------------- golden masks


def test_golden_two_turn_simple_template(make_tok):
    tok = make_tok()
    sample = tokenize_conversation(tok, TWO_TURNS, max_length=512)
    assert sample.id == "golden"
    assert tok.decode(sample.input_ids) == (
        "<|system|>You are a helpful assistant.<|end|>\n<|user|>Hello there!<|end|>\n"
        "<|assistant|>Hello! How are you?<|end|>\n<|user|>What is two plus two?<|end|>\n"
        "<|assistant|>Two plus two is four.<|end|>\n")
    assert supervised(tok, sample) == [
        "H", "ello", "!", " How", " are", " you", "?", "<|end|>",
        "Two", " plus", " two", " is", " four", ".", "<|end|>",
    ]
    assert len(sample.input_ids) == len(sample.loss_mask)


def test_multi_turn_mask_covers_only_assistant_turns(make_tok):
    tok = make_tok()
    sample = tokenize_conversation(tok, TWO_TURNS, max_length=512)
    pieces = [tok.decode([i]) for i in sample.input_ids]
    (s1, n1), (s2, n2) = runs(sample.loss_mask)
    assert pieces[s1 - 1] == "<|assistant|>" and pieces[s1 + n1 - 1] == "<|end|>" and pieces[s1 + n1] == "\n"
    assert pieces[s2 - 1] == "<|assistant|>" and pieces[s2 + n2 - 1] == "<|end|>" and pieces[s2 + n2] == "\n"
    assert s1 + n1 < s2 and sum(sample.loss_mask) == n1 + n2
    # nothing of the system or user turns, nor any role tag or trailing newline, is supervised
    assert not any(m for p, m in zip(pieces, sample.loss_mask) if p in ("<|system|>", "<|user|>", "<|assistant|>", "\n"))


def test_llama3_style_template_with_eot_id(make_tok):
    tok = make_tok(LLAMA3, eos="<|end_of_text|>", bos="<|begin_of_text|>")
    sample = tokenize_conversation(tok, TWO_TURNS, max_length=512, end_of_turn="<|eot_id|>")
    pieces = [tok.decode([i]) for i in sample.input_ids]
    assert pieces[:3] == ["<|begin_of_text|>", "<|start_header_id|>", "system"]
    assert pieces.count("<|begin_of_text|>") == 1
    assert supervised(tok, sample) == [
        "H", "ello", "!", " How", " are", " you", "?", "<|eot_id|>",
        "Two", " plus", " two", " is", " four", ".", "<|eot_id|>",
    ]
    first = runs(sample.loss_mask)[0][0]
    assert pieces[first - 3:first] == ["<|end_header_id|>", "\n", "\n"]  # the header's blank line is not supervised


def test_conversation_starting_with_assistant_and_ending_with_user(make_tok):
    tok = make_tok()
    conv = Conversation("c", [Message("assistant", "Sure."), Message("user", "Thank you.")])
    sample = tokenize_conversation(tok, conv, max_length=512)
    assert supervised(tok, sample) == ["Sure", ".", "<|end|>"]
    assert sample.loss_mask[0] == 0  # the role tag


def test_raw_text_sample_is_fully_supervised_with_eos(make_tok):
    tok = make_tok()
    sample = tokenize_conversation(tok, Conversation("doc", [], text="The quick brown fox."), max_length=512)
    assert sample.input_ids[-1] == tok.eos_token_id
    assert tok.decode(sample.input_ids) == "The quick brown fox.<|end|>"
    assert sample.loss_mask == [1] * len(sample.input_ids)


# ---------------------------------------------------------------- verification and template errors


def test_verification_catches_wrong_end_of_turn(make_tok):
    tok = make_tok()
    with pytest.raises(TemplateError) as err:
        tokenize_conversation(tok, TWO_TURNS, max_length=512, end_of_turn="<|endoftext|>")
    msg = str(err.value)
    assert "sample golden" in msg and "assistant turn 0" in msg
    assert "'Hello! How are you?<|endoftext|>'" in msg  # what it should be
    assert "<|end|>" in msg and "end_of_turn" in msg  # what it got, and the fix


def test_llama3_default_eos_is_caught_and_named(make_tok):
    tok = make_tok(LLAMA3, eos="<|end_of_text|>", bos="<|begin_of_text|>")
    with pytest.raises(TemplateError, match=r"sample golden: loss-mask check failed.*<\|eot_id\|>.*<\|end_of_text\|>") as err:
        tokenize_conversation(tok, TWO_TURNS, max_length=512)
    assert "the render continues after the content with '<|eot_id|><|start_header_id|>" in str(err.value)


def test_template_that_rerenders_earlier_turns_is_refused(make_tok):
    tok = make_tok("<|system|>turns={{ messages|length }}<|end|>\n" + SIMPLE)
    with pytest.raises(TemplateError, match=r"sample golden: the chat template re-renders earlier turns.*cannot be used"):
        tokenize_conversation(tok, TWO_TURNS, max_length=512)


def test_template_that_rewrites_content_is_refused(make_tok):
    tok = make_tok(SIMPLE.replace("{{ message['content'] }}", "{{ message['content'] | trim }}"))
    conv = Conversation("pad", [Message("user", "hi"), Message("assistant", "  spaced  ")])
    with pytest.raises(TemplateError, match=r"sample pad: assistant message 1 does not appear verbatim"):
        tokenize_conversation(tok, conv, max_length=512)


def test_template_failure_and_missing_template_name_the_problem(make_tok):
    tok = make_tok("{{ raise_exception('only user/assistant') }}")
    with pytest.raises(TemplateError, match=r"sample golden: the chat template failed"):
        tokenize_conversation(tok, TWO_TURNS, max_length=512)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat_template"):
        tokenize_conversation(tok, TWO_TURNS, max_length=512)


# ---------------------------------------------------------------- generation markers


@pytest.mark.parametrize("conv", [
    TWO_TURNS,
    Conversation("one", [Message("user", "Hi"), Message("assistant", "Hello there!")]),
    Conversation("three", [Message("user", "a"), Message("assistant", "one"), Message("user", "b"),
                           Message("assistant", "two"), Message("user", "c"), Message("assistant", "three")]),
])
def test_generation_markers_agree_with_prefix_method(make_tok, conv):
    tok = make_tok(SIMPLE_MARKED)
    by_markers = assistant_mask_from_generation_markers(tok, conv)
    by_prefix = tokenize_conversation(tok, conv, max_length=512)
    assert by_markers.input_ids == by_prefix.input_ids
    assert by_markers.loss_mask == by_prefix.loss_mask
    assert sum(by_prefix.loss_mask) > 0
    # and the marked template renders exactly like the plain one
    assert by_prefix == tokenize_conversation(make_tok(SIMPLE), conv, max_length=512)


def test_generation_markers_required(make_tok):
    with pytest.raises(TemplateError, match="no \\{% generation %\\} markers"):
        assistant_mask_from_generation_markers(make_tok(SIMPLE), TWO_TURNS)


# ---------------------------------------------------------------- truncation, tokenize_all, collate


def test_truncation_keeps_mask_aligned(make_tok):
    tok = make_tok()
    full = tokenize_conversation(tok, TWO_TURNS, max_length=512)
    second = runs(full.loss_mask)[1][0]
    cut = tokenize_conversation(tok, TWO_TURNS, max_length=second + 3)
    assert len(cut.input_ids) == len(cut.loss_mask) == second + 3
    assert cut.input_ids == full.input_ids[:second + 3] and cut.loss_mask == full.loss_mask[:second + 3]
    assert supervised(tok, cut)[-3:] == ["Two", " plus", " two"]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tok, TWO_TURNS, max_length=0)


def test_tokenize_all_drops_and_counts_unsupervised_samples(make_tok, caplog):
    tok = make_tok()
    long_prompt = Conversation("long", [Message("user", "The quick brown fox jumps over the lazy dog. " * 5),
                                        Message("assistant", "Sure.")])
    short = Conversation("short", [Message("user", "Hi"), Message("assistant", "Hello!")])
    text = Conversation("text", [], text="Two plus two is four.")
    stats = TokenizeStats()
    with caplog.at_level(logging.WARNING):
        samples = tokenize_all(tok, [long_prompt, short, text], max_length=12, stats=stats)
    assert [s.id for s in samples] == ["short", "text"]
    assert (stats.total, stats.kept, stats.dropped, stats.truncated) == (3, 2, 1, 1)
    assert "dropped 1 of 3" in caplog.text


def test_collate_right_pads():
    a = TokenizedSample("a", [5, 6, 7], [0, 1, 1])
    b = TokenizedSample("b", [8], [1])
    batch = collate([a, b], pad_id=1)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(t.dtype == torch.long and t.shape == (2, 3) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError):
        collate([], pad_id=0)


def test_collate_real_samples(make_tok):
    tok = make_tok()
    samples = tokenize_all(tok, [TWO_TURNS, Conversation("s", [Message("user", "Hi"), Message("assistant", "Yes")])], 512)
    batch = collate(samples, pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(samples[0].input_ids))
    assert int(batch["loss_mask"][1].sum()) == sum(samples[1].loss_mask)
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()
