"""The SGLang rollout engine (``rollout.name=sglang``): SGLang's offline ``Engine`` behind the
``RolloutEngine`` contract, one engine per rollout TP group.

Written against SGLang 0.5.23's API (the ``sglang-0.5.23`` wheel, read file by file; see
``sglang_request``, ``sglang_weights``, ``sglang_memory`` for the facts each part relies on). It
is NOT run by the test suite: SGLang needs CUDA and is never installed on the CPU machines this
project is tested on. What runs on CPU: the request builder, the output parser, the weight payload
and its IPC round trip, the memory-phase logic, and this class's orchestration against a recording
stand-in of SGLang's ``Engine`` (``tests/test_rollout_sglang.py``). The real engine is exercised
only by ``scripts/check_sglang.py`` on a GPU machine with the ``sglang`` extra installed.

SGLang is imported lazily (in ``__init__``); without it, choosing this engine fails in one line
naming the extra before Ray starts (``check_available``, called by ``Trainer.__init__``).

Engine launch (``srt/entrypoints/engine.py::Engine(**ServerArgs fields)``): ``model_path``,
``tp_size``, ``base_gpu_id`` (the group's first device), ``mem_fraction_static``,
``enable_memory_saver=True`` (release/resume by tag), ``enable_deterministic_inference=True``
(``sampling_seed`` is ignored without it; it also selects the pytorch sampling backend,
``srt/arg_groups/overrides.py``), ``load_format="dummy"``: the weights come only through
``update_weights`` (checked name by name against SGLang's parameter list), never through SGLang's
checkpoint loader, whose ``Qwen2_5_VLForConditionalGeneration.load_weights`` skips most names it does
not know, but renames the language model's q/k/v and every gate/up projection to the stacked
``qkv_proj``/``gate_up_proj`` and looks that up unchecked: a ``KeyError`` for transformers 5's
``model.language_model.layers.*.q_proj`` (``models/qwen2_5_vl.py::load_weights``).

Control calls: ``begin/end_weight_update``, ``update_weights_from_tensor`` and ``flush_cache``
return ``(success, message)``, checked by ``_ok`` (a call that reports nothing is a failure there);
``release_memory_occupation``/``resume_memory_occupation`` return ``None`` in 0.5.23 (the
``TokenizerManager`` awaits the schedulers' ``Release/ResumeMemoryOccupationReqOutput``, which
carry no status: ``managers/tokenizer_control_mixin.py``), so the call returning is their only
acknowledgement (``_acknowledged``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from typing import Any, Callable, Iterable, Optional

import torch

from rollplex_train.registry import MissingExtraError
from rollplex_train.data.types import PromptSample, Response
from rollplex_train.rollout.base import RolloutEngine, SamplingParams, StaleWeightsError, register_rollout_engine
from rollplex_train.versioning import check_newer, check_version
from rollplex_train.rollout.sglang_memory import phase_transition
from rollplex_train.rollout.sglang_request import build_generate_call, parse_outputs
from rollplex_train.rollout.sglang_weights import (
    FLATTENED_LOAD_FORMAT,
    LOAD_FORMAT,
    buckets,
    build_update_calls,
    check_full_tensors,
    check_rank_tensors,
    expected_params,
    flatten_bucket,
    serialize,
    sglang_layout,
    sglang_name,
    shard_state_dict,
)

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
EXTRA = "sglang"
TAGS = ("weights", "kv_cache", "cuda_graph")


def check_available(cfg: Any = None) -> None:
    """Fail early (before Ray) when this machine cannot run the SGLang engine.

    Args:
        cfg: the run's ``Config`` (optional): an SGLang run needs GPUs (``cluster.device=cuda``),
            ``model.attn_implementation`` at its default, and (until the worker groups pass each
            engine its TP group) ``rollout.tensor_parallel_size=1``.

    Raises:
        MissingExtraError: SGLang is not installed (names the ``sglang`` extra).
        ValueError: another SGLang version than the one this adapter is written against, or a
            setting the run cannot honour (named).
    """
    if importlib.util.find_spec("sglang") is None:
        raise MissingExtraError(
            f"rollout.name=sglang: SGLang is not installed; on a GPU machine install the '{EXTRA}' extra "
            f"(pip install -e '.[{EXTRA}]', sglang=={SGLANG_VERSION}); make install never installs it")
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise ValueError(f"rollout.name=sglang: the adapter is written against sglang=={SGLANG_VERSION}, "
                         f"found {version}; install the '{EXTRA}' extra")
    if cfg is not None:
        check_config(cfg)


def check_config(cfg: Any) -> None:
    """The settings of a run ``Config`` the SGLang engine cannot honour (``check_available``'s
    second half; needs no SGLang).

    A TP group of ``rollout.tensor_parallel_size`` devices lies on one node (``ParallelLayout``
    refuses a degree that does not divide ``cluster.devices_per_node``), as one SGLang engine needs.

    Raises:
        ValueError: naming the key: ``cluster.device=cpu``, a non-default
            ``model.attn_implementation``.
    """
    if cfg.cluster.device != "cuda":
        raise ValueError(f"rollout.name=sglang: SGLang decodes on GPUs, but cluster.device={cfg.cluster.device}")
    if cfg.model.attn_implementation != "sdpa":
        raise ValueError(f"model.attn_implementation={cfg.model.attn_implementation!r}: a transformers setting the "
                         "SGLang engine cannot honour; leave it at 'sdpa'")


def engine_placement(tp_size: int, local_index: int, gpu_ids: Optional[list[int]] = None,
                     visible: Optional[str] = None) -> dict[str, int]:
    """``tp_size`` and ``base_gpu_id`` of the SGLang engine of a rollout TP group.

    SGLang puts TP rank ``k`` on GPU ``base_gpu_id + k * gpu_id_step`` of the GPUs its process sees
    (``ServerArgs``; ``gpu_id_step`` left at 1), so the group's GPUs must be consecutive there.

    Args:
        tp_size: the group's devices (``rollout.tensor_parallel_size``).
        local_index: the torch index of the group's first device in this process, where the process
            sees the devices as the run numbers them (in process; a Ray worker of a TP 1 engine sees
            only its own GPU: 0).
        gpu_ids: Ray's GPU ids of the group's devices (``DevicePlacement.gpu_id_of_device``), for a
            Ray worker that sees the node's GPUs (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``,
            as slime's ``slime/ray/rollout.py`` starts its SGLang engines); None otherwise.
        visible: the process's ``CUDA_VISIBLE_DEVICES`` (the node's, inherited from the raylet):
            torch index ``i`` is its ``i``-th entry; unset: index = GPU id.

    Raises:
        ValueError: the group's GPUs are not consecutive in this process's numbering (names the key).
    """
    if gpu_ids is None:
        return {"tp_size": tp_size, "base_gpu_id": local_index}
    order = [int(g) for g in visible.split(",")] if visible else None
    index = [order.index(g) for g in gpu_ids] if order else list(gpu_ids)
    if len(index) != tp_size or index != list(range(index[0], index[0] + tp_size)):
        raise ValueError(f"rollout.tensor_parallel_size={tp_size}: SGLang runs its TP ranks on consecutive GPUs, "
                         f"the group's devices are GPUs {index} of its node (CUDA_VISIBLE_DEVICES={visible!r})")
    return {"tp_size": tp_size, "base_gpu_id": index[0]}


def _ok(result: Any, what: str) -> None:
    """Check a control call that reports a status: ``(success, message)`` or an object with
    ``.success`` (and ``.message``).

    Raises:
        RuntimeError: ``success`` is false, or the call reported no status (``None`` or another
            shape: not the SGLang API this adapter is written against, so not counted as success).
    """
    if isinstance(result, tuple) and len(result) == 2:
        success, message = result
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", "")
    else:
        raise RuntimeError(f"SGLang {what} returned {result!r}, not (success, message): not the sglang=="
                           f"{SGLANG_VERSION} API")
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _acknowledged(result: Any, what: str) -> None:
    """Check ``release_memory_occupation``/``resume_memory_occupation``: ``None`` is their 0.5.23
    return (no status exists: the schedulers replied, module docstring); a status, should a
    release return one, is checked as ``_ok`` does.

    Raises:
        RuntimeError: a status that says the call failed, or a result of another shape.
    """
    if result is not None:
        _ok(result, what)


@register_rollout_engine("sglang")
class SGLangRolloutEngine(RolloutEngine):
    """One SGLang engine over the ``tp_size`` devices ``base_gpu_id ..`` of a rollout TP group.

    Args:
        model_path: local HF checkpoint (config, tokenizer, weights: the weights are loaded on CPU
            once and pushed through ``update_weights`` at version 0).
        dtype: SGLang ``dtype``. max_batch_size: most responses of one ``Engine.generate`` call.
        attn_implementation: the transformers setting the worker passes every engine; only its
            default ``sdpa`` is accepted (SGLang picks its own attention backends: give
            ``engine_kwargs={"attention_backend": ...}``).
        tp_size, base_gpu_id, mem_fraction_static: SGLang's (``mem_fraction_static`` from the
            residency plan: ``sglang_memory.mem_fraction_static``).
        weights_cpu_backup: SGLang keeps a host copy of released weights; without it a weight
            release invalidates the weights until the next ``update_weights``/``sync``.
        bucket_bytes: most bytes (per rank) of one ``update_weights_from_tensor`` call.
        weight_format: how full HF weights (``update_weights``, mapped trainer weights) travel:
            ``direct`` (default): each rank gets its shard in SGLang's names, one
            ``LocalSerializedTensor`` per parameter, copied in by name (strict); or
            ``flattened_bucket``: each rank gets the full HF tensors of a bucket flattened into one
            ``FlattenedTensorBucket`` (one IPC handle per bucket and rank) and SGLang's
            ``load_weights`` shards them (names checked here first, ``check_full_tensors``); costs
            ``tp_size`` full copies of a bucket on the devices.
        original_logprobs: report SGLang's original log-probs, ``log_softmax(logits)``
            (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, ``srt/layers/sampler.py``) instead of the
            ``Response`` contract's ``log_softmax(logits / temperature)``, which is what the built-in
            engine reports and the trainer recomputes (``rollout_logprob_diff`` compares the two).
            They differ only when the temperature is neither 0 nor 1. Default False.
        engine_kwargs: further ``ServerArgs`` fields. engine, wrap, meta_cls: a started engine and
            the ``LocalSerializedTensor`` / ``FlattenedTensorMetadata`` constructors to use instead
            of launching SGLang (tests).

    Raises:
        MissingExtraError / ValueError: as ``check_available``; an unknown ``weight_format``.
    """

    check_available = staticmethod(check_available)
    supports_tensor_parallel = True  # one engine over the tp_size GPUs of a rollout TP group

    def __init__(self, model_path: str, dtype: str = "bfloat16", attn_implementation: str = "sdpa",
                 max_batch_size: int = 256, *, tp_size: int = 1, base_gpu_id: int = 0,
                 mem_fraction_static: float = 0.5, weights_cpu_backup: bool = False,
                 bucket_bytes: int = 512 * 1024**2, weight_format: str = LOAD_FORMAT,
                 original_logprobs: bool = False, engine_kwargs: Optional[dict] = None,
                 engine: Any = None, wrap: Optional[Callable[[list[bytes]], Any]] = None,
                 meta_cls: Optional[Callable[..., Any]] = None):
        from rollplex_train.config import ModelConfig
        from rollplex_train.models.arch import load_hf_config, meta_model
        from rollplex_train.models.layouts import Dims
        from rollplex_train.models.loading import load_model, load_tokenizer

        if weight_format not in (LOAD_FORMAT, FLATTENED_LOAD_FORMAT):
            raise ValueError(f"weight_format={weight_format!r}: expected {LOAD_FORMAT!r} or {FLATTENED_LOAD_FORMAT!r}")
        if attn_implementation != "sdpa":
            raise ValueError(f"model.attn_implementation={attn_implementation!r} is a transformers setting the SGLang "
                             "engine cannot honour; leave it at 'sdpa' (SGLang picks its attention backend)")
        if engine is None:
            check_available()
        self.weight_format = weight_format
        self.tp_size, self.base_gpu_id, self.max_batch_size = tp_size, base_gpu_id, max_batch_size
        self.weights_cpu_backup, self.bucket_bytes = weights_cpu_backup, bucket_bytes
        self.original_logprobs = original_logprobs
        self.tokenizer = load_tokenizer(model_path)
        hf_config = load_hf_config(ModelConfig(path=model_path))
        self._meta = meta_model(hf_config)  # names, shapes and get_rope_index; no storage
        shapes = {n: tuple(p.shape) for n, p in self._meta.named_parameters()}
        self.layout = sglang_layout(shapes, Dims.from_hf_config(hf_config), tp_size)
        self.expected = [expected_params(self.layout, r) for r in range(tp_size)]
        cfg = self._meta.config
        self.suppressed_ids = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
        self.placeholders = (cfg.image_token_id, cfg.video_token_id, cfg.vision_config.spatial_merge_size)
        self.eos_ids = self._eos_ids(model_path)
        self.weights_version = 0
        self._released: set[str] = set()
        self._valid = False  # SGLang holds weights of ``weights_version`` (False until pushed)
        self._updating = False
        self._shared = None
        self._wrap, self._meta_cls = wrap, meta_cls
        self.engine = engine if engine is not None else self._launch(model_path, dtype, mem_fraction_static,
                                                                     dict(engine_kwargs or {}))
        if engine is None:  # the checkpoint's weights, through the checked path, as version 0
            weights = load_model(model_path, dtype="float32")
            self._push({n: p.detach() for n, p in weights.named_parameters()}, 0)
            del weights

    def _launch(self, model_path: str, dtype: str, mem_fraction_static: float, extra: dict):
        import sglang  # the 'sglang' extra (checked in __init__)
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        self._wrap = self._wrap or (lambda values: LocalSerializedTensor(values=values))
        self._meta_cls = self._meta_cls or FlattenedTensorMetadata
        # CUDA IPC handles name the device by UUID, so each scheduler maps them whatever its
        # CUDA_VISIBLE_DEVICES (srt/weight_sync/utils.py::update_weights patches the producer too)
        monkey_patch_torch_reductions()
        # read at import by SGLang's sampler in the scheduler processes, which inherit it
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1" if self.original_logprobs else "0"
        kwargs = dict(model_path=model_path, tp_size=self.tp_size, base_gpu_id=self.base_gpu_id,
                      mem_fraction_static=mem_fraction_static, dtype=dtype, enable_memory_saver=True,
                      enable_weights_cpu_backup=self.weights_cpu_backup, enable_deterministic_inference=True,
                      load_format="dummy", random_seed=0)
        kwargs.update(extra)
        log.info("starting SGLang %s engine: %s", sglang.__version__, kwargs)
        return sglang.Engine(**kwargs)

    def _eos_ids(self, model_path: str) -> set[int]:
        from transformers import GenerationConfig

        ids = {self.tokenizer.eos_token_id}
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        ids.update(eos if isinstance(eos, list) else [eos])
        return {int(i) for i in ids if i is not None}

    # ---- generate ---------------------------------------------------------------------------------
    def _check_ready(self, weights_version: Optional[int]) -> None:
        if self._released & {"weights", "kv_cache"}:
            raise RuntimeError(f"SGLang memory released ({sorted(self._released)}): call resume_memory() before generate()")
        if weights_version is not None:
            check_version(weights_version, self.weights_version, "request", "engine")
        if self._updating or not self._valid:
            raise StaleWeightsError(f"SGLang holds no valid weights of version {self.weights_version} "
                                    f"({'update in progress' if self._updating else 'released or never pushed'})")
        for shared in self._shared or ():
            shared.check(self.weights_version)

    def _rope(self, prompt: PromptSample) -> tuple[torch.Tensor, torch.Tensor]:
        from rollplex_train.models.sequence import rope_positions

        ids = prompt.prompt_ids.view(1, -1)
        positions, delta = rope_positions(self._meta, ids, torch.ones_like(ids), prompt.vision)
        return positions[:, 0], delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: list[PromptSample], params: SamplingParams,
                 weights_version: Optional[int] = None, prefixes: Optional[list] = None) -> list[Response]:
        if prefixes is not None:
            raise ValueError("the SGLang engine prefills every prompt itself: prefixes cannot be handed in")
        self._check_ready(weights_version)
        per_call = max(1, self.max_batch_size // params.n)
        out: list[Response] = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            call = build_generate_call(chunk, params, eos_ids=self.eos_ids, suppressed_ids=self.suppressed_ids,
                                       rope=self._rope, placeholder_ids=self.placeholders, first_prompt=start)
            out += parse_outputs(self.engine.generate(**call.kwargs()), call, self._decode)
        self._check_ready(weights_version)  # nothing replaced the weights meanwhile
        return out

    # ---- weights ----------------------------------------------------------------------------------
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Push full HF weights (the ``sharing.enabled=false`` path): sharded per TP rank into
        SGLang's names and shapes, moved to each rank's GPU, loaded as CUDA IPC handles.

        Raises:
            StaleWeightsError: ``version`` is not newer. ValueError: names/shapes do not match.
            RuntimeError: SGLang refused a call (its message quoted).
        """
        if self._shared is not None:
            raise RuntimeError("weights are mapped from the trainer: use sync_shared_weights")
        check_newer(version, self.weights_version, "update_weights")
        self._push(named_tensors, version)

    def _to_rank(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """On TP rank ``rank``'s GPU (CUDA IPC handles); on the CPU where there is none (tests)."""
        device = torch.device("cuda", self.base_gpu_id + rank) if torch.cuda.is_available() else tensor.device
        return tensor.to(device, non_blocking=True).contiguous()

    def _push(self, full: dict[str, torch.Tensor], version: int) -> None:
        if self.weight_format == FLATTENED_LOAD_FORMAT:
            return self._push_flattened(full, version)
        per_rank = []
        for rank in range(self.tp_size):
            tensors = shard_state_dict(full, self.layout, rank)
            check_rank_tensors(tensors, self.expected[rank], rank)  # before SGLang sees anything
            per_rank.append({n: self._to_rank(t, rank) for n, t in tensors.items()})
        self.push_rank_tensors(per_rank, version)

    def _push_flattened(self, full: dict[str, torch.Tensor], version: int) -> None:
        names = check_full_tensors(full, self.layout)  # before SGLang sees anything

        def calls():
            for bucket in buckets([{n: full[n] for n in names}], self.bucket_bytes):
                flats, payloads = [], []  # flats stay referenced until SGLang has loaded them
                for rank in range(self.tp_size):
                    flat, metas = flatten_bucket([(sglang_name(n), self._to_rank(full[n], rank)) for n in bucket])
                    flats.append(flat)
                    payloads.append(serialize({"flattened_tensor": flat,
                                               "metadata": [self._meta_cls(**m) for m in metas]}))
                yield payloads, FLATTENED_LOAD_FORMAT

        self._run_update(calls(), version)

    def push_rank_tensors(self, per_rank: list[dict[str, torch.Tensor]], version: int) -> None:
        """Load per-rank tensors already in SGLang's layout (``sglang_weights.shard_from_plan`` on
        each rank's device: views of the training shards) and set ``version``: one
        ``begin_weight_update`` / ``update_weights_from_tensor(load_format="direct")`` per bucket /
        ``end_weight_update``, then ``flush_cache`` (the radix cache holds KV of the old weights).

        Raises:
            ValueError: a rank's tensors do not match SGLang's parameters. RuntimeError: SGLang
            refused a call; the weights are then invalid until a later update succeeds.
        """
        if len(per_rank) != self.tp_size:
            raise ValueError(f"{len(per_rank)} rank payloads for an engine of TP {self.tp_size}")
        for rank, tensors in enumerate(per_rank):
            check_rank_tensors(tensors, self.expected[rank], rank)
        calls = ((named, LOAD_FORMAT) for named in build_update_calls(per_rank, self._wrap, self.bucket_bytes))
        self._run_update(calls, version)

    def _run_update(self, calls: Iterable[tuple[Any, str]], version: int) -> None:
        """One weight-update session: begin, ``update_weights_from_tensor(named, load_format)`` per
        call, end (also after a failure), ``flush_cache``; then the engine holds ``version``."""
        if self._released & {"weights"}:
            raise RuntimeError("SGLang weights are released: resume_memory(['weights']) before updating them")
        self._updating, self._valid = True, False
        _ok(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for named, load_format in calls:
                _ok(self.engine.update_weights_from_tensor(named, load_format=load_format, flush_cache=False),
                    "update_weights_from_tensor")
        finally:
            _ok(self.engine.end_weight_update(), "end_weight_update")
            self._updating = False
        _ok(self.engine.flush_cache(), "flush_cache")
        self.weights_version, self._valid = version, True

    def map_shared_weights(self, payload: bytes | list[bytes]) -> int:
        """Map the trainer's exported weights and push them at the published version.

        Args:
            payload: at TP 1, one export of the HF tensors (the train rank on the engine's device,
                ``rollout_kind="hf"``); at TP r > 1, the r exports of the group's devices in rank
                order, each that rank's ``sglang``-layout tensors (``rollout_kind="sglang"``: views
                of its training shards and rebuilt ``[q;k;v]``), which go to that rank unsharded.

        Returns:
            the bytes mapped (every rank's tensors). SGLang owns its parameters, so each push copies
            them into SGLang's (``sync_shared_weights`` returns those bytes).

        Raises:
            RuntimeError: already mapped. ValueError: r payloads for an engine of another TP
            degree, or tensors that do not match SGLang's parameters. StaleWeightsError: the
            trainer is writing them.
        """
        from rollplex_train.sharing.ipc import import_handles

        if self._shared is not None:
            raise RuntimeError("shared weights are already mapped")
        payloads = payload if isinstance(payload, list) else [payload]
        if len(payloads) > 1 and len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} rank exports for an SGLang engine of TP {self.tp_size}")
        shared = [import_handles(p) for p in payloads]
        version = shared[0].version.read()
        for s in shared:
            s.check(version)
        self._shared = shared
        return self._push_shared(version)

    def _push_shared(self, version: int) -> int:
        """Push the mapped tensors as ``version``; returns the bytes pushed (copied into SGLang)."""
        if len(self._shared) == 1:  # the HF tensors, sharded here
            self._push(self._shared[0].tensors, version)
        else:
            self.push_rank_tensors([{sglang_name(n): self._to_rank(t, k) for n, t in s.tensors.items()}
                                    for k, s in enumerate(self._shared)], version)
        return sum(t.numel() * t.element_size() for s in self._shared for t in s.tensors.values())

    def sync_shared_weights(self, version: int) -> int:
        """Push the mapped tensors at the trainer's newly published ``version``; returns the bytes
        copied into SGLang's parameters.

        Raises:
            RuntimeError: nothing mapped. StaleWeightsError: ``version`` not newer, or a rank's shared
            counter is not at it.
        """
        from rollplex_train.sharing.ipc import check_sync

        if self._shared is None:
            raise RuntimeError("sync_shared_weights before map_shared_weights")
        for s in self._shared:
            check_sync(s, self.weights_version, version)
        return self._push_shared(version)

    # ---- memory -----------------------------------------------------------------------------------
    def release_memory(self, tags: Optional[Iterable[str]] = None) -> None:
        """Release SGLang memory by tag (all by default); only on an idle engine (between calls)."""
        wanted = set(TAGS if tags is None else tags)
        todo = [t for t in TAGS if t in wanted and t not in self._released]
        if todo:
            _acknowledged(self.engine.release_memory_occupation(tags=todo), "release_memory_occupation")
            self._released.update(todo)
            if "weights" in todo and not self.weights_cpu_backup:
                self._valid = False

    def resume_memory(self, tags: Optional[Iterable[str]] = None) -> None:
        """Resume released tags (all by default), weights first. Weights released without a CPU
        backup are pushed again from the mapped trainer weights when there are some (else the next
        ``update_weights`` must come before ``generate``)."""
        wanted = set(TAGS if tags is None else tags)
        todo = [t for t in TAGS if t in wanted and t in self._released]
        if todo:
            _acknowledged(self.engine.resume_memory_occupation(tags=todo), "resume_memory_occupation")
            self._released.difference_update(todo)
        if "weights" in todo and not self._valid and self._shared is not None:
            self._push_shared(self.weights_version)

    def apply_residency(self, plan, phase: str) -> tuple[list[str], list[str]]:
        """Enter ``phase`` of a ``memory.residency.ResidencyPlan``: release the tags whose groups are
        not resident in it, resume those that are (``sglang_memory.phase_transition``); returns
        ``(released, resumed)``."""
        release, resume = phase_transition(plan, phase, set(self._released))
        self.release_memory(release)
        self.resume_memory(resume)
        return release, resume

    def shutdown(self) -> None:
        self.engine.shutdown()  # blocks until the schedulers released their GPU contexts

