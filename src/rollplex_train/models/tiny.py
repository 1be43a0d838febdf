"""Build tiny Qwen2-VL / Qwen2.5-VL checkpoints offline: tokenizer, config, image-processor config.

The checkpoint has the real architecture (transformers' ``Qwen2_5_VLForConditionalGeneration`` /
``Qwen2VLForConditionalGeneration``) at toy width, so every code path that loads a real Qwen2.5-VL
directory with ``from_pretrained(local_dir)`` loads this one the same way. The tokenizer is a
byte-level BPE trained on a fixed corpus, with Qwen's special tokens and Qwen2-VL's chat template.

Sizes (parameters, embeddings tied):
    ``tiny``  ~1.5M: text 4 layers x 128 wide; vision 2 blocks x 128 wide. For tests.
    ``small`` ~28M: text 8 layers x 384 wide; vision 6 blocks x 384 wide. For benchmarks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2 special tokens, in Qwen's order (they follow the BPE vocabulary).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL-Instruct's chat template (image/video content items become vision placeholders).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "what is the colour color of shape shapes how many are there in image video which direction "
    "does move moving object options answer final put your inside boxed think step by a an and "
    "red green blue yellow left right up down circle square triangle one two three four five "
    "you helpful assistant system user picture frame first last question reason please choose "
    "from following number count the it its to be is are was were on at with for this that"
).split()


def default_corpus() -> list[str]:
    """The fixed text the tiny tokenizer is trained on: task vocabulary, digits, answer formats."""
    lines = [" ".join(_WORDS), " ".join(w.capitalize() for w in _WORDS)]
    for a, b in itertools.product(_WORDS[:40], repeat=2):
        lines.append(f"{a} {b}. {a.capitalize()} {b}?")
    for w in _WORDS + [str(i) for i in range(100)] + list("ABCDEFGH"):
        lines.append(f"\\boxed{{{w}}} The answer is \\boxed{{{w}}}. ({w}) {w}, {w}: {w}")
    lines.append("0123456789 +-*/=()[]{}<>.,;:!?'\"\\ \n\t")
    return lines


def build_tokenizer(texts: Optional[Iterable[str]] = None, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with Qwen's special tokens and Qwen2-VL's chat template.

    Args:
        texts: training corpus (default: :func:`default_corpus`, so the result is deterministic).
        vocab_size: BPE vocabulary size before the 14 special tokens are appended.

    Returns:
        A fast tokenizer: eos ``<|im_end|>``, pad ``<|endoftext|>``, Qwen2-VL chat template.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts) if texts is not None else default_corpus(), trainer=trainer)
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )


@dataclass(frozen=True)
class TinySize:
    """Widths of a tiny checkpoint (text decoder and vision tower)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    init_std: float = 0.02
    """Std of the normal init of every weight matrix but the token embedding (transformers' default
    ``initializer_range`` is 0.02, sized for widths of 1k and up)."""


SIZES = {
    # init_std 0.06: with transformers' 0.02 on these 128-wide layers the supervised probe of the
    # video task (scripts/probe_task.py) sat at chance for ~100 steps, at 0.06 for ~40, and RL on the
    # video prompts alone left chance after ~60 steps instead of ~110 (docs/benchmarks.md)
    "tiny": TinySize(128, 4, 4, 2, 256, (4, 6, 6), 128, 2, 4, 256, init_std=0.06),
    "small": TinySize(384, 8, 6, 2, 1024, (8, 12, 12), 384, 6, 6, 1024),
    # Qwen2.5-VL-3B-Instruct's widths (its config.json); with this project's ~1k-token vocabulary
    # about 3.4B parameters. Random weights only: the GPU benchmark (scripts/bench_gpu.py).
    "3b": TinySize(2048, 36, 16, 2, 11008, (16, 24, 24), 1280, 32, 16, 3420),
}


def build_config(arch: str, size: str, tokenizer: PreTrainedTokenizerFast):
    """The transformers config of a tiny checkpoint.

    Args:
        arch: ``qwen2_5_vl`` or ``qwen2_vl``.
        size: a key of :data:`SIZES`.
        tokenizer: gives the vocabulary size and the special-token ids.

    Raises:
        ValueError: unknown arch or size.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}")
    s = SIZES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vocab = (len(tokenizer) + 63) // 64 * 64
    assert 2 * sum(s.mrope_section) == s.hidden // s.heads, "mrope_section must sum to head_dim / 2"
    text = dict(
        vocab_size=vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(s.mrope_section)},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    if arch == "qwen2_5_vl":
        vision = dict(
            depth=s.vision_depth,
            hidden_size=s.vision_hidden,
            intermediate_size=s.vision_intermediate,
            num_heads=s.vision_heads,
            out_hidden_size=s.hidden,
            window_size=112,
            fullatt_block_indexes=[s.vision_depth - 1],
            tokens_per_second=2,
        )
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    elif arch == "qwen2_vl":
        vision = dict(
            depth=s.vision_depth,
            embed_dim=s.vision_hidden,
            hidden_size=s.hidden,
            num_heads=s.vision_heads,
            mlp_ratio=s.vision_intermediate // s.vision_hidden,
        )
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    else:
        raise ValueError(f"arch={arch!r}: expected 'qwen2_5_vl' or 'qwen2_vl'")
    cfg.tie_word_embeddings = True
    cfg.get_text_config().tie_word_embeddings = True
    return cfg


def build_model(arch: str, size: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0):
    """A randomly initialised tiny VLM (float32) for the given architecture and size.

    transformers draws every weight from N(0, ``initializer_range``); the weight matrices (all
    parameters of two or more dimensions but the token embedding, which the LM head shares) are then
    scaled to the size's ``init_std``.
    """
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cfg = build_config(arch, size, tokenizer)
    torch.manual_seed(seed)
    cls = Qwen2_5_VLForConditionalGeneration if arch == "qwen2_5_vl" else Qwen2VLForConditionalGeneration
    model = cls(cfg).float()
    scale = SIZES[size].init_std / cfg.get_text_config().initializer_range
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1 and "embed_tokens" not in name:
                    param.mul_(scale)
    return model


def build_image_processor(min_pixels: int, max_pixels: int):
    """Qwen2-VL image processor config saved beside the weights (patch 14, merge 2, temporal 2)."""
    from transformers import Qwen2VLImageProcessorPil  # the PIL backend: no torchvision needed

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def make_tiny_checkpoint(out_dir, *, arch: str = "qwen2_5_vl", size: str = "tiny", tasks_dir=None,
                         warmup_steps: int = 50, warmup_batch_size: int = 32, warmup_lr: float = 2e-3,
                         min_pixels: int = 56 * 56, max_pixels: int = 112 * 112, seed: int = 0):
    """Build, format-warm-up and save a tiny checkpoint directory (written atomically).

    Args:
        out_dir: target directory; replaced if it exists.
        tasks_dir: output of ``scripts/make_visual_tasks.py``; its ``train.parquet`` feeds the
            format warm-up (None: no warm-up, random weights).
        warmup_steps / warmup_batch_size / warmup_lr: the supervised format warm-up.

    Returns:
        (Path of the checkpoint, list of warm-up losses).

    Raises:
        FileNotFoundError: ``tasks_dir`` lacks ``train.parquet``.
    """
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from rollplex_train.config import DataConfig
    from rollplex_train.data.dataset import PromptDataset
    from rollplex_train.models.warmup import format_warmup
    from rollplex_train.tracking.checkpoint import fsync_tree, replace_dir

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    model = build_model(arch, size, tokenizer, seed=seed)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    losses: list[float] = []
    if tasks_dir is not None:
        train_file = Path(tasks_dir) / "train.parquet"
        if not train_file.is_file():
            raise FileNotFoundError(f"{train_file} not found: run scripts/make_visual_tasks.py first")
        data_cfg = DataConfig(train_files=str(train_file), val_files="", min_pixels=min_pixels,
                              max_pixels=max_pixels, max_prompt_length=1024)
        dataset = PromptDataset(data_cfg, tokenizer, str(train_file), "warmup",
                                merge_size=model.config.vision_config.spatial_merge_size)
        samples = [s for s in (dataset.get(i) for i in range(len(dataset))) if s is not None]
        torch.manual_seed(seed)
        losses = format_warmup(model, tokenizer, samples, steps=warmup_steps, batch_size=warmup_batch_size,
                               lr=warmup_lr, seed=seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        build_image_processor(min_pixels, max_pixels).save_pretrained(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir, losses
