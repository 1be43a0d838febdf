"""Tensor groups of one GRPO step: size per GPU, the phase that produces them, the phases that use them.

A *group* is a set of tensors that live and move together (all actor bf16 weights, the rollout KV
cache, the reference prefix KV caches of the prompts one rank holds). Its kind decides its lifetime:

- ``state``: keeps a value across steps (weights, fp32 master weights, Adam states). Alive always;
  may wait in pinned host memory between its uses.
- ``live``: produced in one phase, alive until its last consumer phase, then freed (prefix KV caches,
  actor prefix activations, gradients). May wait on the host between producer and consumers.
- ``scratch``: working memory of the phases that use it, dead in between (rollout KV cache,
  micro-batch activations, logits): allocated on entry, freed on exit, never copied.

A group of several *items* (one per prompt) can be partly resident: its phases need at least one
item on the device (the one being produced or consumed), the others may be streamed to/from the host.

Phases of a step, in order (``PHASES``): ``rollout_decode`` (with the rollplex schedule the prefix
tasks run inside this decode window), ``old_log_prob``, ``ref_log_prob``, ``actor_update``,
``optimizer_step``, ``weight_sync``. Sizes come from :mod:`rollplex_train.memory.estimate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from rollplex_train.memory import estimate as est
from rollplex_train.parallel import ParallelLayout

if TYPE_CHECKING:
    from rollplex_train.config import Config

PHASES = ("rollout_decode", "old_log_prob", "ref_log_prob", "actor_update", "optimizer_step", "weight_sync")
KINDS = ("state", "live", "scratch")
LAYOUTS = ("naive", "serial", "rollplex")
"""Which step the groups describe: ``naive`` (rollplex's prefix states, separate rollout weights),
``serial`` (prefix work in the scoring/update phases, separate rollout weights), ``rollplex``
(prefix tasks in the decode window, rollout weights as views of the actor's where layouts match)."""


@dataclass(frozen=True)
class TensorGroup:
    """One group of tensors on one GPU.

    Attributes:
        name: e.g. ``actor_weights``, ``ref_prefix_kv``.
        item_bytes: bytes of one item on one GPU (int, >= 0).
        num_items: items of the group (prompts for per-prompt state); 1 for a monolithic group.
        kind: ``state``, ``live`` or ``scratch`` (see the module docstring).
        producer: phase that creates a ``live`` group (None for ``state``/``scratch``).
        consumers: phases that need it on the device (a ``live`` group dies after the last one).
        note: how the size was computed (shown in the report).
    """

    name: str
    item_bytes: int
    num_items: int = 1
    kind: str = "state"
    producer: Optional[str] = None
    consumers: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.item_bytes >= 0 and self.num_items >= 1, (self.name, self.item_bytes, self.num_items)
        assert (self.producer is not None) == (self.kind == "live"), f"{self.name}: only live groups have a producer"

    @property
    def nbytes(self) -> int:
        """Bytes of all items."""
        return self.item_bytes * self.num_items

    @property
    def used_in(self) -> tuple[str, ...]:
        """Phases that need the group on the device (producer first)."""
        return ((self.producer,) if self.producer else ()) + tuple(c for c in self.consumers if c != self.producer)


def rollout_shares_actor_weights(cfg: "Config") -> bool:
    """True when the rollout engine maps the actor's weights instead of keeping a copy: sharing
    enabled, Megatron (TP-sharded) layout, no pipeline split. The share plan of ``sharing/`` then
    says which rollout tensors are views (no bytes) and which are rebuilt into persistent buffers
    (``rollout_rebuilt``); FSDP's flat shards and pipeline stages keep a full rollout copy."""
    return (cfg.sharing.enabled and cfg.memory.train_strategy == "megatron"
            and ParallelLayout.from_config(cfg).train_pp == 1)


def rank_parameters(cfg: "Config", hf_config: Any) -> tuple[int, int]:
    """``(parameters, trained parameters)`` of the largest training model-parallel rank, as the
    configured backend lays them out: ``actor.backend=megatron`` holds the ``megatron`` layout of
    ``models/megatron_convert.py`` (its vocabulary padding, replicated norms and whatever it does with
    the vision tower), the torch backend the whole model. Trained: without the vision tower when
    ``model.freeze_vision_tower``."""
    from rollplex_train.models.arch import parameter_shapes
    from rollplex_train.models.layouts import Dims

    shapes = parameter_shapes(hf_config)
    frozen = cfg.model.freeze_vision_tower
    lay = ParallelLayout.from_config(cfg)
    if cfg.actor.backend == "megatron":
        from rollplex_train.models.megatron_convert import is_language_model, megatron_layout
        from rollplex_train.sharing.plan import megatron_vocab_divisor

        vocab = est.text_dims(hf_config).vocab
        layout = megatron_layout(shapes, Dims.from_hf_config(hf_config), lay.train_tp,
                                 megatron_vocab_divisor(vocab, lay.train_tp))
        counts = [(sum(s.numel for s in rank.values()),
                   sum(s.numel for s in rank.values() if not frozen or is_language_model(s.blocks[0].source)))
                  for rank in layout.ranks]
        return max(counts)
    total = sum(math.prod(s) for s in shapes.values())
    vision = sum(math.prod(s) for n, s in shapes.items() if ".visual." in "." + n)
    return total // (lay.train_tp * lay.train_pp), (total - (vision if frozen else 0)) // (lay.train_tp * lay.train_pp)


def rollout_rank_bytes(cfg: "Config", hf_config: Any) -> int:
    """Bytes of the largest rollout rank's own weights (a copy: sharing off), in the rollout
    engine's layout (``sglang`` at r > 1 or for SGLang, else ``hf``)."""
    from rollplex_train.models.arch import parameter_shapes
    from rollplex_train.models.layouts import Dims, build_layout
    from rollplex_train.sharing.report import ITEMSIZE, layouts_of

    lay = ParallelLayout.from_config(cfg)
    layout = build_layout(layouts_of(cfg)[1], lay.rollout_tp, parameter_shapes(hf_config), Dims.from_hf_config(hf_config))
    return max(sum(s.numel for s in rank.values()) for rank in layout.ranks) * ITEMSIZE[cfg.model.dtype]


def rollout_shares_prompt_kv(cfg: "Config") -> bool:
    """Whether the rollout engine keeps one copy of a prompt's KV cache for its n samples: SGLang
    (its radix cache matches the n requests' common prompt), the built-in engine with
    ``rollout.share_prompt_kv`` (``rollout/shared_prefix.py``)."""
    return cfg.rollout.name == "sglang" or cfg.rollout.share_prompt_kv


def pinned_groups(cfg: "Config", shared: bool) -> frozenset[str]:
    """Groups no engine moves to host memory (``residency.plan_residency(pinned=...)``): the actor's
    weights when the rollout maps them (an offload would cut the rollout off) or under Megatron DDP
    (its parameters live in DDP's buffers), the fp32 master weights (nothing offloads the distributed
    optimizer's main parameters), the rebuilt rollout buffers (mapped by the rollout), the prefix
    states (held whole until their consumer: no prefix streaming is built), the gradients (made and
    used inside one update call) and the runtime reserve. What moves: the Adam states, the
    reference weights, the actor's weights (torch backend, sharing off) and the rollout engine's
    own weights (``release_memory(("weights",))``)."""
    out = {"master_weights", "rollout_rebuilt", "old_prefix_kv", "ref_prefix_kv", "actor_prefix_acts", "grads",
           "runtime_reserved"}
    if shared or cfg.actor.backend == "megatron":
        out.add("actor_weights")
    return frozenset(out)


def evicted_groups(cfg: "Config") -> frozenset[str]:
    """Groups that leave the device after their last use of a step (``memory.offload_optimizer``:
    the Adam states)."""
    return frozenset({"optimizer_states"} if cfg.memory.offload_optimizer else ())


def step_groups(cfg: "Config", hf_config: Any, layout_name: str, batch: Optional[est.BatchShape] = None,
                shared: Optional[bool] = None) -> list[TensorGroup]:
    """The tensor groups of one step of ``cfg`` on one GPU, for ``layout_name`` in ``LAYOUTS``.

    Args:
        batch: the step's shape (None: the config's bounds, ``estimate.batch_shape``); a run passes
            its step's own prompt lengths (``memory/executor.py``).
        shared: whether the rollout maps the actor's weights (None: ``rollplex`` layout and
            ``rollout_shares_actor_weights``; naive and serial keep a copy).

    Raises:
        ValueError: unknown layout name, or a layout/batch check of :mod:`estimate` fails.
    """
    if layout_name not in LAYOUTS:
        raise ValueError(f"layout {layout_name!r}: expected one of {list(LAYOUTS)}")
    mem = cfg.memory
    lay = ParallelLayout.from_config(cfg)
    batch = batch or est.batch_shape(cfg, hf_config)
    text, vision = est.text_dims(hf_config), est.vision_dims(hf_config)
    tp, pp, dp = lay.train_tp, lay.train_pp, lay.train_dp
    params, pbytes = est.total_parameters(hf_config), est.param_bytes_of(cfg)
    layer_params = est.llm_parameters(text) // text.layers  # ~ largest FSDP unit (embeddings excluded)
    rank_params, rank_trainable = rank_parameters(cfg, hf_config)
    states = est.training_state_bytes(params, strategy=mem.train_strategy, tp=tp, pp=pp, dp=dp,
                                      distributed_optimizer=mem.distributed_optimizer,
                                      largest_layer_params=layer_params, param_bytes=pbytes,
                                      rank_params=rank_params, rank_trainable=rank_trainable)
    rollplex = layout_name != "serial"  # naive colocation holds rollplex's prefix states, all resident
    if shared is None:
        shared = layout_name == "rollplex" and rollout_shares_actor_weights(cfg)
    in_window = ("rollout_decode",) if rollplex else ()
    fsdp, fused = mem.train_strategy == "fsdp", mem.fused_kernels

    prompts_rank = est.per_rank(batch.prompts, dp)
    prompts_engine = est.per_rank(batch.prompts, lay.rollout_dp)
    shared_kv = rollout_shares_prompt_kv(cfg)
    kv_tokens = est.rollout_kv_tokens(prompts_engine, batch.n, batch.padded_prompt_tokens, batch.response_tokens,
                                      shared_prompt=shared_kv, batch_prompts=max(1, cfg.rollout.max_batch_size // batch.n))
    kv_note = (f"{prompts_engine} prompts/engine x {batch.padded_prompt_tokens} tokens "
               + ("once" if shared_kv else f"x {batch.n}") + f" + {prompts_engine * batch.n} responses x "
               f"{batch.response_tokens} tokens ({'one prompt copy per group' if shared_kv else 'one cache per sequence'})")
    first_mini_rank = est.per_rank(batch.mini_batch_prompts, dp)
    micro_suffix = batch.micro_groups * batch.n * batch.response_tokens
    micro_prefix = batch.micro_groups * batch.prompt_tokens
    train_vision = 0 if cfg.model.freeze_vision_tower else 1
    stage_text = est.TransformerDims(**{**text.__dict__, "layers": est.per_rank(text.layers, pp)})
    kv_train = est.kv_bytes_per_token(stage_text, tp, pbytes)

    def prefix_acts(prompts: int) -> int:  # saved for backward (no recompute working set)
        recompute = mem.activation_recompute
        llm = est.stack_activation_bytes(stage_text, prompts * batch.prompt_tokens, tp, recompute,
                                         working_layer=False, elem_bytes=pbytes, fused=fused)
        vis = est.stack_activation_bytes(vision, prompts * batch.vision_patches, tp, recompute,
                                         working_layer=False, elem_bytes=pbytes, fused=fused)
        return llm + train_vision * vis

    actor_users = ("old_log_prob", "actor_update", "optimizer_step", "weight_sync") + in_window
    if shared:
        actor_users += ("rollout_decode",)
    groups = [
        TensorGroup("actor_weights", states["weights"], consumers=_ordered(actor_users),
                    note=f"{cfg.model.dtype} actor weights, {mem.train_strategy} t={tp} p={pp}"),
        TensorGroup("master_weights", states["master"],
                    consumers=_ordered(actor_users if fsdp else ("optimizer_step",)),
                    note="fp32 master copy" + (" (FSDP shards, gathered each pass)" if fsdp else "")),
        TensorGroup("optimizer_states", states["optimizer"], consumers=("optimizer_step",), note="Adam m and v, fp32"),
        TensorGroup("grads", states["grads"], kind="live", producer="actor_update", consumers=("optimizer_step",),
                    note="fp32 main grads"),
        TensorGroup("ref_weights", states["weights"] if not fsdp else pbytes * params // (tp * pp * dp) + states["weights"],
                    consumers=_ordered(("ref_log_prob",) + in_window), note=f"{cfg.model.dtype} reference, actor's layout"),
        TensorGroup("rollout_weights", 0 if shared else rollout_rank_bytes(cfg, hf_config),
                    consumers=() if shared else ("rollout_decode", "weight_sync"),
                    note="views of actor_weights" if shared else f"{cfg.model.dtype} copy, rollout t={lay.rollout_tp}"),
        TensorGroup("rollout_rebuilt", _rebuilt_bytes(cfg, hf_config) if shared else 0,
                    consumers=("rollout_decode", "weight_sync") if shared else (),
                    note=(f"share plan t={tp} -> r={lay.rollout_tp}: rebuilt/gathered rollout tensors"
                          if shared else "none: rollout_weights is a copy")),
        TensorGroup("rollout_kv", kv_tokens * est.kv_bytes_per_token(text, lay.rollout_tp, pbytes), kind="scratch",
                    consumers=("rollout_decode",), note=kv_note),
    ]
    for role, phase in (("old", "old_log_prob"), ("ref", "ref_log_prob")):
        groups.append(TensorGroup(f"{role}_prefix_kv", batch.prompt_tokens * kv_train, num_items=prompts_rank,
                                  kind="live", producer=in_window[0] if rollplex else phase, consumers=(phase,),
                                  note=f"{prompts_rank} prompts/rank x {batch.prompt_tokens} tokens"))
    prefix_items = first_mini_rank if rollplex else batch.micro_groups
    groups += [
        TensorGroup("actor_prefix_acts", prefix_acts(1), num_items=prefix_items, kind="live",
                    producer=in_window[0] if rollplex else "actor_update", consumers=("actor_update",),
                    note=f"{prefix_items} prompts, recompute={mem.activation_recompute}"),
        TensorGroup("vision_features", batch.micro_groups * batch.vision_tokens * text.hidden * pbytes,
                    kind="scratch", consumers=_ordered(in_window or ("old_log_prob", "ref_log_prob", "actor_update")),
                    note="merged vision embeddings of one prefix micro-batch"),
        TensorGroup("actor_activations", est.stack_activation_bytes(stage_text, micro_suffix, tp, mem.activation_recompute,
                                                               elem_bytes=pbytes, fused=fused),
                    kind="scratch", consumers=("actor_update",),
                    note=f"suffix of {batch.micro_groups} group(s): {micro_suffix} tokens"),
        TensorGroup("forward_scratch", est.stack_activation_bytes(
                        est.TransformerDims(**{**text.__dict__, "layers": 1}), micro_prefix + micro_suffix, tp, "none", elem_bytes=pbytes, fused=fused),
                    kind="scratch", consumers=("rollout_decode", "old_log_prob", "ref_log_prob") if rollplex
                    else ("old_log_prob", "ref_log_prob"), note="one layer's activations of a no-grad pass"),
        TensorGroup("logits", micro_suffix * est.logits_bytes_per_token(text, tp, pbytes), kind="scratch",
                    consumers=("old_log_prob", "ref_log_prob", "actor_update"),
                    note=f"{micro_suffix} tokens x V/t x ({cfg.model.dtype} + fp32)"),
    ]
    if lay.device == "cuda":  # a CPU run has no CUDA context and uses gloo
        groups.append(TensorGroup("runtime_reserved", int(mem.reserved_gib * est.GIB), consumers=PHASES,
                                  note="CUDA contexts, NCCL communicators (memory.reserved_gib)"))
    return groups


def _rebuilt_bytes(cfg: "Config", hf_config: Any) -> int:
    """Per-device bytes of the rollout buffers the share plan rebuilds (``sharing.report``)."""
    from rollplex_train.sharing.report import configured_device_totals, rebuilt_bytes_per_device

    return rebuilt_bytes_per_device(configured_device_totals(cfg, hf_config))


def _ordered(phases: tuple[str, ...]) -> tuple[str, ...]:
    """``phases`` without duplicates, in step order."""
    return tuple(p for p in PHASES if p in set(phases))
