# Every target bootstraps what it needs: .venv (Python packages), Debian packages when
# running as root, and the custom ops.  `make demo` and `make test` are the README's two
# set-up commands.

PYTHON_BOOT ?= python3.11
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
EXTRAS      := test,demo,redis,p2pstore,mooncake,verbs,trainer-test
DEB_PKGS    := redis-server libibverbs1
STAMP       := $(VENV)/.installed
OPS_STAMP   := fd_routing_replay/_ops/.built
PYTEST_ARGS ?=
TORCH_CPU   ?= torch==2.13.0
PADDLE_PIN  ?= paddlepaddle==3.3.1
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

VERL_REQS   := tests/trainers/verl-requirements.txt
VERL_STAMP  := $(VENV)/.verl-installed

FD_VENV     := .venv-fd
FD_PY       := $(FD_VENV)/bin/python
FD_STAMP    := $(FD_VENV)/.installed
FD_REQS     := tests/fastdeploy_contract/requirements.txt
FD_SOURCES  ?= ../shared/fastdeploy
FD_VERSIONS ?= 2.5 develop-2026-04 2.6

PADDLE_VENV  := .venv-paddle
PADDLE_PY    := $(PADDLE_VENV)/bin/python
PADDLE_STAMP := $(PADDLE_VENV)/.installed
PADDLE_REQS  := tests/trainers/paddle/requirements.txt

.PHONY: all venv verl-deps deps ops test test-random demo bench lint clean cuda-check device-check fd-env contract \
        paddle-env trainer-paddle wheel-smoke live-env live live-serve soak soak-short

all: test

# Debian packages the tests use (redis-server; libibverbs1 for the Mooncake TCP transport).
# Installed only when missing and when we are root; otherwise the tests that need them skip.
deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] || missing="$$missing libibverbs1"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "warning: missing Debian packages:$$missing (not root: tests that need them will skip)"; \
	  fi; \
	fi

$(PY):
	@command -v $(PYTHON_BOOT) >/dev/null 2>&1 || { echo "error: $(PYTHON_BOOT) not found; set PYTHON_BOOT=/path/to/python3.11"; exit 1; }
	$(PYTHON_BOOT) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(PADDLE_PIN)"
	# A CPU torch (the CPU wheel index where reachable, else PyPI) before the extras, so
	# trainer-test's megatron-core finds torch installed instead of pulling a CUDA build.
	$(PIP) install -q --retries 1 --extra-index-url $(TORCH_INDEX) "$(TORCH_CPU)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

# fdrr_dev (the harness and test servers) is not part of the wheel: the checkout's root on the
# venv's path makes it importable for the tests, benchmarks and `make demo`.
DEV_PTH     := $(VENV)/.dev-path
$(DEV_PTH): $(STAMP)
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fdrr_dev.pth"
	@touch $(DEV_PTH)

venv: $(STAMP) $(DEV_PTH)

# verl's own code for the verl adapter tests: verl 0.9.1 and the few pure-Python packages its
# tested modules import, all --no-deps (verl's declared dependencies pull CUDA builds, vLLM,
# SGLang and an older transformers than trainer-test pins).  ~270 MB, most of it ray, which
# `import verl` needs.
$(VERL_STAMP): $(STAMP) $(VERL_REQS)
	$(PIP) install -q --no-deps -r $(VERL_REQS)
	@touch $(VERL_STAMP)

verl-deps: $(VERL_STAMP)

$(OPS_STAMP): $(STAMP) $(wildcard custom_ops/*) fd_routing_replay/core/native.py
	$(PY) custom_ops/build.py

ops: $(OPS_STAMP)

# FD_RR_OPS=compiled: an ops library that cannot load, or a silent fallback to the NumPy set
# codec, fails the run.
# --timeout: a hung test fails instead of eating CI's budget.
# fd-env: tests/test_pdtensor.py checks our .pdtensor bytes against paddle.save under
# FastDeploy's NumPy 1 (the contract tier's environment, built once for both).
test: deps venv verl-deps ops fd-env
	FD_RR_OPS=compiled $(PY) -m pytest -q --timeout=900 $(PYTEST_ARGS)

# The same suite with a fresh random seed base per run (tests/conftest.py): a hunt for
# seed-dependent failures.  `make test` runs each test's fixed seed.
test-random: deps venv verl-deps ops fd-env
	FD_ROUTING_REPLAY_TEST_SEED=random FD_RR_OPS=compiled $(PY) -m pytest -q --timeout=900 $(PYTEST_ARGS)

demo: deps venv ops
	$(PY) -m fdrr_dev demo

# bench_capture_fd26.py runs FastDeploy 2.6's own code: it needs the contract tier's environment.
bench: deps venv ops fd-env
	$(PY) benchmarks/run_all.py

# The soak (benchmarks/soak, docs/benchmarks.md "Soak"): producers, trainers and a deleting
# driver sharing one store, faults injected, every record checked.  soak-short is CI's form
# (about 2 minutes; fails when a record is lost or corrupt); soak the long one (26 minutes
# here; SOAK_ARGS="--stores redis --scenarios steady" narrows it).  Both need root for the
# disk-full scenario's tmpfs (skipped, and said so, otherwise).
SOAK_ARGS ?=
soak-short: deps venv ops
	FD_RR_OPS=compiled $(PY) -m benchmarks.soak.run --short $(SOAK_ARGS)

soak: deps venv ops fd-env
	FD_RR_OPS=compiled $(PY) -m benchmarks.soak.run $(SOAK_ARGS)

lint: venv
	$(VENV)/bin/ruff check fd_routing_replay fdrr_dev tests benchmarks scripts custom_ops

# Compile-check the CUDA kernels and their Paddle glue (no GPU needed; the glue needs the
# venv's Paddle headers); skipped with a message when nvcc is absent (an error under CI=true).
cuda-check: deps venv
	@bash scripts/cuda_compile_check.sh

# On a machine with an NVIDIA GPU: build the CUDA harness, check it against numpy, time it.
device-check:
	bash scripts/device_check.sh

# The FastDeploy contract tier: FastDeploy's own sources (../shared/fastdeploy/<version>)
# run around the plugin, in their own environment (~1 GB: Paddle + FastDeploy's pure-Python
# dependencies), one process per FastDeploy version.
$(FD_STAMP): $(FD_REQS) setup.cfg pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null 2>&1 || { echo "error: $(PYTHON_BOOT) not found"; exit 1; }
	[ -x $(FD_PY) ] || $(PYTHON_BOOT) -m venv $(FD_VENV)
	$(FD_PY) -m pip install -q --upgrade pip setuptools wheel
	$(FD_PY) -m pip install -q -r $(FD_REQS)
	$(FD_PY) -m pip install -q --no-deps -e .
	echo "$(CURDIR)" > "$$($(FD_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fdrr_dev.pth"
	@touch $(FD_STAMP)

fd-env: $(FD_STAMP)

contract: deps ops fd-env
	@set -e; for v in $(FD_VERSIONS); do \
	  echo "== FastDeploy contract tier: $$v"; \
	  FD_RR_OPS=compiled FD_CONTRACT_TIER=1 FD_CONTRACT_VERSION=$$v FD_SOURCE_DIR=$(FD_SOURCES)/$$v \
	    $(FD_PY) -m pytest -q -p no:cacheprovider --timeout=600 tests/fastdeploy_contract $(PYTEST_ARGS); \
	done

# The Paddle trainer tier: fd_routing_replay.trainers.paddle on PaddleFormers' own MoE models
# (CPU).  Its own environment, since PaddleFormers 1.2.0 pins transformers<5.4 and the main
# .venv pins 5.24.0 for the Hugging Face adapter (~2 GB with PaddleFormers' dependencies).
$(PADDLE_STAMP): $(PADDLE_REQS) setup.cfg pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null 2>&1 || { echo "error: $(PYTHON_BOOT) not found"; exit 1; }
	[ -x $(PADDLE_PY) ] || $(PYTHON_BOOT) -m venv $(PADDLE_VENV)
	$(PADDLE_PY) -m pip install -q --upgrade pip setuptools wheel
	$(PADDLE_PY) -m pip install -q -r $(PADDLE_REQS)
	$(PADDLE_PY) -m pip install -q --no-deps -e .
	echo "$(CURDIR)" > "$$($(PADDLE_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fdrr_dev.pth"
	@touch $(PADDLE_STAMP)

paddle-env: $(PADDLE_STAMP)

trainer-paddle: ops paddle-env
	FD_RR_OPS=compiled $(PADDLE_PY) -m pytest -q -p no:cacheprovider --timeout=900 tests/trainers/paddle $(PYTEST_ARGS)

# The runtime wheel as a user installs it: `python -m build` (sdist, and the wheel from it)
# into dist/, both file lists checked, then a fresh .venv-wheel with Paddle and the wheel
# only, and a smoke run outside the checkout: ops built on first use, `fd-rr doctor`, a
# put/get round trip (scripts/wheel_smoke.sh, scripts/wheel_smoke.py).
wheel-smoke:
	PYTHON_BOOT=$(PYTHON_BOOT) PADDLE_PIN="$(PADDLE_PIN)" bash scripts/wheel_smoke.sh

# The live tier: FastDeploy 2.6's real OpenAI API server, engine, scheduler and worker process
# on a CPU, with the plugin and a tiny MoE model (tests/live; compiled kernels stood in by
# tests/fdcpu).  Its extra packages (gunicorn) go to .live-deps/ on top of .venv-fd.
LIVE_DEPS   := .live-deps
LIVE_REQS   := tests/live/requirements.txt
LIVE_STAMP  := $(LIVE_DEPS)/.installed
LIVE_ENV    := FD_RR_OPS=compiled FDRR_LIVE_TIER=1 FD_SOURCE_DIR=$(abspath $(FD_SOURCES))/2.6 \
               PYTHONPATH=$(CURDIR)/$(LIVE_DEPS)

$(LIVE_STAMP): $(FD_STAMP) $(LIVE_REQS)
	rm -rf $(LIVE_DEPS)
	$(FD_PY) -m pip install -q --no-deps --target $(LIVE_DEPS) -r $(LIVE_REQS)
	@touch $(LIVE_STAMP)

live-env: $(LIVE_STAMP)

live: deps ops live-env
	$(LIVE_ENV) $(FD_PY) -m pytest -q -p no:cacheprovider --timeout=900 tests/live $(PYTEST_ARGS)

# Start the rig by hand (a CPU test rig with fake CUDA, not a deployment; docs/fastdeploy.md).
live-serve: ops live-env
	$(LIVE_ENV) $(FD_PY) -m tests.live.serve $(LIVE_ARGS)

clean:
	rm -rf build dist fd_routing_replay/_ops .pytest_cache
