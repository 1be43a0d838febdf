"""SGLang memory phases from the residency plan: which memory tags an SGLang engine releases or
resumes in each phase of a step, and its ``mem_fraction_static``. Pure Python.

SGLang 0.5.23 (read, not run here): ``srt/constants.py`` names the tags ``kv_cache``, ``weights``,
``cuda_graph``; ``Engine.release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``
(``srt/entrypoints/engine.py``) pause/resume them through torch_memory_saver (the engine must be
started with ``enable_memory_saver=True``). ``scheduler_components/weight_updater.py``: release
asserts the engine is idle and adds the tags to ``offload_tags``; resume *removes* each tag from
that set (a ``KeyError`` for a tag that was not released), so only released tags may be resumed.
Released weights come back with undefined contents unless ``enable_weights_cpu_backup``; the
engine must be given its weights again before it decodes. ``mem_fraction_static`` is the share of
the device's memory SGLang takes for weights and the KV-cache pool
(``srt/arg_groups/fields/schedule.py``).

Residency groups (``memory/groups.py``): ``rollout_weights`` (state, used by ``rollout_decode`` and
``weight_sync``) and ``rollout_kv`` (scratch of ``rollout_decode``).
"""

from __future__ import annotations

import math

from rollplex_train.memory.residency import ResidencyPlan

TAG_OF_GROUP = {"rollout_kv": "kv_cache", "rollout_weights": "weights"}
"""Residency group -> SGLang memory tag. (``cuda_graph`` follows ``kv_cache``.)"""


def tags_resident(plan: ResidencyPlan, phase: str) -> set[str]:
    """SGLang tags whose group is (at least partly) on the device in ``phase``.

    A group the plan does not hold (e.g. rollout weights that are views of the actor's, zero
    bytes) counts as resident: there is nothing to release. ``cuda_graph`` goes with ``kv_cache``.

    Raises:
        KeyError: ``phase`` is not in the plan.
    """
    resident = plan[phase].resident
    tags = {tag for group, tag in TAG_OF_GROUP.items()
            if resident.get(group, 0) > 0 or plan.item_bytes.get(group, 0) == 0}
    if "kv_cache" in tags:
        tags.add("cuda_graph")
    return tags


def phase_transition(plan: ResidencyPlan, phase: str, released: set[str]) -> tuple[list[str], list[str]]:
    """``(release, resume)``: the tags to release at the start of ``phase`` (held, not resident in
    it) and those to resume (released, resident in it), in SGLang's safe order (resume weights
    before the KV cache, as verl does, so the cache is allocated after the weights)."""
    want = tags_resident(plan, phase)
    order = ("weights", "kv_cache", "cuda_graph")
    release = [t for t in order if t not in want and t not in released]
    resume = [t for t in order if t in want and t in released]
    return release, resume


def mem_fraction_static(plan: ResidencyPlan, device_bytes: int, phase: str = "rollout_decode") -> float:
    """SGLang's ``mem_fraction_static``: the bytes the plan gives the rollout's weights and KV cache
    in ``phase`` over the device's bytes, rounded down to 0.01.

    Raises:
        ValueError: the fraction is not in (0, 1) (the plan gives the rollout nothing, or more than
            the device).
    """
    resident = plan[phase].resident
    nbytes = sum(plan.item_bytes.get(g, 0) * resident.get(g, 0) for g in TAG_OF_GROUP)
    fraction = math.floor(100 * nbytes / device_bytes) / 100
    if not 0 < fraction < 1:
        raise ValueError(f"residency plan gives the rollout {nbytes / 1024**3:.2f} GiB of a "
                         f"{device_bytes / 1024**3:.2f} GiB device in {phase}: mem_fraction_static={fraction}")
    return fraction
