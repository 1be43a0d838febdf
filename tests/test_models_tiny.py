"""The tiny checkpoint's initialisation: weight matrices at the size's ``init_std``."""

import pytest

from rollplex_train.models.tiny import SIZES, build_model, build_tokenizer


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_weight_matrices_start_at_the_sizes_init_std(arch):
    model = build_model(arch, "tiny", build_tokenizer(), seed=0)
    stds = {name: p.std().item() for name, p in model.named_parameters() if p.dim() > 1}
    embed = [n for n in stds if "embed_tokens" in n]
    assert len(embed) == 1 and stds.pop(embed[0]) == pytest.approx(0.02, rel=0.05)  # transformers' default
    assert SIZES["tiny"].init_std == 0.06 and len(stds) > 20
    assert all(std == pytest.approx(0.06, rel=0.08) for std in stds.values()), stds
    again = build_model(arch, "tiny", build_tokenizer(), seed=0)
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters()))  # seeded
