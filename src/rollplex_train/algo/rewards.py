"""Rule-based rewards, registered by name, and the manager that scores a rollout batch.

A reward function has the signature ``fn(response: str, ground_truth: str, **kwargs) -> float``;
the manager passes ``options=list[str]`` (the choices of a multiple-choice prompt, possibly empty)
when the function accepts it. Built-ins return a float in [0, 1] and read the final answer from the
last ``\\boxed{...}`` of the response (EasyR1's r1v/math rewards use the same convention).

``reward.function`` names a registered function (``auto``, ``choice``, ``number``, ``math``,
``format``) or a user file ``path/to/file.py:fn``.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from rollplex_train.registry import Registry, load_from_file

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward.function")
register_reward = REWARDS.register
known_rewards = REWARDS.names


# ---------------------------------------------------------------------------------------------
# answer extraction and normalisation


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last balanced ``\\boxed{...}`` in ``text`` (nested braces allowed), or None.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``. An unbalanced last box falls back to the
    previous balanced one. The content is stripped of surrounding whitespace.
    """
    starts = [m.end() for m in re.finditer(r"\\boxed\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos].strip()
    return None


_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\s*\{(.*)\}$", re.DOTALL)
_OPTION_LABEL = re.compile(r"^\(?([a-z])\s*[\).:]?$")
_LABELLED_OPTION = re.compile(r"^\(?([a-z])\s*[\).:]\s+(.+)$")


def normalize_answer(text: str) -> str:
    """Lower-case, unwrap ``\\text{...}``-like wrappers and ``$...$``, collapse whitespace, drop
    trailing punctuation (``. , ; : ! ?``)."""
    s = text.strip()
    for _ in range(3):  # a few layers: $\text{B}$
        s = s.strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$")
        m = _WRAPPER.match(s.strip())
        if m:
            s = m.group(1)
    s = re.sub(r"\s+", " ", s.lower()).strip()
    return s.rstrip(".,;:!? ").strip()


def _option_text(option: str, index: int) -> str:
    """Normalised option text without a leading ``A.`` / ``(A)`` label matching its position."""
    s = normalize_answer(option)
    m = _LABELLED_OPTION.match(s)
    if m and ord(m.group(1)) - ord("a") == index:
        s = m.group(2).strip()
    return s


def _canonical_choice(answer: str, options: Sequence[str]) -> str:
    """Map an option letter (``B``, ``(b)``, ``B.``) to its option text; other answers unchanged."""
    s = normalize_answer(answer)
    if options:
        m = _OPTION_LABEL.match(s)
        if m and ord(m.group(1)) - ord("a") < len(options):
            return _option_text(options[ord(m.group(1)) - ord("a")], ord(m.group(1)) - ord("a"))
        m = _LABELLED_OPTION.match(s)  # "b. cat" -> "cat" when it names the right option
        if m and ord(m.group(1)) - ord("a") < len(options):
            idx = ord(m.group(1)) - ord("a")
            if _option_text(options[idx], idx) == normalize_answer(m.group(2)):
                return normalize_answer(m.group(2))
        for idx, option in enumerate(options):  # a full labelled option string -> its text
            if normalize_answer(option) == s:
                return _option_text(option, idx)
    return s


def parse_number(text: str) -> Optional[float]:
    """A finite float from ``text`` (``"3"``, ``"-2.50"``, ``"1,000"``, ``"1e-3"``, ``"3/4"``,
    ``"45%"`` -> 45.0, ``"$12$"``), or None. Words such as ``"three"`` are not parsed."""
    s = normalize_answer(text).replace(",", "").replace(" ", "")
    s = s.removesuffix("\\%").removesuffix("%")
    m = re.fullmatch(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    try:
        if s.count("/") == 1:
            num, den = (float(p) for p in s.split("/"))
            value = num / den
        else:
            value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# built-in rewards


@register_reward("format")
def format_reward(response: str, ground_truth: str = "", **_: Any) -> float:
    """1.0 if the response holds a non-empty ``\\boxed{...}`` answer, else 0.0."""
    answer = extract_boxed(response)
    return 1.0 if answer else 0.0


@register_reward("choice")
def choice_reward(response: str, ground_truth: str, options: Optional[Sequence[str]] = None, **_: Any) -> float:
    """1.0 if the boxed answer names the ground-truth choice, else 0.0 (no box: 0.0).

    Both sides are normalised (``normalize_answer``); with ``options`` an option letter
    (``B``, ``(B)``, ``B.``) on either side stands for that option's text.
    """
    answer = extract_boxed(response)
    if not answer:
        return 0.0
    opts = list(options or [])
    return 1.0 if _canonical_choice(answer, opts) == _canonical_choice(ground_truth, opts) else 0.0


@register_reward("number")
def number_reward(response: str, ground_truth: str, **_: Any) -> float:
    """1.0 if the boxed answer and the ground truth are equal numbers, else 0.0.

    Equality is ``math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)``; parsing is ``parse_number``.
    """
    answer = extract_boxed(response)
    a = parse_number(answer) if answer else None
    b = parse_number(ground_truth)
    if a is None or b is None:
        return 0.0
    return 1.0 if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) else 0.0


@register_reward("math")
def math_reward(response: str, ground_truth: str, **_: Any) -> float:
    """1.0 if math-verify judges the boxed answer equal to the ground truth, else 0.0.

    Both are parsed as ``$...$`` LaTeX with ``math_verify.parse`` and compared with
    ``math_verify.verify(gold, answer)`` (symbolic, Kydlíček et al., Hugging Face Math-Verify).
    Off the main thread the signal-based timeouts of math-verify are disabled.
    """
    from math_verify import parse, verify

    answer = extract_boxed(response)
    if not answer:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${ground_truth.strip().strip('$')}$", parsing_timeout=timeout)
    pred = parse(f"${answer.strip('$')}$", parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


@register_reward("auto")
def auto_reward(response: str, ground_truth: str, options: Optional[Sequence[str]] = None, **_: Any) -> float:
    """``number`` when the ground truth parses as a number, else ``choice``."""
    if parse_number(ground_truth) is not None:
        return number_reward(response, ground_truth)
    return choice_reward(response, ground_truth, options=options)


# ---------------------------------------------------------------------------------------------
# loading and scoring


def load_reward_function(spec: str) -> RewardFn:
    """The reward function named by ``reward.function``.

    Args:
        spec: a registered name, or ``path/to/file.py:fn`` (the file is imported with importlib
            under a private module name; relative paths are relative to the working directory).

    Raises:
        FileNotFoundError: the file of ``path:fn`` does not exist (names the file).
        ValueError: an unknown name, a spec without ``:fn``, a file that fails to import (names
            the file, the line and the error) or a file without a callable ``fn`` (names the file
            and the function).
    """
    if spec in REWARDS:
        return REWARDS.get(spec)
    if ":" not in spec:
        raise ValueError(f"reward.function={spec!r}: expected one of {known_rewards()} or 'path/to/file.py:fn'")
    fn = load_from_file(spec, "reward.function", "reward")
    if not callable(fn):
        path, _, name = spec.rpartition(":")
        raise ValueError(f"reward.function={spec!r}: file {path!r} has no callable {name!r}")
    return fn


def _mean(values: torch.Tensor) -> float:
    return float(values.mean().item()) if values.numel() else 0.0


def _accepts_options(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or p.name == "options" for p in params)


class RewardFailure(RuntimeError):
    """Too many samples of one scoring call failed (``reward.max_failed_frac``): training on their
    zero scores would teach nothing. The message is one line naming the function and the first failure."""


class RewardManager:
    """Scores a rollout batch: ``score = (1 - w) * accuracy + w * format`` (EasyR1 r1v reward).

    A sample whose function raises or returns something other than a finite number scores 0
    accuracy and is counted in ``reward/failed``; each :meth:`score` call logs one warning with the
    count and the first failure of each kind (not one per sample).

    Args:
        function: ``reward.function`` (registered name or ``path/to/file.py:fn``).
        format_weight: ``reward.format_weight`` ``w`` in [0, 1].
        max_failed_frac: ``reward.max_failed_frac`` in (0, 1]: :meth:`score` raises
            :class:`RewardFailure` when the failed fraction of its samples reaches it (1.0: only
            when every sample failed).

    Raises:
        ValueError / FileNotFoundError: as ``load_reward_function``; ``format_weight`` outside
            [0, 1] or ``max_failed_frac`` outside (0, 1].
    """

    def __init__(self, function: str, format_weight: float, max_failed_frac: float = 1.0) -> None:
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"reward.format_weight={format_weight}: expected 0 <= w <= 1")
        if not 0.0 < max_failed_frac <= 1.0:
            raise ValueError(f"reward.max_failed_frac={max_failed_frac}: expected 0 < f <= 1")
        self.function = function
        self.format_weight = float(format_weight)
        self.max_failed_frac = float(max_failed_frac)
        self._fn = load_reward_function(function)
        self._pass_options = _accepts_options(self._fn)

    def _accuracy(self, response: str, ground_truth: str, options: list[str], uid: str) -> tuple[Optional[float], str]:
        """``(score, "")`` for a finite float, else ``(None, why)``: ``"raised: <Type>: <message>"``
        (the last line of the traceback) or ``"returned <value>"``."""
        try:
            kwargs = {"options": options} if self._pass_options else {}
            value = self._fn(response, ground_truth, **kwargs)
        except Exception as err:  # noqa: BLE001 - a user function may raise anything
            return None, f"raised {type(err).__name__}: {err}"
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return None, f"returned {value!r} (expected a finite number)"
        return float(value), ""

    def score(
        self,
        responses: list[str],
        ground_truths: list[str],
        uids: list[str],
        options: Optional[list[list[str]]] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Score N responses: ``(scores, metrics)`` of :meth:`score_with_failures` (failures score 0)."""
        scores, _, metrics = self.score_with_failures(responses, ground_truths, uids, options)
        return scores, metrics

    def score_with_failures(
        self,
        responses: list[str],
        ground_truths: list[str],
        uids: list[str],
        options: Optional[list[list[str]]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score N responses and say which ones the reward function failed on.

        Args:
            responses: N decoded response texts.
            ground_truths: N reference answers.
            uids: N sample ids (named in warnings).
            options: N lists of choices (empty for open questions); None: no options anywhere.

        Returns:
            ``(scores, failed, metrics)``: (N,) float32 scores, (N,) bool ``failed`` (the function
            raised or returned None/NaN/inf/a non-number; those score 0 accuracy here, and
            ``reward.on_failure`` decides downstream whether they stay in their group's baseline),
            and floats ``reward/accuracy`` (mean accuracy, failures as 0), ``reward/format`` (mean
            format score), ``reward/failed`` (number of failed samples) and ``reward/score`` (mean score).

        Raises:
            ValueError: the lists have different lengths.
            RewardFailure: the failed fraction reached ``max_failed_frac``.
        """
        num = len(responses)
        options = options if options is not None else [[] for _ in range(num)]
        if not (len(ground_truths) == len(uids) == len(options) == num):
            raise ValueError(
                f"score: {num} responses, {len(ground_truths)} ground truths, {len(uids)} uids, "
                f"{len(options)} option lists: expected equal lengths"
            )
        accuracy, formats, failed = [], [], []
        first: dict[str, str] = {}  # kind ("raised" / "returned") -> "uid=...: why" of its first sample
        for response, truth, uid, opts in zip(responses, ground_truths, uids, options):
            acc, why = self._accuracy(response, truth, list(opts), uid)
            failed.append(acc is None)
            if acc is None:
                first.setdefault(why.split(" ", 1)[0], f"uid={uid} {why}")
            accuracy.append(0.0 if acc is None else acc)
            formats.append(format_reward(response))
        num_failed = sum(failed)
        if num_failed:
            summary = (f"reward.function={self.function!r} failed on {num_failed} of {num} samples "
                       f"(accuracy 0; reward.on_failure decides whether they stay in their group's baseline); "
                       f"first: {'; '.join(first.values())}")
            if num_failed >= self.max_failed_frac * num:
                raise RewardFailure(f"{summary} -- stopping: the failed fraction reached "
                                    f"reward.max_failed_frac={self.max_failed_frac:g}")
            logger.warning("%s", summary)
        acc_t = torch.tensor(accuracy, dtype=torch.float32)
        fmt_t = torch.tensor(formats, dtype=torch.float32)
        w = self.format_weight
        scores = (1.0 - w) * acc_t + w * fmt_t
        metrics = {
            "reward/accuracy": _mean(acc_t),
            "reward/format": _mean(fmt_t),
            "reward/failed": float(sum(failed)),
            "reward/score": _mean(scores),
        }
        return scores, torch.tensor(failed, dtype=torch.bool), metrics
