"""Staging a checkpoint's state into host memory off the training step, with DCP's `DefaultStager`.

A save copies the live state (fp32 weights + AdamW moments, 12 bytes a parameter) into host memory
(staging), then a background thread writes the copy to disk. `DefaultStager` does the copy in a thread
of its own too, so `dcp.async_save` returns as soon as the copy is enqueued; the save hands back two
futures, one for the copy (`staged`) and one for the write (`written`).

On CUDA the copy goes into pinned host buffers on a side stream (`non_blocking`): pinned memory is what
lets the device-to-host copy run at PCIe speed without an extra bounce buffer. The stager caches its
buffers by the source tensor's storage, so a trainer whose parameters and AdamW state live for the whole
run (hf_policy, FSDP2 shards) pins them once and reuses them at every save. Without CUDA (tests, CPU
runs) nothing can be pinned and there is no stream: the copy is a plain one, still in the stager's
thread, so it still overlaps with what follows the save.

What the overlap demands of the caller: nothing may change the live tensors until `staged` is done.
`ShardedCheckpointer` enforces it (an optimizer step pre-hook, and a wait before any load).

torch 2.11 (the GPU image's) closes the stager's inner `StateDictStager` at the end of every stage: that
empties its deepcopy dispatch table and its buffer cache, so a second stage through the same
`DefaultStager` fails (`KeyError: <class 'type'>`) and nothing is reused anyway. `stager_is_reusable`
finds that out by staging a small state twice; where it is not, the checkpointer takes a fresh stager
for every save (on CUDA its pinned buffers are then pinned anew at each save, as that torch does itself).
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SaveInFlight:
    staged: Future[Any]
    """Done once the live tensors have been copied: from then on they may change."""
    written: Future[Any]
    """Done once this rank's files are on disk (DCP fsyncs them); carries the save's error."""


def state_on_cuda(state: Any) -> bool:
    """Whether any tensor in the (nested) state lives on a CUDA device (DTensor shards included)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" for leaf in tree_leaves(state))


def staging_options(*, cuda: bool) -> Any:
    """`StagingOptions` for a state on CUDA (pinned buffers, side-stream non-blocking copy) or not (plain
    copy). Always asynchronous staging; never shared memory: the writer is a thread of this process
    (`AsyncCheckpointerType.THREAD`), so no other process reads the buffers."""
    from torch.distributed.checkpoint.staging import StagingOptions

    names = {f.name for f in dataclasses.fields(StagingOptions)}
    # torch 2.8 spelled the non-blocking flag `use_cuda_non_blocking_copy`; 2.9+ `use_non_blocking_copy`.
    non_blocking = "use_non_blocking_copy" if "use_non_blocking_copy" in names else "use_cuda_non_blocking_copy"
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, **{non_blocking: cuda}
    )


def new_stager(state: Any) -> Any:
    """A `DefaultStager` for this state's device. Build it at the first save, after the model is on its
    device: the stager creates its CUDA side stream at construction."""
    from torch.distributed.checkpoint.staging import DefaultStager

    return DefaultStager(staging_options(cuda=state_on_cuda(state)))


@functools.cache
def stager_is_reusable() -> bool:
    """Whether one `DefaultStager` can stage more than once in this torch (see the module's docstring).
    Found by doing it, on CPU and synchronously, with the kinds of objects a policy state holds (nested
    dicts, a list, a tuple, tensors): a version check would have to guess which releases are affected."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    options = staging_options(cuda=False)
    options.use_async_staging = False
    probe = {"model": {"w": torch.zeros(2)}, "optimizer": {"param_groups": [{"betas": (0.9, 0.999)}]}}
    stager = DefaultStager(options)
    try:
        for _ in range(2):
            stager.stage(probe)
    except KeyError:
        return False
    finally:
        stager.close()
    return True


def start_save(state: dict[str, Any], directory: Path, *, stager: Any, process_group: Any) -> SaveInFlight:
    """`dcp.async_save` through `stager`, the write in a thread of this process."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save

    if state_on_cuda(state):
        # DefaultStager's side stream does not wait for the compute stream: the last optimizer step's
        # kernels must be done before the copy reads the weights they write.
        torch.cuda.current_stream().synchronize()
    response = async_save(
        state,
        checkpoint_id=str(directory),
        process_group=process_group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=stager,
    )
    if isinstance(response, AsyncSaveResponse):  # the stager staged in its thread
        return SaveInFlight(staged=response.staging_completion, written=response.upload_completion)
    staged: Future[Any] = Future()  # a synchronous stager: the copy is done when async_save returns
    staged.set_result(None)
    return SaveInFlight(staged=staged, written=response)
