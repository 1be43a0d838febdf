"""Tensor-parallel layouts of Qwen2.5-VL parameters: HF, Megatron-core and SGLang.

A layout says, for every tensor a TP rank holds, which index ranges of which full HF tensors it is
made of. It describes parameters, not models: nothing here builds a module or touches a device.

Legend:
    block      ``Block(source, start, stop)``: rows ``[start, stop)`` along the split dim of the HF
               tensor ``source``. Indices at or past the HF size are *padding* (zeros).
    spec       ``TensorSpec``: one rank-local tensor; its ``blocks``, concatenated along ``dim``, give
               its logical tensor (``groups > 0``: declared shape ``(groups, rows // groups, *rest)``,
               logical tensor = ``flatten(0, 1)``).
    n, i       TP degree, TP rank.  nq, nkv, hd: query heads, KV heads, head dim.

The three layouts (sources read for them, not copied):

* ``hf``: transformers ``Qwen2_5_VLForConditionalGeneration``: separate ``q_proj``/``k_proj``/
  ``v_proj`` and ``gate_proj``/``up_proj`` in the LLM, a fused ``[q; k; v]`` ``attn.qkv`` in the
  vision blocks. With n > 1 every tensor is column/row split on its own (torch ``ColwiseParallel``/
  ``RowwiseParallel`` style); no KV-head replication.
* ``megatron``: megatron-core ``ColumnParallelLinear``/``RowParallelLinear``/
  ``VocabParallelEmbedding`` (``megatron/core/tensor_parallel/layers.py``) with the HF conversion of
  Megatron-Bridge (``src/megatron/bridge/models/conversion/param_mapping.py``: ``QKVMapping`` puts,
  per KV group, the group's q heads, then its k head, then its v head; ``GatedMLPMapping`` makes
  ``linear_fc1`` of rank i ``[gate_i; up_i]``). The vocabulary is padded to a multiple of
  ``make_vocab_size_divisible_by * n`` (megatron ``_vocab_size_with_padding``); requires
  nkv % n == 0 (megatron's check). The vision tower is the HF module, tensor-parallel in SGLang's
  arrangement (``training/megatron/vision.py``): HF names, the fused ``attn.qkv`` of rank i
  ``[q_i; k_i; v_i]``, ``mlp.gate_up_proj`` ``[gate_i; up_i]`` (width padded to a multiple of 8),
  ``attn.proj``/``mlp.down_proj``/``merger.mlp.2`` row parallel, ``merger.mlp.0`` column
  parallel; so every vision tensor of an SGLang rank at r = t is a view of the training rank's.
* ``sglang``: SGLang ``python/sglang/srt/models/qwen2_5_vl.py`` + ``qwen2.py`` with
  ``layers/linear.py``: ``QKVParallelLinear`` holds ``[q_i; k_i; v_i]`` and replicates KV heads when
  n > nkv (kv head of rank i = i // (n / nkv)); ``MergedColumnParallelLinear`` holds
  ``[gate_i; up_i]``; vision attention uses ``QKVParallelLinear`` too (``use_qkv_parallel=True``)
  and the vision MLP's intermediate size is padded to a multiple of 8;
  ``VocabParallelEmbedding``/``ParallelLMHead`` pad the vocabulary to a multiple of 64, or of
  64 x n when n does not divide that (odd n; :func:`sglang_padded_vocab`), and split it evenly. Two rollout-side options change the tensors an engine holds: ``split_qkv`` keeps q, k,
  v as three grouped tensors ``(kv groups of the rank, rows per group, in)`` (the engine runs one
  batched matmul per projection); ``split_gate_up`` keeps ``gate_proj`` and ``up_proj`` apart.

Names keep the HF module path and change the leaf (``linear_qkv``, ``qkv_proj``, ...).
Errors: ``ValueError`` when a degree does not divide what the layout must split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

LAYOUTS = ("hf", "megatron", "sglang")


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` along the split dim of HF tensor ``source`` (past its size: zeros)."""

    source: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of one rank: ``shape`` (declared), split ``dim`` of the logical tensor, ``blocks``."""

    name: str
    shape: tuple[int, ...]
    dim: int
    blocks: tuple[Block, ...]
    groups: int = 0

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.groups:
            return (self.shape[0] * self.shape[1],) + tuple(self.shape[2:])
        return tuple(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """``ranks[i]``: ``{name: TensorSpec}`` held by TP rank ``i`` of a layout ``kind`` at degree ``tp``."""

    kind: str
    tp: int
    ranks: tuple[dict[str, TensorSpec], ...]
    hf_shapes: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Dims:
    """The head/width numbers the layouts need, read from a Qwen2.5-VL HF config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vision_heads: int
    vision_head_dim: int

    @classmethod
    def from_hf_config(cls, hf_config) -> "Dims":
        text = getattr(hf_config, "text_config", hf_config)
        vision = hf_config.vision_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(text.num_attention_heads, text.num_key_value_heads, head_dim,
                   vision.num_heads, vision.hidden_size // vision.num_heads)


def _merge(blocks: Iterable[Block]) -> tuple[Block, ...]:
    """Adjacent blocks of one source joined: ``[(s, 0, 4), (s, 4, 8)] -> [(s, 0, 8)]``."""
    out: list[Block] = []
    for b in blocks:
        if b.size == 0:
            continue
        if out and out[-1].source == b.source and out[-1].stop == b.start:
            out[-1] = Block(b.source, out[-1].start, b.stop)
        else:
            out.append(b)
    return tuple(out)


def _even(what: str, size: int, n: int) -> int:
    if size % n:
        raise ValueError(f"TP {n} does not divide {what} ({size})")
    return size // n


def _split(source: str, padded: int, n: int, i: int) -> Block:
    """Rank i's contiguous share of ``padded`` rows (rows past the HF size are padding)."""
    per = _even(f"{source} (padded {padded})", padded, n)
    return Block(source, i * per, (i + 1) * per)


def _pad(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def sglang_padded_vocab(vocab: int, tp: int) -> int:
    """Rows of SGLang's ``VocabParallelEmbedding``/``ParallelLMHead`` at TP ``tp``: ``vocab`` padded
    to a multiple of 64, or of 64 x tp when tp does not divide that (sglang 0.5.23
    ``srt/layers/vocab_parallel_embedding.py``, ``VocabParallelEmbedding.__init__``:
    ``padding_size *= tp_size``). 151936 rows: 151936 at tp 1, 2, 4, 8; 152064 at tp 3."""
    padded = _pad(vocab, 64)
    return padded if padded % tp == 0 else _pad(vocab, 64 * tp)


class _Builder:
    """Builds the rank specs of one layout; one method per parameter family."""

    def __init__(self, kind: str, n: int, shapes: dict[str, tuple[int, ...]], dims: Dims, *,
                 vocab_divisible_by: int, vision_mlp_multiple: int, split_qkv: bool, split_gate_up: bool):
        if kind not in LAYOUTS:
            raise ValueError(f"layout {kind!r}: expected one of {list(LAYOUTS)}")
        self.kind, self.n, self.shapes, self.dims = kind, n, shapes, dims
        self.vocab_divisible_by, self.vision_mlp_multiple = vocab_divisible_by, vision_mlp_multiple
        self.split_qkv, self.split_gate_up = split_qkv, split_gate_up
        self.ranks: list[dict[str, TensorSpec]] = [{} for _ in range(n)]

    def add(self, i: int, name: str, dim: int, blocks: Iterable[Block], like: str, groups: int = 0) -> None:
        blocks = _merge(blocks)
        shape = list(self.shapes[like])
        shape[dim] = sum(b.size for b in blocks)
        if groups:
            shape = [groups, shape[0] // groups] + shape[1:]
        self.ranks[i][name] = TensorSpec(name, tuple(shape), dim, blocks, groups)

    def replicated(self, name: str) -> None:
        for i in range(self.n):
            self.add(i, name, 0, [Block(name, 0, self.shapes[name][0])], name)

    def split(self, name: str, new_name: str, dim: int, padded: int) -> None:
        """Column (dim 0) or row (dim 1) parallel: rank i holds the i-th of n equal runs."""
        for i in range(self.n):
            self.add(i, new_name, dim, [_split(name, padded, self.n, i)], name)

    def vocab(self, name: str, new_name: str) -> None:
        rows = self.shapes[name][0]
        if self.kind == "megatron":
            padded = _pad(rows, self.vocab_divisible_by * self.n)
        elif self.kind == "sglang":
            padded = sglang_padded_vocab(rows, self.n)
        else:
            padded = rows
        self.split(name, new_name, 0, padded)

    def attention(self, prefix: str, suffix: str, q: str, k: str, v: str, nq: int, nkv: int, hd: int,
                  offsets: tuple[int, int, int]) -> None:
        """q/k/v: HF sources of the heads; offsets: first row of q/k/v in them (fused vision qkv)."""
        n = self.n
        _even("the number of attention heads", nq, n)
        if self.kind == "megatron" or nkv >= n:
            _even("the number of KV heads (megatron: query groups)" if self.kind == "megatron"
                  else "the number of KV heads", nkv, n)
        else:
            _even("the KV-head replication (tp / kv heads)", n, nkv)
        qpg = nq // nkv
        head = lambda src, off, h: Block(src, off + h * hd, off + (h + 1) * hd)  # noqa: E731
        for i in range(n):
            qh = range(i * nq // n, (i + 1) * nq // n)
            kvh = range(i * nkv // n, (i + 1) * nkv // n) if nkv >= n else range(i * nkv // n, i * nkv // n + 1)
            qb = [head(q, offsets[0], h) for h in qh]
            kb = [head(k, offsets[1], h) for h in kvh]
            vb = [head(v, offsets[2], h) for h in kvh]
            if self.kind == "megatron" and q != k:  # the LLM (the vision tower's fused qkv: below)
                blocks = [b for g in kvh for b in (*[head(q, offsets[0], h) for h in qh if h // qpg == g],
                                                   head(k, offsets[1], g), head(v, offsets[2], g))]
                self.add(i, prefix + "linear_qkv" + suffix, 0, blocks, q)
            elif self.kind == "sglang" and self.split_qkv:
                g = len(kvh)
                for leaf, bl in (("q_proj", qb), ("k_proj", kb), ("v_proj", vb)):
                    self.add(i, prefix + leaf + suffix, 0, bl, q, groups=g)
            elif self.kind == "hf" and q != k:
                for src, bl in ((q, qb), (k, kb), (v, vb)):
                    self.add(i, src, 0, bl, src)
            else:  # sglang's qkv_proj; the vision tower's fused qkv (hf, megatron)
                leaf = "qkv_proj" if self.kind == "sglang" else "qkv"
                self.add(i, prefix + leaf + suffix, 0, qb + kb + vb, q)

    def gated(self, prefix: str, suffix: str, gate: str, up: str, padded: int, vision: bool = False) -> None:
        for i in range(self.n):
            gb, ub = _split(gate, padded, self.n, i), _split(up, padded, self.n, i)
            if self.kind == "hf" or (self.kind == "sglang" and self.split_gate_up):
                self.add(i, prefix + "gate_proj" + suffix, 0, [gb], gate)
                self.add(i, prefix + "up_proj" + suffix, 0, [ub], up)
            else:
                leaf = "linear_fc1" if self.kind == "megatron" and not vision else "gate_up_proj"
                self.add(i, prefix + leaf + suffix, 0, [gb, ub], gate)


_MEGATRON_LEAF = {"o_proj": "linear_proj", "down_proj": "linear_fc2", "proj": "linear_proj",
                  "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}


def _rename(kind: str, name: str, leaf: str) -> str:
    """The megatron name of an LLM linear (the vision tower keeps its HF names)."""
    if kind != "megatron" or leaf not in _MEGATRON_LEAF or ".visual." in "." + name:
        return name
    return name.replace("." + leaf + ".", "." + _MEGATRON_LEAF[leaf] + ".")


def build_layout(kind: str, tp: int, shapes: dict[str, tuple[int, ...]], dims: Dims, *,
                 vocab_divisible_by: int = 128, vision_mlp_multiple: int = 8,
                 split_qkv: bool = False, split_gate_up: bool = False) -> Layout:
    """The ``kind`` layout at TP degree ``tp`` of the HF parameters ``shapes`` (``parameter_shapes``).

    Args:
        vocab_divisible_by: megatron ``make_vocab_size_divisible_by`` (vocab padded to it x tp).
        vision_mlp_multiple: the vision MLP's intermediate size is padded to a multiple of this
            (SGLang: 8; megatron is given the same so that the shards line up; zero rows stay zero
            in training since silu(0) * 0 = 0 and both of their gradients vanish); ``hf``: 1.
        split_qkv, split_gate_up: the SGLang rollout-side options (module docstring).

    Raises:
        ValueError: ``tp`` does not divide the heads, KV heads, vocabulary or MLP width to split.
    """
    b = _Builder(kind, tp, shapes, dims, vocab_divisible_by=vocab_divisible_by,
                 vision_mlp_multiple=1 if kind == "hf" else vision_mlp_multiple,
                 split_qkv=split_qkv, split_gate_up=split_gate_up)
    for name, shape in shapes.items():
        module, _, suffix_leaf = name.rpartition(".")
        suffix = "." + suffix_leaf
        prefix = module.rpartition(".")[0] + "."
        leaf = module.rpartition(".")[2]
        if "merger.mlp." in name:
            leaf = "mlp." + leaf
        vision = ".visual." in "." + name
        if name.endswith("self_attn.q_proj" + suffix):
            k, v = name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj")
            b.attention(prefix, suffix, name, k, v, dims.num_heads, dims.num_kv_heads, dims.head_dim, (0, 0, 0))
        elif name.endswith(("self_attn.k_proj" + suffix, "self_attn.v_proj" + suffix, "mlp.up_proj" + suffix)):
            continue  # built with q_proj / gate_proj
        elif vision and name.endswith("attn.qkv" + suffix):
            width = shape[0] // 3
            nh = dims.vision_heads
            b.attention(prefix, suffix, name, name, name, nh, nh, dims.vision_head_dim, (0, width, 2 * width))
        elif name.endswith("mlp.gate_proj" + suffix):
            mult = b.vision_mlp_multiple if vision else 1
            b.gated(prefix, suffix, name, name.replace("gate_proj", "up_proj"), _pad(shape[0], mult), vision)
        elif suffix == ".weight" and leaf in ("o_proj", "down_proj", "mlp.2") or name.endswith("attn.proj.weight"):
            mult = b.vision_mlp_multiple if (vision and leaf == "down_proj") else 1
            b.split(name, _rename(kind, name, leaf), 1, _pad(shape[1], mult))
        elif leaf == "mlp.0":
            b.split(name, _rename(kind, name, leaf), 0, shape[0])
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            new = name
            if kind == "megatron":
                new = name.replace("embed_tokens", "word_embeddings").replace("lm_head", "output_layer")
            b.vocab(name, new)
        else:
            b.replicated(name)  # norms, patch embedding, row-parallel biases
    return Layout(kind, tp, tuple(b.ranks), dict(shapes))


def reference_shard(spec: TensorSpec, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The spec's tensor cut from full HF weights ``full`` (padding rows zero), shaped ``spec.shape``."""
    parts = []
    for blk in spec.blocks:
        src = full[blk.source]
        real = max(0, min(blk.stop, src.shape[spec.dim]) - blk.start)
        parts.append(src.narrow(spec.dim, blk.start, real))
        if real < blk.size:
            pad_shape = list(src.shape)
            pad_shape[spec.dim] = blk.size - real
            parts.append(src.new_zeros(pad_shape))
    return torch.cat(parts, dim=spec.dim).reshape(spec.shape)
