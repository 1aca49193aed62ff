"""What a training run reports: metrics.jsonl, accelerate trackers (wandb, tensorboard) and a
progress bar with tokens/s and ETA on the main process; per-window metrics reduced over ranks
(counts summed before any ratio)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from specheads.config import Recipe, to_dict
from specheads.metrics import ttt_summary


def peak_memory_gib(device) -> float:
    """Peak GPU memory allocated by this process, or peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class RunLog:
    """metrics.jsonl + accelerate trackers + a progress bar, all on the main process."""

    def __init__(self, accelerator, recipe: Recipe, out_dir: Path, start: int):
        self.acc, self.t, self.path = accelerator, recipe.train, out_dir / "metrics.jsonl"
        self.main = accelerator.is_main_process
        if self.t.report_to:
            accelerator.init_trackers(self.t.project, config=_flat(to_dict(recipe)),
                                      init_kwargs={"wandb": {"dir": str(out_dir)}})
        self.bar = None
        if self.main and self.t.progress and sys.stderr.isatty():  # a log file gets the lines, not \r bars
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.t.max_steps, initial=start, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def write(self, record: dict) -> None:
        if self.main:
            if self.bar is None:
                self.acc.print(_format_log(record))
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        if self.t.report_to:
            self.acc.log(_flat(record), step=record["step"])

    def tick(self, record: dict | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if record is not None:
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record.get('tau_est', 0):.2f}",
                                     tok_s=f"{record['tokens_per_s']:.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.acc.end_training()


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dicts / lists -> scalar keys ('acc_uncond/0'), which every tracker accepts."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            out.update(_flat({str(i): x for i, x in enumerate(v)}, key + "/"))
        elif v is None or isinstance(v, (int, float, str, bool)):
            out[key] = v
    return out


def _format_log(r: dict) -> str:
    if "loss" not in r:  # a validation between logging steps
        return f"step {r['step']:>5}  val tau {r['val_tau']:.3f}"
    acc = " ".join(f"{a:.3f}" for a in r["acc_uncond"])
    cond = " ".join(f"{a:.3f}" for a in r["acc_cond"])
    val = f"  val tau {r['val_tau']:.3f}" if r.get("val_tau") is not None else ""
    return (f"step {r['step']:>5}  loss {r['loss']:.4f}  acc/step {acc} (cond {cond})  tau~{r['tau_est']:.3f}{val}  "
            f"lr {r['lr']:.2e}  {r['tokens_per_s']:.0f} tok/s  peak {r['peak_mem_gib']:.2f} GiB")


def window_record(accelerator, window: dict, step: int, lr: float) -> dict:
    """Reduce one logging window over ranks: counts summed before ratios, loss averaged."""
    dev = accelerator.device
    counts = accelerator.reduce(window["counts"], reduction="sum").tolist()
    loss = accelerator.reduce(torch.tensor(window["loss"] / window["n"], device=dev), "mean").item()
    tokens = accelerator.reduce(torch.tensor(float(window["tokens"]), device=dev), "sum").item()
    return {"step": step, "loss": round(loss, 6), "lr": lr,
            "tokens_per_s": round(tokens / max(1e-9, time.time() - window["t0"]), 1),
            **ttt_summary(*counts), "peak_mem_gib": round(peak_memory_gib(dev), 3)}


def new_window() -> dict:
    return {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.time(), "counts": None}
