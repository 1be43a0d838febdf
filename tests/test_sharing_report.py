"""``rollplex-plan sharing`` on the 32B experiment: the last line and the acceptance shares."""

from __future__ import annotations

import functools
import re
from collections import Counter
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import hydra_version_base, register_configs, to_config
from rollplex_train.models.arch import load_hf_config, parameter_shapes
from rollplex_train.models.layouts import Dims
from rollplex_train.sharing.report import (DEGREES, _pcts, device_totals, layouts_of, rebuilt_bytes_per_device, report,
                                           share_totals)

LAST = re.compile(r"^sharing: t=(\d+) r=(\d+) view=([\d.]+)% rebuild=([\d.]+)% gather=([\d.]+)%$")


def _config(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides]))


@functools.lru_cache(maxsize=None)
def _model_32b():
    config = _config("+experiment=qwen25vl32b_embodied")
    hf = load_hf_config(config.model)
    return config, parameter_shapes(hf), Dims.from_hf_config(hf)


def test_cli_ends_with_the_sharing_line_for_the_configured_degrees():
    out = subprocess.run([sys.executable, "-c", "from rollplex_train.cli import plan_main; plan_main()", "sharing",
                          "+experiment=qwen25vl32b_embodied"], capture_output=True, text=True, timeout=120, check=True)
    match = LAST.match(out.stdout.rstrip("\n").splitlines()[-1])
    assert match, out.stdout[-500:]
    t, r, view, rebuild, gather = match.groups()
    assert (t, r) == ("4", "4")  # actor / rollout TP of the experiment
    # megatron's per-group [q_g k_g v_g] vs SGLang's [q_i k_i v_i]: two KV groups per rank -> the LLM's qkv
    # rebuilt; the vision tower is split as SGLang splits it (training/megatron/vision.py): views
    assert (view, rebuild, gather) == ("93.0", "7.0", "0.0")
    assert float(view) + float(rebuild) + float(gather) == pytest.approx(100, abs=0.15)
    assert len(re.findall(r"^ ?\d ? ?\d \|", out.stdout, re.M)) == 16  # the (t, r) table


def test_configured_options_reach_the_last_line():
    text = report(_config("+experiment=qwen25vl32b_embodied", "sharing.split_qkv=true",
                          "sharing.split_gate_up=true", "rollout.tensor_parallel_size=8"))
    assert text.splitlines()[-1] == "sharing: t=4 r=8 view=100.0% rebuild=0.0% gather=0.0%"
    # the degrees come from the run's ParallelLayout
    assert "layout: 32 cuda devices (4 node(s) x 8); train TP=4 PP=1 DP=8; rollout 4 engine(s) x TP=8" in text
    assert "of which rebuilt into persistent buffers (rebuild + gather): 0.00 GiB" in text


def test_rebuilt_bytes_per_device_line():
    config, shapes, dims = _model_32b()
    text = report(config)
    per_device = device_totals(shapes, dims, t=4, r=4, train="megatron", rollout="sglang", split_qkv=False,
                               split_gate_up=False, itemsize=2)
    assert len(per_device) == 4  # lcm(4, 4) devices, one per TP rank
    rollout = sum(per_device[0][a] for a in ("view", "strided_view", "local_rebuild", "gather"))
    rebuilt = rebuilt_bytes_per_device(per_device)
    assert rebuilt == max(c["local_rebuild"] for c in per_device) and rebuilt / rollout == pytest.approx(0.070, abs=5e-4)
    assert sum(per_device, Counter()) == share_totals(shapes, dims, t=4, r=4, train="megatron", rollout="sglang",
                                                      split_qkv=False, split_gate_up=False, itemsize=2)
    assert (f"rollout weights per device: {rollout / 2**30:.2f} GiB, of which rebuilt into persistent buffers "
            f"(rebuild + gather): {rebuilt / 2**30:.2f} GiB") in text
    assert f"{rebuilt / 2**30:.2f}" == "1.09"


def test_32b_acceptance_shares():
    config, shapes, dims = _model_32b()
    train, rollout = layouts_of(config)
    assert (train, rollout) == ("megatron", "sglang")

    def shares(t, r, split_qkv, split_gate_up):
        return _pcts(share_totals(shapes, dims, t=t, r=r, train=train, rollout=rollout, split_qkv=split_qkv,
                                  split_gate_up=split_gate_up, itemsize=2))

    assert shares(8, 8, False, False)[0] >= 99.0  # one KV group per rank: only the vision qkv is rebuilt
    for t in DEGREES:
        assert shares(t, t, True, False)[0] == 100.0  # t = r: the per-group qkv split alone is enough
        for r in DEGREES:
            view, rebuild, gather, moved = shares(t, r, True, True)
            if r >= t:
                assert (view, rebuild, gather, moved) == (100.0, 0.0, 0.0, 0.0), (t, r)
            else:  # a rollout rank needs t / r training shards: 1 - r / t of its bytes cross devices
                assert gather > 99.9 and moved == pytest.approx(100 * (1 - r / t), abs=0.05)  # norms are local


def test_embedded_run_pairs_hf_with_hf_and_shares_everything():
    config = _config("+experiment=tiny_cpu")
    assert layouts_of(config) == ("hf", "hf")
    _, shapes, dims = _model_32b()
    totals = share_totals(shapes, dims, t=1, r=1, train="hf", rollout="hf", split_qkv=False, split_gate_up=False,
                          itemsize=2)
    assert totals["view"] == sum(__import__("math").prod(s) for s in shapes.values()) * 2
