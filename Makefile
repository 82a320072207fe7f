# vkvagent developer entry points. `make dev` once, then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY39 ?= $(shell pyenv prefix 3.9.18 2>/dev/null)/bin/python3
PY313 ?= $(shell pyenv prefix 3.13.0 2>/dev/null)/bin/python3
# pyenv prefix printing nothing would leave /bin/python3: refuse rather than test another Python.
check-python = $(if $(filter /bin/python3,$(1)),$(error $(2) not found: install it with pyenv))

.PHONY: dev demo test lint typecheck unit test-pythons bench bench-policy reliability config-example package clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

dev: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The README's first command: a simulated vLLM degrades and the agent loop diagnoses it (~30 s).
demo: dev
	$(BIN)/vkvagent demo

# The README's test command: style, types, then every test.
test: dev lint typecheck unit

lint:
	$(BIN)/ruff check vkvagent tests bench reliability
	$(BIN)/ruff format --check vkvagent tests bench reliability

typecheck:
	$(BIN)/mypy

unit:
	$(BIN)/pytest -q

# The oldest and newest supported Pythons (RHEL 9's 3.9, and 3.13), each in its own venv.
test-pythons:
	$(call check-python,$(PY39),Python 3.9.18)
	$(call check-python,$(PY313),Python 3.13.0)
	$(PY39) --version && $(MAKE) VENV=.venv-3.9 PYTHON=$(PY39) dev unit
	$(PY313) --version && $(MAKE) VENV=.venv-3.13 PYTHON=$(PY313) dev unit

bench: dev
	$(BIN)/python bench/scrape.py
	$(BIN)/python bench/sim.py
	$(BIN)/python bench/daemon.py

# Decision quality: every restart policy against the oracle over simulated weeks (bench/README.md).
bench-policy: dev
	$(BIN)/python -m bench.policy

# Fuzzing, kill -9 and other faults against a real systemd, a simulated week's soak: the table
# in docs/RELIABILITY.md. Root (the systemd sandbox), about 13 minutes; not part of `make test`.
reliability: dev
	$(BIN)/python -m reliability

config-example: dev
	$(BIN)/python -c 'from vkvagent import config; \
	open("config.example.toml", "w").write(config.render(config.Config(), with_docs=True))'

# dist/vkvagent_<version>_all.deb and dist/vkvagent-<version>-1.noarch.rpm (packaging/README.md).
package: dev
	PYTHON=$(BIN)/python UV=$(BIN)/uv NFPM=$(BIN)/nfpm bash packaging/build.sh

clean:
	rm -rf $(VENV) .venv-3.9 .venv-3.13 .mypy_cache .pytest_cache .ruff_cache build dist *.egg-info
