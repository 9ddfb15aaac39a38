# The verbs of the template. `make train` and `make test` set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
# The torch build. Where nvidia-smi finds a driver: the newest of these CUDA builds that it runs (update
# the list with TORCH_VERSION), or the CPU build for a driver older than all of them. Elsewhere: PyPI's
# wheel (CPU, but CUDA on Linux x86-64 from pypi.org). Choose another:
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (CPU only) or .../whl/cu126. Found when a venv is made.
TORCH_CUDA_BUILDS ?= 126 128 130
TORCH_INDEX ?= $(shell bash scripts/torch_index.sh $(TORCH_CUDA_BUILDS))
# The exact versions CI passed with (`make lock` refreshes them); CONSTRAINTS= resolves freely.
CONSTRAINTS ?= constraints.txt
LOCK_VENV ?= .venv-lock
BIN := $(VENV)/bin
DATA_DIR ?= data/stdlib
PAIRS_DIR ?= data/stdlib_pairs
CODE_DIR ?= data/stdlib_code
EXPERIMENT ?= clm_modern
ARGS ?=
CKPT ?=

.DEFAULT_GOAL := help
.PHONY: help install lock data tokenizer train sweep eval info test test-full lint format chaos clean clean-logs

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: $(VENV)/.installed ## Create .venv: torch pinned first (CUDA build where there is a driver), then the package with every extra and the dev tools

# A venv in $(1): torch first, then the package with every extra and the dev tools; $(2) is pip's
# constraint option, if any.
define new_venv
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "Python 3.11 or later is needed, $(PYTHON) is $$($(PYTHON) --version 2>&1): pass PYTHON=python3.11"; exit 2; }
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet --upgrade pip
	index="$(TORCH_INDEX)"; $(1)/bin/pip install --quiet torch==$(TORCH_VERSION) $${index:+--index-url "$$index"}
	$(1)/bin/pip install --quiet $(2) -e ".[all,dev]"
endef

# .installed names the constraints it installed (tests/test_install.py compares the versions with them).
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(call new_venv,$(VENV),$(if $(CONSTRAINTS),--constraint $(CONSTRAINTS)))
	@$(BIN)/python -c "import torch; print('installed torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)')"
	echo "$(CONSTRAINTS)" > $@

# torch, its CUDA libraries and this package are left out: TORCH_VERSION and the build choose them.
lock: ## Refresh constraints.txt: the versions a fresh install of every extra resolves to now (then make test)
	rm -rf $(LOCK_VENV)
	$(call new_venv,$(LOCK_VENV))
	set -o pipefail; { echo "# The versions make install installs (make lock wrote them; make test checks them). Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())')."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)=='; } > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	rm -rf $(LOCK_VENV)

data: install $(DATA_DIR)/manifest.json $(PAIRS_DIR)/tokenizer.json $(CODE_DIR)/manifest.json ## Build the default shards: stdlib source text, its (docstring, code) pairs, and the text split as the pairs

$(DATA_DIR)/manifest.json: | $(VENV)/.installed
	$(BIN)/pretrain-data build --source stdlib --out $(DATA_DIR)

# More validation pairs than the text default: retrieval is scored against pools of 1000.
$(PAIRS_DIR)/manifest.json: | $(VENV)/.installed
	$(BIN)/pretrain-data build --pairs --source stdlib --validation-fraction 0.2 --out $(PAIRS_DIR)

# The source text split as the pairs are (a file trains in both builds or in neither; either may leave out a
# validation file as training text): the masked-LM stage of experiment=contrastive_modern reads no validation pair's code.
$(CODE_DIR)/manifest.json: | $(VENV)/.installed
	$(BIN)/pretrain-data build --source stdlib --validation-fraction 0.2 --out $(CODE_DIR)

# The BPE that experiment=contrastive_tiny reads (tokenizer=bpe).
$(PAIRS_DIR)/tokenizer.json: $(PAIRS_DIR)/manifest.json
	$(BIN)/pretrain-data tokenizer --data $(PAIRS_DIR) --vocab-size 1024

tokenizer: data ## Train a BPE tokenizer on the default shards (then use tokenizer=bpe)
	$(BIN)/pretrain-data tokenizer --data $(DATA_DIR) $(ARGS)

train: install data ## Train (EXPERIMENT=clm_modern, clm_tiny, mlm_modern, mlm_tiny, contrastive_tiny, contrastive_modern_mlm then contrastive_modern; gpt2_124m, bert_base, contrastive_code need ARGS="data.dir=...")
	$(BIN)/pretrain experiment=$(EXPERIMENT) $(ARGS)

sweep: install data ## A Hydra multirun, each job in logs/train/multiruns/<sweep>/<job>: make sweep ARGS="model.optimizer.lr_scale=0.5,1,2"
	$(BIN)/pretrain -m experiment=$(EXPERIMENT) $(ARGS)

eval: install ## Evaluate a checkpoint: make eval CKPT=path/to/last.ckpt [ARGS="..."]
	@test -n "$(CKPT)" || { echo "usage: make eval CKPT=logs/train/runs/<run>/checkpoints/last.ckpt"; exit 2; }
	$(BIN)/pretrain-eval ckpt_path=$(CKPT) $(ARGS)

info: install ## What produced a checkpoint: make info CKPT=path/to/last.ckpt [ARGS="--config"]
	@test -n "$(CKPT)" || { echo "usage: make info CKPT=logs/train/runs/<run>/checkpoints/last.ckpt"; exit 2; }
	$(BIN)/pretrain-info $(CKPT) $(ARGS)

test: install ## Run the core's fast tests (tests/README.md)
	$(BIN)/pytest -n auto --dist worksteal -m "not slow and not distributed and not extras" $(ARGS)

test-full: install ## Run every test: the core's slow and distributed ones, and the extras'
	$(BIN)/pytest -n auto --dist worksteal $(ARGS)

lint: install ## Check style, formatting and types
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy

format: install ## Fix style and formatting
	$(BIN)/ruff check --fix src tests scripts
	$(BIN)/ruff format src tests scripts

chaos: install data ## Kill a run with SIGKILL at random moments, restart it, compare with an uninterrupted run
	$(BIN)/python scripts/chaos.py --data $(DATA_DIR) $(ARGS)

clean-logs: ## Delete run outputs under logs/, but the model registry (logs/registry/)
	find logs -mindepth 1 -maxdepth 1 ! -name .gitkeep ! -name registry -exec rm -rf {} +

clean: clean-logs ## Delete the venv, built data and caches
	rm -rf $(VENV) $(LOCK_VENV) data .pytest_cache .ruff_cache .mypy_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# The extras' verbs: one file each, deleted with its extra (README, "What to delete").
-include make/*.mk
