# Thin wrappers around the `specheads` CLI. Everything installs into .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
RUN    ?= runs/demo
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install test demo train export eval bench bench-server push clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -x --timeout 900 tests

demo: install
	$(BIN)/specheads demo --run $(RUN)

train: install
	$(BIN)/specheads train $(or $(RECIPE),recipes/demo/eagle3.yaml) train.output_dir=$(RUN)/checkpoint

export: install
	$(BIN)/specheads export $(RUN)/checkpoint --format vllm --out $(RUN)/export/vllm
	$(BIN)/specheads export $(RUN)/checkpoint --format sglang --out $(RUN)/export/sglang

eval: install
	$(BIN)/specheads eval --target $(RUN)/target --draft $(RUN)/export/vllm --prompts $(RUN)/data/heldout_prompts.jsonl --out $(RUN)/eval

bench: install
	$(BIN)/python bench/verifier.py --target $(RUN)/target --draft $(RUN)/export/vllm --prompts $(RUN)/data/heldout_prompts.jsonl --out $(RUN)/bench --limit 16 --max-new-tokens 64

# URL: the speculative server; BASELINE: the same target served without a draft (optional)
bench-server: install
	$(BIN)/specheads bench --url $(URL) $(if $(BASELINE),--baseline-url $(BASELINE)) --prompts $(RUN)/data/heldout_prompts.jsonl --out $(RUN)/server-bench $(if $(CONCURRENCY),--concurrency $(CONCURRENCY))

push: install
	$(BIN)/specheads push $(RUN)/export/vllm --repo $(REPO) $(if $(DRY),--dry-run,)

clean:
	rm -rf $(VENV) runs
