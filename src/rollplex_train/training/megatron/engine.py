"""The megatron-core training backend (``actor.backend=megatron``): TP actor and frozen reference.

``MegatronBackend`` implements ``training.backend.ModelBackend`` with Megatron model calls
(``training/megatron/scoring.py``), Megatron DDP gradient buffers, megatron's distributed optimizer
on CUDA or AdamW on CPU (``training/megatron/optimizer.py``), per-rank checkpoints, HF export
through the layout converter, and rollout tensors made by the sharing plan (views of its TP shards,
``sharing/share.py``). ``MegatronTrainEngine`` is the PPO loop (``training/ppo_loop.py``) over it.
Every method is collective over the ranks that hold one model replica (a TP group): call it on all
of them; results are read from TP rank 0. Pipeline parallelism is refused (``build.build_model``).
"""

from __future__ import annotations

import logging
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
from rollplex_train.device import layout_device
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.megatron_convert import join_ranks, layout_tensors
from rollplex_train.parallel import ParallelLayout
from rollplex_train.training.backend import PrefixFunctions
from rollplex_train.training.base import register_train_engine
from rollplex_train.training.megatron import scoring
from rollplex_train.training.megatron.build import build_model, init_parallel
from rollplex_train.training.megatron.optimizer import AdamStateOffload, build_optimizer
from rollplex_train.training.parallelize import sum_metrics
from rollplex_train.training.ppo_loop import PPOEngine

log = logging.getLogger(__name__)


def _single_device_layout(actor: ActorConfig) -> ParallelLayout:
    if actor.tensor_parallel_size * actor.pipeline_parallel_size != 1:
        raise ValueError(f"actor.tensor_parallel_size={actor.tensor_parallel_size}: the Megatron engine needs the "
                         "run's ParallelLayout (layout=) for TP/PP > 1")
    return ParallelLayout()


class MegatronBackend:
    """Actor (trainable) and reference (frozen) as :class:`MegatronVLM` shards on one TP rank.

    Megatron DDP accumulates every backward into ``main_grad`` through per-parameter hooks and
    ``sync_grads`` finishes its sync: a sum over the DP group (``calculate_per_token_loss``; each
    rank's loss is normalised by the mini-batch's global counts).

    Args:
        model, actor, algorithm, seed: as the torch backend.
        layout: the run's :class:`ParallelLayout` (None: one CPU device, TP=1).
        rank: this process's training rank in ``layout``.

    Raises:
        ValueError: TP/PP > 1 without a layout, PP > 1, or a degree the model cannot be split by.
        RuntimeError: a multi-rank layout without ``torch.distributed`` initialised.
    """

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout: Optional[ParallelLayout] = None, rank: int = 0):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        torch.manual_seed(seed)
        self.model_cfg = model
        self.layout = layout or _single_device_layout(actor)
        self.rank = rank
        self.device = layout_device(self.layout, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # megatron allocates on torch.cuda.current_device()
        init_parallel(self.layout, rank, seed)
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        build = lambda: build_model(model.path, model.dtype, model.attn_implementation,  # noqa: E731
                                    tp=self.layout.train_tp, pp=self.layout.train_pp, tp_rank=self.tp_rank,
                                    device=self.device)
        built = build()
        self.conversion, self.te_names = built.layout, built.te_names
        self.tokenizer = load_tokenizer(model.path)
        self.pad_id = self.tokenizer.pad_token_id
        self.ref = None
        if algorithm.needs_reference:  # same checkpoint, same TP layout (modules holding process
            self.ref = build().model.requires_grad_(False).eval()  # groups cannot be deep-copied)
        if model.freeze_vision_tower:
            built.model.visual.requires_grad_(False)
        distributed = self.device.type == "cuda"  # megatron's distributed optimizer (optimizer.py)
        self.ddp = DistributedDataParallel(
            config=built.model.language_model.config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=distributed,
                                                     grad_reduce_in_fp32=True),
            module=built.model,
        )
        self.actor = built.model
        self.params = [p for p in self.actor.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.ddp, self.params, actor, self.device, self.tp_rank, self.tp_group)
        self.dp_group = ps.get_data_parallel_group() if self.layout.train_dp > 1 else None
        self.prefix_passes = PrefixFunctions(scoring.encode_prefix, scoring.score_suffix)  # no chunks on TP shards
        self._offload: Optional[AdamStateOffload] = None
        self._ref_offloader = None  # memory.offload.ModuleOffloader of the reference, on first use
        self._grads_released = False
        self.release_grads()  # no gradients exist before the first update (memory/groups.py)

    # ---- model calls ------------------------------------------------------------------------------
    def score_full(self, model, part, *, temperature: float, with_entropy: bool):
        return scoring.full_logprobs(model, part.prompts, part.group_index, part.response_ids, part.response_mask,
                                     self.pad_id, temperature=temperature, with_entropy=with_entropy,
                                     vision_grad=not self.model_cfg.freeze_vision_tower)

    # ---- gradients and optimizer ------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self._grads_released:  # the first mini-batch of an update: the buffers come back zeroed
            self.ddp.restore_grad_buffers(synchronize=self.device.type == "cuda")
            self._grads_released = False
        self.ddp.zero_grad_buffer()  # main grads accumulate over one mini-batch's micro-batches only
        self.optimizer.zero_grad()

    def sync_grads(self) -> int:
        self.ddp.finish_grad_sync()
        self.optimizer.take_grads()
        if self.dp_group is None:
            return 0
        return sum(p.main_grad.numel() * p.main_grad.element_size() for p in self.params)

    def sum_metrics(self, metrics: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        return sum_metrics(metrics, keys, self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm(max_norm)

    def optimizer_step(self, lr: float) -> None:
        self.optimizer.step(lr)

    # ---- memory -----------------------------------------------------------------------------------
    def offload(self, parts: tuple[str, ...]) -> int:
        """The Adam states (``optimizer``) and the reference's parameters (``ref``) to host memory;
        returns the bytes moved. The actor's parameters stay (DDP's buffers and the rollout hold
        them); its gradient buffers are freed after each update (:meth:`release_grads`).

        Raises:
            ValueError: another part.
        """
        if set(parts) - {"optimizer", "ref"}:
            raise ValueError(f"actor.backend=megatron moves its optimizer states and reference only, not "
                             f"{sorted(set(parts) - {'optimizer', 'ref'})}")
        moved = self._adam_offload().offload() if "optimizer" in parts else 0
        if "ref" in parts and self.ref is not None:
            moved += self._ref_offload().offload(("params",))
        return moved

    def onload(self, parts: tuple[str, ...]) -> int:
        moved = self._adam_offload().onload() if "optimizer" in parts else 0
        if "ref" in parts and self.ref is not None:
            pending = self._ref_offload().prefetch(("params",))
            pending.wait()
            moved += pending.nbytes
        return moved

    def _adam_offload(self) -> AdamStateOffload:
        if self._offload is None:
            self._offload = AdamStateOffload(self.actor, self.optimizer)
        return self._offload

    def _ref_offload(self):
        from rollplex_train.memory.offload import ModuleOffloader

        if self._ref_offloader is None:
            self._ref_offloader = ModuleOffloader(self.ref)
        return self._ref_offloader

    def release_grads(self) -> None:
        """Free DDP's gradient buffers until the next update (megatron-core 0.16.1
        ``DistributedDataParallel.offload_grad_buffers``: the storage is resized to 0, every
        ``main_grad`` view stays a valid object); :meth:`zero_grad` brings them back, zeroed."""
        if not self._grads_released:
            self.ddp.offload_grad_buffers(synchronize=self.device.type == "cuda", empty_cache=False)
            self._grads_released = True

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes of ``actor_weights``, ``master_weights`` (the distributed optimizer's fp32
        main parameters; none with AdamW on the parameters themselves), ``optimizer_states``,
        ``grads`` (DDP's buffers), ``ref_weights`` (``memory/groups.py``), from the tensors."""
        from rollplex_train.memory.measure import live_tensor_bytes

        own = {p.untyped_storage().data_ptr() for p in self.actor.parameters()}
        inner = self.optimizer.inner()
        main = [p for o in inner for g in o.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in own]
        states = [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        grads = [b.grad_data for b in self.ddp.buffers] + [p.grad for p in self.params]
        return {"actor_weights": live_tensor_bytes(self.actor.parameters()), "master_weights": live_tensor_bytes(main),
                "optimizer_states": live_tensor_bytes(states), "grads": live_tensor_bytes(grads),
                "ref_weights": 0 if self.ref is None else live_tensor_bytes(self.ref.parameters())}

    # ---- weights ----------------------------------------------------------------------------------
    def _gather_tp(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.layout.train_tp)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return parts

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """``{layout name: tensor}`` of this rank (the parameters' storage, detached)."""
        gpt = {k: v.detach() for k, v in self.actor.language_model.named_parameters()}
        vision = {"model.visual." + k: v.detach() for k, v in self.actor.visual.named_parameters()}
        return layout_tensors(gpt, vision, self.conversion, self.tp_rank, self.te_names)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the actor (split tensors joined over TP; collective), new storage."""
        local = self.local_tensors()
        ranks = [{} for _ in range(self.layout.train_tp)]
        for name, tensor in local.items():  # every rank holds the same names (layouts.py)
            for i, part in enumerate(self._gather_tp(tensor)):
                ranks[i][name] = part
        return join_ranks(ranks, self.conversion)

    def share_plan(self, rollout_kind: str, rollout_tp: int, **options):
        """``sharing.plan.plan_sharing`` from this backend's Megatron layout (t = TP) to
        ``rollout_kind`` at ``rollout_tp`` (``options``: ``split_qkv``/``split_gate_up``)."""
        from rollplex_train.models.layouts import Dims
        from rollplex_train.sharing.plan import plan_sharing

        conv = self.conversion
        return plan_sharing(conv.hf_shapes, Dims.from_hf_config(self.actor.config), t=conv.tp, r=rollout_tp,
                            rollout_kind=rollout_kind, itemsize=self.params[0].element_size(), train_layout=conv,
                            **options)

    def rollout_tensors(self, rollout_kind: str = "hf", rollout_tp: int = 1, **options) -> dict[str, torch.Tensor]:
        """This rank's rollout tensors as ``sharing/plan.py`` lays them out (collective when the
        plan gathers): views of the training shards where the plan says view, new buffers for
        rebuilt and gathered tensors (not shared: ``share_weights`` is the in-place hand-over).

        Returns:
            ``{rollout name: tensor}`` of the rollout rank the plan puts on this rank's device.
        """
        from rollplex_train.sharing.share import materialize

        mat, _, pair = materialize(self.share_plan(rollout_kind, rollout_tp, **options), self.rank,
                                   self.local_tensors(), group=self.tp_group)
        assert pair[0] == self.tp_rank, (pair, self.tp_rank)
        return mat.tensors

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The actor under the built-in rollout engine's (HF) names, full tensors (collective)."""
        return self.rollout_tensors("hf", 1)

    def share_weights(self, rollout_kind: str, rollout_tp: int, same_process: bool, **options):
        """The ``sharing.share.WeightShare`` of this rank's device: views of the TP shards where the
        plan allows, ``[q;k;v]``-style rebuilds, gathers only where t != r needs them.

        Raises:
            RuntimeError: the plan puts another rollout rank on this device than the run layout.
        """
        from rollplex_train.sharing.share import WeightShare

        plan = self.share_plan(rollout_kind, rollout_tp, **options)
        train_rank, rollout_rank = plan.devices[self.rank % len(plan.devices)]
        assert train_rank == self.tp_rank, (train_rank, self.tp_rank)
        if rollout_rank != self.rank % rollout_tp:
            raise RuntimeError(f"the share plan puts rollout rank {rollout_rank} on device {self.rank}; the run's "
                               f"rollout engines hold rank {self.rank % rollout_tp} there")
        return WeightShare(plan, self.rank, self.local_tensors(), rollout_kind=rollout_kind, group=self.tp_group,
                           same_process=same_process)

    def weights_digest(self) -> dict[str, str]:
        """``{HF name: sha256}`` of the joined actor (collective), comparable with the rollout
        engine's ``weights_digest``."""
        from rollplex_train.sharing.embedded import tensors_digest

        return tensors_digest(self.hf_state())

    # ---- checkpoints ------------------------------------------------------------------------------
    def _rank_dir(self, directory: Path) -> Path:
        c = self.layout.train_coords(self.rank)
        return directory / f"megatron_tp{c.tp:02d}_pp{c.pp:02d}"

    def save(self, directory: Path, trainer_state: dict) -> None:
        """Per (TP, PP) shard, written by DP rank 0: ``megatron_tpXX_ppYY/{actor,optim}.pt`` (module
        state; optimizer, ``trainer_state``, the TP/PP degrees), plus ``optim_params.pt`` with the
        distributed optimizer. Collective (barrier at the end)."""
        out = self._rank_dir(directory)
        writer = self.layout.train_coords(self.rank).dp == 0
        if writer:
            out.mkdir(parents=True, exist_ok=True)
        optim = self.optimizer.save(out, writer)  # collective over DP with the distributed optimizer
        if writer:
            torch.save(self.actor.state_dict(), out / "actor.pt")
            torch.save({**optim, **trainer_state, "layout": (self.layout.train_tp, self.layout.train_pp)},
                       out / "optim.pt")
        torch.distributed.barrier()

    def load(self, directory: Path) -> dict:
        """Restore what ``save`` wrote (the same TP/PP degrees).

        Raises:
            FileNotFoundError: this rank's shard directory or a file of it is missing.
            ValueError: the checkpoint was written with other TP/PP degrees.
        """
        src = self._rank_dir(directory)
        for name in ("actor.pt", "optim.pt"):
            if not (src / name).is_file():
                raise FileNotFoundError(f"checkpoint {directory} lacks {src.name}/{name}")
        state = torch.load(src / "optim.pt", weights_only=False, map_location=self.device)
        if tuple(state.pop("layout")) != (self.layout.train_tp, self.layout.train_pp):
            raise ValueError(f"checkpoint {directory} has other TP/PP degrees than the run's "
                             f"{(self.layout.train_tp, self.layout.train_pp)}")
        self.actor.load_state_dict(torch.load(src / "actor.pt", weights_only=True, map_location=self.device))
        self.optimizer.load(src, state)
        state.pop("optimizer")
        state["torch_rng"] = state["torch_rng"].cpu()
        return state

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
        export_hf(hf, self.tokenizer, directory, extra_files_from=Path(self.model_cfg.path))


@register_train_engine("megatron")
class MegatronTrainEngine(PPOEngine):
    """The PPO loop over a :class:`MegatronBackend` (arguments as the backend's). It adds nothing to
    the loop but the backend it builds, its declared capabilities and the run-level check below."""

    supports_model_parallel = True  # TP x PP shards; no suffix chunks, prefix states are TP shards

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout: Optional[ParallelLayout] = None, rank: int = 0):
        super().__init__(MegatronBackend(model, actor, algorithm, seed, layout, rank), model, actor, algorithm, rank)

    @staticmethod
    def check_available(cfg) -> None:
        """The settings of a run ``Config`` this engine cannot honour, for the driver to call before
        Ray starts (as it calls a rollout engine's ``check_available``).

        Raises:
            ValueError: ``actor.pipeline_parallel_size > 1`` (PP is not built).
        """
        if cfg.actor.pipeline_parallel_size > 1:
            raise ValueError(f"actor.pipeline_parallel_size={cfg.actor.pipeline_parallel_size}: the Megatron "
                             "backend runs PP=1 only so far")
