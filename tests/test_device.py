"""The GPU path, as far as a CPU machine can check it: engine device placement, the bf16 autocast
precision, the in-process weight sharing (the tensors themselves), and the device-share refusals."""

from __future__ import annotations

import pytest
import torch

from conftest import scored_batch
from rollplex_train.config import ActorConfig, AlgorithmConfig, ClusterConfig, ModelConfig
from rollplex_train.device import compute_context, engine_device, layout_device
from rollplex_train.device_share import MachineFacts, check_config, check_machine, enter_side, probe, resolve_share
from rollplex_train.parallel import ParallelLayout
from rollplex_train.rollout.base import SamplingParams, StaleWeightsError
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.sharing.embedded import LocalWeights
from rollplex_train.training.torch_engine import TorchTrainEngine

PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=3)


def test_engine_device_per_local_index(monkeypatch):
    assert engine_device("cpu", 5) == torch.device("cpu")
    assert layout_device(ParallelLayout(devices_per_node=2), 1) == torch.device("cpu")
    with pytest.raises(ValueError, match="cluster.device='tpu'"):
        engine_device("tpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="cluster.device=cuda: torch sees no GPU"):
        engine_device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # in process: every GPU of the node
    assert layout_device(ParallelLayout(nnodes=2, devices_per_node=4, device="cuda"), 6) == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a Ray actor sees its bundle's GPU only
    assert engine_device("cuda", 3) == torch.device("cuda", 0)


def test_compute_context_float32_is_a_no_op_and_bfloat16_autocasts():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with compute_context(torch.device("cpu"), "float32"):
        same = lin(x)
    assert same.dtype == torch.float32 and torch.equal(same, lin(x))
    with compute_context(torch.device("cpu"), "bfloat16"):
        low = lin(x)
    assert low.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    torch.testing.assert_close(low.float(), lin(x), atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="model.compute_dtype='fp8'"):
        compute_context(torch.device("cpu"), "fp8")
    with pytest.raises(ValueError, match="model.compute_dtype=bfloat16 .* needs model.dtype=float32"):
        ModelConfig(dtype="bfloat16", compute_dtype="bfloat16")


def test_bf16_compute_keeps_fp32_master_weights_and_optimizer_states(tiny_ckpt_qwen25, mixed_prompts):
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25), compute_dtype="bfloat16")
    responses = rollout.generate(mixed_prompts, PARAMS)
    batch = to_train_batch(mixed_prompts, responses, rollout.pad_id)
    fp32 = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25)), ActorConfig(micro_batch_size=6),
                            AlgorithmConfig(), seed=1)
    bf16 = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25), compute_dtype="bfloat16"),
                            ActorConfig(micro_batch_size=6), AlgorithmConfig(), seed=1)
    exact, _ = fp32.compute_log_probs(batch, "actor")
    low, _ = bf16.compute_log_probs(batch, "actor")
    assert low.dtype == torch.float32 and not torch.equal(low, exact)  # computed in bf16 ...
    torch.testing.assert_close(low, exact, atol=0.15, rtol=0)  # ... close to fp32
    torch.testing.assert_close(low, batch.rollout_logprobs, atol=0.15, rtol=0)  # rollout autocasts too
    batch.old_logprobs = low
    batch.ref_logprobs, _ = bf16.compute_log_probs(batch, "ref")
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    bf16.update_actor(batch)
    assert {p.dtype for p in bf16.actor.parameters()} == {torch.float32}
    states = [s for st in bf16.backend.optimizer.state.values() for s in st.values() if torch.is_tensor(s) and s.dim()]
    assert states and {s.dtype for s in states} == {torch.float32}


def test_in_process_sharing_hands_over_the_tensors_themselves(tiny_ckpt_qwen25, mixed_prompts):
    trainer = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25)), ActorConfig(lr=1e-3, micro_batch_size=6),
                               AlgorithmConfig(kl_coef=0.05), seed=1)
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    export = trainer.export_shared_weights(same_process=True)
    assert isinstance(export["payload"], LocalWeights)
    assert rollout.map_shared_weights(export["payload"]) == export["rollout_bytes"] > 0
    actor, mapped = dict(trainer.actor.named_parameters()), dict(rollout.model.named_parameters())
    assert all(mapped[n].data_ptr() == p.data_ptr() for n, p in actor.items())  # the same memory
    assert not any(p.is_shared() for p in trainer.actor.parameters())  # nothing moved to shared memory

    batch = scored_batch(rollout, trainer, mixed_prompts, PARAMS)
    before = trainer.weights_digest()
    trainer.update_actor(batch)
    with pytest.raises(StaleWeightsError, match="being updated"):
        rollout.generate(mixed_prompts, PARAMS, weights_version=0)
    trainer.publish_weights(1)
    rollout.sync_shared_weights(1)
    assert rollout.weights_digest() == trainer.weights_digest() != before  # bit-equal, no copy
    assert all(mapped[n].data_ptr() == p.data_ptr() for n, p in actor.items())
    after = rollout.generate(mixed_prompts, PARAMS, weights_version=1)
    scored = to_train_batch(mixed_prompts, after, rollout.pad_id)
    logps, _ = trainer.compute_log_probs(scored, "actor")
    torch.testing.assert_close(logps, scored.rollout_logprobs, atol=1e-5, rtol=0)


def test_train_group_asks_for_local_weights_on_the_in_process_executor():
    from rollplex_train.cluster.groups import TrainGroup

    calls = []

    class Recorder:
        kind = "inprocess"

        def call(self, handle, method, *args, concurrent=False):
            import concurrent.futures as cf

            calls.append((method, args))
            f = cf.Future()
            f.set_result({"payload": None})
            return f

    TrainGroup(Recorder(), [object()], ParallelLayout()).export_shared_weights().result()
    assert calls == [("export_shared_weights", (True,))]


@pytest.mark.parametrize("share,device,executor,message", [
    ("nvlink", "cuda", "inprocess", r"cluster.device_share='nvlink': expected one of \['cores', 'streams', 'green', 'mps', 'auto'\]"),
    ("streams", "cpu", "inprocess", "cluster.device_share=streams: a CPU device is shared by its cores"),
    ("green", "cuda", "ray", "cluster.device_share=green splits one process's work: it needs cluster.executor=inprocess"),
    ("mps", "cuda", "inprocess", "cluster.device_share=mps partitions SMs between processes: it needs cluster.executor=ray"),
])
def test_device_share_refused_by_the_config(share, device, executor, message):
    with pytest.raises(ValueError, match=message) as err:
        ClusterConfig(device=device, executor=executor, device_share=share)
    assert "\n" not in str(err.value)
    check_config("cores", "cuda", "ray")  # GPU processes time-sliced: allowed
    check_config("streams", "cuda", "inprocess")


GPU = MachineFacts(gpus=1, torch_version=(2, 13), green_contexts=True, driver_cuda=(13, 1),
                   mps_control="/usr/bin/nvidia-cuda-mps-control", green_streams=True)
GREEN_WITHOUT_STREAMS = MachineFacts(1, (2, 11), True, (13, 0), None, green_streams=False)  # before pytorch #171116


@pytest.mark.parametrize("share,facts,message", [
    ("streams", MachineFacts(0, (2, 13), False, None, None), "cluster.device_share=streams: torch sees no GPU"),
    ("green", MachineFacts(1, (2, 11), False, (13, 0), None), r"green: torch 2.11 has no CUDA green contexts \(needs torch >= 2.13"),
    ("green", GREEN_WITHOUT_STREAMS, r"green: torch 2.11's green contexts have no Stream\(\) \(pytorch PR #171116\); use streams"),
    ("mps", MachineFacts(1, (2, 11), False, (13, 0), "/x"), r"mps: static SM partitions need driver CUDA >= 13.1 \(found \(13, 0\)\)"),
    ("mps", MachineFacts(1, (2, 13), True, (13, 1), None), "mps: nvidia-cuda-mps-control is not on PATH"),
    ("mps", GPU, "mps: this machine has MPS static partitions, but the workers do not set CUDA_MPS_SM_PARTITION"),
])
def test_device_share_refused_where_the_machine_lacks_it(share, facts, message):
    with pytest.raises(RuntimeError, match=message) as err:
        check_machine(share, facts)
    assert "\n" not in str(err.value)
    check_machine("streams", GPU)
    check_machine("green", GPU)
    check_machine("cores", MachineFacts(0, (2, 13), False, None, None))


@pytest.mark.parametrize("share,device,executor,facts,chosen", [
    ("auto", "cpu", "ray", None, "cores"),
    ("auto", "cuda", "ray", None, "cores"),                    # across processes: mps is not wired
    ("auto", "cuda", "inprocess", GPU, "streams"),             # never green: its halves may overlap
    ("auto", "cuda", "inprocess", GREEN_WITHOUT_STREAMS, "streams"),
    ("auto", "cuda", "inprocess", MachineFacts(0, (2, 13), False, None, None), "cores"),
    ("green", "cuda", "inprocess", GREEN_WITHOUT_STREAMS, "green"),  # forced as written (check_machine refuses it)
    ("streams", "cuda", "inprocess", None, "streams"),
    ("mps", "cuda", "ray", None, "mps"),
])
def test_device_share_auto_picks_only_what_the_machine_has_and_the_rest_is_forced(share, device, executor, facts,
                                                                                    chosen):
    assert resolve_share(share, device, executor, facts) == chosen
    assert ClusterConfig(device=device, executor=executor, device_share=share).device_share == share
    if share == "auto" and chosen != "cores":
        check_machine(chosen, facts)  # what auto picks, the machine gives


@pytest.mark.parametrize("green_class,has_streams", [(type("Gc211", (), {}), False),
                                                     (type("Gc213", (), {"Stream": lambda self: None}), True)])
def test_probe_reads_green_context_streams_off_torchs_cuda_class(monkeypatch, green_class, has_streams):
    from torch.cuda import green_contexts

    assert probe().green_streams is False  # this CPU build: no green contexts at all
    monkeypatch.setattr(green_contexts, "SUPPORTED", True)
    monkeypatch.setattr(green_contexts, "_GreenContext", green_class)
    facts = probe()
    assert facts.green_contexts is True and facts.green_streams is has_streams


def test_this_cpu_machine_refuses_gpu_shares_before_any_worker_starts(monkeypatch, tmp_path):
    from rollplex_train.cluster import executors, launch
    from rollplex_train.config import Config

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible")
    monkeypatch.setattr(executors.InProcessExecutor, "spawn", lambda *a, **k: pytest.fail("a worker started"))
    cfg = Config(cluster=ClusterConfig(device="cuda", executor="inprocess", device_share="streams"))
    with pytest.raises(RuntimeError, match="cluster.device_share=streams: torch sees no GPU"):
        launch.create_workers(cfg, tmp_path)
    assert enter_side("streams", torch.device("cpu")) is None  # CPU: no stream to enter
