"""Token ids of the pieces of a multi-turn chat, each tokenized once and never re-templated.

A trajectory's ids are the concatenation, in order, of:

    system | user_0 | response_0 | close_0 | user_1 | response_1 | close_1 | ... | user_T | response_T

- ``system``: the system message (``<|im_start|>system\\n...<|im_end|>\\n`` in Qwen's template);
- ``user_t``: observation t as a user message followed by the assistant header
  (``<|im_start|>user\\n... <|vision_start|><|image_pad|>*n<|vision_end|>...<|im_end|>\\n<|im_start|>assistant\\n``),
  each image pad expanded to the frame's ``t*h*w / merge**2`` tokens as ``data/prompts.py`` does;
- ``response_t``: the engine's own sampled ids, kept as they are (token in, token out);
- ``close_t``: what the template writes after an assistant message's content
  (``<|im_end|>\\n``), less the end-of-turn token the engine already sampled (a response that
  stopped on ``<|im_end|>`` is closed by ``\\n`` alone; one cut by ``max_new_tokens`` by both).

The pieces are cut from the checkpoint's own chat template by rendering a short conversation with
and without the new message and keeping the difference (the template must render turns
incrementally: a conversation's text starts with the text of any shorter one), so any Qwen2-VL /
Qwen2.5-VL checkpoint's template works. verl's multi-turn docs explain why: re-tokenizing the
decoded history changes the ids the policy sampled and breaks PPO's ratio.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from rollplex_train.data.prompts import build_messages, expand_vision_pads

_SYSTEM, _USER, _REPLY = "\x00system\x00", "\x00user\x00", "\x00reply\x00"


class TurnTokenizer:
    """Tokenizes the pieces of a multi-turn chat (module docstring). Thread-safe (one lock).

    Args:
        tokenizer: the checkpoint's Hugging Face tokenizer (with its chat template).
        merge_size: the vision tower's spatial merge (tokens per image = grid product / merge**2).

    Raises:
        ValueError: the chat template does not render turns incrementally.
    """

    def __init__(self, tokenizer, merge_size: int = 2):
        self.tokenizer, self.merge_size = tokenizer, merge_size
        self._lock = threading.Lock()
        system = self._render([{"role": "system", "content": _SYSTEM}], generation_prompt=False)
        with_user = self._render([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}])
        with_reply = self._render([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER},
                                   {"role": "assistant", "content": _REPLY}], generation_prompt=False)
        if not with_user.startswith(system) or not with_reply.startswith(with_user) or _REPLY not in with_reply:
            raise ValueError("the checkpoint's chat template does not render turns incrementally: a multi-turn "
                             "rollout cannot append one turn's tokens to the last")
        self._system_len = len(system)
        self.close_ids = self._ids(with_reply.split(_REPLY, 1)[1])
        """(C,) int64: what follows an assistant message's content (``<|im_end|>\\n``)."""

    def _render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _ids(self, text: str) -> torch.Tensor:
        with self._lock:  # a Rust tokenizer shared by worker threads
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def system_ids(self, system_prompt: str) -> torch.Tensor:
        """(S,) int64 ids of the system message."""
        text = self._render([{"role": "system", "content": system_prompt}], generation_prompt=False)
        return self._ids(text)

    def user_ids(self, text: str, image_grid_thw: Optional[torch.Tensor], name: str = "observation") -> torch.Tensor:
        """(U,) int64 ids of one observation as a user message plus the assistant header.

        Args:
            text: the observation text, one ``<image>`` per image.
            image_grid_thw: (num_images, 3) int64 grids of its frames (None: no image).
            name: how errors name the observation.

        Raises:
            ValueError: placeholders and grids disagree in number.
        """
        num_images = 0 if image_grid_thw is None else int(image_grid_thw.shape[0])
        user, = build_messages(text, num_images=num_images, num_videos=0, name=name)
        rendered = self._render([{"role": "system", "content": _SYSTEM}, user])
        piece = expand_vision_pads(rendered[self._system_len:], image_grid_thw, None, self.merge_size)
        return self._ids(piece)

    def closing_ids(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(C',) int64: what closes an assistant message whose content is ``response_ids``:
        ``close_ids`` less the leading tokens the response already ends with."""
        close, response = self.close_ids.tolist(), response_ids.tolist()
        for k in range(len(close), 0, -1):
            if response[-k:] == close[:k]:
                return self.close_ids[k:].clone()
        return self.close_ids.clone()
