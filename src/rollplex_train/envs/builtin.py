"""The built-in environments: ``frozenlake`` (gymnasium) and ``minigrid:<id>`` (MiniGrid and BabyAI).

Both need the ``envs`` extra (gymnasium 1.4.0, minigrid 3.2.0); without it, building one raises
``MissingExtraError`` naming the extra. Both render headless: FrozenLake draws with pygame on an
offscreen surface (``SDL_VIDEODRIVER`` is set to ``dummy`` when unset, so SDL does not look for a
display), MiniGrid with numpy.

FrozenLake (``gymnasium/envs/toy_text/frozen_lake.py``): actions Left 0, Down 1, Right 2, Up 3;
reward 1 on reaching the goal, an episode ends on the goal or a hole (``terminated``) or after 100
steps (``truncated``, gymnasium's ``max_episode_steps``). ``desc`` fixes a map; without it each
episode's seed draws a ``size`` x ``size`` map with frozen-tile probability ``p``
(``generate_random_map``, VAGEN's setting). Non-slippery by default.

MiniGrid (``minigrid/core/actions.py``): actions left 0, right 1, forward 2, pickup 3, drop 4,
toggle 5, done 6; reward ``1 - 0.9 * steps / max_steps`` on success; the mission text is shown
above each frame. Any id ``import minigrid`` registers (``MiniGrid-*``, ``BabyAI-*``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from rollplex_train.envs.gym_adapter import GymnasiumEnv
from rollplex_train.registry import MissingExtraError

FROZENLAKE_ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
MINIGRID_ACTIONS = {"left": 0, "right": 1, "forward": 2, "pickup": 3, "drop": 4, "toggle": 5, "done": 6}


def import_gymnasium(name: str):
    """``gymnasium``, or a one-line ``MissingExtraError`` naming ``env.name`` and the extra."""
    try:
        import gymnasium
    except ImportError as err:
        raise MissingExtraError(f"env.name={name!r} needs gymnasium, the 'envs' extra: "
                                "pip install -e '.[envs]' (make install installs it)") from err
    return gymnasium


def frozenlake(*, desc: Optional[list[str]] = None, size: int = 4, p: float = 0.8, is_slippery: bool = False,
               **adapter: Any) -> GymnasiumEnv:
    """FrozenLake as a vision environment.

    Args:
        desc: a fixed map, rows of ``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal
            (e.g. ``["SFF", "FHF", "FFG"]``); None: a random ``size`` x ``size`` map per seed.
        size, p: random maps' side and frozen-tile probability.
        is_slippery: gymnasium's slippery ice (a move goes sideways with probability 2/3).
        adapter: ``GymnasiumEnv`` options (``max_actions_per_turn``, ``format_penalty``,
            ``answer_format``, pixel budget).

    Raises:
        MissingExtraError: gymnasium is not installed.
    """
    gym = import_gymnasium("frozenlake")
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    import pygame.surfarray  # noqa: F401  (here, in the builder's thread: imported first by several
    # rendering threads at once, pygame.surfarray can be seen half-initialised, without pixels3d)
    fixed = [str(row) for row in desc] if desc is not None else None

    def make(seed: int):
        rows = fixed if fixed is not None else generate_random_map(size=size, p=p, seed=seed)
        return gym.make("FrozenLake-v1", desc=rows, is_slippery=is_slippery, render_mode="rgb_array")

    rules = ("Walk from the start to the gift on the frozen lake without falling into a hole; "
             "the frame shows the map and where you stand.")
    return GymnasiumEnv(make, FROZENLAKE_ACTIONS, title="FrozenLake", rules=rules, **adapter)


def minigrid(env_id: str, *, env_kwargs: Optional[dict[str, Any]] = None, **adapter: Any) -> GymnasiumEnv:
    """A MiniGrid / BabyAI task as a vision environment.

    Args:
        env_id: a registered id, e.g. ``MiniGrid-Empty-5x5-v0`` or ``BabyAI-GoToRedBall-v0``.
        env_kwargs: passed to ``gymnasium.make`` (e.g. ``max_steps``).
        adapter: ``GymnasiumEnv`` options.

    Raises:
        MissingExtraError: gymnasium or minigrid is not installed.
        ValueError: ``env_id`` is not a registered MiniGrid/BabyAI id (lists a few that are).
    """
    gym = import_gymnasium(f"minigrid:{env_id}")
    try:
        import minigrid  # noqa: F401  (registers the MiniGrid and BabyAI ids)
    except ImportError as err:
        raise MissingExtraError(f"env.name='minigrid:{env_id}' needs minigrid, the 'envs' extra: "
                                "pip install -e '.[envs]' (make install installs it)") from err
    known = sorted(k for k in gym.registry if k.startswith(("MiniGrid-", "BabyAI-")))
    if env_id not in known:
        raise ValueError(f"env.name='minigrid:{env_id}': not a MiniGrid/BabyAI id; expected e.g. "
                         f"{known[:3]} ({len(known)} registered)")
    extra = dict(env_kwargs or {})

    def make(seed: int):
        return gym.make(env_id, render_mode="rgb_array", **extra)

    rules = ("You are the red triangle in a grid world; the highlighted cells are what you see. "
             "Left/Right turn in place, Forward moves one cell.")
    return GymnasiumEnv(make, MINIGRID_ACTIONS, title=f"the MiniGrid task {env_id}", rules=rules,
                        describe=lambda env: f"Mission: {env.unwrapped.mission}.", **adapter)
