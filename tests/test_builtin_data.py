"""Demo data from the stdlib: module-level split, conversation extraction, atomic writes."""
import ast
import json

import pytest

from specheads.builtin import stdlib

SOURCE = '''
import os


def plain(a, b=1):
    """Add things.

    More words.
    """
    total = a + b
    # a comment that belongs to the body
    return total * 2 + len(os.sep)


def only_pass(x):
    """Nothing here."""
    pass


def no_doc(x):
    return x + 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 + 11


class Box:
    async def method(self,
                     key):
        """Fetch a key."""
        value = await self.store.get(key)
        return value if value is not None else self.default
'''


@pytest.fixture(scope="module")
def subset():
    """The first 80 stdlib modules, split."""
    return stdlib.split_sources(stdlib.read_sources(limit=80))


def test_split_is_by_module_stable_and_about_ten_percent():
    rels = stdlib.module_paths()
    assert rels == sorted(rels) and rels
    assert not any("site-packages" in r or r.startswith("test/") for r in rels)
    held = [r for r in rels if stdlib.is_heldout(r)]
    assert 0.05 < len(held) / len(rels) < 0.15
    assert held == [r for r in rels if stdlib.is_heldout(r)]  # same answer every call


def test_train_and_heldout_share_no_module(subset):
    train, heldout = subset
    assert heldout, "the first 80 modules should contain a held-out one"
    assert not {s.rel for s in train} & {s.rel for s in heldout}
    assert all(stdlib.is_heldout(s.rel) for s in heldout)


def test_extraction_of_a_known_source():
    convs = stdlib.extract_conversations(stdlib.SourceFile("pkg/mod.py", SOURCE))
    names = [c["id"].rsplit(":", 1)[1] for c in convs]
    assert names == ["plain", "method"]  # `pass`-only and docstring-less functions are skipped
    user, body = (m["content"] for m in convs[0]["messages"])
    assert user == 'def plain(a, b=1):\n    """Add things.\n\n    More words.\n    """'
    assert body.startswith("    total = a + b\n    # a comment")
    method_user = convs[1]["messages"][0]["content"]
    assert method_user.startswith("async def method(self,\n                 key):")
    assert convs[1]["messages"][1]["content"].startswith("    value = await")


def test_conversations_are_well_formed_python(subset):
    train, _ = subset
    convs = stdlib.conversations(train)
    assert len(convs) > 50
    for conv in convs:
        roles = [m["role"] for m in conv["messages"]]
        assert roles == ["user", "assistant"]
        user, body = (m["content"] for m in conv["messages"])
        assert user.lstrip().startswith(("def ", "async def "))
        assert stdlib.MIN_BODY_CHARS <= len(body) <= stdlib.MAX_BODY_CHARS
        assert body[0] in " \t" and body.strip()
        ast.parse(user + "\n" + body)  # signature + docstring + body is the whole function


def test_write_demo_data(tmp_path):
    paths = stdlib.write_demo_data(tmp_path, n_prompts=5, limit=80)
    assert set(paths) == {"train", "heldout", "heldout_prompts"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "heldout.jsonl", "heldout_prompts.jsonl", "train.jsonl"]  # no temp files left
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    train_mods = {stdlib.module_of(r["id"]) for r in rows["train"]}
    held_mods = {stdlib.module_of(r["id"]) for r in rows["heldout"]}
    assert train_mods and held_mods and not train_mods & held_mods
    held_by_id = {r["id"]: r for r in rows["heldout"]}
    assert 0 < len(rows["heldout_prompts"]) <= 5
    for p in rows["heldout_prompts"]:
        assert p["prompt"] == held_by_id[p["id"]]["messages"][0]["content"]
    again = stdlib.write_demo_data(tmp_path / "again", n_prompts=5, limit=80)
    assert all(again[k].read_bytes() == paths[k].read_bytes() for k in paths)


def test_atomic_write_failure_keeps_old_file(tmp_path):
    target = stdlib.write_jsonl_atomic(tmp_path / "x.jsonl", [{"a": 1}])

    def broken():
        yield {"a": 2}
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        stdlib.write_jsonl_atomic(target, broken())
    assert target.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]
