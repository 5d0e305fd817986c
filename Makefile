# Two commands for a newcomer: `make demo` and `make test`. Each builds .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a loose torch pin would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The theory demo (tables + plot), then the engine on the embedded default target: Gemma-3-270M with n-gram
# drafts on an input-grounded prompt, exact greedy output and live stats. (The gate issue turns this into
# `specgate gate --quick`.)
demo: $(STAMP)
	$(VENV)/bin/specgate demo --out out/demo
	$(VENV)/bin/specgate generate --target gemma-3-270m --draft ngram --gamma 4 --max-new-tokens 64 \
		--prompt-file examples/prompts/rewrite_code.txt

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
