"""``rollplex-plan timeline``: the predicted step of serial, disaggregated and rollplex, phase by phase.

Two sources of task costs, one placement path (``runtime/predict.py`` with the run-time planner):

- **roofline** (GPU experiments): :class:`~rollplex_train.runtime.roofline.RooflineModel` from the
  HF config, the parallel layout, the ``gpu`` datasheet and the ``timeline`` efficiencies; host
  copies from the memory plan (``memory/``); disaggregated = half the GPUs rollout, half training.
- **calibrated** (``timeline.run_dir=<run output dir>``): the cost model a rollplex run saved with its
  checkpoint, completed from its metrics (``runtime/calibrate.py``); disaggregated = the device's
  threads split in halves, as ``runtime/disaggregated.py`` runs it.

Prints a per-phase table per schedule, writes a Gantt PNG of one device's step (``timeline.gantt``)
and ends with ``timeline: serial=<s>s disaggregated=<s>s rollplex=<s>s rollplex/serial=<x>
rollplex/disaggregated=<y> prefix_hidden=<p>%``. Assumptions: ``docs/timeline.md``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rollplex_train.memory import estimate as est
from rollplex_train.parallel import ParallelLayout
from rollplex_train.runtime.graph import StepGraph, build_step_graph
from rollplex_train.runtime.old_policy import reuse_actor_forward
from rollplex_train.runtime.predict import PHASE_ROWS, Copies, StepPrediction, predict_rollplex, predict_serial
from rollplex_train.runtime.roofline import DeviceWork, RooflineModel

if TYPE_CHECKING:
    from rollplex_train.config import Config

log = logging.getLogger(__name__)
GIB = 1024**3
MEMORY_PHASES = {"rollout_decode": "gen", "old_log_prob": "old_log_prob", "ref_log_prob": "ref",
                 "actor_update": "update_actor", "optimizer_step": "update_actor", "weight_sync": "update_weights"}
"""Memory-plan phase -> the predicted phase its copies belong to."""


def _budget(config: "Config") -> Optional[int]:
    gib = config.schedule.prefix_memory_gib
    return None if gib is None else int(gib * GIB)


def _prefix_copies(config: "Config") -> int:
    """Prefix passes per group in the serial baselines: 1 with ``model.shared_prefix``, else G."""
    return 1 if config.model.shared_prefix else config.rollout.n


def _mini_groups(config: "Config", groups: int, dp: int) -> int:
    mini = config.actor.ppo_mini_batch_size
    return groups if mini <= 0 else min(groups, math.ceil(mini / dp))


def device_work(config: "Config", hf: Any, train_dp: int, rollout_dp: int) -> DeviceWork:
    """The work of one device when the step's prompts are spread over ``train_dp`` training ranks and
    ``rollout_dp`` rollout engines (the batch of ``memory.estimate.batch_shape``: prompts at
    ``data.max_prompt_length``)."""
    batch = est.batch_shape(config, hf)
    groups = math.ceil(batch.prompts / train_dp)
    mini = _mini_groups(config, groups, train_dp)
    return DeviceWork(
        train_groups=groups, rollout_groups=math.ceil(batch.prompts / rollout_dp), n=batch.n,
        prompt_tokens=batch.prompt_tokens, vision_patches=batch.vision_patches,
        response_tokens=max(1, round(batch.response_tokens * config.timeline.mean_response_frac)),
        decode_steps=batch.response_tokens, mini_batch_groups=mini,
        train_tp=config.actor.tensor_parallel_size, rollout_tp=config.rollout.tensor_parallel_size,
        train_dp=train_dp, recompute=config.memory.activation_recompute,
        needs_reference=config.algorithm.needs_reference, old_from_actor_groups=mini if reuse_actor_forward(config, hf.to_dict()) else 0)


def frame_patches(config: "Config", hf: Any) -> int:
    """Vision patches of one image / video frame at the size bounds (full-attention context)."""
    v = hf.vision_config
    block = (v.patch_size * v.spatial_merge_size) ** 2
    return max(config.data.max_pixels, config.data.video_max_pixels) // block * block // v.patch_size**2


def _graph(work: DeviceWork, decode_steps: int, prompt_tokens: int, response_tokens: int,
           bytes_per_token: dict[str, float]) -> StepGraph:
    return build_step_graph([prompt_tokens] * work.train_groups, work.n * response_tokens, decode_steps=decode_steps,
                            mini_batch_groups=work.mini_batch_groups, needs_reference=work.needs_reference,
                            weights_version=0, prefix_bytes_per_token=max(bytes_per_token.get("old", 0.0),
                                                                          bytes_per_token.get("ref", 0.0)),
                            actor_bytes_per_token=bytes_per_token.get("actor", 0.0),
                            old_from_actor_groups=work.old_from_actor_groups)


def memory_copies(config: "Config", hf: Any, layout_name: str) -> Optional[dict[str, Copies]]:
    """Host<->device copy seconds per predicted phase, from the residency plan of ``layout_name``
    (``serial`` / ``rollplex`` groups of ``memory/groups.py``) over PCIe; None if that plan does not
    fit the device budget."""
    from rollplex_train.memory.groups import PHASES, step_groups
    from rollplex_train.memory.step_plan import budget_bytes
    from rollplex_train.memory.residency import phases_from_groups, plan_residency

    groups = step_groups(config, hf, layout_name)
    try:
        plan = plan_residency(groups, phases_from_groups(groups, PHASES), budget_bytes(config),
                              allow_offload=config.memory.pinned_host_offload)
    except ValueError as err:
        log.info("memory plan of the %s step does not fit: %s", layout_name, err)
        return None
    bps = config.gpu.pcie_gbs * 1e9 * config.timeline.pcie_efficiency
    out: dict[str, Copies] = {}
    for mem_phase, phase in MEMORY_PHASES.items():
        c = plan.copy_bytes(mem_phase)
        copies = out.setdefault(phase, Copies())
        copies.exposed_s += c["h2d_exposed"] / bps
        copies.overlapped_s += max(c["h2d_overlapped"], c["d2h"]) / bps  # the two directions run together
    return out


def colocated_predictions(model: RooflineModel, bytes_per_token: dict[str, float], budget: Optional[int],
                          serial_copies: Optional[dict[str, Copies]] = None,
                          rollplex_copies: Optional[dict[str, Copies]] = None, copies_of_prefix: int = 1):
    """Serial, serial with full sequences and rollplex predictions of one device's roofline work
    (``model.w``) on the whole GPU; ``copies_of_prefix``: prefix passes per group in the serial
    baseline (1: ``model.shared_prefix``, G: full sequences).

    Returns:
        ({"serial": ..., "serial_full": ..., "rollplex": ...}, the step graph, the roofline cost model).
    """
    w, units = model.w, model.units
    graph = _graph(w, w.decode_steps, w.prompt_tokens, w.response_tokens, bytes_per_token)
    cost = model.cost_model()
    prefill = w.rollout_groups * w.prompt_tokens
    preds = {"serial": predict_serial(graph, cost, units, prefill, prefix_copies=copies_of_prefix, copies=serial_copies),
             "serial_full": predict_serial(graph, cost, units, prefill, schedule="serial_full", prefix_copies=w.n,
                                           copies=serial_copies),
             "rollplex": predict_rollplex(graph, cost, units, prefill, memory_budget_bytes=budget,
                                          copies=rollplex_copies)}
    return preds, graph, cost


def gpu_predictions(config: "Config", hf: Any) -> tuple[dict[str, StepPrediction], list[str]]:
    """Roofline predictions of the three schedules and lines describing the model's numbers."""
    from rollplex_train.memory.groups import step_groups

    lay, units, frames = ParallelLayout.from_config(config), config.timeline.share_units, frame_patches(config, hf)
    if lay.train_pp > 1:
        raise ValueError(f"actor.pipeline_parallel_size={lay.train_pp}: the roofline model has no pipeline stages "
                         "(stage split, bubbles) yet; predict with 1")
    work = device_work(config, hf, lay.train_dp, lay.rollout_dp)
    model = RooflineModel(hf, work, config.gpu, config.timeline, frames)
    sizes = {g.name: g.item_bytes for g in step_groups(config, hf, "rollplex")}
    per_token = {"old": sizes.get("old_prefix_kv", 0) / work.prompt_tokens,
                 "ref": sizes.get("ref_prefix_kv", 0) / work.prompt_tokens,
                 "actor": sizes.get("actor_prefix_acts", 0) / work.prompt_tokens}
    serial_copies, rollplex_copies = memory_copies(config, hf, "serial"), memory_copies(config, hf, "rollplex")
    repeats = _prefix_copies(config)
    preds, graph, cost = colocated_predictions(model, per_token, _budget(config), serial_copies, rollplex_copies,
                                               repeats)
    prefill = work.rollout_groups * work.prompt_tokens
    half = lay.world_size // 2
    if half and half % (lay.train_tp * lay.train_pp) == 0 and half % lay.rollout_tp == 0:  # half the GPUs per side
        half_train_dp, half_rollout_dp = half // (lay.train_tp * lay.train_pp), half // lay.rollout_tp
        dwork = device_work(config, hf, half_train_dp, half_rollout_dp)
        dmodel = RooflineModel(hf, dwork, config.gpu, config.timeline, frames)
        dgraph = _graph(dwork, dwork.decode_steps, dwork.prompt_tokens, dwork.response_tokens, per_token)
        preds["disaggregated"] = predict_serial(dgraph, dmodel.cost_model(network_sync=True), units,
                                                dwork.rollout_groups * dwork.prompt_tokens, schedule="disaggregated",
                                                prefix_copies=repeats)
        split = f"{half} GPUs rollout ({half_rollout_dp} engines) + {half} GPUs training (DP={half_train_dp})"
    else:  # too few GPUs to split: halves of each GPU's SMs
        preds["disaggregated"] = predict_serial(graph, cost, units - units // 2, prefill, schedule="disaggregated",
                                                rollout_share=units // 2, prefix_copies=repeats)
        split = "each GPU's SMs in halves (too few GPUs for two disjoint sets)"
    rows, intensity = work.rollout_groups * work.n, model.decode_intensity()
    notes = [
        f"- layout: {lay.describe()}; per device: {work.train_groups} groups x G={work.n} on a training rank, "
        f"{work.rollout_groups} groups ({rows} rows) per rollout engine; disaggregated: {split}",
        f"- work: prompts of {work.prompt_tokens} tokens ({work.vision_patches} vision patches), responses of "
        f"{work.response_tokens} tokens, decode window {work.decode_steps} steps, {len(graph.of_kind('update'))} "
        f"mini-batch(es) per rank, activation recompute={work.recompute}",
        f"- gpu: {config.gpu.name}, {config.gpu.bf16_tflops:g} TFLOP/s bf16, {config.gpu.hbm_gbs:g} GB/s HBM, "
        f"{config.gpu.nvlink_gbs:g} GB/s NVLink, {config.gpu.pcie_gbs:g} GB/s PCIe; efficiencies: train MFU "
        f"{config.timeline.train_mfu:g}, prefill MFU {config.timeline.prefill_mfu:g}, decode MBU {config.timeline.decode_mbu:g} "
        f"(sources: {config.gpu.source or 'gpu.source not given'}; docs/timeline.md)",
        f"- decode: {1e3 * cost.rate('decode', units):.1f} ms/step on the whole GPU, arithmetic intensity "
        f"{intensity:.0f} FLOP/B against a ridge point of {model.ridge_point():.0f} "
        f"({'compute' if intensity > model.ridge_point() else 'memory'}-bound); prefix "
        f"{cost.seconds('prefix/old', work.prompt_tokens, units):.2f} s per prompt and role; prefill "
        f"{cost.seconds('prefill', work.prompt_tokens, units):.2f} s per prompt",
        f"- host copies (memory plan over PCIe): serial {'not planned (does not fit)' if serial_copies is None else 'planned'}, "
        f"rollplex {'not planned (does not fit)' if rollplex_copies is None else 'planned'}",
    ]
    return preds, notes


def cpu_predictions(config: "Config") -> tuple[dict[str, StepPrediction], list[str], Any]:
    """Predictions calibrated from ``timeline.run_dir`` (see ``runtime/calibrate.py``), the lines
    describing them, and the :class:`~rollplex_train.runtime.calibrate.CalibratedRun`."""
    from rollplex_train.runtime.calibrate import load_run

    lay = ParallelLayout.from_config(config)
    groups = math.ceil(config.data.rollout_batch_size / lay.train_dp)
    mini = _mini_groups(config, groups, lay.train_dp)
    run = load_run(config.timeline.run_dir, groups, mini)
    work = DeviceWork(train_groups=groups, rollout_groups=groups, n=config.rollout.n, prompt_tokens=run.prompt_tokens,
                      vision_patches=0, response_tokens=run.response_tokens // config.rollout.n,
                      decode_steps=run.decode_steps, mini_batch_groups=mini, train_tp=1, rollout_tp=1, train_dp=lay.train_dp,
                      recompute="none", needs_reference=config.algorithm.needs_reference,
                      # the calibrated run tells whether the old-policy pass ran: it measured it or not
                      old_from_actor_groups=0 if "prefix/old" in run.cost.rates else mini)
    graph = _graph(work, run.decode_steps, run.prompt_tokens, work.response_tokens, run.bytes_per_token)
    t = run.threads
    repeats = _prefix_copies(config)
    preds = {"serial": predict_serial(graph, run.cost, t, 0, prefix_copies=repeats),
             "serial_full": predict_serial(graph, run.cost, t, 0, schedule="serial_full", prefix_copies=config.rollout.n),
             "disaggregated": predict_serial(graph, run.cost, t // 2, 0, schedule="disaggregated",
                                             rollout_share=(t + 1) // 2, prefix_copies=repeats),
             "rollplex": predict_rollplex(graph, run.cost, t, 0, memory_budget_bytes=_budget(config))}
    measured = f"{run.measured['step']:.2f} s median" if "step" in run.measured else "none logged after it"
    notes = [f"- calibrated from {run.source} (step {run.step}, {t} thread(s) per device); steps after it "
             f"measured: {measured}",
             f"- per device: {groups} groups x G={config.rollout.n}, prompts of {run.prompt_tokens} tokens, "
             f"{run.response_tokens} response tokens per group, decode window {run.decode_steps} steps; "
             f"disaggregated: {(t + 1) // 2} thread(s) rollout, {t // 2} training"]
    if run.trace is not None:
        notes.append(f"- measured trace drawn beside the predictions: {run.trace}")
    return preds, notes, run


def _table(preds: dict[str, StepPrediction], measured: dict[str, float]) -> list[str]:
    """Phase rows, one column per schedule (and the measured run's medians, if any)."""
    columns = {name: dict(p.phases, step=p.step_s) for name, p in preds.items()}
    if measured:
        columns["measured run"] = measured
    phases = [p for p in PHASE_ROWS if any(p in c for c in columns.values())]
    phases += [p for p in ("prefix_exposed",) if p in measured] + ["step"]  # window work that outlasted decode
    lines = [f"{'phase':<16}" + "".join(f"{n:>15}" for n in columns)]
    for phase in phases:
        lines.append(f"{phase:<16}" + "".join(f"{c.get(phase, 0.0):>15.3f}" for c in columns.values()))
    return lines


def report(config: "Config") -> str:
    """The timeline report of ``config`` (see the module docstring).

    Raises:
        ValueError: a CPU experiment without ``timeline.run_dir``, a missing ``gpu.<key>``, pipeline
            parallelism (not modelled), or a run directory that holds no calibration. FileNotFoundError: no architecture file / checkpoint.
    """
    from rollplex_train.runtime.timeline import Timeline, plot_gantt

    if config.timeline.run_dir:
        preds, notes, run = cpu_predictions(config)
        measured, trace = run.measured, run.trace
        source = f"calibrated from {config.timeline.run_dir}"
    elif config.cluster.device == "cuda":
        from rollplex_train.models.arch import load_hf_config

        preds, notes = gpu_predictions(config, load_hf_config(config.model))
        measured, trace = {}, None
        source = f"roofline on {config.gpu.name}"
    else:
        raise ValueError("rollplex-plan timeline: cluster.device=cpu has no roofline model; set "
                         "timeline.run_dir=<output dir of a rollplex run> to predict from its saved cost model")
    preds = {k: preds[k] for k in ("serial", "serial_full", "disaggregated", "rollplex")}
    serial, disagg, rollplex = preds["serial"], preds["disaggregated"], preds["rollplex"]
    plan = rollplex.plan
    units = " thread(s)" if config.timeline.run_dir else f"/{config.timeline.share_units} of the SMs"
    lines = [f"# rollplex-plan timeline: {config.trainer.experiment_name} ({source}), seconds of one device's step",
             "", "## Assumptions", *notes, "", "## Per phase (seconds)", "", *_table(preds, measured), "",
             f"rollplex window: decode on {plan.decode_share}{units}, prefix tasks on {plan.train_share}{units}; "
             f"{len(plan.window_tasks)} of {len(plan.window_tasks) + len(plan.after_tasks)} movable tasks inside; "
             f"planner predicted {plan.predicted_s:.3f} s to the end of the prefix work against "
             f"{plan.predicted_no_overlap_s:.3f} s without overlap",
             f"baselines: serial and disaggregated with model.shared_prefix={str(config.model.shared_prefix).lower()} "
             f"(the experiment's); serial_full scores and trains full sequences (the prompt recomputed for each of "
             f"the G={config.rollout.n} responses, as verl does): rollplex/serial_full="
             f"{preds['serial_full'].step_s / rollplex.step_s:.2f}"]
    gantt = config.timeline.gantt
    if gantt is None:
        gantt = f"outputs/timeline/{config.trainer.experiment_name}.png"
    if gantt:
        panels = {f"{k} (predicted {p.step_s:.2f} s)": p.timeline for k, p in preds.items()}
        if trace is not None:
            panels[f"measured: {trace.parent.parent.name} {trace.stem}"] = Timeline.from_chrome_trace(trace)
        path = plot_gantt(panels, Path(gantt),
                          title=f"{config.trainer.experiment_name}: predicted step of one device ({source})")
        lines.append(f"gantt: {path}")
    lines.append(f"timeline: serial={serial.step_s:.2f}s disaggregated={disagg.step_s:.2f}s rollplex={rollplex.step_s:.2f}s "
                 f"rollplex/serial={serial.step_s / rollplex.step_s:.2f} "
                 f"rollplex/disaggregated={disagg.step_s / rollplex.step_s:.2f} "
                 f"prefix_hidden={100 * rollplex.hidden_frac:.0f}%")
    return "\n".join(lines) + "\n"
