"""A small independent draft LM with the target's tokenizer, distilled on the target's distribution.

The draft is an ordinary Llama causal LM (every engine loads it: vLLM `draft_model`, SGLang
`STANDALONE`) with the target's vocabulary, special ids and RoPE. Training minimises the forward
KL(p_target || q_draft) of the next token at every supervised position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specheads.bounds import bounded
from specheads.heads.losses import HeadOutput, collect_final, forward_kl, shift, stack_counts


@dataclass
class DraftOptions:
    """Recipe `head:` section for a draft model; None sizes are the target's."""

    kind: str = "draft"
    num_layers: int = bounded(2, ge=1)
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    init_from_target: bool = True  # copy embeddings, the first layers, norm and lm_head when widths match
    ttt_steps: int = bounded(4, ge=1)  # default draft length k (reported acceptance uses this many positions)


@dataclass
class DraftConfig:
    """The draft LM's HF (Llama) config dict plus training-only fields."""

    model_config: dict
    vocab_size: int
    ttt_steps: int = 4
    init_from_target: bool = True
    kind: str = "draft"

    def llama_config(self, attn_implementation: str = "sdpa"):
        from transformers import LlamaConfig

        cfg = LlamaConfig(**{k: v for k, v in self.model_config.items() if k != "model_type"})
        cfg._attn_implementation = attn_implementation
        return cfg


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_config(options: DraftOptions, target_config) -> DraftConfig:
    """A Llama config sized by the options, with the target's vocabulary, context, RoPE and ids."""
    from transformers import LlamaConfig

    tc = target_config
    H = options.hidden_size or tc.hidden_size
    heads = options.num_attention_heads or (tc.num_attention_heads if H == tc.hidden_size else max(1, H // 64))
    if H % heads:
        raise ValueError(f"head.hidden_size {H} is not divisible by head.num_attention_heads {heads}")
    kv = options.num_key_value_heads or (getattr(tc, "num_key_value_heads", None) or heads if H == tc.hidden_size else heads)
    if options.num_layers < 1 or heads % kv:
        raise ValueError(f"head.num_layers must be >= 1 and num_attention_heads ({heads}) a multiple of "
                         f"num_key_value_heads ({kv})")
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=H, num_hidden_layers=options.num_layers,
        intermediate_size=options.intermediate_size or (tc.intermediate_size if H == tc.hidden_size else 4 * H),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=H // heads,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
        rope_parameters=dict(rope), tie_word_embeddings=False,
        **{k: getattr(tc, k, None) for k in SPECIAL_IDS},
    )
    d = cfg.to_dict()
    for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        d.pop(key, None)
    return DraftConfig(model_config=d, vocab_size=tc.vocab_size, ttt_steps=options.ttt_steps,
                       init_from_target=options.init_from_target)


class DraftHead(nn.Module):
    """Wraps a LlamaForCausalLM; its state dict is `model.<HF names>`, exported as a plain HF folder."""

    kind = "draft"
    Options = DraftOptions
    Config = DraftConfig

    def __init__(self, config: DraftConfig, attn_implementation: str = "sdpa", model=None):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.config = config
        self.model = model if model is not None else LlamaForCausalLM(config.llama_config(attn_implementation))

    @classmethod
    def for_target(cls, options: DraftOptions, target_config, **kw) -> DraftHead:
        return cls(build_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        return []

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Copy every tensor whose name and shape match the target's (embeddings, first layers, head)."""
        if not self.config.init_from_target:
            return
        theirs = target.model.state_dict()
        own = self.model.state_dict()
        same = {k: v for k, v in theirs.items() if k in own and own[k].shape == v.shape}
        self.model.load_state_dict(same, strict=False)

    # --- training -------------------------------------------------------------------------
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """final [B, T, H]: the target's lm_head input (its logits are recomputed in `expand`)."""
        return collect_final(target, batch)

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        return {"input_ids": batch["input_ids"],
                "target_logits": target.lm_head(feats["final"].to(target.dtype)),  # [B, T, V]
                "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}

    def forward(self, **inputs) -> HeadOutput:
        return self.train_forward(**inputs)

    def train_forward(self, input_ids, target_logits, loss_mask, attention_mask) -> HeadOutput:
        """Forward KL at rows i whose next token x_{i+1} is supervised; counts estimate chain
        acceptance teacher-forced (draft j accepted at row i if rows i..i+j all match the target).

        input_ids, loss_mask, attention_mask [B, T]; target_logits [B, T, V].
        """
        valid = attention_mask.bool()
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask.long()).logits  # [B, T, V]
        rows = shift(loss_mask.bool() & valid, 1)
        b, i = rows.nonzero(as_tuple=True)
        loss = forward_kl(logits[b, i], torch.softmax(target_logits[b, i].float(), dim=-1))
        match = (logits.argmax(-1) == target_logits.argmax(-1)) & rows  # [B, T]
        reached = torch.ones_like(rows)
        counts = {"rows": [], "reached": [], "cond_rows": []}
        for j in range(self.config.ttt_steps):
            rows_j = rows & shift(rows, j)  # draft j from row i is scored at row i + j
            counts["cond_rows"].append((reached & rows_j).sum())
            reached = reached & shift(match, j)
            counts["rows"].append(rows_j.sum())
            counts["reached"].append((reached & rows_j).sum())
        return HeadOutput(loss=loss, step_losses=loss.detach()[None].expand(self.config.ttt_steps).clone(),
                          counts=stack_counts(counts))
