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
EXPERIMENT ?= tiny_cpu

.PHONY: install run test assets assets-small assets-bench clean

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

$(TINY_CKPT)/config.json: $(TASKS)/train.parquet | install
	$(VPY) scripts/make_tiny_checkpoint.py --size tiny --out $(TINY_CKPT) --tasks $(TASKS)

$(SMALL_CKPT)/config.json: $(TASKS)/train.parquet | install
	$(VPY) scripts/make_tiny_checkpoint.py --size small --out $(SMALL_CKPT) --tasks $(TASKS)

assets: $(TASKS)/train.parquet $(TINY_CKPT)/config.json

assets-small: $(SMALL_CKPT)/config.json

$(BENCH)/image/color_train.parquet: | install
	$(VPY) scripts/make_bench_sets.py --out $(BENCH)

# the benchmark workloads (conf/experiment/bench_*.yaml): small checkpoint, tasks, image/video sets
assets-bench: assets assets-small $(BENCH)/image/color_train.parquet

run: install assets
	$(VENV)/bin/rollplex-train +experiment=$(EXPERIMENT)

test: install assets
	$(VPY) -m pytest -q -x --durations=10 tests

clean:
	rm -rf $(ARTIFACTS) outputs
