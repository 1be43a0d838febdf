"""``rollplex-plan sharing``: the weight-sharing table of a config's model for all TP pairs.

Layouts: training ``hf`` when ``actor.backend == "torch"`` and ``actor.tensor_parallel_size == 1``
(the embedded run), else ``megatron``; rollout ``hf`` when ``rollout.name == "builtin"`` and
``rollout.tensor_parallel_size == 1``, else ``sglang``. The same pair of layouts is used for every
(t, r) of the table. Percentages are of rollout bytes over all lcm(t, r) devices: ``view`` counts
views and strided views, ``rebuild`` local rebuilds, ``gather`` tensors that need rows from another
device (``moved``: the bytes that cross devices). Every decoder layer (and vision block) has the
same layout, so layer 0 and block 0 are planned and counted num_layers / depth times (exact).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter

from rollplex_train.models.arch import load_hf_config, parameter_shapes
from rollplex_train.models.layouts import Dims
from rollplex_train.parallel import ParallelLayout
from rollplex_train.sharing.plan import ACTIONS, plan_sharing

log = logging.getLogger(__name__)

DEGREES = (1, 2, 4, 8)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_REPEATED = re.compile(r"\.(layers|blocks)\.(\d+)\.")


def layouts_of(config) -> tuple[str, str]:
    """``(training layout, rollout layout)`` of a ``Config`` (module docstring)."""
    lay = ParallelLayout.from_config(config)
    train = "hf" if config.actor.backend == "torch" and lay.train_tp == 1 else "megatron"
    rollout = "hf" if config.rollout.name == "builtin" and lay.rollout_tp == 1 else "sglang"
    return train, rollout


def _template(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Shapes with only layer 0 / block 0 kept, and how many layers/blocks each kept prefix stands for."""
    counts: Counter = Counter()
    for name in shapes:
        m = _REPEATED.search(name)
        if m and name.endswith(("q_proj.weight", "qkv.weight")):
            counts[m.group(1)] += 1
    kept = {n: s for n, s in shapes.items() if not (m := _REPEATED.search(n)) or m.group(2) == "0"}
    return kept, dict(counts)


def device_totals(shapes, dims: Dims, *, t: int, r: int, train: str, rollout: str, split_qkv: bool,
                  split_gate_up: bool, itemsize: int) -> list[Counter]:
    """Bytes per action (and ``remote``) of the full model on each of the lcm(t, r) devices of the
    plan (device d holds training rank d % t); raises ValueError when the layouts cannot split the
    model at (t, r)."""
    kept, counts = _template(shapes)
    plan = plan_sharing(kept, dims, t=t, r=r, train_kind=train, rollout_kind=rollout, split_qkv=split_qkv,
                        split_gate_up=split_gate_up, itemsize=itemsize)
    out = []
    for pair in plan.devices:
        totals: Counter = Counter()
        for name, tp in plan.tensors[pair].items():
            m = _REPEATED.search(name)
            times = counts.get(m.group(1), 1) if m else 1
            totals[tp.action] += tp.nbytes * times
            totals["remote"] += tp.remote_bytes * times
        out.append(totals)
    return out


def share_totals(shapes, dims: Dims, **kwargs) -> Counter:
    """Bytes per action (and ``remote``) over all devices for the full model (``device_totals`` summed)."""
    return sum(device_totals(shapes, dims, **kwargs), Counter())


def configured_device_totals(config, hf_config) -> list[Counter]:
    """``device_totals`` at the degrees of the config's :class:`~rollplex_train.parallel.ParallelLayout`
    (``train_tp`` -> ``rollout_tp``), its layouts (``layouts_of``), ``sharing`` options and dtype.

    Raises:
        ValueError: the layouts cannot split the model at the configured degrees (names the keys).
    """
    lay = ParallelLayout.from_config(config)
    train, rollout = layouts_of(config)
    try:
        return device_totals(parameter_shapes(hf_config), Dims.from_hf_config(hf_config), t=lay.train_tp,
                             r=lay.rollout_tp, train=train, rollout=rollout, split_qkv=config.sharing.split_qkv,
                             split_gate_up=config.sharing.split_gate_up, itemsize=ITEMSIZE[config.model.dtype])
    except ValueError as err:
        raise ValueError(f"actor.tensor_parallel_size={lay.train_tp}, rollout.tensor_parallel_size="
                         f"{lay.rollout_tp}: cannot split {config.model.hf_config or config.model.path}: {err}") from err


def rebuilt_bytes_per_device(per_device: list[Counter]) -> int:
    """Device bytes of the rollout buffers a share plan rebuilds on one device: its ``local_rebuild``
    and ``gather`` tensors (a persistent buffer each, refilled at every weight sync;
    ``sharing/materialize.py``), the largest over the plan's devices. Views cost nothing."""
    return max(c["local_rebuild"] + c["gather"] for c in per_device)


def _pcts(totals: Counter) -> tuple[float, float, float, float]:
    total = sum(totals[a] for a in ACTIONS) or 1
    return (100 * (totals["view"] + totals["strided_view"]) / total, 100 * totals["local_rebuild"] / total,
            100 * totals["gather"] / total, 100 * totals["remote"] / total)


def _cell(shapes, dims, t, r, train, rollout, options: bool, itemsize: int) -> str:
    try:
        totals = share_totals(shapes, dims, t=t, r=r, train=train, rollout=rollout, split_qkv=options,
                              split_gate_up=options, itemsize=itemsize)
    except ValueError as err:
        return f"n/a: {err}"
    view, rebuild, gather, moved = _pcts(totals)
    return f"{view:6.1f}% {rebuild:6.1f}% {gather:6.1f}% {moved:6.1f}%"


def report(config) -> str:
    """The table for all (t, r) in {1,2,4,8}^2 without and with both rollout-side options, ending
    with ``sharing: t=<t> r=<r> view=<a>% rebuild=<b>% gather=<c>%`` for the configured degrees
    and ``sharing.split_qkv``/``sharing.split_gate_up``.

    Raises:
        FileNotFoundError / ValueError: from ``load_hf_config``; ValueError when the configured
        degrees cannot split the model.
    """
    hf_config = load_hf_config(config.model)
    shapes = parameter_shapes(hf_config)
    dims = Dims.from_hf_config(hf_config)
    itemsize = ITEMSIZE[config.model.dtype]
    train, rollout = layouts_of(config)
    model_gib = sum(math.prod(s) for s in shapes.values()) * itemsize / 2**30
    lines = [
        f"weight sharing plan: {train} (TP t) -> {rollout} (TP r), {len(shapes)} tensors, "
        f"{model_gib:.2f} GiB in {config.model.dtype}",
        "percent of rollout bytes on all lcm(t, r) devices; view = view + strided_view; "
        "moved = bytes copied between devices",
        f"{'t':>2} {'r':>2} | {'view':>7} {'rebuild':>7} {'gather':>7} {'moved':>7} | "
        f"with split_qkv + split_gate_up",
    ]
    for t in DEGREES:
        for r in DEGREES:
            lines.append(f"{t:>2} {r:>2} | {_cell(shapes, dims, t, r, train, rollout, False, itemsize)} | "
                         f"{_cell(shapes, dims, t, r, train, rollout, True, itemsize)}")
    lay = ParallelLayout.from_config(config)
    t, r = lay.train_tp, lay.rollout_tp
    opts = config.sharing
    if lay.train_pp > 1:
        lines.append(f"note: actor.pipeline_parallel_size={lay.train_pp}: the plan covers "
                     "TP only; layers of other pipeline stages are gathered")
    per_device = configured_device_totals(config, hf_config)
    view, rebuild, gather, _ = _pcts(sum(per_device, Counter()))
    rebuilt = rebuilt_bytes_per_device(per_device)
    rollout_dev = max(sum(c[a] for a in ACTIONS) for c in per_device)
    lines.append(f"layout: {lay.describe()}")
    lines.append(f"options: split_qkv={opts.split_qkv} split_gate_up={opts.split_gate_up} "
                 f"(sharing.enabled={opts.enabled})")
    lines.append(f"rollout weights per device: {rollout_dev / 2**30:.2f} GiB, of which rebuilt into persistent "
                 f"buffers (rebuild + gather): {rebuilt / 2**30:.2f} GiB "
                 "(rollout_rebuilt in rollplex-plan memory)")
    lines.append(f"sharing: t={t} r={r} view={view:.1f}% rebuild={rebuild:.1f}% gather={gather:.1f}%")
    return "\n".join(lines)
