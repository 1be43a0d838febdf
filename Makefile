# rollplex-train: `make run` trains the embedded default, `make test` runs the suite.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
  PIP_CONSTRAINT_FLAGS :=
else
  PIP_CONSTRAINT_FLAGS := -c constraints-cpu.txt
endif
ARTIFACTS := artifacts
TINY_CKPT := $(ARTIFACTS)/checkpoints/tiny-qwen25vl
SMALL_CKPT := $(ARTIFACTS)/checkpoints/small-qwen25vl
TASKS := $(ARTIFACTS)/data/visual_tasks
BENCH := $(ARTIFACTS)/data/bench
FLAGSHIP := $(ARTIFACTS)/data/flagship
EXPERIMENT ?= tiny_cpu

# The lowest transformers pyproject.toml allows (the H200 machine's): the model-path tests run on it too,
# from an overlay directory first on PYTHONPATH (the venv keeps the current release). transformers 5.17
# needs huggingface_hub < 2, so the overlay holds that too (1.33.0, the H200 machine's).
TRANSFORMERS_FLOOR := 5.17.0
FLOOR_HUB := 1.33.0
FLOOR_DIR := build/transformers-$(TRANSFORMERS_FLOOR)
FLOOR_TESTS := tests/test_models_prefix.py tests/test_models_sequence.py tests/test_models_rope.py \
	tests/test_models_logprobs.py tests/test_rollout_builtin.py tests/test_rollout_decoder.py tests/test_device_placement.py \
	tests/test_rollout_shared_prefix.py tests/test_rollout_tp.py
# What scripts/gpu_run.sh carries to the H200 machine (Python 3.12, x86_64): megatron-core (not installed there),
# for Python 3.12 and for this machine's python3 (the dry run); a transformers wheel only if the floor rises
# above the H200 machine's 5.17 (gpu_run.sh installs it then).
GPU_WHEELS := build/gpu-wheels
# A venv holding only what the H200 machine has (torch, transformers 5.17, pillow, numpy, jinja2, nvidia-ml-py;
# CPU torch 2.13.0 here): `make gpu-dry-run` runs scripts/gpu_run.sh --dry-run in it.
GPU_VENV := build/gpu-venv
H200_TRANSFORMERS := 5.17.0

.PHONY: install run test test-transformers-floor gpu-wheels gpu-dry-run assets assets-small assets-bench assets-flagship clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifneq ($(HAS_GPU),1)
	$(PIP) install -q torch==2.13.0
endif
	$(PIP) install -q $(PIP_CONSTRAINT_FLAGS) -e '.[dev,megatron,envs,submitit]'
	touch $@

install: $(VENV)/.installed

$(TASKS)/train.parquet: | install
	$(VPY) scripts/make_visual_tasks.py --out $(TASKS)

$(TINY_CKPT)/config.json: $(TASKS)/train.parquet src/rollplex_train/models/tiny.py src/rollplex_train/models/warmup.py | install
	$(VPY) scripts/make_tiny_checkpoint.py --size tiny --out $(TINY_CKPT) --tasks $(TASKS)

$(SMALL_CKPT)/config.json: $(TASKS)/train.parquet | install
	$(VPY) scripts/make_tiny_checkpoint.py --size small --out $(SMALL_CKPT) --tasks $(TASKS)

assets: $(TASKS)/train.parquet $(TINY_CKPT)/config.json

assets-small: $(SMALL_CKPT)/config.json

$(BENCH)/image/color_train.parquet: | install
	$(VPY) scripts/make_bench_sets.py --out $(BENCH)

# the benchmark workloads (conf/experiment/bench_*.yaml): small checkpoint, tasks, image/video sets
assets-bench: assets assets-small $(BENCH)/image/color_train.parquet

$(FLAGSHIP)/train.parquet: | install
	$(VPY) scripts/make_bench_sets.py --flagship --out $(FLAGSHIP)

# conf/experiment/flagship_cpu.yaml (scripts/check_flagship.py): the tiny checkpoint, 58-token image/video prompts
assets-flagship: assets $(FLAGSHIP)/train.parquet

run: install assets
	$(VENV)/bin/rollplex-train +experiment=$(EXPERIMENT)

test: install assets
	$(VPY) -m pytest -q -x --durations=10 tests

$(FLOOR_DIR)/.installed: | install
	$(PIP) install -q --no-deps --target $(FLOOR_DIR) transformers==$(TRANSFORMERS_FLOOR) huggingface_hub==$(FLOOR_HUB)
	touch $@

# the model paths on the lowest supported transformers (CI runs it after `make test`)
test-transformers-floor: install assets $(FLOOR_DIR)/.installed
	PYTHONPATH=$(FLOOR_DIR) $(VPY) -c 'import transformers as t; assert t.__version__ == "$(TRANSFORMERS_FLOOR)", t.__file__'
	PYTHONPATH=$(FLOOR_DIR) $(VPY) -m pytest -q -x $(FLOOR_TESTS)

# wheels for scripts/gpu_run.sh (downloaded with network, carried to the GPU machine; under 64 MiB)
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) 'megatron-core==0.16.1'
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS) 'megatron-core==0.16.1'
	du -sh $(GPU_WHEELS)

$(GPU_VENV)/.installed: constraints-cpu.txt
	rm -rf $(GPU_VENV) && $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q $(PIP_CONSTRAINT_FLAGS) torch==2.13.0 transformers==$(H200_TRANSFORMERS) \
	  huggingface_hub==$(FLOOR_HUB) pillow numpy jinja2 nvidia-ml-py
	touch $@

# scripts/gpu_run.sh's flow on CPU, tiny sizes, in the GPU-machine-shaped venv (CI runs it after `make test`)
gpu-dry-run: $(GPU_VENV)/.installed gpu-wheels
	PYTHON=$(GPU_VENV)/bin/python bash scripts/gpu_run.sh --dry-run build/gpu-run-dry

clean:
	rm -rf $(ARTIFACTS) outputs
