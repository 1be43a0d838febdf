"""Worker groups: the train ranks and the rollout engines of the run, split / fan out / gather.

``TrainGroup`` owns one TrainWorker per device (training rank ``d`` on device ``d``); a DP rank's
batch goes to every rank of its DP index (the TP/PP ranks of one model replica) and results are
read from the replica's first rank. ``RolloutGroup`` owns one RolloutWorker per rollout engine
(engine ``e`` spans devices ``e * rollout_tp ..``). A group's prompts go to the engines on the
devices of the DP rank that will train on it. Calls return ``runtime.protocol.Pending`` results,
so the step reads the same on Ray and in one process (slime ``ray/actor_group.py``; verl's
dispatch modes).

Prompt identity: the driver knows a prompt only by its global index in the step (a
``TrainBatch``'s ``group_index``, a ``Response``'s ``prompt_index``, a result's ``groups``). The
workers know a DP rank's prompt list; :class:`StepPrompts` translates between the two, here and
nowhere else.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from rollplex_train.data.types import DecodeProgress, MiniBatchSpec, PromptSample, Response, TrainBatch, gather_rows
from rollplex_train.runtime.protocol import ItemStream, Pending


class StepPrompts:
    """A step's prompts placed on the DP ranks, each rank's list put in the object store once.

    Attributes:
        rank_of_group: (P,) DP rank of each prompt. groups_of_dp: per DP rank, its global prompt
            indices (ascending). refs: per DP rank, its prompt list (an object-store reference on
            Ray, the list itself in process). groups_per_mini_batch: prompts per optimizer step
            (each mini-batch was dealt over the ranks: ``runtime.planner.place_groups``).
    """

    def __init__(self, executor, prompts: list[PromptSample], rank_of_group: list[int], dp_size: int,
                 groups_per_mini_batch: Optional[int] = None):
        self.prompts, self.rank_of_group = prompts, list(rank_of_group)
        self.groups_per_mini_batch = groups_per_mini_batch or len(prompts)
        self.groups_of_dp = [[g for g, r in enumerate(rank_of_group) if r == dp] for dp in range(dp_size)]
        self.refs = [executor.put([prompts[g] for g in groups]) for groups in self.groups_of_dp]

    def local(self, dp: int, global_indices: list[int]) -> list[int]:
        """Positions of ``global_indices`` in DP rank ``dp``'s list."""
        where = {g: i for i, g in enumerate(self.groups_of_dp[dp])}
        return [where[g] for g in global_indices]

    @property
    def first_mini_batch(self) -> list[int]:
        """The global prompt indices of the first optimizer step (it runs on the rollout's weights)."""
        return list(range(min(self.groups_per_mini_batch, len(self.prompts))))

    def owned(self, groups: list[int]) -> list[tuple[int, list[int]]]:
        """``[(dp, its global prompt indices among groups)]`` for the DP ranks owning some of them."""
        wanted = set(groups)
        return [(dp, [g for g in mine if g in wanted]) for dp, mine in enumerate(self.groups_of_dp)
                if any(g in wanted for g in mine)]

    def part(self, batch: TrainBatch, dp: int, groups: list[int]) -> TrainBatch:
        """The rows of ``groups`` (global prompt indices, all owned by ``dp``) of ``batch`` (a batch
        over the step's prompts, ``group_index`` global) as DP rank ``dp`` reads them: its prompt
        list by reference, ``group_index`` local to it, ``source_rows`` the rows in ``batch``."""
        rows = batch.rows_of(groups)
        part = batch.at_rows(rows)
        return replace(part, prompts=self.refs[dp], source_rows=rows,
                       group_index=torch.tensor(self.local(dp, part.group_index.tolist()), dtype=torch.long))

    def update_part(self, batch: TrainBatch, dp: int, whole: list[MiniBatchSpec]) -> TrainBatch:
        """DP rank ``dp``'s part of the step's ``batch`` for the update: all its groups (``part``)
        and one ``MiniBatchSpec`` per global mini-batch of ``whole`` (``TrainBatch.plan_mini_batches``)
        with the global token/sequence counts and its own groups' local indices, so that every rank
        takes the same optimizer steps and normalises its losses over the whole mini-batch."""
        mine = self.groups_of_dp[dp]
        local = {g: i for i, g in enumerate(mine)}
        specs = [MiniBatchSpec(tuple(local[g] for g in s.groups if g in local), s.num_tokens, s.num_seqs) for s in whole]
        return replace(self.part(batch, dp, mine), mini_batches=specs)


class TrainGroup:
    """The training ranks.

    Args:
        executor: ``RayExecutor`` or ``InProcessExecutor``. handles: (world,) worker per rank.
        layout: the run's ParallelLayout.
    """

    def __init__(self, executor, handles: list, layout):
        self.ex, self.handles, self.layout = executor, handles, layout
        self.leaders = layout.dp_leaders()

    @property
    def dp_size(self) -> int:
        return self.layout.train_dp

    def place(self, prompts: list[PromptSample], rank_of_group: list[int],
              groups_per_mini_batch: Optional[int] = None) -> StepPrompts:
        """The step's prompts on their DP ranks, each rank's list put in the object store once."""
        return StepPrompts(self.ex, prompts, rank_of_group, self.dp_size, groups_per_mini_batch)

    def _replica(self, dp: int) -> list[int]:
        """The ranks of DP index ``dp`` (one model replica)."""
        return [r for r in range(self.layout.world_size) if self.layout.train_coords(r).dp == dp]

    def _all(self, method: str, *args, combine=None) -> Pending:
        """Call ``method(*args)`` on every rank; ``combine`` gets all results in rank order
        (default: rank 0's)."""
        futures = [self.ex.call(h, method, *args) for h in self.handles]
        return Pending(futures, combine or (lambda values: values[0]))

    # ---- step work (global prompt indices in, global prompt indices out) ----------------------
    def log_probs(self, batch: TrainBatch, step: StepPrompts, groups: list[int], role: str,
                          temperature: float) -> Pending:
        """(N, R) float32 log-probs under ``role`` of the rows of ``groups`` (global prompt indices)
        of ``batch`` (``group_index`` global), each group scored on the DP rank that owns it; the
        other rows stay 0."""
        owned = step.owned(groups)
        parts = [step.part(batch, dp, mine) for dp, mine in owned]
        return self._on_owners(owned, "compute_log_probs", lambda k, dp, mine, leader: (parts[k], role, temperature),
                               lambda outs, _: gather_rows(parts, outs, batch.num_responses, complete=False))

    def update_actor(self, batch: TrainBatch, step: StepPrompts, temperature: float, old_from_actor: bool) -> Pending:
        """One PPO update over the whole step's batch, cut into DP parts (whole groups, global
        mini-batch counts; gradients summed over DP in the engines); metrics of the first replica
        (loss metrics are already global sums there). ``old_from_actor``: the first mini-batch's
        old log-probs are the actor's forward (``runtime/old_policy.reuse_actor_forward``)."""
        whole = batch.plan_mini_batches(step.groups_per_mini_batch)
        parts = [step.update_part(batch, dp, whole) for dp in range(self.dp_size)]
        every = list(enumerate(step.groups_of_dp))  # a rank without groups still joins the gradient sum
        return self._on_owners(every, "update_actor", lambda k, dp, mine, leader: (parts[k], temperature, old_from_actor),
                               lambda outs, _: outs[0])

    def precompute_prefixes(self, step: StepPrompts, groups: list[int], roles: list[str], version: int,
                            export: bool = False) -> Pending:
        """Prefix tasks for the global prompt indices ``groups``, each on the DP rank that owns it
        (ranks with none are skipped); result: one ``PrefixResult`` per such rank, its ``groups``
        set (with ``export``, ``states`` in ``groups`` order)."""
        return self._on_owners(step.owned(groups), "precompute_prefixes", lambda k, dp, mine, leader: (
            step.refs[dp], roles, version, step.local(dp, mine), export and leader),
            lambda outs, owned: [replace(r, dp=dp, groups=mine) for r, (dp, mine) in zip(outs, owned)])

    def score_suffix_chunks(self, step: StepPrompts, role: str, tokens: dict, width: int, version: int,
                            final: bool = False) -> Pending:
        """Suffix chunks of the global prompt indices in ``tokens`` (-> (n, t) tokens decoded so
        far), each on the DP rank that owns it; result: one ``ChunkResult`` per such rank
        (``TrainEngine.score_suffix_chunks``; ``final``: the pass's last chunk)."""
        return self._on_owners(step.owned(list(tokens)), "score_suffix_chunks", lambda k, dp, mine, leader: (
            step.refs[dp], role, dict(zip(step.local(dp, mine), (tokens[g] for g in mine))), width, version, final))

    def score_turns(self, dp: int, items: list, roles: list[str], version: int, temperature: float,
                    final: bool = False):
        """Environment trajectories scored turn by turn on DP rank ``dp`` (``TrainWorker.score_turns``;
        the torch backend: one rank per DP index). Returns its future (a ``TurnScoreResult``)."""
        return self.ex.call(self.handles[self.leaders[dp]], "score_turns", items, roles, version, temperature, final)

    def _on_owners(self, owned: list[tuple[int, list[int]]], method: str, args_of, combine=None) -> Pending:
        """Call ``method(*args_of(k, dp, its groups, is_leader))`` on every rank of the ``k``-th DP
        index of ``owned`` (``[(dp, global prompt indices)]``, e.g. ``StepPrompts.owned``; the DP
        ranks not in it are skipped); ``combine(leader results, owned)`` (default: the leaders'
        results, in ``owned`` order)."""
        futures, leaders = [], []
        for k, (dp, mine) in enumerate(owned):
            for r in self._replica(dp):
                leader = r == self.leaders[dp]
                if leader:
                    leaders.append(len(futures))
                futures.append(self.ex.call(self.handles[r], method, *args_of(k, dp, mine, leader)))
        done = combine or (lambda outs, _: outs)
        return Pending(futures, lambda values: done([values[i] for i in leaders], owned))

    def set_threads(self, threads: int) -> Pending:
        return self._all("set_threads", threads)

    def offload_states(self, parts: tuple[str, ...]) -> Pending:
        return self._all("offload_states", parts)

    def prefetch_states(self, parts: tuple[str, ...]) -> Pending:
        return self._all("prefetch_states", parts)

    def enter_phase(self, phase: str, resident: dict[str, bool]) -> Pending:
        """Every rank starts ``phase`` of the residency plan (``TrainEngine.enter_phase``); result:
        the ranks' reports, rank order."""
        return self._all("enter_phase", phase, resident, combine=list)

    # ---- weights ------------------------------------------------------------------------------
    def export_shared_weights(self) -> Pending:
        """Per rank, the handles of the rollout tensors of its device (rank order); in one process
        the tensors themselves (``sharing.embedded.LocalWeights``). At rollout TP 1 the HF
        parameters (the built-in engine's names), above it each rollout rank's ``sglang``-layout
        tensors (the built-in engine's rank binds its device's; SGLang's one worker per engine
        pushes every rank's)."""
        kind = ("sglang",) if self.layout.rollout_tp > 1 else ()  # TP 1: the worker's default, hf
        return self._all("export_shared_weights", self.ex.kind == "inprocess", *kind, combine=list)

    def publish_weights(self, version: int) -> Pending:
        return self._all("publish_weights", version, combine=list)

    def rollout_weights(self) -> Pending:
        return self._all("rollout_weights", combine=list)

    def weights_digest(self) -> dict[str, str]:
        return self._all("weights_digest").result()

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes what it owns (replicas: rank 0 only) into ``directory``."""
        self._all("save_checkpoint", directory).result()

    def load_checkpoint(self, directory: str) -> int:
        """Every rank loads; returns the weights version (equal on all ranks, checked)."""
        versions = self._all("load_checkpoint", directory, combine=list).result()
        assert len(set(versions)) == 1, versions
        return versions[0]

    def export_hf(self, directory: str) -> None:
        """The actor as a HF checkpoint directory (written by rank 0; others take part in gathers)."""
        self._all("export_hf", directory).result()


class RolloutGroup:
    """The rollout engines.

    Args:
        executor, handles: (rollout_dp,) worker per engine (a tensor-parallel built-in engine's
            rank 0). layout: the run's ParallelLayout.
        followers: per engine, the workers of its ranks 1 .. r-1 (a built-in engine at
            ``rollout_tp`` > 1, rank k on the engine's k-th device): each gets every call rank 0
            gets (the same collectives), with its own device's weights; results come from rank 0.
    """

    def __init__(self, executor, handles: list, layout, followers: Optional[list[list]] = None):
        self.ex, self.handles, self.layout = executor, handles, layout
        self.followers = followers or [[] for _ in handles]

    @property
    def all_handles(self) -> list:
        """Every rollout worker (ranks 0 and followers)."""
        return list(self.handles) + [h for ranks in self.followers for h in ranks]

    def _follow(self, engine: int, method: str, *args, per_rank=None) -> list:
        """Futures of ``method`` on engine ``engine``'s follower ranks (``per_rank(k)`` gives rank
        k's arguments when they differ from ``args``)."""
        return [self.ex.call(h, method, *(per_rank(k) if per_rank else args))
                for k, h in enumerate(self.followers[engine], start=1)]

    def engines_of_dp(self, dp: int) -> list[int]:
        """The rollout engines on the devices of DP rank ``dp``'s replica."""
        ranks = [r for r in range(self.layout.world_size) if self.layout.train_coords(r).dp == dp]
        return sorted({self.layout.rollout_engine_of(r) for r in ranks})

    def split(self, step: StepPrompts) -> list[tuple[int, int, list[int]]]:
        """``[(engine, dp, global prompt indices)]``: a DP rank's groups are dealt in turn over the
        engines of its devices (one call per engine and DP rank)."""
        calls: dict[tuple[int, int], list[int]] = {}
        for dp, groups in enumerate(step.groups_of_dp):
            engines = self.engines_of_dp(dp)
            for k, g in enumerate(groups):
                calls.setdefault((engines[k % len(engines)], dp), []).append(g)
        return [(e, dp, idx) for (e, dp), idx in sorted(calls.items())]

    @staticmethod
    def _given(prefixes: Optional[dict], idx: list[int]) -> Optional[list]:
        """Per prompt of a call, its handed-in prefix state or None (None: none handed in)."""
        return None if not prefixes else [prefixes.get(g) for g in idx]

    def generate(self, step: StepPrompts, params, version: Optional[int], prefixes: Optional[dict] = None) -> Pending:
        """All responses, grouped by prompt in global order (``prompt_index`` global).
        ``prefixes``: global prompt index -> its KV cache under ``version`` (``PrefixState``), for
        the prompts the engines need not prefill."""
        calls = self.split(step)
        args = [(step.refs[dp], params, version, step.local(dp, idx), self._given(prefixes, idx)) for _, dp, idx in calls]
        futures = [self.ex.call(self.handles[e], "generate", *a) for (e, _, _), a in zip(calls, args)]
        following = [f for (e, _, _), a in zip(calls, args) for f in self._follow(e, "generate", *a)]

        def combine(outs: list[list[Response]]) -> list[Response]:
            merged = [_globalised(r, idx) for (_, _, idx), rs in zip(calls, outs) for r in rs]
            return sorted(merged, key=lambda r: r.prompt_index)  # stable: a group keeps its order

        return Pending(futures + following, lambda outs: combine(outs[:len(futures)]))

    def generate_stream(self, step: StepPrompts, params, version: Optional[int],
                        prefixes: Optional[dict] = None, progress_every: int = 0) -> "ResponseStream":
        """Whole finished groups as the engines yield them (``ResponseStream``); ``prefixes`` as in
        :meth:`generate`; ``progress_every``: the engines also report the tokens decoded so far
        every that many steps (``RolloutEngine.generate_stream``)."""
        calls = self.split(step)
        stream = ItemStream(len(calls))
        following = []
        for e, dp, idx in calls:
            args = (step.refs[dp], params, version, step.local(dp, idx), self._given(prefixes, idx), progress_every)
            self.ex.stream(self.handles[e], "generate_stream", args, stream, tag=tuple(idx))
            following += self._follow(e, "follow_stream", *args)
        return ResponseStream(stream, following)

    def _seed_runs(self, seeds: list[int]) -> list[tuple[int, list[int]]]:
        """``[(engine, its seeds)]``: the seeds dealt in contiguous runs over the engines, engines
        left without seeds omitted."""
        share = -(-len(seeds) // len(self.handles))
        runs = [(e, seeds[e * share:(e + 1) * share]) for e in range(len(self.handles))]
        return [(e, run) for e, run in runs if run]

    def rollout_envs(self, env_cfg, model_path: str, seeds: list[int], params, version: Optional[int],
                     uid_prefix: str) -> Pending:
        """``params.n`` environment trajectories per seed, the seeds dealt in contiguous runs over the
        engines (a TP engine's followers are not driven: environment runs are refused at rollout TP
        > 1 by ``config``); the combined result is every trajectory, seed-major in ``seeds`` order."""
        futures = [self.ex.call(self.handles[e], "rollout_envs", env_cfg, model_path, run, params, version, uid_prefix)
                   for e, run in self._seed_runs(seeds)]
        return Pending(futures, lambda outs: [t for out in outs for t in out])

    def rollout_envs_stream(self, env_cfg, model_path: str, seeds: list[int], params, version: Optional[int],
                            uid_prefix: str) -> ItemStream:
        """:meth:`rollout_envs` streamed: items ``(engine index, list of TurnInput)`` as each engine's
        turns start and, last per engine, ``(engine index, its trajectories)`` (seed-major over the
        engines' runs when put back in engine order)."""
        runs = self._seed_runs(seeds)
        stream = ItemStream(len(runs))
        for e, run in runs:
            self.ex.stream(self.handles[e], "rollout_envs_stream", (env_cfg, model_path, run, params, version,
                                                                    uid_prefix), stream, tag=e)
        return stream

    def set_threads(self, threads: int) -> Pending:
        """A share change that reaches engines while they decode (applied at their next step)."""
        return Pending([self.ex.call(h, "set_threads", threads, concurrent=True) for h in self.all_handles])

    def decode_stats(self) -> dict[int, tuple[float, int]]:
        """The slowest engine's ``{threads: (seconds, steps)}`` of the last generate (the decode
        window ends when it does)."""
        stats = Pending([self.ex.call(h, "decode_stats") for h in self.handles]).result()
        return max(stats, key=lambda s: sum(sec for sec, _ in s.values()), default={})

    def _on_devices(self, method: str, args_of) -> list:
        """``method(*args_of(d))`` on every rollout worker, ``d`` its device; the results of the
        engines' rank 0, in engine order."""
        devices = self.layout.rollout_devices
        futures = [self.ex.call(h, method, *args_of(devices(e)[0])) for e, h in enumerate(self.handles)]
        following = [f for e in range(len(self.handles))
                     for f in self._follow(e, method, per_rank=lambda k, e=e: args_of(devices(e)[k]))]
        return Pending(futures + following).result()[:len(futures)]

    def enter_phase(self, phase: str, resident: dict[str, bool]) -> Pending:
        """Every rollout worker (followers included) starts ``phase`` of the residency plan
        (``RolloutWorker.enter_phase``); result: their reports."""
        return Pending([self.ex.call(h, "enter_phase", phase, resident) for h in self.all_handles], list)

    def mapped_devices(self, engine: int) -> list[int]:
        """The devices whose train ranks' exports engine ``engine``'s rank-0 worker maps: its first
        device, or all of them for an engine with one worker over a TP group (SGLang at TP > 1)."""
        devices = self.layout.rollout_devices(engine)
        return devices if len(devices) > 1 and not self.followers[engine] else devices[:1]

    def _on_engines(self, method: str, args_of) -> list:
        """``method(*args_of(list of per-device items))`` where one worker runs an engine over its TP
        group: that worker gets every device's item (rank order); else ``_on_devices``."""
        if any(len(self.mapped_devices(e)) > 1 for e in range(len(self.handles))):
            return Pending([self.ex.call(h, method, *args_of(self.mapped_devices(e)))
                            for e, h in enumerate(self.handles)]).result()
        return self._on_devices(method, lambda d: args_of([d]))

    def map_shared_weights(self, payloads: list[bytes]) -> list[int]:
        """Each rollout worker maps the weights of the train rank on its device (rank 0 of engine
        ``e``: its first device; an engine with one worker over its TP group: the exports of all
        its devices, rank order); the bytes each engine's rank 0 mapped."""
        return self._on_engines("map_shared_weights", lambda ds: ([payloads[d] for d in ds] if len(ds) > 1
                                                                  else payloads[ds[0]],))

    def sync_shared_weights(self, version: int, published: list[dict]) -> dict[str, float]:
        return self._on_engines("sync_shared_weights", lambda ds: (version, [published[d] for d in ds]))[0]

    def update_weights(self, state_dicts: list[dict], version: int) -> dict[str, float]:
        """The pickled path: each rollout worker copies the state dict of its device's train rank."""
        return self._on_devices("update_weights", lambda d: (state_dicts[d], version))[0]

    def weights_digest(self) -> dict[str, str]:
        return self.ex.call(self.handles[0], "weights_digest").result()


def _globalised(r: Response, indices: list[int]) -> Response:
    """``r`` with its engine-local prompt index mapped to the step's global one."""
    return replace(r, prompt_index=indices[r.prompt_index])


class ResponseStream:
    """Responses of whole groups as they finish, with global prompt indices, and the engines'
    ``DecodeProgress`` reports (kept apart: :meth:`take_progress`)."""

    def __init__(self, items: ItemStream, following: Optional[list] = None):
        self.items = items
        self.progress: list[DecodeProgress] = []
        self.following = following or []  # futures of the follower ranks' follow_stream (failures raised)

    def _check_followers(self) -> None:
        for f in self.following:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def next_future(self):
        return self.items.next_future()

    def take(self) -> list[Response]:
        """The responses that arrived since the last call (possibly none)."""
        self._check_followers()
        out = []
        for idx, batch in self.items.take():
            for r in batch:
                (self.progress if isinstance(r, DecodeProgress) else out).append(_globalised(r, list(idx)))
        return out

    def take_progress(self) -> list[DecodeProgress]:
        """The progress reports that arrived by the last :meth:`take` and were not taken yet."""
        out, self.progress = self.progress, []
        return out

    @property
    def finished(self) -> bool:
        return self.items.finished
