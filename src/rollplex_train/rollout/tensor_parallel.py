"""Tensor parallelism of the built-in rollout engine: a Qwen2.5-VL over one TP rank's tensors.

A built-in engine of TP degree r runs as r processes (one per device); rank i holds exactly the
tensors ``models/layouts.py`` lays out for rank i of the ``sglang`` layout, the ones a trainer
hands SGLang on a cluster (``sharing/plan.py``, ``MegatronTrainEngine.rollout_tensors("sglang", r)``):

* ``qkv_proj`` = ``[q_i; k_i; v_i]``: the rank's query heads and KV heads (a KV head replicated on
  r / KV-heads ranks when r exceeds the KV heads), column parallel; the vision blocks' ``qkv_proj``
  the same with one KV head per head;
* ``gate_up_proj`` = ``[gate_i; up_i]``, column parallel (the vision MLP's width padded to a
  multiple of 8 with zero rows; silu(0) * 0 = 0, so the padding adds nothing);
* ``o_proj``, ``down_proj``, the vision ``proj``/``down_proj`` and the merger's ``mlp.2``: row
  parallel, each rank's partial product summed over the group (one all-reduce), a replicated bias
  added after the sum (SGLang ``RowParallelLinear``: bias on the reduced output);
* the merger's ``mlp.0``: column parallel (its GELU is elementwise);
* ``embed_tokens`` (and an untied ``lm_head``): rows of the vocabulary padded to a multiple of 64,
  split evenly. The embedding looks up the ids in its rows, zeros the others and the group sums
  (SGLang/megatron ``VocabParallelEmbedding``); the head's logits are gathered over the group and
  the padding columns cut, so every rank samples from the same full logits;
* norms and the patch embedding: replicated.

Parallelized the torchtitan way (``models/llama3/infra/parallelize.py``): the transformers model's
modules stay, each column-parallel linear's weight becomes a view of the rank's tensor (no copy;
q/k/v are row ranges of ``qkv_proj``, gate/up of ``gate_up_proj``), row-parallel linears, the
embedding and the head are swapped for the modules below, and the attention modules get their local
head counts. So the engine's prefill (``models/prefix.encode_prefix``, vision tower included) and
``rollout/decoder.py``'s fused step run unchanged on a rank.

Numerics against the same model at r = 1: the vocab-parallel embedding is exact (one rank holds each
row, the others add zeros) and the gathered logits are the same GEMM columns; a row-parallel
product is not: its K-reduction is split into r partial GEMMs whose sum the all-reduce forms, a
different summation order from one GEMM. The differences this makes on the tiny model are measured
in tests/test_rollout_tp.py and docs/architecture.md ("Tensor-parallel built-in engine").

Legend: r TP degree, i rank, V vocabulary, Vp padded vocabulary, H hidden size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rollplex_train.models.layouts import Dims, Layout, build_layout, reference_shard

TEXT = "model.language_model."
VISION = "model.visual."


class TPGroup:
    """The tensor-parallel group of one rollout engine (r ranks; r = 1: no communication).

    Args:
        rank, size: this rank and the degree r.
        group: the ``torch.distributed`` process group of the r ranks (gloo on CPU, NCCL on GPU);
            or ``connect``, a function making it, called at the first collective (the ranks of an
            in-process run are built one after the other and meet only when they first decode).

    Raises:
        ValueError: rank outside ``[0, size)``, or size > 1 with neither group nor connect.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None, connect: Optional[Callable] = None):
        if not 0 <= rank < size:
            raise ValueError(f"TP rank {rank} outside [0, {size})")
        if size > 1 and group is None and connect is None:
            raise ValueError(f"TP size {size} needs a process group (group= or connect=)")
        self.rank, self.size, self._group, self._connect = rank, size, group, connect

    @property
    def group(self):
        if self._group is None and self.size > 1:
            self._group = self._connect()
        return self._group

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (every rank gets the same bytes); returns ``t``."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """(..., X) on each rank -> (..., r * X): the ranks' tensors side by side, rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def new_process_group(rank: int, size: int, address: tuple[str, int], device: str,
                      timeout_s: float = 600.0):
    """A standalone process group of ``size`` ranks meeting at ``address`` (rank 0 hosts the
    ``TCPStore``): ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA (the NCCL branch has not
    run on a GPU). Standalone, so a rollout process needs no default group and several engines'
    ranks may live in one process (threads of the in-process executor)."""
    host, port = address
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_i @ W_i^T) + b``: rank i holds the columns ``W_i`` (H_out, K / r) of
    the weight and its slice ``x_i`` of the input; ``b`` (H_out,) is replicated. At r = 1 one
    ``F.linear(x, W, b)``, the ``nn.Linear`` it replaces."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce_(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding over rows ``[i * Vp / r, (i + 1) * Vp / r)`` of the padded vocabulary.

    Args:
        weight: (Vp / r, H) this rank's rows (padding rows zero).
    """

    def __init__(self, weight: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(...) int64 ids -> (..., H); every id is looked up by the one rank holding its row."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(out)


class VocabParallelHead(nn.Module):
    """LM head over this rank's vocabulary rows; logits gathered over the group, padding cut.

    Args:
        weight: (Vp / r, H) this rank's rows of the head (the embedding's when tied).
        vocab_size: V, the real vocabulary (columns past it are padding and dropped).
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) logits, the same on every rank."""
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., : self.vocab_size]


@dataclass(frozen=True)
class RankLayout:
    """What one rank of a TP rollout model holds: ``layout`` (``sglang`` at degree r) and ``rank``.

    ``specs``: ``{name: TensorSpec}`` of the rank's tensors; ``hf_names``: the HF parameter names
    (tied weights once) the layout cuts them from."""

    layout: Layout
    rank: int

    @property
    def specs(self):
        return self.layout.ranks[self.rank]

    @property
    def hf_names(self) -> set[str]:
        return set(self.layout.hf_shapes)

    @classmethod
    def of_model(cls, model: nn.Module, size: int, rank: int) -> "RankLayout":
        """The layout of a (not yet parallelized) transformers Qwen2.5-VL's parameters at degree ``size``.

        Raises:
            ValueError: ``size`` does not divide the heads or widths the layout splits.
        """
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return cls(build_layout("sglang", size, shapes, Dims.from_hf_config(model.config)), rank)

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rank's tensors cut from full HF tensors ``full`` (new contiguous storage)."""
        return {name: reference_shard(spec, full).contiguous() for name, spec in self.specs.items()}

    def check(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Raises ValueError unless ``tensors`` are exactly the rank's (names, shapes, ``dtype``)."""
        missing = sorted(set(self.specs) - set(tensors))
        unexpected = sorted(set(tensors) - set(self.specs))
        wrong = sorted(n for n, t in tensors.items() if n in self.specs and
                       (tuple(t.shape) != self.specs[n].shape or t.dtype != dtype))
        if missing or unexpected or wrong:
            raise ValueError(f"rank {self.rank} of the sglang layout at TP {self.layout.tp}: tensors do not match "
                             f"(missing={missing[:4]} unexpected={unexpected[:4]} wrong shape/dtype={wrong[:4]})")

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The rank's KV heads of the language model (one replicated head when r > KV heads)."""
        r, i = self.layout.tp, self.rank
        if num_kv_heads >= r:
            per = num_kv_heads // r
            return slice(i * per, (i + 1) * per)
        head = i * num_kv_heads // r
        return slice(head, head + 1)


def _linear(module: nn.Linear, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)


def _weight(module: nn.Module, weight: torch.Tensor) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)


def parallelize(model: nn.Module, tensors: dict[str, torch.Tensor], tp: TPGroup, rank_layout: RankLayout) -> int:
    """Point every parameter of the transformers Qwen2.5-VL ``model`` at (views of) ``tensors``, the
    rank's sglang-layout tensors, in place: no element is copied. May be called again with other
    tensors (the trainer's shared ones): the modules are re-pointed.

    Returns:
        the bytes of ``tensors``.

    Raises:
        ValueError: ``tensors`` are not the rank's (``RankLayout.check``), or after binding a
            parameter of the model lies outside them.
    """
    cfg = model.config
    text_cfg, vision_cfg = cfg.get_text_config(), cfg.vision_config
    dtype = next(iter(tensors.values())).dtype
    rank_layout.check(tensors, dtype)
    r, t = tp.size, tensors
    dims = Dims.from_hf_config(cfg)
    q_heads = dims.num_heads // r
    kv = rank_layout.kv_heads(dims.num_kv_heads)
    kv_heads = kv.stop - kv.start
    text, visual = model.model.language_model, model.model.visual
    for index, layer in enumerate(text.layers):
        p = f"{TEXT}layers.{index}."
        attn, mlp = layer.self_attn, layer.mlp
        w, b = t[p + "self_attn.qkv_proj.weight"], t[p + "self_attn.qkv_proj.bias"]
        nq, nk = q_heads * dims.head_dim, kv_heads * dims.head_dim
        _linear(attn.q_proj, w[:nq], b[:nq])
        _linear(attn.k_proj, w[nq:nq + nk], b[nq:nq + nk])
        _linear(attn.v_proj, w[nq + nk:], b[nq + nk:])
        attn.fused_qkv = (w, b)  # rollout/decoder.py takes them as they are (no concatenated copy)
        attn.num_key_value_groups = q_heads // kv_heads
        attn.o_proj = RowParallelLinear(t[p + "self_attn.o_proj.weight"], None, tp)
        gate_up = t[p + "mlp.gate_up_proj.weight"]
        half = gate_up.shape[0] // 2
        _linear(mlp.gate_proj, gate_up[:half])
        _linear(mlp.up_proj, gate_up[half:])
        mlp.fused_gate_up = gate_up
        mlp.down_proj = RowParallelLinear(t[p + "mlp.down_proj.weight"], None, tp)
        _weight(layer.input_layernorm, t[p + "input_layernorm.weight"])
        _weight(layer.post_attention_layernorm, t[p + "post_attention_layernorm.weight"])
    _weight(text.norm, t[TEXT + "norm.weight"])
    text.embed_tokens = VocabParallelEmbedding(t[TEXT + "embed_tokens.weight"], tp)
    head = t.get("lm_head.weight", t[TEXT + "embed_tokens.weight"])  # tied: the embedding's rows
    model.lm_head = VocabParallelHead(head, text_cfg.vocab_size, tp)

    _weight(visual.patch_embed.proj, t[VISION + "patch_embed.proj.weight"])
    for index, block in enumerate(visual.blocks):
        p = f"{VISION}blocks.{index}."
        _linear(block.attn.qkv, t[p + "attn.qkv_proj.weight"], t[p + "attn.qkv_proj.bias"])
        block.attn.num_heads = vision_cfg.num_heads // r
        block.attn.proj = RowParallelLinear(t[p + "attn.proj.weight"], t[p + "attn.proj.bias"], tp)
        w, b = t[p + "mlp.gate_up_proj.weight"], t[p + "mlp.gate_up_proj.bias"]
        half = w.shape[0] // 2
        _linear(block.mlp.gate_proj, w[:half], b[:half])
        _linear(block.mlp.up_proj, w[half:], b[half:])
        block.mlp.down_proj = RowParallelLinear(t[p + "mlp.down_proj.weight"], t[p + "mlp.down_proj.bias"], tp)
        _weight(block.norm1, t[p + "norm1.weight"])
        _weight(block.norm2, t[p + "norm2.weight"])
    merger = visual.merger
    _weight(merger.ln_q, t[VISION + "merger.ln_q.weight"])
    _linear(merger.mlp[0], t[VISION + "merger.mlp.0.weight"], t[VISION + "merger.mlp.0.bias"])
    merger.mlp[2] = RowParallelLinear(t[VISION + "merger.mlp.2.weight"], t[VISION + "merger.mlp.2.bias"], tp)

    owned = {x.untyped_storage().data_ptr() for x in t.values()}
    stray = [n for n, prm in model.named_parameters() if prm.untyped_storage().data_ptr() not in owned]
    if stray:
        raise ValueError(f"parallelize: parameters outside the rank's tensors: {stray[:4]}")
    return sum(x.numel() * x.element_size() for x in t.values())


def shard_prefix_kv(keys: list[torch.Tensor], heads: slice) -> list[torch.Tensor]:
    """A whole-model prompt KV cache (per layer (1, K, L, D), e.g. the actor's ``PrefixState``) cut
    to the rank's KV heads ``heads`` (``RankLayout.kv_heads``): views, no copy."""
    return [k[:, heads] for k in keys]


class RankWeights:
    """The weights of one rank of a built-in engine in the ``sglang`` layout (any TP degree, r = 1
    included): binds a model to a rank's tensors and copies updates into them.

    Args:
        model: the engine's transformers Qwen2.5-VL, not yet parallelized (its HF parameters give
            the layout). tp: the engine's group.

    Attributes:
        layout: the rank's ``RankLayout``. tensors: the rank tensors the model runs on (None until
        ``bind``).
    """

    def __init__(self, model: nn.Module, tp: TPGroup):
        self.model, self.tp = model, tp
        self.layout = RankLayout.of_model(model, tp.size, tp.rank)
        self.tensors: Optional[dict[str, torch.Tensor]] = None

    def matches(self, tensors: dict) -> bool:
        """Whether ``tensors`` are named as the rank's tensors (not the HF parameters)."""
        return set(tensors) == set(self.layout.specs)

    def bind(self, tensors: dict[str, torch.Tensor]) -> int:
        """Run the model on ``tensors`` in place (``parallelize``); returns their bytes."""
        nbytes = parallelize(self.model, tensors, self.tp, self.layout)
        self.tensors = dict(tensors)
        return nbytes

    def bind_copy_of(self, named: dict[str, torch.Tensor], device: Optional[torch.device] = None) -> int:
        """Bind new storage holding the rank's tensors, cut from full HF tensors or given as the
        rank's (copied either way, onto ``device``); returns their bytes."""
        rank = self.layout.shard(named) if self.layout.hf_names <= set(named) else named
        return self.bind({n: t.to(device, copy=True) for n, t in rank.items()})

    @torch.no_grad()
    def load(self, named: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the bound tensors: the full HF tensors (this rank's rows cut) or
        the rank's own. Checked before anything is copied.

        Raises:
            ValueError: neither set of names, or wrong shapes/dtype.
        """
        assert self.tensors is not None, "load before bind"
        rank = self.layout.shard(named) if self.layout.hf_names <= set(named) else named
        self.layout.check(rank, next(iter(self.tensors.values())).dtype)
        for name, t in rank.items():
            self.tensors[name].copy_(t)
