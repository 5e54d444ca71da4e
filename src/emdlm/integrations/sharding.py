"""Sharded training (PyTorch FSDP2) for ``emdlm train``, and the full output embedding for the
from-hidden loss under FSDP2 or DeepSpeed ZeRO-3.

Sharding (:func:`shard_model`): ``torch.distributed.fsdp.fully_shard`` on every transformer
block (the model's ``_no_split_modules`` classes, or the names given), then on the root, over
all processes of the default process group (gloo on CPU, NCCL on GPU; launched with
``torchrun``). accelerate 1.15 shards only on multi-GPU-type devices, so emdlm applies FSDP2
itself and marks the model the way transformers 5.23 marks a model sharded at load time
(``from_pretrained(distributed_config=...)``): the Trainer then neither wraps it in DDP nor
shards it again, defers the gradient reduce-scatter to the last micro-batch of an accumulation
window, and gathers the full weights on save. Each rank keeps a 1/world slice (``Shard(0)``)
of every parameter; gradients are averaged over ranks as DDP's are, so
``average_tokens_across_devices`` keeps the loss exact.

The sharded head (:func:`gathered_head`): a from-hidden loss reads the output embedding's
weight without calling the head module, so no FSDP / ZeRO-3 hook gathers it. FSDP2's root
keeps its own parameters unsharded between forward and backward (a plain tensor then), but a
head in a resharded FSDP unit is a ``DTensor`` shard there, and under ZeRO-3 a partitioned
parameter holds 0 elements outside its module's forward. The helper gives the full weight:

- ``DTensor``: all-gathered to a plain tensor whose gradient is reduce-scattered back to the
  shard and averaged over ranks (FSDP's gradient semantics), in one autograd graph;
- ZeRO-3 (a parameter with ``ds_id``, deepspeed importable): inside
  ``deepspeed.zero.GatheredParameters``;
- otherwise the weight unchanged.

Then :func:`check_head_weight` refuses a weight that is not ``[out_features, in_features]`` of
the head, so a shard that slipped through is an error, never a softmax over part of the
vocabulary.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

FSDP_CONFIG_KEYS = ("transformer_layer_cls_to_wrap", "reshard_after_forward")


def check_fsdp_config(fsdp_config: Mapping[str, Any]) -> None:
    """ValueError for an unknown ``train.fsdp_config`` key or a value of the wrong type."""
    unknown = sorted(set(fsdp_config) - set(FSDP_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"train.fsdp_config: unknown key(s) {unknown}; known: {list(FSDP_CONFIG_KEYS)}"
        )
    names = fsdp_config.get("transformer_layer_cls_to_wrap")
    if names is not None and not (
        isinstance(names, list) and names and all(isinstance(n, str) for n in names)
    ):
        raise ValueError(
            "train.fsdp_config.transformer_layer_cls_to_wrap must be a non-empty list of module "
            f"class names, got {names!r}"
        )
    reshard = fsdp_config.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        raise ValueError(
            f"train.fsdp_config.reshard_after_forward must be true or false, got {reshard!r}"
        )


def shard_units(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The modules that become FSDP units below the root: instances of ``class_names`` (default:
    the model's ``_no_split_modules``, its transformer blocks). ValueError when none is found."""
    names = list(class_names) if class_names else list(
        getattr(model, "_no_split_modules", None) or []
    )
    if not names:
        raise ValueError(
            f"{type(model).__name__} does not name its transformer blocks (_no_split_modules): "
            "set train.fsdp_config.transformer_layer_cls_to_wrap to their class names"
        )
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        raise ValueError(
            f"no module of class {names} in {type(model).__name__}: fix "
            "train.fsdp_config.transformer_layer_cls_to_wrap"
        )
    return units


def shard_model(
    model: nn.Module, class_names: list[str] | None = None, reshard_after_forward: bool = True
) -> nn.Module:
    """Apply FSDP2 over every process of the default group: each unit of :func:`shard_units`,
    then the root (which takes the remaining parameters: embeddings, final norm, head).

    Call on every rank, after ``torch.distributed`` is initialised and before the optimizer is
    built. On CUDA the model is first moved to this rank's device. The model is then marked as
    transformers marks a model sharded at load time, so that ``transformers.Trainer`` trains it
    as it is (no DDP) and ``save_pretrained`` gathers the full weights on rank 0.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_model needs torch.distributed initialised (launch with torchrun)")
    world = dist.get_world_size()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        model.to(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    for unit in shard_units(model, class_names):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # What transformers' DistributedMixin.maybe_distribute_model sets for FSDP (5.23): read by
    # Trainer (skip DDP, defer gradient sync, save) and save_pretrained (gather on rank 0).
    model.config.distributed_config = DistributedConfig(fsdp_size=world)
    model._is_distributed_loading_by_transformers = True
    model._is_fsdp_managed_module = True
    return model


def local_fraction(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the full model) over the parameters: about
    1/world each under FSDP, equal when not sharded."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for p in model.parameters():
        full += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, full


def world_size_from_env() -> int:
    """The launcher's process count (``WORLD_SIZE``; 1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None  # None: scale


def full_tensor(weight: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` parameter as one plain full tensor, differentiable back to the shard.

    Forward: all-gather (``redistribute`` to ``Replicate``). Backward: each rank's gradient is a
    partial sum (``grad_placements=[Partial()]``), so it is reduce-scattered onto the shards and
    divided by the ranks' count: FSDP's own averaging of gradients. (``DTensor.full_tensor()``
    alone declares the gradient replicated, so each shard would keep only its own rank's part.)
    A plain tensor is returned unchanged.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(weight, DTensor):
        return weight
    mesh = weight.device_mesh
    full = weight.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(
        grad_placements=[Partial()] * mesh.ndim
    )
    return _ScaleGrad.apply(full, 1.0 / mesh.size())


def _zero3_partitioned(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The DeepSpeed ZeRO-3 parameters among ``params`` that are not gathered now."""
    return [
        p for p in params
        if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", "") != "AVAILABLE"
    ]


@contextlib.contextmanager
def gathered_head(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of the output embedding, full, for the duration of the block.

    FSDP2 ``DTensor``: :func:`full_tensor` (gradient back to the shards). DeepSpeed ZeRO-3:
    ``deepspeed.zero.GatheredParameters`` around the block (not run here: deepspeed is not
    installed in emdlm's test environment). Anything else: unchanged.
    """
    zero3 = _zero3_partitioned([t for t in (weight, bias) if t is not None])
    if zero3:
        try:
            import deepspeed
        except ImportError as err:  # a ds_id without deepspeed: not a ZeRO-3 parameter
            raise RuntimeError("a ZeRO-3 partitioned head, but no deepspeed") from err
        with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
            yield weight, bias
        return
    yield full_tensor(weight), (None if bias is None else full_tensor(bias))


def check_head_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, head: nn.Module, hidden_size: int
) -> None:
    """ValueError unless ``weight`` is the head's full ``[out_features, in_features]`` matrix
    (and ``bias`` its ``[out_features]``): a shard (FSDP ``Shard(0)`` rows, a 0-element ZeRO-3
    partition) would otherwise score only part of the vocabulary."""
    from torch.distributed.tensor import DTensor

    out_f = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
    in_f = getattr(head, "in_features", None) or getattr(head, "embedding_dim", None)
    expected = (out_f, in_f) if out_f is not None and in_f is not None else (None, hidden_size)
    shape = tuple(weight.shape)
    bad = isinstance(weight, DTensor) or shape[1:] != (expected[1],) or (
        expected[0] is not None and shape[0] != expected[0]
    )
    if not bad and bias is not None:
        bad = isinstance(bias, DTensor) or tuple(bias.shape) != (shape[0],)
    if bad:
        kind = "a DTensor" if isinstance(weight, DTensor) else "a plain tensor"
        raise ValueError(
            f"from_hidden: the output embedding weight reaching the loss is {kind} of shape "
            f"{list(shape)}, but the head maps {expected[1]} -> {expected[0]}: a shard of a "
            "sharded model (FSDP / ZeRO-3) reached the loss; gather it first "
            "(emdlm.integrations.sharding.gathered_head)"
        )


__all__ = [
    "check_fsdp_config", "check_head_weight", "full_tensor", "gathered_head", "local_fraction",
    "shard_model", "shard_units",
]
