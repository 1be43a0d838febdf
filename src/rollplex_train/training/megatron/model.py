"""Qwen2-VL / Qwen2.5-VL on megatron-core: HF vision tower + mcore ``GPTModel`` language model.

The arrangement of Megatron-Bridge's ``Qwen25VLModel`` (``src/megatron/bridge/models/qwen_vl/
modeling_qwen25_vl.py``): the HF vision tower encodes images/videos, its features replace the
placeholder embeddings, and an mcore ``GPTModel`` with ``position_embedding_type="mrope"`` runs the
language model on ``decoder_input``. Positions are never derived inside Megatron: the callers pass
the (3, B, S) M-RoPE position ids of ``models/sequence.py::rope_positions``.

Each decoder layer's ``core_attention`` is wrapped by :class:`PrefixAttention`, which can record the
layer's post-RoPE keys/values (a prefix pass) or put recorded ones in front of the current keys/
values (a suffix pass): the prefix/suffix decomposition's KV cache, with autograd kept through it.

Legend: B batch rows, S tokens, H hidden, V padded vocabulary, V/t its TP shard, Ng KV heads of
the rank, Dh head dim. Megatron activations are sequence-first ``[S, B, H]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def has_transformer_engine() -> bool:
    """True where Transformer Engine imports (its layer spec is then used on CUDA)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def transformer_config(hf_config, *, tp: int, pp: int, dtype: torch.dtype, on_cpu: bool, fused: bool = False):
    """The mcore ``TransformerConfig`` of the checkpoint's language model.

    Field meanings: megatron-core 0.16.1 ``transformer/transformer_config.py``; the Qwen2 mapping
    (RMSNorm, SwiGLU, qkv bias only, no linear bias) as Megatron-Bridge ``qwen25_vl_bridge.py`` /
    verl ``verl/models/mcore/config_converter.py::hf_to_mcore_config_qwen2_5_vl``.
    ``calculate_per_token_loss=True`` makes Megatron DDP *sum* gradients over DP ranks (the loss of
    every rank is already normalised by the global token/sequence counts).

    Args:
        on_cpu: build the weights on the CPU (``use_cpu_initialization``).
        fused: turn on megatron's fused kernels (bias+activation, bias+dropout, masked softmax,
            persistent layer norm); they need CUDA and apex/Transformer Engine, so only with TE.
    """
    from megatron.core.transformer import TransformerConfig

    text = hf_config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return TransformerConfig(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, ffn_hidden_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads, num_query_groups=text.num_key_value_heads,
        kv_channels=head_dim, normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=True, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0, mrope_section=list(rope["mrope_section"]),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, calculate_per_token_loss=True,
        # perform_initialization stays on: mcore sets the ``tensor_model_parallel`` attributes of the
        # split weights only while initialising them (tensor_parallel/layers.py); the gradient norm
        # reads them. The random values are overwritten by the converter.
        use_cpu_initialization=on_cpu,
        # the fused kernels are CUDA + apex/TE only (training/megatron/cpu_patches.py, item 3)
        bias_activation_fusion=fused, bias_dropout_fusion=fused, masked_softmax_fusion=fused,
        apply_rope_fusion=False, persist_layer_norm=fused, gradient_accumulation_fusion=False,
    )


def build_gpt_model(hf_config, config, padded_vocab: int, use_te: bool):
    """The language model as an mcore ``GPTModel`` (random weights: load them with the converter).

    Args:
        padded_vocab: vocabulary rows after padding to ``make_vocab_size_divisible_by x tp``.
        use_te: Transformer Engine layer spec (CUDA) instead of the local spec (CPU).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    text = hf_config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    spec = (get_gpt_layer_with_transformer_engine_spec() if use_te
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab,
        max_sequence_length=text.max_position_embeddings, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="mrope", rotary_base=int(rope.get("rope_theta", 10000.0)), parallel_output=True,
    )
    ctx = KVContext()
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.core_attention = PrefixAttention(layer.self_attention.core_attention, ctx, i)
    model.kv_context = ctx
    return model


@dataclass
class KVContext:
    """What the wrapped attention layers do in the current forward.

    Attributes:
        mode: ``None`` (plain), ``record`` (keep each layer's keys/values in ``recorded``) or
            ``extend`` (prepend ``prefix[l]`` to layer l's keys/values and use ``mask``).
        recorded: per layer ``(key, value)`` ``[S, B, Ng, Dh]`` of the last ``record`` forward.
        prefix: per layer ``(key, value)`` ``[Lp, B, Ng, Dh]`` for ``extend``.
        mask: ``[B, 1, S, Lp + S]`` bool, True = masked, for ``extend``.
    """

    mode: Optional[str] = None
    recorded: dict = field(default_factory=dict)
    prefix: list = field(default_factory=list)
    mask: Optional[torch.Tensor] = None


class PrefixAttention(torch.nn.Module):
    """Wraps one layer's mcore core attention (``DotProductAttention`` or TE's) to record or extend
    its post-RoPE keys/values (see :class:`KVContext`); the same call otherwise.

    mcore ``transformer/attention.py::Attention.forward`` applies RoPE to q/k and then calls
    ``core_attention(query [Sq, B, Nq, Dh], key [Sk, B, Ng, Dh], value, attention_mask, ...)``;
    ``DotProductAttention`` accepts Sk != Sq with an explicit ``[B, 1, Sq, Sk]`` mask.
    """

    def __init__(self, inner: torch.nn.Module, ctx: KVContext, layer: int):
        super().__init__()
        self.inner, self.layer = inner, layer
        self.__dict__["ctx"] = ctx  # shared, not a submodule

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        ctx = self.ctx
        if ctx.mode == "record":
            ctx.recorded[self.layer] = (key, value)
        elif ctx.mode == "extend":
            pk, pv = ctx.prefix[self.layer]
            key, value = torch.cat([pk, key], dim=0), torch.cat([pv, value], dim=0)
            attention_mask = ctx.mask
        if attention_mask is not None and "attn_mask_type" in kwargs and not self._reads_mask():
            # Transformer Engine's attention ignores the mask under the spec's ``causal`` type; ours
            # holds padding (and the prefix) too. Untested here: no TE on CPU.
            from megatron.core.transformer.enums import AttnMaskType

            kwargs["attn_mask_type"] = AttnMaskType.arbitrary
        return self.inner(query, key, value, attention_mask, *args, **kwargs)

    def _reads_mask(self) -> bool:
        """mcore's local ``DotProductAttention`` always applies a given mask (``attn_mask_type`` unused)."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return isinstance(self.inner, DotProductAttention)


class MegatronVLM(torch.nn.Module):
    """HF vision tower + mcore ``GPTModel``; the HF shell (config, ``get_rope_index``,
    ``get_image_features``) is kept unregistered as ``hf``.

    Attributes:
        visual: the HF vision tower, TP-split in SGLang's arrangement (``vision.py``).
        language_model: the mcore ``GPTModel`` (TP-sharded).
        vocab_size: real vocabulary rows (the padded ones are masked out of every softmax).
    """

    def __init__(self, hf_shell, gpt, vocab_size: int):
        super().__init__()
        self.visual = hf_shell.model.visual
        self.language_model = gpt
        self.vocab_size = vocab_size
        self.__dict__["hf"] = hf_shell

    @property
    def config(self):
        """The HF config (``models/sequence.py`` reads token ids and the vision geometry from it)."""
        return self.hf.config

    @property
    def model(self):
        """The HF inner model (``get_rope_index``, ``get_image_features``) without its language model."""
        return self.hf.model

    def embed(self, input_ids: torch.Tensor, vision, vision_grad: bool, vision_mask=None) -> torch.Tensor:
        """``[S, B, H]`` decoder input: vocab-parallel token embeddings with the vision features
        scattered into the placeholder slots (``models/sequence.py::embed_with_vision``; only
        ``vision_mask`` tokens, the prompt's, may be slots)."""
        from rollplex_train.models.sequence import embed_with_vision

        embeds = embed_with_vision(self, input_ids, vision, vision_grad, vision_mask=vision_mask,
                                   embed_tokens=self.language_model.embedding.word_embeddings)
        return embeds.transpose(0, 1).contiguous()

    def decode(self, decoder_input: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the decoder (final norm included).

        Args:
            decoder_input: ``[S, B, H]``; position_ids: (3, B, S) int64 M-RoPE positions;
            mask: ``[B, 1, S, Sk]`` bool, True where a query must not see a key.

        Returns:
            ``[S, B, H]`` final hidden states.
        """
        gpt = self.language_model
        rotary = gpt.rotary_pos_emb(position_ids, gpt.mrope_section)
        return gpt.decoder(hidden_states=decoder_input, attention_mask=mask, rotary_pos_emb=rotary)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., V/t) logits of this rank's vocabulary shard (never gathered)."""
        gpt = self.language_model
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(hidden, weight=weight)
        return logits


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool (True = masked): causal and no attention to padding keys.

    Args:
        attention_mask: (B, S) int, 1 on real tokens (left or right padding).
    """
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    return ~allowed.unsqueeze(1)
