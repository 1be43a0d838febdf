"""The plain-torch training backend: actor + frozen reference + AdamW on one device.

``TorchBackend`` runs transformers modules on the rank's device (``cpu`` or ``cuda:<local
index>``; ``device.py``), sums gradients over the DP group with ``training/parallelize.py`` and
steps a ``torch.optim.AdamW``; ``TorchTrainEngine`` is the PPO loop (``training/ppo_loop.py``)
over it, registered as ``actor.backend=torch``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
import torch

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.device import layout_device
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.prefix import ChunkedSuffix, encode_prefix, score_suffix
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.training.backend import PrefixFunctions
from rollplex_train.training.base import register_train_engine
from rollplex_train.training.ppo_loop import PPOEngine, lr_factor  # noqa: F401  (lr_factor re-exported)

log = logging.getLogger(__name__)


class TorchBackend:
    """Actor and reference as transformers models on one device, computing in ``model.compute_dtype``
    (``training.backend.ModelBackend``).

    Args:
        model: model section (checkpoint path, dtype, frozen vision tower).
        actor: optimizer settings. algorithm: whether a reference is needed.
        seed: seeds torch before the models and the optimizer are built.
        layout: the run's :class:`rollplex_train.parallel.ParallelLayout` (None: one process).
        rank: this process's training rank; with DP > 1 torch.distributed is initialised over all
            ranks before the backend is built (``training/parallelize.py``).

    Raises:
        ValueError: the layout asks for TP or PP (``parallelize_torch``).
    """

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout=None, rank: int = 0):
        from rollplex_train.training.parallelize import parallelize_torch

        torch.manual_seed(seed)
        self.model_cfg, self.layout, self.rank = model, layout, rank
        self.device = layout_device(layout, rank)
        self.actor = load_model(model.path, model.dtype, model.attn_implementation).to(self.device)
        self.tokenizer = load_tokenizer(model.path)
        self.pad_id = self.tokenizer.pad_token_id
        self.ref = None
        if algorithm.needs_reference:
            self.ref = copy.deepcopy(self.actor).requires_grad_(False).eval()
        if model.freeze_vision_tower:
            self.actor.model.visual.requires_grad_(False)
        self.params = [p for p in self.actor.parameters() if p.requires_grad]
        self.dp = parallelize_torch(self.params, layout, rank)
        self.optimizer = torch.optim.AdamW(self.params, lr=actor.lr, betas=tuple(actor.betas),
                                           weight_decay=actor.weight_decay)
        self.prefix_passes = PrefixFunctions(encode_prefix, score_suffix, ChunkedSuffix)  # models.prefix
        self._offloader = self._ref_offloader = None  # memory.offload.ModuleOffloader on first offload()

    # ---- model calls ------------------------------------------------------------------------------
    def score_full(self, model, part, *, temperature: float, with_entropy: bool):
        ids, mask, plen, vision = build_full_sequences(
            part.prompts, part.group_index, part.response_ids, part.response_mask, self.pad_id
        )
        return response_logprobs(model, ids, mask, vision, plen, part.response_ids, part.response_mask,
                                 temperature=temperature, with_entropy=with_entropy)

    # ---- gradients and optimizer ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def sync_grads(self) -> int:
        return self.dp.all_reduce_grads()

    def sum_metrics(self, metrics: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        return self.dp.sum_metrics(metrics, keys)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the actor's gradients (torch's ``clip_grad_norm_``)."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    # ---- memory -----------------------------------------------------------------------------------
    def _offloaders(self, parts: tuple[str, ...]) -> list[tuple[object, tuple[str, ...]]]:
        """``(memory.offload.ModuleOffloader, its parts)`` for ``parts``: the actor's ``params``,
        ``grads``, ``optimizer``; ``ref``: the reference's parameters (made on first use)."""
        from rollplex_train.memory.offload import PARTS, ModuleOffloader

        unknown = set(parts) - set(PARTS) - {"ref"}
        if unknown:
            raise ValueError(f"unknown part(s) {sorted(unknown)}: expected any of {[*PARTS, 'ref']}")
        if self._offloader is None:
            self._offloader = ModuleOffloader(self.actor, self.optimizer)
        out = [(self._offloader, tuple(p for p in parts if p != "ref"))]
        if "ref" in parts and self.ref is not None:
            if self._ref_offloader is None:
                self._ref_offloader = ModuleOffloader(self.ref)
            out.append((self._ref_offloader, ("params",)))
        return out

    def offload(self, parts: tuple[str, ...]) -> int:
        """``params``, ``grads``, ``optimizer`` (the actor's) and ``ref`` to host memory
        (``memory.offload.ModuleOffloader``); returns the bytes moved."""
        return sum(o.offload(p) for o, p in self._offloaders(parts) if p)

    def onload(self, parts: tuple[str, ...]) -> int:
        moved = 0
        for offloader, sub in self._offloaders(parts):
            if sub:
                pending = offloader.prefetch(sub)
                pending.wait()
                moved += pending.nbytes
        return moved

    def release_grads(self) -> None:
        """Nothing to free: ``zero_grad`` drops the gradients (``set_to_none``) after each step."""

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes of ``actor_weights``, ``master_weights`` (none: AdamW steps the parameters
        themselves), ``optimizer_states``, ``grads``, ``ref_weights`` (``memory/groups.py``),
        measured from the tensors."""
        from rollplex_train.memory.measure import live_tensor_bytes

        states = (v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        return {"actor_weights": live_tensor_bytes(self.actor.parameters()), "master_weights": 0,
                "optimizer_states": live_tensor_bytes(states), "grads": live_tensor_bytes(p.grad for p in self.params),
                "ref_weights": 0 if self.ref is None else live_tensor_bytes(self.ref.parameters())}

    # ---- weights ----------------------------------------------------------------------------------
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda":  # the optimizer's kernels are done before another stream copies
            torch.cuda.current_stream(self.device).synchronize()
        return {k: v.detach() for k, v in self.actor.state_dict().items()}

    def share_weights(self, rollout_kind: str, rollout_tp: int, same_process: bool, **options):
        """The actor's parameters (HF layout, t = 1) planned into the rollout layout: at ``hf`` r = 1
        every tensor is a view (the embedded run, ``sharing/embedded.py``)."""
        from rollplex_train.models.layouts import Dims
        from rollplex_train.sharing.plan import plan_sharing
        from rollplex_train.sharing.share import WeightShare

        named = dict(self.actor.named_parameters())  # tied weights once
        shapes = {n: tuple(p.shape) for n, p in named.items()}
        plan = plan_sharing(shapes, Dims.from_hf_config(self.actor.config), t=1, r=rollout_tp, train_kind="hf",
                            rollout_kind=rollout_kind, itemsize=next(iter(named.values())).element_size(), **options)
        return WeightShare(plan, self.rank, {n: p.detach() for n, p in named.items()}, rollout_kind=rollout_kind,
                           same_process=same_process)

    def weights_digest(self) -> dict[str, str]:
        from rollplex_train.sharing.embedded import weights_digest

        return weights_digest(self.actor)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, directory: Path, trainer_state: dict) -> None:
        """Rank 0 writes ``actor.pt`` (state dict) and ``optim.pt`` (AdamW + ``trainer_state``): DP
        replicas are identical, and resuming on another DP size loads the same files."""
        if self.rank != 0:
            return
        torch.save(self.actor.state_dict(), directory / "actor.pt")
        torch.save({"optimizer": self.optimizer.state_dict(), **trainer_state}, directory / "optim.pt")

    def load(self, directory: Path) -> dict:
        for name in ("actor.pt", "optim.pt"):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"checkpoint {directory} lacks {name}")
        self.actor.load_state_dict(torch.load(directory / "actor.pt", weights_only=True))
        state = torch.load(directory / "optim.pt", weights_only=False)
        self.optimizer.load_state_dict(state.pop("optimizer"))
        return state

    def export_hf(self, directory: Path) -> None:
        from rollplex_train.tracking.export import export_hf

        export_hf(self.actor, self.tokenizer, directory, extra_files_from=Path(self.model_cfg.path))


@register_train_engine("torch")
class TorchTrainEngine(PPOEngine):
    """The PPO loop over a :class:`TorchBackend` (arguments as the backend's). It adds nothing to
    the loop but the backend it builds and its declared capabilities."""

    supports_suffix_chunks = True  # models.prefix.ChunkedSuffix
    exports_prefix_states = True  # whole transformers KV caches (schedule.prefill_from_actor)

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout=None, rank: int = 0):
        super().__init__(TorchBackend(model, actor, algorithm, seed, layout, rank), model, actor, algorithm, rank)

