# Two entry points for a fresh machine with Python >= 3.10: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup mergekit demo test lint clean
MERGEKIT_VENV ?= .venv-mergekit

# torch goes in first, alone and pinned: the CPU build. An unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lab,eval]'
	touch $@

setup: $(VENV)/.installed

# mergekit 0.1.5 in its own venv: the parity tests and benchmarks run it as a separate program.
$(MERGEKIT_VENV)/.installed: constraints-mergekit.txt
	$(PY) -m venv $(MERGEKIT_VENV)
	$(MERGEKIT_VENV)/bin/pip install -q torch==2.13.0
	$(MERGEKIT_VENV)/bin/pip install -q -c constraints-mergekit.txt mergekit==0.1.5
	touch $@

mergekit: $(MERGEKIT_VENV)/.installed

demo: setup
	$(BIN)/rlmerge demo --workdir demo-output

lint: setup
	$(BIN)/ruff check src tests benchmarks

test: setup mergekit lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(MERGEKIT_VENV) demo-output
