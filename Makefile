# The two commands a newcomer runs: `make run` and `make test`. Both create/reuse .venv and
# install what they need, including Debian packages the tests use (when run as root).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST  := $(VENV)/bin/pytest
# The real router for the slow suites, smg (PyPI), in a venv of its own: sglang-router 0.3.2
# (the one legacy test) also installs a bin/smg, and whichever is installed last owns it.
# tests/real_router.py finds it here (SMG_VERSION there must match).
SMG_VERSION := 1.13.0
SMG_VENV    ?= .venv-smg
SMG_STAMP   := $(SMG_VENV)/.installed-smg-$(SMG_VERSION)
APT_PKGS := prometheus wrk nginx-light curl redis-server

.PHONY: run test test-fast test-slow lint fmt sysdeps smg dashboard bench bench-peers check-record clean

$(STAMP): pyproject.toml $(SMG_STAMP)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[tokenizers,redis,test,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(SMG_STAMP):
	test -x $(SMG_VENV)/bin/python || python3 -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/python -m pip install -q --disable-pip-version-check 'smg==$(SMG_VERSION)'
	$(SMG_VENV)/bin/smg --version | grep -qx 'smg $(SMG_VERSION)'
	rm -f $(SMG_VENV)/.installed-smg-*
	touch $(SMG_STAMP)

smg: $(SMG_STAMP)

# Debian packages used by tests and benchmarks; installed only when missing and when root.
sysdeps:
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v nginx >/dev/null || missing="$$missing nginx-light"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "not root: tests needing$$missing will be skipped"; fi; \
	fi

run: $(STAMP)
	$(VENV)/bin/kvproxy demo

# Everything but the slow suites (soak, real router, real Prometheus end to end), measuring
# kvproxy/'s line coverage in-process (the `kvproxy` subprocesses tests start are not
# measured) and failing under COV_FLOOR: a point or two under the figure README states.
COV_FLOOR := 90
test: $(STAMP) sysdeps
	$(PYTEST) -q -m "not slow" -p no:cacheprovider \
	  --cov=kvproxy --cov-report=term --cov-fail-under=$(COV_FLOOR)

test-slow: $(STAMP) sysdeps
	$(PYTEST) -q -m "slow" -p no:cacheprovider

test-fast: test

lint: $(STAMP)
	$(VENV)/bin/ruff format --check kvproxy tests bench grafana
	$(VENV)/bin/ruff check kvproxy tests bench grafana
	$(VENV)/bin/mypy --strict kvproxy

fmt: $(STAMP)
	$(VENV)/bin/ruff format kvproxy tests bench grafana
	$(VENV)/bin/ruff check --fix kvproxy tests bench grafana

dashboard: $(STAMP)
	$(PY) grafana/generate.py

bench: $(STAMP) sysdeps
	$(PY) bench/run.py

bench-peers: $(STAMP) sysdeps
	$(PY) bench/run.py --peers

clean:
	rm -rf $(VENV) $(SMG_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
