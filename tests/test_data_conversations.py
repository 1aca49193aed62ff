"""Reading every supported dataset format, the malformed-row messages, skipping, and the split."""
import json

import pytest

from specheads.data.conversations import (
    Conversation,
    DataError,
    Message,
    read_conversations,
    split_heldout,
)

SHAREGPT_ROW = {"id": "a1", "conversations": [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "Hello!"},
]}
EXPECTED_SHAREGPT = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!")]


def write_jsonl(path, rows):
    """Write rows (dicts or raw strings) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_openai(i):
    """A valid OpenAI-messages row with no id."""
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


# ---------------------------------------------------------------- formats


def test_sharegpt_json_list(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([SHAREGPT_ROW, {"conversations": [
        {"from": "user", "value": "x"}, {"from": "chatgpt", "value": "y"}, {"from": "model", "value": "z"}]}]))
    convs, stats = read_conversations(path)
    assert stats.format == "sharegpt" and (stats.read, stats.kept, stats.skipped) == (2, 2, 0)
    assert convs[0] == Conversation("a1", EXPECTED_SHAREGPT)
    assert convs[1].id == "chats:1"
    assert [m.role for m in convs[1].messages] == ["user", "assistant", "assistant"]


def test_json_dict_holding_one_list(tmp_path):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"version": 2, "data": [SHAREGPT_ROW]}))
    convs, _ = read_conversations(path)
    assert convs[0].messages == EXPECTED_SHAREGPT


def test_json_dict_with_two_lists_is_refused(tmp_path):
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"train": [SHAREGPT_ROW], "test": [SHAREGPT_ROW]}))
    with pytest.raises(DataError, match=r"two\.json.*exactly one list"):
        read_conversations(path)


def test_openai_messages_jsonl_with_text_parts(tmp_path):
    row = {"id": 7, "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "answer"},
    ]}
    convs, stats = read_conversations(write_jsonl(tmp_path / "oa.jsonl", [row, good_openai(1)]))
    assert stats.format == "openai"
    assert convs[0].id == "7"
    assert convs[0].messages == [Message("system", "sys"), Message("user", "part one\npart two"),
                                 Message("assistant", "answer")]
    assert convs[1].id == "oa:1"


def test_alpaca(tmp_path):
    rows = [
        {"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "You translate."},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Count.", "output": "1 2 3"},
    ]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows))
    convs, stats = read_conversations(path)
    assert stats.format == "alpaca"
    assert convs[0].messages == [Message("system", "You translate."), Message("user", "Translate.\n\nbonjour"),
                                 Message("assistant", "hello")]
    assert convs[1].messages == [Message("user", "Say hi."), Message("assistant", "hi")]
    assert convs[2].messages[0] == Message("user", "Count.")


def test_raw_text_jsonl_and_txt_blocks(tmp_path):
    convs, stats = read_conversations(write_jsonl(tmp_path / "web.jsonl", [{"text": "doc one"}, {"text": "doc two"}]))
    assert stats.format == "text"
    assert [(c.id, c.text, c.messages) for c in convs] == [("web:0", "doc one", []), ("web:1", "doc two", [])]

    txt = tmp_path / "wiki.txt"
    txt.write_text("First para\nline two\n\n\nSecond para\n\nThird\n")
    convs, stats = read_conversations(txt)
    assert stats.format == "text"
    assert [c.text for c in convs] == ["First para\nline two", "Second para", "Third"]
    assert convs[2].id == "wiki:2"


def test_forced_format_overrides_detection(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain", "instruction": "ignored"}])
    convs, stats = read_conversations(path, fmt="text")
    assert stats.format == "text" and convs[0].text == "plain"
    with pytest.raises(DataError, match="unknown data format 'chatml'"):
        read_conversations(path, fmt="chatml")


def test_detection_uses_first_valid_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{not json", good_openai(1)])
    convs, stats = read_conversations(path, skip_malformed=True)
    assert stats.format == "openai" and stats.kept == 1 and stats.skipped == 1


def test_undetectable_format_names_the_keys(tmp_path):
    path = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "turns": ["q"]}])
    with pytest.raises(DataError, match=r"mt\.jsonl: cannot detect.*question_id.*specheads regenerate"):
        read_conversations(path)


def test_saved_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [SHAREGPT_ROW, {"id": "b2", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    convs, stats = read_conversations(folder)
    assert stats.format == "sharegpt" and [c.id for c in convs] == ["a1", "b2"]
    assert convs[0].messages == EXPECTED_SHAREGPT

    folder_dict = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder_dict))
    assert len(read_conversations(folder_dict)[0]) == 2


def test_parquet_and_csv(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist([SHAREGPT_ROW]), tmp_path / "p.parquet")
    convs, _ = read_conversations(tmp_path / "p.parquet")
    assert convs[0].messages == EXPECTED_SHAREGPT

    (tmp_path / "a.csv").write_text('instruction,input,output\n"Add, please.",1 2,3\n')
    convs, stats = read_conversations(tmp_path / "a.csv")
    assert stats.format == "alpaca"
    assert convs[0].messages == [Message("user", "Add, please.\n\n1 2"), Message("assistant", "3")]


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "data.xml").write_text("<x/>")
    with pytest.raises(DataError, match=r"data\.xml: unsupported file type '\.xml'"):
        read_conversations(tmp_path / "data.xml")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file holds no rows"):
        read_conversations(tmp_path / "empty.jsonl")
    (tmp_path / "plain_folder").mkdir()
    with pytest.raises(DataError, match="save_to_disk"):
        read_conversations(tmp_path / "plain_folder")


# ---------------------------------------------------------------- malformed rows

SG = {"from": "human", "value": "hi"}
GPT = {"from": "gpt", "value": "ok"}
MALFORMED_SHAREGPT = [
    ({"id": "x"}, "conversations", "missing"),
    ({"conversations": "hi"}, "conversations", "expected list, got str"),
    ({"conversations": [SG, {"from": "bot", "value": "ok"}]}, "conversations[1].from", "unknown role 'bot'"),
    ({"conversations": [SG, {"value": "ok"}]}, "conversations[1].from", "missing"),
    ({"conversations": [SG, {"from": "gpt", "value": 3}]}, "conversations[1].value", "expected str, got int"),
    ({"conversations": [SG, "ok"]}, "conversations[1]", "expected an object"),
    ({"conversations": []}, "conversations", "empty conversation"),
    ({"conversations": [SG]}, "conversations", "no assistant turn"),
    ({"id": [1], "conversations": [SG, GPT]}, "id", "expected a string or integer"),
    ({"conversations": [SG, {"from": "gpt", "value": "ok\udfff"}]}, "conversations[1].value",
     "lone surrogate U+DFFF at position 2"),
]


@pytest.mark.parametrize("bad, field, problem", MALFORMED_SHAREGPT)
def test_malformed_sharegpt_row_message(tmp_path, bad, field, problem):
    rows = [SHAREGPT_ROW, SHAREGPT_ROW, bad]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError) as err:
        read_conversations(path)
    msg = str(err.value)
    assert "data.json: row 2:" in msg
    assert f"field '{field}': {problem}" in msg
    assert "skip_malformed" in msg


def test_unknown_role_message_lists_the_valid_roles(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [SHAREGPT_ROW, {"conversations": [SG, {"from": "bot", "value": "x"}]}])
    with pytest.raises(DataError) as err:
        read_conversations(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 1 (line 2): field 'conversations[1].from': unknown role 'bot'; expected one of")
    assert "human, user, gpt, assistant" in msg and msg.endswith("fix the row or set data.skip_malformed: true")


MALFORMED_OTHER = [
    ("openai", {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
     "messages[1].role", "unknown role 'bot'"),
    ("openai", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     "messages[1].content", "missing"),
    ("openai", {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", "expected a string or a list of text parts"),
    ("openai", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "a"}]},
     "messages[0].content[0].type", "unsupported content part type 'image_url'"),
    ("openai", {"messages": [{"role": "user", "content": "q"}]}, "messages", "no assistant turn"),
    ("openai", {"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", "lone surrogate U+D800 at position 1 (counting from 0)"),
    ("openai", {"messages": [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a", "thinking": "hm\udc00"}]},
     "messages[1].thinking", "lone surrogate U+DC00 at position 2"),
    ("openai", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "tools": [{"type": "function", "function": {"name": "\ud83d"}}]},
     "tools[0].function.name", "lone surrogate U+D83D at position 0"),
    ("alpaca", {"instruction": "do", "input": "x\udc00", "output": "y"}, "input", "lone surrogate U+DC00"),
    ("text", {"text": "\ud800"}, "text", "lone surrogate U+D800 at position 0"),
    ("alpaca", {"instruction": "do"}, "output", "missing"),
    ("alpaca", {"instruction": 1, "output": "x"}, "instruction", "expected str, got int"),
    ("alpaca", {"instruction": "do", "input": ["x"], "output": "y"}, "input", "expected str, got list"),
    ("text", {"text": "   "}, "text", "empty text"),
    ("text", {"text": None}, "text", "missing"),
]


@pytest.mark.parametrize("fmt, bad, field, problem", MALFORMED_OTHER)
def test_malformed_rows_other_formats(tmp_path, fmt, bad, field, problem):
    path = write_jsonl(tmp_path / "rows.jsonl", ["", json.dumps(bad)])  # blank first line: line != row
    with pytest.raises(DataError) as err:
        read_conversations(path, fmt=fmt)
    msg = str(err.value)
    assert "rows.jsonl: row 0 (line 2):" in msg and f"field '{field}': {problem}" in msg


def test_accepted_roles_and_non_bmp_text_read_unchanged(tmp_path):
    """OpenAI's developer role is accepted; a character outside the BMP (written in JSON as a whole
    surrogate pair, as json.dumps does) is read as that one character."""
    row = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "s"},
                        {"role": "user", "content": "smile \U0001F600"}, {"role": "assistant", "content": "\U0001F600"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [row])
    assert "\\ud83d\\ude00" in path.read_text()
    convs, _ = read_conversations(path)
    assert convs[0].messages == [Message("developer", "Be brief."), Message("system", "s"),
                                 Message("user", "smile \U0001F600"), Message("assistant", "\U0001F600")]


def test_invalid_json_line_is_a_row_error(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [good_openai(0), good_openai(1), '{"messages": [', good_openai(3)])
    with pytest.raises(DataError, match=r"data\.jsonl: row 2 \(line 3\): field '<line>': invalid JSON"):
        read_conversations(path)


def test_row_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([SHAREGPT_ROW, ["not", "a", "row"]]))
    with pytest.raises(DataError, match=r"list\.json: row 1: field '<row>': expected a JSON object, got list"):
        read_conversations(path)


def test_invalid_json_file_names_the_position(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"conversations": [}]')
    with pytest.raises(DataError, match=r"broken\.json: invalid JSON at line 1, column"):
        read_conversations(path)


def test_skip_malformed_counts_and_keeps_reasons(tmp_path):
    rows = [good_openai(0), "{oops", {"messages": []}, good_openai(3),
            {"messages": [{"role": "user", "content": "q"}]}, good_openai(5)]
    convs, stats = read_conversations(write_jsonl(tmp_path / "mix.jsonl", rows), skip_malformed=True)
    assert [c.id for c in convs] == ["mix:0", "mix:3", "mix:5"]
    assert (stats.read, stats.kept, stats.skipped) == (6, 3, 3)
    assert len(stats.reasons) == 3
    assert "mix.jsonl: row 1 (line 2): field '<line>': invalid JSON" in stats.reasons[0]
    assert "row 2 (line 3): field 'messages': empty conversation" in stats.reasons[1]
    assert "row 4 (line 5): field 'messages': no assistant turn" in stats.reasons[2]


def test_skip_malformed_keeps_only_a_few_reasons(tmp_path):
    rows = [good_openai(0)] + ["{bad"] * 20
    _, stats = read_conversations(write_jsonl(tmp_path / "many.jsonl", rows), skip_malformed=True)
    assert stats.skipped == 20 and 1 <= len(stats.reasons) <= 5


# ---------------------------------------------------------------- split


def make_convs(n):
    """n trivial conversations with distinct ids."""
    return [Conversation(f"c{i}", [Message("user", "q"), Message("assistant", "a")]) for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    convs = make_convs(1000)
    train, held = split_heldout(convs, 0.1)
    train2, held2 = split_heldout(list(reversed(convs)), 0.1)
    ids = lambda cs: {c.id for c in cs}  # noqa: E731
    assert ids(train) & ids(held) == set()
    assert ids(train) | ids(held) == ids(convs)
    assert ids(held) == ids(held2) and ids(train) == ids(train2)  # independent of order
    assert 60 <= len(held) <= 140


def test_split_is_stable_across_dataset_growth_and_golden():
    small_held = {c.id for c in split_heldout(make_convs(200), 0.2)[1]}
    big_held = {c.id for c in split_heldout(make_convs(400), 0.2)[1]}
    assert small_held <= big_held
    # golden: sha256-based, so the same on every machine and Python process
    assert sorted(c.id for c in split_heldout(make_convs(20), 0.25)[1]) == GOLDEN_HELD


def test_split_seed_key_and_bounds():
    convs = make_convs(300)
    assert {c.id for c in split_heldout(convs, 0.3, seed=1)[1]} != {c.id for c in split_heldout(convs, 0.3)[1]}
    by_first_msg = split_heldout(convs, 0.5, key=lambda c: c.messages[0].content)[1]
    assert len(by_first_msg) in (0, 300)  # all share one key, so they land together
    assert split_heldout(convs, 0.0) == (convs, [])
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_heldout(convs, 1.0)


GOLDEN_HELD = ['c11', 'c14', 'c15', 'c16', 'c17', 'c18', 'c19', 'c3', 'c4']
