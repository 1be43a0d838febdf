"""Teacher-forced scoring of a multi-turn trajectory turn by turn, against its cached prefix.

Under ``env.context=full`` a trajectory only grows: turn t+1's engine input is turn t's input, its
response, the closing tokens and the next observation (``rollout/multiturn.py``). Everything up to
the input of the turn being decoded is response-independent context for the rest of the
trajectory, so it can be scored while that turn decodes: a :class:`TurnScorer` keeps the KV cache of
the tokens scored so far and, per call, runs only the new tokens (their new frames through the
vision tower) against it. The log-probs of turn t's response come out of the call that extends the
cache to turn t+1's input; after the last turn only its response (the suffix) remains.

M-RoPE positions: those of the whole sequence so far (``models/sequence.rope_positions``, the
reference rule for images after assistant text; index arithmetic only), sliced to the new tokens.
Vision slots: every token the policy did not sample, as in the full-sequence pass
(``models/sequence.response_logprobs``). The vision tower encodes each image on its own (Qwen2-VL's
``cu_seqlens`` per image), so a frame's features do not depend on which call encodes it. The
per-token log-probs equal one full-sequence pass's to float rounding (tested to 1e-5 in fp32,
``tests/test_turn_scoring.py``).

Legend: L tokens scored so far, n new tokens, NL decoder layers, K kv heads, D head dim, H hidden.
"""

from __future__ import annotations

import torch

from rollplex_train.data.types import VisionInputs
from rollplex_train.device import model_device
from rollplex_train.models.hf_compat import cache_kwargs
from rollplex_train.models.sequence import embed_with_vision, logprobs_from_hidden, rope_positions


class TurnScorer:
    """One trajectory's scoring state under one model (the old policy or the reference).

    Args:
        model: a Qwen2-VL / Qwen2.5-VL ``*ForConditionalGeneration`` (run without grad).
        temperature: logits are divided by it (the rollout's sampling temperature).

    Attributes:
        scored: L, the tokens in the cache.
        keys, values: NL tensors (1, K, L, D), the cache.
        last_hidden: (1, 1, H) the final hidden state of token L-1 (it scores token L).
        images: images already encoded (the next call's vision starts after them).
    """

    def __init__(self, model, temperature: float = 1.0):
        self.model, self.temperature = model, temperature
        self.scored, self.images = 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.last_hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, sampled: torch.Tensor, vision: VisionInputs) -> torch.Tensor:
        """Score the tokens of ``ids`` past the cache and add them to it.

        Args:
            ids: (L',) int64 the trajectory so far; ``ids[:scored]`` must be what was scored before.
            sampled: (L',) bool, the tokens the policy sampled (never vision slots).
            vision: the vision inputs of every image in ``ids[:L']``, in order (those already
                encoded are skipped: the first ``images`` of them).

        Returns:
            (L' - scored,) float32 log-probs of the new tokens (token 0 of the trajectory: 0).

        Raises:
            ValueError: ``ids`` shorter than what is scored, or placeholders that disagree with the
                new images.
        """
        start, end = self.scored, int(ids.shape[0])
        if end < start:
            raise ValueError(f"TurnScorer.extend: {end} ids, but {start} are scored already")
        if end == start:
            return torch.zeros(0)
        model, dev = self.model, model_device(self.model)
        ids, slots = ids.to(dev).unsqueeze(0), (~sampled.bool()).to(dev).unsqueeze(0)
        positions, _ = rope_positions(model, ids, torch.ones_like(ids), vision.to(dev), slots)
        fresh = images_from(vision, self.images)
        embeds = embed_with_vision(model, ids[:, start:], fresh.to(dev), vision_grad=False,
                                   vision_mask=slots[:, start:])
        from transformers import DynamicCache

        layers = list(zip(self.keys, self.values)) if start else None
        cache = DynamicCache(ddp_cache_data=layers, config=model.config) if layers else DynamicCache(config=model.config)
        text = model.model.language_model
        out = text(inputs_embeds=embeds, attention_mask=torch.ones((1, end), dtype=torch.long, device=dev),
                   position_ids=positions[:, :, start:], use_cache=True, **cache_kwargs(text, cache))
        hidden = out.last_hidden_state  # (1, n, H): position p scores token p + 1
        prev = hidden[:, :0] if self.last_hidden is None else self.last_hidden
        scoring = torch.cat([prev, hidden[:, :-1]], dim=1)  # scores tokens start (or start + 1) .. end - 1
        targets = ids[:, end - scoring.shape[1]:]
        logp, _ = logprobs_from_hidden(model, scoring, targets, torch.ones_like(targets, dtype=torch.float32),
                                       self.temperature, with_entropy=False)
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.last_hidden, self.scored = hidden[:, -1:], end
        self.images = vision.num_images
        head = torch.zeros(end - start - logp.shape[1])  # token 0 of the trajectory has no score
        return torch.cat([head, logp[0].float().cpu()])


def images_from(vision: VisionInputs, first: int) -> VisionInputs:
    """The images of ``vision`` from index ``first`` on (their grids and patch rows; a grid (t, h, w)
    holds t * h * w patch rows). Videos are not part of an environment's observations.

    Raises:
        ValueError: ``vision`` holds videos.
    """
    if vision.num_videos:
        raise ValueError("TurnScorer: environment observations are images; got videos")
    if first == 0:
        return vision
    if first >= vision.num_images:
        return VisionInputs()
    grids = vision.image_grid_thw
    skip = int(grids[:first].prod(-1).sum())
    return VisionInputs(pixel_values=vision.pixel_values[skip:], image_grid_thw=grids[first:])
