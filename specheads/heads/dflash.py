"""DFlash drafter: a small Qwen3-style stack that drafts a whole block in one forward.

The block is [anchor token, mask token x (B-1)] at positions a..a+B-1; slot s predicts token
a+s. Every draft layer also attends to context keys/values projected from
hidden_norm(fc([target states at target_layer_ids])) of the positions strictly before the anchor
(the layer's own k_proj / v_proj / k_norm, RoPE at the context position), and attention inside the
block is bidirectional unless `causal`. This is the computation vLLM 0.33 (`qwen3_dflash.py`) and
SGLang 0.5.23 (`models/dflash.py`) run; docs/algorithms.md §10, docs/engines.md §2.9 and §3.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from specheads.bounds import bounded
from specheads.heads.losses import ChainCounts, HeadOutput
from specheads.heads.vocab import draft_to_target
from specheads.hf_compat import cache_kwargs

LOSSES = ("ce", "dpace")


@dataclass
class DFlashOptions:
    """Recipe `head:` section for DFlash; target-derived sizes are filled in by `build_config`."""

    kind: str = "dflash"
    target_layer_ids: list[int] | None = None  # 0-based layer outputs; None -> spaced from 1 to L-3
    num_layers: int = bounded(1, ge=1)  # draft decoder layers (published 8B configs: 5)
    block_size: int = bounded(16, ge=2)  # anchor + block_size - 1 drafted tokens
    mask_token_id: int | None = bounded(None, ge=0)  # None -> vocab_size - 1 (any id works: the embedding is frozen)
    num_anchors: int = bounded(512, ge=1)  # blocks sampled per sequence and step
    loss: str = "ce"  # ce (CE with positional decay) | dpace
    loss_decay_gamma: float = bounded(7.0, ge=0)  # slot s weighs exp(-(s-1)/gamma); 0 -> no decay
    dpace_alpha: float = bounded(0.5, ge=0, le=1)  # D-PACE confidence smoothing
    causal: bool = False  # causal attention inside the block (published DFlash: bidirectional)
    draft_vocab_size: int | None = bounded(None, ge=1)  # None -> the target's (its lm_head is shared, frozen)
    intermediate_size: int | None = None  # None -> the target's


@dataclass
class DFlashConfig:
    """Full architecture of a trained DFlash head; round-trips through JSON."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: list[int]  # 0-based target layer outputs (HF hidden_states index - 1)
    num_target_layers: int
    block_size: int
    mask_token_id: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    causal: bool = False
    num_anchors: int = 512
    loss: str = "ce"
    loss_decay_gamma: float = 7.0
    dpace_alpha: float = 0.5
    hidden_act: str = "silu"
    kind: str = "dflash"

    @property
    def ttt_steps(self) -> int:
        """Draft tokens per block (the default chain length k)."""
        return self.block_size - 1

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size  # the draft reads the target's embeddings: same width

    @property
    def own_lm_head(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def qwen3_config(self, attn_implementation: str = "sdpa") -> Qwen3Config:
        """The Qwen3Config whose decoder layer (q/k norms) and RoPE the draft reuses."""
        cfg = Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), hidden_act=self.hidden_act,
            attention_bias=False, use_sliding_window=False,
        )
        cfg._attn_implementation = attn_implementation
        return cfg


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default (SGLang / SpecForge): the middle layer for one draft layer, else
    `num_draft_layers` ids spaced from 1 to L-3 (36 layers, 5 -> [1, 9, 17, 25, 33])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _check_options(o: DFlashOptions, L: int, V: int) -> None:
    if o.block_size < 2:
        raise ValueError(f"head.block_size {o.block_size}: a block needs the anchor and at least one mask slot")
    if o.num_layers < 1 or o.num_anchors < 1:
        raise ValueError(f"head.num_layers ({o.num_layers}) and head.num_anchors ({o.num_anchors}) must be >= 1")
    if o.loss not in LOSSES:
        raise ValueError(f"head.loss '{o.loss}': expected one of {', '.join(LOSSES)}")
    if o.loss_decay_gamma < 0 or not 0 <= o.dpace_alpha <= 1:
        raise ValueError("head.loss_decay_gamma must be >= 0 and head.dpace_alpha in [0, 1]")
    if o.mask_token_id is not None and not 0 <= o.mask_token_id < V:
        raise ValueError(f"head.mask_token_id {o.mask_token_id} is outside the target vocabulary 0..{V - 1} "
                         "(the engines embed it with the target's table)")


def build_config(options: DFlashOptions, target_config) -> DFlashConfig:
    """Derive the head architecture from recipe options and the target's HF config."""
    L, V, H = target_config.num_hidden_layers, target_config.vocab_size, target_config.hidden_size
    _check_options(options, L, V)
    ids = list(options.target_layer_ids or default_target_layer_ids(L, options.num_layers))
    if len(set(ids)) != len(ids) or sorted(ids) != ids or not all(0 <= t <= L - 2 for t in ids):
        raise ValueError(f"head.target_layer_ids {ids}: need distinct ascending layer ids in 0..{L - 2} for "
                         f"this {L}-layer target (DFlash numbering: id t = the output of layer t)")
    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    return DFlashConfig(
        hidden_size=H, intermediate_size=options.intermediate_size or target_config.intermediate_size,
        num_hidden_layers=options.num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or H // heads,
        vocab_size=V, draft_vocab_size=min(options.draft_vocab_size or V, V),
        target_layer_ids=ids, num_target_layers=L, block_size=options.block_size,
        mask_token_id=V - 1 if options.mask_token_id is None else options.mask_token_id,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6), rope_parameters=dict(rope),
        causal=options.causal, num_anchors=options.num_anchors, loss=options.loss,
        loss_decay_gamma=options.loss_decay_gamma, dpace_alpha=options.dpace_alpha,
    )


def rope_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on keys [B, h, T, d] with cos/sin [B, T, d] (transformers' rotate_half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return k * cos + rotate_half(k) * sin


class DFlashHead(nn.Module):
    """DFlash drafter. State-dict names are the engines' (fc, hidden_norm, layers.{i}.*, norm,
    and with a reduced vocabulary lm_head, d2t, t2d); the embedding and, by default, the output
    head are the target's."""

    kind = "dflash"
    feature_layout = "taps+final"  # collect(): aux = states at required_layers, concatenated; final
    Options = DFlashOptions
    Config = DFlashConfig

    def __init__(self, config: DFlashConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        qc = config.qwen3_config(attn_implementation)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(qc, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qc)
        if config.own_lm_head:
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self._target_head = None  # the target's head rows seed a reduced lm_head (set_vocab_map)

    @classmethod
    def for_target(cls, options: DFlashOptions, target_config, **kw) -> DFlashHead:
        return cls(build_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        """HF hidden_states indices of the target layers read (output of layer t = index t + 1)."""
        return [t + 1 for t in self.config.target_layer_ids]

    def init_from_target(self, target) -> None:
        if self.config.own_lm_head:
            self._target_head = target.lm_head.weight.detach()

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Reduced vocabulary only: keep the map and start lm_head from the target's rows."""
        if not self.config.own_lm_head:
            return
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit this head")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self._target_head is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(self._target_head[t2d].to(self.lm_head.weight.dtype))
            self._target_head = None

    # --- building blocks shared by training and the verifier ------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Target states at the tapped layers [B, T, K*H] -> normed context [B, T, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def add_context(self, cache: DynamicCache, ctx: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Append each layer's context keys/values (ctx [B, T, H] at position_ids [B, T]) to `cache`."""
        B, T, _ = ctx.shape
        cos, sin = self.rotary_emb(ctx, position_ids)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(B, T, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(ctx).view(B, T, -1, attn.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
            cache.update(rope_keys(k, cos, sin), v, i)

    def block_forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                      cache: DynamicCache) -> torch.Tensor:
        """Block embeddings [B, Q, H] at position_ids [B, Q], additive mask [B, 1, Q, ctx + Q] over
        [context ; block] keys -> final-normed states [B, Q, H]. Appends the block to `cache`."""
        h = embeds.to(self.fc.weight.dtype)
        cos_sin = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=cos_sin, **cache_kwargs(cache))
            h = h[0] if isinstance(h, tuple) else h
        return self.norm(h)

    def logits(self, out: torch.Tensor, target_head_weight: torch.Tensor | None) -> torch.Tensor:
        """Normed states [..., H] -> draft logits [..., Vd] (the target's head unless reduced)."""
        if self.config.own_lm_head:
            return self.lm_head(out)
        return F.linear(out, target_head_weight.to(out.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t) if self.config.own_lm_head else draft_ids

    # --- training ---------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """Cacheable frozen-target features: aux [B, T, K*H] (tapped states), final [B, T, H]."""
        out = target.forward(batch["input_ids"], layers=self.required_layers(),
                             attention_mask=batch["attention_mask"])
        return {"aux": torch.cat([out.hidden[i] for i in self.required_layers()], dim=-1),
                "final": out.final}

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        """Cached features + batch -> `train_forward` kwargs: labels are the target's greedy
        tokens (labels[t] = argmax of the target at t-1, what greedy verification accepts)."""
        argmax = target.lm_head(feats["final"].to(target.dtype)).argmax(-1)  # [B, T]
        labels = torch.cat([argmax[:, :1], argmax[:, :-1]], dim=1)
        mask_id = torch.tensor([self.config.mask_token_id], device=batch["input_ids"].device)
        inputs = {"aux": feats["aux"], "embeds": target.embed(batch["input_ids"]),
                  "mask_embed": target.embed(mask_id)[0], "labels": labels,
                  "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}
        if not self.config.own_lm_head:
            inputs["target_head_weight"] = target.lm_head.weight
        return inputs

    def forward(self, **inputs) -> HeadOutput:
        """Training forward (what DDP/FSDP wrappers call): see `train_forward`."""
        return self.train_forward(**inputs)

    def train_forward(self, aux, embeds, mask_embed, labels, loss_mask, attention_mask,
                      target_head_weight=None) -> HeadOutput:
        """One block per sampled anchor, all blocks of a batch in one forward.

        aux [B, T, K*H], embeds [B, T, H], mask_embed [H], labels [B, T] (target greedy token at
        each position), loss_mask / attention_mask [B, T]. Slot s of the block at anchor a reads
        the mask token at position a+s and predicts labels[a+s].
        """
        Bs = self.config.block_size
        valid = attention_mask.bool()
        anchors, live = sample_anchors(loss_mask.bool() & valid, valid, self.config.num_anchors,
                                       random=self.training)  # [B, N], [B, N]
        B, N = anchors.shape
        offsets = torch.arange(Bs, device=anchors.device)
        pos = anchors[:, :, None] + offsets  # [B, N, Bs]
        block = mask_embed.expand(B, N, Bs, -1).clone()
        block[:, :, 0] = embeds.gather(1, anchors[..., None].expand(-1, -1, embeds.shape[-1]))
        cache = DynamicCache()
        T = valid.shape[1]
        self.add_context(cache, self.context(aux), torch.arange(T, device=aux.device).expand(B, T))
        mask = block_attention_mask(anchors, valid, Bs, self.config.causal, self.fc.weight.dtype)
        out = self.block_forward(block.view(B, N * Bs, -1), pos.view(B, N * Bs), mask, cache)
        return self._block_loss(out.view(B, N, Bs, -1), pos, live, labels, loss_mask & attention_mask,
                                target_head_weight)

    def _block_loss(self, out, pos, live, labels, supervised, target_head_weight) -> HeadOutput:
        """out [B, N, Bs, H] -> weighted CE over supervised slots 1..Bs-1, with chain counts."""
        B, N, Bs, _ = out.shape
        T = labels.shape[1]
        inside = pos[:, :, 1:] < T  # [B, N, Bs-1]
        p = pos[:, :, 1:].clamp(max=T - 1)
        rows = inside & live[..., None] & supervised.bool().gather(1, p.view(B, -1)).view(B, N, Bs - 1)
        tgt = labels.gather(1, p.view(B, -1)).view(B, N, Bs - 1)
        b, n, s = rows.nonzero(as_tuple=True)
        logits = self.logits(out[b, n, s + 1], target_head_weight).float()  # [M, Vd]
        want = tgt[b, n, s]
        draft_want = self._draft_ids(want)
        reachable = draft_want >= 0
        ce = F.cross_entropy(logits, draft_want.clamp(min=0), reduction="none") * reachable
        weights = self._weights(logits, draft_want, reachable, b, n, s, (B, N, Bs - 1))
        per_slot = torch.zeros(Bs - 1, device=out.device).index_add_(0, s, ce)
        wsum = torch.zeros(Bs - 1, device=out.device).index_add_(0, s, ce * weights)
        count = torch.zeros(Bs - 1, device=out.device).index_add_(0, s, torch.ones_like(ce)).clamp(min=1)
        loss = (wsum / count).sum() if ce.numel() else logits.sum() * 0.0
        counts = ChainCounts(live)  # anchors play the role of positions
        correct = self.to_target_ids(logits.argmax(-1)) == want
        for j in range(Bs - 1):
            sel = s == j
            counts.step(rows[:, :, j], b[sel], n[sel], correct[sel])
        return HeadOutput(loss=loss, step_losses=(per_slot / count).detach(), counts=counts.stacked())

    def _draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids [M] -> draft-vocab ids (-1 where the reduced vocabulary lacks the token)."""
        if not self.config.own_lm_head:
            return target_ids
        index = torch.cumsum(self.t2d.long(), 0) - 1  # [V]: draft id of every kept target id
        return torch.where(self.t2d[target_ids], index[target_ids], -1)

    def _weights(self, logits, draft_want, reachable, b, n, s, shape) -> torch.Tensor:
        """Per-row loss weights [M] (detached): exp(-(s-1)/gamma) decay, or D-PACE's expected
        number of further accepted tokens that depend on the slot."""
        cfg = self.config
        if cfg.loss == "ce":
            if cfg.loss_decay_gamma == 0:
                return torch.ones_like(logits[:, 0])
            return torch.exp(-s.float() / cfg.loss_decay_gamma)  # s is 0-based here: slot s+1
        with torch.no_grad():
            q = torch.softmax(logits, -1).gather(1, draft_want.clamp(min=0)[:, None])[:, 0] * reachable
            conf = torch.ones(shape, device=logits.device)  # [B, N, Bs-1]; unscored slots count as 1
            conf[b, n, s] = (1 - cfg.dpace_alpha) * q + cfg.dpace_alpha
            prefix = torch.cumprod(conf, dim=-1)  # P(slots 1..s all accepted)
            tail = prefix.flip(-1).cumsum(-1).flip(-1)  # sum over s' >= s
            return tail[b, n, s]


def sample_anchors(supervised: torch.Tensor, valid: torch.Tensor, num: int,
                   random: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors per sequence: positions a >= 1 whose next token is supervised (context a-1 and
    the anchor are real tokens). supervised / valid [B, T] -> anchors [B, N], live [B, N].

    Training samples `num` of them uniformly without replacement; evaluation takes `num`
    evenly spaced ones. Sequences with fewer pad with anchor 1 marked dead."""
    B, T = valid.shape
    ok = torch.zeros_like(valid)
    ok[:, 1:T - 1] = valid[:, 1:T - 1] & supervised[:, 2:]
    N = max(1, min(num, int(ok.sum(1).max())))
    anchors = torch.ones(B, N, dtype=torch.long, device=valid.device)
    live = torch.zeros(B, N, dtype=torch.bool, device=valid.device)
    for i in range(B):
        cand = ok[i].nonzero().flatten()
        if cand.numel() > N:
            pick = torch.randperm(cand.numel(), device=cand.device)[:N] if random else \
                torch.linspace(0, cand.numel() - 1, N, device=cand.device).round().long()
            cand = cand[pick.sort().values]
        anchors[i, : cand.numel()] = cand
        live[i, : cand.numel()] = True
    return anchors, live


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, causal: bool,
                         dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, N*Bs, T + N*Bs]: a block sees the real context positions before its
    anchor and its own block (all of it, or slots <= its own when `causal`)."""
    B, N = anchors.shape
    T = valid.shape[1]
    j = torch.arange(T, device=valid.device)
    ctx = (j[None, None] < anchors[..., None]) & valid[:, None]  # [B, N, T]
    ctx = ctx[:, :, None].expand(B, N, block_size, T).reshape(B, N * block_size, T)
    same = torch.eye(N, dtype=torch.bool, device=valid.device)
    inner = torch.ones(block_size, block_size, dtype=torch.bool, device=valid.device)
    if causal:
        inner = torch.tril(inner)
    blocks = torch.kron(same.int(), inner.int()).bool()  # [N*Bs, N*Bs]
    allow = torch.cat([ctx, blocks.expand(B, -1, -1)], dim=-1)
    mask = torch.zeros(allow.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[:, None]
