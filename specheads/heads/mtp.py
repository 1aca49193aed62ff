"""DeepSeek-V3-style multi-token prediction (MTP) modules trained on a frozen target.

Module k: out = block_k(eh_proj_k([enorm_k(E(x)); hnorm_k(h)])), logits = lm_head(norm_k(out)),
with the target's own decoder-layer class as `block`, and the target's embedding and output head
shared (docs/algorithms.md §6). Step 0 reads the target's final-normed state; step j > 0
reads step j-1's post-norm state (what vLLM and SGLang carry, docs/engines.md §2.6). Each step
is trained teacher-forced with a causal mask over its own rows (the paper's objective), which the
verifier's MTP proposer reproduces exactly while the drafts are right.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specheads.bounds import bounded
from specheads.heads.losses import ChainCounts, HeadOutput, chain_starts, collect_final, decayed_output, forward_kl, shift
from specheads.heads.mtp_checkpoint import load_modules
from specheads.hf_compat import cache_kwargs


@dataclass
class MtpOptions:
    """Recipe `head:` section for MTP; sizes come from the target."""

    kind: str = "mtp"
    num_layers: int = bounded(1, ge=1)  # MTP modules (depth D); step j uses module j % D
    ttt_steps: int = bounded(1, ge=1)  # draft steps trained (and the default draft length)
    step_decay: float = bounded(0.8, gt=0, le=1)
    init: str = "last_layer"  # last_layer | random | shipped (fine-tune the target's own MTP layers)


@dataclass
class MtpConfig:
    """A trained MTP head: the target's HF config (to rebuild its layer class) + the MTP shape."""

    target_config: dict
    num_layers: int
    num_target_layers: int
    hidden_size: int
    vocab_size: int
    ttt_steps: int = 1
    step_decay: float = 0.8
    zero_first_embedding: bool = False  # vLLM's DeepSeek-style MTP zeroes E(x) at position 0
    init: str = "last_layer"
    kind: str = "mtp"

    def hf_config(self, attn_implementation: str = "sdpa"):
        """The target's config, extended so that layer ids L..L+D-1 exist (full attention)."""
        from transformers import AutoConfig

        d = dict(self.target_config)
        cfg = AutoConfig.for_model(**d)
        L, D = self.num_target_layers, self.num_layers
        cfg.num_hidden_layers = L + D
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = list(cfg.layer_types)[:L] + ["full_attention"] * D
        cfg._attn_implementation = attn_implementation
        return cfg


ZERO_FIRST_EMBEDDING = {"deepseek_v3", "glm4_moe"}  # engines whose MTP zeroes E(x) at position 0
VALID_INIT = ("last_layer", "random", "shipped")


def family_classes(hf_config):
    """(decoder layer, RMSNorm, rotary embedding) classes of the target's transformers family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    lm_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    module = sys.modules[lm_cls.__module__]
    layer_name = (getattr(lm_cls, "_no_split_modules", None) or [""])[0]
    prefix = layer_name.removesuffix("DecoderLayer")
    rotary = getattr(module, prefix + "RotaryEmbedding", None) or getattr(module, prefix + "TextRotaryEmbedding", None)
    classes = [getattr(module, layer_name, None), getattr(module, prefix + "RMSNorm", None), rotary]  # Qwen3.5: Text*
    if not layer_name.endswith("DecoderLayer") or None in classes:
        raise ValueError(f"target family '{hf_config.model_type}': cannot find its DecoderLayer / RMSNorm / "
                         "RotaryEmbedding classes in transformers, so no MTP block can be built for it")
    return tuple(classes)


def target_config_dict(target_config) -> dict:
    """The target's HF config as plain JSON (what the head needs to rebuild the block)."""
    d = target_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    return d


def build_config(options: MtpOptions, target_config) -> MtpConfig:
    if options.num_layers < 1 or options.ttt_steps < 1:
        raise ValueError(f"head.num_layers ({options.num_layers}) and head.ttt_steps ({options.ttt_steps}) must be >= 1")
    if options.init not in VALID_INIT:
        raise ValueError(f"head.init '{options.init}': expected one of {', '.join(VALID_INIT)}")
    return MtpConfig(
        target_config=target_config_dict(target_config), num_layers=options.num_layers,
        num_target_layers=target_config.num_hidden_layers, hidden_size=target_config.hidden_size,
        vocab_size=target_config.vocab_size, ttt_steps=options.ttt_steps, step_decay=options.step_decay,
        zero_first_embedding=target_config.model_type in ZERO_FIRST_EMBEDDING, init=options.init,
    )


def block_output(out):
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is the state."""
    return out[0] if isinstance(out, tuple) else out


class MtpModule(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj [H, 2H], the family's decoder layer, a final norm."""

    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        Layer, Norm, _ = family_classes(hf_config)
        H, eps = hf_config.hidden_size, getattr(hf_config, "rms_norm_eps", 1e-6)
        self.enorm, self.hnorm, self.norm = Norm(H, eps=eps), Norm(H, eps=eps), Norm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = Layer(hf_config, layer_idx)  # layer_idx L+k: picks MoE / full attention like the engines
        for m in self.block.modules():  # but each draft step has its own one-layer KV cache
            if hasattr(m, "layer_idx"):
                m.layer_idx = 0

    def forward(self, hidden, embeds, position_embeddings, position_ids, mask, cache=None):
        """hidden [B, T, H] (post-norm), embeds [B, T, H] -> post-norm output [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.block(x, attention_mask=mask, position_ids=position_ids,
                         position_embeddings=position_embeddings, **cache_kwargs(cache))
        return self.norm(block_output(out))


class MtpHead(nn.Module):
    """MTP drafter; the engines' layouts are written by export/mtp.py from these names."""

    kind = "mtp"
    Options = MtpOptions
    Config = MtpConfig

    def __init__(self, config: MtpConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        hf = config.hf_config(attn_implementation)
        L = config.num_target_layers
        self.layers = nn.ModuleList([MtpModule(hf, L + k) for k in range(config.num_layers)])
        self.rotary_emb = family_classes(hf)[2](hf)

    @classmethod
    def for_target(cls, options: MtpOptions, target_config, **kw) -> MtpHead:
        return cls(build_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        return []  # MTP reads only the final-normed state (TargetOutput.final)

    def module_for(self, step: int) -> MtpModule:
        return self.layers[step % self.config.num_layers]

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Norms from the target's final norm, block from its last layer (or its shipped MTP layers)."""
        if self.config.init == "shipped":
            load_modules(self, Path(target.path))
            return
        if self.config.init == "random":
            return
        last = target.decoder_layers[-1].state_dict()
        for m in self.layers:
            for norm in (m.enorm, m.hnorm, m.norm):
                norm.weight.copy_(target.final_norm.weight)
            H = m.eh_proj.weight.shape[0]
            m.eh_proj.weight[:, H:] = torch.eye(H)  # start by passing the hidden half through
            m.eh_proj.weight[:, :H].normal_(0, 0.02)
            own = m.block.state_dict()
            if own.keys() == last.keys() and all(own[k].shape == last[k].shape for k in own):
                m.block.load_state_dict(last)

    # --- building blocks used by training and the verifier ----------------------------------
    def step(self, j: int, hidden, embeds, position_ids, mask, cache=None) -> torch.Tensor:
        """Draft step j: hidden [B, T, H], embeds [B, T, H], position_ids [B, T] -> [B, T, H]."""
        cos_sin = self.rotary_emb(hidden, position_ids)
        return self.module_for(j)(hidden, embeds.to(hidden.dtype), cos_sin, position_ids, mask, cache)

    def embed_rows(self, embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Zero E(x) at position 0 where the engines do (DeepSeek-style MTP)."""
        if not self.config.zero_first_embedding:
            return embeds
        return embeds.masked_fill((position_ids == 0)[..., None], 0.0)

    # --- training -------------------------------------------------------------------------
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """final [B, T, H]: the target's final-normed last hidden state (the lm_head input)."""
        return collect_final(target, batch)

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        final = feats["final"].to(target.dtype)
        return {"final": final, "embeds": target.embed(batch["input_ids"]),
                "target_logits": target.lm_head(final),  # [B, T, V]
                "lm_head_weight": target.lm_head.weight,  # [V, H], shared and frozen
                "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}

    def forward(self, **inputs) -> HeadOutput:
        return self.train_forward(**inputs)

    def train_forward(self, final, embeds, target_logits, lm_head_weight, loss_mask,
                      attention_mask) -> HeadOutput:
        """Teacher-forced steps: row i at step j reads E(x_{i+j+1}) at position i+j, predicts x_{i+j+2}.

        final [B, T, H], embeds [B, T, H], target_logits [B, T, V], loss_mask / attention_mask [B, T].
        """
        B, T = loss_mask.shape
        valid = attention_mask.bool()
        supervised = loss_mask.bool() & valid
        target_argmax = target_logits.argmax(-1)  # [B, T]
        mask = causal_padding_mask(valid, final.dtype)  # [B, 1, T, T]
        base = torch.arange(T, device=final.device).expand(B, T)
        hidden = final.to(self.layers[0].eh_proj.weight.dtype)
        losses, counts = [], ChainCounts(loss_mask, chain_starts(supervised))
        for j in range(self.config.ttt_steps):
            pos = base + j
            hidden = self.step(j, hidden, self.embed_rows(shift(embeds, j + 1), pos), pos, mask)
            rows = shift(supervised, j + 2)
            b, i = rows.nonzero(as_tuple=True)
            logits = F.linear(hidden[b, i], lm_head_weight.to(hidden.dtype))  # [N, V]
            src = target_logits[b, i + j + 1]  # [N, V]: the target's distribution for x_{i+j+2}
            losses.append(forward_kl(logits, torch.softmax(src.float(), dim=-1)))
            counts.step(rows, b, i, logits.argmax(-1) == target_argmax[b, i + j + 1])
        return decayed_output(losses, self.config.step_decay, counts)


def causal_padding_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """valid [B, T] -> additive mask [B, 1, T, T]: causal, padded keys blocked, diagonal always open."""
    B, T = valid.shape
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=valid.device))
    allow = causal[None] & valid[:, None, :]
    allow |= torch.eye(T, dtype=torch.bool, device=valid.device)[None]  # no fully blocked rows
    mask = torch.zeros(allow.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[:, None]

