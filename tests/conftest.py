"""Session fixtures shared by the test suite: synthetic tasks, tiny checkpoints, prompt builders.

Everything here is built once per session, lazily (a fixture is only built when a test asks for
it). The random-weight checkpoints take about a second each; ``warm_ckpt`` runs a short supervised
format warm-up (tens of seconds on two cores) and is meant for end-to-end tests that need a policy
which answers in the ``\\boxed{...}`` format.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from rollplex_train.config import DataConfig
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.synthetic import VisualTaskSpec, generate_visual_tasks
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "rollplex-train"
# The assets of `make assets`, shared with `make run` (built by the fixture below if missing).
EMBEDDED_TASKS = ROOT / "artifacts" / "data" / "visual_tasks"
EMBEDDED_CKPT = ROOT / "artifacts" / "checkpoints" / "tiny-qwen25vl"

# Metrics two runs that train identically may still differ in: measured times, the planner's placement,
# and the bytes of the prefix KV caches the placement put in the decode window.
TELEMETRY = ("timing_s/", "perf/throughput", "planner/", "rollplex/", "cost/", "prefix/")


def trained_metric_keys(record: dict) -> list[str]:
    """The keys of a metrics record that are results of the training (not ``TELEMETRY``, not the
    window's ``memory/<phase>/*_prefix_kv_gib`` rows)."""
    return [k for k in record if not k.startswith(TELEMETRY) and not k.endswith("_prefix_kv_gib")]


# Tasks of the test set and what their media look like (VisualTaskSpec defaults, count_size=112):
#   color: 56x56 image -> image grid (1, 4, 4) -> 4 placeholder tokens
#   count: 112x112 image -> image grid (1, 8, 8) -> 16 placeholder tokens
#   direction: 8-frame 56x56 video -> video grid (2, 4, 4) at the default data.video_fps
MIXED_TASKS = ("color", "count", "direction")

# The models here are tiny: one intra-op thread is as fast as several on an idle machine, and on a
# shared one multi-threaded kernels spin against other processes (10x slower measured on 2 cores).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tasks(tmp_path_factory) -> Path:
    """Directory of the synthetic visual tasks (32 train / 8 val rows per task)."""
    out = tmp_path_factory.mktemp("tiny_tasks")
    # count images at 112 px (4x4 cells of 28 px, not the default 56): a second image size for the tests
    generate_visual_tasks(out, VisualTaskSpec(num_train=32, num_val=8, count_size=112))
    return out


@pytest.fixture(scope="session")
def tiny_ckpt_qwen25(tmp_path_factory) -> Path:
    """A random-weight tiny Qwen2.5-VL checkpoint directory (no warm-up)."""
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen25vl", arch="qwen2_5_vl",
                                   size="tiny", tasks_dir=None)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt_qwen2(tmp_path_factory) -> Path:
    """A random-weight tiny Qwen2-VL checkpoint directory (no warm-up)."""
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2vl", arch="qwen2_vl",
                                   size="tiny", tasks_dir=None)
    return path


@pytest.fixture(scope="session")
def warm_ckpt(tmp_path_factory, tiny_tasks) -> Path:
    """A tiny Qwen2.5-VL checkpoint after a short format warm-up on ``tiny_tasks`` (end-to-end tests)."""
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "warm-qwen25vl", arch="qwen2_5_vl",
                                   size="tiny", tasks_dir=tiny_tasks, warmup_steps=40)
    return path


@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen2_vl"])
def tiny_ckpt(request) -> Path:
    """Both tiny architectures, one after the other (parametrized)."""
    name = "tiny_ckpt_qwen25" if request.param == "qwen2_5_vl" else "tiny_ckpt_qwen2"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt_qwen25):
    """The tiny checkpoints' tokenizer (both architectures share it), loaded as a real one loads."""
    from rollplex_train.models.loading import load_tokenizer

    return load_tokenizer(tiny_ckpt_qwen25)


@pytest.fixture(scope="session")
def train_dataset(tiny_tasks, tiny_tokenizer) -> PromptDataset:
    """The mixed train manifest of ``tiny_tasks`` as a PromptDataset (default DataConfig sizes)."""
    files = str(tiny_tasks / "train.parquet")
    return PromptDataset(DataConfig(train_files=files, val_files=""), tiny_tokenizer, files, "test")


@pytest.fixture(scope="session")
def make_prompts(train_dataset) -> Callable[..., list[PromptSample]]:
    """``make_prompts(tasks=MIXED_TASKS, per_task=1)``: prompts of the given tasks, interleaved.

    ``make_prompts(("color", "count", "direction"))`` gives a 56x56 image, a 112x112 image and a
    video; ``per_task=k`` repeats the pattern with the next k rows of each task (distinct images).
    """
    by_task: dict[str, list[PromptSample]] = {}
    for index in range(len(train_dataset)):
        sample = train_dataset.get(index)
        assert sample is not None, f"synthetic row {index} failed to load"
        by_task.setdefault(sample.task, []).append(sample)

    def make(tasks: Sequence[str] = MIXED_TASKS, per_task: int = 1) -> list[PromptSample]:
        return [by_task[task][k] for k in range(per_task) for task in tasks]

    return make


@pytest.fixture(scope="session")
def mixed_prompts(make_prompts) -> list[PromptSample]:
    """[color 56x56 image, count 112x112 image, direction video]."""
    prompts = make_prompts()
    assert [p.task for p in prompts] == list(MIXED_TASKS)
    return prompts


def scored_batch(rollout, trainer, prompts: list[PromptSample], params):
    """A TrainBatch ready for ``trainer.update_actor``: ``rollout``'s responses to ``prompts``, old
    and reference log-probs from ``trainer``, advantages drawn from a fixed seed."""
    from rollplex_train.runtime.batching import to_train_batch

    responses = rollout.generate(prompts, params, weights_version=0)
    batch = to_train_batch(prompts, responses, rollout.pad_id)
    batch.old_logprobs, _ = trainer.compute_log_probs(batch, "actor")
    batch.ref_logprobs, _ = trainer.compute_log_probs(batch, "ref")
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    return batch


def text_prompt(tokenizer, problem: str, uid: str = "text:0") -> PromptSample:
    """A text-only prompt (no vision inputs) rendered with the chat template."""
    messages = build_messages(problem, num_images=0, num_videos=0)
    return PromptSample(uid=uid, prompt_ids=render_prompt_ids(tokenizer, messages), vision=VisionInputs(),
                        ground_truth="", task="text")


@pytest.fixture(scope="session")
def make_text_prompt(tiny_tokenizer) -> Callable[..., PromptSample]:
    """``make_text_prompt(problem, uid)``: a text-only PromptSample."""
    return lambda problem, uid="text:0": text_prompt(tiny_tokenizer, problem, uid)


class BiasedHead(torch.nn.Module):
    """Wraps an LM head and adds a fixed bias to its logits (tests steer sampling with it)."""

    def __init__(self, head: torch.nn.Module, bias: torch.Tensor):
        super().__init__()
        self.head = head
        self.register_buffer("bias", bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden) + self.bias


@pytest.fixture(scope="session")
def biased_head() -> Callable[..., None]:
    """``biased_head(model, {token_id: bias})``: replace ``model.lm_head`` by a :class:`BiasedHead`."""

    def install(model, biases: dict[int, float]) -> None:
        bias = torch.zeros(model.config.get_text_config().vocab_size)
        for token, value in biases.items():
            bias[token] = value
        model.lm_head = BiasedHead(model.lm_head, bias)

    return install


@pytest.fixture(scope="session")
def embedded_assets():
    """The tasks and warmed-up tiny checkpoint of `make assets` (built once if missing)."""
    from rollplex_train.data.synthetic import generate_visual_tasks
    from rollplex_train.models.tiny import make_tiny_checkpoint

    if not (EMBEDDED_TASKS / "train.parquet").is_file():
        generate_visual_tasks(EMBEDDED_TASKS)
    if not (EMBEDDED_CKPT / "config.json").is_file():
        make_tiny_checkpoint(EMBEDDED_CKPT, tasks_dir=EMBEDDED_TASKS)
    return EMBEDDED_TASKS, EMBEDDED_CKPT


@pytest.fixture(scope="session")
def flagship_assets(embedded_assets):
    """``make assets-flagship``: conf/experiment/flagship_cpu.yaml's image + video set (built once if missing)."""
    from rollplex_train.data.bench_sets import write_flagship_set

    manifest = ROOT / "artifacts" / "data" / "flagship" / "train.parquet"
    if not manifest.is_file():
        write_flagship_set(manifest.parent)
    return manifest


@pytest.fixture(scope="session")
def run_cli():
    """``run_cli(out_dir, *overrides, experiment="tiny_cpu", env=None, timeout=600)``: the
    ``rollplex-train`` console script in a subprocess, writing into ``out_dir``."""

    def run(out_dir: Path, *overrides: str, experiment: str = "tiny_cpu", env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
        cmd = [str(CLI), f"+experiment={experiment}", f"hydra.run.dir={out_dir}", f"trainer.output_dir={out_dir}",
               "trainer.progress_bar=false", *overrides]
        full_env = dict(os.environ, WANDB_MODE="offline", **(env or {}))
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode < 0:  # killed by a signal: the driver could not remove its short Ray dir
            for short in re.findall(r"Ray temp dir (/tmp/rp-ray-\S+)", proc.stdout + proc.stderr):
                shutil.rmtree(short, ignore_errors=True)
        return proc

    return run
