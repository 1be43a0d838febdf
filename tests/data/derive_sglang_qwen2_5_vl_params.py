"""Derive SGLang 0.5.23's parameter list of Qwen2.5-VL (names and per-TP-rank shapes) -> JSON.

Written by reading the sglang 0.5.23 wheel (``sglang/_version.py``: ``__version__ = '0.5.23'``),
independently of ``rollplex_train.models.layouts`` (the test compares the two). Each rule names the
SGLang line it follows; every module below is constructed by
``python/sglang/srt/models/qwen2_5_vl.py::Qwen2_5_VLForConditionalGeneration.__init__``:

* ``self.model = Qwen2Model(config, prefix="model")`` (``models/qwen2.py``):
  ``embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size)`` -> rows
  ``pad_vocab_size(vocab, 64) / tp`` (``layers/vocab_parallel_embedding.py``:
  ``DEFAULT_VOCAB_PADDING_SIZE = 64``; ``VocabParallelEmbedding.__init__`` multiplies the padding by
  tp when tp does not divide ``pad_vocab_size(vocab, 64)``); per layer ``input_layernorm``/``post_attention_layernorm =
  RMSNorm(hidden)`` (``weight``); ``self_attn.qkv_proj = QKVParallelLinear(hidden, head_dim, nq, nkv,
  bias=True)`` -> rows ``(nq/tp + 2 * kv_per_rank) * head_dim`` with ``kv_per_rank = 1`` when
  ``tp >= nkv`` (``layers/linear.py``: ``num_kv_head_replicas``) else ``nkv/tp``;
  ``self_attn.o_proj = RowParallelLinear(nq*head_dim, hidden, bias=False)`` -> ``(hidden, nq*hd/tp)``;
  ``mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [I]*2, bias=False)`` -> ``(2*I/tp, hidden)``;
  ``mlp.down_proj = RowParallelLinear(I, hidden, bias=False)``; ``norm = RMSNorm(hidden)``.
* ``self.lm_head = ParallelLMHead(vocab, hidden)`` unless ``tie_word_embeddings`` (then it *is*
  ``model.embed_tokens`` and ``named_parameters()`` lists it once, under ``model.embed_tokens``).
* ``self.visual = Qwen2_5_VisionTransformer(vision_config, prefix="visual")``:
  ``patch_embed.proj = Conv3dLayer(in_channels, hidden, kernel=(tps, ps, ps), bias=False)``
  (``layers/conv.py``: ``weight`` of shape ``(out, in, *kernel)``); ``mlp_hidden_size =
  ((intermediate_size + 7) // 8) * 8``; per block ``norm1``/``norm2 = RMSNorm``; ``attn =
  VisionAttention(use_qkv_parallel=True, proj_bias=True, qkv_bias=True)``
  (``layers/attention/vision.py``: ``qkv_proj = QKVParallelLinear(hidden, head, heads, heads)``,
  ``proj = RowParallelLinear(heads*head, hidden, bias=True)``); ``mlp = Qwen2_5_VLMLP(bias=True,
  fuse_gate_up=True)`` -> ``gate_up_proj`` (MergedColumnParallelLinear) and ``down_proj``
  (RowParallelLinear); ``merger = Qwen2_5_VisionPatchMerger``: ``ln_q = RMSNorm(hidden)``,
  ``mlp.0 = ColumnParallelLinear(hidden*m^2, heads*head*m^2, bias=True)``, ``mlp.2 =
  RowParallelLinear(heads*head*m^2, out_hidden_size, bias=True)`` (m = spatial_merge_size).
  Row-parallel biases are whole on every rank.

Run: ``python tests/data/derive_sglang_qwen2_5_vl_params.py`` (rewrites the JSON next to it).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "sglang_0.5.23_qwen2_5_vl_params.json"
ROOT = HERE.parents[1]


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _div(a: int, b: int) -> int:
    assert a % b == 0, (a, b)
    return a // b


def sglang_params(text: dict, vision: dict, tie: bool, tp: int) -> dict[str, list[int]]:
    """``{name: shape}`` of one TP rank of SGLang's Qwen2_5_VLForConditionalGeneration."""
    h, nq, nkv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    hd = text.get("head_dim") or h // nq
    inter, vocab = text["intermediate_size"], text["vocab_size"]
    kv_rank = 1 if tp >= nkv else _div(nkv, tp)
    rows = _pad(vocab, 64) if _pad(vocab, 64) % tp == 0 else _pad(vocab, 64 * tp)
    p: dict[str, list[int]] = {"model.embed_tokens.weight": [_div(rows, tp), h]}
    for i in range(text["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        p[pre + "self_attn.qkv_proj.weight"] = [(_div(nq, tp) + 2 * kv_rank) * hd, h]
        p[pre + "self_attn.qkv_proj.bias"] = [(_div(nq, tp) + 2 * kv_rank) * hd]
        p[pre + "self_attn.o_proj.weight"] = [h, _div(nq * hd, tp)]
        p[pre + "mlp.gate_up_proj.weight"] = [2 * _div(inter, tp), h]
        p[pre + "mlp.down_proj.weight"] = [h, _div(inter, tp)]
        p[pre + "input_layernorm.weight"] = [h]
        p[pre + "post_attention_layernorm.weight"] = [h]
    p["model.norm.weight"] = [h]
    if not tie:
        p["lm_head.weight"] = [_div(rows, tp), h]
    vh, heads = vision["hidden_size"], vision["num_heads"]
    vhd = vh // heads
    vinter = _pad(vision["intermediate_size"], 8)
    m2 = vision["spatial_merge_size"] ** 2
    ps, tps = vision["patch_size"], vision["temporal_patch_size"]
    p["visual.patch_embed.proj.weight"] = [vh, vision.get("in_channels", vision.get("in_chans", 3)), tps, ps, ps]
    for i in range(vision["depth"]):
        pre = f"visual.blocks.{i}."
        p[pre + "norm1.weight"] = [vh]
        p[pre + "norm2.weight"] = [vh]
        p[pre + "attn.qkv_proj.weight"] = [3 * _div(heads, tp) * vhd, vh]
        p[pre + "attn.qkv_proj.bias"] = [3 * _div(heads, tp) * vhd]
        p[pre + "attn.proj.weight"] = [vh, _div(heads * vhd, tp)]
        p[pre + "attn.proj.bias"] = [vh]
        p[pre + "mlp.gate_up_proj.weight"] = [2 * _div(vinter, tp), vh]
        p[pre + "mlp.gate_up_proj.bias"] = [2 * _div(vinter, tp)]
        p[pre + "mlp.down_proj.weight"] = [vh, _div(vinter, tp)]
        p[pre + "mlp.down_proj.bias"] = [vh]
    p["visual.merger.ln_q.weight"] = [vh]
    p["visual.merger.mlp.0.weight"] = [_div(heads * vhd * m2, tp), vh * m2]
    p["visual.merger.mlp.0.bias"] = [_div(heads * vhd * m2, tp)]
    p["visual.merger.mlp.2.weight"] = [vision["out_hidden_size"], _div(heads * vhd * m2, tp)]
    p["visual.merger.mlp.2.bias"] = [vision["out_hidden_size"]]
    return p


def main() -> None:
    cfg = json.loads((ROOT / "conf" / "hf" / "qwen2_5_vl_7b_instruct.json").read_text())
    text = {k: v for k, v in cfg.items() if k != "vision_config"}
    out = {
        "sglang_version": "0.5.23",
        "model": "Qwen/Qwen2.5-VL-7B-Instruct (conf/hf/qwen2_5_vl_7b_instruct.json)",
        "derived_by": "tests/data/derive_sglang_qwen2_5_vl_params.py",
        "tp": {str(tp): sglang_params(text, cfg["vision_config"], cfg["tie_word_embeddings"], tp) for tp in (1, 2, 4)},
    }
    lines = ["{"] + [f"{json.dumps(k)}: {json.dumps(out[k])}," for k in ("sglang_version", "model", "derived_by")]
    lines.append('"tp": {')
    for t, (tp, params) in enumerate(out["tp"].items()):
        lines.append(f"{json.dumps(tp)}: {{")
        lines += [f"{json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(params) - 1 else "")
                  for i, (k, v) in enumerate(params.items())]
        lines.append("}" + ("," if t < len(out["tp"]) - 1 else ""))
    OUT.write_text("\n".join(lines + ["}", "}"]) + "\n")  # one parameter a line


if __name__ == "__main__":
    main()
