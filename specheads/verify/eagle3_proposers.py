"""EAGLE-3 drafting (docs/algorithms.md §4-§5): the chain proposer (greedy, or sampled from q),
the EAGLE-2 dynamic and static tree proposers over its state, and the kind's `make_proposer`.

The verified draft state is `Eagle3Proposer`'s: its draft cache holds `rows` rows computed from
real target features only, and `last_out` is the pre-norm output of the last of them (it predicts
the next token). A tree proposer drafts on top of that state, one draft forward per tree level:
a node's row reads the output of its parent's row (the root's is `last_out`) and the embedding
of its own token, sits at position `rows - 1 + depth`, and attends to the real prefix plus its
own ancestors' rows (a draft tree mask). Speculative rows are cropped before a draft is returned.
P-EAGLE heads (`parallel_drafting`) draft a chain from the same state in one forward
(`verify.peagle_proposers`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads.target import TargetError, TargetOutput
from specheads.verify.peagle_proposers import PEagleProposer, SampledPEagleProposer
from specheads.verify.ragged import batch_mask, keep_paths, stack_rows, take_row
from specheads.verify.sampling import Warper, expand_draft_logits, sample
from specheads.verify.steps import TREE_ATTENTION, causal_mask, check_tree_attention, positions, trim_cache
from specheads.verify.trees import SettingsError, Tree, TreeError, tree_from_choices, tree_from_parents

# --- the chain ---------------------------------------------------------------------------------


def check_head_fits(head, target) -> None:
    """Refuse a head whose vocabulary / width / taps do not match the target it is run with."""
    cfg = head.config
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} vs the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} vs the target's {target.hidden_size}")
    bad_taps = [a for a in head.required_layers() if not 0 < a < target.num_layers]
    if bad_taps:
        problems.append(f"aux layers {bad_taps} outside 1..{target.num_layers - 1}")
    if problems:
        raise TargetError("the EAGLE-3 head does not fit this target: " + "; ".join(problems))


class Eagle3Proposer:
    """Chain drafts from an EAGLE-3 head (docs/algorithms.md §5, inference alignment).

    Row i of the draft (RoPE position i) reads fuse(target states at position i) and the
    embedding of token i+1; its output predicts token i+2. Draft step j >= 1 reads the previous
    step's pre-norm output and the embedding of d_j at position P-1+j. The draft's own KV cache
    keeps only rows computed from real target features.

    In a draft group (`draft_group`, several rows of the decode batch over one head) `accept`
    is deferred: it keeps the accepted rows' features in `pending`, and the group runs every
    member's pending rows in one forward before drafting; `propose` runs them alone otherwise.
    """

    def __init__(self, head, target):
        check_head_fits(head, target)
        self.head = head.eval()
        self.target = target
        self.layers = head.required_layers()
        self.cache = None
        self.rows = 0  # draft cache rows computed from real target features
        self.last_out = None  # pre-norm output of the last real row: [1, 1, H]
        self.pending = None  # (target features [1, n, F], next ids [n]) accepted, not yet run
        self.deferred = False  # set by a draft group: accept leaves its rows to the group

    @property
    def dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def _taps(self, out: TargetOutput, n: int) -> torch.Tensor:
        """The target features of rows 0..n-1 the draft reads: aux states [1, n, n_aux * Ht]."""
        return torch.cat([out.hidden[i][:, :n] for i in self.layers], dim=-1)

    def _features(self, taps: torch.Tensor) -> torch.Tensor:
        """Target features [B, n, F] -> the draft's input states [B, n, H]."""
        return self.head.fuse(taps)

    def _extend(self, taps: torch.Tensor, next_ids: torch.Tensor, start: int) -> None:
        """Run draft rows start..start+n-1 from target features taps [1, n, F] and the tokens
        after them (next_ids [n])."""
        if start != self.rows:
            raise RuntimeError(f"draft rows out of step: have {self.rows}, asked to add at {start}")
        n = taps.shape[1]
        hidden = self._features(taps)  # [1, n, H]
        embeds = self.target.embed(next_ids.reshape(1, n).to(self.target.device))  # [1, n, H]
        mask = causal_mask(start, n, self.dtype, hidden.device)
        o = self.head.step(hidden, embeds, positions(start, n, hidden.device), mask, self.cache)
        self.rows += n
        self.last_out = o[:, -1:]

    def catch_up(self) -> None:
        """Run the rows a deferred `accept` left pending (one draft forward of this row alone)."""
        if self.pending is not None:
            taps, next_ids = self.pending
            self.pending = None
            self._extend(taps, next_ids, self.rows)

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        self.cache, self.rows, self.pending = DynamicCache(), 0, None
        ids = prompt_ids.reshape(-1)
        next_ids = torch.cat([ids[1:], ids.new_tensor([first_token])])  # x_1 .. x_P
        self._extend(self._taps(out, ids.numel()), next_ids, 0)

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """k draft tokens [k] (target ids); the speculative cache rows are dropped afterwards."""
        self.catch_up()
        out = self.last_out
        tokens = []
        for j in range(k):
            if j > 0:
                emb = self.target.embed(tokens[-1].reshape(1, 1))
                pos = positions(self.rows - 1 + j, 1, out.device)
                out = self.head.step(out, emb, pos, None, self.cache)
            draft_id = self.head.logits(out)[0, -1].argmax()
            tokens.append(self.head.to_target_ids(draft_id))
        trim_cache(self.cache, self.rows)
        return torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None:
        self.catch_up()
        if start != self.rows:
            raise RuntimeError(f"draft rows out of step: have {self.rows}, asked to add at {start}")
        self.pending = (self._taps(out, inputs.numel()), following.reshape(-1))
        if not self.deferred:
            self.catch_up()

    def checkpoint(self) -> tuple[int, torch.Tensor]:
        """Its verified draft state (rows, last output [1, 1, H]), for `rewind` (a timing repeats a step)."""
        if self.pending is not None:
            raise RuntimeError("checkpoint with accepted rows pending: draft (or catch up) first")
        return self.rows, self.last_out

    def rewind(self, point: tuple[int, torch.Tensor]) -> None:
        """Back to a `checkpoint`: later rows cropped from the draft cache, pending rows dropped."""
        self.rows, self.last_out = point
        self.pending = None
        trim_cache(self.cache, self.rows)

    # --- draft groups (protocols.GroupedProposer) ----------------------------------------------

    def group_drafter(self) -> Eagle3Proposer | None:
        """Itself, when its head's attention honours the ragged 4-D masks a group needs."""
        impl = getattr(self.head.layers[0].self_attn.config, "_attn_implementation", None) or "eager"
        return self if impl in TREE_ATTENTION else None

    def group_key(self) -> tuple:
        """Rows of one proposer class over one head draft together."""
        return type(self), id(self.head)

    def draft_group(self, members: list[Eagle3Proposer], ks: list[int], samplers: list,
                    stops: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return draft_group(members, ks, samplers, stops)


class SampledEagle3Proposer(Eagle3Proposer):
    """EAGLE-3 chain proposer that samples d_j ~ q_j = warp(draft logits) and returns q.

    Same verified state as `Eagle3Proposer` (start / accept unchanged); q is expressed over the
    target vocabulary, 0 outside the draft vocabulary, warped exactly like the target.
    """

    @torch.no_grad()
    def propose_sampled(self, k: int, warper: Warper,
                        gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        return self.propose_until(k, warper, gen, None)

    @torch.no_grad()
    def propose_until(self, k: int, warper: Warper, gen: torch.Generator,
                      stop: Callable[[int], bool] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k draft tokens [n] and their q [n, V]; `stop(j)` (None: never) is asked after the
        warper saw position j's logits, before d_j is drawn (`protocols.StoppingProposer`)."""
        self.catch_up()
        head, out = self.head, self.last_out
        V = self.target.vocab_size
        ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=out.device))
        tokens, qs = [], []
        for j in range(k):
            if j > 0:
                emb = self.target.embed(tokens[-1].reshape(1, 1))
                out = head.step(out, emb, positions(self.rows - 1 + j, 1, out.device), None,
                                self.cache)
            q = warper(expand_draft_logits(head.logits(out)[0, -1], ids, V))  # [V]
            if stop is not None and stop(j + 1):
                break
            tokens.append(sample(q.to(gen.device), gen).to(out.device))
            qs.append(q)
        trim_cache(self.cache, self.rows)
        if not tokens:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return torch.stack(tokens), torch.stack(qs)


# --- draft groups: one drafter forward per draft position for several rows ---------------------


@torch.no_grad()
def draft_group(members: list[Eagle3Proposer], ks: list[int], samplers: list,
                stops: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Member b's chain of <= ks[b] drafts, top-1 (samplers[b] None) or sampled with samplers[b] =
    (warper, generator), ended early where stops[b](j) says so (`protocols.DraftAsk.stop`), exactly
    as its own `propose` / `propose_sampled` / `propose_until` would draft it, for all members at
    once: their one-row caches stacked (`ragged.stack_rows`), their pending rows run in one
    forward, then one forward per draft position while any member still drafts. -> per member
    (ids [n], q [n, V] or None).

    Members (same class, same head) keep their own state: each takes its caught-up rows back
    (views of the stacked cache) and from now on defers `accept` to the group's next forward.
    """
    cache = stack_rows([m.cache for m in members])  # [G, heads, L, head_dim] per layer
    rows, last = _catch_up_group(members, cache)  # [G], [G, 1, H]
    for b, m in enumerate(members):
        take_row(cache, b, rows[b], m.cache)
        m.rows, m.last_out, m.pending, m.deferred = rows[b], last[b: b + 1], None, True
    return _draft_positions(members[0], cache, rows, last, ks, samplers, stops or [None] * len(ks))


def _catch_up_group(members: list[Eagle3Proposer], cache) -> tuple[list[int], torch.Tensor]:
    """Every member's pending rows (n_b each, none for some) in one draft forward over the
    stacked cache, moved right after each member's rows -> (rows [G], last outputs [G, 1, H])."""
    lead, pending = members[0], [m.pending for m in members]
    rows, L = [m.rows for m in members], cache.get_seq_length()
    if all(p is None for p in pending):
        return rows, torch.cat([m.last_out for m in members])
    taps, nexts = next(p for p in pending if p is not None)
    empty = (taps[:, :0], nexts[:0])  # a member without pending rows rides along, unread
    pending = [p if p is not None else empty for p in pending]
    n = [p[1].numel() for p in pending]
    N = max(n)
    hidden = lead._features(torch.cat([F.pad(t, (0, 0, 0, N - k)) for (t, _), k in zip(pending, n)]))
    ids = torch.stack([F.pad(x.reshape(-1), (0, N - k)) for (_, x), k in zip(pending, n)])  # [G, N]
    pos = torch.tensor(rows, device=hidden.device)[:, None] + torch.arange(N, device=hidden.device)
    mask = batch_mask([torch.ones(k, k, dtype=torch.bool).tril() for k in n], rows, L, lead.dtype,
                      hidden.device)  # [G, 1, N, L + N]
    out = lead.head.step(hidden, lead.target.embed(ids.to(lead.target.device)), pos, mask, cache)
    rows = keep_paths(cache, rows, L, [list(range(k)) for k in n])  # [G, N, H] -> its rows moved
    last = [out[b: b + 1, k - 1: k] if k else m.last_out for b, (m, k) in enumerate(zip(members, n))]
    return rows, torch.cat(last)


def _draft_positions(lead: Eagle3Proposer, cache, rows: list[int], out: torch.Tensor, ks: list[int],
                     samplers: list, stops: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Draft position j of every member from out [G, 1, H] (their last outputs), then one forward
    of the drafts just picked at positions rows_b - 1 + j, each row seeing its own real rows and
    its own speculative ones, while any member still drafts (one past its ks[b] or stopped rides
    along, unread)."""
    head, target = lead.head, lead.target
    G, L, V, k = len(ks), cache.get_seq_length(), target.vocab_size, max(ks)
    # query j - 1 of the chain of k - 1 speculative rows is draft position j's (keys: L + j)
    mask = batch_mask([torch.ones(k - 1, k - 1, dtype=torch.bool).tril()] * G, rows, L, lead.dtype,
                      out.device) if k > 1 else None  # [G, 1, k - 1, L + k - 1]
    base = torch.tensor(rows, device=out.device)[:, None] - 1  # [G, 1]
    vocab = None  # target id of every draft id (sampled members)
    tokens: list[list] = [[] for _ in ks]
    qs: list[list] = [[] for _ in ks]
    live = [True] * G  # member b drew every draft so far and was not stopped
    fed = None  # [G]: the drafts of position j - 1, fed at position j
    for j in range(k):
        live = [alive and j < kb for alive, kb in zip(live, ks)]
        if not any(live):
            break
        if j > 0:
            # a copy, not a view: CUDA's memory-efficient sdpa reads the mask from its data pointer
            # in 16-byte loads, and this view's offset can be misaligned ("misaligned address")
            step_mask = None if mask is None else mask[:, :, j - 1: j, : L + j].clone()
            out = head.step(out, target.embed(fed.reshape(G, 1)), base + j, step_mask, cache)
        logits = head.logits(out)[:, -1]  # [G, Vd]
        fed = head.to_target_ids(logits.argmax(-1))  # [G]: top-1, replaced where sampled
        for b in (b for b in range(G) if live[b]):
            q = None
            if samplers[b] is not None:
                if vocab is None:
                    vocab = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=out.device))
                q = samplers[b][0](expand_draft_logits(logits[b], vocab, V))  # [V]
            if stops[b] is not None and stops[b](j + 1):
                live[b] = False
                continue
            if q is not None:
                fed[b] = sample(q.to(samplers[b][1].device), samplers[b][1]).to(out.device)
                qs[b].append(q)
            tokens[b].append(fed[b])
    return [chain(t, q, sampler is not None, V) for t, q, sampler in zip(tokens, qs, samplers)]


def chain(tokens: list, qs: list, sampled: bool, V: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A member's drafts (0-d ids) and q rows [V] -> ids [n], q [n, V] (None: top-1), as drafted alone."""
    if not tokens:
        return torch.empty(0, dtype=torch.long), torch.empty(0, V) if sampled else None
    return torch.stack(tokens), torch.stack(qs) if sampled else None


# --- trees ------------------------------------------------------------------------------------


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Draft logits [..., Vd] -> log-probabilities in at least float32."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def draft_tree_mask(prefix: int, ancestors: list[list[int]], tree_rows: int,
                    dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, F, prefix + tree_rows] for F new draft rows.

    ancestors[f] lists the tree-row indices (0-based after the prefix, own row included) that
    new row f may see; every prefix column is visible.
    """
    allow = torch.zeros(len(ancestors), prefix + tree_rows, dtype=torch.bool, device=device)
    allow[:, :prefix] = True
    for f, rows in enumerate(ancestors):
        allow[f, [prefix + r for r in rows]] = True
    mask = torch.zeros(allow.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[None, None]


def select_top_nodes(scores: torch.Tensor, parents: torch.Tensor, n: int) -> torch.Tensor:
    """Best n pool nodes by score, ancestor-closed, ascending -> indices [<= n].

    scores [M] cumulative log-probs, parents [M] pool index of the parent (-1: child of the
    root), parents before children. A child never scores above its parent, and a stable sort
    puts a parent before an equally scored child, so the top n are ancestor-closed.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    chosen = torch.sort(order).values
    picked = torch.zeros(scores.numel(), dtype=torch.bool)
    picked[chosen] = True
    p = parents[chosen]
    if bool((p >= 0).any()) and not bool(picked[p[p >= 0]].all()):
        raise TreeError("the selected draft nodes are not ancestor-closed")
    return chosen


class _DraftTreeRows:
    """Speculative EAGLE-3 rows appended to the chain proposer's draft cache for one tree."""

    def __init__(self, chain: Eagle3Proposer):
        self.chain = chain
        self.ancestors: list[list[int]] = []  # per tree row: tree rows it sees (self included)

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int,
            parent_rows: list[int | None]) -> torch.Tensor:
        """hidden [1, F, H], tokens [F] (target ids), parents' tree rows -> out [1, F, H].

        Appends F draft cache rows (tree-row ids continue from the rows drafted so far) and
        returns their pre-norm outputs, whose logits predict the nodes' children.
        """
        chain = self.chain
        first = len(self.ancestors)
        new = [(self.ancestors[p] if p is not None else []) + [first + f]
               for f, p in enumerate(parent_rows)]
        self.ancestors.extend(new)
        mask = draft_tree_mask(chain.rows, new, len(self.ancestors), chain.dtype, hidden.device)
        pos = torch.full((1, len(new)), chain.rows - 1 + depth, device=hidden.device)
        emb = chain.target.embed(tokens.reshape(1, -1).to(chain.target.device))  # [1, F, H]
        return chain.head.step(hidden, emb, pos, mask, chain.cache)

    def drop(self) -> None:
        """Crop the draft cache back to the rows from real target features."""
        trim_cache(self.chain.cache, self.chain.rows)
        self.ancestors = []


class _Eagle3TreeBase:
    """start / accept delegate to the chain proposer: the verified draft state is the same."""

    def __init__(self, head, target):
        check_tree_attention(head.layers[0].self_attn.config, "the EAGLE-3 head")
        self.chain = Eagle3Proposer(head, target)
        self.layers = self.chain.layers

    def start(self, prompt_ids, first_token, out) -> None:
        self.chain.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self.chain.accept(inputs, following, out, start)


class Eagle3StaticTreeProposer(_Eagle3TreeBase):
    """A fixed tree shape (Medusa choice list or `Tree`).

    A node holds the rank-th token of its parent's draft top-k (rank = last entry of its choice).
    """

    def __init__(self, head, target, tree: Tree | list):
        super().__init__(head, target)
        self.tree = tree if isinstance(tree, Tree) else tree_from_choices(tree)
        vd = head.config.draft_vocab_size
        if int(self.tree.ranks.max()) >= vd:
            raise TreeError(f"the tree uses rank {int(self.tree.ranks.max())} but the draft "
                            f"vocabulary has only {vd} tokens")
        self.max_nodes = self.tree.size

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        tree, chain = self.tree, self.chain
        head = chain.head
        n = tree.size
        draft_ids = torch.zeros(n, dtype=torch.long)
        outs = {0: chain.last_out}  # node -> pre-norm output predicting its children: [1, 1, H]
        row_of: dict[int, int | None] = {0: None}
        rows = _DraftTreeRows(chain)
        parents, ranks = tree.parents.tolist(), tree.ranks.tolist()
        has_kids = set(parents[1:])
        for depth in range(1, tree.max_depth + 1):
            level = (tree.depths == depth).nonzero().flatten().tolist()
            for p in sorted({parents[v] for v in level}):
                kids = [v for v in level if parents[v] == p]
                k = max(ranks[v] for v in kids) + 1
                top = head.logits(outs[p])[0, -1].topk(k).indices.cpu()  # [k] draft ids
                for v in kids:
                    draft_ids[v] = top[ranks[v]]
            expand = [v for v in level if v in has_kids]
            if not expand:
                break
            hidden = torch.cat([outs[parents[v]] for v in expand], dim=1)  # [1, F, H]
            tokens = head.to_target_ids(draft_ids[expand].to(hidden.device))
            out = rows.run(hidden, tokens, depth, [row_of[parents[v]] for v in expand])
            for f, v in enumerate(expand):
                outs[v], row_of[v] = out[:, f: f + 1], len(rows.ancestors) - len(expand) + f
        rows.drop()
        return tree, head.to_target_ids(draft_ids[1:].to(chain.last_out.device))


class Eagle3DynamicTreeProposer(_Eagle3TreeBase):
    """EAGLE-2 dynamic tree (docs/algorithms.md §4): expand the best `top_k` nodes per level
    for `depth` levels, then keep the `total_tokens - 1` nodes with the highest cumulative
    draft log-probability (the verified tree has total_tokens nodes with the root)."""

    def __init__(self, head, target, depth: int = 5, top_k: int = 8, total_tokens: int = 48):
        super().__init__(head, target)
        if depth < 0 or top_k < 1 or total_tokens < 1:
            raise TreeError(f"EAGLE-2 tree needs depth >= 0, top_k >= 1, total_tokens >= 1; got "
                            f"{depth}, {top_k}, {total_tokens}")
        self.depth, self.top_k = depth, min(top_k, head.config.draft_vocab_size)
        self.total_tokens = total_tokens
        self.max_nodes = total_tokens
        self.last_scores = torch.empty(0)  # node scores of the last proposed tree (for inspection)

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        chain, k = self.chain, self.top_k
        head = chain.head
        top = log_probs(head.logits(chain.last_out)[0, -1]).topk(k)  # depth-1 candidates
        ids, scores = [top.indices], [top.values]
        parents = [torch.full((k,), -1, dtype=torch.long, device=top.indices.device)]
        frontier = torch.arange(k, device=top.indices.device)  # pool indices to expand next
        hidden = chain.last_out.expand(1, k, -1)  # [1, k, H]: outputs of the frontier's parents
        frontier_rows: list[int | None] = [None] * k  # tree rows of the frontier's parents
        rows = _DraftTreeRows(chain)
        for level in range(1, self.depth + 1):
            pool_ids, pool_scores = torch.cat(ids), torch.cat(scores)
            tokens = head.to_target_ids(pool_ids[frontier])
            out = rows.run(hidden, tokens, level, frontier_rows)  # [1, F, H]
            new_rows = list(range(len(rows.ancestors) - frontier.numel(), len(rows.ancestors)))
            child = log_probs(head.logits(out)[0]).topk(k)  # [F, k]
            cand = (pool_scores[frontier][:, None] + child.values).reshape(-1)  # [F*k]
            base = pool_scores.numel()
            ids.append(child.indices.reshape(-1))
            scores.append(cand)
            parents.append(frontier.repeat_interleave(k))
            best = cand.topk(min(k, cand.numel())).indices  # next frontier, within this level
            frontier = base + best
            hidden = out[:, best // k]
            frontier_rows = [new_rows[int(b) // k] for b in best]
        rows.drop()
        pool_ids, pool_scores, pool_parents = torch.cat(ids), torch.cat(scores), torch.cat(parents)
        chosen = select_top_nodes(pool_scores.cpu(), pool_parents.cpu(), self.total_tokens - 1)
        self.last_scores = pool_scores[chosen.to(pool_scores.device)]  # [N-1] cumulative log-probs
        tokens = head.to_target_ids(pool_ids[chosen.to(pool_ids.device)])  # [N-1]
        return self._as_tree(chosen, pool_parents.cpu()), tokens

    @staticmethod
    def _as_tree(chosen: torch.Tensor, pool_parents: torch.Tensor) -> Tree:
        """Selected pool indices [M] (ascending) -> Tree of M + 1 nodes (node = position + 1)."""
        node_of = torch.zeros(pool_parents.numel() + 1, dtype=torch.long)  # pool idx + 1 -> node
        node_of[chosen + 1] = torch.arange(1, chosen.numel() + 1)
        parent_nodes = node_of[pool_parents[chosen] + 1]  # root (-1 + 1 = 0) -> node 0
        return tree_from_parents(torch.cat([torch.tensor([-1]), parent_nodes]))


# --- the kind's factory ----------------------------------------------------------------------


def make_proposer(spec, head, target, sampled: bool = False):
    """The EAGLE-3 proposer for a `TreeSpec` (P-EAGLE heads: one forward per chain, chains only)."""
    if head.config.parallel_drafting:
        if spec.kind != "chain":
            raise SettingsError("a P-EAGLE head drafts all depths in one forward and was not trained for "
                                f"tree steps; '{spec.kind}' trees are not supported: use --tree chain")
        chain = Eagle3Proposer(head, target)
        return SampledPEagleProposer(chain) if sampled else PEagleProposer(chain)
    if spec.kind == "chain" and sampled:
        return SampledEagle3Proposer(head, target)
    if spec.kind == "chain":
        return Eagle3Proposer(head, target)
    if spec.kind == "eagle2":
        return Eagle3DynamicTreeProposer(head, target, spec.depth, spec.top_k, spec.total_tokens)
    return Eagle3StaticTreeProposer(head, target, list(spec.choices))
