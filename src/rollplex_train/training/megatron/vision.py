"""The Megatron backend's vision tower: the HF Qwen2.5-VL vision modules, tensor-parallel over the TP
group in SGLang's arrangement, so that an SGLang rollout rank's vision tensors are views of them.

Megatron-Bridge keeps the HF vision tower whole on every TP rank (``modeling_qwen25_vl.py``). Whole
HF tensors cannot be views of SGLang's per-rank ``qkv_proj`` (``[q_i; k_i; v_i]``: three row ranges
of the fused ``attn.qkv``) or ``gate_up_proj`` (``[gate_i; up_i]``: rows of two tensors), so the
rollout would rebuild them at every weight sync. Here rank i holds exactly those tensors
(``models/layouts.py``, ``megatron`` layout, vision part):

* ``attn.qkv``: ``[q_i; k_i; v_i]`` (the rank's heads; the HF attention module runs unchanged with
  ``num_heads`` set to the rank's heads) and ``merger.mlp.0``: column parallel;
* ``mlp.gate_up_proj``: ``[gate_i; up_i]``, column parallel (the MLP width padded to a multiple of
  8 with zero rows, as SGLang pads it: silu(0) * 0 = 0, and the zero rows get zero gradients);
* ``attn.proj``, ``mlp.down_proj``, ``merger.mlp.2``: row parallel, the partial products summed
  over the group, the replicated bias added after the sum;
* norms and the patch embedding (and Qwen2-VL's ``fc1``/``fc2`` MLP, which the layouts keep
  whole): replicated (identical gradients on every rank).

Autograd through the collectives is megatron-core's (``tensor_parallel/mappings.py``):
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the input gradient) in
front of every column-parallel linear, ``reduce_from_tensor_model_parallel_region`` (all-reduce
forward, identity backward) after every row-parallel one: Megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` with ``input_is_parallel=True`` (``tensor_parallel/layers.py``). Split
parameters carry megatron's ``tensor_model_parallel`` attributes, so the gradient norm counts them
once per rank and replicated ones once per group.

Numerics against the whole tower: a row-parallel product sums t partial GEMMs (another summation
order), so values differ in the last bits, as the LLM's row-parallel layers do.

Legend: t TP degree, i TP rank, H vision hidden size, I MLP width (padded), M merger width (4H).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "model.visual."


def _parameter(t: torch.Tensor, split_dim: Optional[int]) -> nn.Parameter:
    """A new parameter holding ``t``; ``split_dim``: the dim it is split along over TP (None: replicated)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    p = nn.Parameter(t.detach().clone().contiguous())
    if split_dim is not None:
        set_tensor_model_parallel_attributes(p, True, split_dim, 1)
    return p


class ColumnParallelLinear(nn.Module):
    """``y_i = x @ W_i^T + b_i``: rank i holds rows ``W_i`` (out/t, in) and ``b_i``; the input is
    replicated, its gradient summed over the group."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.weight = _parameter(weight, 0)
        self.bias = None if bias is None else _parameter(bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return F.linear(copy_to_tensor_model_parallel_region(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_i @ W_i^T) + b``: rank i holds columns ``W_i`` (out, in/t) and its
    slice ``x_i`` of the input; ``b`` (out,) is replicated and added after the sum."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.weight = _parameter(weight, 1)
        self.bias = None if bias is None else _parameter(bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class GatedMLP(nn.Module):
    """The vision block's SwiGLU ``down(act(gate(x)) * up(x))`` over the rank's ``[gate_i; up_i]``
    (2 I/t, H) and ``down_i`` (H, I/t)."""

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear, act):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up, down, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def parallelize_vision(visual: nn.Module, shards: dict[str, torch.Tensor], tp_size: int) -> None:
    """Make the HF vision tower ``visual`` hold rank i's tensors of the ``megatron`` layout (module
    docstring), in place: column/row-parallel linears replace ``attn.qkv``/``attn.proj``, the MLP
    and the merger's linears; norms and the patch embedding keep their (replicated) parameters.

    Args:
        shards: ``{layout name: tensor}`` of this rank's split vision tensors (``model.visual.``
            names, ``reference_shard`` of the HF weights); copied into new parameters.
        tp_size: t (the attention modules get ``num_heads / t`` heads).

    Raises:
        KeyError: a split tensor of the tower is missing from ``shards``.
    """
    def linear(cls, name: str, bias: bool = True):
        return cls(shards[PREFIX + name + ".weight"], shards[PREFIX + name + ".bias"] if bias else None)

    for index, block in enumerate(visual.blocks):
        p = f"blocks.{index}."
        block.attn.qkv = linear(ColumnParallelLinear, p + "attn.qkv")
        block.attn.num_heads //= tp_size
        block.attn.proj = linear(RowParallelLinear, p + "attn.proj")
        if hasattr(block.mlp, "gate_proj"):  # Qwen2.5-VL's SwiGLU; Qwen2-VL's fc1/fc2 MLP stays replicated (layouts.py)
            block.mlp = GatedMLP(linear(ColumnParallelLinear, p + "mlp.gate_up_proj"),
                                 linear(RowParallelLinear, p + "mlp.down_proj"), block.mlp.act_fn)
    visual.merger.mlp[0] = linear(ColumnParallelLinear, "merger.mlp.0")
    visual.merger.mlp[2] = linear(RowParallelLinear, "merger.mlp.2")
