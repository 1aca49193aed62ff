"""Static trees from draft models and MTP heads: each node is the drafter's rank-r token after its
path, greedy tree decoding equals plain greedy decoding; dynamic trees are refused clearly."""

from __future__ import annotations

import json

import pytest
import torch
from random_models import make_target

from specheads.cli import main as cli
from specheads.export import export
from specheads.export.checkpoint import save_checkpoint
from specheads.heads.draft import DraftHead, DraftOptions
from specheads.heads.losses import shift
from specheads.heads.mtp import MtpHead, MtpOptions, causal_padding_mask
from specheads.provenance import provenance
from specheads.target import Target
from specheads.verify.draft_proposers import DraftModelTreeProposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.mtp_proposers import MtpProposer, MtpTreeProposer
from specheads.verify.registry import make_proposer
from specheads.verify.settings import SettingsError, TreeSpec

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


def draft_head(target, noise: float = 0.02, seed: int = 0) -> DraftHead:
    """A 2-layer draft copied from the target, then perturbed so it disagrees now and then."""
    torch.manual_seed(seed)
    head = DraftHead.for_target(DraftOptions(num_layers=2, ttt_steps=3), target.config)
    head.init_from_target(target)
    with torch.no_grad():
        for p in head.model.model.layers.parameters():
            p.add_(torch.randn_like(p) * noise)
    return head.eval()


def check_nodes_are_ranked_tokens(proposer, head, tree, nodes):
    """Every node's token has the rank its choice path names in a plain draft forward."""
    prefix, toks = proposer.chain.tokens, [proposer.chain.tokens[-1]] + nodes.tolist()
    for v in range(1, tree.size):
        path = [toks[a] for a in tree.path_to(v)[1:-1]]
        logits = head.model(input_ids=torch.tensor([prefix + path])).logits[0, -1]  # [V]
        ranked = logits.sort(descending=True).values
        torch.testing.assert_close(logits[toks[v]], ranked[int(tree.ranks[v])], atol=1e-4, rtol=0)


@torch.no_grad()
def test_nodes_are_top_k_of_the_draft_after_their_path(target):
    head = draft_head(target)
    proposer = DraftModelTreeProposer(head, target, TREE)
    prompt = torch.tensor([5, 9, 2, 7, 30])
    proposer.start(prompt, 11, None)
    tree, nodes = proposer.propose_tree()
    assert nodes.shape == (tree.size - 1,)
    check_nodes_are_ranked_tokens(proposer, head, tree, nodes)
    assert proposer.chain.cache.get_seq_length() == prompt.numel() + 1  # tree rows dropped
    proposer.accept(None, torch.tensor([nodes[0], 40]), None, 0)  # later steps reuse the cache
    tree, nodes = proposer.propose_tree()
    check_nodes_are_ranked_tokens(proposer, head, tree, nodes)


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_greedy_tree_output_equals_plain_greedy(target, noise):
    head = draft_head(target, noise)
    accepted = 0
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, target.vocab_size, (6,), generator=gen).tolist()
        plain = greedy_decode(target, prompt, 24).tokens
        proposer = make_proposer(TreeSpec("static", choices=tuple(map(tuple, TREE))), head, target)
        res = decode(target, proposer, prompt, 24)
        assert res.tokens == plain
        sampled = decode(target, proposer, prompt, 24, temperature=0.0, rule="exact")
        assert sampled.tokens == plain and not sampled.lossy
        accepted += sum(res.stats.accepted_per_pos)
    assert accepted > 0  # the tree is really used, not just the root


def test_dynamic_trees_are_refused(target):
    with pytest.raises(SettingsError, match="draft model cannot grow 'eagle2' trees"):
        make_proposer(TreeSpec("eagle2"), draft_head(target), target)
    with pytest.raises(SettingsError, match="MTP head cannot grow 'eagle2' trees"):
        make_proposer(TreeSpec("eagle2"), mtp_head(make_target()), target)


# --- MTP -----------------------------------------------------------------------------------------


def mtp_head(target, seed: int = 1) -> MtpHead:
    """Two MTP modules started from the target, the embedding half perturbed so it matters."""
    torch.manual_seed(seed)
    head = MtpHead.for_target(MtpOptions(num_layers=2, ttt_steps=3), target.config).to(torch.float64)
    head.init_from_target(target)
    with torch.no_grad():
        for m in head.layers:
            m.eh_proj.weight.add_(torch.randn_like(m.eh_proj.weight) * 0.3)
    return head.eval()


def teacher_forced_logits(head, target, ext: list[int], row: int, j: int) -> torch.Tensor:
    """Training's computation on the sequence `ext`: step j's logits [V] at `row`."""
    seq = torch.tensor([ext])
    hidden, embeds = target.forward(seq).final, target.embed(seq)  # [1, T, H]
    mask = causal_padding_mask(torch.ones(1, seq.shape[1], dtype=torch.bool), hidden.dtype)
    for step in range(j + 1):
        pos = torch.arange(seq.shape[1])[None] + step
        hidden = head.step(step, hidden, head.embed_rows(shift(embeds, step + 1), pos), pos, mask)
    return (hidden @ target.lm_head.weight.T)[0, row]


@torch.no_grad()
def test_mtp_nodes_are_top_k_of_teacher_forced_rows():
    """Every MTP tree node's child logits equal training's rows on the sequence prefix + its path
    and its children hold the ranked tokens, at every prefix length (short prompts included,
    where early steps have no real rows)."""
    target = make_target()
    head = mtp_head(target)
    seq = [5, 9, 2] + greedy_decode(target, [5, 9, 2], 12).tokens
    for P in (1, 2, 4, 8):
        proposer = MtpTreeProposer(head, target, TREE)
        proposer.start(torch.tensor(seq[:P]), seq[P], target.forward(torch.tensor([seq[:P]])))
        tree, nodes = proposer.propose_tree()
        toks = [seq[P]] + nodes.tolist()
        assert sorted(proposer.node_logits) == [0, 1, 2, 4, 5, 7]  # the nodes with children
        for v, got in proposer.node_logits.items():
            path = [toks[a] for a in tree.path_to(v)[1:]]
            want = teacher_forced_logits(head, target, seq[: P + 1] + path, P - 1, len(path))
            torch.testing.assert_close(got, want)
        for v in range(1, tree.size):
            ranked = proposer.node_logits[int(tree.parents[v])].sort(descending=True).indices
            assert toks[v] == int(ranked[int(tree.ranks[v])])
        chain = MtpProposer(head, target)  # and the rank-0 path is the chain's drafts
        chain.start(torch.tensor(seq[:P]), seq[P], target.forward(torch.tensor([seq[:P]])))
        assert chain.propose(4).tolist() == [toks[v] for v in (1, 4, 7, 9)]


@pytest.mark.parametrize("prompt", [[3, 1, 4, 1, 5], [9], [7, 7, 7, 2, 8, 1, 0, 4]])
def test_mtp_greedy_tree_output_equals_plain_greedy(prompt):
    target = make_target()
    head = mtp_head(target)
    spec = TreeSpec("static", choices=tuple(map(tuple, TREE)))
    plain = greedy_decode(target, prompt, 24).tokens
    res = decode(target, make_proposer(spec, head, target), prompt, 24)
    assert res.tokens == plain and res.stats.drafts > 0
    sampled = decode(target, make_proposer(spec, head, target), prompt, 24, temperature=0.0, rule="exact")
    assert sampled.tokens == plain


def test_generate_cli_with_a_tree_file(target, tiny_target_dir, tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "run", 1, draft_head(target, 0.02),
                           recipe={"target": {"path": str(tiny_target_dir)}},
                           provenance=provenance(target=target.fingerprint()), trainer_state={})
    out = export(ckpt, "vllm", tmp_path / "export")
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps(TREE))
    rc = cli(["generate", "--target", str(tiny_target_dir), "--draft", str(out), "--prompt",
              "def add(a, b):", "--tree", str(tree), "--max-new-tokens", "16", "--device", "cpu"])
    assert rc == 0
    assert "identical to plain greedy: True" in capsys.readouterr().err
