"""A pretend accelerator for CPU tests: every tensor is tagged ``device`` or ``host`` as it would be
on a GPU run, and an op that a GPU would refuse is recorded (``tests/test_device_placement.py``).

Why tags and not a real second device: the engines run on real numbers (``.tolist()``, ``int()``,
seeded draws), so the ``meta`` device cannot stand in, and a CPU-only torch build has no second
device. The tensors stay on the CPU; :class:`PretendDevice` (a ``torch.overrides.TorchFunctionMode``)
sees every torch call made from Python, with its keyword arguments, and decides where the result
would live:

- a factory (no tensor inputs: ``torch.arange``, ``torch.zeros``, ``torch.tensor``, ``randint`` ...)
  is on the device when it is given ``device=`` (the engine's device: on a CPU run that is ``cpu``),
  or when the code under test called ``torch.set_default_device`` (patched by :meth:`PretendDevice.
  patch_default_device`); otherwise on the host;
- ``.to(device)`` / ``.cuda()`` / ``device=`` with tensor inputs move to the device, ``.cpu()`` to the
  host, ``.to(tensor)`` to where that tensor is; any other op's result is where its inputs are;
- a ``torch.device`` read off a host tensor (``host_tensor.device``) stays the host's: ``.to(d)`` or
  ``device=d`` with it is the host (``results.to(batch.device)``, "back where the batch lives").
- ``nn.Parameter(t)`` takes ``t``'s place (``Tensor._make_subclass`` is not seen by the mode: a
  module's weights bound to new tensors, as the TP engine binds a rank's tensors).

An op whose inputs mix device tensors with host tensors of one or more dimensions is recorded: a
CUDA op raises there ("Expected all tensors to be on the same device"). Allowed, as CUDA allows
them: 0-dim host tensors (CPU scalars), host index tensors of ``t[idx]`` / ``t[idx] = v`` on a
device tensor, and the transfers themselves. A factory drawing from a CPU ``torch.Generator`` into a
device tensor is recorded too (CUDA needs a CUDA generator). Backward passes run with the mode on
(custom ``autograd.Function.backward`` included); gradients the autograd engine makes are untagged.

What it cannot see: tensors made in other threads (the mode is per thread) or other processes; ops
inside C++ (only their results, tagged by their inputs); an explicit ``device="cpu"`` meant as the
host (it reads as the engine's device: write host tensors without a device, use ``.cpu()`` or a
host tensor's ``.device``);
dtype, stream, synchronisation and memory questions; CUDA-only code paths the CPU run does not take
(a branch on ``device.type == "cuda"``).
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

DEVICE, HOST = "device", "host"
_T = torch.Tensor
_INDEXING = {_T.__getitem__, _T.__setitem__}
_DEVICE_OF = _T.device.__get__  # ``tensor.device`` (a new method-wrapper per access: compare with ==)
_ACTIVE = threading.local()  # the PretendDevice entered on this thread (``.mode``), for nn.Parameter
_PARAMETER_NEW = torch.nn.Parameter.__new__


def _parameter_new(cls, data=None, requires_grad=True):
    """``nn.Parameter(t)`` made outside the mode's sight (``Tensor._make_subclass``): the new
    parameter takes ``t``'s tag, as it takes its storage (a module's weights bound to new tensors)."""
    param = _PARAMETER_NEW(cls, data, requires_grad)
    mode = getattr(_ACTIVE, "mode", None)
    if mode is not None and data is not None and mode.tags.get(data) is not None:
        mode.tags[param] = mode.tags[data]
    return param


@dataclass(frozen=True)
class Violation:
    """One op a GPU would refuse: ``where`` (file:line of the project code that made the call),
    ``op`` (the torch function) and ``what`` (the inputs' places and shapes)."""

    where: str
    op: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.op}({self.what})"


def _where() -> str:
    """The innermost stack frame in the project's code (or, failing that, outside torch)."""
    frames = traceback.extract_stack()[:-3]
    for keys in (("rollplex_train", "scripts/"), ("",)):
        for f in reversed(frames):
            path = f.filename.replace("\\", "/")
            if any(k in path for k in keys) and "/torch/" not in path and not path.endswith("pretend_device.py"):
                short = path.split("src/")[-1] if "src/" in path else "/".join(path.split("/")[-2:])
                return f"{short}:{f.lineno}"
    return "?"


def _describe(tagged: list[tuple[torch.Tensor, Optional[str]]]) -> str:
    return ", ".join(f"{tag or 'untagged'} {tuple(t.shape)}" for t, tag in tagged)


class PretendDevice(TorchFunctionMode):
    """Tags tensors ``device``/``host`` and records the ops a GPU would refuse (module docstring).

    Use::

        with PretendDevice() as placement:
            placement.on_device(model)          # its parameters and buffers are the engine's
            placement.on_host(prompts)          # tensors in any nested list/tuple/dict/dataclass
            ... run the path ...
        assert not placement.violations, placement.report()
    """

    def __init__(self, untagged_is_host: bool = False):
        """``untagged_is_host``: a tensor without a tag counts as a host tensor: one made on a thread
        the mode is not entered in (an environment worker's frames) or before it was entered. Only
        for passes without backward (the autograd engine's gradients are untagged)."""
        super().__init__()
        self.untagged_is_host = untagged_is_host
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.violations: list[Violation] = []
        self.default_is_device = False
        self._host_devices: dict[int, torch.device] = {}  # id -> the object, kept alive: ids stay unique

    # ---- marking --------------------------------------------------------------------------------
    def _mark(self, tag: str, objs) -> None:
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    self.tags[t] = tag
            elif isinstance(obj, torch.Tensor):
                self.tags[obj] = tag
            elif isinstance(obj, dict):
                self._mark(tag, obj.values())
            elif isinstance(obj, (list, tuple)):
                self._mark(tag, obj)
            elif hasattr(obj, "__dataclass_fields__"):
                self._mark(tag, [getattr(obj, f) for f in obj.__dataclass_fields__])

    def on_device(self, *objs) -> None:
        """Tag tensors (modules: parameters and buffers; containers and dataclasses recursively) as
        living on the engine's device."""
        self._mark(DEVICE, objs)

    def on_host(self, *objs) -> None:
        """Tag tensors (as ``on_device``) as host tensors (the data the driver builds)."""
        self._mark(HOST, objs)

    @contextmanager
    def patch_default_device(self) -> Iterator[None]:
        """While open, ``torch.set_default_device(d)`` (d not None) makes later factories without a
        ``device=`` device tensors, as it would on a GPU run (the CPU default is left alone)."""
        real = torch.set_default_device

        def pretend(device):
            self.default_is_device = device is not None

        torch.set_default_device = pretend
        try:
            yield
        finally:
            torch.set_default_device = real
            self.default_is_device = False

    def report(self) -> str:
        """The recorded violations, one per line (duplicates of one call site folded)."""
        seen = dict.fromkeys(str(v) for v in self.violations)
        return f"{len(self.violations)} ops a GPU would refuse:\n" + "\n".join(seen)

    # ---- the mode -------------------------------------------------------------------------------
    def __enter__(self):
        self._outer = getattr(_ACTIVE, "mode", None)
        _ACTIVE.mode = self
        torch.nn.Parameter.__new__ = _parameter_new  # a pass-through wherever no mode is entered
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.mode = self._outer
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _T.backward:
            return self._backward(*args, **kwargs)
        if func == _DEVICE_OF:
            return self._device_of(*args)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tagged = [(t, self._tag_of(t)) for t in tensors]
        target = self._target(func, args, kwargs, tagged)
        if target == "transfer":
            target = None
        else:
            self._check(func, args, kwargs, tagged, target)
        out = func(*args, **kwargs)
        return self._tag_outputs(func, out, tensors, tagged, target)

    def _tag_of(self, tensor: torch.Tensor) -> Optional[str]:
        return self.tags.get(tensor, HOST if self.untagged_is_host else None)

    def _device_of(self, tensor: torch.Tensor) -> torch.device:
        """``tensor.device``; for a host tensor a fresh ``torch.device`` remembered as the host's."""
        device = _DEVICE_OF(tensor)
        if self._tag_of(tensor) != HOST:
            return device
        device = torch.device(device.type, device.index)
        self._host_devices[id(device)] = device
        return device

    def _place(self, device) -> str:
        """Where ``device=``/``.to(device)`` puts a tensor: the host for a host tensor's device."""
        return HOST if self._host_devices.get(id(device)) is device else DEVICE

    def _target(self, func, args, kwargs, tagged) -> Optional[str]:
        """Where the result lives when the call itself says so (a move or a factory); None: with
        its inputs. ``transfer``: an in-place copy between places (``copy_``), unchecked."""
        if func is _T.cpu:
            return HOST
        if func is _T.cuda:
            return DEVICE
        if func is _T.copy_:
            return "transfer"
        if func is _T.to:
            dest = [a for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]
                    if isinstance(a, (str, torch.device, torch.Tensor))]
            if not dest:
                return None  # a dtype conversion stays where it is
            return self._tag_of(dest[0]) if isinstance(dest[0], torch.Tensor) else self._place(dest[0])
        if kwargs.get("device") is not None:
            return self._place(kwargs["device"])
        if not tagged:  # a factory
            return DEVICE if self.default_is_device and func is not torch.from_numpy else HOST
        return None

    def _check(self, func, args, kwargs, tagged, target) -> None:
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cpu" and target == DEVICE:
            self._record(func, "a CPU generator drawing a device tensor")
        if target is not None and any(t is not None for _, t in tagged) and func not in _INDEXING:
            return  # a move (.to/.cpu/device=): inputs may sit anywhere
        consider = tagged
        if func in _INDEXING and self._tag_of(args[0]) == DEVICE:  # host indices are fine on a device tensor
            index = {id(t) for t in pytree.tree_leaves(args[1]) if isinstance(t, torch.Tensor)}
            consider = [(t, tag) for t, tag in tagged if id(t) not in index]
        on_device = any(tag == DEVICE for _, tag in consider)
        on_host = any(tag == HOST and t.dim() > 0 for t, tag in consider)
        if on_device and on_host:
            self._record(func, _describe(consider))

    def _record(self, func, what: str) -> None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        self.violations.append(Violation(_where(), name, what))

    def _tag_outputs(self, func, out, tensors, tagged, target):
        if target is None:
            places = {tag for _, tag in tagged if tag is not None}
            target = DEVICE if DEVICE in places else HOST if HOST in places else None
        if target is None:
            return out
        inputs = {id(t) for t in tensors}

        def tag(o):
            if not isinstance(o, torch.Tensor):
                return o
            if id(o) in inputs:  # in place, or a move that had nothing to do on this CPU
                if func not in (_T.to, _T.cuda, _T.cpu) or self.tags.get(o) == target:
                    return o
                if isinstance(o, torch.nn.Parameter):
                    self.tags[o] = target
                    return o
                o = o.view_as(o)  # a new tensor for the moved value; the original keeps its place
            self.tags[o] = target
            return o

        if isinstance(out, torch.Tensor):
            return tag(out)
        if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out)):
            return out  # shapes, sizes, numbers: untouched (a torch.Size must stay one)
        return pytree.tree_map(tag, out)

    def _backward(self, tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``Tensor.backward`` with this mode on while the autograd engine runs the graph."""
        from torch.autograd.graph import _engine_run_backward

        grad = gradient if gradient is not None else torch.ones_like(tensor)
        retain = create_graph if retain_graph is None else retain_graph
        with self:
            _engine_run_backward((tensor,), (grad,), retain, create_graph, tuple(inputs or ()),
                                 allow_unreachable=True, accumulate_grad=True)
