"""Loss masks with real model chat templates (tests/fixtures/chat_templates): golden supervised text."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specheads.data.conversations import Conversation, Message
from specheads.data.tokenize import TemplateError, assistant_mask_from_generation_markers, mask_messages

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
           "</tool_call>", "<tool_response>", "</tool_response>", "<|begin_of_text|>", "<|end_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>",
           "<end_of_turn>"]
CORPUS = ["You are a helpful assistant. Hello there! How are you? What is two plus two? Two plus two is four.",
          "Let me add the numbers. The answer is four. Call the add function with a and b.",
          'system user assistant model tool {"name": "add", "arguments": {"a": 2, "b": 2}} parameters'] * 30
FAMILIES = {  # template file, eos, bos, end-of-turn text
    "qwen3": ("qwen3.jinja", "<|im_end|>", None, "<|im_end|>"),
    "llama3": ("llama3.2.jinja", "<|eot_id|>", "<|begin_of_text|>", "<|eot_id|>"),
    "gemma2": ("gemma2.jinja", "<eos>", "<bos>", "<end_of_turn>"),
    "gemma2_marked": ("gemma2_marked.jinja", "<eos>", "<bos>", "<end_of_turn>"),
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hello! How are you?"},
         {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Two plus two is four."}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}


@pytest.fixture(scope="module")
def backend():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def family(backend):
    def make(name):
        file, eos, bos, eot = FAMILIES[name]
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()), eos_token=eos,
                                      bos_token=bos, pad_token="<|pad|>")
        tok.chat_template = (TEMPLATES / file).read_text()
        return tok, eot
    return make


def supervised_text(tok, sample) -> list[str]:
    """The decoded text of each maximal run of supervised tokens."""
    runs, current = [], []
    for i, m in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


def golden(name, messages, family):
    tok, eot = family(name)
    sample = mask_messages(tok, messages, "golden", end_of_turn=eot)
    return tok, sample, supervised_text(tok, sample)


def test_qwen3_multi_turn_with_system(family):
    tok, sample, text = golden("qwen3", [SYSTEM, *TURNS], family)
    assert text == ["Hello! How are you?<|im_end|>", "Two plus two is four.<|im_end|>"]
    # the template puts an empty think block before the last answer: boilerplate, not supervised
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nTwo plus" in tok.decode(sample.input_ids)


def test_qwen3_thinking_blocks(family):
    think = "<think>\nLet me add the numbers.\n</think>\n\nThe answer is four."
    msgs = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": think},
            {"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": think}]
    _, _, text = golden("qwen3", msgs, family)
    # an earlier turn is rendered without its reasoning; the last keeps it, and it is supervised
    assert text == ["The answer is four.<|im_end|>", think + "<|im_end|>"]


def test_qwen3_tool_call_and_empty_turn(family):
    msgs = [{"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "Two plus two is four."}]
    _, _, text = golden("qwen3", msgs, family)
    assert text == ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>',
                    "<|im_end|>", "Two plus two is four.<|im_end|>"]


def test_llama3_multi_turn_system_and_tool_call(family):
    _, sample, text = golden("llama3", [SYSTEM, *TURNS], family)
    assert text == ["Hello! How are you?<|eot_id|>", "Two plus two is four.<|eot_id|>"]
    msgs = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "The answer is four."}]
    _, _, text = golden("llama3", msgs, family)
    assert text == ['{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>', "The answer is four.<|eot_id|>"]


def test_gemma2_multi_turn_and_empty_turn(family):
    _, sample, text = golden("gemma2", TURNS, family)
    assert text == ["Hello! How are you?<end_of_turn>", "Two plus two is four.<end_of_turn>"]
    msgs = [TURNS[0], {"role": "assistant", "content": ""}, *TURNS[2:]]
    _, _, text = golden("gemma2", msgs, family)
    assert text == ["<end_of_turn>", "Two plus two is four.<end_of_turn>"]
    tok, eot = family("gemma2")
    with pytest.raises(TemplateError, match="System role not supported"):
        mask_messages(tok, [SYSTEM, *TURNS], "sys", end_of_turn=eot)


@pytest.mark.parametrize("msgs", [TURNS, TURNS[:2], [TURNS[0], {"role": "assistant", "content": ""}, *TURNS[2:]]])
def test_unmarked_template_gives_the_marked_twins_mask(family, msgs):
    plain_tok, eot = family("gemma2")
    marked_tok, _ = family("gemma2_marked")
    conv = Conversation("twin", [Message(m["role"], m["content"]) for m in msgs])
    by_markers = assistant_mask_from_generation_markers(marked_tok, conv)
    for tok in (plain_tok, marked_tok):
        by_prefix = mask_messages(tok, msgs, "twin", end_of_turn=eot)
        assert by_prefix.input_ids == by_markers.input_ids
        assert by_prefix.loss_mask == by_markers.loss_mask
