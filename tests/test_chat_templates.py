"""Loss masks with real model chat templates (tests/fixtures/chat_templates): golden supervised text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specheads.config import DataConfig, from_dict
from specheads.data.conversations import Conversation, DataError, Message, read_conversations
from specheads.data.tokenize import TemplateError, assistant_mask_from_generation_markers, mask_messages, tokenize_conversation

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
           "</tool_call>", "<tool_response>", "</tool_response>", "<|begin_of_text|>", "<|end_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>",
           "<end_of_turn>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<｜begin▁of▁sentence｜>",
           "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>", "<|startoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>",
           "<|return|>", "<|call|>", "<|constrain|>"]
CORPUS = ["You are a helpful assistant. Hello there! How are you? What is two plus two? Two plus two is four.",
          "Let me add the numbers. The answer is four. Call the add function with a and b.",
          'system user assistant model tool {"name": "add", "arguments": {"a": 2, "b": 2}} parameters'] * 30
FAMILIES = {  # template file, eos, bos, end-of-turn text
    "qwen3": ("qwen3.jinja", "<|im_end|>", None, "<|im_end|>"),
    "llama3": ("llama3.2.jinja", "<|eot_id|>", "<|begin_of_text|>", "<|eot_id|>"),
    "gemma2": ("gemma2.jinja", "<eos>", "<bos>", "<end_of_turn>"),
    "gemma2_marked": ("gemma2_marked.jinja", "<eos>", "<bos>", "<end_of_turn>"),
    "qwen2.5": ("qwen2.5.jinja", "<|im_end|>", None, "<|im_end|>"),
    "mistral": ("mistral_nemo.jinja", "</s>", "<s>", "</s>"),
    "deepseek": ("deepseek_v3.1.jinja", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "gpt_oss": ("gpt_oss.jinja", "<|return|>", "<|startoftext|>", ["<|end|>", "<|return|>", "<|call|>"]),
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hello! How are you?"},
         {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Two plus two is four."}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
# OpenAI form, as `specheads regenerate` writes it: arguments a JSON string, an id (9 characters for Mistral)
OPENAI_CALL = {"id": "call00001", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TOOL_TURNS = [{"role": "user", "content": "What is two plus two?"},
              {"role": "assistant", "content": "", "tool_calls": [OPENAI_CALL]},
              {"role": "tool", "tool_call_id": "call00001", "name": "add", "content": "4"},
              {"role": "assistant", "content": "The answer is four."}]


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


def golden(name, messages, family, tools=None):
    tok, eot = family(name)
    sample = mask_messages(tok, messages, "golden", end_of_turn=eot, tools=tools)
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


def test_qwen25_multi_turn_system_tool_calls_and_empty_turn(family):
    tok, sample, text = golden("qwen2.5", [SYSTEM, *TURNS], family)
    assert text == ["Hello! How are you?<|im_end|>", "Two plus two is four.<|im_end|>"]
    _, _, text = golden("qwen2.5", TURNS[:2], family)  # no system message: the template adds its default one
    assert text == ["Hello! How are you?<|im_end|>"]
    tok, sample, text = golden("qwen2.5", [*TOOL_TURNS, TURNS[0], {"role": "assistant", "content": ""}], family, TOOLS)
    # JSON-string arguments are rendered as an object, as the model writes them (not a quoted string)
    assert text == ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>',
                    "The answer is four.<|im_end|>", "<|im_end|>"]
    assert "<tool_response>\n4\n</tool_response>" in tok.decode(sample.input_ids)  # rendered, not supervised


def test_mistral_nemo_turns_tool_calls_and_system_refused(family):
    _, _, text = golden("mistral", TURNS, family)
    assert text == ["Hello! How are you?</s>", "Two plus two is four.</s>"]
    _, _, text = golden("mistral", [TURNS[0], {"role": "assistant", "content": ""}, *TURNS[2:]], family)
    assert text == ["</s>", "Two plus two is four.</s>"]
    tok, sample, text = golden("mistral", TOOL_TURNS, family, TOOLS)
    assert text == ['[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 2}, "id": "call00001"}]</s>',
                    "The answer is four.</s>"]
    # the template writes the system message into the last user turn only, so earlier turns re-render
    tok, eot = family("mistral")
    with pytest.raises(TemplateError, match="re-renders earlier turns"):
        mask_messages(tok, [SYSTEM, *TURNS], "sys", end_of_turn=eot)


def test_deepseek_v31_turns_thinking_and_tool_calls(family):
    tok, sample, text = golden("deepseek", [SYSTEM, *TURNS], family)
    # the empty-think marker `</think>` after <｜Assistant｜> (thinking off) is boilerplate
    assert text == ["Hello! How are you?<｜end▁of▁sentence｜>", "Two plus two is four.<｜end▁of▁sentence｜>"]
    assert "<｜Assistant｜></think>Two plus" in tok.decode(sample.input_ids)
    think = "<think>Let me add the numbers.</think>The answer is four."
    _, _, text = golden("deepseek", [TURNS[2], {"role": "assistant", "content": think}], family)
    assert text == ["The answer is four.<｜end▁of▁sentence｜>"]  # the template drops reasoning from history
    _, _, text = golden("deepseek", [TURNS[0], {"role": "assistant", "content": ""}], family)
    assert text == ["<｜end▁of▁sentence｜>"]
    # arguments stay a JSON string here: this template concatenates them and fails on an object
    _, _, text = golden("deepseek", TOOL_TURNS, family, TOOLS)
    assert text == ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 2, "b": 2}<｜tool▁call▁end｜>'
                    '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>', "The answer is four.<｜end▁of▁sentence｜>"]


def test_gpt_oss_harmony_channels_and_end_tokens(family):
    _, _, text = golden("gpt_oss", [SYSTEM, *TURNS], family)
    # earlier final answers end with <|end|>, the last (training) one with <|return|>
    assert text == ["Hello! How are you?<|end|>", "Two plus two is four.<|return|>"]
    thought = {"role": "assistant", "thinking": "Let me add the numbers.", "content": "The answer is four."}
    _, _, text = golden("gpt_oss", [TURNS[0], TURNS[1], TURNS[2], thought], family)
    # the last turn's analysis channel is rendered and supervised through its final answer
    assert text == ["Hello! How are you?<|end|>", "Let me add the numbers.<|end|><|start|>assistant<|channel|>final"
                    "<|message|>The answer is four.<|return|>"]
    _, _, text = golden("gpt_oss", [TURNS[2], thought, *TURNS[:2]], family)  # earlier analysis is dropped
    assert text == ["The answer is four.<|end|>", "Hello! How are you?<|return|>"]
    _, _, text = golden("gpt_oss", [TURNS[0], {"role": "assistant", "content": ""}, *TURNS[2:]], family)
    assert text == ["<|channel|>final<|message|><|end|>", "Two plus two is four.<|return|>"]
    tok, sample, text = golden("gpt_oss", TOOL_TURNS, family, TOOLS)
    assert text == [' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}<|call|>',
                    "The answer is four.<|return|>"]
    # a tool call with analysis text, not followed by a final answer: both messages are supervised
    with_text = {**TOOL_TURNS[1], "content": "Let me add."}
    _, _, text = golden("gpt_oss", [TOOL_TURNS[0], with_text, TOOL_TURNS[2]], family, TOOLS)
    assert text == ['Let me add.<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>'
                    '{"a": 2, "b": 2}<|call|>']
    # ... but followed by a final answer the template drops that text: the clear error says so
    tok, eot = family("gpt_oss")
    with pytest.raises(TemplateError, match="drops assistant content"):
        mask_messages(tok, [TOOL_TURNS[0], with_text, *TOOL_TURNS[2:]], "oss", end_of_turn=eot, tools=TOOLS)
    with pytest.raises(TemplateError, match=re.escape("<|channel|> tags in the content field")):
        mask_messages(tok, [TURNS[0], {"role": "assistant", "content": "<|channel|>final<|message|>Hi"}], "oss",
                      end_of_turn=eot)


def test_regenerated_tool_row_reads_and_masks(family, tmp_path):
    """A row as `specheads regenerate` writes it: tool results are never supervised, the call turn is."""
    row = {"id": "t", "tools": TOOLS, "regenerated": {"turns": 1, "truncated_turns": 0}, "messages": [
        SYSTEM, TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": [OPENAI_CALL]},
        {"role": "tool", "tool_call_id": "call00001", "content": "4"}, TOOL_TURNS[3]]}
    path = tmp_path / "regenerated.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (conv,), _ = read_conversations(path)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.tools == TOOLS and conv.messages[2].tool_calls == (OPENAI_CALL,)
    results = {"qwen2.5": "<tool_response>\n4\n</tool_response>",
               "gpt_oss": 'functions.add to=assistant<|channel|>commentary<|message|>"4"<|end|>'}
    for name, want in [("qwen2.5", ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
                                    '<|im_end|>', "The answer is four.<|im_end|>"]),
                       ("gpt_oss", [' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}<|call|>',
                                    "The answer is four.<|return|>"])]:
        tok, eot = family(name)
        sample = tokenize_conversation(tok, conv, 4096, end_of_turn=eot)
        assert supervised_text(tok, sample) == want
        assert results[name] in tok.decode(sample.input_ids)  # the tool result is rendered, not supervised


def test_reader_checks_tool_fields(tmp_path):
    def read(messages):
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"messages": messages}) + "\n")
        return read_conversations(path)[0][0]

    conv = read(TOOL_TURNS)
    assert conv.messages[2] == Message("tool", "4", tool_call_id="call00001", name="add") and conv.tools is None
    with pytest.raises(DataError, match=r"messages\[1\].content': missing"):
        read([TOOL_TURNS[0], {"role": "assistant", "content": None}])
    with pytest.raises(DataError, match="only assistant messages carry tool calls"):
        read([{**TOOL_TURNS[0], "tool_calls": [OPENAI_CALL]}, TOOL_TURNS[3]])
    bad = {"id": "x", "type": "function", "function": {"name": "add", "arguments": 4}}
    with pytest.raises(DataError, match=r"tool_calls\[0\].function.arguments"):
        read([TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": [bad]}])


def test_end_of_turn_config_takes_one_text_or_several():
    assert from_dict(DataConfig, {"end_of_turn": "<|eot_id|>"}).end_of_turn == "<|eot_id|>"
    assert from_dict(DataConfig, {"end_of_turn": ["<|end|>", "<|return|>"]}).end_of_turn == ["<|end|>", "<|return|>"]
    assert from_dict(DataConfig, {}).end_of_turn is None
