"""The multi-turn rollout: generate -> environment step -> generate ... per trajectory, token in / token out.

A decode strategy a training step calls in place of one ``generate``: for P environment seeds and
G = ``params.n`` trajectories per seed it returns P * G :class:`~rollplex_train.rollout.trajectory.Trajectory`
records (seed 0's G first), each with its ids, loss mask, per-turn boundaries, rewards, images
and the engine's log-probs.

Per turn, every open trajectory's engine input is one prompt of one engine request
(``RolloutEngine.generate_stream``, the engine's public API): turn 0's input is the same for the G
trajectories of a seed, so it is one prompt with ``n = G`` (the engine prefills it once and
repeats its cache); later turns are one prompt per trajectory with ``n = 1``. Sampling is seeded
per sequence from (``params.seed``, prompt uid, sample index), so a trajectory's tokens do not
depend on the batch around it.

Token in, token out: the engine's sampled ids are kept; only the new observation (a user message
with its image pads) is tokenized and appended, with the template's closing tokens between
(``rollout/turns.py``); the history is never re-templated. As soon as the engine yields a finished
response, its environment step (parse, act, render, resize and patchify the frame, tokenize the next
observation) is queued on a small pool of threads (``env.num_workers``), so it runs while the
other trajectories of the turn still decode.

The engine prefills each turn's whole input itself (its vision included). Under ``context=full``
turn t's input is a prefix of turn t+1's: :meth:`TurnLoop.rollout_stream` yields each turn's inputs
(:class:`TurnInput`) as the turn starts, so a planner can score everything up to them while the
turn decodes (``runtime/env_window.py``, ``models/turn_scoring.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from rollplex_train.config import EnvConfig
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.data.vision import patchify_images
from rollplex_train.envs.base import EnvError, VisionEnv, check_observation, fit_frame
from rollplex_train.models.loading import VisionSpec
from rollplex_train.rollout.base import RolloutEngine, SamplingParams
from rollplex_train.rollout.env_workers import EnvWorkers
from rollplex_train.rollout.trajectory import ObservationRecord, Trajectory, TurnRecord
from rollplex_train.rollout.turns import TurnTokenizer

log = logging.getLogger(__name__)


@dataclass
class TurnInput:
    """The whole context of trajectories about to decode a turn: response-independent for the rest of
    them (under ``context=full``).

    Attributes:
        seed: the environment seed. uids: the trajectories it belongs to (turn 0: the G of the
            seed, which share it; later: one).
        ids: (L,) int64 everything so far (system ... this turn's observation and assistant header).
        sampled: (L,) bool, the tokens the policy sampled (earlier responses).
        vision: the patches of every observation in ``ids``, in order.
    """

    seed: int
    uids: tuple[str, ...]
    ids: torch.Tensor
    sampled: torch.Tensor
    vision: VisionInputs


class _Episode:
    """One trajectory while it runs: its environment and the token pieces so far."""

    def __init__(self, uid: str, seed: int, sample: int, env: VisionEnv):
        self.uid, self.seed, self.sample, self.env = uid, seed, sample, env
        self.system_ids: torch.Tensor = torch.zeros(0, dtype=torch.long)
        self.user_ids: list[torch.Tensor] = []  # per observation
        self.close_ids: list[torch.Tensor] = []  # per finished turn
        self.observations: list[ObservationRecord] = []
        self.turns: list[TurnRecord] = []
        self.finish, self.error = "", ""
        self.hung = False  # an environment call was abandoned: never call the environment again

    def where(self, call: str) -> str:
        """``seed <s> sample <g> reset`` or ``... turn <k> step`` (the step after answer k, from 0)."""
        at = "reset" if call == "reset" else f"turn {len(self.turns) - 1} {call}"
        return f"seed {self.seed} sample {self.sample} {at}"

    def input(self, window: Optional[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The next turn's engine input ids (L,) and the observations in it."""
        last = len(self.user_ids) - 1
        first = 0 if window is None else max(0, last - window + 1)
        pieces = [self.system_ids]
        for j in range(first, last + 1):
            pieces.append(self.user_ids[j])
            if j < last:
                pieces += [self.turns[j].response_ids, self.close_ids[j]]
        return torch.cat(pieces), tuple(range(first, last + 1))

    def scoring_input(self) -> TurnInput:
        """The whole context so far (every observation, whatever ``env.context``) as a TurnInput."""
        ids, sampled = [self.system_ids], [torch.zeros(len(self.system_ids), dtype=torch.bool)]
        for j, user in enumerate(self.user_ids):
            ids.append(user)
            sampled.append(torch.zeros(len(user), dtype=torch.bool))
            if j < len(self.user_ids) - 1:
                ids += [self.turns[j].response_ids, self.close_ids[j]]
                sampled += [torch.ones(len(self.turns[j].response_ids), dtype=torch.bool),
                            torch.zeros(len(self.close_ids[j]), dtype=torch.bool)]
        vision = VisionInputs.concat([o.vision for o in self.observations])
        return TurnInput(self.seed, (self.uid,), torch.cat(ids), torch.cat(sampled), vision)

    def prompt(self, window: Optional[int], uid: str) -> PromptSample:
        """The next turn's engine input as a prompt (its observations' images as its vision)."""
        ids, observations = self.input(window)
        vision = VisionInputs.concat([self.observations[i].vision for i in observations])
        return PromptSample(uid=uid, prompt_ids=ids, vision=vision, ground_truth="", task="env")

    def trajectory(self, context: str) -> Trajectory:
        """The finished record: pieces concatenated, spans and masks filled in."""
        pieces, mask, logps = [self.system_ids], [torch.zeros(len(self.system_ids))], [torch.zeros(len(self.system_ids))]
        at = len(self.system_ids)
        for j, turn in enumerate(self.turns):
            user = self.user_ids[j]
            self.observations[j].span = (at, at + len(user))
            at += len(user)
            turn.span = (at, at + len(turn.response_ids))
            at += len(turn.response_ids)
            pieces += [user, turn.response_ids]
            mask += [torch.zeros(len(user)), torch.ones(len(turn.response_ids))]
            logps += [torch.zeros(len(user)), turn.logprobs]
            if j < len(self.turns) - 1:
                close = self.close_ids[j]
                pieces.append(close)
                mask.append(torch.zeros(len(close)))
                logps.append(torch.zeros(len(close)))
                at += len(close)
        return Trajectory(uid=self.uid, env_seed=self.seed, sample_index=self.sample, ids=torch.cat(pieces),
                          loss_mask=torch.cat(mask).float(), logprobs=torch.cat(logps).float(), turns=self.turns,
                          observations=self.observations[:len(self.turns)], finish=self.finish, error=self.error,
                          context=context)


class TurnLoop:
    """Runs environment trajectories on a rollout engine (module docstring).

    Args:
        engine: any ``RolloutEngine`` (only ``generate_stream`` is called).
        tokenizer: the checkpoint's tokenizer (``models.loading.load_tokenizer``).
        make_env: builds a fresh environment (``envs.env_builder``); one per trajectory.
        cfg: the ``env`` config section (turns, context, token budget, pixel budget, workers, errors).
        geometry: the checkpoint's patch geometry (``models.loading.load_vision_spec``).
        env_name: how errors name the environment (``env.name``).
    """

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: Callable[[], VisionEnv], cfg: EnvConfig,
                 geometry: VisionSpec = VisionSpec(), env_name: str = ""):
        self.engine, self.make_env, self.cfg, self.geometry = engine, make_env, cfg, geometry
        self.env_name = env_name or cfg.name or "env"
        self.window = cfg.context_window
        self.turn_tokens = TurnTokenizer(tokenizer, merge_size=geometry.merge_size)

    @classmethod
    def from_config(cls, engine: RolloutEngine, model_path: str, cfg: EnvConfig) -> "TurnLoop":
        """The loop of ``env.*`` over ``engine``, with the tokenizer and patch geometry of the
        checkpoint at ``model_path`` (``model.path``).

        Raises:
            ValueError / FileNotFoundError / MissingExtraError: as ``envs.env_builder``.
        """
        from rollplex_train.envs.registry import env_builder
        from rollplex_train.models.loading import load_tokenizer, load_vision_spec

        return cls(engine, load_tokenizer(model_path), env_builder(cfg.name, cfg.kwargs, cfg.adapter_options()), cfg,
                   load_vision_spec(model_path), env_name=cfg.name)

    # ---- environment calls (worker threads) -----------------------------------------------------
    def _observe(self, episode: _Episode, obs, call: str) -> None:
        """Check an observation, resize + patchify its frames, tokenize it; append to ``episode``."""
        where = f"env.name={self.env_name} {episode.where(call)}"
        obs = check_observation(obs, where)
        g, cfg = self.geometry, self.cfg
        frames = [fit_frame(im, cfg.min_pixels, cfg.max_pixels, g.patch_size * g.merge_size) for im in obs.images]
        pixel_values, grid = patchify_images(frames, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                             patch_size=g.patch_size, temporal_patch_size=g.temporal_patch_size,
                                             merge_size=g.merge_size)
        episode.user_ids.append(self.turn_tokens.user_ids(obs.text, grid, name=where))
        episode.observations.append(ObservationRecord(obs.text, frames, VisionInputs(pixel_values=pixel_values,
                                                                                     image_grid_thw=grid)))

    def _reset(self, episode: _Episode) -> None:
        obs, _ = episode.env.reset(episode.seed)
        episode.system_ids = self.turn_tokens.system_ids(episode.env.system_prompt())
        self._observe(episode, obs, "reset")

    def _step(self, episode: _Episode, text: str) -> tuple:
        obs, reward, terminated, truncated, info = episode.env.step(text)
        if not (terminated or truncated):
            self._observe(episode, obs, "step")
        return float(reward), bool(terminated), bool(truncated), dict(info)

    # ---- the loop ---------------------------------------------------------------------------------
    def rollout(self, seeds: list[int], params: SamplingParams, weights_version: Optional[int] = None,
                uid_prefix: str = "env") -> list[Trajectory]:
        """Run ``params.n`` trajectories for each environment seed: the last item of
        :meth:`rollout_stream` (its arguments, result and errors)."""
        for item in self.rollout_stream(seeds, params, weights_version, uid_prefix):
            pass
        return item

    def rollout_stream(self, seeds: list[int], params: SamplingParams, weights_version: Optional[int] = None,
                       uid_prefix: str = "env") -> Iterator[Union[list[TurnInput], list[Trajectory]]]:
        """Run ``params.n`` trajectories for each environment seed; before each turn's engine request,
        yield the :class:`TurnInput` of every trajectory about to decode (turn 0: one per seed), and
        last, the trajectories.

        Args:
            seeds: P environment seeds (``reset(seed)``).
            params: sampling parameters of every turn (``n`` = trajectories per seed, G).
            weights_version: passed to the engine (a stale request is refused there).
            uid_prefix: trajectory uids are ``<uid_prefix>:<seed>/<g>``; the sampling streams are
                seeded by them, so a step should give its own prefix.

        Yields:
            lists of TurnInput, then (last) P * G trajectories, seed-major (seed 0's G first), each
            finished (``Trajectory.finish``).

        Raises:
            EnvError: one line naming the environment, seed, sample and turn: ``reset`` failed or
                broke the contract; the G first observations of a seed differ; the first input
                does not fit ``env.max_context_tokens``; with ``env.on_error=raise``, a failed step.
            ValueError: a seed given twice.
            StaleWeightsError: from the engine.
        """
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds {seeds}: expected distinct environment seeds (a seed's G trajectories come from params.n)")
        episodes = [_Episode(f"{uid_prefix}:{seed}/{g}", seed, g, self.make_env())
                    for seed in seeds for g in range(params.n)]
        workers = EnvWorkers(self.cfg.num_workers, self.cfg.step_timeout_s)
        try:
            self._start(episodes, workers, params)
            groups = [episodes[i * params.n:(i + 1) * params.n] for i in range(len(seeds))]
            yield [dataclasses.replace(g[0].scoring_input(), uids=tuple(e.uid for e in g)) for g in groups]
            # turn 0: one prompt per seed, its G samples share the prefill
            self._turn([(g[0].prompt(self.window, f"{uid_prefix}:{g[0].seed}"), g) for g in groups], params,
                       weights_version, workers)
            single = dataclasses.replace(params, n=1)
            while live := [e for e in episodes if not e.finish]:
                yield [e.scoring_input() for e in live]
                self._turn([(e.prompt(self.window, f"{e.uid}/turn{len(e.turns)}"), [e]) for e in live], single,
                           weights_version, workers)
        finally:
            for e in episodes:
                try:
                    if not e.hung:
                        e.env.close()
                except Exception as err:  # noqa: BLE001 - a failing close must not hide the rollout's result
                    log.warning("env.name=%s %s: close raised %s: %s", self.env_name, e.where("close"),
                                type(err).__name__, err)
            workers.shutdown()
        if workers.abandoned:
            log.warning("%d environment calls of env.name=%s ran past env.step_timeout_s=%g s and were abandoned",
                        workers.abandoned, self.env_name, self.cfg.step_timeout_s)
        failed = [e for e in episodes if e.finish == "env_error"]
        if failed:
            log.warning("%d of %d trajectories ended by an environment error (env.on_error=truncate); first: %s",
                        len(failed), len(episodes), failed[0].error)
        yield [e.trajectory(self.cfg.context) for e in episodes]

    def _start(self, episodes: list[_Episode], workers: EnvWorkers, params: SamplingParams) -> None:
        """Reset every environment (worker threads); check the G first observations of a seed agree
        and the first input fits the token budget."""
        futures = [workers.submit(self._reset, e) for e in episodes]
        workers.wait(futures)
        for e, f in zip(episodes, futures):
            if f.exception() is not None:
                e.hung = getattr(f, "abandoned", False)
                raise EnvError(self._message(e, "reset", f.exception())) from f.exception()
        for index, e in enumerate(episodes):
            head = episodes[index - e.sample]
            same = e.user_ids[0].equal(head.user_ids[0]) and e.system_ids.equal(head.system_ids) and all(
                a.tobytes() == b.tobytes() for a, b in zip(e.observations[0].images, head.observations[0].images))
            if not same:
                raise EnvError(f"env.name={self.env_name} {e.where('reset')}: the first observation differs from "
                               f"sample 0's; reset(seed) must give the same episode for the same seed")
            length = len(e.input(self.window)[0])
            if length + params.max_new_tokens > self.cfg.max_context_tokens:
                raise EnvError(f"env.name={self.env_name} {e.where('reset')}: the first input is {length} tokens; with "
                               f"rollout.max_new_tokens={params.max_new_tokens} it exceeds env.max_context_tokens="
                               f"{self.cfg.max_context_tokens}")

    def _turn(self, requests: list[tuple[PromptSample, list[_Episode]]], params: SamplingParams,
              weights_version: Optional[int], workers: EnvWorkers) -> None:
        """One engine request of (prompt, its episodes) pairs, ``params.n`` episodes a prompt; each
        finished response goes to its environment step at once. The engine yields a prompt's
        responses in sample order (``BuiltinRolloutEngine`` does)."""
        taken = [0] * len(requests)
        pending: list[tuple[_Episode, Future]] = []
        for item in self.engine.generate_stream([prompt for prompt, _ in requests], params, weights_version):
            for response in item:
                prompt, owners = requests[response.prompt_index]
                episode = owners[taken[response.prompt_index]]
                taken[response.prompt_index] += 1
                episode.turns.append(TurnRecord(
                    input_ids=prompt.prompt_ids, observations=episode.input(self.window)[1],
                    response_ids=response.token_ids, logprobs=response.logprobs, text=response.text,
                    finish_reason=response.finish_reason, span=(0, 0)))
                pending.append((episode, workers.submit(self._step, episode, response.text)))
        workers.wait([f for _, f in pending])
        for episode, future in pending:
            self._finish_turn(episode, future, params)

    def _finish_turn(self, episode: _Episode, future: Future, params: SamplingParams) -> None:
        """Apply a step's result (or its error) and decide whether the trajectory goes on."""
        turn = episode.turns[-1]
        error = future.exception()
        if error is not None:
            episode.hung = getattr(future, "abandoned", False)
            message = self._message(episode, "step", error)
            if self.cfg.on_error == "raise":
                raise EnvError(message) from error
            episode.finish, episode.error = "env_error", message
            return
        turn.reward, turn.terminated, turn.truncated, turn.info = future.result()
        turn.invalid = bool(turn.info.get("invalid", False))
        episode.close_ids.append(self.turn_tokens.closing_ids(turn.response_ids))
        if turn.terminated or turn.truncated:
            episode.finish = "terminated" if turn.terminated else "truncated"
        elif len(episode.turns) >= self.cfg.max_turns:
            episode.finish = "max_turns"
        elif len(episode.input(self.window)[0]) + params.max_new_tokens > self.cfg.max_context_tokens:
            episode.finish = "token_budget"

    def _message(self, episode: _Episode, call: str, error: BaseException) -> str:
        """One line: the environment, where, and the error's first line."""
        if isinstance(error, EnvError):
            return str(error).splitlines()[0]
        first = (str(error).splitlines() or [""])[0]
        return f"env.name={self.env_name} {episode.where(call)} raised {type(error).__name__}: {first}"
