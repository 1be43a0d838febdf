"""The built-in rollout engine: batched sampling over a preallocated KV cache (``rollout/kv_cache.py``).

Per request: each of the P prompts is prefilled once (``models/prefix.encode_prefix``, the training
side's prefix pass, vision encoded once per prompt; or its KV cache is handed in, already encoded by
the actor from the same weights), the caches are left-padded into one batch and repeated ``n``
times along the batch (the n responses of a prompt share its prefill, as SGLang's radix cache
does), then tokens are decoded for all live sequences together. Finished
sequences are dropped from the cache, so the decode batch shrinks along the long tail.

Sampling follows the usual order: logits / temperature -> top-k -> top-p -> a draw by inverse CDF
with one seeded ``torch.Generator`` per sequence, seeded from (request seed, prompt uid, sample
index): a sequence's tokens do not depend on which other prompts share its batch or its rollout
engine, so data-parallel rollout over any number of engines samples what one engine would (the
per-request ``seed`` of SGLang/vLLM sampling parameters, per sequence). The returned log-prob of a token is taken from ``log_softmax(logits /
temperature)`` before truncation, the distribution the actor recomputes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Iterator, Optional

import torch

from rollplex_train.data.types import DecodeProgress, PromptSample, Response
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.hf_compat import cache_kwargs
from rollplex_train.models.prefix import PrefixState, encode_prefix
from rollplex_train.models.sequence import pad_prompts
from rollplex_train.device import compute_context, model_device
from rollplex_train.rollout.base import RolloutEngine, SamplingParams, register_rollout_engine
from rollplex_train.versioning import StaleWeightsError, check_newer, check_version
from rollplex_train.rollout.decoder import FusedDecoder
from rollplex_train.rollout.sampling import draw, filter_logits, sequence_generator  # noqa: F401 (re-exported)
from rollplex_train.rollout.kv_cache import PreallocatedCache, cache_nbytes
from rollplex_train.rollout.shared_prefix import SharedPromptCache
from rollplex_train.rollout.tensor_parallel import RankWeights, TPGroup, shard_prefix_kv

log = logging.getLogger(__name__)


@register_rollout_engine("builtin")
class BuiltinRolloutEngine(RolloutEngine):
    """transformers-based engine; one instance lives in its own Ray actor process.

    Args:
        model_path: local HF checkpoint directory.
        dtype: parameter dtype name. attn_implementation: ``sdpa`` or ``eager``.
        max_batch_size: most sequences decoded together (requests are split into chunks of prompts).
        device: where the model runs (a torch device; None: where ``load_model`` puts it).
        compute_dtype: forward precision, ``float32`` or ``bfloat16`` (autocast; ``device.py``).
        device_share: ``cluster.device_share``; with ``streams``/``green`` on a GPU the decode work
            runs on a CUDA stream of its own (``device_share.py``), entered on the first decode.
        decode_sms: SMs of the decode side's green context (``green`` only).
        tp: this process's rank of the engine's tensor-parallel group (``rollout/tensor_parallel.py``;
            None: one device). At r > 1 the rank keeps only its tensors of the ``sglang`` layout,
            cut from the checkpoint; every rank of the group must get the same calls.
        share_prompt_kv: decode the n samples of a prompt over one copy of its KV cache
            (``rollout/shared_prefix.py``; needs the fused decode step).

    Sampling generators stay on CPU on every device, so a sequence's draws do not depend on it.

    Raises:
        ValueError: ``share_prompt_kv`` where the fused decode step does not run; a TP degree the
            model's heads or widths do not divide.
    """

    def __init__(self, model_path: str, dtype: str = "float32", attn_implementation: str = "sdpa",
                 max_batch_size: int = 256, device=None, compute_dtype: str = "float32",
                 device_share: str = "cores", decode_sms: Optional[int] = None, tp: Optional[TPGroup] = None,
                 share_prompt_kv: bool = False):
        self.model = load_model(model_path, dtype, attn_implementation)
        self.tp = tp if tp is not None else TPGroup()
        self.rank_weights = RankWeights(self.model, self.tp)  # bound once the model runs on rank tensors
        if self.tp.size > 1:  # this rank's tensors cut from the checkpoint, the full model dropped
            nbytes = self.rank_weights.bind_copy_of(dict(self.model.named_parameters()), device)
            log.info("rollout TP rank %d of %d: %.1f MB of sglang-layout tensors", self.tp.rank, self.tp.size,
                     nbytes / 1e6)
        if device is not None:
            self.model.to(device)
        self.device = model_device(self.model)
        self.compute_dtype = compute_dtype
        self.device_share, self.decode_sms = device_share, decode_sms
        self._side = None  # device_share.SideStream of the decode thread, once entered
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(model_path)
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        cfg = self.model.config
        # Vision placeholders can never be part of a valid response (they would be taken for image
        # slots when the response is scored), so they are never sampled.
        self.suppressed_ids = torch.tensor(sorted({
            cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
        }), dtype=torch.long, device=self.device)
        self.weights_version = 0
        self._released = False
        self._shared = None  # sharing.ipc.SharedWeights once map_shared_weights ran
        self.fused_decode_unsupported = FusedDecoder.unsupported(self.model, self.device, compute_dtype)
        if self.fused_decode_unsupported:
            if share_prompt_kv:
                raise ValueError(f"rollout.share_prompt_kv=true needs the fused decode step, which does not run "
                                 f"here: {self.fused_decode_unsupported}")
            log.info("decode steps run transformers' forward (%s)", self.fused_decode_unsupported)
        self.share_prompt_kv = share_prompt_kv
        self.kv_cache_bytes = 0  # bytes of the decode KV cache of the last request's largest chunk
        self.kv_cache_peak_bytes = 0  # the largest since memory_bytes() last read it
        self._released_tags: set[str] = set()
        self._weights_offload = None  # memory.offload.StorageOffload once the weights were released

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        ids.add(self.tokenizer.eos_token_id)
        return {i for i in ids if i is not None}

    # ---- protocol -------------------------------------------------------------------------------
    def generate(self, prompts: list[PromptSample], params: SamplingParams,
                 weights_version: Optional[int] = None, prefixes: Optional[list] = None) -> list[Response]:
        finished = self.generate_stream(prompts, params, weights_version, prefixes)
        return sorted((r for item in finished for r in item), key=lambda r: r.prompt_index)  # stable

    supports_progress = True
    accepts_prefix_states = True  # decodes from the actor's prefix KV caches (_prefill)
    supports_tensor_parallel = True  # rank k of an engine on its k-th device (rollout/tensor_parallel.py)

    @staticmethod
    def check_config(cfg) -> None:
        """The settings of a run ``Config`` this engine cannot honour (asked by ``resolve.resolve``
        before Ray starts).

        Raises:
            ValueError: at ``rollout.tensor_parallel_size > 1``, ``sharing.split_qkv`` or
                ``split_gate_up`` (the TP ranks run SGLang's fused ``qkv_proj``/``gate_up_proj``), or
                engine devices that do not lie in one training replica.
        """
        a, r = cfg.actor, cfg.rollout
        if r.tensor_parallel_size == 1:
            return
        if cfg.sharing.split_qkv or cfg.sharing.split_gate_up:
            raise ValueError("sharing.split_qkv/split_gate_up: the builtin rollout engine at "
                             f"rollout.tensor_parallel_size={r.tensor_parallel_size} runs SGLang's fused "
                             "qkv_proj and gate_up_proj (set both false)")
        replica = a.tensor_parallel_size * a.pipeline_parallel_size
        if replica % r.tensor_parallel_size:  # its ranks then take the same calls in the same order
            raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the builtin engine's devices must "
                             f"lie in one training replica (actor.tensor_parallel_size x pipeline_parallel_size = "
                             f"{replica}), so that it decodes one DP rank's prompts per call")

    def generate_stream(self, prompts: list[PromptSample], params: SamplingParams,
                        weights_version: Optional[int] = None, prefixes: Optional[list] = None,
                        progress_every: int = 0) -> Iterator[list]:
        if self._released:
            raise RuntimeError("rollout engine memory is released: call resume_memory() before generate()")
        if weights_version is not None:
            check_version(weights_version, self.weights_version, "request", "engine")
        if self._shared is not None:  # the trainer's own tensors: refuse them stale or mid-update
            self._shared.check(self.weights_version)
        if progress_every and not params.ignore_eos:
            raise ValueError(f"progress_every={progress_every} needs ignore_eos (responses of one length)")
        self._decode_stats = {}
        self.kv_cache_bytes = 0
        per_chunk = max(1, self.max_batch_size // params.n)
        for start in range(0, len(prompts), per_chunk):
            chunk = prompts[start : start + per_chunk]
            gens = [sequence_generator(params.seed, p.uid, k) for p in chunk for k in range(params.n)]
            given = None if prefixes is None else prefixes[start : start + per_chunk]
            for finished in self._generate_chunk(chunk, params, gens, given, progress_every):
                for r in finished:
                    r.prompt_index += start
                yield finished
        if self._shared is not None:  # nothing wrote the weights while we decoded
            self._shared.check(self.weights_version)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights in: the full HF state dict, or this rank's ``sglang``-layout tensors
        (``RankLayout``; any TP degree, r = 1 included). Checked before anything is copied.

        Raises:
            RuntimeError: the engine runs on the trainer's shared tensors. StaleWeightsError: an old
                ``version``. ValueError: names or shapes that match neither.
        """
        if self._shared is not None:
            raise RuntimeError("the weights are the trainer's shared tensors: use sync_shared_weights, "
                               "update_weights would write into the trainer's memory")
        check_newer(version, self.weights_version, "update_weights")
        named_tensors = dict(named_tensors)  # a state dict or an iterator of (name, tensor)
        rank = self.rank_weights
        if rank.tensors is not None:
            rank.load(named_tensors)
        elif rank.matches(named_tensors):  # the first rank-layout update at r = 1: bind a copy
            rank.layout.check(named_tensors, next(iter(self.model.parameters())).dtype)
            rank.bind_copy_of(named_tensors, self.device)
        else:
            self._load_hf_state(named_tensors)
        self.weights_version = version

    def _load_hf_state(self, named_tensors: dict[str, torch.Tensor]) -> None:
        current = self.model.state_dict()
        tied = {k for k in current if k.endswith("lm_head.weight")} if self.model.config.tie_word_embeddings else set()
        missing = sorted(set(current) - set(named_tensors) - tied)
        unexpected = sorted(set(named_tensors) - set(current))
        wrong_shape = sorted(k for k, v in named_tensors.items() if k in current and v.shape != current[k].shape)
        if missing or unexpected or wrong_shape:  # checked before anything is copied
            raise ValueError(f"weight update does not match the model: missing={missing} "
                             f"unexpected={unexpected} wrong_shape={wrong_shape}")
        self.model.load_state_dict(named_tensors, strict=False)

    def map_shared_weights(self, payload) -> int:
        """Point the model at the trainer's tensors, in place (no copy): ``payload`` is an IPC handle
        payload (bytes) from another process or a ``LocalWeights`` in this one (its tensors taken as
        they are). The tensors are the HF parameters (r = 1) or this rank's ``sglang``-layout
        tensors (``RankLayout``: any r, the per-rank dict of ``rollout_tensors("sglang", r)``).

        Returns:
            the bytes of the mapped tensors.

        Raises:
            RuntimeError: already mapped. ValueError: the tensors match neither set.
            StaleWeightsError: the trainer is writing them.
        """
        from rollplex_train.sharing.embedded import LocalWeights, map_parameters
        from rollplex_train.sharing.ipc import import_handles

        if self._shared is not None:
            raise RuntimeError("shared weights are already mapped")
        shared = payload if isinstance(payload, LocalWeights) else import_handles(payload)
        if self.tp.size > 1 or self.rank_weights.matches(shared.tensors):
            nbytes = self.rank_weights.bind(shared.tensors)  # this engine's own copy is freed
        else:
            nbytes = map_parameters(self.model, shared.tensors)
        self._shared = shared
        self.weights_version = shared.version.read()
        shared.check(self.weights_version)  # not mid-update
        return nbytes

    def sync_shared_weights(self, version: int) -> None:
        from rollplex_train.sharing.ipc import check_sync

        check_sync(self._shared, self.weights_version, version)
        self.weights_version = version

    def weights_digest(self) -> dict[str, str]:
        """sha256 per HF parameter, or per rank tensor once the model runs on rank tensors."""
        from rollplex_train.sharing.embedded import tensors_digest, weights_digest

        bound = self.rank_weights.tensors
        return weights_digest(self.model) if bound is None else tensors_digest(bound)

    MEMORY_TAGS = ("kv_cache", "weights")

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> int:
        """``weights``: this engine's own weights go to host memory (``memory.offload.StorageOffload``:
        the storages are emptied in place, so the TP rank's q/k/v and gate/up views stay views);
        weights mapped from the trainer are the trainer's and stay. ``kv_cache``: the KV cache lives
        only inside a request, so between requests there is none to free. The released tags are
        recorded and ``generate`` refuses to run until they are resumed.

        Returns:
            the bytes moved to host memory.

        Raises:
            ValueError: an unknown tag.
        """
        unknown = set(tags) - set(self.MEMORY_TAGS)
        if unknown:
            raise ValueError(f"release_memory tags {sorted(unknown)}: expected some of {list(self.MEMORY_TAGS)}")
        moved = 0
        if "weights" in tags and self._shared is None:
            if self._weights_offload is None:
                from rollplex_train.memory.offload import StorageOffload

                self._weights_offload = StorageOffload(self.model.parameters())
            moved = self._weights_offload.offload()
        self._released_tags = self._released_tags | set(tags)
        self._released = bool(self._released_tags)
        return moved

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> int:
        """Bring back what :meth:`release_memory` moved; returns the bytes."""
        moved = self._weights_offload.onload() if "weights" in tags and self._weights_offload is not None else 0
        self._released_tags = self._released_tags - set(tags)
        self._released = bool(self._released_tags)
        return moved

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes of the residency groups (``memory/groups.py``) this engine holds:
        ``rollout_weights`` (its own weights; 0 when they are the trainer's) and ``rollout_kv`` (the
        largest decode KV cache since the last call, ``rollout/kv_cache.cache_nbytes``)."""
        from rollplex_train.memory.measure import live_tensor_bytes

        kv, self.kv_cache_peak_bytes = self.kv_cache_peak_bytes, 0
        own = 0 if self._shared is not None else live_tensor_bytes(self.model.parameters())
        return {"rollout_weights": own, "rollout_kv": kv}

    # ---- decode ---------------------------------------------------------------------------------
    def _account(self, since: float, steps: int) -> float:
        """Charge the time since ``since`` and ``steps`` decode steps to the current thread count,
        then apply a pending share change (``set_compute_share``); returns the new tick."""
        now = time.perf_counter()
        threads = torch.get_num_threads()
        seconds, done = self._decode_stats.get(threads, (0.0, 0))
        self._decode_stats[threads] = (seconds + now - since, done + steps)
        target = getattr(self, "_compute_share", None)
        if target and target != threads:
            torch.set_num_threads(target)
        return time.perf_counter()

    def _prefill(self, prompts: list[PromptSample], prefixes: Optional[list[Optional[PrefixState]]]
                 ) -> list[PrefixState]:
        """Each prompt's KV cache under this engine's weights: the given prefix state (the actor's,
        encoded by the train worker from the same weights) or this engine's own ``encode_prefix`` of
        the prompt alone. Both are the same function of (weights, prompt), so the decode does not
        depend on which one it got.

        Raises:
            StaleWeightsError: a given state was encoded under another weights version.
        """
        states = []
        for i, prompt in enumerate(prompts):
            given = prefixes[i] if prefixes is not None else None
            if given is None:
                with compute_context(self.device, self.compute_dtype):
                    given, = encode_prefix(self.model, [prompt], version=self.weights_version)
            elif given.uid != prompt.uid:
                raise StaleWeightsError(f"prefix of {given.uid!r} handed in for prompt {prompt.uid!r}")
            else:
                check_version(given.version, self.weights_version, f"prefix of {given.uid!r}", "engine")
                if self.tp.size > 1:  # a whole-model cache (the actor's): this rank's KV heads
                    heads = self.rank_weights.layout.kv_heads(self.model.config.get_text_config().num_key_value_heads)
                    given = replace(given, keys=shard_prefix_kv(given.keys, heads),
                                    values=shard_prefix_kv(given.values, heads))
            states.append(given)
        return states

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[PromptSample], params: SamplingParams,
                        gens: list[torch.Generator], prefixes: Optional[list[Optional[PrefixState]]] = None,
                        progress_every: int = 0) -> Iterator[list]:
        """Decode ``prompts`` together; after a decode step that finished some groups, yield the
        responses of those groups (all n of each), and when decoding ends, those of all the rest.
        With ``progress_every``, every that many steps (not after the last) also one
        ``DecodeProgress`` per group still decoding.

        The prompts are prefilled one by one (``_prefill``), each exactly as the training side's
        prefix pass encodes it, and their caches left-padded into one batch."""
        model, n, dev = self.model, params.n, self.device
        if self._side is None and self.device_share in ("streams", "green"):
            from rollplex_train.device_share import enter_side

            self._side = enter_side(self.device_share, dev, self.decode_sms)
        tick = self._account(time.perf_counter(), 0)  # applies a pending share change
        states = self._prefill(prompts, prefixes)
        _, mask = pad_prompts(prompts, self.pad_id, side="left")
        mask = mask.to(dev)
        keys, values = [s.keys for s in states], [s.values for s in states]
        if self.share_prompt_kv:  # one copy of a prompt's KV for its n samples
            cache = SharedPromptCache(keys, values, mask, n, capacity=params.max_new_tokens)
        else:  # the prompt's KV repeated n times
            cache = PreallocatedCache.left_padded(keys, values, capacity=mask.shape[1] + params.max_new_tokens)
            cache.batch_repeat_interleave(n)
        self.kv_cache_bytes = max(self.kv_cache_bytes, cache_nbytes(cache))
        self.kv_cache_peak_bytes = max(self.kv_cache_peak_bytes, self.kv_cache_bytes)
        last_hidden = torch.stack([s.last_hidden for s in states])  # (P, H)
        deltas = torch.tensor([[s.next_position - s.prompt_length] for s in states], device=dev)
        last_hidden = last_hidden.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        deltas = deltas.repeat_interleave(n, dim=0)
        num_real = mask.sum(-1)  # (B,) real tokens so far = index of the next token
        batch = last_hidden.shape[0]
        alive = torch.arange(batch)  # row -> original sequence index
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logps: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        stop_strings = tuple(params.stop)
        left = [n] * len(prompts)  # unfinished responses per group

        def group(index: int) -> list[Response]:
            left[index] = -1  # yielded
            return [Response(prompt_index=index, token_ids=torch.tensor(tokens[seq], dtype=torch.long),
                             logprobs=torch.tensor(logps[seq], dtype=torch.float32),
                             text=self.tokenizer.decode(tokens[seq], skip_special_tokens=True),
                             finish_reason=finish[seq])
                    for seq in range(index * n, (index + 1) * n)]

        # this request's weights, q/k/v and gate/up fused (rollout/decoder.py: bitwise the same forward)
        decoder = None if self.fused_decode_unsupported else FusedDecoder(model)
        tick = self._account(tick, 1)  # the prefill is charged as the first step
        for step in range(params.max_new_tokens):
            with compute_context(dev, self.compute_dtype):
                logits = model.lm_head(last_hidden).float()
            allowed = logits.index_fill(-1, self.suppressed_ids, float("-inf"))
            if params.temperature > 0:
                scaled = logits / params.temperature
                logp_all = torch.log_softmax(scaled, dim=-1)
                probs = filter_logits(allowed / params.temperature, params.top_k, params.top_p).softmax(-1)
                next_tok = draw(probs, [gens[seq] for seq in alive.tolist()])
            else:
                logp_all = torch.log_softmax(logits, dim=-1)
                next_tok = allowed.argmax(-1)
            next_logp = logp_all.gather(-1, next_tok.unsqueeze(-1)).squeeze(-1)
            keep = []
            step_toks, step_logps = next_tok.tolist(), next_logp.tolist()  # one device sync per step
            for row, seq in enumerate(alive.tolist()):
                tok = step_toks[row]
                tokens[seq].append(tok)
                logps[seq].append(step_logps[row])
                done = False
                if not params.ignore_eos and tok in self.eos_ids:
                    done = True
                elif stop_strings:
                    tail = self.tokenizer.decode(tokens[seq][-16:], skip_special_tokens=True)
                    done = any(tail.endswith(s) for s in stop_strings)
                if done:
                    finish[seq] = "stop"
                    left[seq // n] -= 1
                else:
                    keep.append(row)
            if not keep or step == params.max_new_tokens - 1:
                break
            finished = [g for g, count in enumerate(left) if count == 0]
            if finished:
                yield [r for index in finished for r in group(index)]
            if progress_every and (step + 1) % progress_every == 0:
                yield [DecodeProgress(g, torch.tensor(tokens[g * n:(g + 1) * n], dtype=torch.long))
                       for g, count in enumerate(left) if count > 0]
            if len(keep) < len(alive):
                sel = torch.tensor(keep, dtype=torch.long)
                alive = alive[sel]
                sel = sel.to(dev)
                cache.batch_select_indices(sel)
                next_tok, mask = next_tok[sel], mask[sel]
                num_real, deltas = num_real[sel], deltas[sel]
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=torch.long, device=dev)], dim=1)
            pos = (num_real.view(-1, 1) + deltas).view(1, -1, 1).expand(3, -1, -1)
            if decoder is not None:
                last_hidden = decoder.step(next_tok, mask, pos, cache)
            else:
                with compute_context(dev, self.compute_dtype):
                    out = model.model(input_ids=next_tok.view(-1, 1), attention_mask=mask, position_ids=pos,
                                      use_cache=True, **cache_kwargs(model.model, cache))
                last_hidden = out.last_hidden_state[:, -1]
            num_real = num_real + 1
            tick = self._account(tick, 1)

        yield [r for index in range(len(prompts)) if left[index] >= 0 for r in group(index)]
