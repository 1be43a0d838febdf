"""Answer parsing: the action names in a model's turn, against an environment's action vocabulary.

Two answer formats:

- ``tag`` (VAGEN's, ``vagen/envs/frozenlake``): the actions sit in the last
  ``<answer>...</answer>`` of the turn, separated by commas (``<answer>Left, Down</answer>``).
  A turn without a closed answer tag is unparsable.
- ``words``: every vocabulary word in the turn, in order of appearance (case-insensitive, whole
  words). For policies too small to learn a tag format; a turn naming none is unparsable.

Either way at most ``max_actions`` actions are taken; a name outside the vocabulary, more names
than ``max_actions``, or an unparsable turn make the turn invalid (the environment scores it with
its format penalty and counts it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_FORMATS = ("tag", "words")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class ParsedAnswer:
    """The actions of one turn.

    Attributes:
        actions: vocabulary names to take, in order (lower case), at most ``max_actions``; they
            stop before the first unknown name.
        invalid: the turn broke the format: unparsable, an unknown name, or too many names.
        reason: why it is invalid (empty when valid), for the trajectory record.
    """

    actions: tuple[str, ...]
    invalid: bool
    reason: str = ""


def parse_answer(text: str, vocabulary: tuple[str, ...], max_actions: int, answer_format: str = "tag") -> ParsedAnswer:
    """The actions named in ``text``.

    Args:
        text: the model's turn (decoded, special tokens skipped).
        vocabulary: the environment's action names, lower case.
        max_actions: most actions taken in one turn (>= 1).
        answer_format: ``tag`` or ``words`` (module docstring).

    Raises:
        ValueError: an unknown ``answer_format`` or ``max_actions`` < 1.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r}: expected one of {list(ANSWER_FORMATS)}")
    if max_actions < 1:
        raise ValueError(f"max_actions={max_actions}: expected >= 1")
    if answer_format == "words":
        pattern = r"\b(" + "|".join(re.escape(v) for v in vocabulary) + r")\b"
        names = [m.lower() for m in re.findall(pattern, text, flags=re.IGNORECASE)]
        if not names:
            return ParsedAnswer((), True, "no action named")
    else:
        found = _ANSWER_RE.findall(text)
        if not found:
            return ParsedAnswer((), True, "no <answer>...</answer>")
        names = [n.strip().lower() for n in found[-1].split(",")]
        if names == [""]:
            return ParsedAnswer((), True, "empty answer")
    taken = []
    for name in names[:max_actions]:
        if name not in vocabulary:
            return ParsedAnswer(tuple(taken), True, f"unknown action {name!r}")
        taken.append(name)
    if len(names) > max_actions:
        return ParsedAnswer(tuple(taken), True, f"{len(names)} actions, at most {max_actions}")
    return ParsedAnswer(tuple(taken), False)
