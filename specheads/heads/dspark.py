"""DSpark drafter (arXiv 2607.05147): a DFlash block drafter plus a low-rank Markov head and a
confidence head.

The DFlash backbone is held by composition (`self.dflash`, a `DFlashHead`) and trained on one of
the engines' two block layouts: fill-in (`sample_from_anchor: false`, speculators' reading): queries
[anchor, mask x G] at positions a..a+G, slot s = 1..G predicts the token at a+s; or anchor-as-first
(`sample_from_anchor: true`, vLLM native's and SGLang's default, SpecForge's only one): queries
[anchor, mask x (G-1)] at a..a+G-1, slot s = 0..G-1 predicts the token at a+1+s, one query fewer.
The Markov head adds a bias from the previous token (vanilla / gated / rnn, exactly as SGLang
0.5.23 `models/dspark.py` and, for vanilla, vLLM 0.33 `qwen3_dspark.py` compute it); the
confidence head gives each drafted slot a conditional acceptance probability whose running product
the engines use as survival.
docs/dspark_format.md is the spec.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specheads.bounds import bounded
from specheads.heads.dflash import (
    DFlashConfig,
    DFlashHead,
    DFlashOptions,
    block_attention_mask,
    build_config,
    sample_anchors,
)
from specheads.heads.losses import ChainCounts, HeadOutput

MARKOV_TYPES = ("vanilla", "gated", "rnn")
# the Markov / confidence fields of a DSpark head, as every format names them
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


@dataclass
class DSparkOptions:
    """Recipe `head:` section for DSpark; DFlash's options plus the Markov / confidence heads."""

    kind: str = "dspark"
    target_layer_ids: list[int] | None = None  # 0-based layer outputs; None -> DFlash's default spacing
    num_layers: int = bounded(1, ge=1)  # draft decoder layers
    block_size: int = bounded(7, ge=1)  # G drafted tokens per block (the engines' block_size / gamma)
    mask_token_id: int | None = bounded(None, ge=0)  # None -> vocab_size - 1
    num_anchors: int = bounded(512, ge=1)
    loss: str = "ce"  # DFlash block loss: ce (positional decay) | dpace
    loss_decay_gamma: float = bounded(7.0, ge=0)
    dpace_alpha: float = bounded(0.5, ge=0, le=1)
    causal: bool = False
    draft_vocab_size: int | None = bounded(None, ge=1)  # None -> the target's (SGLang needs that)
    intermediate_size: int | None = None
    markov_rank: int = bounded(64, ge=1)  # no engine default; both refuse 0
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (vLLM runs vanilla only)
    enable_confidence_head: bool = False  # vLLM's default
    confidence_head_with_markov: bool = False  # vLLM's default (SGLang's: markov_rank > 0)
    confidence_loss_weight: float = bounded(1.0, ge=0)
    sample_from_anchor: bool = False  # anchor-as-first layout (G queries) instead of fill-in (G + 1)


@dataclass
class DSparkConfig:
    """Full architecture of a trained DSpark head (the DFlash part nested); round-trips through JSON."""

    dflash: DFlashConfig
    markov_rank: int
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    confidence_loss_weight: float = 1.0
    sample_from_anchor: bool = False  # the DFlash block holds G queries (anchor-as-first), else G + 1
    kind: str = "dspark"

    def __post_init__(self):
        if isinstance(self.dflash, dict):  # from head_config.json: unknown keys fail in DFlashConfig
            self.dflash = DFlashConfig(**self.dflash)
        check_markov(self.markov_rank, self.markov_head_type)

    @property
    def block_size(self) -> int:
        """G: drafted tokens per block (the engines' block_size / gamma); DFlash's block (the query
        slots) is G + 1 in the fill-in layout, G when the anchor's own slot drafts."""
        return self.dflash.block_size - self.first_slot

    @property
    def first_slot(self) -> int:
        """The query slot that drafts the first token: 1 (fill-in), 0 (anchor-as-first)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def ttt_steps(self) -> int:
        return self.block_size

    @property
    def draft_vocab_size(self) -> int:
        return self.dflash.draft_vocab_size

    @property
    def vocab_size(self) -> int:
        return self.dflash.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dflash.hidden_size

    @property
    def own_lm_head(self) -> bool:
        return self.dflash.own_lm_head


def check_markov(rank: int, head_type: str) -> None:
    if rank < 1:
        raise ValueError(f"head.markov_rank {rank}: both engines require markov_rank > 0")
    if head_type not in MARKOV_TYPES:
        raise ValueError(f"head.markov_head_type '{head_type}': expected one of {', '.join(MARKOV_TYPES)}")


def build_dspark_config(options: DSparkOptions, target_config) -> DSparkConfig:
    """Derive the architecture: the DFlash part from DFlash's builder, its block the query slots
    (G + 1 fill-in, G anchor-as-first)."""
    check_markov(options.markov_rank, options.markov_head_type)
    shared = {k: v for k, v in asdict(options).items() if k in DFlashOptions.__dataclass_fields__}
    dflash = build_config(DFlashOptions(**{**shared, "kind": "dflash", "block_size": options.block_size + 1}),
                          target_config)
    if options.sample_from_anchor:
        dflash = replace(dflash, block_size=options.block_size)
    return DSparkConfig(dflash=dflash, markov_rank=options.markov_rank, markov_head_type=options.markov_head_type,
                        enable_confidence_head=options.enable_confidence_head,
                        confidence_head_with_markov=options.confidence_head_with_markov,
                        confidence_loss_weight=options.confidence_loss_weight,
                        sample_from_anchor=options.sample_from_anchor)


class MarkovHead(nn.Module):
    """Previous-token logit bias; parameter names are the engines' (markov_w1, markov_w2, gate_proj,
    joint_proj). markov_w2 starts at zero, so the bias starts at exactly zero for every type."""

    def __init__(self, head_type: str, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]: previous token (target ids)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)  # [Vd, r]
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)  # [r, H + r]
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [3r, 2r + H]
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] target ids -> e [..., r] (what the confidence head also reads)."""
        return self.markov_w1(prev)

    def latent(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Slot states hidden [B, N, G, H], previous tokens prev [B, N, G] -> latent [B, N, G, r];
        bias = markov_w2(latent). The rnn runs left to right over the G slots from a zero state."""
        e = self.embed(prev)  # [B, N, G, r]
        if self.head_type == "vanilla":
            return e
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)))
            return gate.to(e.dtype) * e
        state = torch.zeros_like(e[:, :, 0])  # [B, N, r]
        outs = []
        for s in range(e.shape[2]):
            z = torch.cat([state, e[:, :, s], hidden[:, :, s].to(e.dtype)], dim=-1)  # [B, N, 2r + H]
            g, c, o = self.joint_proj(z).chunk(3, dim=-1)
            g = torch.sigmoid(g)
            state = g * state + (1.0 - g) * torch.tanh(c)
            outs.append(torch.tanh(o))
        return torch.stack(outs, dim=2)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [..., r] -> bias [..., Vd] in draft-vocab space."""
        return self.markov_w2(latent)


class ConfidenceHead(nn.Module):
    """proj: Linear(H (+ r), 1) with a bias (both engines hold it in float32; export casts to it)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], markov_embed [..., r] -> raw logit [...]; sigmoid = P(accept | prefix)."""
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


def survival_bce(conf_logits: torch.Tensor, prefix_ok: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """BCE of the survival prod_{j<=s} sigmoid(c_j) against prefix_ok (drafts 1..s all accepted).

    conf_logits / prefix_ok / scored [B, N, G]; mean over `scored` slots (0 when none)."""
    log_s = torch.cumsum(F.logsigmoid(conf_logits.double()), dim=-1).clamp(max=-1e-12)  # log survival
    log_1ms = torch.where(log_s > -0.6931, torch.log(-torch.expm1(log_s)), torch.log1p(-torch.exp(log_s)))
    y = prefix_ok.double()
    nll = -(y * log_s + (1 - y) * log_1ms)
    if not scored.any():
        return conf_logits.sum() * 0.0
    return nll[scored].mean().to(conf_logits.dtype)


def acceptance_targets(correct: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """correct / scored [B, N, G] -> (prefix_ok: drafts 1..s all correct, usable: slots 1..s all scored)."""
    usable = torch.cumprod(scored.long(), dim=-1).bool()
    prefix_ok = torch.cumprod((correct & scored).long(), dim=-1).bool()
    return prefix_ok, usable


class DSparkHead(nn.Module):
    """DSpark drafter. State dict: `dflash.<DFlash names>`, `markov_head.*`, `confidence_head.*`
    (engine names once the `dflash.` prefix is stripped)."""

    kind = "dspark"
    feature_layout = "taps+final"  # collect(): aux = states at required_layers, concatenated; final
    Options = DSparkOptions
    Config = DSparkConfig

    def __init__(self, config: DSparkConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        self.dflash = DFlashHead(config.dflash, attn_implementation=attn_implementation)
        d = config.dflash
        self.markov_head = MarkovHead(config.markov_head_type, d.vocab_size, d.draft_vocab_size,
                                      config.markov_rank, d.hidden_size)
        self.confidence_head = (ConfidenceHead(d.hidden_size, config.markov_rank, config.confidence_head_with_markov)
                                if config.enable_confidence_head else None)

    @classmethod
    def for_target(cls, options: DSparkOptions, target_config, **kw) -> DSparkHead:
        return cls(build_dspark_config(options, target_config), **kw)

    def required_layers(self) -> list[int]:
        return self.dflash.required_layers()

    def init_from_target(self, target) -> None:
        self.dflash.init_from_target(target)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.dflash.set_vocab_map(d2t, t2d)

    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """Cacheable frozen-target features (DFlash's: aux, final)."""
        return self.dflash.collect(target, batch)

    def expand(self, target, feats: dict, batch: dict) -> dict:
        """DFlash's inputs plus input_ids (the Markov head's previous tokens)."""
        return {**self.dflash.expand(target, feats, batch), "input_ids": batch["input_ids"]}

    def forward(self, **inputs) -> HeadOutput:
        return self.train_forward(**inputs)

    # --- the step the engines run, written for all slots of a block at once --------------------
    def block_logits(self, out: torch.Tensor, prev: torch.Tensor, target_head_weight=None) -> torch.Tensor:
        """Drafted-slot states out [B, N, G, H], previous tokens prev [B, N, G] -> logits [B, N, G, Vd]
        = lm_head(out) + markov bias (teacher-forced: prev = the tokens before each slot)."""
        base = self.dflash.logits(out, target_head_weight)  # [B, N, G, Vd]
        return base + self.markov_head.bias(self.markov_head.latent(out, prev)).to(base.dtype)

    def confidence(self, out: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """out [..., H], prev [...] -> P(slot accepted | earlier slots accepted) [...]."""
        return torch.sigmoid(self.confidence_head(out, self.markov_head.embed(prev)))

    # --- training ---------------------------------------------------------------------------
    def train_forward(self, aux, embeds, mask_embed, labels, loss_mask, attention_mask, input_ids,
                      target_head_weight=None) -> HeadOutput:
        """DFlash's block forward, then the block loss on (draft logits + Markov bias) and, with a
        confidence head, the survival BCE. Shapes as `DFlashHead.train_forward`; input_ids [B, T]."""
        d = self.dflash
        Bs = d.config.block_size  # query slots: G + 1 (fill-in) or G (anchor-as-first)
        valid = attention_mask.bool()
        anchors, live = sample_anchors(loss_mask.bool() & valid, valid, d.config.num_anchors,
                                       random=self.training)  # [B, N]
        B, N = anchors.shape
        pos = anchors[:, :, None] + torch.arange(Bs, device=anchors.device)  # [B, N, Bs]
        block = mask_embed.expand(B, N, Bs, -1).clone()
        block[:, :, 0] = embeds.gather(1, anchors[..., None].expand(-1, -1, embeds.shape[-1]))
        cache = DynamicCache()
        T = valid.shape[1]
        d.add_context(cache, d.context(aux), torch.arange(T, device=aux.device).expand(B, T))
        mask = block_attention_mask(anchors, valid, Bs, d.config.causal, d.fc.weight.dtype)
        out = d.block_forward(block.view(B, N * Bs, -1), pos.view(B, N * Bs), mask, cache)
        first = self.config.first_slot  # drafted slots [first, Bs) predict the tokens at a+1..a+G
        drafted = pos[:, :, first:] + (1 - first)  # [B, N, G]: the predicted token's position
        return self._loss(out.view(B, N, Bs, -1)[:, :, first:], drafted, live, labels, input_ids,
                          loss_mask & attention_mask, target_head_weight)

    def _loss(self, out, pos, live, labels, input_ids, supervised, target_head_weight) -> HeadOutput:
        """out [B, N, G, H] drafted slots, pos [B, N, G] the positions of the tokens they predict ->
        weighted CE on logits + bias, chain counts, and the confidence BCE."""
        d = self.dflash
        B, N, G, _ = out.shape
        T = labels.shape[1]
        inside = pos < T
        p = pos.clamp(max=T - 1)
        rows = inside & live[..., None] & supervised.bool().gather(1, p.view(B, -1)).view(B, N, G)  # [B, N, G]
        tgt = labels.gather(1, p.view(B, -1)).view(B, N, G)
        prev = input_ids.gather(1, (p - 1).view(B, -1)).view(B, N, G)  # token before each slot (anchor first)
        latent = self.markov_head.latent(out, prev)  # [B, N, G, r]
        b, n, s = rows.nonzero(as_tuple=True)
        base = d.logits(out[b, n, s], target_head_weight).float()  # [M, Vd]
        logits = base + self.markov_head.bias(latent[b, n, s]).float()
        want = tgt[b, n, s]
        draft_want = d._draft_ids(want)
        reachable = draft_want >= 0
        ce = F.cross_entropy(logits, draft_want.clamp(min=0), reduction="none") * reachable
        weights = d._weights(logits, draft_want, reachable, b, n, s, (B, N, G))
        per_slot = torch.zeros(G, device=out.device).index_add_(0, s, ce)
        wsum = torch.zeros(G, device=out.device).index_add_(0, s, ce * weights)
        count = torch.zeros(G, device=out.device).index_add_(0, s, torch.ones_like(ce)).clamp(min=1)
        loss = (wsum / count).sum() if ce.numel() else logits.sum() * 0.0
        correct_rows = d.to_target_ids(logits.argmax(-1)) == want
        counts = ChainCounts(live)
        for j in range(G):
            sel = s == j
            counts.step(rows[:, :, j], b[sel], n[sel], correct_rows[sel])
        if self.confidence_head is not None:
            correct = torch.zeros_like(rows)
            correct[b, n, s] = correct_rows
            prefix_ok, usable = acceptance_targets(correct, rows)
            conf = self.confidence_head(out.detach(), self.markov_head.embed(prev).detach())  # [B, N, G]
            loss = loss + self.config.confidence_loss_weight * survival_bce(conf, prefix_ok, usable)
        return HeadOutput(loss=loss, step_losses=(per_slot / count).detach(), counts=counts.stacked())
