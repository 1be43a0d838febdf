"""The megatron-core training backend (``actor.backend=megatron``): TP actor and frozen reference.

The PPO loop (mini-batches over GRPO groups, micro-batch loss aggregation with global token counts,
prefix store, warm-up, clipping policy) is the torch backend's (``training/torch_engine.py``); this
engine swaps in the Megatron model calls (``training/megatron/scoring.py``), Megatron DDP gradient
buffers, a TP-aware gradient norm, per-rank checkpoints, HF export through the layout converter and
rollout weights made by the sharing plan. Every method is collective over the ranks that hold one
model replica (a TP group): call it on all of them; results are read from TP rank 0.

Optimizer: a plain ``torch.optim.AdamW`` over the Megatron DDP main grads (CPU, and also CUDA so far:
megatron's distributed optimizer, ``megatron.core.optimizer.get_megatron_optimizer``, is not wired
in yet). Pipeline parallelism is refused (``build.build_model``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

import torch

try:  # one-line error naming the extra (the registry imports this module on first use)
    import megatron.core  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without the extra
    from rollplex_train.registry import MissingExtraError

    raise MissingExtraError("actor.backend=megatron needs megatron-core, the 'megatron' extra: "
                            "pip install -e '.[megatron]'") from None

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.megatron_convert import gpt_key, is_language_model, layout_tensors, megatron_to_hf
from rollplex_train.parallel import ParallelLayout
from rollplex_train.training.base import PrefixFunctions, register_train_engine
from rollplex_train.training.parallelize import DataParallel
from rollplex_train.training.megatron import scoring
from rollplex_train.training.megatron.build import build_model, init_parallel
from rollplex_train.training.prefix_store import PrefixStore
from rollplex_train.training.torch_engine import TorchTrainEngine, build_optimizer

log = logging.getLogger(__name__)


class MegatronDataParallel(DataParallel):
    """The torch loop's DP hook over Megatron DDP: ``all_reduce_grads`` finishes DDP's gradient
    sync (a sum over the DP group: ``calculate_per_token_loss``; each rank's loss is normalised by
    the mini-batch's global counts) and hands the main grads to the optimizer as ``.grad``;
    ``sum_metrics`` as :class:`DataParallel` over the DP group.

    Megatron DDP accumulates every backward into ``main_grad`` through per-parameter hooks, so the
    several backward passes through one retained prefix graph (``model.shared_prefix``) are summed
    as plain autograd does (``training/parallelize.py`` says why torch DDP cannot do that).
    """

    def __init__(self, ddp, params: list[torch.nn.Parameter], group):
        super().__init__(params, group)
        self.ddp = ddp

    def all_reduce_grads(self) -> int:
        self.ddp.finish_grad_sync()
        for p in self.params:
            p.grad = p.main_grad
        return 0 if self.group is None else sum(p.main_grad.numel() * p.main_grad.element_size() for p in self.params)


def _single_device_layout(actor: ActorConfig) -> ParallelLayout:
    if actor.tensor_parallel_size * actor.pipeline_parallel_size != 1:
        raise ValueError(f"actor.tensor_parallel_size={actor.tensor_parallel_size}: the Megatron engine needs the "
                         "run's ParallelLayout (layout=) for TP/PP > 1")
    return ParallelLayout()


@register_train_engine("megatron")
class MegatronTrainEngine(TorchTrainEngine):
    """Actor (trainable) and reference (frozen) as :class:`MegatronVLM` shards on one TP rank.

    Args:
        model, actor, algorithm, seed: as the torch backend.
        layout: the run's :class:`ParallelLayout` (None: one CPU device, TP=1).
        rank: this process's training rank in ``layout``.

    Raises:
        ValueError: TP/PP > 1 without a layout, PP > 1, or a degree the model cannot be split by.
        RuntimeError: a multi-rank layout without ``torch.distributed`` initialised.
    """

    supports_suffix_chunks = False  # models.prefix.ChunkedSuffix runs a whole HF model, not TP shards
    exports_prefix_states = False  # its prefix states are TP shards
    supports_model_parallel = True

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout: Optional[ParallelLayout] = None, rank: int = 0):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        torch.manual_seed(seed)
        self.model_cfg, self.cfg, self.algo = model, actor, algorithm
        self.layout = layout or _single_device_layout(actor)
        self.rank = rank
        init_parallel(self.layout, rank, seed)
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        build = lambda: build_model(model.path, model.dtype, model.attn_implementation,  # noqa: E731
                                    tp=self.layout.train_tp, pp=self.layout.train_pp, tp_rank=self.tp_rank,
                                    device=self.layout.device)
        built = build()
        self.conversion, self.te_names = built.layout, built.te_names
        self.tokenizer = load_tokenizer(model.path)
        self.pad_id = self.tokenizer.pad_token_id
        self.ref = None
        if algorithm.needs_reference:  # same checkpoint, same TP layout (modules holding process
            self.ref = build().model.requires_grad_(False).eval()  # groups cannot be deep-copied)
        if model.freeze_vision_tower:
            built.model.visual.requires_grad_(False)
        gpt = built.model.language_model
        self.ddp = DistributedDataParallel(
            config=gpt.config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
            module=built.model,
        )
        self.actor = built.model
        self.device = next(self.actor.parameters()).device  # where the loss inputs go (TorchTrainEngine)
        self.params = [p for p in self.actor.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, actor)
        dp_group = ps.get_data_parallel_group() if self.layout.train_dp > 1 else None
        self.dp = MegatronDataParallel(self.ddp, self.params, dp_group)
        self.prefix_passes = PrefixFunctions(scoring.encode_prefix, scoring.score_suffix)
        self.weights_version = 0
        self.param_version = 0
        self.prefixes = PrefixStore(owner=f"megatron-rank{rank}")
        self.chunked = {}  # stays empty: no suffix chunks on TP shards (supports_suffix_chunks)
        self._shared = None
        self._offloader = None

    @staticmethod
    def check_available(cfg) -> None:
        """The settings of a run ``Config`` this engine cannot honour, for the driver to call before
        Ray starts (as it calls a rollout engine's ``check_available``).

        Raises:
            ValueError: ``sharing.enabled=true`` or ``memory.offload_optimizer=true`` (named).
        """
        if cfg.sharing.enabled or cfg.memory.offload_optimizer:
            raise ValueError("actor.backend=megatron shares no weights in place and offloads nothing yet: set "
                             "sharing.enabled=false and memory.offload_optimizer=false")

    # ---- model calls (the torch backend's loop calls these) -------------------------------------
    def _score_full(self, model, prompts, part: dict, temperature: float, with_entropy: bool):
        return scoring.full_logprobs(model, prompts, part["group_index"], part["response_ids"], part["response_mask"],
                                     self.pad_id, temperature=temperature, with_entropy=with_entropy,
                                     vision_grad=not self.model_cfg.freeze_vision_tower)

    # ---- gradients -------------------------------------------------------------------------------
    def _update_mini_batch(self, *args, **kwargs):
        self.ddp.zero_grad_buffer()  # main grads accumulate over the mini-batch's micro-batches only
        return super()._update_mini_batch(*args, **kwargs)

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global norm over the TP group, counting replicated tensors once
        (megatron-core ``optimizer/clip_grads.py::get_grad_norm_fp32`` with
        ``param_is_not_tensor_parallel_duplicate``); the scale is torch's ``clip_grad_norm_``:
        ``min(1, max_norm / (norm + 1e-6))``. Runs after ``MegatronDataParallel.all_reduce_grads``."""
        squares = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                squares += p.grad.double().pow(2).sum()
        torch.distributed.all_reduce(squares, group=self.tp_group)
        norm = float(squares.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))
        if scale < 1.0:
            for p in self.params:
                p.grad.mul_(scale)
        return norm

    # ---- weights ---------------------------------------------------------------------------------
    def _gather_tp(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.layout.train_tp)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return parts

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """``{layout name: tensor}`` of this rank (the parameters' storage, detached)."""
        gpt = {k: v.detach() for k, v in self.actor.language_model.named_parameters()}
        vision = {"model.visual." + k: v.detach() for k, v in self.actor.visual.named_parameters()}
        return layout_tensors(gpt, vision, self.conversion, self.tp_rank, self.te_names)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the actor (language model joined over TP; collective), new storage."""
        local = self._local_tensors()
        ranks = [{} for _ in range(self.layout.train_tp)]
        for name, tensor in local.items():
            if is_language_model(self.conversion.ranks[self.tp_rank][name].blocks[0].source):
                for i, part in enumerate(self._gather_tp(tensor)):
                    ranks[i][gpt_key(name, self.te_names)] = part
        out = megatron_to_hf(ranks, self.conversion, self.te_names)
        out.update({n: t.clone() for n, t in local.items() if not is_language_model(n)})
        return out

    def rollout_tensors(self, rollout_kind: str = "hf", rollout_tp: int = 1, **options) -> dict[str, torch.Tensor]:
        """This rank's rollout tensors as ``sharing/plan.py`` lays them out: views of the training
        shards where the plan says view, rebuilt buffers for local rebuilds, gathered runs fetched
        over the TP group (collective).

        Args:
            rollout_kind: ``hf`` (the built-in engine) or ``sglang``; rollout_tp: its TP degree;
                options: ``split_qkv``/``split_gate_up`` of the SGLang layout.

        Returns:
            ``{rollout name: tensor}`` of the rollout rank the plan puts on this rank's device.
        """
        from rollplex_train.models.layouts import Dims
        from rollplex_train.sharing.materialize import Materializer, RankFetcher
        from rollplex_train.sharing.plan import plan_sharing

        conv = self.conversion
        local = self._local_tensors()
        plan = plan_sharing(conv.hf_shapes, Dims.from_hf_config(self.actor.config), t=conv.tp, r=rollout_tp,
                            rollout_kind=rollout_kind, itemsize=next(iter(local.values())).element_size(),
                            train_layout=conv, **options)
        pair = plan.devices[self.rank % len(plan.devices)]
        assert pair[0] == self.tp_rank, (pair, self.tp_rank)
        plans = plan.tensors[pair]
        fetch = None
        if conv.tp > 1:  # every rank joins the gathers, in name order, whether it needs them or not
            gathered = {n: self._gather_tp(t) for n, t in sorted(local.items())}
            fetch = RankFetcher(conv, [{n: g[i] for n, g in gathered.items()} for i in range(conv.tp)])
        return Materializer(plans, local, fetch).tensors

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The actor under the built-in rollout engine's (HF) names, full tensors (collective)."""
        return self.rollout_tensors("hf", 1)

    def export_shared_weights(self) -> dict:
        raise NotImplementedError("actor.backend=megatron cannot share its weights in place yet (sharing.enabled=false)")

    def publish_weights(self, version: int) -> dict[str, float]:
        raise NotImplementedError("actor.backend=megatron cannot share its weights in place yet")

    def offload_states(self, parts: tuple[str, ...]) -> int:
        raise NotImplementedError("actor.backend=megatron has no offload yet (memory.offload_optimizer=false)")

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        """Nothing is ever offloaded (``offload_states`` refuses): 0 bytes."""
        return 0

    # ---- checkpoints -----------------------------------------------------------------------------
    def _rank_dir(self, directory: Path) -> Path:
        c = self.layout.train_coords(self.rank)
        return Path(directory) / f"megatron_tp{c.tp:02d}_pp{c.pp:02d}"

    def save_checkpoint(self, directory: Path) -> None:
        """Per (TP, PP) shard, written by DP rank 0: ``megatron_tpXX_ppYY/{actor,optim}.pt`` (module
        state, AdamW and warm-up state, weights version, torch RNG). Collective (barrier at the end)."""
        out = self._rank_dir(directory)
        if self.layout.train_coords(self.rank).dp == 0:
            out.mkdir(parents=True, exist_ok=True)
            torch.save(self.actor.state_dict(), out / "actor.pt")
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "weights_version": self.weights_version, "torch_rng": torch.get_rng_state(),
                        "layout": (self.layout.train_tp, self.layout.train_pp)}, out / "optim.pt")
        torch.distributed.barrier()

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote (the same TP/PP degrees).

        Raises:
            FileNotFoundError: this rank's shard directory or a file of it is missing.
            ValueError: the checkpoint was written with other TP/PP degrees.
        """
        src = self._rank_dir(directory)
        for name in ("actor.pt", "optim.pt"):
            if not (src / name).is_file():
                raise FileNotFoundError(f"checkpoint {directory} lacks {src.name}/{name}")
        state = torch.load(src / "optim.pt", weights_only=False)
        if tuple(state["layout"]) != (self.layout.train_tp, self.layout.train_pp):
            raise ValueError(f"checkpoint {directory} has TP/PP {state['layout']}, the run has "
                             f"{(self.layout.train_tp, self.layout.train_pp)}")
        self.actor.load_state_dict(torch.load(src / "actor.pt", weights_only=True))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weights_version = int(state["weights_version"])
        torch.set_rng_state(state["torch_rng"])

    def export_hf(self, directory: Path) -> None:
        """Write the actor as an HF checkpoint directory (collective; TP rank 0 of DP rank 0 writes)."""
        from rollplex_train.tracking.export import export_hf

        full = self.hf_state()
        if self.layout.train_coords(self.rank).dp != 0 or self.tp_rank != 0:
            return
        hf = load_model(self.model_cfg.path, self.model_cfg.dtype, self.model_cfg.attn_implementation)
        with torch.no_grad():
            for name, param in hf.named_parameters():
                param.copy_(full[name])
        export_hf(hf, self.tokenizer, Path(directory), extra_files_from=Path(self.model_cfg.path))

    def weights_digest(self) -> dict[str, str]:
        """``{HF name: sha256}`` of the joined actor (collective), comparable with the rollout
        engine's ``weights_digest``."""
        from rollplex_train.sharing.embedded import tensors_digest

        return tensors_digest(self.hf_state())
