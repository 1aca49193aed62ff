"""GPU benchmark: online EAGLE-3 training throughput and memory on a Llama-8B-shaped random target,
against the target's own forward-only throughput on the same tokens (the floor), plus the
verifier's speed over plain decoding at batch 1 and, by concurrency, B ragged sequences per
forward (plain and oracle-drafted). Writes OUT/gpu_train.json.

    python bench/gpu_train.py --out runs/bench            # on one GPU (bf16), ~5 minutes on an H200
    python bench/gpu_train.py --out runs/bench --preset smollm2  # SmolLM2-135M's shape
    python bench/gpu_train.py --out /tmp/b --preset tiny  # a seconds-long CPU run (fp32) so it cannot rot

Needs only PyTorch, transformers and accelerate (`pip install torch transformers accelerate` on a
GPU machine, CUDA build of torch); it imports specheads from this checkout, so run it from a
clone, unchanged. Results: OUT/gpu_train.json (also printed).
Weights are random, so acceptance is meaningless here; the verifier is measured with an oracle
proposer (always right: the ceiling, tau = k + 1) and with the random head (always wrong: the
overhead floor, tau = 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from specheads.atomic import write_json  # noqa: E402
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options  # noqa: E402
from specheads.target import Target  # noqa: E402
from specheads.verify.eagle3_proposers import Eagle3Proposer  # noqa: E402
from specheads.verify.loop import decode, decode_batch, greedy_decode, request  # noqa: E402
from specheads.verify.ngram_proposers import NO_DRAFT  # noqa: E402

PRESETS = {  # target shape, training batch, timing loop sizes
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, batch=4, seq=2048, steps=20, warmup=3,
                    draft_vocab=32000, ttt=7, decode_tokens=128),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, batch=8, seq=2048, steps=20, warmup=3,
                    draft_vocab=32000, ttt=7, decode_tokens=128),  # SmolLM2-135M's shape
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, batch=2, seq=64, steps=3, warmup=1,
                 draft_vocab=256, ttt=3, decode_tokens=16),
}


class OracleProposer:
    """Proposes the target's own greedy continuation (precomputed): the verifier's ceiling."""

    layers: list[int] = []

    def __init__(self, reference: list[int]):
        self.reference, self.emitted = reference, 0

    def start(self, prompt_ids, first_token, out=None):
        self.emitted = 1

    def propose(self, k: int) -> torch.Tensor:
        return torch.tensor(self.reference[self.emitted:self.emitted + k], dtype=torch.long)

    def accept(self, inputs, following, out=None, start=0):
        self.emitted += following.numel()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int, warmup: int) -> float:
    """Seconds per call of fn(), after warm-up, synchronised around the timed loop."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def build(preset: dict, device: torch.device, dtype: torch.dtype):
    cfg = LlamaConfig(**{k: preset[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "vocab_size")},
                      max_position_embeddings=max(4096, preset["seq"]))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    target = Target(model, None, Path("random-" + str(cfg.num_hidden_layers) + "-layers"))
    with torch.device(device):
        head = Eagle3Head.for_target(Eagle3Options(ttt_steps=preset["ttt"], draft_vocab_size=preset["draft_vocab"]), cfg)
    return target, head.to(device)  # head in fp32 (master weights); autocast runs it in `dtype`


def train_step(target, head, opt, ids, mask, dtype):
    with torch.no_grad():
        out = target.forward(ids, layers=head.required_layers(), attention_mask=mask)
        aux = torch.cat([out.hidden[i] for i in head.required_layers()], dim=-1)  # [B, T, 3H]
        embeds = target.embed(ids)
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        res = head(aux=aux, embeds=embeds, target_logits=out.logits, loss_mask=mask, attention_mask=mask)
    res.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_training(target, head, preset, device, dtype) -> dict:
    B, T = preset["batch"], preset["seq"]
    ids = torch.randint(0, preset["vocab_size"], (B, T), device=device)
    mask = torch.ones_like(ids)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    with torch.no_grad():
        fwd_s = timed(lambda: target.forward(ids, attention_mask=mask), device, preset["steps"], preset["warmup"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = timed(lambda: train_step(target, head, opt, ids, mask, dtype), device, preset["steps"], preset["warmup"])
    tokens = B * T
    return {
        "batch": B, "seq_len": T, "ttt_steps": preset["ttt"], "draft_vocab_size": preset["draft_vocab"],
        "target_forward_tokens_per_s": tokens / fwd_s, "train_tokens_per_s": tokens / step_s,
        "train_vs_forward_floor": fwd_s / step_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "head_parameters": sum(p.numel() for p in head.parameters()),
    }


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Token-for-token equality with plain greedy decoding, and how far it holds. In fp32 it must
    hold; in bf16 a (k + 1)-token verification and a 1-token step run other kernels, so a near-tie
    of random weights' logits can flip (engines share this), and the report shows where."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return {"greedy_equal": tokens == reference, "equal_prefix": same}


def bench_verifier(target, head, preset, device) -> dict:
    prompt = torch.randint(0, preset["vocab_size"], (64,), device=device)
    n = preset["decode_tokens"]
    greedy_decode(target, prompt, 4)  # warm-up
    results, plain_s = {}, float("inf")
    for _ in range(2):  # the faster of two: a first long decode can still pay one-off costs
        sync(device)
        t0 = time.perf_counter()
        plain = greedy_decode(target, prompt, n)
        sync(device)
        plain_s = min(plain_s, time.perf_counter() - t0)
    results["plain_tokens_per_s"] = len(plain.tokens) / plain_s
    for name, make in (("oracle", lambda: OracleProposer(plain.tokens)),
                       ("random_head", lambda: Eagle3Proposer(head.to(target.dtype), target))):
        for k in (1, 3, 5, 7):
            sync(device)
            t0 = time.perf_counter()
            res = decode(target, make(), prompt, n, k)
            sync(device)
            secs = time.perf_counter() - t0
            results[f"{name}_k{k}"] = {"tau": res.stats.summary()["tau"],
                                       "speedup": plain_s / secs, "tokens_per_s": len(res.tokens) / secs,
                                       **agreement(res.tokens, plain.tokens)}
    return results


def bench_concurrency(target, preset, device, batch_sizes: list[int], k: int = 3) -> dict:
    """Plain and oracle-drafted (k) greedy decoding of B ragged prompts at once, B per target
    forward (`decode_batch`): tokens/s per batch size, each row equal to its plain decode."""
    n, results = preset["decode_tokens"], {}
    gen = torch.Generator().manual_seed(1)
    for B in batch_sizes:
        lengths = torch.randint(48, 81, (B,), generator=gen).tolist()
        prompts = [torch.randint(0, preset["vocab_size"], (p,), generator=gen) for p in lengths]
        decode_batch(target, [request(target, NO_DRAFT, prompts[0], 4)])  # warm-up
        sync(device)
        t0 = time.perf_counter()
        plain = decode_batch(target, [request(target, NO_DRAFT, p, n) for p in prompts])
        sync(device)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        spec = decode_batch(target, [request(target, OracleProposer(r.tokens), p, n, k)
                                     for p, r in zip(prompts, plain)])
        sync(device)
        spec_s = time.perf_counter() - t0
        tokens = sum(len(r.tokens) for r in plain)
        results[f"batch_{B}"] = {
            "plain_tokens_per_s": tokens / plain_s, f"oracle_k{k}_tokens_per_s": tokens / spec_s,
            f"oracle_k{k}_speedup": plain_s / spec_s,
            "greedy_equal_rows": sum(s.tokens == r.tokens for s, r in zip(spec, plain)), "rows": B,
            "equal_prefix_mean": sum(agreement(s.tokens, r.tokens)["equal_prefix"] for s, r in zip(spec, plain)) / B,
        }
    base = results[f"batch_{batch_sizes[0]}"]["plain_tokens_per_s"]
    for row in results.values():
        row["plain_vs_batch_1"] = row["plain_tokens_per_s"] / base
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_train.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: llama8b on a GPU, tiny on a CPU")
    p.add_argument("--batch-sizes", default="1,8,32", help="concurrency rows (default 1,8,32)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset_name = a.preset or ("llama8b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = PRESETS[preset_name]
    t0 = time.time()
    target, head = build(preset, device, dtype)
    report = {"preset": preset_name,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__}
    sections = {"training": lambda: bench_training(target, head, preset, device, dtype),
                "verifier": lambda: bench_verifier(target, head, preset, device),
                "concurrency": lambda: bench_concurrency(target, preset, device,
                                                         [int(b) for b in a.batch_sizes.split(",")])}
    for name, run in sections.items():  # written after each: a later failure keeps what ran
        report[name] = run()
        report["wall_s"] = time.time() - t0
        write_json(Path(a.out) / "gpu_train.json", report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
