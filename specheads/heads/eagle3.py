"""EAGLE-3 draft head: fused low/mid/high target features, one Llama-style layer, TTT training.

Semantics follow what vLLM and SGLang run (docs/algorithms.md §5): residual = fc output
(or hidden_norm(fc output) with norm_before_residual), qkv read [input_layernorm(emb);
hidden_norm(h)], logits = lm_head(norm(out)), and the pre-norm `out` is carried to the next step.
EAGLE 3.1 options (arXiv 2605.09992): an RMSNorm over the fused features before fc
(`norm_before_fc`) or one per feature (`fc_norm`), and the post-norm state carried instead
(`norm_output`). `qk_norm` makes the layer Qwen3-style (per-head q/k RMSNorm, vLLM's qwen3_eagle3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from specheads.bounds import ConfigError, bounded
from specheads.heads.losses import LOSSES, NOISES, ChainCounts, HeadOutput, add_feature_noise, chain_starts, decayed_output, shift
from specheads.heads.peagle import parallel_train_forward
from specheads.heads.vocab import draft_to_target
from specheads.hf_compat import cache_kwargs


@dataclass
class Eagle3Options:
    """Recipe `head:` section for EAGLE-3; target-derived sizes are filled in by `build_config`."""

    kind: str = "eagle3"
    aux_layers: list[int] | None = None  # HF hidden_states indices (= vLLM ids); None -> (2, L//2, L-3)
    ttt_steps: int = bounded(3, ge=1, hint="draft steps trained")
    step_decay: float = bounded(0.8, gt=0, le=1)
    draft_vocab_size: int | None = bounded(None, ge=1)  # None -> min(V, 32000)
    norm_before_residual: bool = False
    # EAGLE 3.1: at most one of norm_before_fc / fc_norm; norm_output carries norm(out) across steps
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    qk_norm: bool = False  # Qwen3-style draft layer (q/k RMSNorm per head); vLLM only
    intermediate_size: int | None = None  # None -> the target's
    # P-EAGLE (heads/peagle.py): all ttt_steps drafts in one forward from a learned mask_hidden
    parallel_drafting: bool = False
    mask_token_id: int | None = bounded(None, ge=0)  # parallel drafting: None -> vocab_size - 1
    cod_ratio: float = bounded(0.7, gt=0, le=1)  # depth d trains on ~max(cod_ratio^d, cod_min_ratio) of rows
    cod_min_ratio: float = bounded(0.2, gt=0, le=1)
    # training only (never exported): the per-step loss, noise on the target features, draft-layer dropout
    loss: str = "kl"  # kl | tv | nla | lk (heads/losses.py LOSSES)
    feature_noise: str = "none"  # none | uniform | gaussian, on the target features fed to fc
    feature_noise_scale: float = bounded(0.1, ge=0, hint="uniform half-width or gaussian std")
    dropout: float = bounded(0.0, ge=0, le=0.9, hint="dropout on the draft layer's attention and MLP outputs")
    init_lm_head: bool = False  # lm_head (the draft vocabulary's rows) and final norm start as the target's
    freeze_lm_head: bool = False  # with init_lm_head: lm_head and final norm stay the target's (EAGLE-1's choice)

    def __post_init__(self):
        for key, table in (("loss", LOSSES), ("feature_noise", NOISES)):
            if getattr(self, key) not in table:
                raise ConfigError(f"head.{key} '{getattr(self, key)}': expected one of {', '.join(table)}")
        if self.freeze_lm_head and not self.init_lm_head:
            raise ConfigError("head.freeze_lm_head keeps lm_head and the final norm as they start, which is "
                              "random unless head.init_lm_head: set head.init_lm_head=true, or freeze_lm_head=false")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("head.norm_before_fc and head.fc_norm exclude each other (one norm over the "
                              "concatenated features, or one per feature): set one of them to false")


@dataclass
class Eagle3Config:
    """Full architecture of a trained EAGLE-3 head; round-trips through JSON."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    norm_before_residual: bool = False
    ttt_steps: int = 3
    step_decay: float = 0.8
    hidden_act: str = "silu"
    attention_bias: bool = False
    kind: str = "eagle3"
    # EAGLE 3.1 (speculators / SpecForge "EAGLE3.1"), trained here or loaded from elsewhere
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    fc_norm: bool = False  # one RMSNorm per feature before the concatenation
    norm_output: bool = False  # carry norm(out) to the next step instead of the pre-norm out
    qk_norm: bool = False  # Qwen3-style attention: RMSNorm over each q / k head before RoPE
    parallel_drafting: bool = False  # P-EAGLE
    mask_token_id: int | None = None
    cod_ratio: float = 0.7
    cod_min_ratio: float = 0.2
    loss: str = "kl"  # training only, like the three below
    feature_noise: str = "none"
    feature_noise_scale: float = 0.1
    dropout: float = 0.0
    init_lm_head: bool = False
    freeze_lm_head: bool = False

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The LlamaConfig whose building blocks (attention, MLP, RoPE) the draft layer reuses."""
        return self._layer_config(LlamaConfig, attn_implementation, mlp_bias=False)

    def qwen3_config(self, attn_implementation: str = "sdpa") -> Qwen3Config:
        """The Qwen3Config of a Qwen3-style layer (qk_norm): its attention brings the q/k norms."""
        return self._layer_config(Qwen3Config, attn_implementation, use_sliding_window=False)

    def _layer_config(self, cls, attn_implementation: str, **extra):
        """One decoder layer's transformers config of class `cls`, from these options."""
        cfg = cls(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, num_hidden_layers=1,
            rope_parameters=dict(self.rope_parameters), hidden_act=self.hidden_act,
            attention_bias=self.attention_bias, **extra,
        )
        cfg._attn_implementation = attn_implementation
        return cfg


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's / speculators' default taps: states after 2, L//2 and L-3 layers."""
    return [2, num_layers // 2, num_layers - 3]


def build_config(options: Eagle3Options, target_config) -> Eagle3Config:
    """Derive the head architecture from recipe options and the target's HF config."""
    L = target_config.num_hidden_layers
    aux = list(options.aux_layers or default_aux_layers(L))
    if len(set(aux)) != len(aux) or sorted(aux) != aux or not all(0 < a < L for a in aux):
        raise ValueError(
            f"head.aux_layers {aux}: need distinct ascending layer ids in 1..{L - 1} for this "
            f"{L}-layer target (vLLM numbering: id k = hidden state after k layers)"
        )
    V = target_config.vocab_size
    H = target_config.hidden_size
    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    return Eagle3Config(
        hidden_size=H, target_hidden_size=H,
        intermediate_size=options.intermediate_size or target_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or H // heads,
        vocab_size=V, draft_vocab_size=min(options.draft_vocab_size or 32000, V),
        aux_layers=aux, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5), rope_parameters=dict(rope),
        norm_before_residual=options.norm_before_residual, ttt_steps=options.ttt_steps,
        step_decay=options.step_decay, **eagle31_fields(options), **parallel_fields(options, V),
    )


def eagle31_fields(options: Eagle3Options) -> dict:
    """The EAGLE 3.1, Qwen3-layer and training options, as the head config carries them."""
    return {name: getattr(options, name) for name in ("norm_before_fc", "fc_norm", "norm_output", "qk_norm",
                                                       "loss", "feature_noise", "feature_noise_scale", "dropout",
                                                       "init_lm_head", "freeze_lm_head")}


def parallel_fields(options: Eagle3Options, vocab_size: int) -> dict:
    """P-EAGLE's config fields (empty for sequential EAGLE-3); the mask token must be a target id."""
    if not options.parallel_drafting:
        return {}
    mask = vocab_size - 1 if options.mask_token_id is None else options.mask_token_id
    if not 0 <= mask < vocab_size:
        raise ValueError(f"head.mask_token_id {mask} is outside the target vocabulary 0..{vocab_size - 1}")
    if not 0 < options.cod_min_ratio <= options.cod_ratio <= 1:
        raise ValueError("head.cod_min_ratio and head.cod_ratio need 0 < cod_min_ratio <= cod_ratio <= 1")
    return {"parallel_drafting": True, "mask_token_id": mask, "cod_ratio": options.cod_ratio,
            "cod_min_ratio": options.cod_min_ratio}


class Eagle3Layer(nn.Module):
    """One draft decoder layer whose attention reads [norm(embedding); norm(hidden)] (2H wide);
    `qwen3` (a Qwen3Config) swaps in Qwen3's attention, whose q/k heads are RMS-normed."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool, qwen3: Qwen3Config | None = None,
                 dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        H = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(qwen3, layer_idx=0) if qwen3 is not None else LlamaAttention(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            out_features = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * H, out_features, bias=cfg.attention_bias))
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, embeds, hidden, position_embeddings, attention_mask, cache=None):
        """embeds [B, T, H], hidden [B, T, H] -> pre-norm output [B, T, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn, _ = self.self_attn(
            x, position_embeddings=position_embeddings, attention_mask=attention_mask,
            **cache_kwargs(cache),
        )
        r = residual + self.dropout(attn)
        return r + self.dropout(self.mlp(self.post_attention_layernorm(r)))


class Eagle3Head(nn.Module):
    """EAGLE-3 drafter. State-dict names are the ones vLLM reads (fc, layers.0.*, norm, lm_head, d2t, t2d)."""

    counts_ranks = True  # train_forward counts sibling ranks (HeadOutput.counts['rank_hits'])

    kind = "eagle3"
    feature_layout = "taps+final"  # collect(): aux = states at required_layers, concatenated; final
    Options = Eagle3Options
    Config = Eagle3Config

    def __init__(self, config: Eagle3Config, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        lc = config.llama_config(attn_implementation)
        n_aux = len(config.aux_layers)
        self.fc = nn.Linear(n_aux * config.target_hidden_size, config.hidden_size, bias=False)
        if config.norm_before_fc and config.fc_norm:
            raise ValueError("EAGLE-3 config: norm_before_fc and fc_norm exclude each other; set one")
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(n_aux * config.target_hidden_size, eps=config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in range(n_aux))
        qwen3 = config.qwen3_config(attn_implementation) if config.qk_norm else None
        self.layers = nn.ModuleList([Eagle3Layer(lc, config.norm_before_residual, qwen3, config.dropout)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(lc)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        # until a vocab map is set, the draft vocab is the first Vd target ids
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        if config.parallel_drafting:  # P-EAGLE: the fused feature of every masked depth
            self.mask_hidden = nn.Parameter(torch.randn(n_aux * config.target_hidden_size) * 0.02)
        self._target_head = None  # init_lm_head: the target's head rows, copied once the vocab map is set
        if config.freeze_lm_head:  # the target's output space, kept: only the layer, fc (and embeddings' use) learn
            self.lm_head.weight.requires_grad_(False)
            self.norm.weight.requires_grad_(False)

    @classmethod
    def for_target(cls, options: Eagle3Options, target_config, **kw) -> Eagle3Head:
        return cls(build_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        return list(self.config.aux_layers)

    def init_from_target(self, target) -> None:
        """init_lm_head: the final norm starts as the target's; lm_head takes the target's rows of the
        draft vocabulary when the vocab map is set (the draft then starts on the target's output space)."""
        if not self.config.init_lm_head:
            return
        weight = target.lm_head.weight.detach()  # [V, Ht]
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ConfigError(f"head.init_lm_head: the target's lm_head is {tuple(weight.shape)}, the draft head "
                              f"needs {(self.config.vocab_size, self.config.hidden_size)}; set it to false")
        with torch.no_grad():
            self.norm.weight.copy_(target.final_norm.weight.detach().to(self.norm.weight.dtype))
        self._target_head = weight

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit this head")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self._target_head is not None:
            with torch.no_grad():  # [Vd, H]: the target's rows in draft-id order (t2d is sorted)
                self.lm_head.weight.copy_(self._target_head[t2d.to(self._target_head.device)].to(self.lm_head.weight.dtype))
            self._target_head = None

    # --- building blocks used by training and by the verifier -----------------------------
    def fuse(self, aux: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Target states at aux_layers (list of [B, T, Ht], ascending) -> fc output [B, T, H]."""
        if isinstance(aux, (list, tuple)):
            aux = torch.cat(aux, dim=-1)  # [B, T, n*Ht]
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)  # n x [B, T, Ht]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, hidden, embeds, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """One draft step: hidden [B, T, H], embeds [B, T, H], position_ids [B, T] -> out [B, T, H]
        (the state carried to the next step: pre-norm, or normed with `norm_output`)."""
        cos_sin = self.rotary_emb(hidden, position_ids)
        out = self.layers[0](embeds.to(hidden.dtype), hidden, cos_sin, attention_mask, cache)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Step output [B, T, H] -> draft-vocab logits [B, T, Vd] (normed here unless already)."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))

    def draft_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids that are in the draft vocabulary -> their draft ids (t2d is sorted)."""
        return torch.cumsum(self.t2d.long(), 0)[target_ids] - 1

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    # --- training-time test ---------------------------------------------------------------
    @torch.no_grad()
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """Frozen-target features worth caching offline: fused taps and the lm_head input.

        aux [B, T, n*Ht] (states at aux_layers), final [B, T, Ht] (final-normed last state).
        """
        out = target.forward(batch["input_ids"], layers=self.required_layers(),
                             attention_mask=batch["attention_mask"])
        return {"aux": torch.cat([out.hidden[i] for i in self.required_layers()], dim=-1),
                "final": out.final}

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        """Cached features + batch -> `train_forward` kwargs (embeddings and logits recomputed)."""
        final = feats["final"].to(target.dtype)
        inputs = {"aux": feats["aux"], "embeds": target.embed(batch["input_ids"]),
                  "target_logits": target.lm_head(final),  # [B, T, V]
                  "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}
        if self.config.parallel_drafting:
            mask_id = torch.tensor([self.config.mask_token_id], device=batch["input_ids"].device)
            inputs["mask_embed"] = target.embed(mask_id)[0]  # [H]
        return inputs

    def noisy(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n*Ht] with the recipe's feature noise in training (unchanged in eval)."""
        if not self.training:
            return aux
        return add_feature_noise(aux, self.config.feature_noise, self.config.feature_noise_scale)

    def forward(self, **inputs) -> HeadOutput:
        """Training forward (what DDP/FSDP wrappers call): see `train_forward`."""
        return self.train_forward(**inputs)

    def train_forward(self, aux, embeds, target_logits, loss_mask, attention_mask, mask_embed=None) -> HeadOutput:
        """Unrolled TTT over `ttt_steps` (docs/algorithms.md §5); P-EAGLE heads: heads/peagle.py.

        aux [B, T, n*Ht] target features at x_<=i; embeds [B, T, H] of x_i; target_logits
        [B, T, V] (position i predicts x_{i+1}); loss_mask, attention_mask [B, T].
        Row i at step j reads x_{i+j+1}, sits at position i+j and predicts x_{i+j+2}; the
        draft head and the loss run only on rows that count, which keeps the big [.., Vd]
        tensors small.
        """
        if self.config.parallel_drafting:
            return parallel_train_forward(self, aux, embeds, mask_embed, target_logits, loss_mask, attention_mask)
        B, T = loss_mask.shape
        valid = attention_mask.bool()
        target_argmax = target_logits.argmax(-1)  # [B, T]
        supervised = loss_mask.bool() & valid
        in_vocab = self.t2d[target_argmax]  # the target's choice is reachable by the draft
        hidden = self.fuse(self.noisy(aux))
        cache = DynamicCache()
        base_pos = torch.arange(T, device=hidden.device).expand(B, T)
        losses, counts = [], ChainCounts(loss_mask, chain_starts(supervised))
        for j in range(self.config.ttt_steps):
            mask4d = ttt_attention_mask(valid, j, hidden.dtype)  # [B, 1, T, (j+1)T]
            out = self.step(hidden, shift(embeds, j + 1), base_pos + j, mask4d, cache)
            # the predicted token x_{i+j+2} is supervised and the target's argmax is in the draft vocab
            rows = shift(supervised, j + 2) & shift(in_vocab, j + 1)
            b, i = rows.nonzero(as_tuple=True)
            logits = self.logits(out[b, i])  # [N, Vd]
            src = target_logits[b, i + j + 1]  # [N, V]: target at the position predicting x_{i+j+2}
            losses.append(LOSSES[self.config.loss](logits, torch.softmax(src[:, self.t2d].float(), dim=-1)))
            wanted = target_argmax[b, i + j + 1]  # [N], in the draft vocabulary (rows says so)
            counts.step(rows, b, i, self.to_target_ids(logits.argmax(-1)) == wanted,
                        ranks=draft_rank(logits, self.draft_index(wanted)))
            hidden = out
        return decayed_output(losses, self.config.step_decay, counts)


def draft_rank(logits: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """logits [N, Vd], wanted [N] draft ids -> [N] how many draft tokens score strictly higher."""
    return (logits > logits.gather(1, wanted[:, None])).sum(-1)


def ttt_attention_mask(valid: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, (step+1)T]: causal over step-0 keys, plus own row at later steps."""
    B, T = valid.shape
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=valid.device))
    first = causal[None] & valid[:, None, :]  # [B, T, T]
    eye = torch.eye(T, dtype=torch.bool, device=valid.device).expand(B, T, T)
    allow = torch.cat([first] + [eye] * step, dim=-1)  # [B, T, (step+1)T]
    mask = torch.zeros(allow.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[:, None]
