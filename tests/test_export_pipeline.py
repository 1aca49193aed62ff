"""One export pipeline: every kind goes through the same option checks in `export()`, and the engine
facts table (specheads/engine_facts.py) drives the --format choices, the refusals, the serve commands
and the README."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from safetensors import safe_open

from specheads import engine_facts
from specheads.engines import matrix, venvs
from specheads.export import ALL_FORMATS, WRITERS, ExportRefused, export, read_export_meta
from specheads.export.readme import TargetRef, serve_commands
from specheads.export.registry import writer_for
from specheads.heads import HEADS
from specheads.kinds import KINDS
from specheads.target import Target


@pytest.fixture(scope="module")
def checkpoints(tiny_target_dir, tmp_path_factory):
    """A checkpoint of every kind: its descriptor's first example (random weights; MTP on its family target)."""
    root = tmp_path_factory.mktemp("kinds")
    target = Target.load(str(tiny_target_dir), device="cpu")
    out = {kind: matrix.example_checkpoint(root, spec.example, tiny_target_dir, target)[0] for kind, spec in KINDS.items()}
    assert sorted(out) == sorted(HEADS)
    return out


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("k", [0, -2, True, 1.5])
def test_every_kind_refuses_a_draft_length_below_one(checkpoints, tmp_path, kind, k):
    fmt = WRITERS[kind].FORMATS[0]
    with pytest.raises(ValueError, match=f"num_speculative_tokens {k!r}: expected a positive integer"):
        export(checkpoints[kind], fmt, tmp_path / "out", num_speculative_tokens=k)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_kind_names_a_bad_dtype(checkpoints, tmp_path, kind):
    fmt = WRITERS[kind].FORMATS[0]
    with pytest.raises(ValueError, match="dtype 'fp8': expected one of float32, bfloat16, float16"):
        export(checkpoints[kind], fmt, tmp_path / "out", dtype="fp8")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_kind_checks_the_adapter_option(checkpoints, tmp_path, kind):
    fmt = WRITERS[kind].FORMATS[0]
    modes = getattr(WRITERS[kind], "ADAPTER_MODES", None)  # heads trained with target adapters (Medusa-2)
    want = f"adapter 'keep': expected one of {', '.join(modes)}" if modes else "--adapter applies to heads"
    with pytest.raises(ValueError, match=want):
        export(checkpoints[kind], fmt, tmp_path / "out", adapter="keep")
    assert not (tmp_path / "out").exists()


def test_every_writer_provides_the_writer_protocol():
    """No optional export hooks: every kind plans, refuses and checks its contract the same way."""
    for kind, writer in WRITERS.items():
        for member in ("check_exportable", "plan", "validate", "load_export"):
            assert callable(getattr(writer, member, None)), (kind, member)
        assert not hasattr(writer, "export_folder") and not hasattr(writer, "REFUSED"), kind


def test_the_facts_table_names_exactly_the_pairs_the_writers_write():
    written = {(kind, fmt) for kind, writer in WRITERS.items() for fmt in writer.FORMATS}
    assert written == set(engine_facts.SERVING)
    assert not written & set(engine_facts.REFUSED), "a pair both written and refused"
    assert {fmt for _, fmt in written} == set(engine_facts.FORMATS) == set(ALL_FORMATS)
    for kind, fmt in engine_facts.REFUSED:
        with pytest.raises(ExportRefused) as err:
            writer_for(kind, fmt)
        assert str(err.value) == engine_facts.REFUSED[(kind, fmt)]


def test_format_choices_come_from_the_facts_table(capsys):
    from specheads.cli import _export

    with pytest.raises(SystemExit):
        _export(["ckpt", "--format", "nope", "--out", "x"])
    err = capsys.readouterr().err
    assert "choose from " + ", ".join(f"'{f}'" for f in engine_facts.FORMATS) in err, err
    assert ALL_FORMATS == ("vllm", "vllm-native", "sglang", "medusa", "vllm-0.32")  # golden: the --help order


def test_engine_versions_come_from_the_facts_table(checkpoints, tmp_path):
    """Golden values: what specheads.json records and what the engine venvs install."""
    out = export(checkpoints["eagle"], "sglang", tmp_path / "e")
    record = json.loads((out / "specheads.json").read_text())
    assert record["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert record["engine_versions"] == {"vllm": "0.33", "sglang": "0.5.23", "vllm-0.32": "0.32", "medusa": "1.0"}
    assert (venvs.ENGINES["vllm"].version, venvs.ENGINES["sglang"].version) == ("0.33.0", "0.5.23")
    assert "SGLang 0.5.23, LlamaForCausalLMEagle" in (out / "README.md").read_text()


GOLDEN_COMMANDS = {  # (kind, format) -> the commands for folder /x/d, target org/t (a hub id), k = 3
    ("eagle3", "vllm"): ["vllm serve /x/d",
                         """vllm serve org/t --speculative-config '{"method":"eagle3","model":"/x/d","""
                         """"num_speculative_tokens":3}'"""],
    ("eagle3", "sglang"): ["python -m sglang.launch_server --model-path org/t --speculative-algorithm EAGLE3 "
                           "--speculative-draft-model-path /x/d --speculative-num-steps 3 --speculative-eagle-topk 1 "
                           "--speculative-num-draft-tokens 4"],
    ("mtp", "vllm"): ["""vllm serve /x/d --speculative-config '{"method":"mtp","num_speculative_tokens":3}'"""],
    ("mtp", "sglang"): ["python -m sglang.launch_server --model-path /x/d --speculative-algorithm NEXTN "
                        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"],
    ("dflash", "sglang"): ["python -m sglang.launch_server --model-path org/t --speculative-algorithm DFLASH "
                           "--speculative-draft-model-path /x/d"],
    ("draft", "vllm"): ["""vllm serve org/t --speculative-config '{"method":"draft_model","model":"/x/d","""
                        """"num_speculative_tokens":3}'"""],
    ("medusa", "medusa"): ["python -m medusa.inference.cli --model /x/d"],
    ("medusa", "vllm-0.32"): ["""vllm serve org/t --speculative-config '{"method":"medusa","model":"/x/d","""
                              """"num_speculative_tokens":3}'"""],
}


@pytest.mark.parametrize("pair", sorted(GOLDEN_COMMANDS))
def test_serve_commands_golden(pair):
    target = TargetRef(name="t", hub_id="org/t", local=None, architectures=[])
    kind, fmt = pair
    assert serve_commands(fmt, "/x/d", target, 3, kind) == GOLDEN_COMMANDS[pair]


def test_the_facts_table_drives_serve_commands_and_the_readme(checkpoints, tmp_path, monkeypatch):
    """Change the table's entry for EAGLE-1 on SGLang: the export's commands and README follow it."""
    old = engine_facts.SERVING[("eagle", "sglang")]
    monkeypatch.setitem(engine_facts.SERVING, ("eagle", "sglang"),
                        replace(old, method="EAGLE_NEXT", chain=False, title="SGLang 9.9, EagleNext"))
    out = export(checkpoints["eagle"], "sglang", tmp_path / "e")
    cmds = read_export_meta(out).serve_commands
    assert len(cmds) == 1 and cmds[0].endswith(f"--speculative-algorithm EAGLE_NEXT --speculative-draft-model-path "
                                               f"{out}"), cmds
    readme = (out / "README.md").read_text()
    assert cmds[0] in readme and "(SGLang 9.9, EagleNext)" in readme


def test_mtp_casts_to_the_asked_dtype_and_records_it(checkpoints, tmp_path):
    """The dtype table reaches MTP's modules too (a bad name was a bare KeyError); the record names it."""
    out = export(checkpoints["mtp"], "vllm", tmp_path / "m", dtype="bfloat16", num_speculative_tokens=2)
    record = json.loads((out / "specheads.json").read_text())
    assert record["dtype"] == "bfloat16" and record["num_speculative_tokens"] == 2
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as fh:
        assert {fh.get_slice(n).get_dtype() for n in fh.keys()} == {"BF16"}
