"""Requests to SGLang's offline ``Engine.generate`` built from ``PromptSample``s, and its output
dicts mapped back to ``Response``s. Pure Python + torch: nothing here imports SGLang.

Written against SGLang 0.5.23 (the ``sglang-0.5.23`` wheel, read, never run here: no SGLang engine
runs on the CPU machines this project is tested on). API facts used, by file of that wheel:

* ``srt/entrypoints/engine.py::Engine.generate(input_ids=, image_data=, video_data=,
  sampling_params=, return_logprob=)``: a batch is ``input_ids`` as a list of id lists; ``image_data``
  / ``video_data`` one entry per request (a list of items, or None).
* ``srt/multimodal/processors/base_processor.py``: an item that is a dict with ``"format":
  "processor_output"`` is taken as the HF processor's output. ``load_mm_data`` returns the request's
  ``input_ids`` untouched when every item is preprocessed (no decode + re-tokenize, no resize),
  ``collect_mm_items_from_processor_output`` keeps ``pixel_values`` / ``pixel_values_videos`` as the
  features the vision tower runs on and ``image_grid_thw`` / ``video_grid_thw`` /
  ``second_per_grid_ts`` as their grids; image offsets are the runs of the image token in the ids.
* ``srt/multimodal/processors/qwen_vl.py::_process_mm_data_uncached``: ``mrope_positions`` (3, L)
  and ``mrope_position_delta`` found in the *first* preprocessed dict are used as the request's
  M-RoPE positions instead of SGLang's own ``get_rope_index``. We pass the trainer's positions
  (``models.sequence.rope_positions``), so prefill and decode positions equal the trainer's, also
  where transformers' max-position delta differs (a Qwen2.5-VL video ending the prompt).
* ``srt/sampling/sampling_params.py::SamplingParams``: ``max_new_tokens, stop, stop_token_ids,
  temperature, top_p, top_k, ignore_eos, no_stop_trim, logit_bias, sampling_seed, n``.
  ``sampling_seed`` is used only with ``enable_deterministic_inference`` (``srt/sampling/
  sampling_batch_info.py``), per (seed, position): the ``n`` copies of a request made by ``n > 1``
  would share it and sample the same tokens, so the builder sends one request per response, each
  with its own seed (``response_seed``).
* ``srt/managers/tokenizer_manager.py``: batch outputs come back in request order; each is a dict
  with ``output_ids`` and ``meta_info`` holding ``output_token_logprobs`` (a list of
  ``(logprob, token_id, text)``), ``completion_tokens`` and ``finish_reason``
  (``{"type": "stop" | "length" | "abort", ...}``).
* ``srt/layers/sampler.py``: the returned log-prob is ``log_softmax(logits / temperature)`` before
  top-k/top-p (``log(probs)`` of the tempered distribution; greedy: ``log_softmax(logits)``), the
  ``Response.logprobs`` contract; with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` it is
  ``log_softmax(logits)`` instead. ``logit_bias`` is added before the sampler, so the log-probs
  come from the biased distribution (see ``build_sampling_params``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rollplex_train.data.types import PromptSample, Response, VisionInputs
from rollplex_train.rollout.base import SamplingParams

SUPPRESS_BIAS = -1.0e9
"""Logit bias that keeps the vision placeholder tokens from being sampled (as the built-in engine
masks them); finite, since the bias dict travels through SGLang's msgspec/JSON paths."""

RopeFn = Callable[[PromptSample], tuple[torch.Tensor, torch.Tensor]]
"""``prompt -> (positions (3, L) int64, delta (1, 1) int64)``: the trainer's M-RoPE positions."""


def response_seed(seed: int, prompt_index: int, sample: int, n: int) -> int:
    """The ``sampling_seed`` of response ``sample`` of prompt ``prompt_index`` of a request with
    seed ``seed`` and ``n`` responses per prompt: distinct per response, a function of the request
    seed only (so a resumed run draws what the uninterrupted one drew). In ``[0, 2**63)``."""
    return (seed * 1_000_003 + prompt_index * n + sample) % (1 << 63)


def build_sampling_params(params: SamplingParams, *, eos_ids: set[int], suppressed_ids: set[int],
                          seed: int) -> dict:
    """SGLang ``sampling_params`` of one response (``n`` is expanded by ``build_generate_call``).

    Args:
        params: the project's sampling parameters. eos_ids: ids that end a response (the
            checkpoint's generation-config EOS ids and the tokenizer's), sent as ``stop_token_ids``
            so SGLang stops on exactly the built-in engine's set (dropped with ``ignore_eos``).
        suppressed_ids: ids never to sample (vision placeholders), as a ``logit_bias`` of
            ``SUPPRESS_BIAS``. SGLang adds the bias before computing log-probs, so a reported
            log-prob is the built-in engine's plus ``-log(1 - p_suppressed)`` (the placeholders'
            probability mass; ~0 for a trained policy).
        seed: ``sampling_seed`` (``response_seed``).

    Returns:
        a dict of SGLang 0.5.23 ``SamplingParams`` fields; ``temperature`` 0 is greedy in both.
        ``no_stop_trim`` keeps a matched stop string in the text, as the built-in engine does;
        ``skip_special_tokens`` as its ``decode``.
    """
    out = {
        "n": 1,
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": True,
        "sampling_seed": seed,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if eos_ids and not params.ignore_eos:
        out["stop_token_ids"] = sorted(eos_ids)
    if suppressed_ids:
        out["logit_bias"] = {str(i): SUPPRESS_BIAS for i in sorted(suppressed_ids)}
    return out


def vision_items(vision: VisionInputs, positions: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> tuple[list[dict], list[dict]]:
    """The ``processor_output`` items of one prompt: ``(image_data, video_data)`` of its request,
    ``[]`` where it has none (not None: ``GenerateReqInput._normalize_image_data`` decides from the
    *first* request's entry whether the batch is a list of per-request lists, and SGLang's
    ``has_valid_data([])`` is False).

    All images of the prompt travel in one dict and all videos in one (SGLang splits a bundled
    item per image/video by its grid, ``managers/mm_utils.py::get_new_expanded_mm_items``). The
    tensors are the trainer's own (no copy, same patches): ``pixel_values`` (Np_img, D) float32,
    ``image_grid_thw`` (num_images, 3) int64, ``pixel_values_videos`` (Np_vid, D),
    ``video_grid_thw`` (num_videos, 3), ``second_per_grid_ts`` (num_videos,) float32.
    ``positions``, when given, are put in the first dict (the one SGLang reads them from).
    """
    images: list[dict] = []
    videos: list[dict] = []
    if vision.num_images:
        images = [{"format": "processor_output", "pixel_values": vision.pixel_values,
                   "image_grid_thw": vision.image_grid_thw}]
    if vision.num_videos:
        item = {"format": "processor_output", "pixel_values_videos": vision.pixel_values_videos,
                "video_grid_thw": vision.video_grid_thw}
        if vision.second_per_grid_ts is not None:
            item["second_per_grid_ts"] = vision.second_per_grid_ts
        videos = [item]
    first = images or videos
    if first and positions is not None:
        first[0]["mrope_positions"], first[0]["mrope_position_delta"] = positions
    return images, videos


def check_placeholders(prompt: PromptSample, image_token_id: int, video_token_id: int, merge_size: int) -> None:
    """The prompt's placeholder counts match its grids (SGLang finds the features' slots by them).

    Raises:
        ValueError: naming the prompt uid, the token and both counts.
    """
    ids = prompt.prompt_ids
    for token, grid, what in ((image_token_id, prompt.vision.image_grid_thw, "image"),
                              (video_token_id, prompt.vision.video_grid_thw, "video")):
        want = 0 if grid is None else int(grid.prod(-1).sum()) // (merge_size * merge_size)
        have = int((ids == token).sum())
        if have != want:
            raise ValueError(f"prompt {prompt.uid}: {have} {what} placeholder tokens (id {token}) but its "
                             f"{what} grids need {want}")


@dataclass
class GenerateCall:
    """The keyword arguments of one ``Engine.generate`` call, one request per response.

    Attributes:
        input_ids: per request, the prompt's exact ids (placeholders already expanded).
        image_data, video_data: per request, its ``processor_output`` items (``[]``: none).
        sampling_params: per request (``build_sampling_params``).
        prompt_index: per request, the index of its prompt in the call's prompt list.
        n: responses per prompt (requests of prompt i are ``i * n .. i * n + n - 1``).
    """

    input_ids: list[list[int]] = field(default_factory=list)
    image_data: list[list[dict]] = field(default_factory=list)
    video_data: list[list[dict]] = field(default_factory=list)
    sampling_params: list[dict] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)
    n: int = 1

    def kwargs(self) -> dict:
        """``Engine.generate(**call.kwargs())`` (``return_logprob=True``)."""
        out = {"input_ids": self.input_ids, "sampling_params": self.sampling_params, "return_logprob": True}
        if any(self.image_data):
            out["image_data"] = self.image_data
        if any(self.video_data):
            out["video_data"] = self.video_data
        return out


def build_generate_call(prompts: list[PromptSample], params: SamplingParams, *, eos_ids: set[int],
                        suppressed_ids: set[int], rope: Optional[RopeFn] = None,
                        placeholder_ids: Optional[tuple[int, int, int]] = None, first_prompt: int = 0) -> GenerateCall:
    """One request per response: prompt i's ``params.n`` requests are contiguous, in sample order.

    Args:
        first_prompt: index of ``prompts[0]`` in the whole request when it is sent in chunks (the
            call's ``prompt_index`` and the per-response seeds count from it).
        rope: the trainer's M-RoPE positions of a prompt (sent for prompts with images/videos).
        placeholder_ids: ``(image_token_id, video_token_id, merge_size)`` to check each prompt's
            placeholder counts against its grids (``check_placeholders``); None skips the check.

    Raises:
        ValueError: an empty prompt list, or placeholders that do not match the grids.
    """
    if not prompts:
        raise ValueError("generate: no prompts")
    call = GenerateCall(n=params.n)
    for i, prompt in enumerate(prompts):
        if placeholder_ids is not None:
            check_placeholders(prompt, *placeholder_ids)
        has_vision = prompt.vision.num_images or prompt.vision.num_videos
        positions = rope(prompt) if (rope is not None and has_vision) else None
        images, videos = vision_items(prompt.vision, positions)
        ids = prompt.prompt_ids.tolist()
        for j in range(params.n):
            call.input_ids.append(ids)
            call.image_data.append(images)
            call.video_data.append(videos)
            call.sampling_params.append(build_sampling_params(
                params, eos_ids=eos_ids, suppressed_ids=suppressed_ids,
                seed=response_seed(params.seed, first_prompt + i, j, params.n)))
            call.prompt_index.append(first_prompt + i)
    return call


FINISH_REASONS = {"stop": "stop", "length": "length"}


def parse_output(output: dict, prompt_index: int, decode: Callable[[list[int]], str]) -> Response:
    """One SGLang output dict -> ``Response``.

    Token ids and log-probs come from ``meta_info["output_token_logprobs"]`` (every sampled token,
    EOS included); ``output_ids``, when present, must agree. ``text`` is ``decode(ids)`` (the
    trainer's tokenizer, special tokens skipped: the built-in engine's text), not SGLang's.

    Raises:
        RuntimeError: the request was aborted (SGLang's message quoted).
        ValueError: a malformed output (missing keys, ids disagreeing, unknown finish reason).
    """
    meta = output.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta or "finish_reason" not in meta:
        raise ValueError(f"SGLang output without meta_info.output_token_logprobs/finish_reason: keys {sorted(output)}")
    reason = meta["finish_reason"] or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted request {meta.get('id')}: {reason.get('message', reason)}")
    if kind not in FINISH_REASONS:
        raise ValueError(f"SGLang finish_reason {reason!r}: expected type stop, length or abort")
    triples = meta["output_token_logprobs"]
    ids = [int(t[1]) for t in triples]
    logps = [float(t[0]) for t in triples]
    if "output_ids" in output and list(output["output_ids"]) != ids:
        raise ValueError(f"SGLang output_ids {list(output['output_ids'])[:8]}... disagree with the log-prob "
                         f"token ids {ids[:8]}...")
    if "completion_tokens" in meta and int(meta["completion_tokens"]) != len(ids):
        raise ValueError(f"SGLang completion_tokens={meta['completion_tokens']} but {len(ids)} log-probs")
    return Response(prompt_index=prompt_index, token_ids=torch.tensor(ids, dtype=torch.long),
                    logprobs=torch.tensor(logps, dtype=torch.float32), text=decode(ids),
                    finish_reason=FINISH_REASONS[kind])


def parse_outputs(outputs: list[dict], call: GenerateCall, decode: Callable[[list[int]], str]) -> list[Response]:
    """The outputs of ``Engine.generate(**call.kwargs())`` (request order) -> responses grouped by
    prompt (prompt 0's n responses first), as ``RolloutEngine.generate`` returns them.

    Raises:
        ValueError: the number of outputs is not the number of requests; ``parse_output``'s errors.
    """
    if isinstance(outputs, dict):
        outputs = [outputs]
    if len(outputs) != len(call.prompt_index):
        raise ValueError(f"SGLang returned {len(outputs)} outputs for {len(call.prompt_index)} requests")
    return [parse_output(o, p, decode) for o, p in zip(outputs, call.prompt_index)]
