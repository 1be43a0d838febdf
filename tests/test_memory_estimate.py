"""The analytical memory model: parameter counts against the meta-device model, KV-cache, activation
and training-state formulas, batch/layout checks."""

import pytest
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import ModelConfig, hydra_version_base, register_configs, to_config
from rollplex_train.memory import estimate as est
from rollplex_train.models.arch import load_hf_config, meta_model
from rollplex_train.parallel import ParallelLayout

HF_7B = "conf/hf/qwen2_5_vl_7b_instruct.json"
HF_32B = "conf/hf/qwen2_5_vl_32b_instruct.json"


def _hf(path):
    return load_hf_config(ModelConfig(hf_config=path))


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides]))


def test_parameter_counts_match_the_meta_model_7b():
    hf = _hf(HF_7B)
    model = meta_model(hf)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert est.total_parameters(hf) == total == 8_292_166_656
    assert est.vision_parameters(hf) == vision == 676_550_144


def test_parameter_counts_32b_and_architecture_values():
    hf = _hf(HF_32B)
    assert est.total_parameters(hf) == 33_452_718_336  # numel of the meta model (checked once by hand)
    assert est.vision_parameters(hf) == 688_841_984
    text = est.text_dims(hf)
    assert (text.layers, text.hidden, text.intermediate, text.heads, text.kv_heads, text.head_dim, text.vocab) == (
        64, 5120, 27648, 40, 8, 128, 152064)
    assert not text.tied_embeddings
    assert hf.vision_config.out_hidden_size == 5120 and hf.vision_config.intermediate_size == 3456


def test_relative_hf_config_resolves_against_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert est.text_dims(_hf(HF_7B)).hidden == 3584


def test_kv_bytes_per_token():
    text = est.text_dims(_hf(HF_32B))
    assert est.kv_bytes_per_token(text, 1) == 2 * 64 * 8 * 128 * 2 == 262_144
    assert est.kv_bytes_per_token(text, 4) == 65_536
    assert est.kv_bytes_per_token(text, 16) == 2 * 64 * 1 * 128 * 2  # one replicated kv head per rank
    assert est.kv_bytes_per_token(text, 1, dtype_bytes=4) == 524_288


def test_activation_formula_reduces_to_korthikanti_bookkeeping():
    h = 1024
    mha_4h = est.TransformerDims(layers=2, hidden=h, intermediate=4 * h, heads=16, kv_heads=16, head_dim=64)
    # 12h + 4h_kv + 8i = 48h for MHA and i = 4h (Korthikanti's 34h less 2 dropout masks, GeLU -> SwiGLU: +16h)
    assert est.layer_activation_bytes_per_token(mha_4h, "none") == 48 * h
    assert est.layer_activation_bytes_per_token(mha_4h, "selective") == 48 * h
    assert est.layer_activation_bytes_per_token(mha_4h, "none", attention_scores=True, seq_len=512) == \
        48 * h + 5 * 16 * 512
    assert est.layer_activation_bytes_per_token(mha_4h, "full") == 2 * h
    tokens = 1000
    assert est.stack_activation_bytes(mha_4h, tokens, 1, "none") == 2 * tokens * 48 * h
    assert est.stack_activation_bytes(mha_4h, tokens, 4, "none") == 2 * tokens * 48 * h // 4
    # full recompute: every layer's input plus one layer's working set while it is recomputed
    assert est.stack_activation_bytes(mha_4h, tokens, 1, "full") == 2 * tokens * 2 * h + tokens * 48 * h
    assert est.stack_activation_bytes(mha_4h, tokens, 1, "full", working_layer=False) == 2 * tokens * 2 * h
    assert est.stack_activation_bytes(mha_4h, tokens, 1, "none", elem_bytes=4) == 2 * 2 * tokens * 48 * h
    with pytest.raises(ValueError, match="activation_recompute"):
        est.layer_activation_bytes_per_token(mha_4h, "partial")


def test_training_states_megatron_and_fsdp():
    p = 1200
    dist = est.training_state_bytes(p, strategy="megatron", tp=1, pp=1, dp=4, distributed_optimizer=True)
    assert dist == {"weights": 2 * p, "grads": 4 * p, "master": p, "optimizer": 2 * p}
    assert sum(dist.values()) == (6 + 12 / 4) * p  # Megatron dist_optimizer.md: 6 + 12/d bytes/param
    plain = est.training_state_bytes(p, strategy="megatron", tp=2, pp=3, dp=4, distributed_optimizer=False)
    assert sum(plain.values()) == 18 * p // 6
    fsdp = est.training_state_bytes(p, strategy="fsdp", tp=1, pp=1, dp=8, distributed_optimizer=False,
                                    largest_layer_params=100)
    assert fsdp == {"weights": 2 * 2 * 100, "grads": 4 * p // 8, "master": 4 * p // 8, "optimizer": 8 * p // 8}
    fp32 = est.training_state_bytes(p, strategy="megatron", tp=1, pp=1, dp=1, distributed_optimizer=True,
                                    param_bytes=4)
    assert fp32["master"] == 0 and fp32["weights"] == 4 * p
    with pytest.raises(ValueError, match="train_strategy"):
        est.training_state_bytes(p, strategy="zero1", tp=1, pp=1, dp=1, distributed_optimizer=True)


def test_logits_bytes():
    text = est.text_dims(_hf(HF_32B))
    assert est.logits_bytes_per_token(text, 4) == 152064 // 4 * 6


def test_batch_and_layout_of_the_32b_experiment():
    cfg = _compose("+experiment=qwen25vl32b_embodied")
    hf = _hf(HF_32B)
    batch, lay = est.batch_shape(cfg, hf), ParallelLayout.from_config(cfg)
    assert batch.vision_patches == 16 * 1024 and batch.vision_tokens == 4096  # 32 frames of 448x448
    assert (batch.prompts, batch.n, batch.prompt_tokens, batch.response_tokens) == (128, 8, 4608, 1024)
    assert (batch.mini_batch_prompts, batch.micro_groups) == (64, 1)
    assert (lay.world_size, lay.train_tp, lay.train_dp, lay.rollout_tp, lay.rollout_dp) == (32, 4, 8, 4, 8)
    assert not hasattr(est, "Layout")  # the memory model reads the one ParallelLayout


def test_batch_errors_name_the_key():
    cfg = _compose("+experiment=qwen25vl32b_embodied", "data.max_prompt_length=2048")
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        est.batch_shape(cfg, _hf(HF_32B))
