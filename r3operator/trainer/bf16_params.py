"""Under bf16 autocast, every forward reads each fp32 master parameter at its bf16 value.

Why: the engines hold the weights the sync sent, each fp32 master rounded to bf16. Autocast casts the
weight of a matmul to bf16 (the same round-to-nearest), but the operations it leaves in fp32 (the embedding
lookup, the RMSNorm weight's product, anything else off autocast's bf16 list) would read the unrounded fp32
value. Before the first update the masters are the bf16 checkpoint's and the two agree; after
it they do not, and the trainer's logprobs drift from the engine's (docs/runtime.md, "Numerics").

How: a forward pre-hook on every module that owns parameters swaps each fp32 parameter for
`_RoundToBf16.apply(p)` for that module's forward and puts the parameter back after it, so the value is the
bf16 rounding while the gradient reaches the fp32 master unchanged (straight-through) and the optimizer
steps the masters in fp32. The hooks act only while bf16 autocast is on for the parameter's device, which:

- leaves the canary's fp32 forward (no autocast) and `trainer.fsdp.paramDtype: float32` reading fp32;
- covers the recompute of gradient checkpointing, which re-enters the forward's autocast state;
- works under FSDP2, whose pre-forward hook on an enclosing module has put the unsharded parameter in place
  before the leaf module's own hook runs.

`nn.Linear` is skipped: `F.linear` under autocast already rounds its weight and bias to bf16, so rounding
them first would change nothing and cost a copy of every projection.
"""

from __future__ import annotations

from typing import Any

# Any: torch modules and their parameters, imported lazily (trainer/ loads torch when a trainer is built): Any here.


def _round_to_bf16_function() -> Any:
    import torch

    class _RoundToBf16(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, param: torch.Tensor) -> torch.Tensor:
            return param.to(torch.bfloat16).to(param.dtype)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    return _RoundToBf16


class Bf16ParameterRounding:
    """The hooks of one model; `remove()` takes them off."""

    def __init__(self, model: Any) -> None:
        import torch

        self._round = _round_to_bf16_function()
        self._swapped: dict[int, dict[str, Any]] = {}
        self._handles: list[Any] = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) or not any(True for _ in module.parameters(recurse=False)):
                continue
            self._handles.append(module.register_forward_pre_hook(self._before))
            self._handles.append(module.register_forward_hook(self._after, always_call=True))

    def _before(self, module: Any, args: Any) -> None:
        import torch

        swapped: dict[str, Any] = {}
        for name, param in module._parameters.items():
            if param is None or param.dtype != torch.float32:
                continue
            device_type = param.device.type
            if not torch.is_autocast_enabled(device_type) or torch.get_autocast_dtype(device_type) != torch.bfloat16:
                continue
            swapped[name] = param
        for name, param in swapped.items():
            module._parameters[name] = self._round.apply(param)
        if swapped:
            self._swapped[id(module)] = swapped

    def _after(self, module: Any, args: Any, output: Any) -> None:
        for name, param in self._swapped.pop(id(module), {}).items():
            module._parameters[name] = param

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


_ATTRIBUTE = "_r3operator_bf16_rounding"


def install(model: Any) -> Bf16ParameterRounding:
    """Hook `model` (an HF model, FSDP2-wrapped or not, or a Megatron GPTModel) after any wrapping. Once per
    model: a second set of hooks would put back the first set's rounded tensor instead of the parameter."""
    existing: Bf16ParameterRounding | None = getattr(model, _ATTRIBUTE, None)
    if existing is not None:
        return existing
    rounding = Bf16ParameterRounding(model)
    setattr(model, _ATTRIBUTE, rounding)
    return rounding


def uninstall(model: Any) -> None:
    """Take the hooks off (benchmarks compare against the forwards without them)."""
    rounding: Bf16ParameterRounding | None = getattr(model, _ATTRIBUTE, None)
    if rounding is not None:
        rounding.remove()
        delattr(model, _ATTRIBUTE)
