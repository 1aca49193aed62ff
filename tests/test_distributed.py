"""Every launch config in recipes/accelerate/ trains with 2 real CPU processes and matches one
process on the same global batch; DDP and ZeRO-2 also run as two "machines" on loopback.

The reference is one process with batch 2 x grad_accum 2; each distributed run is 2 ranks x
batch 2. Both read the same 4 samples per step in the same 2 micro-batches (schedule.BatchPlan)
and average the same 2 micro-batch gradients, so losses and weights agree up to float summation
order. Stated tolerance: losses rel 1e-5, weights abs 1e-5 (measured: identical logged losses,
weights within 9e-7 after 6 steps). The ZeRO-3 run is also resumed from its step-4 checkpoint.

Multi-node rehearsal: two `accelerate launch` processes, `--num_machines 2 --machine_rank 0|1
--main_process_ip 127.0.0.1`, one process each, give the same losses and the same weights, bit
for bit, as the one-machine 2-process run. A machine killed (SIGKILL) or frozen (SIGSTOP) after
the first checkpoint stops the other with one clear paragraph (at once, resp. after
train.dist_timeout), and rerunning the same commands resumes to the uninterrupted run's bits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.config import load_recipe
from specheads.export.checkpoint import Checkpoint
from specheads.train import train

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"
STEPS = 6
CONFIGS = {  # launch config -> the strategy the run must report
    "ddp": "multi_cpu", "fsdp": "fsdp2-cpu", "zero2": "deepspeed-zero2", "zero3": "deepspeed-zero3",
}


def _overrides(target, data, out, **extra) -> list[str]:
    base = {"target.path": str(target), "data.train": f"[{data / 'train.jsonl'}]", "data.max_length": 96,
            "head.draft_vocab_size": 256, "head.ttt_steps": 2, "train.output_dir": str(out),
            "train.batch_size": 2, "train.max_steps": STEPS, "train.log_every": 1,
            "train.save_every": 2, "train.warmup_steps": 2, "train.lr": 3e-3, "train.progress": "false"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def _launch(config: str, machine: int | None = None, port: int = 0) -> list[str]:
    """`accelerate launch` of 2 processes with a recipes/accelerate config: on one machine, or as
    machine `machine` of 2 (one process each) meeting at 127.0.0.1:`port`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"), "--num_processes", "2",
           "--main_process_port", str(port)]  # one machine, 0: a free port (concurrent sessions never collide)
    if machine is not None:
        cmd += ["--num_machines", "2", "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1"]
        if config.startswith("zero"):  # torchrun on each machine (the default, pdsh, needs ssh and a hostfile)
            cmd += ["--deepspeed_multinode_launcher", "standard"]
    return [*cmd, "-m", "specheads.train", str(RECIPE)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_machines(config: str, overrides: list[str], logs: Path) -> list[subprocess.Popen]:
    """Both machines of a 2-machine run, each in its own session; output in logs/machine{R}.{out,err}."""
    port, procs = _free_port(), []
    for rank in (0, 1):
        with open(logs / f"machine{rank}.out", "w") as out, open(logs / f"machine{rank}.err", "w") as err:
            procs.append(subprocess.Popen([*_launch(config, rank, port), *overrides], stdout=out, stderr=err,
                                          env=ENV, cwd=ROOT, start_new_session=True))
    return procs


def _machine_tree(proc: subprocess.Popen) -> list:
    """A running machine's launcher and its workers (torchrun starts each worker in a session of
    its own, so signalling the launcher's process group would leave them running)."""
    import psutil

    try:
        launcher = psutil.Process(proc.pid) if proc.poll() is None else None  # not reaped: still our pid
        return [launcher, *launcher.children(recursive=True)] if launcher else []
    except psutil.NoSuchProcess:
        return []


def _signal(tree: list, sig: int) -> None:
    import psutil

    for p in tree:
        try:
            p.send_signal(sig)  # psutil refuses a pid reused since the tree was listed
        except psutil.NoSuchProcess:
            pass


def _stop_machines(procs: list[subprocess.Popen], *trees: list) -> None:
    """SIGKILL whatever is left of both machines (and of `trees` listed earlier), then reap."""
    for tree in (*trees, *map(_machine_tree, procs)):
        _signal(tree, signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=60)


def _finish_machines(procs: list[subprocess.Popen], logs: Path, timeout: float = 300) -> list[str]:
    """Wait for both machines (killing what is left after `timeout`); their stdouts, asserting rc 0."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _stop_machines(procs)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (logs / f"machine{rank}.out").read_text()[-3000:] + \
            (logs / f"machine{rank}.err").read_text()[-3000:]
    return [(logs / f"machine{rank}.out").read_text() for rank in range(2)]


@pytest.fixture(scope="module")
def launched(tiny_target_dir, demo_data_dir, tmp_path_factory):
    """`launched(config, machines)`: (output_dir, main stdout) of that run, launched once per module
    (the one-machine run serves the config test and the two-machine test)."""
    runs = {}

    def get(config: str, machines: int = 1) -> tuple[Path, str]:
        if (config, machines) not in runs:
            logs = tmp_path_factory.mktemp(f"{config}-{machines}m")
            out, overrides = logs / "run", _overrides(tiny_target_dir, demo_data_dir, logs / "run")
            if machines == 1:
                proc = subprocess.run([*_launch(config), *overrides], capture_output=True, text=True, timeout=300,
                                      env=ENV, cwd=ROOT)
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
                stdout = proc.stdout
            else:
                stdout = _finish_machines(_start_machines(config, overrides, logs), logs)[0]
            runs[config, machines] = out, stdout
        return runs[config, machines]

    return get


def _assert_same_bits(got: Path, want: Path) -> None:
    """Identical logged losses and identical final drafter weights."""
    assert _losses(got) == _losses(want)
    a, b = Checkpoint(got).weights, load_file(str(want / f"checkpoint-{STEPS:06d}" / "head.safetensors"))
    assert sorted(a) == sorted(b)
    for name in b:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference(tiny_target_dir, demo_data_dir, tmp_path_factory):
    """One process, the same global batch (2 x 2 accumulated micro-batches)."""
    out = tmp_path_factory.mktemp("single") / "run"
    train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out,
                                         **{"train.grad_accum": 2, "train.max_grad_norm": 0.5})))
    return out


def test_batch_plan_two_ranks_read_what_one_rank_accumulates():
    from specheads.schedule import BatchPlan

    lengths = [(7 * i) % 50 + 1 for i in range(40)]
    single = BatchPlan(lengths, 2, world=1, rank=0, seed=3, accum=2)
    ranks = [BatchPlan(lengths, 2, world=2, rank=r, seed=3) for r in range(2)]
    for step in range(25):  # crosses an epoch boundary (10 steps per epoch)
        assert [single.indices(step, m) for m in range(2)] == [ranks[r].indices(step) for r in range(2)]


GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:21894: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv"


def test_peer_failures_are_told_from_other_errors():
    from specheads.errors import peer_failure

    assert peer_failure(RuntimeError(GLOO_RESET))[0] == "lost"
    assert peer_failure(RuntimeError(GLOO_TIMEOUT))[0] == "timeout"
    assert peer_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))[0] == "lost"
    try:
        try:
            raise RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:4321")
        except RuntimeError as err:
            raise ValueError("wrapped") from err
    except ValueError as wrapped:
        assert peer_failure(wrapped)[0] == "lost"  # found through the exception chain
    for other in (RuntimeError("shape mismatch"), ValueError("Connection reset by peer"), OSError("timed out")):
        assert peer_failure(other) is None


class _Accel:
    process_index, num_processes = 0, 2


def test_lost_peer_message_names_both_ranks_and_the_checkpoint(tmp_path, monkeypatch):
    from specheads.config import TrainConfig
    from specheads.train import interrupted_message

    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    t = TrainConfig(output_dir=str(tmp_path), dist_timeout=600)
    text = interrupted_message("lost", RuntimeError(GLOO_RESET), _Accel(), t)
    assert text.startswith("process 0 of 2 (machine 0 of 2) lost process 1 (machine 1) of the run (Read error "
                           "[10.0.0.2]:21894: Connection reset by peer): ")
    assert text.endswith(f"there is no checkpoint in {tmp_path} yet, so it starts again from step 0.")
    (tmp_path / "checkpoint-000004").mkdir()
    (tmp_path / "latest").write_text("checkpoint-000004\n")
    text = interrupted_message("timeout", RuntimeError(GLOO_TIMEOUT), _Accel(), t)
    assert "waited train.dist_timeout=600 s for process 1 (machine 1) of the run (Timed out waiting" in text
    resume = f"rerun the same command on every machine: it resumes from {tmp_path / 'checkpoint-000004'}."
    assert text.endswith(resume)
    assert "\n" not in text and "Traceback" not in text
    four = type("Accel", (), {"process_index": 3, "num_processes": 4})()  # which peer: only its address says
    assert "process 3 of 4 (machine 0 of 2) lost another process of the run (Read error [10.0.0.2]" in \
        interrupted_message("lost", RuntimeError(GLOO_RESET), four, t)


def test_collective_timeout_reaches_every_process_group(monkeypatch):
    """accelerate drops a timeout equal to its default (600 s) and DeepSpeed's groups pass none:
    the recipe's timeout is torch's default for every group created afterwards."""
    import torch.distributed.distributed_c10d as c10d

    from specheads.train import collective_timeout

    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # restored after the test
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    handler = collective_timeout(cuda=False, seconds=600)
    assert c10d._get_default_timeout("gloo").total_seconds() == 600
    assert handler.backend == "gloo" and handler.timeout.total_seconds() == 600


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_launch_config_matches_single_process(config, reference, launched, tiny_target_dir, demo_data_dir):
    out, stdout = launched(config)
    assert f"2 process(es), {CONFIGS[config]}," in stdout
    if config == "zero3":  # resume from step 4 (DeepSpeed restores per-rank ZeRO optimizer shards)
        shutil.rmtree(out / f"checkpoint-{STEPS:06d}")
        (out / "latest").write_text(f"checkpoint-{STEPS - 2:06d}\n")
        cmd = [*_launch(config), *_overrides(tiny_target_dir, demo_data_dir, out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"steps {STEPS - 2}->{STEPS}, resumed from" in proc.stdout
    ckpt = Checkpoint(out)
    assert ckpt.provenance["num_processes"] == 2 and ckpt.provenance["strategy"] == CONFIGS[config]
    assert _losses(out) == pytest.approx(_losses(reference), rel=1e-5)
    ref = load_file(str(reference / f"checkpoint-{STEPS:06d}" / "head.safetensors"))
    got = ckpt.weights
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype, name
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=name)
    # every rank that holds the gathered drafter holds the same bytes (sharded: rank 0 only)
    digests = ckpt.trainer_state["weights_sha256_per_rank"]
    held = [d for d in digests if d is not None]
    assert digests[0] is not None and len(set(held)) == 1
    if config in ("ddp", "zero2"):  # replicated weights: both ranks hold them
        assert len(held) == 2
    assert sorted(p.name for p in ckpt.path.glob("rank*.pt")) == ["rank000.pt", "rank001.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "zero2"])
def test_two_machines_match_one_machine(config, launched):
    """The multi-node launch (2 machines x 1 process, loopback) is the one-machine run, bit for bit."""
    out, stdout = launched(config, machines=2)
    assert f"2 process(es), {CONFIGS[config]}, steps 0->{STEPS}" in stdout
    _assert_same_bits(out, launched(config)[0])
    ckpt = Checkpoint(out)
    assert sorted(p.name for p in ckpt.path.glob("rank*.pt")) == ["rank000.pt", "rank001.pt"]


LOST_WITHIN = 120  # s: a killed machine's peer stops at once (its socket closes); this is the hard bound
FROZEN_TIMEOUT = 30  # train.dist_timeout of the frozen run: a silent machine's peer stops after it


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config, how", [("ddp", "killed"), ("zero2", "frozen")])
def test_lost_machine_stops_the_other_then_resumes(config, how, launched, tiny_target_dir, demo_data_dir,
                                                   tmp_path):
    """Machine 1 SIGKILLed (or SIGSTOPped: a machine gone silent) once the first checkpoint exists:
    machine 0 exits with one clear paragraph in time; the same commands then resume to the bits
    of the uninterrupted two-machine run."""
    out = tmp_path / "run"
    extra = {"train.dist_timeout": FROZEN_TIMEOUT} if how == "frozen" else {}
    overrides = _overrides(tiny_target_dir, demo_data_dir, out, **extra)
    procs, tree = _start_machines(config, overrides, tmp_path), []
    try:
        deadline = time.monotonic() + 600
        while not (out / "latest").is_file() and procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        tree = _machine_tree(procs[1])
        _signal(tree, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        assert (out / "latest").is_file() and len(tree) >= 2, "machine 1 ended before its first checkpoint"
        killed_at = int((out / "latest").read_text().strip().split("-")[1])
        assert 2 <= killed_at < STEPS, "not killed mid-run"
        bound = LOST_WITHIN if how == "killed" else FROZEN_TIMEOUT + LOST_WITHIN
        procs[0].wait(timeout=bound)  # raises (the test fails) if machine 0 hangs past the bound
        waited = time.monotonic() - lost_at
    finally:
        _stop_machines(procs, tree)
    assert procs[0].returncode != 0
    err = (tmp_path / "machine0.err").read_text()
    ckpt = out / f"checkpoint-{killed_at:06d}"
    why = ("lost process 1 (machine 1) of the run (" if how == "killed" else
           f"waited train.dist_timeout={FROZEN_TIMEOUT} s for process 1 (machine 1) of the run (")
    assert f"specheads train: error: process 0 of 2 (machine 0 of 2) {why}" in err, err[-3000:]
    assert f"rerun the same command on every machine: it resumes from {ckpt}.\n" in err
    assert "specheads/train.py" not in err  # no traceback through our code (the launcher adds its own summary)
    if how == "frozen":
        assert waited > FROZEN_TIMEOUT / 2  # the collective timeout stopped it, not a closed socket

    logs = tmp_path / "resumed"  # the interrupted run's logs stay for a failure's post-mortem
    logs.mkdir()
    stdout = _finish_machines(_start_machines(config, overrides, logs), logs)[0]
    assert f"steps {killed_at}->{STEPS}, resumed from {ckpt}" in stdout
    _assert_same_bits(out, launched(config, machines=2)[0])


@pytest.mark.slow
def test_sharded_target_matches_single_process(tiny_target_dir, demo_data_dir, tmp_path):
    """train.shard_target: the frozen target's layers split over 2 ranks (FSDP2); training losses
    and held-out tau equal one process with the whole target."""
    extra = {"train.val_samples": 8, "train.val_every": 1}
    single = tmp_path / "single"
    train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, single, **extra, **{"train.grad_accum": 2})))
    out = tmp_path / "sharded"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / "cpu.yaml"), "--main_process_port", "0",
           "-m", "specheads.train", str(RECIPE),
           *_overrides(tiny_target_dir, demo_data_dir, out, **extra, **{"train.shard_target": "true"})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout
    local, total = (int(n.replace(",", "")) for n in
                    proc.stdout.split("target sharded over 2 processes: ")[1].split(" parameters")[0].split(" of "))
    assert local < 0.75 * total  # the decoder layers are split, embeddings and lm_head are whole

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    got, want = records(out), records(single)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["val_tau"] for r in got] == pytest.approx([r["val_tau"] for r in want], rel=1e-6)
