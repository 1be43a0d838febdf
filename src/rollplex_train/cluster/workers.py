"""Worker actor shells: one RolloutWorker and one TrainWorker per device, colocated.

They are thin: each builds its engine through the registry, pins its torch thread count, and
forwards calls. No algorithm code lives here. On CPU colocated workers share the machine's cores
(``cluster.threads_per_worker``); on GPU they share the device (streams / MPS, later issues).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import PromptSample, Response, TrainBatch
from rollplex_train.rollout.base import SamplingParams, create_rollout_engine
from rollplex_train.training.base import create_train_engine


def _setup_process(threads: int, authkey: Optional[bytes] = None) -> None:
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    transformers.utils.logging.disable_progress_bar()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if authkey is not None:
        # Shared-memory handles (sharing/ipc.py, file_descriptor strategy) are fetched over a
        # multiprocessing connection authenticated with this key: both workers of a group need the
        # same one, and Ray starts each actor with its own random key.
        from rollplex_train.sharing.ipc import set_authkey

        set_authkey(authkey)


class RolloutWorker:
    """Holds the rollout engine (the built-in one decodes in this process; SGLang spawns its own).

    Args:
        engine: registered rollout engine name. model: checkpoint section. threads: torch threads.
        max_batch_size: most sequences decoded together.
        authkey: the group's multiprocessing authkey (the TrainWorker's too) when weights are shared.
    """

    def __init__(self, engine: str, model: ModelConfig, threads: int, max_batch_size: int,
                 authkey: Optional[bytes] = None):
        _setup_process(threads, authkey)
        self.engine = create_rollout_engine(
            engine, model_path=model.path, dtype=model.dtype,
            attn_implementation=model.attn_implementation, max_batch_size=max_batch_size,
        )
        self.engine.set_compute_share(threads)  # calls may run on other threads than __init__

    def generate(self, prompts: list[PromptSample], params: SamplingParams,
                 weights_version: Optional[int] = None) -> list[Response]:
        return self.engine.generate(prompts, params, weights_version)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """The pickled path (``sharing.enabled=false``): copy the received state dict in."""
        self.engine.update_weights(named_tensors, version)
        copied = sum(t.numel() * t.element_size() for t in named_tensors.values())
        return {"sharing/copied_bytes": float(copied)}

    def map_shared_weights(self, payload: bytes) -> int:
        return self.engine.map_shared_weights(payload)

    def sync_shared_weights(self, version: int, published: dict[str, float]) -> dict[str, float]:
        """The shared path: ``published`` is the TrainWorker's ``publish_weights`` result (Ray
        resolves it first, so the trainer has refreshed and published ``version``)."""
        self.engine.sync_shared_weights(version)
        return {"sharing/copied_bytes": published.get("sharing/rebuild_bytes", 0.0)}

    def weights_digest(self) -> dict[str, str]:
        return self.engine.weights_digest()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def weights_version(self) -> int:
        return self.engine.weights_version

    def set_threads(self, threads: int) -> None:
        """This worker's share of the cores from the next decode step on (this actor runs two calls
        at once, so the planner can re-share while ``generate`` runs)."""
        self.engine.set_compute_share(threads)

    def decode_stats(self) -> dict[int, tuple[float, int]]:
        return self.engine.decode_stats()

    def generate_stream(self, prompts: list[PromptSample], params: SamplingParams,
                        weights_version: Optional[int] = None):
        """Ray streaming generator (call with ``.options(num_returns="streaming")``): one object per
        batch of finished groups, the list of their responses."""
        yield from self.engine.generate_stream(prompts, params, weights_version)


class TrainWorker:
    """Holds the training engine (actor + reference + optimizer).

    Args:
        backend: registered training engine name. model/actor/algorithm: config sections.
        seed: torch seed. threads: torch threads.
        authkey: the group's multiprocessing authkey (the RolloutWorker's too) when weights are shared.
    """

    def __init__(self, backend: str, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig,
                 seed: int, threads: int, authkey: Optional[bytes] = None):
        _setup_process(threads, authkey)
        self.engine = create_train_engine(backend, model=model, actor=actor, algorithm=algorithm, seed=seed)

    def compute_log_probs(self, batch: TrainBatch, role: str, temperature: float = 1.0,
                          with_entropy: bool = False):
        return self.engine.compute_log_probs(batch, role, temperature, with_entropy)

    def update_actor(self, batch: TrainBatch, temperature: float = 1.0) -> dict[str, float]:
        return self.engine.update_actor(batch, temperature)

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.rollout_weights()

    def export_shared_weights(self) -> dict:
        return self.engine.export_shared_weights()

    def publish_weights(self, version: int) -> dict[str, float]:
        return self.engine.publish_weights(version)

    def weights_digest(self) -> dict[str, str]:
        return self.engine.weights_digest()

    def offload_states(self, parts: tuple[str, ...]) -> int:
        return self.engine.offload_states(parts)

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        return self.engine.prefetch_states(parts)

    def precompute_prefixes(self, prompts: list[PromptSample], roles: list[str], weights_version: int):
        return self.engine.precompute_prefixes(prompts, roles, weights_version)

    def set_threads(self, threads: int) -> None:
        """This worker's share of the cores for the coming phase."""
        torch.set_num_threads(threads)

    def weights_version(self) -> int:
        return self.engine.weights_version

    def save_checkpoint(self, directory: str) -> None:
        self.engine.save_checkpoint(Path(directory))

    def load_checkpoint(self, directory: str) -> int:
        self.engine.load_checkpoint(Path(directory))
        return self.engine.weights_version

    def export_hf(self, directory: str) -> None:
        self.engine.export_hf(Path(directory))
