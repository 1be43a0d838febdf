"""The typed records that travel between driver and workers.

Legend for shapes: P prompts in a batch, N responses (N = P * G for groups of G), L prompt tokens,
R response tokens, Np vision patches, D = C * temporal_patch * patch * patch patch features
(1176 for Qwen2-VL: 3 * 2 * 14 * 14).

These are plain dataclasses of CPU tensors: they pickle cheaply through Ray and carry no device
state. Weights never travel this way (see ``sharing/``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class VisionInputs:
    """Patchified images and videos of one prompt, in the Qwen2-VL processor layout.

    Attributes:
        pixel_values: (Np_img, D) float32 image patches, all images of the prompt concatenated.
        image_grid_thw: (num_images, 3) int64 patch grid (t, h, w) per image (t = 1).
        pixel_values_videos: (Np_vid, D) float32 video patches.
        video_grid_thw: (num_videos, 3) int64 patch grid per video.
        second_per_grid_ts: (num_videos,) float32 seconds per temporal grid step (Qwen2.5-VL M-RoPE).
    """

    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None
    second_per_grid_ts: Optional[torch.Tensor] = None

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])

    def to(self, device) -> "VisionInputs":
        """The same inputs on ``device`` (a tensor already there is not copied: ``Tensor.to``)."""
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        return VisionInputs(**{n: None if getattr(self, n) is None else getattr(self, n).to(device) for n in names})

    @staticmethod
    def concat(items: list["VisionInputs"]) -> "VisionInputs":
        """Concatenate the vision inputs of several prompts in order (for one batched forward)."""

        def cat(name: str) -> Optional[torch.Tensor]:
            parts = [getattr(v, name) for v in items if getattr(v, name) is not None]
            return torch.cat(parts, dim=0) if parts else None

        return VisionInputs(
            pixel_values=cat("pixel_values"),
            image_grid_thw=cat("image_grid_thw"),
            pixel_values_videos=cat("pixel_values_videos"),
            video_grid_thw=cat("video_grid_thw"),
            second_per_grid_ts=cat("second_per_grid_ts"),
        )


@dataclass
class PromptSample:
    """One prompt ready for the model: token ids with vision placeholders already expanded.

    Attributes:
        uid: stable id, ``<split>:<row index>`` (row index counted across all the split's files).
        prompt_ids: (L,) int64 token ids of the chat-formatted prompt, ending with the assistant header.
        vision: patchified images/videos referenced by the placeholders in ``prompt_ids``.
        ground_truth: the reference answer (string) for the reward function.
        task: data source / task name (metrics are also reported per task).
        options: the multiple-choice options if the task has them (else empty).
        problem: the prompt text as the data file holds it (placeholders included), for dumps.
        media: the paths of its images and videos, in order: as the data file gives them, relative
            ones joined to the data file's directory (what was loaded); ``<bytes>`` for an image
            stored inline. For dumps.
    """

    uid: str
    prompt_ids: torch.Tensor
    vision: VisionInputs
    ground_truth: str
    task: str = "default"
    options: list[str] = field(default_factory=list)
    problem: str = ""
    media: list[str] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_ids.shape[0])


@dataclass
class Response:
    """One sampled response.

    Attributes:
        prompt_index: index of its prompt in the request's prompt list.
        token_ids: (R,) int64 generated tokens (EOS included when generated).
        logprobs: (R,) float32 log-probs of those tokens under the sampling distribution
            (logits / temperature, before top-p/top-k truncation).
        text: decoded response (special tokens skipped).
        finish_reason: ``stop`` (EOS or stop string) or ``length`` (max_new_tokens reached).
        loss_mask: (R,) float32, 1 on the tokens the policy sampled (None: all of them). A
            multi-turn trajectory's row (``runtime/envs.py``) holds the observations between its
            turns with mask 0; they are the sequence's context, not trained.
    """

    prompt_index: int
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    text: str
    finish_reason: str
    loss_mask: Optional[torch.Tensor] = None


@dataclass
class DecodeProgress:
    """The tokens one group has decoded so far (a ``generate_stream`` item with ``progress_every``).

    Attributes:
        prompt_index: index of its prompt in the request's prompt list.
        token_ids: (n, t) int64, the first t tokens of each of the group's n responses (all the
            same length: progress is only reported under ``ignore_eos``).
    """

    prompt_index: int
    token_ids: torch.Tensor


@dataclass(frozen=True)
class MiniBatchSpec:
    """One optimizer step's share of a data-parallel rank's batch.

    Attributes:
        groups: local prompt indices (into ``TrainBatch.prompts``) of this rank's part of the
            mini-batch; may be empty when a mini-batch has fewer groups than DP ranks.
        num_tokens: response tokens of the whole mini-batch over all DP ranks.
        num_seqs: responses of the whole mini-batch over all DP ranks.

    The global counts make every ``loss_agg_mode`` normalise by the mini-batch, not by the rank's
    part, so the sum of the ranks' gradients is the single-process gradient (EasyR1 passes the same
    thing as ``meta_info["global_token_num"]``).
    """

    groups: tuple[int, ...]
    num_tokens: int
    num_seqs: int


@dataclass
class TrainBatch:
    """Responses grouped by prompt, with everything the actor update needs.

    Attributes:
        prompts: the P prompts of the step.
        group_index: (N,) int64 prompt index of each response (responses of a group are contiguous).
        response_ids: (N, R) int64, right-padded with the pad token.
        response_mask: (N, R) float32, 1 on real response tokens.
        advantages: (N, R) float32 token-level advantages (zero outside the mask).
        old_logprobs: (N, R) float32 log-probs under the weights that sampled (None before computed).
        ref_logprobs: (N, R) float32 reference log-probs (None when no KL is used).
        rollout_logprobs: (N, R) float32 log-probs reported by the rollout engine (diagnostics).
        mini_batches: the optimizer steps of one PPO epoch over this batch, with global counts
            (None: consecutive runs of ``actor.ppo_mini_batch_size`` prompts counted locally, the
            single-process case).
        source_rows: (N,) int64 row of each response in the step's whole batch, for a data-parallel
            rank's part (None: this is the whole batch).
        reward_failed: (N,) bool, the reward function failed on the response (None: not scored).
    """

    prompts: list[PromptSample]
    group_index: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    mini_batches: Optional[list[MiniBatchSpec]] = None
    source_rows: Optional[torch.Tensor] = None
    reward_failed: Optional[torch.Tensor] = None

    @property
    def num_responses(self) -> int:
        return int(self.response_ids.shape[0])

    @classmethod
    def from_responses(cls, prompts: list[PromptSample], responses: list[Response], pad_id: int) -> "TrainBatch":
        """Stack grouped responses into a right-padded batch over the step's ``prompts``
        (``group_index`` = each response's ``prompt_index``, the step's global prompt index).

        Args:
            responses: N responses, those of one prompt contiguous (as engines return them): all of
                the step's prompts, or some finished groups (a decode-tail suffix task).

        Raises:
            ValueError: an empty response list (nothing to train on).
        """
        if not responses:
            raise ValueError("no responses to train on")
        max_len = max(1, max(int(r.token_ids.shape[0]) for r in responses))
        n = len(responses)
        ids = torch.full((n, max_len), pad_id, dtype=torch.long)
        mask = torch.zeros((n, max_len), dtype=torch.float32)
        rollout_logprobs = torch.zeros((n, max_len), dtype=torch.float32)
        for i, r in enumerate(responses):
            length = int(r.token_ids.shape[0])
            ids[i, :length] = r.token_ids
            mask[i, :length] = 1.0 if r.loss_mask is None else r.loss_mask
            rollout_logprobs[i, :length] = r.logprobs
        return cls(prompts=prompts, group_index=torch.tensor([r.prompt_index for r in responses], dtype=torch.long),
                   response_ids=ids, response_mask=mask, rollout_logprobs=rollout_logprobs)

    def plan_mini_batches(self, groups_per_mini_batch: int) -> list[MiniBatchSpec]:
        """``mini_batches`` if set, else consecutive runs of ``groups_per_mini_batch`` prompts with
        this batch's own token/sequence counts."""
        if self.mini_batches is not None:
            return self.mini_batches
        specs = []
        for start in range(0, len(self.prompts), groups_per_mini_batch):
            groups = tuple(range(start, min(start + groups_per_mini_batch, len(self.prompts))))
            rows = self.rows_of(groups)
            mask = self.response_mask.index_select(0, rows)
            specs.append(MiniBatchSpec(groups, int(mask.sum()), int((mask.sum(-1) > 0).sum())))
        return specs

    def rows_of(self, prompt_indices) -> torch.Tensor:
        """(n,) int64 rows of the responses of the given prompts, in row order."""
        wanted = set(int(p) for p in prompt_indices)
        return torch.tensor([i for i, g in enumerate(self.group_index.tolist()) if g in wanted], dtype=torch.long)

    def select_groups(self, prompt_indices: list[int]) -> "TrainBatch":
        """The sub-batch holding the responses of the given prompts (prompt indices renumbered)."""
        remap = {p: i for i, p in enumerate(prompt_indices)}
        part = self.at_rows(self.rows_of(prompt_indices))
        return dataclasses.replace(part, prompts=[self.prompts[p] for p in prompt_indices],
                                   group_index=torch.tensor([remap[int(g)] for g in part.group_index.tolist()],
                                                            dtype=torch.long))

    def at_rows(self, rows: torch.Tensor) -> "TrainBatch":
        """The responses at ``rows`` ((n,) int64), every per-response tensor taken; the prompts and
        the prompt indices as they are, no mini-batch plan, no ``source_rows``."""
        taken = {name: None if getattr(self, name) is None else getattr(self, name).index_select(0, rows)
                 for name in PER_RESPONSE}
        return dataclasses.replace(self, mini_batches=None, source_rows=None, **taken)


PER_RESPONSE = ("group_index", "response_ids", "response_mask", "advantages", "old_logprobs", "ref_logprobs",
                "rollout_logprobs", "reward_failed")
"""The ``TrainBatch`` fields with one row per response."""


def gather_rows(parts: list[TrainBatch], values: list[torch.Tensor], num_rows: int,
                complete: bool = True) -> torch.Tensor:
    """Put per-rank (N_r, R) results back in the whole batch's row order: (num_rows, R) float32
    (rows no part holds stay 0 when ``complete=False``: the parts cover some groups only).

    Raises:
        AssertionError: a part without ``source_rows``, or (``complete``) rows left unfilled.
    """
    width = max(v.shape[1] for v in values)
    out = torch.zeros(num_rows, width, dtype=values[0].dtype)
    filled = 0
    for part, value in zip(parts, values):
        assert part.source_rows is not None
        out[part.source_rows, : value.shape[1]] = value
        filled += len(part.source_rows)
    assert filled == num_rows or not complete, (filled, num_rows)
    return out
