"""The per-layer registries of drafter kinds agree, and an unknown kind fails at its first lookup."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specheads.export import LOADERS, WRITERS, ExportRefused, load_with_meta
from specheads.export.readme import Readme
from specheads.export.registry import writer_for
from specheads.heads import HEADS, head_class
from specheads.kinds import KINDS, Kind, kind_of
from specheads.verify.registry import PROPOSERS, make_proposer
from specheads.verify.settings import SettingsError, TreeSpec

REGISTRIES = {"heads.HEADS": HEADS, "export.WRITERS": WRITERS, "export.LOADERS": LOADERS,
              "verify.registry.PROPOSERS": PROPOSERS, "kinds.KINDS": KINDS}


def test_every_registry_has_the_same_kinds():
    kinds = {name: sorted(reg) for name, reg in REGISTRIES.items()}
    assert all(k == kinds["heads.HEADS"] for k in kinds.values()), kinds


def test_registry_members_provide_their_protocol():
    for kind, cls in HEADS.items():
        assert cls.kind == kind and cls.Options.kind == kind
        for member in ("for_target", "required_layers", "collect", "expand", "train_forward"):
            assert callable(getattr(cls, member, None)), (kind, member)
    for kind, module in WRITERS.items():
        assert module.FORMATS_WRITTEN and callable(LOADERS[kind].load_export), kind
    for kind, module in PROPOSERS.items():
        assert callable(module.make_proposer), kind
    for kind, spec in KINDS.items():  # a descriptor with examples the engine matrix and export tests build
        assert isinstance(spec, Kind) and spec.name == kind and spec.examples, kind
        assert all(set(e.formats) <= set(WRITERS[kind].FORMATS_WRITTEN) for e in spec.examples), kind
        assert isinstance(WRITERS[kind].README, Readme), kind  # what the export's README says of the kind


def test_unknown_kind_fails_at_first_lookup_naming_the_kinds(tmp_path):
    known = ", ".join(HEADS)
    with pytest.raises(ValueError, match=f"head.kind 'nope'.*{known}"):
        head_class("nope")
    with pytest.raises(ExportRefused, match=f"head kind 'nope'.*{known}"):
        writer_for("nope", "vllm")
    with pytest.raises(ValueError, match=f"head kind 'nope' has no descriptor.*{known}"):
        kind_of("nope")
    with pytest.raises(SettingsError, match=f"head kind 'nope' has no proposer.*{known}"):
        make_proposer(TreeSpec("chain", k=2), SimpleNamespace(kind="nope"), target=None)
    (tmp_path / "specheads.json").write_text(json.dumps({"kind": "nope", "format": "vllm"}))
    with pytest.raises(ValueError, match=f"head kind 'nope' cannot be loaded.*{known}"):
        load_with_meta(tmp_path)


@pytest.mark.parametrize("field", ["kind", "format"])
def test_a_record_without_kind_or_format_is_refused_naming_the_file_and_field(tmp_path, field):
    """No kind is assumed: a specheads.json that names no kind (or format) is an error, not EAGLE-3."""
    from specheads.export import read_export_meta

    record = {"kind": "eagle3", "format": "vllm"}
    record.pop(field)
    (tmp_path / "specheads.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=f"{tmp_path / 'specheads.json'}: no \"{field}\" field"):
        read_export_meta(tmp_path)


def test_validate_without_kind_reads_it_from_the_record(tmp_path):
    from specheads.export import validate

    with pytest.raises(ValueError, match=r"specheads.json: no such file, so the folder names no head kind; pass kind"):
        validate(tmp_path, "vllm")
    (tmp_path / "specheads.json").write_text(json.dumps({"kind": "nope", "format": "vllm"}))
    with pytest.raises(ValueError, match="head kind 'nope' cannot be loaded"):
        validate(tmp_path, "vllm")


def test_every_kind_has_a_row_in_the_engine_probes_naming_the_engines_own_methods():
    """The probes run in the engines' venvs with their own table (engines/probe_kinds.py); it must agree
    with engine_facts.SERVING on each engine's name for the kind, and cover every probe name a kind uses."""
    from specheads.engine_facts import SERVING
    from specheads.engines.probe_kinds import KINDS as PROBE_KINDS

    configs = ({}, {"parallel_drafting": True})  # P-EAGLE is EAGLE-3 with parallel drafting
    for kind, spec in KINDS.items():
        assert {spec.probe_name(hc) for hc in configs} <= set(PROBE_KINDS), kind
    field = {"vllm": "vllm_method", "sglang": "sglang_algorithm"}
    for (kind, fmt), serving in SERVING.items():
        if serving.launcher in field:
            row = PROBE_KINDS[KINDS[kind].probe_name({})]
            assert getattr(row, field[serving.launcher]) == serving.method, (kind, fmt)
