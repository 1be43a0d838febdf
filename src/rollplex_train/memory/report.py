"""``rollplex-plan memory``: per-phase, per-GPU memory of one step under three residency policies.

- **naive colocation**: every group of the rollplex step resident at once, rollout weights as a
  separate copy, nothing offloaded (the paper's "everything colocated" baseline).
- **serial with offload**: the serial schedule (prefix work inside each scoring/update phase), each
  phase holding only the groups it uses, everything else in host memory (verl-style param/optimizer
  offload); the column is the bytes the phase's groups need, so it may exceed the budget.
- **rollplex**: prefix tasks in the decode window, rollout weights as views of the actor's where the
  layouts match, residency planned by :func:`residency.plan_residency` within the budget.

The text ends with ``memory: naive_colocation=<a>GiB serial_offload=<b>GiB rollplex=<c>GiB budget=<B>GiB``
(peaks over the phases), plus `` short=<s>GiB`` when even the rollplex plan needs more than the
budget. Assumptions and formulas: ``docs/memory.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rollplex_train.memory import estimate as est
from rollplex_train.memory.groups import (PHASES, TensorGroup, rollout_shares_actor_weights, rollout_shares_prompt_kv,
                                          step_groups)
from rollplex_train.memory.residency import ResidencyPlan, phases_from_groups
from rollplex_train.memory.step_plan import budget_bytes, plan_rows, plan_step, row, run_plan
from rollplex_train.parallel import ParallelLayout

if TYPE_CHECKING:
    from rollplex_train.config import Config

log = logging.getLogger(__name__)
PREFIX_GROUPS = ("old_prefix_kv", "ref_prefix_kv", "actor_prefix_acts")


def _gib(nbytes: float) -> str:
    """GiB with one decimal (three significant digits below 1 GiB: the CPU runs)."""
    gib = nbytes / est.GIB
    return f"{gib:.1f}" if gib >= 1 or gib == 0 else f"{gib:.3g}"


def serial_phase_bytes(groups: list[TensorGroup]) -> dict[str, int]:
    """Bytes each phase of the serial step needs when everything it does not use is offloaded."""
    phases = phases_from_groups(groups, PHASES)
    sizes = {g.name: g.nbytes for g in groups}
    return {p.name: sum(sizes[g] for g in p.uses) for p in phases}


def report(config: "Config") -> str:
    """The memory report of ``config`` (see the module docstring).

    Raises:
        FileNotFoundError: no architecture file (``model.hf_config`` / ``model.path``).
        ValueError: layout/batch/share-plan checks (a plan over the budget is reported, not raised).
    """
    from rollplex_train.models.arch import load_hf_config

    hf = load_hf_config(config.model)
    naive = step_groups(config, hf, "naive")
    serial = step_groups(config, hf, "serial")
    step = plan_step(config, hf, "rollplex")
    groups, plan, worst, short = step.groups, step.plan, step.worst_phase, step.short_bytes
    naive_total = sum(g.nbytes for g in naive)
    serial_bytes = serial_phase_bytes(serial)
    budget = budget_bytes(config)
    lines = [f"# rollplex-plan memory: {config.trainer.experiment_name} (per GPU, GiB)", ""]
    lines += _assumptions(config, hf)
    lines += ["", "## Per phase (GiB per GPU)", "",
              f"{'phase':<16} {'naive_colocation':>17} {'serial_offload':>15} {'rollplex':>9}  rollplex residency"]
    for p in plan.phases:
        lines.append(f"{p.phase:<16} {_gib(naive_total):>17} {_gib(serial_bytes[p.phase]):>15} "
                     f"{_gib(p.device_bytes):>9}  {_describe(p, plan)}")
    lines += ["", "## Tensor groups (rollplex step; GiB per GPU)", "",
              f"{'group':<18} {'GiB':>7} {'items':>5} {'kind':<7} {'producer':<15} consumers / how sized"]
    for g in groups:
        lines.append(f"{g.name:<18} {_gib(g.nbytes):>7} {g.num_items:>5} {g.kind:<7} {g.producer or '-':<15} "
                     f"{','.join(g.consumers) or '-'} / {g.note}")
    rollout_copy = next(g for g in naive if g.name == "rollout_weights")
    lines.append(f"(naive colocation and serial keep rollout_weights as a {_gib(rollout_copy.nbytes)} GiB copy)")
    window = plan["rollout_decode"].resident
    counts = {g.name: g.num_items for g in groups}
    held = sum(plan.item_bytes[g] * window.get(g, 0) for g in PREFIX_GROUPS)
    lines += ["", f"prefix states kept alive in the decode window ({_gib(held)} GiB): old/ref KV of "
              f"{plan.items_alive('rollout_decode', PREFIX_GROUPS[:2])} of {counts['old_prefix_kv']} prompts, "
              f"actor prefix graphs of {window.get('actor_prefix_acts', 0)} of {counts['actor_prefix_acts']}; "
              "the rest streamed to pinned host memory and prefetched before their consumer"]
    lines += ["", *_run_rows(config, hf)]
    peak_serial = max(serial_bytes.values())
    if peak_serial > budget:
        lines.append(f"serial with offload does not fit: {serial_bytes and max(serial_bytes, key=serial_bytes.get)} "
                     f"needs {_gib(peak_serial)} GiB")
    if short:
        lines.append(f"rollplex does not fit the {budget / est.GIB:g} GiB budget: {worst} needs at least "
                     f"{_gib(plan.peak_bytes)} GiB, short by {short / est.GIB:.2f} GiB (the residency above is "
                     "planned at that least budget)")
    lines.append(f"memory: naive_colocation={_gib(naive_total)}GiB serial_offload={_gib(peak_serial)}GiB "
                 f"rollplex={_gib(plan.peak_bytes)}GiB budget={budget / est.GIB:g}GiB"
                 + (f" short={short / est.GIB:.2f}GiB" if short else ""))
    log.debug("memory plan of %s: peak %.1f GiB", config.trainer.experiment_name, plan.peak_bytes / est.GIB)
    return "\n".join(lines) + "\n"


def _run_rows(config: "Config", hf) -> list[str]:
    """The rows the run of ``config`` logs (``memory/<phase>/<group>_gib``), from its own plan
    (``step_plan.run_plan``: its schedule, sharing and backend)."""
    step = run_plan(config, hf)
    rows = plan_rows(step)
    groups = list(dict.fromkeys(name.split("/")[2][: -len("_gib")] for name in rows))
    out = [f"## Rows the run measures: memory/<phase>/<group>_gib ({config.schedule.name} schedule, sharing "
           f"{'on' if config.sharing.enabled else 'off'}, actor.backend={config.actor.backend}; GiB per device, "
           "<= : at most)", "", f"{'phase':<16} " + " ".join(f"{g:>17}" for g in groups)]
    for phase in PHASES:
        cells = []
        for g in groups:
            gib, kind = rows.get(row(phase, g), (None, ""))
            cells.append(f"{'-' if gib is None else ('<=' if kind == 'at_most' else '') + f'{gib:.4g}':>17}")
        out.append(f"{phase:<16} " + " ".join(cells))
    if step.short_bytes:
        out.append(f"(the run's plan does not fit: {step.worst_phase} needs {step.short_bytes / est.GIB:.3g} GiB more)")
    return out


def _describe(p, plan: ResidencyPlan) -> str:
    """One line: offloaded groups, overlapped prefetches, exposed copies, streamed items."""
    parts = []
    for label, counts in (("host", p.host), ("prefetch", p.prefetch), ("exposed", p.exposed),
                          ("streamed", p.streamed)):
        items = [f"{g}{'' if k == 1 else f'x{k}'}" for g, k in counts.items() if plan.item_bytes[g] and k]
        if items:
            parts.append(f"{label}: {' '.join(items)}")
    return "; ".join(parts) or "all resident"


def _assumptions(config: "Config", hf) -> list[str]:
    lay, batch = ParallelLayout.from_config(config), est.batch_shape(config, hf)
    text = est.text_dims(hf)
    mem = config.memory
    shared = rollout_shares_actor_weights(config)
    params = est.total_parameters(hf)
    return [
        "## Assumptions",
        f"- model: {params / 1e9:.2f}B parameters ({est.llm_parameters(text) / 1e9:.2f}B LLM, "
        f"{est.vision_parameters(hf) / 1e9:.2f}B vision), {config.model.dtype} weights/KV/activations, "
        f"architecture from {config.model.hf_config or config.model.path}",
        f"- layout: {lay.world_size} GPUs ({lay.nnodes} node(s) x {lay.devices_per_node}); actor/reference "
        f"TP={lay.train_tp} PP={lay.train_pp} DP={lay.train_dp} ({mem.train_strategy}, distributed optimizer="
        f"{'on' if mem.distributed_optimizer else 'off'}); {lay.rollout_dp} rollout engines of TP={lay.rollout_tp}",
        f"- batch: {batch.prompts} prompts x {batch.n} responses per step; prompts of "
        f"{batch.prompt_tokens} tokens (data.max_prompt_length, incl. {batch.vision_tokens} vision tokens = "
        f"{batch.vision_patches} vision-tower patches of the largest image/video); responses of "
        f"{batch.response_tokens} tokens (rollout.max_new_tokens, every sequence at the maximum)",
        f"- rollout KV cache ({config.rollout.name} engine): "
        + ("one copy of a prompt's KV for its n samples (P W + P n C positions: "
           + ("SGLang's radix cache" if config.rollout.name == "sglang" else "rollout.share_prompt_kv") + ")"
           if rollout_shares_prompt_kv(config) else
           "one cache per sequence (P n (W + C) positions: the prompt's cache repeated n times, "
           "rollout.share_prompt_kv=false)")
        + f", {est.kv_bytes_per_token(text, lay.rollout_tp, est.param_bytes_of(config)):,} bytes/token/GPU",
        f"- update: mini-batches of {batch.mini_batch_prompts} prompts ({est.per_rank(batch.mini_batch_prompts, lay.train_dp)}"
        f"/rank), micro-batches of {batch.micro_groups} group(s) = {batch.micro_groups * batch.n} responses; "
        f"activation recompute={mem.activation_recompute}; vision tower "
        f"{'frozen' if config.model.freeze_vision_tower else 'trained'}",
        "- rollplex: old/ref prefix KV caches of the rank's prompts and the first mini-batch's actor prefix "
        "graphs are made in the decode window; rollout weights "
        + ("map the actor's: views, plus the tensors the share plan rebuilds (rollout_rebuilt, as "
           "rollplex-plan sharing counts them)" if shared else "are a separate copy"),
        f"- offload to pinned host memory: {'allowed' if mem.pinned_host_offload else 'off'}; "
        + (f"runtime_reserved: {mem.reserved_gib:g} GiB per GPU for CUDA contexts and NCCL communicators "
           "(memory.reserved_gib; docs/memory.md gives the sources)" if config.cluster.device == "cuda" else
           "runtime_reserved: none (cluster.device=cpu: no CUDA context, gloo; the budget is memory.budget_gib "
           "or cluster.gpu_memory_gib per device)"),
    ]
