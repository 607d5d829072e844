# Two entry points for a fresh machine with Python >= 3.10: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test lint clean

# torch goes in first, alone and pinned: the CPU build. An unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/rlmerge demo --workdir demo-output

lint: setup
	$(BIN)/ruff check src tests benchmarks

test: setup lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-output
