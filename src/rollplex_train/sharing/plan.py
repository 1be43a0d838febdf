"""Share planner: which rollout tensors can be views of the local training shards.

From a training layout at TP t (``hf`` or ``megatron``) to a rollout layout at TP r (``sglang`` or
``hf``), on D = lcm(t, r) colocated devices (device d holds training rank d % t), the planner picks
which rollout rank runs on which device so that the most rollout bytes are found in that device's
training shards, then decides, per rollout tensor of every device, one of:

    view           the tensor is a contiguous slice of one local training tensor (same storage)
    strided_view   a non-contiguous slice of one local training tensor (row-parallel column range,
                   or equally spaced groups for the ``split_qkv`` option); same storage
    local_rebuild  every element is on the device, but in another order or in several tensors (or
                   it needs zero padding the training side lacks): copied into a persistent buffer
    gather         some elements live on another device's training shard: fetched, then rebuilt

Byte counts are of rollout tensors (``itemsize`` bytes an element); ``remote_bytes`` counts only
the part of gathered tensors that has to cross devices. Pure Python + the specs of
``models/layouts.py``: no tensors, no processes.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

from rollplex_train.models.layouts import Block, Dims, Layout, TensorSpec, build_layout

ACTIONS = ("view", "strided_view", "local_rebuild", "gather")


@dataclass(frozen=True)
class Piece:
    """A run of a rollout tensor: ``block`` found at row ``pos`` of local training tensor ``tensor``.

    ``tensor`` is None for a run held by no local tensor: ``remote`` (real rows on another device)
    or padding that must be zero-filled (``remote=False``).
    """

    block: Block
    tensor: Optional[str] = None
    pos: int = 0
    remote: bool = False


@dataclass(frozen=True)
class TensorPlan:
    """How one rollout tensor is made. ``view``: ``(training tensor, size, stride, offset)`` in
    elements of that (contiguous) training tensor, for view/strided_view actions."""

    spec: TensorSpec
    action: str
    pieces: tuple[Piece, ...]
    nbytes: int
    remote_bytes: int
    view: Optional[tuple[str, tuple[int, ...], tuple[int, ...], int]] = None


@dataclass
class SharePlan:
    """The plan for all devices of one (training layout, t) -> (rollout layout, r) pair.

    Attributes:
        devices: per device d, ``(training rank, rollout rank)``.
        tensors: ``(training rank, rollout rank) -> {rollout name: TensorPlan}``.
        vocab_divisible_by: the megatron ``make_vocab_size_divisible_by`` the plan assumes.
    """

    train: Layout
    rollout: Layout
    devices: tuple[tuple[int, int], ...]
    tensors: dict[tuple[int, int], dict[str, TensorPlan]]
    itemsize: int
    vocab_divisible_by: int
    totals: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for pair in self.devices:
            for tp in self.tensors[pair].values():
                self.totals[tp.action] += tp.nbytes
                self.totals["remote"] += tp.remote_bytes

    @property
    def rollout_bytes(self) -> int:
        """Bytes of all rollout tensors on all D devices (every engine, every rank)."""
        return sum(self.totals[a] for a in ACTIONS)

    @property
    def model_bytes(self) -> int:
        return sum(math.prod(s) for s in self.train.hf_shapes.values()) * self.itemsize

    def fraction(self, *actions: str) -> float:
        return sum(self.totals[a] for a in actions) / max(1, self.rollout_bytes)

    def shared_fraction(self) -> float:
        """Share of rollout bytes that are views of training storage (view + strided_view)."""
        return self.fraction("view", "strided_view")


def index_rank(specs: dict[str, TensorSpec]) -> dict[str, list[tuple[int, int, str, int]]]:
    """source -> sorted ``(start, stop, tensor name, row in tensor)`` of one rank's tensors."""
    idx: dict[str, list[tuple[int, int, str, int]]] = defaultdict(list)
    for spec in specs.values():
        pos = 0
        for b in spec.blocks:
            idx[b.source].append((b.start, b.stop, spec.name, pos))
            pos += b.size
    for entries in idx.values():
        entries.sort()
    return idx


def locate(block: Block, index: dict, hf_rows: int) -> list[Piece]:
    """Split ``block`` into runs found in a rank's ``index`` and runs it lacks (remote or fill)."""
    out: list[Piece] = []
    cur = block.start
    entries = index.get(block.source, ())

    def gap(stop: int) -> None:
        real_stop = min(stop, max(cur, hf_rows))
        if real_stop > cur:
            out.append(Piece(Block(block.source, cur, real_stop), remote=True))
        if stop > real_stop:
            out.append(Piece(Block(block.source, real_stop, stop)))

    for start, stop, name, pos in entries:
        if stop <= cur or cur >= block.stop:
            continue
        if start > cur:
            gap(min(start, block.stop))
            cur = min(start, block.stop)
            if cur >= block.stop:
                break
        end = min(stop, block.stop)
        out.append(Piece(Block(block.source, cur, end), name, pos + cur - start))
        cur = end
    if cur < block.stop:
        gap(block.stop)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _runs(pieces: list[Piece]) -> list[tuple[int, int]]:
    """``(first row, rows)`` runs of local pieces, adjacent ones merged."""
    runs: list[tuple[int, int]] = []
    for p in pieces:
        if runs and runs[-1][0] + runs[-1][1] == p.pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + p.block.size)
        else:
            runs.append((p.pos, p.block.size))
    return runs


def _view(spec: TensorSpec, train: TensorSpec, runs: list[tuple[int, int]]):
    """``(action, view)`` for a rollout spec whose rows are ``runs`` of one training tensor."""
    ts = train.logical_shape
    rest = ts[:spec.dim] + ts[spec.dim + 1:]
    assert rest == spec.logical_shape[:spec.dim] + spec.logical_shape[spec.dim + 1:], (spec, train)
    row = math.prod(ts[spec.dim + 1:])
    if spec.dim == 1:
        if len(runs) != 1:
            return "local_rebuild", None
        start, rows = runs[0]
        stride = (ts[1] * row,) + _contiguous_strides(spec.shape[1:])
        return ("view" if rows == ts[1] else "strided_view"), (train.name, spec.shape, stride, start * row)
    if not spec.groups:
        if len(runs) != 1:
            return "local_rebuild", None
        return "view", (train.name, spec.shape, _contiguous_strides(spec.shape), runs[0][0] * row)
    per = spec.shape[1]
    starts = []
    for start, rows in runs:
        if rows % per:
            return "local_rebuild", None
        starts += [start + k * per for k in range(rows // per)]
    steps = {b - a for a, b in zip(starts, starts[1:])}
    inner = _contiguous_strides(spec.shape[1:])
    if not steps or steps == {per}:
        return "view", (train.name, spec.shape, _contiguous_strides(spec.shape), starts[0] * row)
    if len(steps) == 1 and min(steps) > 0:
        return "strided_view", (train.name, spec.shape, (steps.pop() * row,) + inner, starts[0] * row)
    return "local_rebuild", None


def plan_tensor(spec: TensorSpec, train_specs: dict[str, TensorSpec], index: dict,
                hf_shapes: dict[str, tuple[int, ...]], itemsize: int) -> TensorPlan:
    """The action for one rollout tensor given the local training rank's specs and ``index_rank``."""
    pieces = [p for b in spec.blocks for p in locate(b, index, hf_shapes[b.source][spec.dim])]
    nbytes = spec.numel * itemsize
    row_bytes = nbytes // max(1, spec.logical_shape[spec.dim])
    remote = sum(p.block.size for p in pieces if p.remote) * row_bytes
    action, view = "local_rebuild", None
    if remote:
        action = "gather"
    elif all(p.tensor for p in pieces) and len({p.tensor for p in pieces}) == 1:
        action, view = _view(spec, train_specs[pieces[0].tensor], _runs(pieces))
    return TensorPlan(spec, action, tuple(pieces), nbytes, remote, view)


def _local_bytes(rollout: dict[str, TensorSpec], index: dict, hf_shapes: dict, itemsize: int) -> int:
    total = 0
    for spec in rollout.values():
        row = math.prod(spec.logical_shape) // spec.logical_shape[spec.dim] * itemsize
        for b in spec.blocks:
            for p in locate(b, index, hf_shapes[b.source][spec.dim]):
                total += p.block.size * row if p.tensor else 0
    return total


def best_mapping(overlap: list[list[int]], t: int, r: int) -> tuple[tuple[int, int], ...]:
    """Per device d of D = lcm(t, r) (training rank d % t), the rollout rank maximising local bytes.

    ``overlap[j][i]``: bytes of rollout rank j found in training rank i. Each rollout rank runs on
    D / r devices. Exact (dynamic programming over device subsets), D <= 16.

    Raises:
        ValueError: D > 16.
    """
    devices = math.lcm(t, r)
    if devices > 16:
        raise ValueError(f"t={t}, r={r}: lcm {devices} devices is more than the planner maps (16)")
    slots = [j for j in range(r) for _ in range(devices // r)]
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for d in range(devices):  # device d takes one free slot
        nxt: dict[int, tuple[int, tuple[int, ...]]] = {}
        for mask, (score, chosen) in best.items():
            seen = set()
            for s, j in enumerate(slots):
                if mask >> s & 1 or j in seen:
                    continue
                seen.add(j)
                cand = (score + overlap[j][d % t], chosen + (j,))
                key = mask | 1 << s
                if key not in nxt or cand[0] > nxt[key][0]:
                    nxt[key] = cand
        best = nxt
    chosen = best[(1 << devices) - 1][1]
    return tuple((d % t, j) for d, j in enumerate(chosen))


def megatron_vocab_divisor(vocab: int, t: int, rollout_multiple: int = 64) -> int:
    """The largest power of two <= 128 for ``make_vocab_size_divisible_by`` such that megatron's
    padded vocabulary (multiple of divisor x t) equals the rollout's (multiple of 64), if any;
    else 128 (megatron's default). 152064 rows at t = 8: 64 (128 would pad to 152576 and shift
    every rank's rows)."""
    target = -(-vocab // rollout_multiple) * rollout_multiple
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if -(-vocab // (d * t)) * d * t == target:
            return d
    return 128


def plan_sharing(shapes: dict[str, tuple[int, ...]], dims: Dims, *, t: int, r: int,
                 train_kind: str = "megatron", rollout_kind: str = "sglang", split_qkv: bool = False,
                 split_gate_up: bool = False, itemsize: int = 2,
                 vocab_divisible_by: Optional[int] = None, train_layout: Optional[Layout] = None) -> SharePlan:
    """Plan the weight sharing of HF parameters ``shapes`` (``models.arch.parameter_shapes``).

    Args:
        t, r: training and rollout TP degrees.
        itemsize: bytes per element (2 for bf16).
        vocab_divisible_by: megatron's divisor; None picks ``megatron_vocab_divisor``.
        train_layout: the training side's layout as built by its backend (e.g. the Megatron
            backend's: ``megatron`` language model, whole HF vision tower); None builds
            ``train_kind`` at ``t``.

    Raises:
        ValueError: a degree the layouts cannot split (``build_layout``) or too many devices.
    """
    vocab = next((s[0] for n, s in shapes.items() if n.endswith("embed_tokens.weight")), 1)
    divisor = vocab_divisible_by or megatron_vocab_divisor(vocab, t)
    train = train_layout or build_layout(train_kind, t, shapes, dims, vocab_divisible_by=divisor)
    rollout = build_layout(rollout_kind, r, shapes, dims, split_qkv=split_qkv, split_gate_up=split_gate_up)
    indexes = [index_rank(specs) for specs in train.ranks]
    overlap = [[_local_bytes(rollout.ranks[j], indexes[i], shapes, itemsize) for i in range(t)] for j in range(r)]
    devices = best_mapping(overlap, t, r)
    tensors = {
        (i, j): {name: plan_tensor(spec, train.ranks[i], indexes[i], shapes, itemsize)
                 for name, spec in rollout.ranks[j].items()}
        for i, j in set(devices)
    }
    return SharePlan(train, rollout, devices, tensors, itemsize, divisor)
