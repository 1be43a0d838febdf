"""Structured configuration for rollplex-train.

Every section is a keyword-only dataclass registered with Hydra's ConfigStore, so a misspelt key in
YAML or on the command line is an error (OmegaConf struct mode). Each dataclass checks its own
values in ``__post_init__`` and raises ``ValueError`` naming the offending key. Sections never copy
values between each other: the few values derived from other sections or from what the chosen
engines can do are resolved in one step before a run, ``rollplex_train.resolve.resolve`` (the
trainer calls it), which logs each one and asks the engine registries what an engine can do
(never its name). This module imports nothing above it: the engines import their config sections.

Names follow verl/EasyR1 where a counterpart exists (``rollout.n``, ``actor.ppo_mini_batch_size``,
``algorithm.adv_estimator``, ``actor.clip_ratio_low``/``clip_ratio_high``, ``actor.loss_agg_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # Hydra/OmegaConf are imported where used: the in-process GPU benchmark runs without them
    from omegaconf import DictConfig

from rollplex_train.hardware import GpuConfig, TimelineConfig

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
SCHEDULES = ("serial", "disaggregated", "rollplex")
DTYPES = ("float32", "bfloat16", "float16")


def _check_choice(section: str, key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{key}={value!r}: expected one of {list(choices)}")


def _check_positive(section: str, key: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{section}.{key}={value!r}: expected a number {bound}")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy checkpoint: a local Hugging Face directory (Qwen2-VL / Qwen2.5-VL)."""

    path: str = "artifacts/checkpoints/tiny-qwen25vl"
    """Local checkpoint directory loaded with ``from_pretrained`` (never a hub id: no network)."""
    dtype: str = "float32"
    """Parameter dtype of actor, reference and rollout weights."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: ``sdpa`` or ``eager``."""
    compute_dtype: str = "float32"
    """Forward-pass precision: ``float32`` (the weights' dtype) or ``bfloat16`` (fp32 master weights and
    optimizer states, forwards under ``torch.autocast(bfloat16)``; needs ``dtype=float32``)."""
    freeze_vision_tower: bool = False
    """Keep the vision encoder (and its merger) frozen in the actor update."""
    shared_prefix: bool = False
    """Score/train the prompt prefix once per group (prefix/suffix decomposition)."""
    hf_config: Optional[str] = None
    """A HF ``config.json`` describing the architecture, for ``rollplex-plan`` when the checkpoint
    in ``path`` is not on this machine (None: read ``path/config.json``)."""

    def __post_init__(self) -> None:
        _check_choice("model", "dtype", self.dtype, DTYPES)
        _check_choice("model", "attn_implementation", self.attn_implementation, ("sdpa", "eager"))
        _check_choice("model", "compute_dtype", self.compute_dtype, ("float32", "bfloat16"))
        if self.compute_dtype == "bfloat16" and self.dtype != "float32":
            raise ValueError(f"model.compute_dtype=bfloat16 autocasts fp32 master weights: it needs "
                             f"model.dtype=float32 (got {self.dtype!r})")


@dataclass(kw_only=True)
class CurriculumStage:
    """One stage of ``data.curriculum``: for ``steps`` training steps, rollout batches are drawn
    only from the train rows whose task (the ``task`` column, else ``data_source``, else
    ``default``) is one of ``tasks``."""

    steps: int
    tasks: list[str]


@dataclass(kw_only=True)
class DataConfig:
    """Prompt datasets in the EasyR1 schema (``problem``, ``answer``, ``images``, ``videos``)."""

    train_files: str = "artifacts/data/visual_tasks/train.parquet"
    """Parquet or jsonl file(s) for training; several are separated by commas."""
    val_files: str = "artifacts/data/visual_tasks/val.parquet"
    """Parquet or jsonl file(s) for validation; empty string disables validation."""
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    system_prompt: Optional[str] = None
    """System message of the chat template (None: the template's default)."""
    format_prompt: Optional[str] = None
    """Path to a Jinja template rendering ``content`` (the problem) into the user message."""
    max_prompt_length: int = 512
    """Longest prompt in tokens after vision placeholders are expanded; longer samples are skipped."""
    rollout_batch_size: int = 8
    """Prompts per training step (verl ``data.train_batch_size``)."""
    val_batch_size: int = 64
    """Prompts per validation generate call."""
    max_val_samples: int = -1
    """Cap on validation prompts (-1: all)."""
    shuffle: bool = True
    seed: int = 1
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    """Image resize bounds in pixels (Qwen2-VL ``smart_resize``)."""
    video_fps: float = 2.0
    video_max_frames: int = 8
    video_min_pixels: int = 56 * 56
    video_max_pixels: int = 56 * 56
    curriculum: list[CurriculumStage] = field(default_factory=list)
    """Stages run in order before the plain shuffled epochs over every row (empty: no stages), e.g.
    ``[{steps: 120, tasks: [direction]}]``: the first 120 steps draw direction prompts only."""
    resume_on_changed_data: bool = False
    """Resuming a checkpoint saved on other train data (another file fingerprint): false refuses to
    start; true warns and restarts the checkpoint's epoch from its beginning on the new data."""

    def __post_init__(self) -> None:
        if not self.train_files:
            raise ValueError("data.train_files is empty: expected a parquet/jsonl path")
        for key in ("max_prompt_length", "rollout_batch_size", "val_batch_size", "video_max_frames"):
            _check_positive("data", key, getattr(self, key))
        _check_positive("data", "video_fps", self.video_fps)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels={self.min_pixels} > data.max_pixels={self.max_pixels}")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"data.video_min_pixels={self.video_min_pixels} > data.video_max_pixels={self.video_max_pixels}"
            )
        for i, stage in enumerate(self.curriculum):
            if stage.steps <= 0 or not stage.tasks:
                raise ValueError(f"data.curriculum[{i}]: expected steps > 0 and a non-empty tasks list, got "
                                 f"steps={stage.steps} tasks={list(stage.tasks)}")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and KL regularisation."""

    adv_estimator: str = "grpo"
    """Registered estimator: ``grpo``, ``drgrpo``, ``rloo``, ``reinforce_plus_plus``."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred scores by the group std (Shao et al. 2024, DeepSeekMath §4.1.2)."""
    gamma: float = 1.0
    """Discount for REINFORCE++ returns."""
    kl_estimator: str = "low_var_kl"
    """KL(actor || reference) per token: ``k1``, ``k2``, ``k3``, ``low_var_kl`` (Schulman 2020)."""
    use_kl_loss: bool = True
    """Add ``kl_coef * KL`` to the actor loss (GRPO style)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL`` from the token-level reward (PPO/REINFORCE++ style)."""
    kl_coef: float = 0.01

    def __post_init__(self) -> None:
        _check_choice("algorithm", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_positive("algorithm", "kl_coef", self.kl_coef, allow_zero=True)
        if self.use_kl_loss and self.use_kl_in_reward:
            raise ValueError("algorithm.use_kl_loss and algorithm.use_kl_in_reward are both true: pick one")

    @property
    def needs_reference(self) -> bool:
        """True when reference log-probs must be computed this run."""
        return (self.use_kl_loss or self.use_kl_in_reward) and self.kl_coef > 0


@dataclass(kw_only=True)
class RolloutConfig:
    """Response sampling by the rollout engine."""

    name: str = "builtin"
    """Registered engine: ``builtin`` (transformers, CPU/GPU) or ``sglang`` (GPU, the ``sglang`` extra)."""
    n: int = 8
    """Responses per prompt (the GRPO group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    """Stop strings (in addition to EOS); the stop string is kept in the response."""
    ignore_eos: bool = False
    """Always decode ``max_new_tokens`` tokens (benchmarks)."""
    max_batch_size: int = 256
    """Most sequences decoded together; larger requests are split."""
    tensor_parallel_size: int = 1
    """TP degree of each rollout engine (SGLang ``tp_size``; the built-in engine runs one process per
    device over a gloo/NCCL group, ``rollout/tensor_parallel.py``)."""
    share_prompt_kv: bool = False
    """Built-in engine: decode a prompt's n samples over one copy of its KV cache instead of n
    (``rollout/shared_prefix.py``; same tokens on the tests, log-probs rounded differently, so off by
    default; needs the fused decode step: CPU, float32, SDPA). SGLang's radix cache always keeps one."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0: greedy)."""
    seed: int = 1234

    def __post_init__(self) -> None:
        _check_positive("rollout", "n", self.n)
        _check_positive("rollout", "max_new_tokens", self.max_new_tokens)
        _check_positive("rollout", "temperature", self.temperature, allow_zero=True)
        _check_positive("rollout", "val_temperature", self.val_temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p}: expected 0 < top_p <= 1")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k}: expected -1 (off) or a positive integer")
        _check_positive("rollout", "tensor_parallel_size", self.tensor_parallel_size)


@dataclass(kw_only=True)
class ActorConfig:
    """Actor update (and the frozen reference held by the same training worker)."""

    backend: str = "torch"
    """Registered training engine: ``torch`` (CPU/GPU) or ``megatron`` (megatron-core, TP actor and
    reference; needs the ``megatron`` extra; ``docs/megatron.md``)."""
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many optimizer steps."""
    lr_scheduler: str = "constant"
    """After the warm-up: ``constant``, or ``cosine`` (half a cosine from ``lr`` down to
    ``min_lr_ratio * lr`` over ``lr_decay_steps``; verl's ``warmup_style``)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule, as a fraction of ``lr``."""
    lr_decay_steps: int = -1
    """Optimizer steps from the end of the warm-up to the floor; -1: the rest of the run
    (``trainer.total_steps`` x mini-batches per step x ``ppo_epochs`` - warm-up)."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this value (<= 0 disables clipping)."""
    ppo_mini_batch_size: int = -1
    """Prompts per optimizer step (each with ``rollout.n`` responses); -1: the whole rollout batch."""
    micro_batch_size: int = 16
    """Responses per forward/backward (gradient accumulation inside a mini-batch). With
    ``model.shared_prefix=true`` a micro-batch is one group instead (its prefix pass and its
    ``rollout.n`` suffixes), so that results do not depend on how a schedule places the passes."""
    ppo_epochs: int = 1
    recompute_old_log_prob: bool = False
    """Always run the separate old-policy pass (verl's behaviour). False: the first mini-batch's old
    log-probs are the actor's own forward before its first optimizer step (``old = logp.detach()``,
    as TRL's GRPOTrainer does), since the weights are provably the same; only the other mini-batches
    get the separate pass (``runtime/old_policy.py``)."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """PPO ratio clip range [1 - low, 1 + high] (DAPO's clip-higher when high > low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip PPO (Ye et al. 2020; verl ``actor.clip_ratio_c``): the loss of a token with a negative
    advantage A is at most ``-A * clip_ratio_c``; must be > 1."""
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    tensor_parallel_size: int = 1
    """TP degree of the actor/reference (Megatron ``tensor_model_parallel_size``)."""
    pipeline_parallel_size: int = 1
    """PP degree of the actor/reference (Megatron ``pipeline_model_parallel_size``)."""

    def __post_init__(self) -> None:
        _check_positive("actor", "lr", self.lr, allow_zero=True)
        _check_positive("actor", "micro_batch_size", self.micro_batch_size)
        _check_positive("actor", "ppo_epochs", self.ppo_epochs)
        _check_positive("actor", "clip_ratio_low", self.clip_ratio_low, allow_zero=True)
        _check_positive("actor", "clip_ratio_high", self.clip_ratio_high, allow_zero=True)
        if not self.clip_ratio_c > 1.0:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c}: expected a number > 1 (dual-clip PPO)")
        _check_choice("actor", "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice("actor", "lr_scheduler", self.lr_scheduler, ("constant", "cosine"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"actor.min_lr_ratio={self.min_lr_ratio}: expected a number in [0, 1]")
        if self.lr_decay_steps == 0 or self.lr_decay_steps < -1:
            raise ValueError(f"actor.lr_decay_steps={self.lr_decay_steps}: expected -1 or > 0")
        _check_positive("actor", "tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("actor", "pipeline_parallel_size", self.pipeline_parallel_size)
        if len(self.betas) != 2:
            raise ValueError(f"actor.betas={self.betas}: expected two numbers")
        if self.ppo_mini_batch_size == 0 or self.ppo_mini_batch_size < -1:
            raise ValueError(f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size}: expected -1 or > 0")


@dataclass(kw_only=True)
class RewardConfig:
    """Reward function: a registered rule name or ``path/to/file.py:fn``."""

    function: str = "auto"
    """``auto`` (number or choice by the answer), ``choice``, ``number``, ``math``, ``format``, or
    ``path/to/file.py:fn`` with ``fn(response: str, ground_truth: str, **kwargs) -> float``."""
    format_weight: float = 0.0
    """Score = (1 - w) * accuracy + w * format (EasyR1's r1v reward)."""
    on_failure: str = "exclude"
    """A response whose reward function raised or returned None/NaN/a non-number: ``exclude`` (advantage
    0, left out of its group's mean and std) or ``zero`` (scored 0 and kept in the group's baseline,
    i.e. trained as a wrong answer). Counted in ``reward/failed`` either way."""
    max_failed_frac: float = 1.0
    """Stop the run with a one-line error when this fraction of a step's samples failed to score
    (the function raised or returned no finite number); 1.0: only when every sample failed."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"reward.format_weight={self.format_weight}: expected 0 <= w <= 1")
        _check_choice("reward", "on_failure", self.on_failure, ("exclude", "zero"))
        if not 0.0 < self.max_failed_frac <= 1.0:
            raise ValueError(f"reward.max_failed_frac={self.max_failed_frac}: expected 0 < f <= 1")


@dataclass(kw_only=True)
class ClusterConfig:
    """The devices of the run and the Ray cluster that holds the colocated workers.

    The devices are ``nnodes x devices_per_node``; on each one a training rank and (a share of) a
    rollout engine sit on one placement-group bundle. The degrees laid over them are read from one
    :class:`rollplex_train.parallel.ParallelLayout`.
    """

    device: str = "cpu"
    """``cpu`` (a device is ``threads_per_device`` cores) or ``cuda`` (a device is one GPU)."""
    nnodes: int = 1
    """Nodes of the run."""
    devices_per_node: int = 1
    """Devices used on each node (GPUs, or CPU core sets)."""
    threads_per_device: Optional[int] = None
    """CPU runs: torch threads of a device's workers (None: the node's cores / devices_per_node)."""
    executor: str = "ray"
    """``ray`` (one actor per worker, on a placement group) or ``inprocess`` (the same worker groups
    with the engines in the driver process: one device, no Ray; tests and GPU benchmarks)."""
    address: Optional[str] = None
    """Existing Ray cluster (``auto`` or ``host:port``); None starts a local one."""
    num_cpus: Optional[int] = None
    """CPUs given to a local Ray cluster (None: all cores)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (the residency planner's device budget)."""
    object_store_memory_bytes: int = 200 * 1024**2
    device_share: str = "cores"
    """How colocated workers share a device: ``cores`` (CPU threads; GPU time-sliced), ``streams`` or
    ``green`` (GPU, in one process), ``mps`` (GPU, across processes), or ``auto`` (the best the
    machine has: ``device_share.resolve_share``); see ``device_share.py``."""

    def __post_init__(self) -> None:
        from rollplex_train.parallel import DEVICES

        _check_choice("cluster", "device", self.device, DEVICES)
        _check_choice("cluster", "executor", self.executor, ("ray", "inprocess"))
        from rollplex_train.device_share import check_config

        check_config(self.device_share, self.device, self.executor)
        for key in ("nnodes", "devices_per_node"):
            _check_positive("cluster", key, getattr(self, key))
        for key in ("num_cpus", "threads_per_device"):
            if getattr(self, key) is not None:
                _check_positive("cluster", key, getattr(self, key))
        if self.executor == "inprocess" and (self.nnodes * self.devices_per_node != 1 or self.address):
            raise ValueError(f"cluster.executor=inprocess runs one device in the driver: it needs cluster.nnodes=1, "
                             f"cluster.devices_per_node=1 and no cluster.address (got {self.nnodes} x "
                             f"{self.devices_per_node}, address={self.address!r})")

    def resolved_threads_per_device(self) -> int:
        """``threads_per_device``, or this node's cores (``num_cpus`` or all) split over its devices."""
        import os

        if self.threads_per_device is not None:
            return self.threads_per_device
        return max(1, (self.num_cpus or os.cpu_count() or 1) // self.devices_per_node)


@dataclass(kw_only=True)
class MemoryConfig:
    """Phase-aware residency of tensor groups (``memory/``)."""

    budget_gib: Optional[float] = None
    """Device bytes the residency plan may use per GPU, in GiB (None: ``cluster.gpu_memory_gib``)."""
    train_strategy: str = "megatron"
    """How actor/reference states are laid out: ``megatron`` (TP/PP shards, fp32 main grads per
    model-parallel rank) or ``fsdp`` (ZeRO-3: everything sharded over all ranks)."""
    distributed_optimizer: bool = True
    """Megatron: shard fp32 master weights and Adam states over the data-parallel group."""
    activation_recompute: str = "full"
    """Activation checkpointing of the actor: ``none``, ``selective`` (attention core) or ``full``
    (keep only each layer's input; Korthikanti et al. 2022)."""
    pinned_host_offload: bool = True
    """Let the residency plan move groups to pinned host memory between their uses (False: a group
    stays on the device from its first to its last use)."""
    reserved_gib: float = 3.5
    """Device memory per GPU the plan holds for what torch's allocator does not see, in GiB: two CUDA
    contexts (train worker and rollout engine, ~0.75 GiB each: 781 MB measured in pytorch/pytorch#34323)
    and three NCCL communicators (train TP, train DP, rollout TP; 544-688 MB each measured on A100 in
    NVIDIA/nccl#964). A floor: more NVLink channels use more (NVIDIA/nccl#986); measure on the target."""
    fused_kernels: bool = True
    """Activations as fused kernels keep them (Megatron/TransformerEngine RMSNorm, RoPE, attention);
    False: as eager transformers modules do (the torch engine, HF-model FSDP), which keep more."""
    offload_optimizer: bool = False
    """Keep the actor's optimizer states in host memory whenever the step does not step the
    optimizer: the residency plan moves them off the device after the update and back for the next
    one, even where the device could hold them (``memory/executor.py``). Without it the plan moves
    them only when the budget needs it. On CPU the same mechanism runs and only moves bytes."""

    def __post_init__(self) -> None:
        if self.budget_gib is not None:
            _check_positive("memory", "budget_gib", self.budget_gib)
        _check_choice("memory", "train_strategy", self.train_strategy, ("megatron", "fsdp"))
        _check_choice("memory", "activation_recompute", self.activation_recompute, ("none", "selective", "full"))
        _check_positive("memory", "reserved_gib", self.reserved_gib, allow_zero=True)
        if self.offload_optimizer and not self.pinned_host_offload:
            raise ValueError("memory.offload_optimizer=true moves the optimizer states to host memory, which "
                             "memory.pinned_host_offload=false forbids: set one of them the other way")


@dataclass(kw_only=True)
class SharingConfig:
    """Weight sharing between the training and rollout TP layouts (``sharing/``)."""

    enabled: bool = True
    """Hand rollout weights over as views of the training shards (IPC handles) where layouts allow."""
    split_qkv: bool = False
    """Rollout side keeps q, k, v as three tensors grouped by KV head, ``(kv groups of the rank, rows
    per group, hidden)``, computed with one batched matmul each: with it every qkv shard of a
    Megatron training rank (per-group interleaved) is a (strided) view. False: SGLang's fused
    ``[q_i; k_i; v_i]``, a local rebuild whenever a rank holds more than one KV group."""
    split_gate_up: bool = False
    """Rollout side keeps ``gate_proj`` and ``up_proj`` as two tensors: with it every r >= t MLP shard
    is a view of the training rank's ``[gate; up]`` fc1. False: SGLang's merged ``gate_up_proj``,
    a local rebuild when r > t."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """How the phases of a step are placed in time."""

    name: str = "serial"
    prefix_memory_gib: Optional[float] = None
    """rollplex: most GiB of prefix state (KV caches, actor prefix activations) the planner may keep
    alive from the decode window to the suffix passes, the actor prefixes encoded before decode for
    ``prefill_from_actor`` included (None: no limit)."""
    stream_suffix: bool = True
    """rollplex: score the suffixes of groups whose responses are all finished while other groups
    still decode (the decode tail), on the planner's split of the device."""
    prefill_from_actor: str = "auto"
    """rollplex: encode the first mini-batch's actor prefixes (with their graph) before decode and
    hand their KV caches to the rollout engine, which then skips its own prefill of those prompts
    (one vision + prompt pass per group fewer). ``auto``: where it can run (``schedule.name=rollplex``,
    a rollout engine that accepts prefix states (``builtin``), a backend that exports whole ones
    (``torch``), and the states fit ``prefix_memory_gib``; resolved to ``false`` elsewhere);
    ``true``: required (a config error where it cannot run, a run error when the states outgrow the
    budget); ``false``: off. The states' bytes per token are measured by the first step, so the
    budget applies from the second step on."""

    suffix_chunk_tokens: int = 0
    """rollplex under ``rollout.ignore_eos`` with a reference: the planner may score the reference
    suffixes in chunks of this many response tokens while decode goes on (the decode window's
    train share), with the one-call pass's numbers (``models.prefix.ChunkedSuffix``); it does when
    its cost model predicts a gain over the margin. Needs a rollout engine that reports decode
    progress (``builtin``), a backend that scores chunks (``torch``) and ``model.shared_prefix``;
    elsewhere it is resolved to 0 (off). 0: off; otherwise at least 4 (the rollplex schedule's
    config sets 32; docs/benchmarks.md, "Reference suffix chunks")."""

    def __post_init__(self) -> None:
        _check_choice("schedule", "name", self.name, SCHEDULES)
        if self.suffix_chunk_tokens != 0 and self.suffix_chunk_tokens < 4:
            raise ValueError(f"schedule.suffix_chunk_tokens={self.suffix_chunk_tokens}: expected 0 (off) or at least 4")
        self.prefill_from_actor = str(self.prefill_from_actor).lower()  # Hydra reads `true` as a bool
        _check_choice("schedule", "prefill_from_actor", self.prefill_from_actor, ("auto", "true", "false"))
        if self.prefix_memory_gib is not None:
            _check_positive("schedule", "prefix_memory_gib", self.prefix_memory_gib, allow_zero=True)


@dataclass(kw_only=True)
class EnvConfig:
    """A multi-turn environment (``envs/``) and how a rollout drives it (``rollout/multiturn.py``).
    ``name=""`` (the default): no environment, single-turn prompts from ``data``."""

    name: str = ""
    """``frozenlake``, ``minigrid:<MiniGrid or BabyAI id>`` or ``path/to/file.py:Class`` (a
    ``envs.VisionEnv`` or a VAGEN ``GymImageEnv``); built-ins need the ``envs`` extra."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The environment's own options (frozenlake: ``desc``, ``size``, ``p``, ``is_slippery``;
    minigrid: ``env_kwargs``; a user class: its constructor's keywords)."""
    max_turns: int = 5
    """Most turns (model answers) per trajectory; an episode still running then is truncated."""
    max_context_tokens: int = 4096
    """Most tokens of a turn's engine input plus ``rollout.max_new_tokens``; a trajectory whose next
    turn would exceed it ends (``token_budget``)."""
    context: str = "full"
    """``full``: every turn sees the whole history (images accumulate); ``window:<k>``: the system
    message and the last k observations with the answers between them."""
    max_actions_per_turn: Optional[int] = None
    """Built-ins: most actions one answer may take (None: 3)."""
    format_penalty: Optional[float] = None
    """Built-ins: subtracted from the reward of a turn whose answer is unparsable or names an unknown
    action (None: 0.1); such turns are counted."""
    answer_format: Optional[str] = None
    """Built-ins: ``tag`` (``<answer>Left, Down</answer>``, VAGEN's) or ``words`` (None: tag)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    """Pixel budget of a frame (area bounds): frames are resized to it (Qwen2-VL ``smart_resize``)."""
    num_workers: int = 4
    """Threads stepping environments while other trajectories decode."""
    step_timeout_s: float = 60.0
    """Most seconds one ``reset``/``step`` may run; past it the call counts as an environment error."""
    on_error: str = "truncate"
    """An environment that raises, breaks the observation contract or times out in ``step``:
    ``truncate`` ends that trajectory (``env_error``, counted and logged) or ``raise`` stops the
    rollout with a one-line error. Errors in ``reset`` always stop it."""

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_context_tokens", "min_pixels", "max_pixels", "num_workers", "step_timeout_s"):
            _check_positive("env", key, getattr(self, key))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"env.min_pixels={self.min_pixels} > env.max_pixels={self.max_pixels}")
        _check_choice("env", "on_error", self.on_error, ("truncate", "raise"))
        if self.answer_format is not None:
            _check_choice("env", "answer_format", self.answer_format, ("tag", "words"))
        if self.max_actions_per_turn is not None:
            _check_positive("env", "max_actions_per_turn", self.max_actions_per_turn)
        if self.format_penalty is not None:
            _check_positive("env", "format_penalty", self.format_penalty, allow_zero=True)
        _ = self.context_window  # validates env.context

    @property
    def context_window(self) -> Optional[int]:
        """k of ``window:<k>``, None for ``full``.

        Raises:
            ValueError: ``context`` is neither ``full`` nor ``window:<k>`` with k >= 1.
        """
        if self.context == "full":
            return None
        head, _, k = self.context.partition(":")
        if head != "window" or not k.isdigit() or int(k) < 1:
            raise ValueError(f"env.context={self.context!r}: expected 'full' or 'window:<k>' with k >= 1")
        return int(k)

    def adapter_options(self) -> dict[str, Any]:
        """The built-ins' adapter options set here (unset ones left to their defaults) and the
        pixel budget: ``envs.env_builder``'s ``options``."""
        set_ = {k: getattr(self, k) for k in ("max_actions_per_turn", "format_penalty", "answer_format")
                if getattr(self, k) is not None}
        return {**set_, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}


@dataclass(kw_only=True)
class TrainerConfig:
    """The single-controller loop: steps, validation, checkpoints, trackers."""

    project_name: str = "rollplex"
    experiment_name: str = "default"
    output_dir: Optional[str] = "${hydra:runtime.output_dir}"
    """Metrics, checkpoints, tensorboard events, Ray temp dir and the HF export go here (default:
    Hydra's run dir, ``outputs/<project>/<experiment>``, so ``resume=auto`` finds the last run; it
    resolves to null outside a Hydra job, e.g. under ``--cfg job --resolve``)."""
    total_steps: int = 10
    seed: int = 1
    val_freq: int = 5
    """Validate every this many steps (<= 0: never during training)."""
    val_before_train: bool = True
    save_freq: int = 5
    """Checkpoint every this many steps (<= 0: only at the end)."""
    max_ckpt_to_keep: int = 2
    resume: str = "auto"
    """``auto`` (latest checkpoint in output_dir if any), ``disable``, or a checkpoint directory."""
    max_restarts: int = 0
    """A failed worker: tear the workers down, start them again and resume from the last checkpoint,
    at most this many times per run (0: the run ends with one line naming the worker)."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard", "wandb"])
    wandb_init_timeout_s: float = 30.0
    """Most seconds the wandb start may take; after it (or any online failure) the run logs to wandb
    offline in ``output_dir/wandb``, with one warning naming the cause."""
    export_hf: bool = True
    """Write the final actor as a HF checkpoint directory under ``output_dir/hf_actor``."""
    progress_bar: bool = True
    trace_steps: list[int] = field(default_factory=list)
    """Steps whose phase timeline is written as a Chrome trace to ``output_dir/traces/step_<k>.json``."""
    rollout_data_dir: Optional[str] = None
    """Write every step's responses, token ids and scores to ``<dir>/<step>.jsonl`` (verl's
    ``trainer.rollout_data_dir``); a relative path is under ``output_dir``. None: no dumps."""

    def __post_init__(self) -> None:
        _check_positive("trainer", "total_steps", self.total_steps)
        _check_positive("trainer", "max_ckpt_to_keep", self.max_ckpt_to_keep)
        _check_positive("trainer", "max_restarts", self.max_restarts, allow_zero=True)
        _check_positive("trainer", "wandb_init_timeout_s", self.wandb_init_timeout_s)
        for name in self.loggers:
            _check_choice("trainer", "loggers", name, ("console", "jsonl", "tensorboard", "wandb"))


@dataclass(kw_only=True)
class Config:
    """The whole run: one section per config group of ``conf/config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """A multi-turn environment (``conf/env/``); empty name: none."""
    gpu: GpuConfig = field(default_factory=GpuConfig)
    """GPU datasheet numbers (``conf/gpu/``), read only by ``rollplex-plan timeline``."""
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    """Roofline efficiencies and options of ``rollplex-plan timeline``."""

    def __post_init__(self) -> None:
        from rollplex_train.parallel import ParallelLayout

        ParallelLayout.from_config(self)  # degrees that do not fit the devices fail here, naming the keys
        if self.schedule.name == "rollplex" and not self.model.shared_prefix and not self.env.name:
            raise ValueError("schedule.name=rollplex moves prefix work into decode: it needs model.shared_prefix=true")
        if self.env.name:
            self._check_env_run()
        mini = self.actor.ppo_mini_batch_size
        if mini > 0 and self.data.rollout_batch_size % mini != 0:
            raise ValueError(
                f"actor.ppo_mini_batch_size={mini} must divide data.rollout_batch_size="
                f"{self.data.rollout_batch_size}"
            )

    def _check_env_run(self) -> None:
        """Refuse what an environment run (``runtime/envs.py``) cannot honour, one line each."""
        name = f"env.name={self.env.name!r}"
        if self.model.shared_prefix:
            raise ValueError(f"{name}: a trajectory's later frames sit in its training row after its first turn; "
                             "the shared-prefix passes score responses as text: set model.shared_prefix=false "
                             "(schedule.name=rollplex scores an environment run's turns with its own prefix "
                             "passes, runtime/env_window.py)")
        if self.schedule.name == "rollplex" and self.schedule.prefill_from_actor == "true":
            raise ValueError(f"{name}: schedule.prefill_from_actor=true hands single-turn prompt prefixes to the "
                             "rollout; an environment run's turns are prefilled by the engine: set it to auto or false")
        if self.actor.backend != "torch":
            raise ValueError(f"{name}: environment runs train with actor.backend=torch; got {self.actor.backend!r}")
        if self.rollout.tensor_parallel_size != 1:
            raise ValueError(f"{name}: environment runs decode at rollout.tensor_parallel_size=1; "
                             f"got {self.rollout.tensor_parallel_size}")
        if self.env.context_window is not None and self.env.context_window < self.env.max_turns:
            raise ValueError(f"{name}: env.context={self.env.context} drops observations a turn saw; training on "
                             f"trajectories needs env.context=full or window:<k> with k >= env.max_turns={self.env.max_turns}")
        if self.trainer.val_freq > 0 or self.trainer.val_before_train:
            raise ValueError(f"{name}: validation runs single-turn prompts, not environment episodes; set "
                             "trainer.val_freq=0 trainer.val_before_train=false (env/success_rate is the training "
                             "trajectories')")
        if self.rollout.n < 2 and self.algorithm.adv_estimator in ("grpo", "rloo"):
            raise ValueError(f"{name}: algorithm.adv_estimator={self.algorithm.adv_estimator} compares the rollout.n "
                             f"trajectories of a seed; got rollout.n={self.rollout.n}")


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore under the name ``rollplex_schema``, once per process.

    A second ``store`` of the same name warns on Hydra 1.4 and is an error on 1.5 (Hydra's
    "config_store_collisions" upgrade note), so a registered schema is left as it is.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "rollplex_schema.yaml" not in cs.repo:
        cs.store(name="rollplex_schema", node=Config)


def hydra_version_base() -> dict[str, str]:
    """The ``version_base`` keyword for ``hydra.main`` and ``initialize_config_dir``, as a dict to splat.

    Hydra 1.3 needs ``version_base="1.3"`` (without it the 1.1 defaults apply: the job changes into
    its run directory). Hydra 1.4 deprecates the parameter and warns for any value it is given
    (``hydra/version.py`` ``setbase`` in 1.4.0.dev9, ``Hydra15MigrationWarning``); its defaults keep
    1.3's behaviour for this project (``hydra.job.chdir=False``), so nothing is passed there.
    """
    import hydra

    major, minor = (int(part) for part in hydra.__version__.split(".")[:2])
    return {"version_base": "1.3"} if (major, minor) < (1, 4) else {}


def to_config(cfg: DictConfig) -> Config:
    """Turn a composed Hydra config into validated dataclasses (derived values unresolved:
    ``rollplex_train.resolve.resolve`` sets them before a run).

    The composed config is merged once more into a fresh structured ``Config``, so a key that the
    schema lacks is an error even when it was appended with ``+key=value``.

    Raises:
        omegaconf.errors.ConfigKeyError: a key the schema does not have (the message names it).
        ValueError: a value fails a section's check (the message names ``section.key``).
    """
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=False))
    return OmegaConf.to_object(merged)
