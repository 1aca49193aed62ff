"""Frozen target wrapper: loads a local HF folder, taps states by hooks, fingerprints, errors."""

from __future__ import annotations

import pytest
import torch

from specheads.target import Target, TargetError, check_fingerprint


def test_load_frozen_and_tap(tiny_target_dir):
    t = Target.load(str(tiny_target_dir), device="cpu")
    assert not any(p.requires_grad for p in t.model.parameters()) and not t.model.training
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = t.forward(ids, layers=[0, 2, t.num_layers - 1])
    ref = t.model(ids, output_hidden_states=True).hidden_states
    assert set(out.hidden) == {0, 2, t.num_layers - 1}
    for i, h in out.hidden.items():
        torch.testing.assert_close(h, ref[i], rtol=0, atol=0)
    with pytest.raises(TargetError, match="outside 0..7"):
        t.forward(ids, layers=[t.num_layers])
    # the final-norm tap is HF's last hidden state, and the output head maps it to the logits
    torch.testing.assert_close(out.final, ref[-1], rtol=0, atol=0)
    torch.testing.assert_close(t.lm_head(out.final), out.logits, rtol=0, atol=0)


def test_fingerprint_refuses_other_target(tiny_target_dir):
    t = Target.load(str(tiny_target_dir), device="cpu")
    fp = t.fingerprint()
    check_fingerprint(fp, t, "head")
    other = dict(fp, tokenizer_sha256="0" * 64)
    with pytest.raises(TargetError, match="tokenizer_sha256"):
        check_fingerprint(other, t, "the head in exports/x")


@pytest.mark.parametrize("trained, loaded", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                             ("float16", "float32"), ("float32", "float16")])
def test_fingerprint_accepts_same_target_in_another_dtype(tiny_target_dir, trained, loaded):
    """A head trained on the bf16 (or fp16, fp32) load of a folder works against any other load of it."""
    fp = Target.load(str(tiny_target_dir), dtype=trained, device="cpu").fingerprint()
    check_fingerprint(fp, Target.load(str(tiny_target_dir), dtype=loaded, device="cpu"), "head")


def test_fingerprint_refuses_other_weights_in_any_dtype(tiny_target_dir, tmp_path):
    """Same tokenizer and shapes, other embedding values (another init): refused in every dtype."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_target_dir, other)
    t = Target.load(str(other), device="cpu")
    torch.manual_seed(5)
    t.embed_tokens.weight.data.normal_(std=t.embed_tokens.weight.std().item())
    t.model.save_pretrained(other)
    for dtype in ("float32", "bfloat16", "float16"):
        fp = Target.load(str(tiny_target_dir), dtype=dtype, device="cpu").fingerprint()
        with pytest.raises(TargetError, match="embedding_sketch"):
            check_fingerprint(fp, Target.load(str(other), device="cpu"), "head")
    # noise of 30% of each row's norm (far above bf16 rounding, 0.4%) is refused too
    t2 = Target.load(str(tiny_target_dir), device="cpu")
    fp = t2.fingerprint()
    w = t2.embed_tokens.weight.data
    w.add_(torch.sign(torch.randn_like(w)) * w.norm(dim=1, keepdim=True) * 0.3 / w.shape[1] ** 0.5)
    with pytest.raises(TargetError, match="embedding_sketch"):
        check_fingerprint(fp, t2, "head")


def test_fingerprint_reads_older_embedding_hashes(tiny_target_dir):
    """Artifacts written before the sketch carry `embedding_sha256` of the embedding in their own
    load dtype: matched against the fp32 load cast to fp32/bf16/fp16; anything else refused."""
    from specheads.target import embedding_hash

    t32 = Target.load(str(tiny_target_dir), device="cpu")
    fp = {k: v for k, v in t32.fingerprint().items() if k != "embedding_sketch"}
    for dtype in ("float32", "bfloat16", "float16"):
        old = embedding_hash(Target.load(str(tiny_target_dir), dtype=dtype, device="cpu").embed_tokens.weight)
        check_fingerprint(dict(fp, embedding_sha256=old), t32, "old head")
    with pytest.raises(TargetError, match="embedding_sha256"):
        check_fingerprint(dict(fp, embedding_sha256="0" * 64), t32, "old head")


def test_missing_target_folder(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        Target.load(str(tmp_path / "nowhere"))
