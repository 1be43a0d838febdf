"""Roofline costs of the tasks of one step on one GPU, expressed as a :class:`CostModel`.

Every task kind of the step graph gets a rate (seconds per unit of its work) at every device share
``s = 1 .. share_units`` (a share is ``s / share_units`` of the GPU's SMs), so the run-time
:class:`PhasePlanner` places the predicted step exactly as it places a measured one. Units: the
tokens of the step graph (``prefix/*``: prompt tokens incl. vision tokens; ``suffix/*``, ``update``:
response tokens; ``decode``: decode steps of the whole batch; ``prefill``: prompt tokens) and 1 for
the per-step kinds (``reward``, ``adv``, ``sync``, ``optimizer``).

Per task on share ``f = s / share_units`` of a GPU (roofline: Williams, Waterman, Patterson 2009):

    t = max(FLOPs / (peak * mfu * f),  bytes / (HBM * mbu * min(1, f / hbm_saturation_frac))) + TP comm

FLOPs per token of a forward pass (Kaplan et al. 2020 / Narayanan et al. 2021 counting, 2 FLOPs per
multiply-add): ``2 * (2h^2 + 2h*h_kv + 3h*i)`` per LLM layer plus attention ``4 * ctx * heads *
head_dim`` per layer, the LM head ``2*h*V`` where log-probs are needed; vision tower the same with
its windowed attention (window of ``(window_size / patch_size)^2`` patches, full attention in
``fullatt_block_indexes`` over one frame). Backward = 2 x forward; full activation recompute adds
one forward (Korthikanti et al. 2022). Decode reads the LLM weights once per step and each row's KV
cache (``memory.estimate.kv_bytes_per_token``); it is compute-bound only above the ridge point. TP
all-reduces: 2 per layer forward (Megatron, Shoeybi et al. 2019), 2 more backward and recompute,
ring cost ``2 (t-1)/t * bytes`` over one direction of NVLink. While prefix work runs beside decode,
decode's bandwidth is what the prefix passes leave (their weight reads per forward).

Every assumption is listed in ``docs/timeline.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollplex_train.memory import estimate as est
from rollplex_train.runtime.cost_model import CostModel

if TYPE_CHECKING:
    from rollplex_train.hardware import GpuConfig, TimelineConfig

GB = 1e9


@dataclass(frozen=True)
class DeviceWork:
    """The work one device (one rank of a TP group) does in one step.

    Attributes:
        train_groups: prompt groups of one training DP rank. rollout_groups: of one rollout engine.
        n: responses per group (G). prompt_tokens: LLM tokens per prompt (vision tokens included).
        vision_patches: vision-tower tokens per prompt (before the 2x2 merge).
        response_tokens: mean tokens per response. decode_steps: steps of the decode window.
        mini_batch_groups: groups of one rank per optimizer step. train_tp, rollout_tp: TP degrees.
        train_dp: data-parallel degree of training (gradient reduction). recompute: ``none``,
            ``selective``, ``full``. needs_reference: KL on (reference passes exist).
        old_from_actor_groups: groups of the first mini-batch whose old-policy log-probs come from
            the actor's own forward (``runtime/old_policy.py``): no old-policy pass for them.
    """

    train_groups: int
    rollout_groups: int
    n: int
    prompt_tokens: int
    vision_patches: int
    response_tokens: int
    decode_steps: int
    mini_batch_groups: int
    train_tp: int
    rollout_tp: int
    train_dp: int
    recompute: str
    needs_reference: bool
    old_from_actor_groups: int = 0


def _layer_linear_flops(d: est.TransformerDims) -> float:
    """Forward FLOPs per token of one layer's GEMMs (q, k, v, o and the SwiGLU MLP)."""
    return 2.0 * (2 * d.hidden**2 + 2 * d.hidden * d.kv_width + 3 * d.hidden * d.intermediate)


def llm_forward_flops(d: est.TransformerDims, tokens: float, context_sum: float, logits_tokens: float) -> float:
    """Forward FLOPs of ``tokens`` LLM tokens whose attention contexts sum to ``context_sum``, with the
    LM head applied to ``logits_tokens`` of them."""
    attn = 4.0 * d.heads * d.head_dim * context_sum
    return d.layers * (_layer_linear_flops(d) * tokens + attn) + 2.0 * d.hidden * d.vocab * logits_tokens


def vision_forward_flops(hf_config: Any, patches: int, frame_patches: int) -> float:
    """Forward FLOPs of the vision tower (and patch merger) over ``patches`` patches; windowed
    attention except in the full-attention blocks, which attend over one frame's ``frame_patches``."""
    if patches <= 0:
        return 0.0
    v, d = hf_config.vision_config, est.vision_dims(hf_config)
    window = (getattr(v, "window_size", 0) // v.patch_size) ** 2 or frame_patches
    full = len(getattr(v, "fullatt_block_indexes", []) or [])
    ctx = (d.layers - full) * min(window, frame_patches) + full * frame_patches
    linear = 2.0 * (4 * d.hidden**2 + 3 * d.hidden * d.intermediate) * d.layers
    merged = 4 * d.hidden
    merger = 2.0 * (merged * merged + merged * v.out_hidden_size) / 4  # per patch (one merged token per 4)
    return patches * (linear + merger) + 4.0 * d.hidden * ctx * patches


class RooflineModel:
    """Roofline rates of one device's tasks from a HF config, the GPU and the efficiencies.

    Args:
        hf_config: a Qwen2-VL/Qwen2.5-VL ``PretrainedConfig`` (``models.arch.load_hf_config``).
        work: the device's work (:class:`DeviceWork`). gpu / eff: ``gpu`` and ``timeline`` sections.
        frame_patches: vision patches of one frame/image (full-attention context).

    Raises:
        ValueError: a ``gpu.<key>`` the model needs is not set.
    """

    def __init__(self, hf_config: Any, work: DeviceWork, gpu: "GpuConfig", eff: "TimelineConfig",
                 frame_patches: int):
        gpu.require()
        self.hf, self.w, self.gpu, self.eff = hf_config, work, gpu, eff
        self.text = est.text_dims(hf_config)
        self.frame_patches = max(1, frame_patches)
        self.units = eff.share_units
        t = self.text
        self.weight_bytes = (est.llm_parameters(t) - t.vocab * t.hidden) * est.BF16  # embedding rows: lookups only

    # ---- building blocks (whole model, before the TP split) -------------------------------------
    def prefix_flops(self) -> float:
        """Forward FLOPs of one prompt's prefix (vision tower + causal LLM over the prompt)."""
        p = self.w.prompt_tokens
        return llm_forward_flops(self.text, p, p * (p + 1) / 2, 0) + vision_forward_flops(
            self.hf, self.w.vision_patches, self.frame_patches)

    def suffix_flops_per_token(self) -> float:
        """Forward FLOPs per response token against the stored prefix (with log-prob logits)."""
        p, r = self.w.prompt_tokens, self.w.response_tokens
        return llm_forward_flops(self.text, 1, p + r / 2, 1)

    def _passes(self) -> tuple[float, int]:
        """(forward-equivalents of a training pass, TP all-reduces per layer) for the recompute mode."""
        return (4.0, 6) if self.w.recompute == "full" else (3.0, 4)

    # ---- per-device seconds -------------------------------------------------------------------
    def _compute_s(self, flops: float, mfu: float, share: int) -> float:
        return flops / (self.gpu.bf16_tflops * 1e12 * mfu * share / self.units)

    def _bw_frac(self, share: int) -> float:
        return min(1.0, share / self.units / self.eff.hbm_saturation_frac)

    def _allreduce_s(self, nbytes: float, tp: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``tp`` ranks on NVLink (one direction), bandwidth term."""
        if tp <= 1:
            return 0.0
        return 2 * (tp - 1) / tp * nbytes / (self.gpu.nvlink_gbs / 2 * GB * self.eff.nvlink_efficiency)

    def _token_comm_s(self, tp: int, per_layer: int) -> float:
        """TP all-reduce seconds per token of a pass with ``per_layer`` all-reduces per layer."""
        t = self.text
        return per_layer * t.layers * self._allreduce_s(t.hidden * est.BF16, tp)

    def _vision_comm_s(self, tp: int, per_layer: int) -> float:
        v = est.vision_dims(self.hf)
        return per_layer * v.layers * self._allreduce_s(v.hidden * est.BF16, tp) * self.w.vision_patches

    def _pass_s(self, flops: float, nbytes: float, mfu: float, share: int) -> float:
        """Roofline seconds of a pass of ``flops`` reading ``nbytes`` of HBM on ``share``."""
        memory = nbytes / (self.gpu.hbm_gbs * GB * self.eff.decode_mbu * self._bw_frac(share))
        return max(self._compute_s(flops, mfu, share), memory)

    def prefix_s(self, share: int) -> float:
        """Seconds per prompt token of a prefix forward pass (old / ref / actor) on ``share``: one
        prompt per pass, the rank's weight shard read once per pass."""
        w = self.w
        s = self._pass_s(self.prefix_flops() / w.train_tp, self.weight_bytes / w.train_tp, self.eff.train_mfu, share)
        comm = self._token_comm_s(w.train_tp, 2) * w.prompt_tokens + self._vision_comm_s(w.train_tp, 2)
        return (s + comm) / w.prompt_tokens

    def prefill_s(self, share: int) -> float:
        """Seconds per prompt token of the rollout's prefill (one prefill per prompt: the G samples
        share its KV cache, SGLang's radix cache)."""
        w = self.w
        s = self._pass_s(self.prefix_flops() / w.rollout_tp, self.weight_bytes / w.rollout_tp, self.eff.prefill_mfu,
                         share)
        comm = self._token_comm_s(w.rollout_tp, 2) * w.prompt_tokens + self._vision_comm_s(w.rollout_tp, 2)
        return (s + comm) / w.prompt_tokens

    def suffix_s(self, share: int) -> float:
        """Seconds per response token of a no-grad suffix pass (old / ref log-probs); one group's
        G responses per pass."""
        w = self.w
        group_tokens = w.n * w.response_tokens
        return self._pass_s(self.suffix_flops_per_token() / w.train_tp, self.weight_bytes / w.train_tp / group_tokens,
                            self.eff.train_mfu, share) + self._token_comm_s(w.train_tp, 2)

    def update_s(self, share: int) -> float:
        """Seconds per response token of the actor update: suffix forward+backward (+ recompute) and
        the backward of the group's prefix, spread over the group's response tokens."""
        w = self.w
        passes, collectives = self._passes()
        group_tokens = w.n * w.response_tokens
        flops = passes * self.suffix_flops_per_token() + (passes - 1) * self.prefix_flops() / group_tokens
        nbytes = 2 * passes * self.weight_bytes / group_tokens  # weights read per pass over prefix and suffix
        comm = self._token_comm_s(w.train_tp, collectives) * (1 + w.prompt_tokens / group_tokens) + \
            self._vision_comm_s(w.train_tp, collectives - 2) / group_tokens
        return self._pass_s(flops / w.train_tp, nbytes / w.train_tp, self.eff.train_mfu, share) + comm

    def prefix_backward_s(self, share: int) -> float:
        """Seconds per prompt token of back-propagating one prefix copy (backward and, with full
        recompute, the recomputed forward): full-sequence updates pay it once per response."""
        return (self._passes()[0] - 1) * self.prefix_s(share)

    def gradient_bytes(self) -> float:
        """bf16 gradient bytes of one model-parallel rank (what one DP rank reduce-scatters)."""
        return est.total_parameters(self.hf) / self.w.train_tp * est.BF16

    def optimizer_s(self) -> float:
        """Seconds of one optimizer step: gradient reduce-scatter + parameter all-gather over the DP
        group on the network, ring cost ``2 (d-1)/d * bytes`` (Megatron's distributed optimizer), and
        Adam over the rank's fp32 shard in HBM (read and write of params, m, v)."""
        dp, grads = self.w.train_dp, self.gradient_bytes()
        net = 0.0 if dp <= 1 else 2 * (dp - 1) / dp * grads / (self.gpu.internode_gbs * GB * self.eff.internode_efficiency)
        adam = grads / est.BF16 / dp * 3 * 2 * est.FP32 / (self.gpu.hbm_gbs * GB * self.eff.decode_mbu)
        return net + adam

    def _decode_work(self) -> tuple[float, float]:
        """(FLOPs, HBM bytes) of one decode step of the engine's batch on one GPU."""
        w, t = self.w, self.text
        rows = w.rollout_groups * w.n
        ctx = w.prompt_tokens + w.decode_steps / 2
        flops = llm_forward_flops(t, rows, rows * ctx, rows) / w.rollout_tp
        return flops, self.weight_bytes / w.rollout_tp + rows * ctx * est.kv_bytes_per_token(t, w.rollout_tp)

    def decode_intensity(self) -> float:
        """Arithmetic intensity of a decode step, FLOPs per HBM byte (compare :meth:`ridge_point`)."""
        flops, nbytes = self._decode_work()
        return flops / nbytes

    def decode_s(self, share: int) -> float:
        """Seconds per decode step of the engine's whole batch on ``share`` (the rest of the device
        runs prefix passes, whose weight reads take HBM bandwidth from decode)."""
        w, t = self.w, self.text
        rows = w.rollout_groups * w.n
        flops, nbytes = self._decode_work()
        bw = self._bw_frac(share)
        if share < self.units:  # prefix passes on the other SMs read the weights once per prompt
            other = self.units - share
            per_prompt = self.prefix_s(other) * w.prompt_tokens
            achievable = self.gpu.hbm_gbs * GB * self.eff.decode_mbu
            used = min(self._bw_frac(other), self.weight_bytes / w.train_tp / per_prompt / achievable)
            bw = min(bw, max(1.0 - used, share / self.units))  # oversubscribed: bandwidth in proportion to SMs
        memory = nbytes / (self.gpu.hbm_gbs * GB * self.eff.decode_mbu * bw)
        compute = self._compute_s(flops, self.eff.decode_mfu, share)
        comm = 2 * t.layers * (self.eff.collective_latency_s + self._allreduce_s(rows * t.hidden * est.BF16,
                                                                                 w.rollout_tp))
        return max(memory, compute) + (comm if w.rollout_tp > 1 else 0.0)

    def ridge_point(self) -> float:
        """FLOPs per byte where the GPU turns compute-bound (peak * mfu / (HBM * mbu))."""
        return self.gpu.bf16_tflops * 1e12 * self.eff.decode_mfu / (self.gpu.hbm_gbs * GB * self.eff.decode_mbu)

    def sync_s(self) -> float:
        """A colocated weight sync: at most one device-local copy of the rollout weights (read and
        write at HBM bandwidth; views of the actor's shards copy nothing, so this is an upper bound)."""
        return 2 * self.weight_bytes / self.w.rollout_tp / (self.gpu.hbm_gbs * GB * self.eff.decode_mbu)

    def network_sync_s(self) -> float:
        """A disaggregated weight sync: each rollout GPU receives its weight shard over the network."""
        return self.weight_bytes / self.w.rollout_tp / (self.gpu.internode_gbs * GB * self.eff.internode_efficiency)

    def cost_model(self, network_sync: bool = False) -> CostModel:
        """A :class:`CostModel` holding these rates at every share ``1 .. share_units``, every
        (kind, share) marked calibrated, and the share-switch cost."""
        per_share = {"decode": self.decode_s, "prefill": self.prefill_s, "prefix/old": self.prefix_s,
                     "prefix/backward": self.prefix_backward_s,
                     "prefix/ref": self.prefix_s, "prefix/actor": self.prefix_s, "suffix/old": self.suffix_s,
                     "suffix/ref": self.suffix_s, "update": self.update_s}
        fixed = {"optimizer": self.optimizer_s(), "sync": self.network_sync_s() if network_sync else self.sync_s(),
                 "reward": 0.0, "adv": 0.0}
        cost = CostModel(switch_s=self.eff.share_switch_s)
        for s in range(1, self.units + 1):
            for kind, fn in per_share.items():
                cost.rates.setdefault(kind, {})[s] = fn(s)
            for kind, seconds in fixed.items():
                cost.rates.setdefault(kind, {})[s] = seconds
        cost.counts = {(kind, s): 2 for kind, by in cost.rates.items() for s in by}
        return cost
