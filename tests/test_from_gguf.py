"""`specheads target from-gguf`: a GGUF written with the gguf package's writer -> a HF folder whose
logits, tokenizer and chat template equal the GGUF-loaded model's, usable as a target."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

from gguf_files import write_tiny_gguf  # noqa: E402

from specheads.cli import main as cli  # noqa: E402
from specheads.from_gguf import GGUFError, convert, load_gguf, max_logit_difference  # noqa: E402
from specheads.target import Target  # noqa: E402


@pytest.fixture(scope="module")
def gguf_file(tiny_target_dir, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf", tiny_target_dir)


def test_converted_folder_equals_the_gguf_model(gguf_file, tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert(gguf_file, tmp_path / "hf", name="someorg/tiny-llama", report=lambda *_: None)
    src, src_tok = load_gguf(gguf_file)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert max_logit_difference(src, saved, tok) == 0.0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] and cfg["num_hidden_layers"] == 2
    assert saved.get_output_embeddings().weight.data_ptr() == saved.get_input_embeddings().weight.data_ptr()
    # the tokenizer and chat template survive: same ids and rendering as the tiny target's own
    ref = AutoTokenizer.from_pretrained(tiny_target_dir)
    chat = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    text = "import os\nprint(os.getcwd())"
    assert tok(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]
    # a usable target, named after the hub id given (not the local folder)
    t = Target.load(str(out), device="cpu")
    assert t.fingerprint()["name"] == "someorg/tiny-llama" and t.vocab_size == len(ref)
    assert len(src_tok) == len(ref)


def test_cli_from_gguf_and_errors(gguf_file, tmp_path, capsys):
    assert cli(["target", "from-gguf", str(gguf_file), "--out", str(tmp_path / "t")]) == 0
    assert str(tmp_path / "t") in capsys.readouterr().out
    assert (tmp_path / "t" / "model.safetensors").is_file()
    assert cli(["target", "from-gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "u")]) == 1
    assert "no such GGUF file" in capsys.readouterr().err and not (tmp_path / "u").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="bad.gguf"):
        convert(bad, tmp_path / "v", report=lambda *_: None)
    assert cli(["target"]) == 2


def test_a_truncated_gguf_is_named_and_an_existing_out_is_refused_before_loading(gguf_file, tmp_path, capsys):
    data = gguf_file.read_bytes()
    for cut, needle in ((len(data) - 1000, r"truncated: its \d+ tensors need [\d,]+ bytes but the file has [\d,]+ "
                                            r"\(1,000 missing\); download or copy it again"),
                        (300, r"truncated: the file ends \(300 bytes\) inside its header")):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=rf"{short}: {needle}"):
            load_gguf(short)
        assert cli(["target", "from-gguf", str(short), "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert f"{short}: truncated" in err and "bug" not in err and not (tmp_path / "o").exists()
    # an existing --out is refused first: even a truncated file is not read
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text("{}")
    assert cli(["target", "from-gguf", str(short), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'o'} already exists (1 file(s)" in err and "Nothing was read or changed" in err
    assert ": truncated" not in err
