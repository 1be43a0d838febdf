"""One decode step of Qwen2.5-VL's text decoder for the built-in engine, with fused projections.

transformers' module stack costs a decode step more than its arithmetic on a small model: per layer
three q/k/v and two gate/up GEMMs of a few dozen rows each, module dispatch, mask building. This
step runs the same torch ops in the same order as ``Qwen2_5_VLTextModel.forward`` for one new token
per sequence over a KV cache (``transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py``,
transformers 5.x: ``Qwen2_5_VLDecoderLayer``, ``Qwen2_5_VLAttention``, ``Qwen2MLP``,
``Qwen2_5_VLRMSNorm``, ``apply_rotary_pos_emb``; the SDPA call as ``integrations/sdpa_attention.py``
makes it for one query token: no mask and ``enable_gqa`` when no position is padded, else a boolean
(B, 1, 1, T) mask with the query heads packed per key/value head), except that the q/k/v and the
gate/up weights are concatenated into one GEMM each. A GEMM's output columns do not depend on which
other columns it computes (MKL/oneDNN on CPU: each output element is the same K-reduction), so the
hidden states are bitwise those of the transformers forward (tests/test_rollout_decoder.py compares
them, padded and unpadded, on the tiny checkpoint), and so are the sampled tokens.

``scripts/bench_decode.py`` times the engine's ``generate`` with and without it (docs/benchmarks.md).

Only where it is exactly that forward: a Qwen2.5-VL text decoder (``Qwen2_5_VLTextModel``), SDPA
attention, no sliding-window layers, float32 compute on CPU, transformers >= 5.24 (whose SDPA path packs
the query heads per KV head, ``integrations/sdpa_attention.py::pack_gqa``; older releases repeat the KV
heads, a different summation order). Elsewhere ``FusedDecoder.unsupported``
names the reason and the engine keeps transformers' forward.

On a rank of a tensor-parallel engine (``rollout/tensor_parallel.py``) the same step runs over the
rank's heads: q/k/v and gate/up come fused as the rank holds them (no concatenated copy) and the
o/down partial products are summed over the group. With a ``SharedPromptCache``
(``rollout.share_prompt_kv``) attention reads each group's one prompt copy
(``rollout/shared_prefix.py``; not bitwise SDPA, see there).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rollplex_train.rollout.shared_prefix import SharedPromptCache


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``Qwen2_5_VLRMSNorm.forward``: x * rsqrt(mean(x^2) + eps) in float32, times the weight."""
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(hidden.dtype)


def _row_parallel_group(linear: torch.nn.Module):
    """The TP group whose ranks' partial products a row-parallel linear sums (None: a plain linear)."""
    tp = getattr(linear, "tp", None)
    return tp if tp is not None and tp.size > 1 else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedDecoder:
    """The text decoder of a Qwen2.5-VL model for one decode step, from its weights of the moment.

    The fused q/k/v and gate/up weights are copies: build a new decoder after the model's weights
    change (the engine builds one per request; weights never change during a request).

    Args:
        model: a ``Qwen2_5_VLForConditionalGeneration`` (``model.model.language_model`` is the text
            decoder) that ``unsupported`` accepts.
    """

    def __init__(self, model: torch.nn.Module):
        self.text = model.model.language_model
        self.layers = []
        for layer in self.text.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # a tensor-parallel rank (rollout/tensor_parallel.py) holds them fused already: no copy
            w_qkv, b_qkv = getattr(attn, "fused_qkv", None) or (
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach())
            w_gate_up = getattr(mlp, "fused_gate_up", None)
            if w_gate_up is None:
                w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            self.layers.append((
                layer, attn, w_qkv, b_qkv, w_gate_up, attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                _row_parallel_group(attn.o_proj), _row_parallel_group(mlp.down_proj),
            ))

    @staticmethod
    def unsupported(model: torch.nn.Module, device: torch.device, compute_dtype: str) -> Optional[str]:
        """Why this decoder is not the model's transformers forward here (None: it is)."""
        text = getattr(getattr(model, "model", None), "language_model", None)
        if type(text).__name__ != "Qwen2_5_VLTextModel":
            return f"text decoder {type(text).__name__}: only Qwen2_5_VLTextModel"
        if text.config._attn_implementation != "sdpa":
            return f"attn_implementation={text.config._attn_implementation!r}: only 'sdpa'"
        if getattr(text, "has_sliding_layers", False):
            return "sliding-window layers"
        if device.type != "cpu" or compute_dtype != "float32":
            return f"{device.type} / compute_dtype={compute_dtype}: only float32 on CPU"
        if any(p.dtype != torch.float32 for p in text.parameters()):
            return "parameters not float32"
        from transformers.integrations import sdpa_attention

        if not hasattr(sdpa_attention, "pack_gqa"):  # transformers < 5.24 repeats the KV heads instead
            return "transformers' SDPA decode without pack_gqa (< 5.24): not the fused step's op order"
        return None

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             cache) -> torch.Tensor:
        """The final-norm hidden state of one new token per sequence; appends its keys/values to ``cache``.

        Args:
            token_ids: (B,) int64, the tokens sampled last.
            attention_mask: (B, T) int64, 1 for real positions, T = cached tokens + 1 (left padding).
            position_ids: (3, B, 1) int64 M-RoPE positions of the new tokens.
            cache: the transformers ``Cache`` of the B sequences (``rollout/kv_cache.py``), or a
                ``SharedPromptCache`` (then ``attention_mask`` is not read: the cache masks its prompts).

        Returns:
            (B, H) float32.
        """
        hidden = self.text.embed_tokens(token_ids.view(-1, 1))
        cos, sin = self.text.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        batch = hidden.shape[0]
        shared = isinstance(cache, SharedPromptCache)
        mask = None if shared or bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        for index, (layer, attn, w_qkv, b_qkv, w_gate_up, n_q, n_k, o_tp, down_tp) in enumerate(self.layers):
            residual = hidden
            x = _rms_norm(layer.input_layernorm, hidden)
            qkv = F.linear(x, w_qkv, b_qkv)
            d = attn.head_dim
            q = qkv[..., :n_q].view(batch, 1, -1, d).transpose(1, 2)
            k = qkv[..., n_q:n_q + n_k].view(batch, 1, -1, d).transpose(1, 2)
            v = qkv[..., n_q + n_k:].view(batch, 1, -1, d).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, index)
            if shared:  # the group's one prompt copy + this sequence's response (rollout/shared_prefix.py)
                out = cache.attend(index, q, attn.scaling).transpose(1, 2)
            elif mask is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=attn.scaling,
                                                     is_causal=False, enable_gqa=True).transpose(1, 2)
            else:  # one query token: its heads packed per key/value head (transformers' pack_gqa)
                groups = attn.num_key_value_groups
                packed = q.reshape(batch, q.shape[1] // groups, groups, d)
                out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, dropout_p=0.0,
                                                     scale=attn.scaling, is_causal=False)
            o = F.linear(out.reshape(batch, 1, -1).contiguous(), attn.o_proj.weight)
            hidden = residual + (o if o_tp is None else o_tp.all_reduce_(o))
            residual = hidden
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gate_up = F.linear(x, w_gate_up)
            half = gate_up.shape[-1] // 2
            down = F.linear(F.silu(gate_up[..., :half]) * gate_up[..., half:], layer.mlp.down_proj.weight)
            hidden = residual + (down if down_tp is None else down_tp.all_reduce_(down))
        return _rms_norm(self.text.norm, hidden)[:, -1]
