"""HF <-> megatron-core weight conversion of the Qwen2-VL / Qwen2.5-VL language model.

The language model becomes an mcore ``GPTModel``; the vision tower stays the HF module, as in
Megatron-Bridge's ``Qwen25VLModel`` (``src/megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py``),
but tensor-parallel in SGLang's arrangement (``training/megatron/vision.py``). Which rows of which
HF tensor a rank holds is read from ``models/layouts.py``'s
``megatron`` layout (qkv interleaved per KV group, ``[gate_i; up_i]`` in ``linear_fc1``, the
vocabulary padded to ``make_vocab_size_divisible_by x tp``); this module only renames the layout's
tensors to ``GPTModel`` state-dict keys (the key names of megatron-core 0.16.1
``models/gpt/gpt_layer_specs.py``; cf. Megatron-Bridge ``qwen25_vl_bridge.py`` mapping registry and
verl ``verl/models/mcore/weight_converter.py``) and cuts/joins tensors.

Pure tensor code: no process groups, no megatron import.

Legend: t TP degree, i TP rank; "layout name" = a ``TensorSpec.name`` of the megatron layout.
"""

from __future__ import annotations

import re
import torch

from rollplex_train.models.layouts import Dims, Layout, TensorSpec, build_layout, reference_shard

# (layout-name pattern, GPTModel key) for the local layer spec; with Transformer Engine's spec the
# two pre-norms are fused into the following linears (``te_names=True``).
_LM = r"model\.language_model\."
_RULES = (
    (_LM + r"layers\.(\d+)\.self_attn\.linear_qkv\.(weight|bias)", r"decoder.layers.\1.self_attention.linear_qkv.\2"),
    (_LM + r"layers\.(\d+)\.self_attn\.linear_proj\.weight", r"decoder.layers.\1.self_attention.linear_proj.weight"),
    (_LM + r"layers\.(\d+)\.mlp\.linear_fc1\.weight", r"decoder.layers.\1.mlp.linear_fc1.weight"),
    (_LM + r"layers\.(\d+)\.mlp\.linear_fc2\.weight", r"decoder.layers.\1.mlp.linear_fc2.weight"),
    (_LM + r"layers\.(\d+)\.input_layernorm\.weight", r"decoder.layers.\1.input_layernorm.weight"),
    (_LM + r"layers\.(\d+)\.post_attention_layernorm\.weight", r"decoder.layers.\1.pre_mlp_layernorm.weight"),
    (_LM + r"norm\.weight", r"decoder.final_layernorm.weight"),
    (_LM + r"word_embeddings\.weight", r"embedding.word_embeddings.weight"),
    (r"output_layer\.weight", r"output_layer.weight"),
)
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def is_language_model(hf_name: str) -> bool:
    """True for HF parameters of the language model (and ``lm_head``), False for the vision tower."""
    return hf_name.startswith("model.language_model.") or hf_name.startswith("lm_head.")


def gpt_key(layout_name: str, te_names: bool = False) -> str:
    """The ``GPTModel`` state-dict key of a megatron-layout tensor of the language model.

    Raises:
        KeyError: the name is not a language-model tensor this converter knows.
    """
    for pattern, repl in _RULES:
        if re.fullmatch(pattern, layout_name):
            key = re.sub(pattern, repl, layout_name)
            if te_names:
                for old, new in _TE_NORMS.items():
                    key = key.replace(old, new)
            return key
    raise KeyError(f"no GPTModel key for {layout_name!r}")


def megatron_layout(shapes: dict[str, tuple[int, ...]], dims: Dims, tp: int, vocab_divisible_by: int) -> Layout:
    """The training layout of the Megatron backend at TP ``tp``: ``models/layouts.py``'s ``megatron``
    layout (``GPTModel`` tensors of the language model, the vision tower's HF modules split as
    SGLang splits them).

    Args:
        shapes: HF parameter shapes (tied embeddings once, ``models.arch.parameter_shapes``).

    Raises:
        ValueError: ``tp`` does not divide the heads, KV heads, padded vocabulary or vision widths.
    """
    return build_layout("megatron", tp, shapes, dims, vocab_divisible_by=vocab_divisible_by)


def vision_shards(full: dict[str, torch.Tensor], layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s vision-tower tensors of ``layout`` cut from full HF weights ``full`` (padding
    rows zero), ``{layout name: tensor}`` in the spec shapes, new storage."""
    return {n: reference_shard(s, full).clone() for n, s in layout.ranks[rank].items()
            if not is_language_model(_source(s))}


def _source(spec: TensorSpec) -> str:
    return spec.blocks[0].source


def lm_specs(layout: Layout, rank: int) -> dict[str, TensorSpec]:
    """The language-model specs of ``rank`` (vision tensors left out)."""
    return {n: s for n, s in layout.ranks[rank].items() if is_language_model(_source(s))}


def hf_to_megatron(full: dict[str, torch.Tensor], layout: Layout, rank: int, te_names: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``GPTModel`` tensors cut from full HF weights (padding rows zero).

    Args:
        full: ``{HF name: tensor}`` holding every language-model parameter of the layout.

    Returns:
        ``{GPTModel key: tensor}`` in the spec shapes, new storage (the HF tensors are not aliased).
    """
    return {gpt_key(n, te_names): reference_shard(s, full).clone() for n, s in lm_specs(layout, rank).items()}


def megatron_to_hf(rank_states: list[dict[str, torch.Tensor]], layout: Layout, te_names: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Join the ranks' ``GPTModel`` tensors back into full HF language-model tensors (the inverse of
    :func:`hf_to_megatron`: padding rows dropped, replicated tensors taken from rank 0).

    Args:
        rank_states: per TP rank ``{GPTModel key: tensor}`` (``len == layout.tp``).

    Returns:
        ``{HF name: tensor}`` float tensors in the ranks' dtype, HF shapes.

    Raises:
        ValueError: the number of rank states is not the layout's TP degree.
        KeyError: a rank lacks a tensor of its spec.
    """
    if len(rank_states) != layout.tp:
        raise ValueError(f"{len(rank_states)} rank states for a TP={layout.tp} layout")
    return join_ranks([{n: state[gpt_key(n, te_names)] for n in lm_specs(layout, rank)}
                       for rank, state in enumerate(rank_states)], layout)


def join_ranks(rank_tensors: list[dict[str, torch.Tensor]], layout: Layout) -> dict[str, torch.Tensor]:
    """Full HF tensors joined from the ranks' tensors of ``layout``: ``rank_tensors[i]`` maps layout
    names of rank i to tensors (any subset of its specs); padding rows are dropped, a replicated
    tensor is taken from the last rank holding it (the ranks hold the same values).

    Returns:
        ``{HF name: tensor}`` of every HF tensor the given specs cover, HF shapes, new storage.

    Raises:
        KeyError: a name that is not a spec of its rank.
    """
    out: dict[str, torch.Tensor] = {}
    for rank, tensors in enumerate(rank_tensors):
        for name, tensor in tensors.items():
            spec = layout.ranks[rank][name]
            local = tensor.reshape(spec.logical_shape)
            pos = 0
            for blk in spec.blocks:
                shape = layout.hf_shapes[blk.source]
                dst = out.get(blk.source)
                if dst is None:
                    dst = out[blk.source] = torch.empty(shape, dtype=local.dtype, device=local.device)
                real = max(0, min(blk.stop, shape[spec.dim]) - blk.start)
                if real:
                    dst.narrow(spec.dim, blk.start, real).copy_(local.narrow(spec.dim, pos, real))
                pos += blk.size
    return out


def layout_tensors(gpt_state: dict[str, torch.Tensor], vision: dict[str, torch.Tensor], layout: Layout,
                   rank: int, te_names: bool = False) -> dict[str, torch.Tensor]:
    """``{layout name: tensor}`` of one rank (what ``sharing.materialize.Materializer`` reads), the
    tensors themselves (no copy): ``GPTModel`` parameters and the HF vision tower's."""
    out = {}
    for name, spec in layout.ranks[rank].items():
        src = gpt_state[gpt_key(name, te_names)] if is_language_model(_source(spec)) else vision[name]
        out[name] = src.view(spec.shape)
    return out

