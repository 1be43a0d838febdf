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

    def extend(self, ids: torch.Tensor, sampled: torch.Tensor, vision: VisionInputs) -> torch.Tensor:
        """Score the tokens of ``ids`` past the cache and add them to it (:func:`extend_all` of one).

        Args:
            ids: (L',) int64 the trajectory so far; ``ids[:scored]`` must be what was scored before.
            sampled: (L',) bool, the tokens the policy sampled (never vision slots).
            vision: the vision inputs of every image in ``ids[:L']``, in order (those already
                encoded are skipped: the first ``images`` of them).

        Returns:
            (L' - scored,) float32 log-probs of the new tokens (token 0 of the trajectory: 0).

        Raises:
            ValueError: as :func:`extend_all`.
        """
        return extend_all([self], [(ids, sampled, vision)])[0]


@torch.no_grad()
def extend_all(scorers: list[TurnScorer], inputs: list[tuple]) -> list[torch.Tensor]:
    """:meth:`TurnScorer.extend` of several trajectories in one batched forward (one model).

    The new tokens are right-padded to the longest; the caches are left-padded to the longest, the
    attention mask hiding both pads (the layout of ``models.prefix.score_suffix``). Each scorer
    keeps its own real columns.

    Args:
        scorers: B scorers of one model. inputs: per scorer ``(ids, sampled, vision)`` as in
            :meth:`TurnScorer.extend`.

    Returns:
        per scorer, (L'_b - scored_b,) float32 log-probs of its new tokens.

    Raises:
        ValueError: ids shorter than what a scorer holds, scorers of different models, or
            placeholders that disagree with the new images.
    """
    from transformers import DynamicCache

    model = scorers[0].model
    if any(s.model is not model for s in scorers):
        raise ValueError("extend_all: the scorers of one call must share their model")
    for s, (ids, _, _) in zip(scorers, inputs):
        if int(ids.shape[0]) < s.scored:
            raise ValueError(f"TurnScorer.extend: {int(ids.shape[0])} ids, but {s.scored} are scored already")
    work = [b for b, (s, (ids, _, _)) in enumerate(zip(scorers, inputs)) if int(ids.shape[0]) > s.scored]
    out = [torch.zeros(0) for _ in scorers]
    if not work:
        return out
    dev, pad = model_device(model), model.config.get_text_config().pad_token_id or 0
    rows, masks, positions, visions, lengths = [], [], [], [], []
    for b in work:
        s, (ids, sampled, vision) = scorers[b], inputs[b]
        ids1, slots = ids.to(dev).unsqueeze(0), (~sampled.bool()).to(dev).unsqueeze(0)
        pos, _ = rope_positions(model, ids1, torch.ones_like(ids1), vision.to(dev), slots)
        rows.append(ids1[0, s.scored:])
        masks.append(slots[0, s.scored:])
        positions.append(pos[:, 0, s.scored:])
        visions.append(images_from(vision, s.images))
        lengths.append(int(ids.shape[0]) - s.scored)
    n, width = max(lengths), max(scorers[b].scored for b in work)
    new_ids = torch.full((len(work), n), pad, dtype=torch.long, device=dev)
    slots = torch.zeros((len(work), n), dtype=torch.bool, device=dev)
    position_ids = torch.zeros((3, len(work), n), dtype=torch.long, device=dev)
    attention = torch.zeros((len(work), width + n), dtype=torch.long, device=dev)
    for k, b in enumerate(work):
        length, held = lengths[k], scorers[b].scored
        new_ids[k, :length], slots[k, :length], position_ids[:, k, :length] = rows[k], masks[k], positions[k]
        position_ids[:, k, length:] = positions[k][:, -1:]  # pad columns: any position, masked
        attention[k, width - held:width + length] = 1
    embeds = embed_with_vision(model, new_ids, VisionInputs.concat(visions).to(dev), vision_grad=False,
                               vision_mask=slots)
    cache = DynamicCache(config=model.config)
    if width:
        held = next(scorers[b] for b in work if scorers[b].scored)  # any cache: its (1, K, ., D) shape

        def stacked(kind: str, layer: int) -> torch.Tensor:  # (B, K, width, D), each cache left-padded
            parts = [getattr(scorers[b] if scorers[b].scored else held, kind)[layer][:, :, :scorers[b].scored]
                     for b in work]
            return torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in parts])

        cache = DynamicCache(ddp_cache_data=[(stacked("keys", l), stacked("values", l)) for l in range(len(held.keys))],
                             config=model.config)
    text = model.model.language_model
    result = text(inputs_embeds=embeds, attention_mask=attention, position_ids=position_ids, use_cache=True,
                  **cache_kwargs(text, cache))
    hidden = result.last_hidden_state  # (B, n, H): column p scores new token p + 1
    for k, b in enumerate(work):
        s, length, held = scorers[b], lengths[k], scorers[b].scored
        h = hidden[k:k + 1, :length]
        prev = h[:, :0] if s.last_hidden is None else s.last_hidden
        scoring = torch.cat([prev, h[:, :-1]], dim=1)  # scores new tokens 0 (or 1) .. length - 1
        targets = rows[k][length - scoring.shape[1]:].unsqueeze(0)
        logp, _ = logprobs_from_hidden(model, scoring, targets, torch.ones_like(targets, dtype=torch.float32),
                                       s.temperature, with_entropy=False)
        keep = slice(width - held, width + length)
        s.keys = [layer.keys[k:k + 1, :, keep] for layer in cache.layers]
        s.values = [layer.values[k:k + 1, :, keep] for layer in cache.layers]
        s.last_hidden, s.scored = h[:, -1:], held + length
        s.images = inputs[b][2].num_images
        out[b] = torch.cat([torch.zeros(length - logp.shape[1]), logp[0].float().cpu()])
    return out


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
