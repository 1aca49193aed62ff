"""A tiny Llama GGUF file written with the `gguf` package's own writer (random fp32 weights, the
tiny target's byte-level BPE tokenizer and chat template), for the from-gguf conversion tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2


def _tokenizer_fields(tokenizer_dir: Path) -> dict:
    """Tokens in id order, their GGUF types (3 = control for special tokens), merges, ids, template."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template_file = tokenizer_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else cfg["chat_template"]
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges,
            "bos": special[cfg["bos_token"]], "eos": special[cfg["eos_token"]],
            "pad": special[cfg["pad_token"]], "template": template}


def write_tiny_gguf(path: Path, tokenizer_dir: Path, seed: int = 0, layers: int = LAYERS) -> Path:
    """A small Llama (`layers` decoder layers) with tied embeddings as an F32 GGUF file at `path`."""
    import gguf

    t = _tokenizer_fields(tokenizer_dir)
    vocab, rng = len(t["tokens"]), np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(t["tokens"])
    w.add_token_types(t["types"])
    w.add_token_merges(t["merges"])
    w.add_bos_token_id(t["bos"])
    w.add_eos_token_id(t["eos"])
    w.add_pad_token_id(t["pad"])
    w.add_add_bos_token(False)
    w.add_chat_template(t["template"])

    def add(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", vocab, HIDDEN, scale=1.0)
    add("output_norm.weight", HIDDEN, scale=0.1)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", HIDDEN)
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
