"""Training entry point; the only module that builds an Accelerator.

    specheads train RECIPE [key=value ...]
    accelerate launch -m specheads.train RECIPE [key=value ...]
    torchrun --nproc_per_node 2 -m specheads.train RECIPE [key=value ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.config import Recipe, load_recipe, to_dict


class TrainError(ValueError):
    """A recipe that cannot be trained as asked (e.g. a variant an export format cannot load)."""


# heads whose options an engine cannot reproduce: (format, option) -> reason
UNSUPPORTED_VARIANTS = {
    ("sglang", "norm_before_residual"): "SGLang 0.5.23 always uses the raw fc output as the residual",
}


def check_export_compat(recipe: Recipe) -> None:
    """Refuse to train a variant that a chosen export format would silently run differently."""
    for (fmt, option), reason in UNSUPPORTED_VARIANTS.items():
        if fmt in recipe.export.formats and getattr(recipe.head, option, False):
            raise TrainError(
                f"head.{option}: true cannot be exported to {fmt} ({reason}). Set head.{option}: "
                f"false, or drop '{fmt}' from export.formats."
            )


@dataclass
class BatchPlan:
    """Deterministic data order: global micro-batch g -> sample indices for one rank (resumable).

    Each epoch is a seeded permutation cut into windows of `bucket` global batches; inside a
    window samples are sorted by length so a batch pads little, and batch order is shuffled.
    """

    lengths: list[int]
    batch_size: int
    world: int
    rank: int
    seed: int
    bucket: int = 32

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.lengths) // self.global_batch)

    @functools.lru_cache(maxsize=2)
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=gen).tolist()
        n = self.batches_per_epoch * self.global_batch
        perm = perm[:n] if len(perm) >= self.global_batch else (perm * self.global_batch)[: self.global_batch]
        window = self.bucket * self.global_batch
        batches = []
        for w in range(0, len(perm), window):
            chunk = sorted(perm[w:w + window], key=lambda k: self.lengths[k])
            batches += [chunk[b:b + self.global_batch] for b in range(0, len(chunk), self.global_batch)]
        order = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[o] for o in order]

    def indices(self, g: int) -> list[int]:
        epoch, pos = divmod(g, self.batches_per_epoch)
        batch = self.epoch_batches(epoch)[pos]
        return batch[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    __hash__ = object.__hash__


def prepare_samples(recipe: Recipe, tokenizer, report=print):
    """Read and tokenise the recipe's training data (assistant-only loss masks, verified)."""
    from specheads.data.conversations import read_conversations
    from specheads.data.tokenize import TokenizeStats, tokenize_all

    if not recipe.data.train:
        raise TrainError("data.train is empty: list at least one dataset file or folder")
    convs = []
    for source in recipe.data.train:
        rows, stats = read_conversations(source, fmt=recipe.data.format,
                                         skip_malformed=recipe.data.skip_malformed)
        convs.extend(rows)
        skipped = f", skipped {stats.skipped} malformed (e.g. {stats.reasons[0]})" if stats.skipped else ""
        report(f"[specheads] {source}: {stats.kept} of {stats.read} rows ({stats.format}){skipped}")
    tstats = TokenizeStats()
    samples = tokenize_all(tokenizer, convs, recipe.data.max_length, end_of_turn=recipe.data.end_of_turn,
                           stats=tstats)
    report(f"[specheads] tokenised {tstats.kept} samples (max_length {recipe.data.max_length}): "
           f"{tstats.truncated} truncated, {tstats.dropped} dropped with no supervised token left")
    if not samples:
        raise TrainError("no training sample has a supervised token after tokenisation")
    return samples


def build_head(recipe: Recipe, target, samples):
    """Head sized from the target, with its draft vocabulary from supervised-token frequencies."""
    from specheads.heads import head_class
    from specheads.heads.vocab import build_vocab_map, count_tokens

    head = head_class(recipe.head.kind).for_target(recipe.head, target.config)
    if hasattr(head, "set_vocab_map"):
        d2t, t2d = build_vocab_map(count_tokens(samples, target.vocab_size), head.config.draft_vocab_size)
        head.set_vocab_map(d2t, t2d)
    return head


def lr_lambda(recipe: Recipe):
    """Linear warmup then cosine (or constant) decay, as a LambdaLR factor."""
    t = recipe.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def make_batch(samples, idx, pad_id, device):
    from specheads.data.tokenize import collate

    return {k: v.to(device) for k, v in collate([samples[i] for i in idx], pad_id).items()}


def head_inputs(target, head, batch) -> dict:
    """Frozen-target features for one batch: what the head's loss needs, nothing more."""
    return head.expand(target, head.collect(target, batch), batch)


def train(recipe: Recipe) -> Path:
    """Run (or resume) training; returns the path of the final checkpoint."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from specheads.export.checkpoint import Checkpoint, latest_checkpoint, load_strict, save_checkpoint
    from specheads.metrics import ttt_summary
    from specheads.provenance import provenance
    from specheads.target import Target, check_fingerprint

    check_export_compat(recipe)
    t = recipe.train
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=t.grad_accum)
    set_seed(t.seed)
    target = Target.load(recipe.target.path, dtype=recipe.target.dtype, device=str(accelerator.device),
                         attn_implementation=recipe.target.attn_implementation)
    samples = prepare_samples(recipe, target.tokenizer, report=accelerator.print)
    head = build_head(recipe, target, samples)
    out_dir = Path(t.output_dir)
    resume_from = latest_checkpoint(out_dir) if t.resume else None
    start = 0
    if resume_from is not None:
        ckpt = Checkpoint(resume_from)
        check_fingerprint(ckpt.provenance.get("target", {}), target, f"the run in {out_dir}")
        load_strict(head, ckpt.weights, str(resume_from))
        start = ckpt.trainer_state["step"]
    head.to(accelerator.device)
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=t.lr,
                              weight_decay=t.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(recipe))
    if resume_from is not None and (resume_from / "optimizer.pt").is_file():
        optim.load_state_dict(torch.load(resume_from / "optimizer.pt", weights_only=True))
        sched.load_state_dict(torch.load(resume_from / "scheduler.pt", weights_only=True))
    # the scheduler stays unprepared: accelerate would step it once per process
    model, optim = accelerator.prepare(head, optim)
    plan = BatchPlan([len(x.input_ids) for x in samples], t.batch_size, accelerator.num_processes, accelerator.process_index, t.seed)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    prov = provenance(target=target.fingerprint(), num_processes=accelerator.num_processes)
    log_path = out_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        accelerator.print(
            f"[specheads] training {recipe.head.kind} on {len(samples)} samples, "
            f"{accelerator.num_processes} process(es), steps {start}->{t.max_steps}"
            + (f", resumed from {resume_from}" if resume_from else "")
        )
    window = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.time(), "counts": None}
    step = start
    while step < t.max_steps:
        for micro in range(t.grad_accum):
            g = step * t.grad_accum + micro
            batch = make_batch(samples, plan.indices(g), pad_id, accelerator.device)
            with accelerator.accumulate(model):
                with torch.no_grad():
                    inputs = head_inputs(target, head, batch)
                out = model(**inputs)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and t.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                optim.step()
                if accelerator.sync_gradients:
                    sched.step()
                optim.zero_grad()
            window["loss"] += out.loss.item()
            window["n"] += 1
            window["tokens"] += int(batch["attention_mask"].sum())
            c = torch.stack([out.counts[k] for k in ("rows", "reached", "cond_rows")])
            window["counts"] = c if window["counts"] is None else window["counts"] + c
        step += 1
        if step % t.log_every == 0 or step == t.max_steps:
            counts = accelerator.reduce(window["counts"], reduction="sum").tolist()
            loss = accelerator.reduce(torch.tensor(window["loss"] / window["n"], device=accelerator.device), "mean").item()
            tokens = accelerator.reduce(torch.tensor(window["tokens"], device=accelerator.device), "sum").item()
            summary = ttt_summary(*counts)
            record = {"step": step, "loss": round(loss, 5), "lr": sched.get_last_lr()[0],
                      "tokens_per_s": round(tokens / max(1e-9, time.time() - window["t0"]), 1), **summary}
            if accelerator.is_main_process:
                accelerator.print(_format_log(record))
                with log_path.open("a") as fh:
                    fh.write(json.dumps(record) + "\n")
            window = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.time(), "counts": None}
        if step % t.save_every == 0 or step == t.max_steps:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                last = save_checkpoint(
                    out_dir, step, accelerator.unwrap_model(model), to_dict(recipe), prov,
                    {"num_samples": len(samples)}, optim.state_dict(), sched.state_dict(), t.keep_last)
            accelerator.wait_for_everyone()
    accelerator.end_training()
    return latest_checkpoint(out_dir)


def _format_log(r: dict) -> str:
    acc = " ".join(f"{a:.3f}" for a in r["acc_uncond"])
    cond = " ".join(f"{a:.3f}" for a in r["acc_cond"])
    return (f"step {r['step']:>5}  loss {r['loss']:.4f}  acc/step {acc} (cond {cond})  tau~{r['tau_est']:.3f}  "
            f"lr {r['lr']:.2e}  {r['tokens_per_s']:.0f} tok/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specheads train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    ckpt = train(recipe)
    print(f"[specheads] checkpoint: {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
