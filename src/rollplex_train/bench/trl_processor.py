"""A Qwen2.5-VL processor for TRL built on rollplex's own data path (the TRL peer's input side).

transformers' ``Qwen2_5_VLProcessor`` needs torchvision, which cannot be installed beside CPU torch,
so TRL gets :class:`RolloutPlexProcessor`: it returns what transformers' Qwen2.5-VL processor
returns (ids with expanded pads, patches, grids, ``mm_token_type_ids``), computed with rollplex's
chat rendering and patchifying (``data/prompts.py``, ``data/vision.py``), so the ids and pixels are
those of :class:`rollplex_train.data.dataset.PromptDataset` for the same row and config (checked by
``bench/trl_peer.py`` on what the model actually receives).

TRL 1.16's GRPOTrainer has no video route: ``__call__`` returns a video under the image names
(``pixel_values`` / ``image_grid_thw``), which TRL's plumbing splits, shuffles and chunks per sample;
``bench/trl_peer.py`` renames them for the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from rollplex_train.config import Config
from rollplex_train.data.prompts import expand_vision_pads
from rollplex_train.data.vision import load_image, load_video, patchify_images, patchify_video, resolve_path
from rollplex_train.models.loading import load_tokenizer, load_vision_spec


class RolloutPlexProcessor:
    """A ``transformers.ProcessorMixin`` stand-in for Qwen2.5-VL, built on rollplex's data path.

    Media arrive as file paths (the manifest's ``images`` / ``videos`` entries, resolved against
    ``base_dir``); a path ending in a video suffix is a video. Ids, patches and grids are exactly
    those of :class:`rollplex_train.data.dataset.PromptDataset` for the same row and config.

    Args:
        cfg: the workload's config (data section: pixel bounds, video fps and frames).
        base_dir: directory the manifest's relative media paths are resolved against.
    """

    VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")

    def __init__(self, cfg: Config, base_dir: Path):
        self.cfg, self.base_dir = cfg, Path(base_dir)
        self.tokenizer = load_tokenizer(cfg.model.path)
        spec = load_vision_spec(cfg.model.path)
        self.geometry = dict(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                             merge_size=spec.merge_size)
        self.image_pad = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video_pad = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self._cache: dict[str, tuple] = {}
        self.second_per_grid_ts: list[float] = []  # of every video encoded (the model hook reads it)

    # ---- media ------------------------------------------------------------------------------------
    def is_video(self, item: Any) -> bool:
        return isinstance(item, str) and item.lower().endswith(self.VIDEO_SUFFIXES)

    def encode(self, item: str) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(patches (Np, D) float32, grid (1, 3) int64, second_per_grid_ts (1,) or None) of one file."""
        if item not in self._cache:
            d = self.cfg.data
            path = resolve_path(item, self.base_dir)
            if self.is_video(item):
                frames, fps = load_video(path, fps=d.video_fps, max_frames=d.video_max_frames,
                                         temporal_patch_size=self.geometry["temporal_patch_size"])
                self._cache[item] = patchify_video(frames, min_pixels=d.video_min_pixels, max_pixels=d.video_max_pixels,
                                                   sample_fps=fps, **self.geometry)
            else:
                pixels, grid = patchify_images([load_image(str(path))], min_pixels=d.min_pixels,
                                               max_pixels=d.max_pixels, **self.geometry)
                self._cache[item] = (pixels, grid, None)
        return self._cache[item]

    def _media(self, conversation: list[dict]) -> list[str]:
        return [part["image"] for m in conversation if isinstance(m.get("content"), list)
                for part in m["content"] if part.get("type") == "image"]

    def _render(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        """Chat text with one pad per medium (video items rendered as videos)."""
        messages = []
        for m in conversation:
            content = m["content"]
            if isinstance(content, list):
                content = [{"type": "video"} if p.get("type") == "image" and self.is_video(p.get("image"))
                           else {k: v for k, v in p.items() if k != "image"} for p in content]
            messages.append({"role": m["role"], "content": content})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _encode_rows(self, texts: list[str], media: list[list[str]]) -> tuple[list[list[int]], dict]:
        ids, fields = [], {"images": [], "videos": []}
        for text, items in zip(texts, media):
            encoded = [(self.is_video(x), self.encode(x)) for x in items]
            grids = {kind: [g for v, (_, g, _) in encoded if v == kind] for kind in (False, True)}
            text = expand_vision_pads(text, torch.cat(grids[False]) if grids[False] else None,
                                      torch.cat(grids[True]) if grids[True] else None, self.geometry["merge_size"])
            ids.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            for is_video, enc in encoded:
                fields["videos" if is_video else "images"].append(enc)
        return ids, fields

    def _type_ids(self, ids: list[int]) -> list[int]:
        return [1 if t == self.image_pad else 2 if t == self.video_pad else 0 for t in ids]

    # ---- the processor API TRL calls ----------------------------------------------------------------
    def apply_chat_template(self, conversation, tools=None, chat_template=None, add_generation_prompt=True,
                            tokenize=False, return_dict=False, continue_final_message=False, **_):
        """Like a processor's: text (``tokenize=False``) or ids + the model's vision inputs."""
        single = isinstance(conversation[0], dict)
        convs = [conversation] if single else conversation
        texts = [self._render(c, add_generation_prompt) for c in convs]
        if not tokenize:
            return texts[0] if single else texts
        ids, fields = self._encode_rows(texts, [self._media(c) for c in convs])
        out: dict[str, Any] = {"input_ids": ids, "mm_token_type_ids": [self._type_ids(x) for x in ids]}
        if fields["images"]:
            out["pixel_values"] = torch.cat([p for p, _, _ in fields["images"]])
            out["image_grid_thw"] = torch.cat([g for _, g, _ in fields["images"]])
        if fields["videos"]:  # generate's prefill gets the video under its own names
            out["pixel_values_videos"] = torch.cat([p for p, _, _ in fields["videos"]])
            out["video_grid_thw"] = torch.cat([g for _, g, _ in fields["videos"]])
            out["second_per_grid_ts"] = torch.cat([s for _, _, s in fields["videos"]])
        return out

    def __call__(self, images=None, text=None, padding=True, return_tensors="pt", **_):
        """Left-padded ids, mask, ``mm_token_type_ids`` and the media as ``pixel_values`` /
        ``image_grid_thw`` (videos too: TRL's forward plumbing carries only the image names)."""
        media = [list(x) if x else [] for x in (images or [[] for _ in text])]
        ids, fields = self._encode_rows(list(text), media)
        width = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id
        out = {
            "input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]),
            "mm_token_type_ids": torch.tensor([[0] * (width - len(x)) + self._type_ids(x) for x in ids]),
        }
        encoded = fields["images"] + fields["videos"]
        if fields["images"] and fields["videos"]:
            raise ValueError("the TRL peer takes image rows or video rows in a batch, not both")
        if encoded:
            out["pixel_values"] = torch.cat([p for p, _, _ in encoded])
            out["image_grid_thw"] = torch.cat([g for _, g, _ in encoded])
            self.second_per_grid_ts = [float(s) for _, _, s in fields["videos"] for s in s]
        return out

    def batch_decode(self, ids, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


def make_processor_class():
    """:class:`RolloutPlexProcessor` as a ``ProcessorMixin`` subclass (TRL checks the type to
    treat the model as a VLM); built lazily so importing this module needs no transformers."""
    from transformers import ProcessorMixin

    return type("RolloutPlexProcessorMixin", (RolloutPlexProcessor, ProcessorMixin), {})
