"""Training entry point; the only module that builds an Accelerator.

    specheads train RECIPE [key=value ...]
    accelerate launch --config_file recipes/accelerate/ddp.yaml -m specheads.train RECIPE [key=value ...]
    torchrun --nproc_per_node 2 -m specheads.train RECIPE [key=value ...]

The strategy (DDP, FSDP2, DeepSpeed ZeRO-2/3) comes from the accelerate launch config; only the
drafter is prepared (wrapped, sharded), the frozen target is loaded whole on every process.
Resume is exact: data order is a function of the step, and the head, optimizer (per rank),
scheduler and RNG states come back from the latest checkpoint. A resume keeps the recorded
recipe: a change that affects the weights (lr, data, head.*, batch size, a cosine run's max_steps,
...) is refused by name unless --new-phase starts a new phase from the checkpoint's weights
(specheads/resume_plan.py lists what may change freely). One run at a time writes an output_dir:
a second is refused, naming the live process (specheads/run_lock.py). Several machines run the same
command (with --num_machines / --machine_rank / --main_process_ip) into one shared output_dir; a
lost machine stops the others (at the latest after train.dist_timeout) with a message saying how
to resume.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch

from specheads.atomic import OutputRefused, write_text
from specheads.cli_parsers import train_parser
from specheads.config import Recipe, TrainConfig, check_recipe_inputs, load_recipe, to_dict
from specheads.data.features import feature_source
from specheads.data.samples import prepare_samples, split_samples
from specheads.data.tokenize import collate
from specheads.data.vocab_stats import load_vocab_stats
from specheads.engine_facts import PEAGLE_SPECULATORS_DROPS, REFUSED_OPTIONS
from specheads.errors import disk_guard, first_line, peer_failure
from specheads.eval.offline import offline_acceptance
from specheads.export.checkpoint import (
    Checkpoint,
    best_checkpoint,
    latest_checkpoint,
    load_strict,
    mark_run,
    resume_hint,
    run_dir_refusal,
    save_checkpoint,
    save_torch,
)
from specheads.heads import head_class
from specheads.heads.losses import COUNT_KEYS
from specheads.heads.vocab import build_vocab_map, count_tokens
from specheads.optim import build_optimizer
from specheads.protocols import InitFromTarget, ReducedVocab
from specheads.provenance import provenance
from specheads.resume_plan import NEW_PHASE_FLAG, ResumePlan, plan_resume
from specheads.run_lock import RunBusy, acquire, release
from specheads.runlog import RunLog, new_window, window_record
from specheads.schedule import BatchPlan, lr_factor
from specheads.target import Target, check_fingerprint


class TrainError(ValueError):
    """A recipe that cannot be trained as asked (e.g. a variant an export format cannot load)."""


def check_export_compat(recipe: Recipe) -> None:
    """Refuse to train a variant that a chosen export format would silently run differently."""
    refused = dict(REFUSED_OPTIONS)
    if getattr(recipe.head, "parallel_drafting", False):  # P-EAGLE: the speculators reader drops some flags
        refused.update({("vllm", o): why + "; --format vllm-native carries it" for o, why in PEAGLE_SPECULATORS_DROPS.items()})
    for (fmt, option), reason in refused.items():
        if fmt in recipe.export.formats and getattr(recipe.head, option, False):
            raise TrainError(
                f"head.{option}: true cannot be exported to {fmt} ({reason}). Set head.{option}: "
                f"false, or drop '{fmt}' from export.formats."
            )


def build_head(recipe: Recipe, target, samples):
    """Head sized from the target, with its draft vocabulary from supervised-token frequencies."""
    head = head_class(recipe.head.kind).for_target(recipe.head, target.config)
    if isinstance(head, InitFromTarget):  # e.g. Medusa output layers start as the target's head
        head.init_from_target(target)
    if isinstance(head, ReducedVocab):
        if recipe.data.vocab_stats:
            counts = load_vocab_stats(recipe.data.vocab_stats, target)
        else:
            counts = count_tokens(samples, target.vocab_size)
        d2t, t2d = build_vocab_map(counts, head.config.draft_vocab_size)
        head.set_vocab_map(d2t, t2d)
    return head


def make_batch(samples, idx, pad_id, device, supervise: str = "assistant"):
    """The collated batch on `device`; supervise "all" (recipe data.supervise) puts every real token
    under the loss, not only the assistant turns."""
    batch = {k: v.to(device) for k, v in collate([samples[i] for i in idx], pad_id).items()}
    if supervise == "all":
        batch["loss_mask"] = batch["attention_mask"].clone()
    return batch


def head_inputs(target, head, batch, features=None) -> dict:
    """Frozen-target features for one batch: what the head's loss needs, nothing more.

    `features` is `specheads.data.features.feature_source(recipe.data.features, target, head)`
    (offline capture or online collect); None = online.
    """
    feats = features(batch) if features is not None else head.collect(target, batch)
    return head.expand(target, feats, batch)


# --- the accelerator and the strategy it was launched with -----------------------------------
def collective_timeout(cuda: bool, seconds: int):
    """InitProcessGroupKwargs with the recipe's timeout, also made torch's default for every group:
    accelerate passes a timeout only when it differs from its own default (600 s), and DeepSpeed
    creates groups without one; both then get torch's defaults (gloo: 30 min)."""
    import torch.distributed.distributed_c10d as c10d
    from accelerate.utils import InitProcessGroupKwargs

    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout  # read when a group is created
    return InitProcessGroupKwargs(backend="nccl" if cuda else "gloo", timeout=timeout)


def build_accelerator(t: TrainConfig, out_dir: Path):
    """Accelerator from the launch config (DDP / FSDP / DeepSpeed) and the recipe's precision;
    collectives time out after train.dist_timeout seconds."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched:  # a second train() in one process (tests, the demo) may change the precision
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    # accelerate honours a DeepSpeed launch config only when not forced onto the CPU
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    # launched: the recipe's collective timeout; on CPU gloo (DeepSpeed otherwise counts one process
    # and fails its batch-size check)
    handlers = [collective_timeout(cuda, t.dist_timeout)] if launched else []
    acc = Accelerator(cpu=not cuda and not deepspeed, gradient_accumulation_steps=t.grad_accum,
                      mixed_precision=t.mixed_precision, log_with=t.report_to or None,
                      project_dir=str(out_dir), kwargs_handlers=handlers)
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is not None:  # DeepSpeed clips inside its engine; accelerate's clip_grad_norm_ is a no-op
        ds = plugin.deepspeed_config
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = t.max_grad_norm
        ds["train_micro_batch_size_per_gpu"] = t.batch_size
        ds["gradient_accumulation_steps"] = t.grad_accum
        ds["train_batch_size"] = t.batch_size * t.grad_accum * acc.num_processes
    return acc


def cpu_fsdp(accelerator) -> bool:
    """An FSDP launch without CUDA: accelerate runs it as plain multi-CPU, so we shard ourselves."""
    return (os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
            and accelerator.device.type == "cpu" and accelerator.num_processes > 1)


def strategy(accelerator) -> str:
    if cpu_fsdp(accelerator):
        return "fsdp2-cpu"
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        return f"deepspeed-zero{plugin.zero_stage}"
    if accelerator.num_processes == 1:
        return "single"
    return str(accelerator.distributed_type).split(".")[-1].lower()


def wrap(accelerator, head, t: TrainConfig):
    """(model, optimizer, the torch optimizer inside) for the launch's strategy; only the drafter
    is ever wrapped. The LR scheduler drives the inner torch optimizer's param groups."""
    if t.optimizer == "muon" and strategy(accelerator).startswith(("fsdp", "deepspeed")):
        raise TrainError(f"train.optimizer: muon needs each weight matrix whole on every process (Newton-Schulz "
                         f"over the full matrix), which a {strategy(accelerator)} launch shards; launch with DDP "
                         "(recipes/accelerate/ddp.yaml) or one process, or use train.optimizer: adamw")
    if cpu_fsdp(accelerator):
        from torch.distributed.fsdp import fully_shard

        fully_shard(head)  # before the optimizer: parameters become sharded DTensors
    base = build_optimizer(head, t.optimizer, t.lr, t.weight_decay)
    if cpu_fsdp(accelerator):
        return head, accelerator.prepare(base), base
    return *accelerator.prepare(head, base), base


def shard_target(target, device) -> None:
    """FSDP2 over the frozen target's decoder layers: each process keeps 1/N of every layer and
    gathers it in forward; embeddings, final norm and lm_head (called directly) stay whole."""
    from torch.distributed.fsdp import fully_shard

    for layer in target.decoder_layers:
        fully_shard(layer)
    target.model.to(device)


def load_target(accelerator, recipe: Recipe):
    """The frozen target, whole on every process (a ZeRO-3 launch would partition it on load)."""
    sharded = recipe.train.shard_target and accelerator.num_processes > 1

    def load():
        device = "cpu" if sharded else str(accelerator.device)  # sharded: load on the host, then split
        target = Target.load(recipe.target.path, dtype=recipe.target.dtype, device=device,
                             attn_implementation=recipe.target.attn_implementation)
        if sharded:
            shard_target(target, accelerator.device)
            local = sum(getattr(q, "to_local", lambda q=q: q)().numel() for q in target.model.parameters())
            total = sum(q.numel() for q in target.model.parameters())
            accelerator.print(f"[specheads] target sharded over {accelerator.num_processes} processes: "
                              f"{local:,} of {total:,} parameters on each")
        return target

    hf_ds = getattr(getattr(accelerator.state, "deepspeed_plugin", None), "dschf", None)
    if hf_ds is None:
        return load()
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # transformers would load the target through zero.Init
    try:
        return load()
    finally:
        set_hf_deepspeed_config(hf_ds)


def full_state(accelerator, model) -> dict:
    """Collective: the drafter's full state dict on the main process (may be empty elsewhere)."""
    if cpu_fsdp(accelerator):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return accelerator.get_state_dict(model)


# --- checkpoints: save on every rank, resume ---------------------------------------------------
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def state_digest(state: dict) -> str:
    """sha256 over names and bytes of a state dict: equal digests = identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def claim_output_dir(accelerator, out_dir: Path):
    """Rank 0 decides whether train.output_dir may be written (absent, empty, or a run of ours no
    other live process writes: it takes the run's lock, returned); every rank raises the same
    refusal, before the target loads."""
    from accelerate.utils import broadcast_object_list

    lock, verdict = None, [None]
    if accelerator.is_main_process:
        verdict = [run_dir_refusal(out_dir)]
        if verdict[0] is None:
            try:
                lock = acquire(out_dir)
            except RunBusy as err:
                verdict = [str(err)]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict)
    if verdict[0] is not None:
        raise OutputRefused(verdict[0])
    return lock


@contextmanager
def run_folder(accelerator, out_dir: Path):
    """train.output_dir claimed for this run (see claim_output_dir) while the block runs."""
    lock = claim_output_dir(accelerator, out_dir)
    try:
        yield
    finally:
        release(lock)


def resume_plan(recipe: Recipe, new_phase: bool, report=print) -> ResumePlan:
    """Where this run starts: from scratch, or its latest checkpoint when the recipe continues the
    recorded one (resume_plan.plan_resume refuses anything else); `new_phase` (--new-phase)."""
    out_dir = Path(recipe.train.output_dir)
    ckpt = latest_checkpoint(out_dir) if recipe.train.resume else None
    if ckpt is None:
        if new_phase:
            report(f"[specheads] {NEW_PHASE_FLAG}: no checkpoint in {out_dir} to start a phase from; training from step 0")
        return ResumePlan()
    recorded = Checkpoint(ckpt, remedy=resume_hint(ckpt))  # checksums first: a corrupt recipe.json is named as such
    return plan_resume(ckpt, recorded.recipe, recorded.trainer_state, to_dict(recipe), new_phase)


def save(accelerator, model, optim, sched, out_dir: Path, step: int, recipe: Recipe, prov: dict,
         trainer_state: dict):
    """Checkpoint on all ranks: gathered full head weights, per-rank optimizer and RNG shards."""
    from accelerate.utils import broadcast_object_list, gather_object

    full = full_state(accelerator, model)
    digests = gather_object([state_digest(full) if full else None])  # one per rank
    rank = accelerator.process_index
    shard = {"optimizer": optim.state_dict(), "rng": rng_state()}

    def write_shards(tmp: Path) -> None:
        save_torch(shard, Path(tmp) / f"rank{rank:03d}.pt")
        accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        def before_commit(tmp: Path) -> None:
            broadcast_object_list([str(tmp)])  # tells the other ranks where to write
            write_shards(tmp)

        save_checkpoint(out_dir, step, accelerator.unwrap_model(model), to_dict(recipe), prov,
                        {**trainer_state, "weights_sha256_per_rank": digests}, None, sched.state_dict(),
                        recipe.train.keep_last, state=full, keep_best=recipe.train.keep_best,
                        before_commit=before_commit)
    else:
        where = [None]
        broadcast_object_list(where)
        write_shards(Path(where[0]))
    accelerator.wait_for_everyone()


def restore(accelerator, optim, sched, ckpt_dir: Path, saved_world: int) -> None:
    """Per-rank optimizer + RNG state and the scheduler from a checkpoint (same world size)."""
    import torch.distributed.tensor  # noqa: F401  (lets weights_only loading rebuild FSDP2 DTensors)

    shard_path = ckpt_dir / f"rank{accelerator.process_index:03d}.pt"
    deepspeed = strategy(accelerator).startswith("deepspeed")
    if saved_world != accelerator.num_processes or not shard_path.is_file():
        accelerator.print(f"[specheads] {ckpt_dir}: no optimizer state for {accelerator.num_processes} "
                          f"process(es) (written by {saved_world}); weights and schedule restored, "
                          "optimizer moments restart")
    else:
        # ZeRO's optimizer state holds DeepSpeed's own classes: full unpickling, of a file this
        # trainer wrote into the run's own folder; every other strategy loads tensors only
        shard = torch.load(shard_path, weights_only=not deepspeed)
        state = shard["optimizer"]
        if deepspeed:  # ZeRO reads the list entry of its own rank
            state = [state if r == accelerator.process_index else None for r in range(saved_world)]
        try:
            optim.load_state_dict(state)
        except ValueError as err:  # another head's or version's optimizer groups
            raise ValueError(f"{shard_path}: {err}") from None
        set_rng_state(shard["rng"])
    if (ckpt_dir / "scheduler.pt").is_file():
        sched.load_state_dict(torch.load(ckpt_dir / "scheduler.pt", weights_only=True))


def truncate_metrics(log_path: Path, step: int) -> None:
    """Drop records a killed run logged after its last checkpoint, so the log reads as one run."""
    if not log_path.is_file():
        return
    keep = []
    for line in log_path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by the kill
    write_text(log_path, "".join(ln + "\n" for ln in keep))


# --- validation -----------------------------------------------------------------------
def validate(accelerator, model, evaluator, target, val_samples, batch_size: int) -> float | None:
    """Offline tau on the held-out split, from full weights: the teacher-forced rows replayed in
    decode order (what the verifier measures on those answers) where the head drafts at every
    position, else the teacher-forced tau. The main process's number counts. With a sharded target
    every process runs the same forwards (they gather layers together); the others may hold stale
    head weights, their result is discarded."""
    full = full_state(accelerator, model)
    tau = None
    if evaluator is not None:
        if full:
            evaluator.load_state_dict(full)
        acc = offline_acceptance(target, evaluator, val_samples, batch_size)
        tau = acc["decode_order"]["tau"] if "decode_order" in acc else acc["tau_est"]
    accelerator.wait_for_everyone()
    return tau if accelerator.is_main_process else None


def shared(accelerator, value):
    """The main process's `value` on every process (a decision every rank must take alike)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box)
    return box[0]


def best_val_tau(out_dir: Path) -> float | None:
    """The validation tau of the run's best checkpoint so far (None: none validated yet)."""
    best = best_checkpoint(out_dir)
    return None if best is None else Checkpoint(best).trainer_state.get("val_tau")


# --- a process of the run lost: one clear paragraph --------------------------------------------
class RunInterrupted(TrainError):
    """Another process (or machine) of a distributed run stopped or went silent."""


def machine_of_launch() -> tuple[int, int]:
    """(this machine's rank, number of machines) from the launcher (torchrun, deepspeed); (0, 1) if unknown."""
    for rank, size in (("GROUP_RANK", "GROUP_WORLD_SIZE"), ("CROSS_RANK", "CROSS_SIZE")):
        if os.environ.get(rank, "").isdigit() and os.environ.get(size, "").isdigit():
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def interrupted_message(kind: str, err: BaseException, accelerator, t: TrainConfig) -> str:
    """What a surviving process says when another one was lost (`kind` 'lost') or silent ('timeout')."""
    rank, world = accelerator.process_index, accelerator.num_processes
    node, nodes = machine_of_launch()
    other = "another process"
    if world == 2:  # the only other one, on the other machine when there are two
        other = f"process {1 - rank}" + (f" (machine {1 - node})" if nodes == 2 else "")
    detail = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first_line(err, 400)).split(". ")[0]
    what = (f"lost {other} of the run ({detail}): it stopped (killed, crashed, out of memory: its own log "
            "says which) or its machine or the network went down" if kind == "lost" else
            f"waited train.dist_timeout={t.dist_timeout} s for {other} of the run ({detail}): it hangs or "
            "stopped, or its machine or the network went down (if a step, a checkpoint or loading the target "
            "legitimately takes longer, raise train.dist_timeout)")
    ckpt = latest_checkpoint(t.output_dir)
    resume = (f"it resumes from {ckpt}" if ckpt is not None
              else f"there is no checkpoint in {t.output_dir} yet, so it starts again from step 0")
    if not t.resume:
        resume = "with train.resume=true " + resume
    machine = f" (machine {node} of {nodes})" if nodes > 1 else ""
    return (f"process {rank} of {world}{machine} {what}. Stop the run wherever it still runs, then rerun "
            f"the same command on every machine: {resume}.")


@contextmanager
def peer_guard(accelerator, t: TrainConfig):
    """Turn a lost or silent peer (gloo socket error, collective timeout) into RunInterrupted."""
    try:
        yield
    except Exception as err:
        found = peer_failure(err) if accelerator.num_processes > 1 else None
        if found is None:
            raise
        raise RunInterrupted(interrupted_message(*found, accelerator, t)) from err


# --- the loop ----------------------------------------------------------------------------------
DISK_FULL_AFTER = ("nothing is lost: every checkpoint there is complete (a checkpoint is written whole or not at "
                   "all, and `latest` names the newest). Free some space and rerun the same command: it resumes "
                   "from the latest checkpoint (from step 0 when none was written yet)")


def train(recipe: Recipe, new_phase: bool = False) -> Path:
    """Run (or resume) training; returns the path of the final checkpoint. A resume must keep the
    recorded recipe (resume_plan.FREE_KEYS aside) unless `new_phase` starts a new phase from it."""
    check_export_compat(recipe)
    check_recipe_inputs(recipe)  # before the slow part
    accelerator = build_accelerator(recipe.train, Path(recipe.train.output_dir))
    out_dir = Path(recipe.train.output_dir)
    # a user's folder, or one another live run writes, is refused before anything loads
    with peer_guard(accelerator, recipe.train), run_folder(accelerator, out_dir), disk_guard(out_dir, DISK_FULL_AFTER):
        plan = resume_plan(recipe, new_phase, accelerator.print)
        if plan.finished:
            accelerator.print(f"[specheads] the run in {recipe.train.output_dir} is already at train.max_steps="
                              f"{plan.step} ({plan.checkpoint.name}): nothing to train; raise train.max_steps to train on")
            return plan.checkpoint
        return run_training(recipe, accelerator, plan)


def run_training(recipe: Recipe, accelerator, resume: ResumePlan) -> Path:
    """The training loop on a built accelerator, from where `resume` says (see `train`)."""
    from accelerate.utils import set_seed

    t = recipe.train
    out_dir = Path(t.output_dir)
    set_seed(t.seed)
    target = load_target(accelerator, recipe)
    samples = prepare_samples(recipe, target.tokenizer, report=accelerator.print)
    samples, val_samples = split_samples(recipe, samples)
    head = build_head(recipe, target, samples)
    resume_from = resume.checkpoint
    start, saved_world = 0, 1
    if resume_from is not None:
        ckpt = Checkpoint(resume_from, remedy=resume_hint(resume_from))
        ckpt.verify_for_resume(accelerator.process_index)  # recorded checksums: no corruption carried on
        check_fingerprint(ckpt.provenance.get("target", {}), target, f"the run in {out_dir}")
        load_strict(head, ckpt.weights, str(resume_from))
        start, saved_world = ckpt.trainer_state["step"], ckpt.provenance.get("num_processes", 1)
    head.to(accelerator.device)
    every_rank_evaluates = t.shard_target and accelerator.num_processes > 1
    evaluator = copy.deepcopy(head) if val_samples and (accelerator.is_main_process or every_rank_evaluates) else None
    model, optim, base_optim = wrap(accelerator, head, t)
    # the scheduler stays unprepared: accelerate would step it once per process
    # the schedule counts the steps of the current phase (a new phase starts it again)
    sched = torch.optim.lr_scheduler.LambdaLR(base_optim, lambda s: lr_factor(
        s, t.max_steps - resume.phase_start, t.warmup_steps, t.schedule, t.decay_fraction, t.min_lr_ratio))
    if resume_from is not None and not resume.new_phase:  # a new phase keeps the weights only
        restore(accelerator, optim, sched, resume_from, saved_world)
    plan = BatchPlan([len(x.input_ids) for x in samples], t.batch_size, accelerator.num_processes,
                     accelerator.process_index, t.seed, accum=t.grad_accum)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    prov = provenance(target=target.fingerprint(), num_processes=accelerator.num_processes,
                      strategy=strategy(accelerator))
    if accelerator.is_main_process:
        mark_run(out_dir)
        truncate_metrics(out_dir / "metrics.jsonl", start)
        accelerator.print(
            f"[specheads] training {recipe.head.kind} on {len(samples)} samples ({len(val_samples)} held out), "
            f"{accelerator.num_processes} process(es), {strategy(accelerator)}, steps {start}->{t.max_steps}"
            + resume.describe())
    features = feature_source(recipe.data.features, target, head)  # offline capture or online collect
    log = RunLog(accelerator, recipe, out_dir, start)
    window, step = new_window(), start
    best_tau = best_val_tau(out_dir) if t.keep_best else None  # checkpoints are kept by validation tau
    while step < t.max_steps:
        for micro in range(t.grad_accum):
            batch = make_batch(samples, plan.indices(step, micro), pad_id, accelerator.device,
                               recipe.data.supervise)
            with accelerator.accumulate(model):
                with torch.no_grad():
                    inputs = head_inputs(target, head, batch, features)
                with accelerator.autocast():
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
            c = torch.stack([out.counts[k] for k in COUNT_KEYS]).float()
            window["counts"] = c if window["counts"] is None else window["counts"] + c
        step += 1
        saving = step % t.save_every == 0 or step == t.max_steps
        record = None
        if step % t.log_every == 0 or step == t.max_steps:
            record = window_record(accelerator, window, step, sched.get_last_lr()[0])
            window = new_window()
        val_due = bool(val_samples) and bool((t.val_every and step % t.val_every == 0) or saving)
        val_tau = validate(accelerator, model, evaluator, target, val_samples, t.val_batch_size) if val_due else None
        val_tau = shared(accelerator, val_tau) if val_due else None
        improved = val_tau is not None and t.keep_best and (best_tau is None or val_tau > best_tau)
        best_tau = val_tau if improved else best_tau
        if record is not None or val_tau is not None:
            log.write({**(record or {"step": step}),
                       **({"val_tau": val_tau, "best_val_tau": best_tau} if val_tau is not None else {})})
        log.tick(record)
        if saving or improved:  # a validation that beats every kept checkpoint is kept too
            state = {"num_samples": len(samples), "val_samples": len(val_samples)}
            if resume.phases:  # the run's phases, each with the recipe keys it changed
                state["phases"] = resume.phases
            if val_tau is not None:
                state["val_tau"] = val_tau
            save(accelerator, model, optim, sched, out_dir, step, recipe, prov, state)
    log.close()
    return latest_checkpoint(out_dir)


def resume_note(t: TrainConfig) -> str:
    """What rerunning the same train command does after an interruption."""
    ckpt = latest_checkpoint(t.output_dir)
    if ckpt is None:
        return f"no checkpoint was written in {t.output_dir} yet: the same command starts again from step 0"
    return f"the same command resumes from {ckpt}" + ("" if t.resume else " (with train.resume=true)")


def main(argv: list[str] | None = None) -> int:
    parser = train_parser()
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    try:
        ckpt = train(recipe, new_phase=args.new_phase)
    except KeyboardInterrupt as err:  # Ctrl-C: say where the same command resumes from
        err.add_note(resume_note(recipe.train))
        raise
    print(f"[specheads] checkpoint: {ckpt}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # DeepSpeed ranks otherwise hang at exit
    return 0


if __name__ == "__main__":  # torchrun / accelerate launch: the same error boundary as the CLI
    from specheads.errors import run_verb
    from specheads.hf_compat import quiet_deepspeed

    quiet_deepspeed()
    sys.exit(run_verb("train", main, sys.argv[1:]))
