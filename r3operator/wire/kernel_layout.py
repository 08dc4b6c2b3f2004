"""Trainer state dict → the engine's own parameters ("kernel format"): one tensor per vLLM parameter.

A checkpoint-format sync (wire/weights.py) sends HF names, experts unfused, and the engine's
`load_weights` maps every tensor onto its parameters inside vLLM's layerwise-reload bracket: ~300-450 µs
of engine host work per tensor (docs/benchmarks.md, "Where a sync's time goes"), 1,575 tensors for a3b.
A kernel-format sync sends each vLLM parameter whole, already fused, and the engine copies it in with one
`param.copy_` (vLLM 0.22.1's `start_weight_update(is_checkpoint_format=False)`): 39 tensors for a3b.

The fusions are vLLM's (its Qwen3-MoE `load_weights` builds them; tests/wire/test_kernel_layout.py
checks every parameter bit-equal against it):

- `…self_attn.qkv_proj.{weight,bias}` = cat(q_proj, k_proj, v_proj) along rows;
- `…gate_up_proj.weight` (a dense MLP or a shared expert) = cat(gate_proj, up_proj) along rows;
- `…mlp.experts[.<runner>].w13_weight` [E, 2I, H] = per expert cat(gate, up) rows, gate first: the
  transformers 5 fused `mlp.experts.gate_up_proj` as it is, or the per-expert checkpoint tensors stacked;
- `…mlp.experts[.<runner>].w2_weight` [E, H, I] = `mlp.experts.down_proj`, or the per-expert ones stacked;
- every other parameter: the trainer tensor of the same name.

Nothing about the engine is assumed: the plan is built from the parameters the engine reports (name,
dtype, shape; vLLM 0.22 names experts `mlp.experts.w13_weight`, 0.30 `mlp.experts.routed_experts.…`), and a
parameter with no source, a source of another shape, or a trainer tensor no parameter takes is an error
naming it. The plan is only right where the loaded layout is the served one (unquantized, one engine rank
holding whole parameters, no post-load repack): `api/rules.py` refuses the layout elsewhere.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3operator.wire.param_names import GATE_UP, checkpoint_parts
from r3operator.wire.weights import full_tensor

# Any: wire/ loads no framework at import: the tensors a parameter is built of, their dtype and device are Any here.


class KernelLayoutError(ValueError):
    """The trainer's tensors cannot be laid out as the engine's parameters (the message names which)."""


COMMIT_DTYPE = "int32"
"""The torch dtype (by name) of the commit flag a direct kernel-layout sync ends with (weightsync/direct.py): one
element, 1 when every parameter went out, 0 when the trainer failed and sent zeros instead, so that the engine
aborts its bracket instead of stamping the policy."""


@dataclass(frozen=True, slots=True)
class EngineParameter:
    """One parameter as the engine reports it (`r3_parameter_metadata` of the worker extension)."""

    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. "bfloat16"."""
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Source:
    """How one engine parameter is built from the trainer's state dict.

    kind: "same" (one tensor as it is), "rows" (cat along dim 0), "fused_w13" (the fused HF gate_up_proj
    [E, 2I, H], halves in `order`), "experts_rows" (per expert: cat of its tensors along rows, stacked),
    "fused_w2" (the fused HF down_proj as it is).
    """

    parameter: EngineParameter
    kind: str
    parts: tuple[str, ...]
    experts: int = 0
    order: tuple[str, str] = GATE_UP
    """For "fused_w13": the order of the halves wanted in the parameter."""


def engine_parameters(rows: Sequence[Sequence[Any]]) -> list[EngineParameter]:
    """(name, dtype, shape) rows, as they come over an RPC (lists), to `EngineParameter`s."""
    out = []
    for row in rows:
        name, dtype, shape = row
        out.append(EngineParameter(str(name), str(dtype).removeprefix("torch."), tuple(int(d) for d in shape)))
    return out


def _numel_rows(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of cat(…, dim=0) of `shapes`, or () when their trailing dims differ."""
    tails = {s[1:] for s in shapes}
    if len(tails) != 1 or any(len(s) == 0 for s in shapes):
        return ()
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _source_for(param: EngineParameter, trainer: Container[str], order: tuple[str, str]) -> Source:
    """`trainer`: the names of the trainer's tensors (only membership is asked)."""
    kind, parts, experts = checkpoint_parts(param.name, param.shape, trainer, order)
    return Source(param, kind, parts, experts=experts, order=order if kind == "fused_w13" else GATE_UP)


def _built_shape(source: Source, trainer: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    shapes = [trainer[p] for p in source.parts]
    if source.kind in ("same", "fused_w13", "fused_w2"):
        return shapes[0]
    if source.kind == "rows":
        return _numel_rows(shapes)
    per = len(source.parts) // max(source.experts, 1)
    blocks = {_numel_rows(shapes[i : i + per]) for i in range(0, len(shapes), per)}
    if len(blocks) != 1 or () in blocks:
        return ()
    return (source.experts, *blocks.pop())


def plan_kernel_layout(
    trainer: Mapping[str, tuple[int, ...]],
    engine: Sequence[EngineParameter],
    *,
    order: tuple[str, str] = GATE_UP,
) -> list[Source]:
    """The source of every engine parameter, checked: each source tensor exists, the built shape is the
    parameter's, and every trainer tensor goes into exactly one parameter. `trainer`: name → shape of the
    trainer's state dict (an FSDP2 DTensor's global shape). Raises `KernelLayoutError` naming the parameter
    or tensor at fault."""
    plan = [_source_for(p, trainer, order) for p in engine]
    used: dict[str, str] = {}
    for source in plan:
        missing = [p for p in source.parts if p not in trainer]
        if missing:
            raise KernelLayoutError(
                f"engine parameter {source.parameter.name} {list(source.parameter.shape)}: the trainer's state "
                f"dict has no {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        built = _built_shape(source, trainer)
        if built != source.parameter.shape:
            shown = ", ".join(f"{p} {list(trainer[p])}" for p in source.parts[:3])
            raise KernelLayoutError(
                f"engine parameter {source.parameter.name} has shape {list(source.parameter.shape)}, but the "
                f"trainer's {shown}{' …' if len(source.parts) > 3 else ''} make {list(built) or 'no single tensor'}"
                " (a tensor-parallel engine holds shards: the kernel layout needs whole parameters)"
            )
        for part in source.parts:
            if part in used:
                raise KernelLayoutError(
                    f"trainer tensor {part} would go into two engine parameters: {used[part]} and "
                    f"{source.parameter.name}"
                )
            used[part] = source.parameter.name
    unused = [name for name in trainer if name not in used]
    if unused:
        raise KernelLayoutError(
            f"trainer tensor {unused[0]} {list(trainer[unused[0]])} goes into no engine parameter"
            + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
            + ": the engine's model is not the trainer's"
        )
    return plan


def trainer_shapes(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """name → shape of a state dict without materialising anything (a DTensor's shape is its global one)."""
    return {name: tuple(int(d) for d in tensor.shape) for name, tensor in state_dict.items()}


def kernel_metadata(plan: Sequence[Source], *, dtype: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(engine parameter, dtype, shape) of every tensor `kernel_tensors` yields, in the same order."""
    return [(s.parameter.name, dtype, s.parameter.shape) for s in plan]


def as_parameter(source: Source, parts: Sequence[Any], *, dtype: Any, device: Any) -> Any:
    """The trainer tensor itself when it already IS the engine parameter (one part, taken whole, in `dtype`, on
    `device`, contiguous): a ranked trainer's gathered copy, or a bf16 trainer. None when it must be built."""
    if len(parts) != 1 or source.kind not in ("same", "fused_w2", "fused_w13"):
        return None
    if source.kind == "fused_w13" and source.order != GATE_UP:
        return None
    part = parts[0]
    if dtype is not None and part.dtype != dtype:
        return None
    if device is not None and part.device != _device(device):
        return None
    return part if part.is_contiguous() and tuple(part.shape) == source.parameter.shape else None


def _device(device: Any) -> Any:
    import torch

    wanted = torch.device(device)
    if wanted.type == "cuda" and wanted.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return wanted


def build_parameter(out: Any, source: Source, parts: Sequence[Any]) -> Any:
    """Write the engine parameter of `source` into `out` (its shape, the engine's dtype, any device) from the
    whole trainer tensors `parts`: one `copy_` per part or half, each casting and moving as it copies, so no
    intermediate tensor is made. Returns `out`."""
    kind = source.kind
    if kind in ("same", "fused_w2") or (kind == "fused_w13" and source.order == GATE_UP):
        # transformers 5 fuses gate rows first, as vLLM does: the fused tensor goes as it is
        out.copy_(parts[0])
    elif kind == "fused_w13":
        fused = parts[0]
        half = fused.shape[1] // 2
        out[:, : fused.shape[1] - half].copy_(fused[:, half:])
        out[:, fused.shape[1] - half :].copy_(fused[:, :half])
    elif kind == "rows":
        _rows_into(out, parts)
    else:
        per = len(parts) // source.experts
        for expert in range(source.experts):
            _rows_into(out[expert], parts[expert * per : (expert + 1) * per])
    return out


def _rows_into(out: Any, parts: Sequence[Any]) -> None:
    row = 0
    for part in parts:
        out[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]


def parameter_pieces(source: Source, parts: Sequence[Any]) -> list[Any]:
    """The trainer tensors (or views of them) whose concatenation, flat and in order, IS `source`'s engine parameter:
    vLLM's fusions are all concatenations along rows (the module doc), so its pieces are the parts in the plan's order,
    except a fused gate_up_proj wanted with its halves swapped, which is per expert its second half, then its first.

    Written apart from `build_parameter`: the receipt fingerprints these pieces, where the trainer holds them, and
    composes the parameter's fingerprint from theirs (`add_parameter_pieces`), so a builder that writes a piece
    into the wrong place fails the receipt instead of fingerprinting its own mistake."""
    if source.kind == "fused_w13" and source.order != GATE_UP:
        fused = parts[0]
        half = fused.shape[1] // 2
        return [piece for expert in fused for piece in (expert[half:], expert[:half])]
    return list(parts)


def add_parameter_pieces(log: Any, source: Source, parts: Sequence[Any], *, later: bool = False) -> None:
    """Fingerprint `source`'s engine parameter into `log` (wire/receipt.py `FingerprintLog`) from the trainer tensors
    `parts` themselves: each piece (`parameter_pieces`) cast to the parameter's dtype, at its offset in words
    (`add_part`). `later`: when the log is read (`add_part_later`), for tensors that stay as they are until then."""
    import torch

    dtype = getattr(torch, source.parameter.dtype)
    words_per_element = dtype.itemsize // 2
    if words_per_element < 1:
        raise KernelLayoutError(
            f"engine parameter {source.parameter.name} is {source.parameter.dtype}: the receipt places pieces by "
            "16-bit words"
        )
    add = log.add_part_later if later else log.add_part
    offset = 0
    for piece in parameter_pieces(source, parts):
        add(source.parameter.name, offset, piece, dtype=dtype)
        offset += piece.numel() * words_per_element


def kernel_tensors(
    state_dict: Mapping[str, Any], plan: Sequence[Source], *, dtype: Any = None, device: Any = "cpu"
) -> Iterator[tuple[str, Any]]:
    """Yield (engine parameter name, tensor) for every parameter of `plan`, contiguous, in `dtype` on
    `device`: the trainer tensor itself where it already is the parameter (`as_parameter`), else built by
    `build_parameter` into a new tensor (one pass over the bytes, casting and moving as it copies)."""
    import torch

    for source in plan:
        parts = [full_tensor(state_dict[p]) for p in source.parts]
        same = as_parameter(source, parts, dtype=dtype, device=device)
        if same is None:
            out = torch.empty(source.parameter.shape, dtype=dtype or parts[0].dtype, device=device)
            same = build_parameter(out, source, parts)
        yield source.parameter.name, same
