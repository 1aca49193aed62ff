"""EAGLE-1 draft head: fc over [embedding ; feature], one Llama decoder layer without input norm.

The feature f_i is the target's final-normed last hidden state (its lm_head input). A draft step
computes v = layer(fc([E(x_{i+1}) ; f_i])); v regresses f_{i+1} and the frozen target lm_head
turns it into logits for x_{i+2}; later steps feed v back in place of f (docs/algorithms.md
§3). No final norm and no lm_head of its own: exactly what vLLM's `method: eagle` and SGLang's
`LlamaForCausalLMEagle` run. `fc_bias` is SGLang-only (vLLM drops an fc bias silently).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specheads.bounds import bounded
from specheads.heads.eagle3 import ttt_attention_mask
from specheads.heads.losses import ChainCounts, HeadOutput, chain_starts, collect_final, decayed_output, forward_kl, shift
from specheads.hf_compat import cache_kwargs


@dataclass
class EagleOptions:
    """Recipe `head:` section for EAGLE-1; target-derived sizes are filled in by `build_config`."""

    kind: str = "eagle"
    ttt_steps: int = bounded(1, ge=1)  # unrolled draft steps in training (1 = EAGLE-1; more feed v back, HASS-like)
    step_decay: float = bounded(0.8, gt=0, le=1)
    fc_bias: bool = False  # true only for SGLang-only heads (vLLM has no fc bias)
    cls_weight: float = bounded(0.1, ge=0)  # weight of the soft cross-entropy next to the feature regression
    noise: float = bounded(0.0, ge=0)  # U(-noise, noise) added to the input features in training
    intermediate_size: int | None = None  # None -> the target's


@dataclass
class EagleConfig:
    """Full architecture of a trained EAGLE-1 head; round-trips through JSON."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    fc_bias: bool = False
    ttt_steps: int = 1
    step_decay: float = 0.8
    cls_weight: float = 0.1
    noise: float = 0.0
    hidden_act: str = "silu"
    kind: str = "eagle"

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size  # the target's own head: the full vocabulary

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The LlamaConfig whose decoder layer (attention, MLP, RoPE) the draft reuses."""
        cfg = LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, num_hidden_layers=1,
            rope_parameters=dict(self.rope_parameters), hidden_act=self.hidden_act,
            attention_bias=False, mlp_bias=False,
        )
        cfg._attn_implementation = attn_implementation
        return cfg


def build_config(options: EagleOptions, target_config) -> EagleConfig:
    """Derive the head architecture from recipe options and the target's HF config."""
    if options.ttt_steps < 1:
        raise ValueError(f"head.ttt_steps must be >= 1, got {options.ttt_steps}")
    H, heads = target_config.hidden_size, target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    return EagleConfig(
        hidden_size=H, intermediate_size=options.intermediate_size or target_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or H // heads,
        vocab_size=target_config.vocab_size, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5), rope_parameters=dict(rope),
        fc_bias=options.fc_bias, ttt_steps=options.ttt_steps, step_decay=options.step_decay,
        cls_weight=options.cls_weight, noise=options.noise,
    )


class EagleHead(nn.Module):
    """EAGLE-1 drafter. State-dict names are the engines' (fc, layers.0.*; no norm, no lm_head)."""

    kind = "eagle"
    Options = EagleOptions
    Config = EagleConfig

    def __init__(self, config: EagleConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        lc = config.llama_config(attn_implementation)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        layer = LlamaDecoderLayer(lc, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # layer 0 reads the fc output un-normalised
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(lc)
        self._lm_head = None  # the target's output head, bound by `bind_lm_head` (not a parameter)

    @classmethod
    def for_target(cls, options: EagleOptions, target_config, **kw) -> EagleHead:
        return cls(build_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        return []  # only the final-normed state, which every target forward returns

    def bind_lm_head(self, lm_head: nn.Module) -> None:
        """Use the (frozen) target head for `logits`; kept out of the state dict and optimizer."""
        object.__setattr__(self, "_lm_head", lm_head)

    # --- building blocks used by training and by the verifier -----------------------------
    def step(self, hidden, embeds, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """hidden [B, T, H] (feature or previous v), embeds [B, T, H] of the next tokens,
        position_ids [B, T] -> v [B, T, H] (the predicted next feature)."""
        x = self.fc(torch.cat([embeds.to(self.fc.weight.dtype), hidden.to(self.fc.weight.dtype)], -1))
        cos_sin = self.rotary_emb(x, position_ids)
        return self.layers[0](x, attention_mask=attention_mask, position_embeddings=cos_sin,
                              **cache_kwargs(cache))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """v [B, T, H] -> target-vocabulary logits [B, T, V] through the bound target head."""
        if self._lm_head is None:
            raise RuntimeError("EAGLE-1 head has no lm_head bound: call bind_lm_head(target.lm_head)")
        return self._lm_head(out.to(self._lm_head.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the draft vocabulary is the target's

    # --- training ----------------------------------------------------------------------------
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """final [B, T, H]: the target's final-normed last hidden state (the features)."""
        return collect_final(target, batch)

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        """Cached features + batch -> `train_forward` kwargs (embeddings and head weight attached)."""
        return {"final": feats["final"].to(target.dtype), "embeds": target.embed(batch["input_ids"]),
                "lm_head": target.lm_head.weight,  # [V, H], frozen
                "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}

    def forward(self, **inputs) -> HeadOutput:
        return self.train_forward(**inputs)

    def train_forward(self, final, embeds, lm_head, loss_mask, attention_mask) -> HeadOutput:
        """Feature regression + soft cross-entropy over `ttt_steps` unrolled steps (docs/algorithms.md §3).

        final [B, T, H] features f_i; embeds [B, T, H] of x_i; lm_head [V, H]; masks [B, T].
        Row i at step j reads x_{i+j+1}, sits at position i+j, regresses f_{i+j+1} and predicts
        x_{i+j+2} (scored against the target's distribution there).
        """
        B, T = loss_mask.shape
        valid, supervised = attention_mask.bool(), loss_mask.bool() & attention_mask.bool()
        hidden = final
        if self.training and self.config.noise > 0:
            hidden = hidden + (torch.rand_like(hidden) - 0.5) * 2 * self.config.noise
        cache, base_pos = DynamicCache(), torch.arange(T, device=final.device).expand(B, T)
        losses, counts = [], ChainCounts(loss_mask, chain_starts(supervised))
        for j in range(self.config.ttt_steps):
            mask4d = ttt_attention_mask(valid, j, self.fc.weight.dtype)  # [B, 1, T, (j+1)T]
            out = self.step(hidden, shift(embeds, j + 1), base_pos + j, mask4d, cache)
            rows = shift(supervised, j + 2)
            b, i = rows.nonzero(as_tuple=True)
            v, f = out[b, i], final[b, i + j + 1]  # [N, H] predicted and true next feature
            logits = F.linear(v, lm_head.to(v.dtype))  # [N, V]
            with torch.no_grad():
                p = torch.softmax(F.linear(f, lm_head.to(f.dtype)).float(), dim=-1)
            losses.append(regression(v, f) + self.config.cls_weight * forward_kl(logits, p))
            counts.step(rows, b, i, logits.argmax(-1) == p.argmax(-1))
            hidden = out
        return decayed_output(losses, self.config.step_decay, counts)


def regression(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """SmoothL1 (beta 1) averaged over features and rows: [N, H] each; 0 when there are no rows."""
    if pred.shape[0] == 0:
        return pred.sum() * 0.0
    return F.smooth_l1_loss(pred.float(), true.float())
