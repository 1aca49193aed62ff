"""Regeneration with the target: assistant turns become the target's own greedy answers."""

from __future__ import annotations

from specheads.data.conversations import Conversation, Message
from specheads.data.regenerate import regenerate_local
from specheads.target import Target
from specheads.verify.decode import greedy_decode


def test_regenerate_matches_plain_greedy(tiny_target_dir):
    target = Target.load(str(tiny_target_dir), device="cpu")
    tok = target.tokenizer
    convs = [
        Conversation("a", [Message("user", "def add(a, b):\n    \"\"\"Sum.\"\"\""), Message("assistant", "x")]),
        Conversation("b", [Message("system", "be brief"), Message("user", "def f():"), Message("assistant", "y"),
                           Message("user", "def g(self, name, default=None):"), Message("assistant", "z")]),
    ]
    out, stats = regenerate_local(target, convs, max_new_tokens=12, batch_size=2, progress=False)
    assert [m.role for m in out[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert out[1].messages[0].content == "be brief" and out[1].messages[3].content.startswith("def g")
    assert stats.turns == 3 and stats.conversations == 2
    for conv in out:
        for i, msg in enumerate(conv.messages):
            if msg.role != "assistant":
                continue
            history = [{"role": m.role, "content": m.content} for m in conv.messages[:i]]
            prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ref = greedy_decode(target, ids, 12, eos_token_ids=[tok.eos_token_id]).tokens
            ref = [t for t in ref if t != tok.eos_token_id]
            assert msg.content == tok.decode(ref, skip_special_tokens=True)
    assert stats.settings["target"]["tokenizer_sha256"] == target.fingerprint()["tokenizer_sha256"]
