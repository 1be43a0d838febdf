"""Config sections of ``rollplex-plan timeline``: the GPU's datasheet numbers and the achievable
efficiencies of the roofline model.

``gpu`` is a Hydra config group (``conf/gpu/{h800,h100,h200,a100}.yaml``; pick one with ``gpu=h100``),
each value with its datasheet source in the YAML; ``timeline`` holds the efficiency factors (each
field's docstring gives its source or says it is an assumption) and the command's options. Both are
structured dataclasses, so a misspelt key is an error like any other (``timeline.decode_mbuu=...``
fails). The run itself (``rollplex-train``) never reads them.

Units: TFLOP/s (dense, no sparsity), GB/s (10^9 bytes per second), GiB, seconds, fractions in (0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _check_fraction(section: str, key: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{section}.{key}={value!r}: expected a fraction 0 < x <= 1")


@dataclass(kw_only=True)
class GpuConfig:
    """One GPU model's datasheet numbers (``conf/gpu/<name>.yaml`` names the source of each).

    A value of 0 means "not given": ``rollplex-plan timeline`` refuses a GPU experiment whose
    ``gpu.<key>`` is 0; CPU runs never read this section.
    """

    name: str = "none"
    """Marketing name, e.g. ``H800 SXM5 80GB``."""
    bf16_tflops: float = 0.0
    """Peak dense BF16 tensor-core throughput, TFLOP/s."""
    hbm_gbs: float = 0.0
    """Peak HBM bandwidth, GB/s."""
    nvlink_gbs: float = 0.0
    """NVLink bandwidth per GPU as the datasheet gives it (both directions together), GB/s."""
    pcie_gbs: float = 0.0
    """Host link per GPU, one direction (PCIe Gen5 x16: 64, Gen4 x16: 32), GB/s."""
    internode_gbs: float = 0.0
    """Network bandwidth per GPU between nodes (one 400 Gb/s NIC per GPU: 50), GB/s."""
    memory_gib: float = 0.0
    """HBM capacity, GiB (as sold: 80 GB parts are 80 GiB of addressable memory here)."""
    source: str = ""
    """Where the numbers come from (datasheet URL)."""

    def __post_init__(self) -> None:
        for key in ("bf16_tflops", "hbm_gbs", "nvlink_gbs", "pcie_gbs", "internode_gbs", "memory_gib"):
            if getattr(self, key) < 0:
                raise ValueError(f"gpu.{key}={getattr(self, key)!r}: expected a number >= 0")

    def require(self) -> None:
        """Raise if a number the roofline needs is missing.

        Raises:
            ValueError: ``gpu.<key>`` is 0 (names the key and the config group to pick).
        """
        for key in ("bf16_tflops", "hbm_gbs", "nvlink_gbs", "pcie_gbs", "internode_gbs", "memory_gib"):
            if getattr(self, key) <= 0:
                raise ValueError(f"gpu.{key} is not set: pick a GPU with gpu=<h800|h100|h200|a100> (conf/gpu/)")


@dataclass(kw_only=True)
class TimelineConfig:
    """``rollplex-plan timeline``: achievable efficiencies of the roofline model and the command's options.

    The efficiencies are named so that the prediction can be re-run with other values
    (``timeline.train_mfu=0.35``); none was fitted to a result this project wants to see.
    """

    train_mfu: float = 0.47
    """Model FLOP utilisation of training forward/backward passes (prefix, suffix, update).
    Source: Megatron-LM README, "up to 47% Model FLOP Utilization (MFU) on H100 clusters"
    (github.com/NVIDIA/Megatron-LM). An upper figure: RL micro-batches are short."""
    prefill_mfu: float = 0.47
    """MFU of the rollout engine's prefill. Assumption: the same as training forward passes (large
    GEMMs of the same shapes); no separate published figure is used."""
    decode_mbu: float = 0.6
    """Model bandwidth utilisation of decode (achieved / peak HBM bytes per second). MBU as defined
    by Databricks/MosaicML, "LLM Inference Performance Engineering: Best Practices" (2023); 0.6 is
    an assumption inside the 50-80% range such serving stacks are usually quoted at."""
    decode_mfu: float = 0.47
    """MFU of decode GEMMs above the ridge point (large batches). Assumption: as ``prefill_mfu``."""
    hbm_saturation_frac: float = 0.5
    """Fraction of the SMs a memory-bound kernel needs to reach its full bandwidth; a device share
    below it gets proportionally less bandwidth. Assumption (no vendor figure); it sets how much
    decode slows when the planner gives SMs to prefix tasks."""
    nvlink_efficiency: float = 0.8
    """Achieved NCCL all-reduce bus bandwidth / unidirectional NVLink bandwidth. Assumption."""
    collective_latency_s: float = 1.0e-5
    """Fixed cost of one TP all-reduce (launch + synchronisation), seconds. Assumption (the order of
    NCCL's small-message latency on NVLink)."""
    pcie_efficiency: float = 0.8
    """Achieved pinned host<->device copy bandwidth / PCIe peak. Assumption."""
    internode_efficiency: float = 0.8
    """Achieved network bandwidth / NIC peak (disaggregated weight transfer). Assumption."""
    share_switch_s: float = 0.001
    """Seconds to change the SM split between the rollout and train workers (MPS/green-context
    shares prepared in advance). Assumption."""
    mean_response_frac: float = 1.0
    """Mean response length / ``rollout.max_new_tokens`` (suffix and update work); the decode window
    is always ``max_new_tokens`` steps (the longest response). 1.0: every response at the maximum."""
    share_units: int = 20
    """Device-share granularity of the planner on GPUs: the SMs are split in steps of
    ``1/share_units`` (20: 5% steps, as MPS's active-thread percentage can express)."""
    run_dir: Optional[str] = None
    """A finished run's output directory: predict with the cost model it saved in its latest
    checkpoint (``trainer_state.json`` -> ``schedule`` -> ``cost``) and its measured phase times,
    instead of the roofline."""
    gantt: Optional[str] = None
    """Where to write the Gantt PNG (None: ``outputs/timeline/<experiment>.png``; empty: none)."""

    def __post_init__(self) -> None:
        for key in ("train_mfu", "prefill_mfu", "decode_mbu", "decode_mfu", "hbm_saturation_frac",
                    "nvlink_efficiency", "pcie_efficiency", "internode_efficiency", "mean_response_frac"):
            _check_fraction("timeline", key, getattr(self, key))
        if self.collective_latency_s < 0 or self.share_switch_s < 0:
            raise ValueError("timeline.collective_latency_s / timeline.share_switch_s: expected seconds >= 0")
        if self.share_units < 2:
            raise ValueError(f"timeline.share_units={self.share_units}: expected an integer >= 2")
