# Quick start: `make demo` (export SmolLM2-135M + EAGLE generation) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: demo test test-fast lint setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	$(PY) -m pip install -q --no-deps $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['eagle-deploy']['no-deps-requirements']))")
	# Triton's Python-backend stub needs a numpy<2 venv of its own (eagle_deploy/triton/env.py)
	$(PY) -m eagle_deploy.triton.env
	touch $@

demo: setup
	$(VENV)/bin/eagle-export --model smollm2-135m --out engines/ --force
	$(VENV)/bin/eagle-run --engines engines/smollm2-135m --prompt "$(PROMPT)" --compare-vanilla

# Two pytest workers (pytest-xdist), a test file each at a time: one worker's onnxruntime forwards
# overlap the other's Python, server waits and child processes (docs/decisions.md, "two test workers").
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: setup
	$(PYTEST)

# The fast lane: everything but the tests marked slow (the real SmolLM2 export, the real tritonserver, eagle-serve child processes, the filled-up tmpfs, the GGUF conversion) and the Monte-Carlo distribution tests.
test-fast: setup
	$(PYTEST) -m "not slow and not statistical"

lint: setup
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV)
