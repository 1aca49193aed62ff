"""speculators (vllm-project) as a library on a CPU: train an EAGLE-3, DFlash or DSpark drafter (the
job's `kind`) on the bench's samples.

    <speculators venv>/bin/python speculators_train.py JOB.json      (bench/anchors.py writes JOB)

Runs in the speculators venv only (no specheads import). Steps, each through speculators' own API:
`load_and_preprocess_dataset` (pre-tokenized rows pass through; token_freq.pt for the draft
vocabulary) and `save_to_disk`; the target's hidden states written as its offline `hs_<i>.safetensors`
files (vLLM, its capture engine, needs a GPU: capture.py computes them with transformers); then
`TrainConfig.resolve` + `speculators.train.cli.main`, first unchanged, and only if that fails on a CPU
again with the recorded adaptation. The final checkpoint folder is speculators' format (what vLLM
serves), loaded as is by specheads' verifier.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from capture import capture_all, load_target, run_job, with_adaptations


def prepare(job: dict, data: Path) -> list[list[int]]:
    """The samples as speculators' Arrow dataset at `data` (its order defines hs_<i>); the token ids."""
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    dataset, _ = load_and_preprocess_dataset(
        job["target"], [job["samples"]], seq_length=job["max_length"], build_dataset_num_proc=1,
        seed=job["seed"], token_freq_path=data / "token_freq.pt", skip_token_freq=False)
    dataset.save_to_disk(str(data))
    return [row.tolist() for row in dataset["input_ids"]]


def write_hidden_states(job: dict, data: Path, ids: list[list[int]]) -> dict:
    """hs_<i>.safetensors: token_ids [T] and hidden_states [T, n_aux + 1, H] (aux taps, then last)."""
    from safetensors.torch import save_file

    folder = data / "hidden_states"
    folder.mkdir(parents=True, exist_ok=True)

    def save(i, row, aux, last):
        states = torch.stack([*aux, last], dim=1).contiguous()  # [T, n_aux + 1, H]
        save_file({"token_ids": torch.tensor(row), "hidden_states": states}, str(folder / f"hs_{i}.safetensors"))

    return capture_all(load_target(job["target"]), ids, job["aux_layers"], save)


def epochs_for(job: dict, data: Path, total_seq_len: int, train_ratio: float) -> tuple[int, int]:
    """(epochs, batches in the first epoch) so that `steps` packed batches run: speculators' own
    packing sampler over the train split's lengths (its loop has no step-based stop across epochs)."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(str(data)).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * train_ratio)]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths,
                                                 num_replicas=1, rank=0, seed=job["seed"])
    per_epoch = len(sampler)
    return max(1, math.ceil(job["steps"] / per_epoch)), per_epoch


def train_argv(job: dict, data: Path, save: Path, total_seq_len: int, epochs: int, train_ratio: float) -> list[str]:
    """The `speculators train` flags of the shared budget (sdpa, eager loss): the kind's own head flags,
    then the optimizer, schedule and step budget every kind shares."""
    return ["--speculator-type", job.get("kind", "eagle3"), "--verifier-name-or-path", job["target"],
            "--data-path", str(data), "--save-path", str(save), "--log-dir", str(save / "logs"),
            *head_argv(job), "--draft-attn-impl", "sdpa",
            "--target-layer-ids", *map(str, job["aux_layers"]), "--draft-vocab-size", str(job["draft_vocab_size"]),
            "--total-seq-len", str(total_seq_len), "--train-data-ratio", str(train_ratio),
            "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise",
            "--loss-implementation", "eager", "--lr", str(job["lr"]),
            "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(job["warmup_steps"]),
            "--scheduler-total-steps", str(job["steps"]), "--epochs", str(epochs), "--max-steps", str(job["steps"]),
            "--log-freq", "10", "--seed", str(job["seed"]), "--no-resume-from-checkpoint"]


def head_argv(job: dict) -> list[str]:
    """EAGLE-3: one Llama layer, TTT steps and decay. DFlash / DSpark: the shared block and layout
    (anchor + G query slots, fill-in: no sample-from-anchor; or, for a DSpark recipe trained
    anchor-as-first, G slots with sample-from-anchor), layer count and anchor blocks per sample;
    DSpark's Markov and confidence heads as shared. Everything else stays speculators' default."""
    if job.get("kind", "eagle3") == "eagle3":
        return ["--num-layers", "1", "--draft-arch", "llama", "--ttt-steps", str(job["ttt_steps"]),
                "--ttt-step-loss-decay", str(job["step_decay"])]
    block = job["block"]
    from_anchor = bool(block.get("sample_from_anchor"))
    argv = ["--num-layers", str(block["num_layers"]), "--block-size", str(block["block_size"] - from_anchor),
            "--max-anchors", str(block["num_anchors"]),
            "--sample-from-anchor" if from_anchor else "--no-sample-from-anchor"]
    if job["kind"] == "dspark":
        argv += ["--markov-rank", str(block["markov_rank"]), "--markov-head-type", block["markov_head_type"],
                 "--enable-confidence-head" if block["enable_confidence_head"] else "--no-enable-confidence-head",
                 "--confidence-head-with-markov" if block["confidence_head_with_markov"]
                 else "--no-confidence-head-with-markov"]
    return argv


def run_training(argv: list[str]) -> None:
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(argv))


def _local_rank_is_cpu() -> None:
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"


def _no_synchronize() -> None:
    torch.accelerator.synchronize = lambda *args, **kwargs: None


# applied one at a time, each only after the run before it failed (capture.with_adaptations)
CPU_ADAPTATIONS = (
    ("speculators.train.trainer.get_local_rank -> 'cpu': its Trainer moves the draft and every batch to "
     "local rank 0, an accelerator device", "Cannot access accelerator device", _local_rank_is_cpu),
    ("torch.accelerator.synchronize -> no-op (no accelerator): its Trainer's step timer calls it",
     "Cannot access accelerator device", _no_synchronize),
)


def final_checkpoint(save: Path) -> Path:
    """The last epoch folder speculators saved (config.json + weights)."""
    epochs = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs or not (epochs[-1] / "config.json").is_file():
        raise FileNotFoundError(f"{save}: no epoch checkpoint with a config.json was saved")
    return epochs[-1]


def kept_defaults(kind: str, saved: dict) -> dict:
    """The settings the budget does not share, as speculators saved them (its own defaults)."""
    layer = saved.get("transformer_layer_config", {})
    common = {"sliding_window": layer.get("sliding_window"), "layer_types": layer.get("layer_types"),
              "saved_dtype": saved.get("dtype")}
    if kind == "eagle3":
        return {**{k: saved.get(k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
                **common, "loss": "kl_div (its default for eagle3)",
                "optimizer": "muon on 2D weights, adamw on the rest (its default)"}
    return {"draft layer": layer.get("model_type"), "mask_token_id": saved.get("mask_token_id"),
            "sliding_window_non_causal": saved.get("sliding_window_non_causal"), **common,
            "loss": "ce with D-PACE position weights (its default for dflash)" if kind == "dflash"
            else "kl_div with fixed exponential position weights (its default for dspark)",
            "optimizer": "muon on 2D weights, adamw on the rest (its default)"}


def main(job: dict, state: dict) -> dict:
    from importlib.metadata import version

    work = Path(job["work"])
    data = work / "data"
    state.update(stage="prepare-data", toolkit="speculators", version=version("speculators"))
    ids = prepare(job, data)
    state.update(stage="capture-hidden-states", samples=len(ids))
    captured = write_hidden_states(job, data, ids)
    train_ratio = job.get("train_ratio", 0.98)
    total_seq_len = job["tokens_per_step"]
    epochs, per_epoch = epochs_for(job, data, total_seq_len, train_ratio)
    state.update(stage="train", total_seq_len=total_seq_len, epochs=epochs, batches_per_epoch=per_epoch)
    timing = {}

    def attempt(n: int) -> Path:
        save = work / f"train-{n}"
        timing["argv"] = train_argv(job, data, save, total_seq_len, epochs, train_ratio)
        t0 = time.perf_counter()
        run_training(timing["argv"])
        timing["train_s"] = time.perf_counter() - t0
        return save

    ckpt = final_checkpoint(with_adaptations(attempt, CPU_ADAPTATIONS, state))
    defaults = kept_defaults(job.get("kind", "eagle3"), json.loads((ckpt / "config.json").read_text()))
    trained_tokens = sum(len(i) for i in ids[: int(len(ids) * train_ratio)])  # one epoch's worth
    return {**state, "stage": "done", "export": str(ckpt), "train_s": round(timing["train_s"], 2), **captured,
            "steps": job["steps"], "train_tokens_per_epoch": trained_tokens,
            "train_tokens_est": round(job["steps"] * trained_tokens / per_epoch), "argv": timing["argv"],
            "toolkit_defaults_kept": defaults}


if __name__ == "__main__":
    sys.exit(run_job(main))
