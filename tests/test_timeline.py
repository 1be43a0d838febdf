"""``rollplex-plan timeline``: roofline rates, predicted steps placed by the planner, config keys, properties."""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from omegaconf.errors import ConfigKeyError

from rollplex_train.cli import conf_dir
from rollplex_train.config import ModelConfig, register_configs, to_config
from rollplex_train.memory import estimate as est
from rollplex_train.models.arch import load_hf_config
from rollplex_train.runtime.planner import PhasePlanner
from rollplex_train.hardware import GpuConfig, TimelineConfig
from rollplex_train.runtime.roofline import DeviceWork, RooflineModel, llm_forward_flops
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.runtime.timeline_report import colocated_predictions

ROOT = Path(__file__).resolve().parents[1]
H800 = GpuConfig(name="H800", bf16_tflops=989.5, hbm_gbs=3350, nvlink_gbs=400, pcie_gbs=64, internode_gbs=50,
                 memory_gib=80)
LAST = re.compile(r"^timeline: serial=([\d.]+)s disaggregated=([\d.]+)s rollplex=([\d.]+)s "
                  r"rollplex/serial=([\d.]+) rollplex/disaggregated=([\d.]+) prefix_hidden=(\d+)%$")


@lru_cache(maxsize=1)
def hf32b():
    return load_hf_config(ModelConfig(hf_config=str(ROOT / "conf/hf/qwen2_5_vl_32b_instruct.json")))


def _config(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides]))


def work(groups=4, n=8, prompt=1024, patches=0, response=256, steps=256, mini=None, tp=4, dp=8, recompute="full"):
    return DeviceWork(train_groups=groups, rollout_groups=groups, n=n, prompt_tokens=prompt, vision_patches=patches,
                      response_tokens=response, decode_steps=steps, mini_batch_groups=mini or groups, train_tp=tp,
                      rollout_tp=tp, train_dp=dp, recompute=recompute, needs_reference=True)


def model(w, **eff):
    return RooflineModel(hf32b(), w, H800, TimelineConfig(**eff), frame_patches=1024)


def test_linear_flops_are_two_per_parameter_per_token():
    text = est.text_dims(hf32b())
    matmul_params = est.llm_parameters(text) - text.vocab * text.hidden * 2 - text.hidden \
        - text.layers * (2 * text.hidden + text.hidden + 2 * text.kv_width)  # embeddings, norms, qkv biases
    assert llm_forward_flops(text, 1, 0, 0) == pytest.approx(2 * matmul_params, rel=1e-9)
    # the LM head counts only where logits are needed; causal attention 4 * heads * head_dim per context token
    assert llm_forward_flops(text, 1, 10, 1) - llm_forward_flops(text, 1, 0, 0) == pytest.approx(
        2 * text.hidden * text.vocab + text.layers * 4 * text.heads * text.head_dim * 10)


def test_decode_is_bandwidth_bound_small_and_compute_bound_above_the_ridge():
    w = work(groups=1, n=1, prompt=4096, steps=2, tp=1)
    m = model(w, hbm_saturation_frac=0.5)
    text = m.text
    ctx = 4096 + 1
    nbytes = m.weight_bytes + ctx * est.kv_bytes_per_token(text, 1)
    assert m.decode_s(m.units) == pytest.approx(nbytes / (3350e9 * 0.6), rel=1e-9)  # weights + KV over HBM * MBU
    # 1/4 of the SMs: half the bandwidth (the compute-bound prefix on the other 3/4 reads little)
    assert m.decode_s(m.units // 4) == pytest.approx(2 * m.decode_s(m.units), rel=1e-9)
    short = model(work(groups=1, n=1, prompt=16, steps=2, tp=1))  # 16-token prefixes: memory-bound too
    assert short.decode_s(short.units // 4) == pytest.approx(4 * short.decode_s(short.units), rel=1e-3)
    big = model(work(groups=512, n=8, prompt=16, steps=2, tp=1))  # 4096 rows: far above the ridge point
    ctx = 16 + 1
    flops = llm_forward_flops(text, 4096, 4096 * ctx, 4096)
    assert big.decode_s(big.units) == pytest.approx(flops / (989.5e12 * 0.47), rel=1e-9)
    assert model(w).ridge_point() == pytest.approx(989.5e12 * 0.47 / (3350e9 * 0.6))


def test_tp_collectives_cost_nvlink_time():
    one, four = model(work(tp=1)), model(work(tp=4))
    # suffix: a quarter of the FLOPs per rank plus 2 all-reduces per layer of one bf16 hidden vector per token
    ring = 2 * 3 / 4 * 5120 * 2 / (200e9 * 0.8)
    assert four.suffix_s(20) == pytest.approx(one.suffix_s(20) / 4 + 2 * 64 * ring, rel=1e-9)


def test_rollplex_timeline_matches_the_planner_and_hides_prefix_work():
    m = model(work(groups=8, prompt=4096, patches=16384, response=1024, steps=1024, mini=4))
    preds, graph, cost = colocated_predictions(m, {}, None)
    serial, rollplex = preds["serial"], preds["rollplex"]
    plan = rollplex.plan
    assert plan.mode == "plan" and plan.overlaps
    prefill = cost.seconds("prefill", 8 * 4096, m.units)
    assert rollplex.phases["gen"] + rollplex.phases["prefix_after"] == pytest.approx(prefill + plan.predicted_s)
    assert serial.phases["gen"] + serial.prefix_s == pytest.approx(prefill + plan.predicted_no_overlap_s)
    # suffix-only scoring after decode: serial's scoring phases minus their prefix passes
    old = sum(cost.seconds(t.kind, t.tokens, m.units) for t in graph.of_kind("prefix/old"))
    assert serial.phases["old_log_prob"] - rollplex.phases["old_log_prob"] == pytest.approx(old)
    assert rollplex.step_s < serial.step_s and rollplex.hidden_frac > 0.5


def test_gpu_and_efficiency_keys_are_config_with_errors_for_typos():
    cfg = _config("+experiment=qwen25vl32b_embodied", "gpu=h200", "timeline.decode_mbu=0.7")
    assert (cfg.gpu.hbm_gbs, cfg.gpu.memory_gib, cfg.timeline.decode_mbu) == (4800, 141, 0.7)
    assert _config().gpu.name.startswith("H800")  # the default group
    with pytest.raises(ConfigCompositionException, match="timeline.decode_mbuu"):
        _config("timeline.decode_mbuu=0.7")
    with pytest.raises(ConfigKeyError, match="decode_mbuu"):  # appended with +: refused by the schema
        _config("+timeline.decode_mbuu=0.7")
    with pytest.raises(ValueError, match="timeline.train_mfu"):
        _config("timeline.train_mfu=1.5")
    with pytest.raises(ValueError, match="gpu.hbm_gbs is not set"):
        dataclasses.replace(H800, hbm_gbs=0.0).require()


def test_32b_timeline_line(tmp_path):
    from rollplex_train.runtime.timeline_report import report

    text = report(_config("+experiment=qwen25vl32b_embodied", f"timeline.gantt={tmp_path / 'g.png'}"))
    match = LAST.match(text.rstrip("\n").splitlines()[-1])
    assert match, text.splitlines()[-1]
    serial, disagg, rollplex, x, y, hidden = map(float, match.groups())
    assert rollplex < serial < disagg and x == pytest.approx(serial / rollplex, abs=0.01)
    assert (tmp_path / "g.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="timeline.run_dir"):
        report(_config("+experiment=bench_cpu"))
    with pytest.raises(ValueError, match="actor.pipeline_parallel_size=2"):
        report(_config("+experiment=qwen25vl32b_embodied", "actor.pipeline_parallel_size=2"))


# ---- properties of the model -------------------------------------------------------------------
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
works = st.builds(work, groups=st.integers(1, 12), n=st.sampled_from([1, 4, 8]), prompt=st.integers(64, 6000),
                  patches=st.sampled_from([0, 4096, 16384]), response=st.integers(16, 2048),
                  steps=st.integers(16, 2048), tp=st.sampled_from([1, 2, 4, 8]))


@FAST
@given(w=works, extra=st.integers(1, 4096))
def test_a_larger_decode_window_never_hides_less_prefix_work(w, extra):
    """At every device split the planner weighs, a longer decode window admits at least as many
    prefix seconds (first-fit admission in a fixed order is monotone in the capacity). The split the
    planner then picks minimises time, not hidden work, so across splits this is not promised."""
    m = model(w)
    _, graph, cost = colocated_predictions(m, {}, None)
    planner, movable = PhasePlanner(m.units), graph.movable()

    def hidden(steps, train_share):
        plan = planner._overlap(movable, steps, m.units - train_share, train_share, cost)
        return sum(cost.seconds(t.kind, t.tokens, train_share) for t in plan.window_tasks)

    for c in range(1, m.units):
        assert hidden(w.decode_steps + extra, c) >= hidden(w.decode_steps, c) - 1e-12


@FAST
@given(w=works, prompts_per_rank=st.integers(1, 8), dp=st.sampled_from([1, 2, 4]))
def test_more_devices_never_lengthen_a_step(w, prompts_per_rank, dp):
    """The same batch over twice the devices (twice the DP ranks and rollout engines). Doubling the
    DP degree halves each rank's work and adds ``gradient_bytes / d`` to its ring traffic, so the step
    can only grow when the batch's whole update is shorter than two gradient transfers: a batch too
    small for data parallelism, which the domain leaves out."""
    def predict(devices_dp):
        groups = prompts_per_rank * 2 * dp // devices_dp
        m = model(dataclasses.replace(w, train_groups=groups, rollout_groups=groups, mini_batch_groups=groups,
                                      train_dp=devices_dp))
        preds, _, cost = colocated_predictions(m, {}, None)
        return preds, m

    few, m = predict(dp)
    transfer = m.gradient_bytes() / (H800.internode_gbs * 1e9 * m.eff.internode_efficiency)
    update_compute = few["serial"].phases["update_actor"] - m.optimizer_s()  # one mini-batch per rank here
    assume(update_compute * dp >= 2 * transfer)
    many, _ = predict(2 * dp)
    for schedule in ("serial", "rollplex"):
        assert many[schedule].step_s <= few[schedule].step_s


@FAST
@given(w=works, mbu=st.floats(0.2, 1.0), mfu=st.floats(0.2, 0.8), sat=st.floats(0.1, 1.0))
def test_rollplex_is_never_predicted_slower_than_serial(w, mbu, mfu, sat):
    m = model(w, decode_mbu=mbu, train_mfu=mfu, hbm_saturation_frac=sat)
    preds, _, _ = colocated_predictions(m, {}, None)
    assert preds["rollplex"].step_s <= preds["serial"].step_s + 1e-9


# ---- calibration from a measured run ------------------------------------------------------------
def fake_run(root: Path, step=3, old_pass=True) -> Path:
    """A rollplex run directory: a checkpoint's trainer_state.json with a cost model, and metrics;
    ``old_pass=False``: the run took its old-policy log-probs from the actor's forward (no old pass)."""
    import json

    from rollplex_train.runtime.cost_model import CostModel

    cost = CostModel(switch_s=0.003)
    for kind, rates in {"decode": {1: 0.06, 2: 0.045}, "prefix/old": {1: 0.004, 2: 0.0025},
                        "prefix/ref": {1: 0.004, 2: 0.0025}, "prefix/actor": {1: 0.004, 2: 0.0025}}.items():
        if kind != "prefix/old" or old_pass:
            cost.rates[kind] = dict(rates)
            cost.counts.update({(kind, c): 2 for c in rates})
    ckpt = root / "checkpoints" / f"global_step_{step}"
    ckpt.mkdir(parents=True)
    schedule = {"cost": cost.state_dict(), "response_tokens": 1024, "decode_steps": 128,
                "bytes_per_token": {"old": 1000.0, "ref": 1000.0, "actor": 3000.0}}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "schedule": schedule}))
    rows = [{"step": s, "timing_s/old_log_prob": 1.6 if old_pass else 0.0, "timing_s/ref": 1.7, "timing_s/update_actor": 5.5 + (s == 1),
             "timing_s/reward": 0.01, "timing_s/adv": 0.02, "timing_s/update_weights": 0.003,
             "prompt_length/mean": 100.0, "timing_s/step": 14.0 + s} for s in range(1, 6)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = Timeline(origin=0.0)
    trace.add("gen", "rollout", 0.0, 5.9)
    trace.add("update_actor", "train", 9.1, 14.7)
    trace.write_chrome_trace(root / "traces" / "step_5.json")
    return root


def test_calibrated_prediction_uses_the_saved_cost_model_and_the_measured_phases(tmp_path):
    from rollplex_train.runtime.timeline_report import cpu_predictions

    run = fake_run(tmp_path / "run")
    cfg = _config("+experiment=bench_cpu", f"timeline.run_dir={run}")
    preds, notes, run_info = cpu_predictions(cfg)
    measured = run_info.measured
    serial, rollplex, disagg = preds["serial"], preds["rollplex"], preds["disaggregated"]
    prefix = 8 * 100 * 0.0025  # 8 groups of 100 prompt tokens at the 2-thread rate, per role
    assert serial.phases["gen"] == pytest.approx(128 * 0.045)
    assert serial.phases["old_log_prob"] == pytest.approx(prefix + 1.6)
    assert serial.phases["ref"] == pytest.approx(prefix + 1.7)
    assert serial.phases["update_actor"] == pytest.approx(prefix + 5.5)  # step 1 (warm-up) left out
    assert serial.step_s == pytest.approx(128 * 0.045 + 3 * prefix + 1.6 + 1.7 + 5.5 + 0.01 + 0.02 + 0.003)
    full = preds["serial_full"]  # the prompt recomputed (and back-propagated) for each of the 8 responses
    assert full.phases["old_log_prob"] == pytest.approx(8 * prefix + 1.6)
    assert full.phases["update_actor"] == pytest.approx(8 * prefix + 7 * 2 * prefix + 5.5)
    assert rollplex.plan.mode == "plan" and rollplex.phases["old_log_prob"] == pytest.approx(1.6)
    assert rollplex.step_s <= serial.step_s
    # disaggregated: one thread per side; decode and prefixes at their measured 1-thread rates
    assert disagg.phases["gen"] == pytest.approx(128 * 0.06)
    assert any("steps after it measured: 18.50 s median" in n for n in notes)  # steps 4 and 5 were logged
    # a checkpoint directory works too, and a serial run (no cost model) is refused
    back = Timeline.from_chrome_trace(run_info.trace)  # the run's trace of step 5, read back
    assert [(s.name, s.row, s.start_s, s.end_s) for s in back.spans] == [("gen", "rollout", 0.0, 5.9),
                                                                         ("update_actor", "train", 9.1, 14.7)]
    assert measured["step"] == pytest.approx(18.5) and measured["old_log_prob"] == pytest.approx(1.6)
    preds2, _, _ = cpu_predictions(_config("+experiment=bench_cpu", f"timeline.run_dir={run}/checkpoints/global_step_3"))
    assert preds2["serial"].step_s == pytest.approx(serial.step_s)
    state = run / "checkpoints" / "global_step_3" / "trainer_state.json"
    state.write_text('{"step": 3, "schedule": {}}')
    with pytest.raises(ValueError, match="only schedule=rollplex runs save a cost model"):
        cpu_predictions(cfg)


def test_calibrated_prediction_without_an_old_policy_pass(tmp_path):
    """A run whose one mini-batch took the old-policy log-probs from the actor's forward measured no
    old pass: the prediction has none either (and one prefix pass per role less than above)."""
    from rollplex_train.runtime.timeline_report import cpu_predictions

    cfg = _config("+experiment=bench_cpu", f"timeline.run_dir={fake_run(tmp_path / 'run', old_pass=False)}")
    preds, _, _ = cpu_predictions(cfg)
    prefix = 8 * 100 * 0.0025
    serial = preds["serial"]
    assert serial.phases.get("old_log_prob", 0.0) == 0.0
    assert serial.step_s == pytest.approx(128 * 0.045 + 2 * prefix + 1.7 + 5.5 + 0.01 + 0.02 + 0.003)
    assert preds["rollplex"].step_s <= serial.step_s


def test_cli_prints_the_32b_line_without_a_gpu(tmp_path):
    import subprocess
    import sys
    import time

    cli = Path(sys.executable).parent / "rollplex-plan"
    start = time.perf_counter()
    out = subprocess.run([str(cli), "timeline", "+experiment=qwen25vl32b_embodied", f"timeline.gantt={tmp_path / 'g.png'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert LAST.match(out.stdout.rstrip("\n").splitlines()[-1]), out.stdout[-500:]
    print(f"rollplex-plan timeline (32B): {time.perf_counter() - start:.1f} s")  # acceptance: < 30 s on an idle machine
    bad = subprocess.run([str(cli), "timeline", "+experiment=bench_cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "timeline.run_dir" in bad.stderr
