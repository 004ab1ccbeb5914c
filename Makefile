# flaxformer_lite — set-up, tests and the demo. Every target installs what it needs.
#   make demo       train/run the default experiment (see README)
#   make test       the default suite: corpora, browser and SLURM (if they can be had), tests
#   make test-all   the whole suite, runs marked slow included (what CI runs)
#   make test-newest  the default suite on the newest JAX the ranges admit (CI runs it too)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Multi-device code is tested on 8 simulated CPU devices.
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
# Test files run in parallel worker processes (pytest-xdist), a file per worker so that
# its module fixtures are built once: one per core, at most 4 (the suite's tests are
# mostly single-threaded XLA compiles; on 2 cores two workers take ~1.5x less time).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST := $(TEST_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

.PHONY: setup extras prepare browser slurm test test-all test-newest test-slow test-gpu gpu-bundle demo bench lint format clean

setup: $(STAMP)

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "error: flaxformer_lite needs Python >= 3.11 (found $$($(PYTHON) --version)); set PYTHON=python3.11 or newer"; exit 1; }
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing Debian's python3-venv"; rm -rf $(VENV); \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-venv python3-pip && \
	  $(PYTHON) -m venv $(VENV); }

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# The libraries that load an export or make the models an import reads (transformers,
# CTranslate2 and a CPU build of torch: the 'export' extra), for their parity tests;
# Weights & Biases (the 'wandb' extra), whose offline mode the tracker test uses; and
# papermill with a kernel (the 'notebook' extra), which runs the notebook as batch jobs do.
# torch's CPU build is not on PyPI (PyPI's Linux torch is a CUDA build of several GB):
# it comes from a local wheel folder where pip is given one, else from PyTorch's CPU
# index; where neither answers, those tests are skipped, and nothing else changes.
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS := $(VENV)/.extras
extras: $(EXTRAS)
$(EXTRAS): $(STAMP)
	@$(BIN)/python -c 'import torch' 2>/dev/null || \
	  $(BIN)/python -m pip install -q '$(TORCH_CPU)' 2>/dev/null || \
	  $(BIN)/python -m pip install -q '$(TORCH_CPU)' --extra-index-url $(TORCH_CPU_INDEX) || true
	@if $(BIN)/python -c 'import torch' 2>/dev/null; then \
	  $(BIN)/python -m pip install -q -e '.[dev,export,wandb,notebook]'; else \
	  $(BIN)/python -m pip install -q -e '.[dev,wandb,notebook]'; \
	  echo "no CPU build of torch could be installed: the export/import parity tests will be skipped"; fi
	@touch $(EXTRAS)

# The tests read the real corpora too (their parsers on the real packages): set-up
# fetches them, so that a broken data path fails instead of being skipped. The
# browser is tried; where it cannot be installed its one test is skipped.
test: setup extras prepare browser slurm
	@start=$$(date +%s); $(PYTEST) -m "not slow"; status=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s of tests ($(TEST_WORKERS) workers)"; exit $$status

test-all: setup extras prepare browser slurm
	@start=$$(date +%s); $(PYTEST); status=$$?; \
	  echo "make test-all: $$(( $$(date +%s) - start )) s of tests ($(TEST_WORKERS) workers)"; exit $$status

test-slow: test-all  # the former name

# The default suite on the newest jax/flax/optax/orbax the ranges admit, in .venv-newest on
# a Python >= 3.12 (the machine's, else Debian trixie's set up in a folder): JAX 0.11 and
# later need it, so the machine's Python 3.11 never sees them. CI runs it after test-all.
test-newest: prepare
	@TEST_WORKERS=$(TEST_WORKERS) tests/newest.sh

# The tests marked gpu (cuDNN's fused kernel against the project's kernels), on a machine
# with an NVIDIA GPU and a CUDA build of jax in the venv (docs/accelerator.md).
test-gpu: setup
	JAX_PLATFORMS=cuda FLAXFORMER_TEST_OPTIMIZE=1 $(BIN)/python -m pytest -q -m gpu -rs tests/

# Wheels, corpus and peer to carry to an accelerator machine without a package index.
gpu-bundle: prepare
	benchmarks/gpu/bundle.sh

# Debian's chromium, for the test that opens the attention page in a headless browser
# (skipped without it).
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed: the browser test will be skipped"

# Debian's SLURM (controller, node daemon, client) and munge, for the tests that run a
# sweep's jobs on a one-node cluster they start (skipped without them).
slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	  slurm-wlm munge >/dev/null; } || \
	  echo "SLURM could not be installed: the SLURM sweep tests will be skipped"

# Fetch the corpora's Debian packages (apt-get download) unless already extracted.
prepare: setup
	$(BIN)/python -m flaxformer_lite.data.prepare

# The main job: train the default config (ende_small, 15 minutes) on the real corpus,
# average the four checkpoints it writes in the last quarter of the budget, whatever the
# machine's speed (as the paper averages the end of a run; translate/evaluate then use
# the average), and translate the test split: beam 4 with the length penalty and repeat rule
# chosen on the validation split (alpha 1.0, no repeated 3-grams); DEMO_DECODE= gives
# the paper's 0.6.
DEMO_WORKDIR ?= runs/ende_small
DEMO_DECODE ?= --alpha=1.0 --no_repeat_ngram=3
DEMO_AVERAGE ?= 4
demo: prepare
	$(BIN)/python -m flaxformer_lite.main --config=configs/ende_small.py --workdir=$(DEMO_WORKDIR)
	$(BIN)/python -m flaxformer_lite.main average --workdir=$(DEMO_WORKDIR) --num=$(DEMO_AVERAGE)
	$(BIN)/python -m flaxformer_lite.main evaluate --workdir=$(DEMO_WORKDIR) --split=test $(DEMO_DECODE)

# The peer of train_step.py and decode.py: google/flax's examples/wmt from the installed
# flax's source distribution (pip download), cached in benchmarks/.peer (not committed).
bench: prepare
	$(BIN)/python benchmarks/peer.py
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/packing.py
	$(BIN)/python benchmarks/scale.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
