"""The weight payload of an SGLang rollout engine: per rollout TP rank, SGLang's parameter names
and shapes, serialized the way SGLang's ``update_weights_from_tensor`` reads them. Pure Python +
torch: nothing here imports SGLang.

Written against SGLang 0.5.23 (the wheel, read, not run here):

* ``srt/model_executor/model_runner_components/weight_updater.py``: ``update_weights_from_tensor
  (named_tensors, load_format)`` unwraps each value that is a ``LocalSerializedTensor`` (``values``:
  one ``MultiprocessingSerializer`` payload per TP rank) to ``values[tp_rank]``, moves it to the
  rank's device and, with ``load_format="direct"``, copies it into ``named_parameters()[name]``
  (``default_weight_loader`` asserts equal shapes; an unknown name is a ``KeyError`` inside the
  scheduler). So a ``direct`` payload holds, per rank, exactly that rank's shard under SGLang's
  parameter name. (``load_format=None`` and ``"flattened_bucket"`` go through
  ``Qwen2_5_VLForConditionalGeneration.load_weights`` instead, which takes *full* HF tensors, shards
  them itself and skips names it does not know, except that it renames the language model's q/k/v
  and every gate/up projection to the stacked ``qkv_proj``/``gate_up_proj`` and indexes those
  unchecked: an unknown one is a ``KeyError``. The optional ``flattened_bucket`` format at the end
  of this module sends full tensors that way, every name checked first.)
* ``srt/weight_sync/utils.py::update_weights`` (the helper verl's ``sglang_rollout`` calls): each
  TP rank serializes its own tensor, ``LocalSerializedTensor(values=[rank 0's, rank 1's, ...])``
  per name, the producer's torch reductions patched (``monkey_patch_torch_reductions``: CUDA
  devices named by UUID). ``per_rank_entries`` builds exactly those ``values``. verl and slime
  (``backends/sglang_utils``, with ``FlattenedTensorBucket`` + ``load_format="flattened_bucket"``)
  send *full* HF tensors and let ``load_weights`` shard them; here each rank gets only its shard.
* ``srt/utils/common.py::MultiprocessingSerializer.serialize``: ``ForkingPickler(buf).dump(obj)``
  with torch's reductions (``torch.multiprocessing.reductions``: a CUDA tensor becomes a CUDA IPC
  handle, a CPU tensor a shared-memory handle); ``deserialize`` is a ``SafeUnpickler`` that allows
  torch's rebuild functions, builtins and a few SGLang containers only.
* ``srt/entrypoints/engine.py``: ``update_weights_from_tensor`` must run between
  ``begin_weight_update()`` and ``end_weight_update()`` (``success=False`` otherwise, 0.5.23's
  ``scheduler_components/weight_updater.py``); ``flush_cache`` is taken per call.

Shapes and names: ``models.layouts`` builds the ``sglang`` layout (``QKVParallelLinear``,
``MergedColumnParallelLinear``, vocab padded to 64, or 64 x TP where TP does not divide that,
vision MLP padded to 8); its names keep the HF
module path, so ``sglang_name`` maps transformers' prefixes to the module paths of SGLang's
``Qwen2_5_VLForConditionalGeneration`` (``model.`` = its ``Qwen2Model``, ``visual.``, ``lm_head``).
The test ``tests/test_rollout_sglang.py`` pins the result to SGLang's own parameter list
(``tests/data/sglang_0.5.23_qwen2_5_vl_params.json``, derived from SGLang's model code).
"""

from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

from rollplex_train.models.layouts import Dims, Layout, build_layout, reference_shard
from rollplex_train.sharing.materialize import Fetch, Materializer
from rollplex_train.sharing.plan import SharePlan

HF_TO_SGLANG_PREFIX = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers 5 module paths of Qwen2.5-VL -> SGLang 0.5.23's (``qwen2_5_vl.py``: ``self.model =
Qwen2Model(prefix="model")``, ``self.visual``, ``self.lm_head``)."""

LOAD_FORMAT = "direct"


def sglang_name(layout_name: str) -> str:
    """The SGLang parameter name of a ``sglang``-layout tensor name (HF module path, SGLang leaf)."""
    for hf, sgl in HF_TO_SGLANG_PREFIX:
        if layout_name.startswith(hf):
            return sgl + layout_name[len(hf):]
    return layout_name


def sglang_layout(shapes: dict[str, tuple[int, ...]], dims: Dims, tp: int) -> Layout:
    """SGLang's TP layout of HF parameters ``shapes`` (``models.arch.parameter_shapes``) at ``tp``
    (fused ``qkv_proj`` and ``gate_up_proj``, the modules SGLang builds).

    Raises:
        ValueError: ``tp`` does not divide the heads / vocabulary / MLP width (``build_layout``).
    """
    return build_layout("sglang", tp, shapes, dims)


def expected_params(layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    """``{SGLang parameter name: shape}`` of TP rank ``rank`` (what ``named_parameters()`` of that
    rank's SGLang model holds, tied weights once)."""
    return {sglang_name(name): tuple(spec.shape) for name, spec in layout.ranks[rank].items()}


def check_rank_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], rank: int) -> None:
    """Refuse a payload SGLang's ``direct`` loader would fail on (or only partly load).

    Raises:
        ValueError: names missing or unknown, or shapes that differ (first few of each listed).
    """
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    wrong = sorted(f"{n} {tuple(t.shape)} != {expected[n]}" for n, t in tensors.items()
                   if n in expected and tuple(t.shape) != expected[n])
    if missing or unknown or wrong:
        raise ValueError(f"SGLang weight payload of TP rank {rank} does not match the model: "
                         f"missing={missing[:5]} ({len(missing)}) unknown={unknown[:5]} ({len(unknown)}) "
                         f"wrong_shape={wrong[:5]} ({len(wrong)})")


def shard_state_dict(full: dict[str, torch.Tensor], layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s tensors cut from full HF weights (the ``sharing.enabled=false`` path, or
    a mapped HF state dict): ``{SGLang name: tensor}``, padding rows zero. Copies (``torch.cat``)
    where a tensor is made of several blocks or padded, views otherwise.

    Raises:
        ValueError: ``full`` lacks a tensor the layout needs, has one the model does not (a tied
            ``lm_head.weight`` is accepted and not sent: SGLang ties it too), or one of another
            shape (checked before anything is cut: a short tensor would otherwise be zero-padded).
    """
    needed = {b.source for spec in layout.ranks[rank].values() for b in spec.blocks}
    missing = sorted(needed - set(full))
    unknown = sorted(set(full) - set(layout.hf_shapes) - {"lm_head.weight"})
    wrong = sorted(f"{n} {tuple(full[n].shape)} != {layout.hf_shapes[n]}" for n in needed
                   if n in full and tuple(full[n].shape) != tuple(layout.hf_shapes[n]))
    if missing or unknown or wrong:
        raise ValueError(f"weights for SGLang do not match the model: lack {len(missing)} HF tensors {missing[:5]}, "
                         f"unknown {unknown[:5]}, wrong_shape {wrong[:5]}")
    return {sglang_name(name): reference_shard(spec, full) for name, spec in layout.ranks[rank].items()}


def shard_from_plan(plan: SharePlan, train_rank: int, rollout_rank: int, local: dict[str, torch.Tensor],
                    fetch: Optional[Fetch] = None) -> tuple[Materializer, dict[str, torch.Tensor]]:
    """Rollout rank ``rollout_rank``'s tensors on the device of training rank ``train_rank``, from
    that rank's own shards (``local``, training-layout names): views where the share plan found
    them, rebuild buffers otherwise (``Materializer``; call its ``sync()`` after each optimizer step
    to refresh the buffers). Returns the materializer and ``{SGLang name: tensor}``.

    Raises:
        ValueError: the plan's rollout layout is not SGLang's fused one (``split_qkv`` /
            ``split_gate_up`` describe tensors SGLang's model does not have), or the pair is not
            one of the plan's devices; the materializer's errors.
    """
    if plan.rollout.kind != "sglang":
        raise ValueError(f"share plan rolls out to {plan.rollout.kind!r}, not 'sglang'")
    if (train_rank, rollout_rank) not in plan.tensors:
        raise ValueError(f"(training rank {train_rank}, rollout rank {rollout_rank}) is not a device of the "
                         f"share plan: {sorted(plan.tensors)}")
    grouped = sorted(n for n, s in plan.rollout.ranks[rollout_rank].items()
                     if s.groups or n.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")))
    if grouped:
        raise ValueError(f"sharing.split_qkv/split_gate_up tensors ({grouped[:2]}...) are not SGLang parameters: "
                         "plan the SGLang engine with both off")
    mat = Materializer(plan.tensors[(train_rank, rollout_rank)], local, fetch=fetch)
    return mat, {sglang_name(n): t for n, t in mat.tensors.items()}


def serialize(obj) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize(obj)`` (0.5.23, ``output_str=False``):
    ``ForkingPickler`` with torch's reductions, so tensors travel as IPC handles, not data."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def per_rank_entries(per_rank: list[dict[str, torch.Tensor]]) -> list[tuple[str, list[bytes]]]:
    """``[(SGLang name, [payload of rank 0, ..., rank r-1])]``: the ``values`` of one
    ``LocalSerializedTensor`` per parameter, in rank 0's order. Each payload is one tensor's
    handle (a few hundred bytes), to be loaded by that rank only.

    Raises:
        ValueError: the ranks hold different parameter names.
    """
    names = list(per_rank[0])
    for rank, tensors in enumerate(per_rank[1:], 1):
        if set(tensors) != set(names):
            raise ValueError(f"TP rank {rank} holds other parameters than rank 0: "
                             f"{sorted(set(tensors) ^ set(names))[:5]}")
    return [(name, [serialize(tensors[name]) for tensors in per_rank]) for name in names]


def buckets(per_rank: list[dict[str, torch.Tensor]], bucket_bytes: int) -> list[list[str]]:
    """Parameter names cut into consecutive buckets of at most ``bucket_bytes`` (rank 0's bytes; a
    larger tensor gets a bucket of its own): one ``update_weights_from_tensor`` call each."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in per_rank[0].items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return [b for b in out if b]


def build_update_calls(per_rank: list[dict[str, torch.Tensor]], wrap: Callable[[list[bytes]], object],
                       bucket_bytes: int = 512 * 1024**2) -> list[list[tuple[str, object]]]:
    """The ``named_tensors`` argument of each ``update_weights_from_tensor(..., load_format=
    "direct")`` call: ``[(name, wrap(values))]`` per bucket, ``wrap`` being SGLang's
    ``LocalSerializedTensor(values=...)`` in the engine (any callable in tests)."""
    entries = dict(per_rank_entries(per_rank))
    return [[(name, wrap(entries[name])) for name in bucket] for bucket in buckets(per_rank, bucket_bytes)]


# ---- the full-tensor alternative: FlattenedTensorBucket + load_weights ------------------------------

FLATTENED_LOAD_FORMAT = "flattened_bucket"
ALIGN_BYTES = 16

_STACKED = ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
            ("gate_up_proj", "up_proj"), ("gate_up_proj", "gate_proj"))
"""``stacked_params_mapping`` of SGLang 0.5.23 ``qwen2_5_vl.py::load_weights`` (param, checkpoint name)."""


def load_weights_target(name: str) -> str:
    """The SGLang parameter ``Qwen2_5_VLForConditionalGeneration.load_weights`` (0.5.23) loads a
    checkpoint tensor ``name`` (SGLang's checkpoint naming: ``model.layers.*``, ``visual.*``,
    ``lm_head``) into: its stacked-parameter loop (q/k/v -> ``qkv_proj`` except in the vision tower,
    gate/up -> ``gate_up_proj``), else ``attn.qkv.`` -> ``attn.qkv_proj.`` in the vision tower. A
    stacked target that is not a parameter is a ``KeyError`` in SGLang; any other one is skipped
    without a word."""
    for param, weight in _STACKED:
        if weight not in name:
            continue
        if "visual" in name and "up_proj" not in name and "gate_proj" not in name:
            continue
        return name.replace(weight, param)
    return name.replace("attn.qkv.", "attn.qkv_proj.") if "visual" in name else name


def check_full_tensors(full: dict[str, torch.Tensor], layout: Layout) -> list[str]:
    """The HF names to send as full tensors (a tied ``lm_head`` dropped), after checking that each
    has its HF shape and lands on an SGLang parameter, and that every parameter gets one (what
    ``load_weights`` would otherwise skip or leave stale silently).

    Raises:
        ValueError: names that land nowhere, parameters nothing lands on, or wrong shapes.
    """
    names = [n for n in full if n in layout.hf_shapes]
    unknown = sorted(set(full) - set(names) - {"lm_head.weight"})
    wrong = sorted(f"{n} {tuple(full[n].shape)} != {layout.hf_shapes[n]}" for n in names
                   if tuple(full[n].shape) != tuple(layout.hf_shapes[n]))
    params = set(expected_params(layout, 0))
    targets = {n: load_weights_target(sglang_name(n)) for n in names}
    unknown += sorted(n for n, t in targets.items() if t not in params)
    untouched = sorted(params - set(targets.values()))
    if unknown or untouched or wrong:
        raise ValueError(f"full weights for SGLang's load_weights do not match the model: unknown {unknown[:5]}, "
                         f"no tensor for {untouched[:5]}, wrong_shape {wrong[:5]}")
    return names


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[dict]]:
    """SGLang 0.5.23's ``FlattenedTensorBucket(named_tensors=...)`` layout (``srt/weight_sync/
    tensor_bucket.py``): every tensor ``flatten().view(uint8)``, concatenated; per tensor the
    ``FlattenedTensorMetadata`` fields ``name, shape, dtype, start_idx, end_idx, numel`` (bytes).
    Returns the (B,) uint8 tensor and the metadata as dicts (the engine builds SGLang's objects).
    Unlike SGLang's constructor, each tensor starts at a multiple of ``ALIGN_BYTES`` (zero bytes in
    between): ``reconstruct_tensors`` views each slice as its dtype, which fails at an offset that
    is not a multiple of the item size (an int64 after an odd count of bf16 values)."""
    parts, metas, offset = [], [], 0
    for name, tensor in named:
        gap = -offset % ALIGN_BYTES
        if gap:
            parts.append(torch.zeros(gap, dtype=torch.uint8, device=tensor.device))
            offset += gap
        flat = tensor.contiguous().flatten().view(torch.uint8)
        metas.append({"name": name, "shape": tensor.shape, "dtype": tensor.dtype, "start_idx": offset,
                      "end_idx": offset + flat.numel(), "numel": flat.numel()})
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), metas


def unflatten_bucket(flat: torch.Tensor, metas: list) -> list[tuple[str, torch.Tensor]]:
    """The inverse, as SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` computes it."""
    get = (lambda m, k: m[k]) if metas and isinstance(metas[0], dict) else getattr
    return [(get(m, "name"), flat[get(m, "start_idx"):get(m, "end_idx")].view(get(m, "dtype")).reshape(get(m, "shape")))
            for m in metas]
