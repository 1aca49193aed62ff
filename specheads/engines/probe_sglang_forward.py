"""The SGLang probe's forward passes: a CPU attention kernel and SGLang's target and draft modules
run on one sequence (target prefill with aux capture, draft extend, greedy chain).

A sibling of probe_sglang.py, run under the SGLang virtualenv's python; never imports specheads.
"""

from __future__ import annotations

from types import SimpleNamespace


class KVStore:
    """Keys and values each RadixAttention layer has seen since the last reset (a plain KV cache)."""

    def __init__(self):
        self.kv: dict[int, tuple] = {}

    def reset(self) -> None:
        self.kv.clear()


KV = KVStore()


def causal_attention(self, q, k, v, forward_batch, save_kv_cache=True, **kwargs):
    """Causal softmax attention over this layer's own cached and new q/k/v (replaces the kernel);
    an ENCODER_ONLY layer (DFLASH's non-causal draft) sees every new row too.

    q: [N, nh*hd], k: [N, kvh*hd], v: [N, kvh*vd] -> [N, nh*vd]. Rows are one sequence, appended
    after whatever this layer cached since KV.reset().
    """
    import torch

    nh, kvh, hd, vd = self.tp_q_head_num, self.tp_k_head_num, self.qk_head_dim, self.v_head_dim
    q = q.reshape(-1, nh, hd)
    k, v = k.reshape(-1, kvh, hd), v.reshape(-1, kvh, vd)
    past_k, past_v = KV.kv.get(id(self), (k[:0], v[:0]))
    k, v = torch.cat([past_k, k]), torch.cat([past_v, v])  # [P+N, kvh, *]
    KV.kv[id(self)] = (k, v)
    n, total = q.shape[0], k.shape[0]
    rep = nh // kvh
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [P+N, nh, *]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scaling  # [nh, N, P+N]
    if getattr(self, "logit_cap", 0) and self.logit_cap > 0:
        scores = self.logit_cap * torch.tanh(scores / self.logit_cap)
    # SGLang's AttentionType.ENCODER_ONLY, read by name: the kernel runs (and is tested) without SGLang
    if getattr(getattr(self, "attn_type", None), "name", "DECODER") != "ENCODER_ONLY":
        rows = torch.arange(total - n, total).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(total).unsqueeze(0) > rows, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())  # [N, nh, vd]
    return out.reshape(n, nh * vd).to(q.dtype)


def replace_attention_kernel() -> str:
    """Route every RadixAttention through `causal_attention`; returns what was replaced and why."""
    from sglang.srt.layers.radix_attention import RadixAttention

    RadixAttention.forward = causal_attention
    return ("RadixAttention.forward: plain causal softmax over the layer's own q/k/v (SGLang's attention "
            "kernels need CUDA and a paged KV pool), no mask inside the new rows for an ENCODER_ONLY layer "
            "(DFLASH's non-causal draft); projections, RoPE, norms, MLP, fc and lm_head are SGLang's own modules")


def forward_batch(ids, positions, mode, capture, hidden=None):
    """A one-sequence ForwardBatch: every position of `ids` [N] new, at `positions` [N]."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    n = ids.shape[0]
    end = int(positions[-1]) + 1
    return ForwardBatch(
        forward_mode=getattr(ForwardMode, mode), batch_size=1, input_ids=ids,
        req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([end]),
        out_cache_loc=positions.clone(), seq_lens_sum=end, seq_lens_cpu=torch.tensor([end]),
        positions=positions, extend_num_tokens=n, extend_seq_lens=torch.tensor([n]),
        extend_prefix_lens=torch.tensor([end - n]), extend_start_loc=torch.zeros(1, dtype=torch.int64),
        extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[end - n], extend_logprob_start_lens_cpu=[n],
        capture_hidden_mode=getattr(CaptureHiddenMode, capture), return_logprob=False,
        spec_info=None if hidden is None else SimpleNamespace(hidden_states=hidden),
    )


def run_target(target_model, ids):
    """Target prefill in EXTEND mode, capturing hidden states for the draft as the worker does.
    ids [T] -> (hidden for the draft [T, n_aux*H or H], next token id)."""
    import torch

    KV.reset()
    fb = forward_batch(ids, torch.arange(ids.shape[0]), "EXTEND", "FULL")
    out = target_model.forward(ids, fb.positions, fb)
    return out.hidden_states, int(out.next_token_logits[-1].argmax())


def draft_step(draft_model, ids, positions, hidden):
    """One draft forward with SGLang's module: -> (logits [N, Vd], carried hidden [N, H])."""
    from sglang.srt.layers.logits_processor import LogitsMetadata

    fb = forward_batch(ids, positions, "EXTEND", "LAST", hidden)
    out = draft_model.model(ids, positions, fb)
    if isinstance(out, tuple):  # EAGLE-3: (normed for logits, [carried])
        to_logits, carried = out[0], out[1][0]
    else:
        to_logits = carried = out
    logits = draft_model.logits_processor._get_logits(to_logits, draft_model.lm_head,
                                                      LogitsMetadata.from_forward_batch(fb))
    return logits, carried


def to_target_vocab(logits, hot, vocab: int):
    """Draft-vocab logits [N, Vd] placed at target ids [N, V]: through the hot-token map when SGLang
    has one, else draft id i is target id i (what the worker does without a map)."""
    import torch

    full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype)
    if hot is None:
        full[:, :logits.shape[1]] = logits[:, :vocab]
    else:  # a float map (from a float d2t) is used the way SGLang's embedding uses ids: .long()
        full[:, hot.long()] = logits
    return full


def greedy_token(logits, hot):
    """The worker's top-1 draft id mapped to a target id (`hot_token_id[topk_index]`), as the
    0-d tensor the worker feeds to the next step (a float map stays float, as in SGLang)."""
    idx = logits[-1].argmax()
    return hot[idx] if hot is not None else idx


def run_draft(standalone: bool, draft_model, ids, hidden, next_token, hot, vocab: int, k: int):
    """Draft logits at every prompt position [T, V] and the greedy chain [k] after the prompt.

    EAGLE drafts read token x_{t+1} and the target state at t (SGLang's draft extend shifts the ids
    and appends the target's next token x_T), so row T-1 proposes chain[0] = x_{T+1}; the chain then
    feeds each proposal back with the carried draft state. A standalone draft model reads the prompt
    itself (row t predicts x_{t+1}), then x_T at position T, then its own proposals."""
    import torch

    KV.reset()
    t = ids.shape[0]
    if standalone:
        logits, _ = draft_step(draft_model, ids, torch.arange(t), None)
        chain, carried, tok = [], None, torch.tensor(next_token)
    else:
        shifted = torch.cat([ids[1:], torch.tensor([next_token])])
        logits, carried = draft_step(draft_model, shifted, torch.arange(t), hidden)
        chain = [greedy_token(logits, hot)]
        tok = chain[-1]
    prompt_logits, pos = logits, t
    while len(chain) < k:
        state = None if standalone else carried[-1:]
        step_logits, carried = draft_step(draft_model, tok.reshape(1), torch.tensor([pos]), state)
        chain.append(greedy_token(step_logits, hot))
        tok, pos = chain[-1], pos + 1
    return to_target_vocab(prompt_logits, hot, vocab), torch.stack(chain).to(torch.int64)


STANDALONE_NOTE = ("SGLang 0.5.23's draft extend after prefill shifts the ids for STANDALONE as for EAGLE: the "
                   "draft model reads x_1..x_T at positions 0..T-1 (x_0 never enters its KV cache); "
                   "`chain` feeds the whole prompt like our verifier, `chain_as_served` feeds it as SGLang does")


def standalone_chain_as_served(draft_model, ids, next_token: int, k: int):
    """The STANDALONE chain with SGLang's shifted prefill: [x_1..x_T] at 0..T-1, then proposals."""
    import torch

    KV.reset()
    t = ids.shape[0]
    logits, _ = draft_step(draft_model, torch.cat([ids[1:], torch.tensor([next_token])]), torch.arange(t), None)
    chain = [logits[-1].argmax()]
    while len(chain) < k:
        logits, _ = draft_step(draft_model, chain[-1].reshape(1), torch.tensor([t - 1 + len(chain)]), None)
        chain.append(logits[-1].argmax())
    return torch.stack(chain).to(torch.int64)
