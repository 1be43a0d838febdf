"""Analytical memory model of one GRPO step, per GPU, from a HF config, a parallel layout and a batch.

Everything here is arithmetic on integers (bytes); nothing is allocated. Sizes are per GPU of the
colocated group. Legend: P parameters, L decoder layers, h hidden size, i MLP intermediate size,
h_kv = kv_heads * head_dim, V vocabulary, t tensor-parallel degree, p pipeline degree, d data-parallel
degree (``devices / (t * p)``), T tokens, bf16 = 2 bytes, fp32 = 4 bytes. The degrees are read from
the run's one :class:`rollplex_train.parallel.ParallelLayout` (``train_tp``, ``train_pp``,
``train_dp``, ``rollout_tp``, ``rollout_dp``).

Sources:
- Training states under Megatron's distributed optimizer: Megatron-LM
  ``docs/source/api-guide/dist_optimizer.md`` (bf16 params and fp32 main grads per model-parallel
  rank, fp32 master params and Adam m/v sharded over the data-parallel group: 6 + 12/d bytes/param).
- Training states under FSDP / ZeRO-3: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models" (2 + 2 + 12 bytes/param, all partitioned over N ranks);
  Zhao et al. 2023, "PyTorch FSDP" (bf16 compute copies of one gathered unit at a time, plus the
  prefetched next unit).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. (1)-(5): per layer ``s*b*h*(34 + 5*a*s/h)`` bytes, divided by t with tensor and
  sequence parallelism, ``2*s*b*h*L/t`` with full recomputation. Re-derived here for Qwen2.5's
  block (RMSNorm, GQA, SwiGLU, no dropout, flash attention) — see :func:`layer_activation_bytes_per_token`.
- KV cache: 2 (K and V) * L * kv_heads * head_dim * bytes per token; kv heads split over TP ranks,
  replicated when t > kv_heads (vLLM / Megatron GQA rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollplex_train.config import Config

GIB = 1024**3
BF16 = 2
FP32 = 4
RECOMPUTE_MODES = ("none", "selective", "full")
STRATEGIES = ("megatron", "fsdp")


@dataclass(frozen=True)
class TransformerDims:
    """The dimensions of one transformer stack (the LLM or the vision tower).

    Attributes:
        layers, hidden, intermediate, heads, kv_heads, head_dim: as in the HF config.
        vocab: vocabulary size (0 for the vision tower).
        tied_embeddings: the LM head shares the embedding matrix.
        qkv_bias: q/k/v projections carry a bias (Qwen2 LLM); ``fused_qkv`` one qkv Linear with bias
            and an output projection with bias (Qwen2.5-VL vision blocks).
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 0
    tied_embeddings: bool = False
    fused_qkv: bool = False

    @property
    def kv_width(self) -> int:
        """h_kv = kv_heads * head_dim."""
        return self.kv_heads * self.head_dim


def text_dims(hf_config: Any) -> TransformerDims:
    """The LLM dimensions of a Qwen2-VL/Qwen2.5-VL (or plain causal-LM) ``PretrainedConfig``."""
    text = hf_config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    return TransformerDims(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=text.intermediate_size,
                           heads=text.num_attention_heads, kv_heads=text.num_key_value_heads, head_dim=head_dim,
                           vocab=text.vocab_size, tied_embeddings=tied)


def vision_dims(hf_config: Any) -> TransformerDims:
    """The vision tower's dimensions (MHA: kv_heads = heads)."""
    v = hf_config.vision_config
    return TransformerDims(layers=v.depth, hidden=v.hidden_size, intermediate=v.intermediate_size, heads=v.num_heads,
                           kv_heads=v.num_heads, head_dim=v.hidden_size // v.num_heads, fused_qkv=True)


def llm_parameters(d: TransformerDims) -> int:
    """Parameters of a Qwen2 decoder: per layer q/k/v (with bias), o (no bias), SwiGLU gate/up/down
    (no bias), two RMSNorm weights; plus embedding, final norm and an untied LM head.

    ``L*(h*(h + 2*h_kv) + h + 2*h_kv + h*h + 3*h*i + 2*h) + V*h*(1 or 2) + h``.
    """
    attn = d.hidden * (d.hidden + 2 * d.kv_width) + d.hidden + 2 * d.kv_width + d.hidden * d.hidden
    per_layer = attn + 3 * d.hidden * d.intermediate + 2 * d.hidden
    embeddings = d.vocab * d.hidden * (1 if d.tied_embeddings else 2)
    return d.layers * per_layer + embeddings + d.hidden


def vision_parameters(hf_config: Any) -> int:
    """Parameters of the Qwen2.5-VL vision tower: Conv3d patch embedding (3*t_patch*p*p*h, no bias),
    per block a fused qkv (3h*h + 3h), proj (h*h + h), SwiGLU with biases (3*h*i + 2*i + h) and two
    RMSNorms (2h); the patch merger: RMSNorm (h), Linear(4h, 4h) and Linear(4h, out_hidden) with biases.
    """
    v = hf_config.vision_config
    d = vision_dims(hf_config)
    h, i, m = d.hidden, d.intermediate, 4 * d.hidden  # m: merged width (spatial_merge_size**2 * h)
    assert v.spatial_merge_size == 2, "merger width assumes 2x2 spatial merging"
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h
    block = (3 * h * h + 3 * h) + (h * h + h) + (3 * h * i + 2 * i + h) + 2 * h
    merger = h + (m * m + m) + (m * v.out_hidden_size + v.out_hidden_size)
    return patch + d.layers * block + merger


def total_parameters(hf_config: Any) -> int:
    """LLM + vision tower parameters (Qwen2.5-VL-7B: 8,292,166,656; 32B: 33,452,718,336)."""
    return llm_parameters(text_dims(hf_config)) + vision_parameters(hf_config)


def kv_bytes_per_token(d: TransformerDims, tp: int, dtype_bytes: int = BF16) -> int:
    """KV-cache bytes one token occupies on one TP rank: ``2 * L * ceil-div heads * head_dim * bytes``.

    The kv heads are split over the t ranks; when t > kv_heads each rank keeps one (replicated) head.
    Qwen2.5-VL-32B, bf16: 2*64*8*128*2 = 262,144 B/token at t=1, 65,536 at t=4.
    """
    heads_per_rank = max(1, d.kv_heads // tp)
    return 2 * d.layers * heads_per_rank * d.head_dim * dtype_bytes


def layer_activation_bytes_per_token(d: TransformerDims, recompute: str, attention_scores: bool = False,
                                     seq_len: int = 0, fused: bool = True) -> float:
    """Bytes one token keeps alive for backward in one transformer block, before TP division.

    Korthikanti et al. 2022 count, per layer and per token (bf16, with dropout, GeLU MLP of width 4h):
    attention 11h + 5*a*s, MLP 19h, two LayerNorms 4h = ``h*(34 + 5*a*s/h)``. The same bookkeeping for
    a Qwen2.5 block (no dropout, RMSNorm, GQA, SwiGLU ``down(silu(gate(x)) * up(x))``):

    - two RMSNorm inputs: 4h
    - attention: q/k/v input 2h, Q 2h, K and V 4*h_kv, o_proj input (the attention output) 2h
    - MLP: gate/up input 2h; gate output, silu(gate), up output, down input: 8i
    - attention scores: 5*a*s per token only without flash attention (``attention_scores=True``,
      Korthikanti's term); flash attention (Dao et al. 2022) recomputes them and keeps O(s) statistics.

    Total ``12h + 4h_kv + 8i`` (+ ``5*a*s``). With h_kv = h and i = 4h it is 48h (GeLU: 32h without
    dropout; SwiGLU keeps three i-wide tensors instead of two). That is what fused kernels keep
    (Megatron/TransformerEngine RMSNorm, RoPE, attention). Eager transformers modules
    (``fused=False``, the torch engine) keep more, per token and layer: each RMSNorm's normalised
    input before the weight multiply (2 x 2h), RoPE's un-rotated q, k and their ``rotate_half``
    copies (2 x (2h + 2h_kv)), and the attention output apart from its contiguous reshape for
    o_proj (2h): ``+ 10h + 4h_kv``. ``recompute``:

    - ``none``: the total above.
    - ``selective`` (Korthikanti §4.2): drop the attention-score term (recomputed); equals ``none``
      with flash attention.
    - ``full`` (Korthikanti eq. 5): only the block input, 2h.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"memory.activation_recompute={recompute!r}: expected one of {list(RECOMPUTE_MODES)}")
    if recompute == "full":
        return 2.0 * d.hidden
    full = 12 * d.hidden + 4 * d.kv_width + 8 * d.intermediate
    if not fused:
        full += 10 * d.hidden + 4 * d.kv_width
    if attention_scores and recompute == "none":
        full += 5 * d.heads * seq_len
    return float(full)


def stack_activation_bytes(d: TransformerDims, tokens: int, tp: int, recompute: str,
                           working_layer: bool = True, elem_bytes: int = BF16, fused: bool = True) -> int:
    """Activations of a whole stack for ``tokens`` tokens on one TP rank (sequence parallel: /t).

    ``L * tokens * per_layer / t``; with full recompute and ``working_layer`` add one layer's
    un-recomputed activations (the working set while that layer's backward re-runs its forward;
    leave it out for activations that are only held, e.g. a prefix graph waiting for its backward).
    ``elem_bytes``: activation dtype (the per-layer counts are for 2-byte elements; fp32 doubles them).
    ``fused``: see :func:`layer_activation_bytes_per_token`.
    """
    per_layer = layer_activation_bytes_per_token(d, recompute, fused=fused)
    total = d.layers * tokens * per_layer
    if recompute == "full" and working_layer:
        total += tokens * layer_activation_bytes_per_token(d, "none", fused=fused)
    return int(math.ceil(total * elem_bytes / BF16 / tp))


def logits_bytes_per_token(d: TransformerDims, tp: int, elem_bytes: int = BF16) -> int:
    """Logits of one token on one rank: the LM head's output (``elem_bytes``, bf16) and its fp32 copy
    for log-softmax (kept for backward), vocabulary-parallel over t ranks: ``ceil(V/t) * (2 + 4)``."""
    return math.ceil(d.vocab / tp) * (elem_bytes + FP32)


def training_state_bytes(num_params: int, *, strategy: str, tp: int, pp: int, dp: int, distributed_optimizer: bool,
                         largest_layer_params: int = 0, param_bytes: int = BF16, rank_params: int | None = None,
                         rank_trainable: int | None = None) -> dict[str, int]:
    """Per-GPU bytes of the actor's training states: ``weights`` (bf16), ``grads``, ``master`` (fp32
    copy), ``optimizer`` (Adam m and v, fp32). With ``param_bytes=4`` (fp32 training, the CPU run)
    the weights are their own master copy: ``master`` is 0 and ``weights`` 4 bytes/param.

    - ``megatron``: weights 2P/(t*p), fp32 main grads 4P/(t*p); master 4P and Adam 8P divided by
      t*p, and by d as well with the distributed optimizer (Megatron dist_optimizer.md). Given
      ``rank_params`` (parameters of the largest model-parallel rank, as its layout holds them:
      replicated tensors whole, padded vocabulary) and ``rank_trainable`` (of those, trained) the
      weights are ``param_bytes * rank_params`` and the grads, master and Adam states count
      ``rank_trainable`` instead of P/(t*p).
    - ``fsdp`` (ZeRO-3): master 4P, grads 4P and Adam 8P all divided by N = t*p*d; the bf16 weights
      are the all-gathered units alive at a time: the current and the prefetched one,
      ``2 * 2 * largest_layer_params / t``.

    Raises:
        ValueError: unknown strategy.
    """
    mp = tp * pp
    master = 0 if param_bytes == FP32 else FP32
    if strategy == "megatron":
        held = num_params // mp if rank_params is None else rank_params
        trained = num_params // mp if rank_trainable is None else rank_trainable
        shard = dp if distributed_optimizer else 1
        return {"weights": param_bytes * held, "grads": FP32 * trained,
                "master": master * trained // shard, "optimizer": 2 * FP32 * trained // shard}
    if strategy == "fsdp":
        n = mp * dp
        return {"weights": 2 * param_bytes * largest_layer_params // tp, "grads": FP32 * num_params // n,
                "master": max(master, param_bytes) * num_params // n, "optimizer": 2 * FP32 * num_params // n}
    raise ValueError(f"memory.train_strategy={strategy!r}: expected one of {list(STRATEGIES)}")


def rollout_kv_tokens(prompts: int, n: int, prompt_width: int, response_tokens: int, *, shared_prompt: bool,
                      batch_prompts: int) -> int:
    """Tokens of KV cache one rollout engine holds at its peak while it decodes ``prompts`` prompts
    x ``n`` samples, prompts left-padded to ``prompt_width`` tokens, responses of ``response_tokens``.

    The engine decodes at most ``batch_prompts`` prompts together (the built-in engine: chunks of
    ``rollout.max_batch_size // n`` prompts, ``rollout/builtin.py``), so the peak is one chunk's.
    ``shared_prompt``: one copy of a prompt's KV for its n samples (SGLang's radix cache; the
    built-in engine's ``rollout.share_prompt_kv``, ``rollout/shared_prefix.py``):
    ``P * W + P * n * R``; else the prompt's cache is repeated n times: ``P * n * (W + R)``.
    """
    p = max(1, min(prompts, batch_prompts))
    if shared_prompt:
        return p * prompt_width + p * n * response_tokens
    return p * n * (prompt_width + response_tokens)


@dataclass(frozen=True)
class BatchShape:
    """The step's batch, as the memory model sees it (upper bounds: buffers are sized for them).

    Attributes:
        prompts: prompts per step; n: responses per prompt; prompt_tokens: tokens per prompt
            (``data.max_prompt_length``, vision tokens included); response_tokens:
            ``rollout.max_new_tokens``; vision_patches: vision-tower tokens per prompt (before the
            2x2 merge); mini_batch_prompts: prompts per optimizer step; micro_groups: groups per
            forward/backward (shared prefix: micro-batches hold whole groups). prompt_width: the
            longest prompt, the width a rollout engine left-pads its prompts' KV to (0: ``prompt_tokens``).
    """

    prompts: int
    n: int
    prompt_tokens: int
    response_tokens: int
    vision_patches: int
    mini_batch_prompts: int
    micro_groups: int
    prompt_width: int = 0

    @property
    def vision_tokens(self) -> int:
        return self.vision_patches // 4

    @property
    def padded_prompt_tokens(self) -> int:
        """Tokens of a prompt as a rollout engine holds it (left-padded to the longest)."""
        return self.prompt_width or self.prompt_tokens


def vision_patches_per_prompt(cfg: "Config", hf_config: Any) -> int:
    """Vision-tower tokens of the largest prompt: one image at ``data.max_pixels`` or one video of
    ``data.video_max_frames`` frames at ``data.video_max_pixels``, whichever is larger.

    An image gives ``max_pixels / patch**2`` patches (one temporal step); a video
    ``ceil(frames / temporal_patch) * video_max_pixels / patch**2`` (Qwen2-VL smart_resize keeps
    the pixel count at most the bound, rounded to 28x28 blocks).
    """
    v = hf_config.vision_config
    area = v.patch_size**2
    block = (v.patch_size * v.spatial_merge_size) ** 2
    image = (cfg.data.max_pixels // block) * block // area
    steps = math.ceil(cfg.data.video_max_frames / v.temporal_patch_size)
    video = steps * (cfg.data.video_max_pixels // block) * block // area
    return max(image, video)


def batch_shape(cfg: "Config", hf_config: Any) -> BatchShape:
    """The batch of ``cfg`` (see :class:`BatchShape`).

    Raises:
        ValueError: the largest vision input alone exceeds ``data.max_prompt_length``.
    """
    patches = vision_patches_per_prompt(cfg, hf_config)
    if patches // 4 > cfg.data.max_prompt_length:
        raise ValueError(f"data.max_prompt_length={cfg.data.max_prompt_length} is below the {patches // 4} vision "
                         "tokens of the largest image/video: every such prompt would be skipped")
    mini = cfg.actor.ppo_mini_batch_size if cfg.actor.ppo_mini_batch_size > 0 else cfg.data.rollout_batch_size
    return BatchShape(prompts=cfg.data.rollout_batch_size, n=cfg.rollout.n, prompt_tokens=cfg.data.max_prompt_length,
                      response_tokens=cfg.rollout.max_new_tokens, vision_patches=patches, mini_batch_prompts=mini,
                      # the torch engine trains one group per micro-batch with a shared prefix
                      micro_groups=1 if cfg.model.shared_prefix else max(1, cfg.actor.micro_batch_size // cfg.rollout.n))


def param_bytes_of(cfg: "Config") -> int:
    """Bytes per parameter (and per KV/activation element) of ``model.dtype``."""
    return FP32 if cfg.model.dtype == "float32" else BF16


def per_rank(count: int, ranks: int) -> int:
    """``ceil(count / ranks)``: items one rank holds when ``count`` items are spread over ``ranks``."""
    return -(-count // ranks)
