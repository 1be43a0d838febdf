"""The Megatron backend's optimizer: megatron's distributed optimizer on CUDA, AdamW on CPU.

Both hold Adam (decoupled weight decay, as ``torch.optim.AdamW``, on every parameter) over the
Megatron DDP gradient buffers and give the backend one interface: ``take_grads`` after DDP's
gradient sync, ``clip_grad_norm``, ``step(lr)``, ``zero_grad``, ``save``/``load`` and
``offload``/``onload`` of the Adam states.

* ``DistributedAdam`` (CUDA): ``megatron.core.optimizer.get_megatron_optimizer`` with
  ``use_distributed_optimizer=True`` (megatron-core 0.16.1 ``optimizer/__init__.py``): fp32 main
  parameters and Adam states sharded over the DP group, DDP reduce-scatters the gradients and the
  step all-gathers the parameters (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``), the
  memory layout ``memory/estimate.py`` assumes for the 32B run. ``config_overrides={}`` keeps weight
  decay on biases and norms, as the CPU path does. NOT RUN ON A GPU YET: written from the
  megatron-core 0.16.1 sources; no test here can execute it.
* ``CpuAdamW`` (CPU): a plain ``torch.optim.AdamW`` over the parameters, the gradients taken from
  DDP's ``main_grad`` buffers, the global norm over the TP group computed here. megatron's
  optimizers cannot run on CPU: ``FP32Optimizer.__init__`` allocates ``device='cuda'`` and
  ``DistributedOptimizer`` accepts only ``torch.cuda`` parameters (``optimizer/optimizer.py``,
  ``optimizer/distrib_optimizer.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rollplex_train.config import ActorConfig

log = logging.getLogger(__name__)


class CpuAdamW:
    """``torch.optim.AdamW`` over the Megatron DDP main grads (CPU runs).

    Args:
        params: trainable parameters (each with DDP's ``main_grad``). actor: lr, betas, weight decay.
        tp_rank, tp_group: this rank's TP coordinates (the norm counts replicated tensors once).
    """

    description = ("torch.optim.AdamW over Megatron DDP main grads: megatron's optimizers need CUDA "
                   "(FP32Optimizer allocates on 'cuda', DistributedOptimizer takes torch.cuda parameters only)")

    def __init__(self, params: list[torch.nn.Parameter], actor: ActorConfig, tp_rank: int, tp_group):
        self.params, self.tp_rank, self.tp_group = params, tp_rank, tp_group
        self.optimizer = torch.optim.AdamW(params, lr=actor.lr, betas=tuple(actor.betas),
                                           weight_decay=actor.weight_decay)

    def take_grads(self) -> None:
        """After DDP's sync: the main grads become the parameters' ``.grad``."""
        for p in self.params:
            p.grad = p.main_grad

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global norm over the TP group, counting replicated tensors once
        (megatron-core ``optimizer/clip_grads.py::get_grad_norm_fp32`` with
        ``param_is_not_tensor_parallel_duplicate``); the scale is torch's ``clip_grad_norm_``:
        ``min(1, max_norm / (norm + 1e-6))``."""
        squares = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                squares += p.grad.double().pow(2).sum()
        torch.distributed.all_reduce(squares, group=self.tp_group)
        norm = float(squares.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))
        if scale < 1.0:
            for p in self.params:
                p.grad.mul_(scale)
        return norm

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def inner(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers holding the Adam states."""
        return [self.optimizer]

    def save(self, directory: Path, writer: bool) -> dict:
        """The state to store in ``optim.pt`` (only ``writer`` stores it)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load(self, directory: Path, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class DistributedAdam:
    """megatron's distributed optimizer over ``ddp`` (CUDA runs; see the module docstring).

    Args:
        ddp: the Megatron ``DistributedDataParallel`` built with ``use_distributed_optimizer=True``.
        actor: lr, betas, weight decay. bf16: the parameters are bf16 (fp32 main parameters kept).
    """

    description = ("megatron DistributedOptimizer (get_megatron_optimizer, use_distributed_optimizer=True): "
                   "Adam states and fp32 main params sharded over the DP group")

    def __init__(self, ddp, actor: ActorConfig, bf16: bool):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(optimizer="adam", lr=actor.lr, weight_decay=actor.weight_decay,
                                 adam_beta1=actor.betas[0], adam_beta2=actor.betas[1], bf16=bf16,
                                 params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                 use_distributed_optimizer=True, clip_grad=0.0)  # the loop clips
        self.optimizer = get_megatron_optimizer(config, [ddp], config_overrides={})

    def take_grads(self) -> None:
        """Copy the reduce-scattered main grads into the fp32 main parameters' grads."""
        self.optimizer.prepare_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        """megatron's fp32 global norm (over DP shards and TP, duplicates once) and clip, same
        scale ``min(1, max_norm / (norm + 1e-6))`` (``optimizer/clip_grads.py``)."""
        return float(self.optimizer.clip_grad_norm(max_norm))

    def step(self, lr: float) -> None:
        """Adam on the main shards, copy into the model params, all-gather them over DP."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step_with_ready_grads()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def inner(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer for o in self.optimizer.chained_optimizers if o.optimizer is not None]

    def save(self, directory: Path, writer: bool) -> dict:
        """Collective over the DP group: the sharded Adam states and main params gathered to DP rank
        0 into ``optim_params.pt`` (``save_parameter_state``); returns the rest for ``optim.pt``."""
        self.optimizer.save_parameter_state(str(directory / "optim_params.pt"))
        return {"optimizer": self.optimizer.state_dict()}

    def load(self, directory: Path, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_parameter_state(str(directory / "optim_params.pt"))


def build_optimizer(ddp, params: list[torch.nn.Parameter], actor: ActorConfig, device: torch.device,
                    tp_rank: int, tp_group):
    """``DistributedAdam`` on CUDA, ``CpuAdamW`` on CPU; logs which one runs and why (one line)."""
    if device.type == "cuda":
        optimizer = DistributedAdam(ddp, actor, bf16=params[0].dtype == torch.bfloat16)
    else:
        optimizer = CpuAdamW(params, actor, tp_rank, tp_group)
    log.info("megatron optimizer on %s: %s", device, optimizer.description)
    return optimizer


class AdamStateOffload:
    """Offload and prefetch of the Adam states (``exp_avg``, ``exp_avg_sq``) of an optimizer's
    inner torch optimizers, through ``memory.offload.ModuleOffloader`` (pinned host buffers and a
    side-stream prefetch on CUDA). The distributed optimizer's fp32 main parameters stay resident.

    Args:
        module: the actor (its device and pinning). optimizer: a ``CpuAdamW`` or ``DistributedAdam``.
    """

    def __init__(self, module: torch.nn.Module, optimizer):
        from rollplex_train.memory.offload import ModuleOffloader

        self.offloaders = [ModuleOffloader(module, inner) for inner in optimizer.inner()]

    def offload(self) -> int:
        return sum(o.offload(("optimizer",)) for o in self.offloaders)

    def onload(self) -> int:
        moved = 0
        for o in self.offloaders:
            pending = o.prefetch(("optimizer",))
            pending.wait()
            moved += pending.nbytes
        return moved
