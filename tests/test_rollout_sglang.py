"""The SGLang rollout adapter without SGLang: requests built from PromptSamples, SGLang output dicts
parsed to Responses, the engine's weight/version/memory orchestration against a recording
stand-in of SGLang's Engine, the memory phases from a residency plan, and the CLI refusing
rollout.name=sglang in one line when the extra is missing. (The real engine runs only in
scripts/check_sglang.py on a GPU machine.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rollplex_train.memory.groups import TensorGroup
from rollplex_train.memory.residency import phases_from_groups, plan_residency
from rollplex_train.models.loading import load_model
from rollplex_train.models.sequence import rope_positions
from rollplex_train.rollout.base import ROLLOUT_ENGINES, SamplingParams, StaleWeightsError
from rollplex_train.rollout.sglang_memory import mem_fraction_static, phase_transition, tags_resident
from rollplex_train.rollout.sglang_request import (
    SUPPRESS_BIAS,
    build_generate_call,
    parse_output,
    parse_outputs,
    response_seed,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt_qwen25):
    return load_model(tiny_ckpt_qwen25)


def _trainer_rope(model):
    def rope(prompt):
        ids = prompt.prompt_ids.view(1, -1)
        positions, delta = rope_positions(model, ids, torch.ones_like(ids), prompt.vision)
        return positions[:, 0], delta
    return rope


def test_requests_carry_the_trainer_ids_patches_and_positions(mixed_prompts, tiny_model):
    cfg = tiny_model.config
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=11, stop=("</answer>",),
                            seed=5)
    call = build_generate_call(mixed_prompts, params, eos_ids={7, 9}, suppressed_ids={cfg.image_token_id},
                               rope=_trainer_rope(tiny_model),
                               placeholder_ids=(cfg.image_token_id, cfg.video_token_id, 2))
    assert call.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for k, i in enumerate(call.prompt_index):
        prompt = mixed_prompts[i]
        assert call.input_ids[k] == prompt.prompt_ids.tolist()
    color, count, video = mixed_prompts
    image = call.image_data[0][0]
    assert image["format"] == "processor_output"
    assert torch.equal(image["pixel_values"], color.vision.pixel_values)  # the trainer's patches, as they are
    assert torch.equal(image["image_grid_thw"], color.vision.image_grid_thw)
    assert image["pixel_values"].shape == (16, 1176)  # 56x56 image: grid (1, 4, 4), D = 3*2*14*14
    assert torch.equal(call.image_data[3][0]["pixel_values"], count.vision.pixel_values)
    assert call.video_data[0] == [] and call.image_data[6] == []  # [] not None: SGLang reads entry 0's type
    vid = call.video_data[6][0]
    assert torch.equal(vid["pixel_values_videos"], video.vision.pixel_values_videos)
    assert torch.equal(vid["video_grid_thw"], video.vision.video_grid_thw)
    assert torch.equal(vid["second_per_grid_ts"], video.vision.second_per_grid_ts)
    ids = video.prompt_ids.view(1, -1)
    want_pos, want_delta = rope_positions(tiny_model, ids, torch.ones_like(ids), video.vision)
    assert torch.equal(vid["mrope_positions"], want_pos[:, 0]) and torch.equal(vid["mrope_position_delta"], want_delta)
    assert vid["mrope_positions"].shape == (3, video.prompt_length)
    kwargs = call.kwargs()
    assert kwargs["return_logprob"] is True and len(kwargs["image_data"]) == len(kwargs["input_ids"]) == 9
    video_first = build_generate_call(mixed_prompts[::-1], params, eos_ids=set(), suppressed_ids=set()).kwargs()
    # every entry a list, the first one too: SGLang takes a batch whose entry 0 is not a list for
    # a list of single images and wraps each entry again
    assert all(isinstance(x, list) for x in video_first["image_data"] + video_first["video_data"])
    assert video_first["image_data"][0] == [] and video_first["video_data"][0][0]["format"] == "processor_output"


def test_sampling_params_carry_every_field_and_a_seed_per_response(mixed_prompts):
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=11,
                            stop=("</answer>", "\n\n"), seed=5)
    call = build_generate_call(mixed_prompts[:2], params, eos_ids={9, 7}, suppressed_ids={3, 4})
    sp = call.sampling_params[0]
    assert sp == {"n": 1, "max_new_tokens": 11, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": False,
                  "no_stop_trim": True, "skip_special_tokens": True, "sampling_seed": response_seed(5, 0, 0, 2),
                  "stop": ["</answer>", "\n\n"], "stop_token_ids": [7, 9],
                  "logit_bias": {"3": SUPPRESS_BIAS, "4": SUPPRESS_BIAS}}
    seeds = [p["sampling_seed"] for p in call.sampling_params]
    assert len(set(seeds)) == 4  # n copies of a prompt must not share a seed (same tokens otherwise)
    again = build_generate_call(mixed_prompts[:2], params, eos_ids={9, 7}, suppressed_ids={3, 4})
    assert [p["sampling_seed"] for p in again.sampling_params] == seeds
    other = build_generate_call(mixed_prompts[:2], SamplingParams(n=2, seed=6), eos_ids={9}, suppressed_ids=set())
    assert not set(seeds) & {p["sampling_seed"] for p in other.sampling_params}
    bench = build_generate_call(mixed_prompts[:1], SamplingParams(ignore_eos=True, temperature=0.0), eos_ids={9},
                                suppressed_ids=set()).sampling_params[0]
    assert bench["ignore_eos"] and "stop_token_ids" not in bench and bench["temperature"] == 0.0


def test_placeholders_that_do_not_match_the_grid_are_refused(mixed_prompts, tiny_model):
    cfg = tiny_model.config
    prompt = mixed_prompts[0]
    ids = prompt.prompt_ids.clone()
    ids[ids == cfg.image_token_id] = cfg.vision_end_token_id  # drop every placeholder
    broken = type(prompt)(uid=prompt.uid, prompt_ids=ids, vision=prompt.vision, ground_truth="")
    with pytest.raises(ValueError, match=f"prompt {prompt.uid}: 0 image placeholder tokens .* need 4"):
        build_generate_call([broken], SamplingParams(), eos_ids=set(), suppressed_ids=set(),
                            placeholder_ids=(cfg.image_token_id, cfg.video_token_id, 2))


def _output(ids, logps, reason, **extra):
    meta = {"id": "r", "finish_reason": reason, "completion_tokens": len(ids),
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logps, ids)]}
    return {"text": "ignored", "output_ids": list(ids), "meta_info": {**meta, **extra}}


def test_output_dicts_become_responses():
    decode = lambda ids: "-".join(map(str, ids))  # noqa: E731
    r = parse_output(_output([5, 6, 2], [-0.5, -1.25, -0.01], {"type": "stop", "matched": 2}), 3, decode)
    assert r.prompt_index == 3 and r.token_ids.tolist() == [5, 6, 2] and r.token_ids.dtype == torch.long
    assert torch.equal(r.logprobs, torch.tensor([-0.5, -1.25, -0.01])) and r.logprobs.dtype == torch.float32
    assert r.text == "5-6-2" and r.finish_reason == "stop"
    r = parse_output(_output([4], [-2.0], {"type": "length", "length": 1}), 0, decode)
    assert r.finish_reason == "length"
    with pytest.raises(RuntimeError, match="aborted request r: out of memory"):
        parse_output(_output([], [], {"type": "abort", "message": "out of memory"}), 0, decode)
    bad = _output([5, 6], [-0.5, -1.0], {"type": "stop"})
    bad["output_ids"] = [5, 7]
    with pytest.raises(ValueError, match="disagree"):
        parse_output(bad, 0, decode)
    with pytest.raises(ValueError, match="without meta_info"):
        parse_output({"text": "x"}, 0, decode)
    call = build_generate_call.__globals__["GenerateCall"](prompt_index=[0, 0, 1, 1], n=2)
    outs = [_output([i], [-float(i)], {"type": "length"}) for i in range(4)]
    assert [x.prompt_index for x in parse_outputs(outs, call, decode)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="3 outputs for 4 requests"):
        parse_outputs(outs[:3], call, decode)


class RecordingEngine:
    """Stands in for sglang.Engine: records each call; generate answers in SGLang's output format
    (token ids 10 + prompt's first id mod 5, then EOS)."""

    def __init__(self, eos: int):
        self.calls, self.eos, self.fail = [], eos, set()

    def _record(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))
        return (name not in self.fail, f"{name} refused")

    def begin_weight_update(self):
        return self._record("begin_weight_update")

    def end_weight_update(self):
        return self._record("end_weight_update")

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        return self._record("update_weights_from_tensor", named, load_format=load_format, flush_cache=flush_cache)

    def flush_cache(self):
        return self._record("flush_cache")

    def release_memory_occupation(self, tags=None):  # 0.5.23 returns None (no status); a failure: a status
        status = self._record("release_memory_occupation", tags=tags)
        return None if status[0] else status

    def resume_memory_occupation(self, tags=None):
        status = self._record("resume_memory_occupation", tags=tags)
        return None if status[0] else status

    def generate(self, **kw):
        self.calls.append(("generate", (), kw))
        return [_output([10 + ids[0] % 5, self.eos], [-0.5, -0.25], {"type": "stop", "matched": self.eos})
                for ids in kw["input_ids"]]

    def names(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def sgl(tiny_ckpt_qwen25, tiny_model):
    from rollplex_train.rollout.sglang import SGLangRolloutEngine

    engine = RecordingEngine(eos=tiny_model.config.text_config.eos_token_id or 2)
    adapter = SGLangRolloutEngine(str(tiny_ckpt_qwen25), tp_size=2, engine=engine,
                                  wrap=lambda values: ("LocalSerializedTensor", values), bucket_bytes=256 * 1024)
    full = {n: p.detach() for n, p in tiny_model.named_parameters()}
    return adapter, engine, full


def test_weight_updates_are_wrapped_versioned_and_flush_the_cache(sgl, mixed_prompts):
    adapter, engine, full = sgl
    with pytest.raises(StaleWeightsError, match="never pushed"):
        adapter.generate(mixed_prompts, SamplingParams(n=2))
    adapter.update_weights(full, version=1)
    names = engine.names()
    assert names[0] == "begin_weight_update" and names[-2:] == ["end_weight_update", "flush_cache"]
    updates = [c for c in engine.calls if c[0] == "update_weights_from_tensor"]
    assert len(updates) > 1 and all(c[2] == {"load_format": "direct", "flush_cache": False} for c in updates)
    sent = [name for c in updates for name, _ in c[1][0]]
    assert sorted(sent) == sorted(adapter.expected[0]) and len(sent) == len(set(sent))
    values = dict(p for c in updates for p in c[1][0])["model.layers.0.self_attn.qkv_proj.weight"]
    assert values[0] == "LocalSerializedTensor" and len(values[1]) == 2 and values[1][0] != values[1][1]
    assert adapter.weights_version == 1
    with pytest.raises(StaleWeightsError, match="not newer"):
        adapter.update_weights(full, version=1)
    responses = adapter.generate(mixed_prompts, SamplingParams(n=2, seed=3), weights_version=1)
    assert [r.prompt_index for r in responses] == [0, 0, 1, 1, 2, 2]
    assert responses[0].token_ids.tolist()[0] == 10 + mixed_prompts[0].prompt_ids[0].item() % 5
    with pytest.raises(StaleWeightsError, match="version 0, engine holds version 1"):
        adapter.generate(mixed_prompts, SamplingParams(), weights_version=0)
    with pytest.raises(ValueError, match=r"wrong_shape \[.model.language_model.norm.weight \(3,\) != \(128,\)"):
        adapter.update_weights({**full, "model.language_model.norm.weight": torch.zeros(3)}, version=2)
    assert adapter.weights_version == 1 and engine.names().count("begin_weight_update") == 1  # refused before SGLang


def test_a_refused_update_closes_the_session_and_invalidates_the_weights(sgl, mixed_prompts):
    adapter, engine, full = sgl
    adapter.update_weights(full, version=1)
    engine.fail.add("update_weights_from_tensor")
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed"):
        adapter.update_weights(full, version=2)
    assert engine.names()[-1] == "end_weight_update" and adapter.weights_version == 1
    with pytest.raises(StaleWeightsError):
        adapter.generate(mixed_prompts, SamplingParams(), weights_version=1)


def test_memory_release_and_resume_by_tag(sgl, mixed_prompts):
    adapter, engine, full = sgl
    adapter.update_weights(full, version=1)
    adapter.release_memory(["kv_cache"])
    adapter.release_memory(["kv_cache"])  # already released: not sent twice
    with pytest.raises(RuntimeError, match="released"):
        adapter.generate(mixed_prompts, SamplingParams(), weights_version=1)
    adapter.resume_memory()
    assert [c[2]["tags"] for c in engine.calls if "memory" in c[0]] == [["kv_cache"], ["kv_cache"]]
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=1)) == 3
    adapter.release_memory()  # all tags; weights without a CPU backup are gone
    adapter.resume_memory()
    every = ["weights", "kv_cache", "cuda_graph"]
    assert [c[2]["tags"] for c in engine.calls if "memory" in c[0]][-2:] == [every, every]
    with pytest.raises(StaleWeightsError, match="released or never pushed"):
        adapter.generate(mixed_prompts, SamplingParams(), weights_version=1)
    adapter.update_weights(full, version=2)
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=2)) == 3


def test_a_control_call_that_reports_no_status_is_not_a_success(sgl, mixed_prompts):
    """release/resume return None in SGLang 0.5.23 (accepted: the call returning is the acknowledgement);
    a weight-update call that returns None is another API than the adapter's: refused, not counted as done."""
    from rollplex_train.rollout import sglang

    adapter, engine, full = sgl
    with pytest.raises(RuntimeError, match=r"SGLang flush_cache returned None, not \(success, message\)"):
        sglang._ok(None, "flush_cache")
    sglang._acknowledged(None, "release_memory_occupation")
    engine.flush_cache = lambda: None
    with pytest.raises(RuntimeError, match="flush_cache returned None"):
        adapter.update_weights(full, version=1)
    assert adapter.weights_version == 0
    del engine.flush_cache
    adapter.update_weights(full, version=1)
    engine.fail.add("release_memory_occupation")
    with pytest.raises(RuntimeError, match="release_memory_occupation failed: release_memory_occupation refused"):
        adapter.release_memory(["kv_cache"])
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=1)) == 3  # not marked released


def _plan(kv_items: int = 1):
    groups = [TensorGroup("rollout_weights", 30, consumers=("rollout_decode", "weight_sync")),
              TensorGroup("rollout_kv", 40, kind="scratch", consumers=("rollout_decode",)),
              TensorGroup("actor_weights", 30, consumers=("actor_update", "weight_sync")),
              TensorGroup("acts", 60, kind="scratch", consumers=("actor_update",))]
    order = ("rollout_decode", "actor_update", "weight_sync")
    return plan_residency(groups, phases_from_groups(groups, order), budget_bytes=100)


def test_memory_phases_follow_the_residency_plan(sgl, mixed_prompts):
    plan = _plan()
    assert tags_resident(plan, "rollout_decode") == {"weights", "kv_cache", "cuda_graph"}
    assert tags_resident(plan, "actor_update") == set()  # 30 + 60 of 100: rollout weights offloaded
    assert tags_resident(plan, "weight_sync") == {"weights"}
    assert phase_transition(plan, "actor_update", set()) == (["weights", "kv_cache", "cuda_graph"], [])
    assert phase_transition(plan, "weight_sync", {"weights", "kv_cache", "cuda_graph"}) == ([], ["weights"])
    assert mem_fraction_static(plan, device_bytes=100) == 0.7
    with pytest.raises(ValueError, match="mem_fraction_static"):
        mem_fraction_static(plan, device_bytes=50)
    adapter, engine, full = sgl
    adapter.update_weights(full, version=1)
    assert adapter.apply_residency(plan, "actor_update") == (["weights", "kv_cache", "cuda_graph"], [])
    assert adapter.apply_residency(plan, "weight_sync") == ([], ["weights"])
    adapter.update_weights(full, version=2)
    assert adapter.apply_residency(plan, "rollout_decode") == ([], ["kv_cache", "cuda_graph"])
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=2)) == 3


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed here")
def test_missing_extra_is_one_line_naming_it_before_ray(tmp_path, run_cli):
    from rollplex_train.rollout.sglang import MissingExtraError

    engine_cls = ROLLOUT_ENGINES.get("sglang")
    with pytest.raises(MissingExtraError, match="install the 'sglang' extra"):
        engine_cls.check_available()
    proc = run_cli(tmp_path, "rollout.name=sglang", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "rollplex-train: error: rollout.name=sglang: SGLang is not installed; on a GPU machine install the "
        "'sglang' extra (pip install -e '.[sglang]', sglang==0.5.23); make install never installs it")
    assert not (tmp_path / "ray").exists()  # refused before Ray started


def test_mapped_trainer_weights_are_pushed_at_each_published_version(sgl, mixed_prompts):
    import pickle

    from rollplex_train.sharing.ipc import WeightsVersion, export_handles

    adapter, engine, full = sgl
    trainer = {n: t.clone() for n, t in full.items()}
    counter = WeightsVersion()
    counter.publish(3)
    adapter.map_shared_weights(export_handles(trainer, counter))
    assert adapter.weights_version == 3 and engine.names()[-1] == "flush_cache"

    def last_sent(name):  # the rank-0 payload of ``name`` in the last update, loaded back
        for call in reversed(engine.calls):
            if call[0] == "update_weights_from_tensor":
                for n, (_, values) in call[1][0]:
                    if n == name:
                        return pickle.loads(values[0])

    norm = "model.norm.weight"
    assert torch.equal(last_sent(norm), full["model.language_model.norm.weight"])
    counter.begin_update()  # the trainer writes in place
    with pytest.raises(StaleWeightsError, match="being updated"):
        adapter.generate(mixed_prompts, SamplingParams(), weights_version=3)
    trainer["model.language_model.norm.weight"].add_(1.0)
    counter.publish(4)
    with pytest.raises(StaleWeightsError, match="the shared counter holds version 4"):
        adapter.sync_shared_weights(5)
    adapter.sync_shared_weights(4)
    assert torch.equal(last_sent(norm), full["model.language_model.norm.weight"] + 1.0)
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=4)) == 3
    adapter.release_memory(["weights"])
    adapter.resume_memory(["weights"])  # pushed again from the mapped weights, same version
    names = engine.names()
    after = names[len(names) - 1 - names[::-1].index("resume_memory_occupation"):]
    assert after[1] == "begin_weight_update" and after[-2:] == ["end_weight_update", "flush_cache"]
    assert adapter.weights_version == 4 and len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=4)) == 3


def test_check_script_measures_the_engine_trainer_logprob_gap(tiny_ckpt_qwen25, tiny_model, mixed_prompts):
    """scripts/check_sglang.py's yardstick, on the built-in engine (whose log-probs are the trainer's)."""
    import importlib.util as iu
    from pathlib import Path

    from rollplex_train.rollout.builtin import BuiltinRolloutEngine

    spec = iu.spec_from_file_location("check_sglang", Path(__file__).parents[1] / "scripts" / "check_sglang.py")
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    responses = engine.generate(mixed_prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=1))
    pad = engine.pad_id
    assert script.max_logprob_diff(tiny_model, mixed_prompts, responses, pad, 0.8) < 1e-4
    responses[3].logprobs[0] -= 0.25  # an engine that reports another distribution is caught
    assert abs(script.max_logprob_diff(tiny_model, mixed_prompts, responses, pad, 0.8) - 0.25) < 1e-3


def test_check_script_runs_to_its_verdict_without_datasets_or_pyarrow(tiny_ckpt_qwen25, tiny_model):
    """scripts/check_sglang.py on a machine without datasets/pyarrow (the GPU machine): it imports, says
    NOT RUN in one line where SGLang is missing, and builds its prompts in code (image pads = grid tokens)."""
    import argparse
    import importlib.util as iu
    import subprocess
    import sys
    from pathlib import Path

    script_path = Path(__file__).parents[1] / "scripts" / "check_sglang.py"
    blocked = "import sys, runpy; sys.modules.update(datasets=None, pyarrow=None); sys.argv = ['check_sglang.py']; " \
              f"runpy.run_path({str(script_path)!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.startswith("check_sglang: NOT RUN rollout.name=sglang: SGLang is not "
                                                           "installed"), proc.stdout + proc.stderr[-2000:]
    spec = iu.spec_from_file_location("check_sglang", script_path)
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    path, prompts = script.prepare(argparse.Namespace(model=str(tiny_ckpt_qwen25), prompts=3))
    image = tiny_model.config.image_token_id
    assert path == str(tiny_ckpt_qwen25) and [p.uid for p in prompts] == ["check:0", "check:1", "check:2"]
    assert [int((p.prompt_ids == image).sum()) for p in prompts] == [
        int(p.vision.image_grid_thw.prod()) // 4 for p in prompts] == [4, 16, 36]


def test_requests_larger_than_max_batch_size_are_split_keeping_prompt_order(sgl, mixed_prompts):
    adapter, engine, full = sgl
    adapter.update_weights(full, version=1)
    adapter.max_batch_size = 2  # with n = 2: one prompt per Engine.generate call
    responses = adapter.generate(mixed_prompts, SamplingParams(n=2, seed=3), weights_version=1)
    calls = [c[2] for c in engine.calls if c[0] == "generate"]
    assert [len(c["input_ids"]) for c in calls] == [2, 2, 2]
    assert [r.prompt_index for r in responses] == [0, 0, 1, 1, 2, 2]
    assert [c["input_ids"][0] for c in calls] == [p.prompt_ids.tolist() for p in mixed_prompts]
    seeds = [sp["sampling_seed"] for c in calls for sp in c["sampling_params"]]
    assert len(set(seeds)) == 6  # distinct across calls too


def test_flattened_bucket_format_sends_full_tensors_per_rank(tiny_ckpt_qwen25, tiny_model):
    import pickle
    import types

    from rollplex_train.rollout.sglang import SGLangRolloutEngine
    from rollplex_train.rollout.sglang_weights import sglang_name, unflatten_bucket

    engine = RecordingEngine(eos=2)
    adapter = SGLangRolloutEngine(str(tiny_ckpt_qwen25), tp_size=2, engine=engine, wrap=None,
                                  meta_cls=types.SimpleNamespace, weight_format="flattened_bucket",
                                  bucket_bytes=256 * 1024)
    full = {n: p.detach() for n, p in tiny_model.named_parameters()}
    adapter.update_weights(full, version=1)
    updates = [c for c in engine.calls if c[0] == "update_weights_from_tensor"]
    assert len(updates) > 1 and all(c[2]["load_format"] == "flattened_bucket" for c in updates)
    got = [{}, {}]
    for call in updates:
        payloads = call[1][0]
        assert len(payloads) == 2  # one serialized bucket per TP rank
        for rank, payload in enumerate(payloads):
            bucket = pickle.loads(payload)
            got[rank].update(unflatten_bucket(bucket["flattened_tensor"], bucket["metadata"]))
    want = {sglang_name(n): t for n, t in full.items()}
    for rank in range(2):
        assert got[rank].keys() == want.keys()
        assert all(torch.equal(got[rank][n], want[n]) for n in want)
    assert engine.names()[-2:] == ["end_weight_update", "flush_cache"] and adapter.weights_version == 1
    with pytest.raises(ValueError, match="weight_format='bucket'"):
        SGLangRolloutEngine(str(tiny_ckpt_qwen25), engine=engine, weight_format="bucket")


def test_settings_the_sglang_engine_cannot_honour_are_refused():
    from rollplex_train.config import ClusterConfig, Config, ModelConfig, RolloutConfig
    from rollplex_train.rollout.sglang import check_config

    ok = dict(cluster=ClusterConfig(device="cuda", devices_per_node=2), rollout=RolloutConfig(name="sglang"))
    check_config(Config(**ok))
    with pytest.raises(ValueError, match="cluster.device=cpu"):
        check_config(Config(rollout=RolloutConfig(name="sglang")))
    with pytest.raises(ValueError, match="model.attn_implementation='eager'"):
        check_config(Config(**ok, model=ModelConfig(attn_implementation="eager")))
    check_config(Config(cluster=ClusterConfig(device="cuda", devices_per_node=2),  # one engine per TP group
                        rollout=RolloutConfig(name="sglang", tensor_parallel_size=2)))


def test_an_engine_over_a_tp_group_starts_on_its_consecutive_gpus():
    from rollplex_train.rollout.sglang import engine_placement

    assert engine_placement(2, 2) == {"tp_size": 2, "base_gpu_id": 2}  # in process: the run's own numbering
    assert engine_placement(4, 0, [4, 5, 6, 7]) == {"tp_size": 4, "base_gpu_id": 4}  # Ray ids, all GPUs seen
    assert engine_placement(2, 0, [6, 7], visible="4,5,6,7") == {"tp_size": 2, "base_gpu_id": 2}  # SLURM's subset
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=2: SGLang runs its TP ranks on consecutive "
                                         r"GPUs, the group's devices are GPUs \[0, 2\]"):
        engine_placement(2, 0, [4, 6], visible="4,5,6,7")


def test_the_rollout_worker_starts_sglang_over_its_tp_group(monkeypatch, tiny_ckpt_qwen25):
    from rollplex_train.cluster import workers
    from rollplex_train.config import ModelConfig
    from rollplex_train.parallel import ParallelLayout

    started = []

    class Started:
        weights_version = 0

        def set_compute_share(self, threads):
            pass

    monkeypatch.setattr(workers, "create_rollout_engine", lambda name, **kw: started.append((name, kw)) or Started())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    layout = ParallelLayout(devices_per_node=8, device="cuda", train_tp=4, rollout_tp=4)
    workers.RolloutWorker("sglang", ModelConfig(path=str(tiny_ckpt_qwen25)), 1, 64, layout=layout, device_index=4,
                          engine_gpus=[4, 5, 6, 7])
    (name, kw), = started
    assert name == "sglang" and (kw["tp_size"], kw["base_gpu_id"]) == (4, 4) and "device" not in kw


def test_a_tp_group_engine_pushes_every_ranks_exported_tensors(tiny_ckpt_qwen25, mixed_prompts):
    """At rollout TP 2 one SGLang engine maps the exports of both devices (each rank's sglang-layout
    tensors, views of the actor where the plan allows) and sends rank k exactly SGLang's rank-k shard
    of the actor's weights; the bytes mapped are the trainers' views + rebuilds."""
    import pickle

    from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
    from rollplex_train.rollout.sglang import SGLangRolloutEngine
    from rollplex_train.rollout.sglang_weights import shard_state_dict
    from rollplex_train.training.torch_engine import TorchTrainEngine

    trainers = [TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25)), ActorConfig(lr=1e-3), AlgorithmConfig(),
                                 seed=1, rank=rank) for rank in (0, 1)]
    exports = [t.export_shared_weights(rollout_kind="sglang", rollout_tp=2) for t in trainers]
    engine = RecordingEngine(eos=2)
    adapter = SGLangRolloutEngine(str(tiny_ckpt_qwen25), tp_size=2, engine=engine,
                                  wrap=lambda values: ("LocalSerializedTensor", values), bucket_bytes=256 * 1024)
    with pytest.raises(ValueError, match="3 rank exports for an SGLang engine of TP 2"):
        adapter.map_shared_weights(([e["payload"] for e in exports] * 2)[:3])
    mapped = adapter.map_shared_weights([e["payload"] for e in exports])
    assert mapped == sum(e["view_bytes"] + e["rebuild_bytes"] for e in exports) and adapter.weights_version == 0
    sent = {n: [pickle.loads(v) for v in values] for c in engine.calls if c[0] == "update_weights_from_tensor"
            for n, (_, values) in c[1][0]}
    full = {n: p.detach() for n, p in trainers[0].actor.named_parameters()}
    for rank in (0, 1):
        want = shard_state_dict(full, adapter.layout, rank)
        assert sorted(want) == sorted(sent) and all(torch.equal(sent[n][rank], want[n]) for n in want)
    with pytest.raises(StaleWeightsError, match="not newer"):
        adapter.sync_shared_weights(0)
    assert len(adapter.generate(mixed_prompts, SamplingParams(), weights_version=0)) == 3


def test_the_run_hands_an_engine_over_a_tp_group_every_devices_weights():
    """SGLang at rollout TP 2 on 4 devices: one worker per engine maps the exports of both of its
    devices (rank order) and syncs with both devices' publish results; the driver checks the bytes
    against both exports (``runtime.step.share_weights``)."""
    from types import SimpleNamespace

    from rollplex_train.cluster.executors import InProcessExecutor
    from rollplex_train.cluster.groups import RolloutGroup
    from rollplex_train.parallel import ParallelLayout
    from rollplex_train.runtime.protocol import Pending
    from rollplex_train.runtime.step import share_weights

    class Worker:  # the RolloutWorker calls the group makes, recorded
        def __init__(self):
            self.calls = []

        def map_shared_weights(self, payload):
            self.calls.append(("map", payload))
            return sum(EXPORTS[p].view_bytes + EXPORTS[p].rebuild_bytes for p in payload)

        def sync_shared_weights(self, version, published):
            self.calls.append(("sync", version, published))
            return {"sharing/copied_bytes": float(sum(p["sharing/rebuild_bytes"] for p in published))}

    EXPORTS = {f"p{d}": SimpleNamespace(payload=f"p{d}", view_bytes=100 + d, rebuild_bytes=10, rollout_bytes=110 + d)
               for d in range(4)}
    ex = InProcessExecutor()
    handles = [ex.spawn(Worker, (), device=2 * e, gpu_fraction=0) for e in range(2)]
    layout = ParallelLayout(devices_per_node=4, rollout_tp=2)
    group = RolloutGroup(ex, handles, layout)
    assert [group.mapped_devices(e) for e in range(2)] == [[0, 1], [2, 3]]
    train = SimpleNamespace(export_shared_weights=lambda: Pending([], lambda _: [EXPORTS[f"p{d}"] for d in range(4)]))
    frac = share_weights(SimpleNamespace(train=train, rollout=group, layout=layout))
    assert frac == {"sharing/shared_bytes_frac": pytest.approx((100 + 101 + 102 + 103) / (110 + 111 + 112 + 113))}
    assert [h.obj.calls for h in handles] == [[("map", ["p0", "p1"])], [("map", ["p2", "p3"])]]
    published = [{"sharing/rebuild_bytes": float(d)} for d in range(4)]
    assert group.sync_shared_weights(3, published) == {"sharing/copied_bytes": 1.0}  # engine 0's: devices 0 + 1
    assert handles[1].obj.calls[-1] == ("sync", 3, published[2:])
