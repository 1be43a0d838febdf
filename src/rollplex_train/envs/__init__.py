"""Vision environments for multi-turn rollouts: the contract (``base.py``), answer parsing
(``actions.py``), the gymnasium adapter (``gym_adapter.py``), the built-ins ``frozenlake`` and
``minigrid:<id>`` (``builtin.py``, the ``envs`` extra) and ``env.name`` -> builder (``registry.py``).

Nothing here knows engines or devices; ``rollout/multiturn.py`` drives these environments.
"""

from rollplex_train.envs.base import EnvError, IMAGE_PLACEHOLDER, Observation, VagenEnv, VisionEnv, check_observation
from rollplex_train.envs.registry import ENVS, env_builder, register_env

__all__ = ["ENVS", "EnvError", "IMAGE_PLACEHOLDER", "Observation", "VagenEnv", "VisionEnv", "check_observation",
           "env_builder", "register_env"]
