"""Worker shells: one TrainWorker per device and one RolloutWorker per rollout engine, colocated.

They are thin: each builds its engine through the registry, pins its torch thread count, joins the
training ranks' torch.distributed group, resolves object-store references, and forwards calls
(the engines answer with typed results: ``training.base.PrefixResult`` ...). No algorithm code lives here. The same classes run as Ray actors (``RayExecutor``) or as objects in
the driver (``InProcessExecutor``). On CPU colocated workers share the device's cores
(``cluster.threads_per_device``); on a GPU, with ``cluster.device_share=streams|green``, each
worker thread issues on a CUDA stream of its own (``device_share.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import PromptSample, Response, TrainBatch
from rollplex_train.rollout.base import SamplingParams, create_rollout_engine
from rollplex_train.device import layout_device
from rollplex_train.device_share import enter_side, half_sms
from rollplex_train.memory.host_malloc import keep_freed_memory
from rollplex_train.runtime.protocol import WeightsExport
from rollplex_train.training.base import ChunkResult, PrefixResult, create_train_engine


def resolve(value, indices: Optional[list[int]] = None):
    """A value sent by reference (``RayExecutor.put``) fetched from Ray's object store (anything
    else as it is), then ``[value[i] for i in indices]`` when indices are given."""
    if type(value).__name__ == "ObjectRef":
        import ray

        value = ray.get(value)
    return value if indices is None else [value[i] for i in indices]


def resolve_batch(batch: TrainBatch) -> TrainBatch:
    """The batch with its prompts fetched if they travel by reference."""
    batch.prompts = resolve(batch.prompts)
    return batch


def init_distributed(rank: int, world_size: int, address: Optional[tuple[str, int]], device: str) -> None:
    """Join the training ranks' default process group (gloo on CPU, NCCL on GPU) at the driver's
    rendezvous ``address``; nothing for a single rank."""
    if world_size == 1 or address is None:
        return
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    host, port = address
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{host}:{port}",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10))


def _setup_process(threads: int, authkey: Optional[bytes] = None) -> None:
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    transformers.utils.logging.disable_progress_bar()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    keep_freed_memory()  # freed tensors' memory reused, not page-faulted in afresh every step
    if authkey is not None:
        # Shared-memory handles (sharing/ipc.py, file_descriptor strategy) are fetched over a
        # multiprocessing connection authenticated with this key: both workers of a group need the
        # same one, and Ray starts each actor with its own random key.
        from rollplex_train.sharing.ipc import set_authkey

        set_authkey(authkey)


class ComputeThread:
    """One thread on which all of a worker's tensor work runs, whatever thread a call arrives on.

    A rollout worker takes two calls at once (a share change reaches it mid-decode), so Ray runs its
    calls on a pool of threads. With libgomp (PyTorch's CPU OpenMP runtime) every thread that runs
    a parallel region gets a team of its own, and once the process manages more OpenMP threads than
    there are cores, libgomp spins only briefly before parking idle team threads (its "throttled"
    spin count, libgomp ``env.c``/``wait.h``): every parallel region then wakes its team through the
    kernel. Measured on 2 cores: a decode on a second pool thread (from the second step on) kept
    the team's other thread 60-75% busy instead of ~100%, and its steps took 1.3-2.2x as long as
    on the one thread a serial run uses. Running the engine on one thread keeps one team.
    """

    def __init__(self, name: str):
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread; its result (or exception)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def iterate(self, make: Callable[[], Iterator]) -> Iterator:
        """The items of the iterator ``make()``, produced on the compute thread (eagerly: it does not
        wait for the consumer) and yielded here in order; its exception is re-raised here."""
        items: queue.Queue = queue.Queue()
        end = object()

        def pump() -> None:
            try:
                for item in make():
                    items.put((item, None))
            except BaseException as err:  # noqa: BLE001 -- handed to the consumer
                items.put((end, err))
                return
            items.put((end, None))

        self._pool.submit(pump)
        while True:
            item, err = items.get()
            if item is end:
                if err is not None:
                    raise err
                return
            yield item


class RolloutWorker:
    """Holds the rollout engine (the built-in one decodes in this process; SGLang spawns its own).

    Args:
        engine: registered rollout engine name. model: checkpoint section. threads: torch threads.
        max_batch_size: most sequences decoded together.
        authkey: the group's multiprocessing authkey (the TrainWorker's too) when weights are shared.
        layout: the run's ParallelLayout (None: the model stays on CPU). device_index: the engine's
            first run device (its GPU is ``cuda:<local index>``, or the actor's only visible one).
        device_share: ``cluster.device_share`` (decode on a stream of its own with streams/green).
        share_prompt_kv: ``rollout.share_prompt_kv`` (built-in engine).
        tp_rank, tp_address: built-in engine over ``layout.rollout_tp`` > 1 devices: this worker's
            rank of the engine's group and the group's rendezvous (host, port) (one worker per
            rank, every rank given the same calls; ``rollout/tensor_parallel.py``).
        engine_gpus: SGLang over ``layout.rollout_tp`` > 1 GPUs under Ray: Ray's GPU ids of the
            group's devices; this one worker sees the node's GPUs and starts the engine's TP
            processes on them (``rollout.sglang.engine_placement``).
    """

    def __init__(self, engine: str, model: ModelConfig, threads: int, max_batch_size: int,
                 authkey: Optional[bytes] = None, layout=None, device_index: int = 0, device_share: str = "cores",
                 share_prompt_kv: bool = False, tp_rank: int = 0, tp_address: Optional[tuple[str, int]] = None,
                 engine_gpus: Optional[list[int]] = None):
        _setup_process(threads, authkey)
        self.compute = ComputeThread("rollout-compute")  # the engine's tensors are touched on it only
        placement = {}
        if engine == "sglang" and layout is not None:  # one engine over the group's GPUs, started from here
            from rollplex_train.rollout.sglang import engine_placement

            first = 0 if engine_gpus else layout_device(layout, device_index).index or 0
            placement = engine_placement(layout.rollout_tp, first, engine_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if engine == "builtin":  # decodes in this process (SGLang places its own scheduler processes)
            device = layout_device(layout, device_index)
            placement = dict(device=device, compute_dtype=model.compute_dtype, device_share=device_share,
                             decode_sms=half_sms(device, device_share, "decode"), share_prompt_kv=share_prompt_kv)
            size = 1 if layout is None else layout.rollout_tp
            if size > 1:  # the group meets at the first decode (in one process the ranks are built in turn)
                from functools import partial

                from rollplex_train.rollout.tensor_parallel import TPGroup, new_process_group

                placement["tp"] = TPGroup(tp_rank, size, connect=partial(
                    new_process_group, tp_rank, size, tp_address, layout.device))
        self.engine = self.compute.run(
            create_rollout_engine, engine, model_path=model.path, dtype=model.dtype,
            attn_implementation=model.attn_implementation, max_batch_size=max_batch_size, **placement,
        )
        self.compute.run(self.engine.set_compute_share, threads)

    def generate(self, prompts: list[PromptSample], params: SamplingParams,
                 weights_version: Optional[int] = None, indices: Optional[list[int]] = None,
                 prefixes: Optional[list] = None) -> list[Response]:
        """``prompts`` (or its ``indices``) decoded; prompt indices of the responses count in the
        selected list. ``prefixes``: per selected prompt, its KV cache or None (``RolloutEngine.generate``)."""
        return self.compute.run(self.engine.generate, resolve(prompts, indices), params, weights_version, prefixes)

    def rollout_envs(self, env_cfg, model_path: str, seeds: list[int], params: SamplingParams,
                     weights_version: Optional[int], uid_prefix: str) -> list:
        """``params.n`` environment trajectories per seed on this engine (``rollout/multiturn.TurnLoop``,
        built once per ``env`` config): seed-major ``rollout.trajectory.Trajectory`` records."""
        return self.compute.run(self._loop(env_cfg, model_path).rollout, seeds, params, weights_version, uid_prefix)

    def _loop(self, env_cfg, model_path: str):
        """The ``TurnLoop`` of ``env_cfg`` on this engine, built once per config."""
        if getattr(self, "_turn_loop_key", None) != (env_cfg, model_path):
            from rollplex_train.rollout.multiturn import TurnLoop

            self._turn_loop = TurnLoop.from_config(self.engine, model_path, env_cfg)
            self._turn_loop_key = (env_cfg, model_path)
        return self._turn_loop

    def rollout_envs_stream(self, env_cfg, model_path: str, seeds: list[int], params: SamplingParams,
                            weights_version: Optional[int], uid_prefix: str):
        """Ray streaming generator of :meth:`rollout_envs`: each turn's ``TurnInput`` list as the turn
        starts, then the trajectories (``TurnLoop.rollout_stream``)."""
        loop = self._loop(env_cfg, model_path)
        yield from self.compute.iterate(lambda: loop.rollout_stream(seeds, params, weights_version, uid_prefix))

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """The pickled path (``sharing.enabled=false``): copy the received state dict in."""
        self.compute.run(self.engine.update_weights, named_tensors, version)
        copied = sum(t.numel() * t.element_size() for t in named_tensors.values())
        return {"sharing/copied_bytes": float(copied)}

    def map_shared_weights(self, payload) -> int:
        return self.compute.run(self.engine.map_shared_weights, payload)

    def sync_shared_weights(self, version: int, published: list[dict[str, float]]) -> dict[str, float]:
        """The shared path: ``published`` is the ``publish_weights`` result of each device whose
        tensors this engine mapped (this device's alone, or its TP group's: Ray resolves them first,
        so the trainer has refreshed and published ``version``). Copied: the trainer's rebuilds, and
        what an engine that owns its parameters (SGLang) copied in."""
        pushed = self.compute.run(self.engine.sync_shared_weights, version) or 0
        rebuilt = sum(p.get("sharing/rebuild_bytes", 0.0) for p in published)
        return {"sharing/copied_bytes": rebuilt + float(pushed)}

    def weights_digest(self) -> dict[str, str]:
        return self.compute.run(self.engine.weights_digest)

    def release_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        self.compute.run(self.engine.release_memory, tags)

    def resume_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        self.compute.run(self.engine.resume_memory, tags)

    def weights_version(self) -> int:
        return self.engine.weights_version

    def enter_phase(self, phase: str, resident: dict[str, bool]) -> dict:
        """Start ``phase`` of the residency plan (``memory/executor.py``): the engine's weights
        (``rollout_weights``) released or resumed as ``resident`` says; the groups' bytes before
        (``closing``) and after (``rows``) the moves, and the bytes moved."""
        def run() -> dict:
            closing, off, on = self.engine.memory_bytes(), 0, 0
            if "rollout_weights" in resident:
                if resident["rollout_weights"]:
                    on = self.engine.resume_memory(("weights",)) or 0
                else:
                    off = self.engine.release_memory(("weights",)) or 0
            return {"closing": closing, "rows": self.engine.memory_bytes(), "offloaded": off, "prefetched": on}

        return self.compute.run(run)

    def set_threads(self, threads: int) -> None:
        """This worker's share of the cores from the next decode step on (this actor runs two calls
        at once, so the planner can re-share while ``generate`` runs)."""
        self.engine.set_compute_share(threads)

    def decode_stats(self) -> dict[int, tuple[float, int]]:
        return self.engine.decode_stats()

    def follow_stream(self, prompts: list[PromptSample], params: SamplingParams,
                      weights_version: Optional[int] = None, indices: Optional[list[int]] = None,
                      prefixes: Optional[list] = None, progress_every: int = 0) -> None:
        """A tensor-parallel rank other than 0: the same ``generate_stream`` (the same collectives),
        its items dropped (rank 0 returns them)."""
        prompts = resolve(prompts, indices)
        self.compute.run(lambda: [None for _ in self.engine.generate_stream(prompts, params, weights_version,
                                                                             prefixes, progress_every)])

    def generate_stream(self, prompts: list[PromptSample], params: SamplingParams,
                        weights_version: Optional[int] = None, indices: Optional[list[int]] = None,
                        prefixes: Optional[list] = None, progress_every: int = 0):
        """Ray streaming generator (call with ``.options(num_returns="streaming")``): one object per
        batch of finished groups, the list of their responses (or, with ``progress_every``, of
        ``DecodeProgress``)."""
        prompts = resolve(prompts, indices)
        yield from self.compute.iterate(lambda: self.engine.generate_stream(prompts, params, weights_version, prefixes,
                                                                            progress_every))


class TrainWorker:
    """Holds the training engine (actor + reference + optimizer).

    Args:
        backend: registered training engine name. model/actor/algorithm: config sections.
        seed: torch seed. threads: torch threads.
        authkey: the group's multiprocessing authkey (the RolloutWorker's too) when weights are shared.
        layout: the run's ParallelLayout. rank: this worker's training rank.
        dist_address: (host, port) of the torch.distributed rendezvous (None: one rank).
        device_share: ``cluster.device_share``; with streams/green on a GPU this worker's thread (the
            prefix and training work) issues on a CUDA stream of its own.
    """

    def __init__(self, backend: str, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig,
                 seed: int, threads: int, authkey: Optional[bytes] = None, layout=None, rank: int = 0,
                 dist_address: Optional[tuple[str, int]] = None, device_share: str = "cores"):
        _setup_process(threads, authkey)
        if layout is not None:
            init_distributed(rank, layout.world_size, dist_address, layout.device)
        self.engine = create_train_engine(backend, model=model, actor=actor, algorithm=algorithm, seed=seed,
                                          layout=layout, rank=rank)
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the load is done before another stream reads it
            self.side = enter_side(device_share, device, half_sms(device, device_share, "prefix"))

    def compute_log_probs(self, batch: TrainBatch, role: str, temperature: float = 1.0) -> torch.Tensor:
        """(N, R) float32 log-probs of ``batch``'s responses under ``role``."""
        return self.engine.compute_log_probs(resolve_batch(batch), role, temperature)[0]

    def update_actor(self, batch: TrainBatch, temperature: float = 1.0, old_from_actor: bool = False) -> dict[str, float]:
        return self.engine.update_actor(resolve_batch(batch), temperature, old_from_actor)

    def pid(self) -> int:
        """This worker's process id (the worker-kill test hook)."""
        return os.getpid()

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.rollout_weights()

    def export_shared_weights(self, same_process: bool = False, rollout_kind: str = "hf") -> WeightsExport:
        out = self.engine.export_shared_weights(same_process, rollout_kind=rollout_kind)
        return WeightsExport(out["payload"], out["view_bytes"], out["rebuild_bytes"], out["rollout_bytes"])

    def publish_weights(self, version: int) -> dict[str, float]:
        return self.engine.publish_weights(version)

    def weights_digest(self) -> dict[str, str]:
        return self.engine.weights_digest()

    def offload_states(self, parts: tuple[str, ...]) -> int:
        return self.engine.offload_states(parts)

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        return self.engine.prefetch_states(parts)

    def enter_phase(self, phase: str, resident: dict[str, bool]) -> dict:
        return self.engine.enter_phase(phase, resident)

    def precompute_prefixes(self, prompts: list[PromptSample], roles: list[str], weights_version: int,
                            indices: Optional[list[int]] = None, export: bool = False) -> PrefixResult:
        return self.engine.precompute_prefixes(resolve(prompts, indices), roles, weights_version, export)

    def score_suffix_chunks(self, prompts: list[PromptSample], role: str, tokens: dict, width: int,
                            weights_version: int, final: bool = False) -> ChunkResult:
        """``tokens``: position in ``prompts`` (this rank's prompts, by reference) -> (n, t) tokens."""
        return self.engine.score_suffix_chunks(resolve(prompts), role, tokens, width, weights_version, final)

    def score_turns(self, items: list, roles: list[str], weights_version: int, temperature: float,
                    final: bool = False):
        """Score environment trajectories turn by turn (``training/turn_store.TurnStore.extend``:
        arguments, result and errors) under the rollout's ``weights_version``.

        Raises:
            StaleWeightsError: ``weights_version`` is not the actor's.
        """
        from rollplex_train.training.turn_store import TurnStore
        from rollplex_train.versioning import check_version

        check_version(weights_version, self.engine.weights_version, "turn scoring", "the actor")
        if getattr(self, "turns", None) is None:
            self.turns = TurnStore({"actor": self.engine.actor, "ref": self.engine.ref}, self.engine.scorer.compute)
        return self.turns.extend(items, roles, temperature, final)

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
