"""A trainer over many processes: one Ray actor per rank (one per GPU of the RayJob, or a chosen number
of CPU processes), torch.distributed between them (NCCL + gloo on GPU, gloo on CPU). What each rank
builds is the `RankBuilder`'s choice: `PolicyOptions` (HF model, FSDP2 sharding the model and AdamW
state over all ranks: every rank is its own data-parallel replica) or
`megatron.ranks.MegatronOptions` (megatron-core TP/EP/SP groups; ranks of one TP group form one
data-parallel replica). `DistributedTrainer` is the driver's `Trainer`: each call fans out to every
rank and gathers the answers of one rank per data-parallel replica, so the step loop does not know
how many ranks there are.

- Rendezvous: rank 0's actor picks its node's address and a free port; the driver passes both to
  every rank (`fsdp.init_rank`). On GPU the ranks sit in one placement group (PACK: ranks of one node
  are neighbours), one GPU each.
- Data: the driver builds the step's batch on CPU and puts each data-parallel replica's slice (its
  rows, their routed-experts arrays, old logprobs and replay ids) in the Ray object store: one object
  per replica per call, read by every rank of that replica (a TP/EP group needs the same rows and
  routes on each of its ranks), never the whole batch to every rank. `trainer/shards.py` says which
  rows go where and how the per-replica losses are weighted so that the update equals the
  single-process one.
- Weight sync: every rank takes part in gathering each parameter (FSDP: `DTensor.full_tensor`, one at a
  time; Megatron: `hf_state_dict`). On the packed path rank 0 packs the full tensors exactly as the
  single-process trainer does (wire/weights.py) and streams the chunks back to the driver (a Ray streaming
  generator); on vLLM's native NCCL path rank 0 sends them to the engines itself (`on_every_rank` runs
  weightsync/rank_sync.py's part on each rank).
- Checkpoints: each rank writes its part of a DCP checkpoint asynchronously (`sharded_checkpoint.py`;
  FSDP: its shard; Megatron: the gathered state, each tensor written once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from r3operator.api.enums import ReplayMode
from r3operator.trainer.base import CanaryForward, OldPass, UpdateStats, greedy_decode, old_pass_for
from r3operator.trainer.batch import TrainBatch
from r3operator.trainer.shards import Share, ShareStats, combine_update, forward_rows, update_plan
from r3operator.wire.weights import PackedChunk, checkpoint_tensors, chunk_tensors, pack_chunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

PLACEMENT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankRole:
    """A rank's place in the data-parallel dimension: which replica's rows it gets, and whether its
    results are that replica's answer (one rank per replica answers; its TP/EP peers computed the same)."""

    dp_rank: int
    dp_size: int
    answers: bool


class RankBuilder(Protocol):
    """What a rank builds once its process group is up (picklable: it travels to the rank actors)."""

    @property
    def compute_dtype(self) -> str:
        """Of the training forwards (bfloat16 autocast or float32)."""
        ...

    def build(self, model_dir: Path, device: str, *, rank: int, world_size: int) -> tuple[Any, RankRole]:
        """This rank's trainer (`update_shares`, `sft_share` and the `Trainer` state calls) and its role."""
        ...


@dataclass(frozen=True)
class PolicyOptions:
    """What every rank builds its `PolicyTrainer` with: FSDP2 over all ranks, each its own replica."""

    learning_rate: float
    seed: int
    compute_dtype: str = "bfloat16"
    reshard_after_forward: bool = True
    gradient_checkpointing: bool = False
    micro_batch_tokens: int | None = None

    def build(self, model_dir: Path, device: str, *, rank: int, world_size: int) -> tuple[Any, RankRole]:
        from r3operator.trainer.hf_policy import PolicyTrainer

        trainer = PolicyTrainer(
            model_dir,
            device=device,
            learning_rate=self.learning_rate,
            seed=self.seed,
            use_fsdp=True,
            compute_dtype=self.compute_dtype,
            fsdp_options={"reshard_after_forward": self.reshard_after_forward},
            gradient_checkpointing=self.gradient_checkpointing,
            micro_batch_tokens=self.micro_batch_tokens,
        )
        return trainer, RankRole(dp_rank=rank, dp_size=world_size, answers=True)


@dataclass
class UpdateSlice:
    """One rank's input to the update: its rows of the batch and of the old-logprob pass."""

    batch: TrainBatch
    old_logprobs: torch.Tensor
    replay_ids: torch.Tensor | None
    replay_pad: torch.Tensor | None


def batch_to(batch: TrainBatch, device: str) -> TrainBatch:
    changes = {
        f.name: getattr(batch, f.name).to(device) for f in fields(batch) if hasattr(getattr(batch, f.name), "to")
    }
    return replace(batch, **changes)


def _to(value: Any, device: str) -> Any:
    return None if value is None else value.to(device)


class TrainerRank:
    """One rank in its own Ray actor process: the trainer its `RankBuilder` builds over all ranks."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.trainer: Any = None
        self.role = RankRole(dp_rank=rank, dp_size=world_size, answers=True)

    def address(self) -> tuple[str, int]:
        """This node's address and a free port: the rendezvous of the process group (rank 0)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def start(self, master_addr: str, master_port: int, model_dir: str, options: RankBuilder) -> dict[str, Any]:
        from r3operator.trainer import fsdp

        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(0)  # Ray gave this actor one GPU: CUDA_VISIBLE_DEVICES holds only it
        fsdp.init_rank(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=self.device,
        )
        self.trainer, self.role = options.build(
            Path(model_dir), self.device, rank=self.rank, world_size=self.world_size
        )
        return {"pad_id": self.trainer.pad_id, "eos_id": self.trainer.eos_id, "role": self.role}

    def old_logprobs(self, batch: TrainBatch, mode: ReplayMode) -> OldPass:
        old = self.trainer.old_logprobs(batch_to(batch, self.device), mode)
        entropy = None if old.entropy is None else old.entropy.cpu()
        calls = None if old.hook_calls is None else {self.rank: dict(old.hook_calls[0])}
        return OldPass(
            old.logprobs.cpu(),
            old.natural_ids.cpu(),
            old.used_ids.cpu(),
            None,
            None,
            mode,
            entropy=entropy,
            hook_calls=calls,
        )

    def update(
        self,
        part: UpdateSlice,
        shares: Sequence[Share],
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> list[ShareStats]:
        return self.trainer.update_shares(
            batch_to(part.batch, self.device),
            _to(part.old_logprobs, self.device),
            _to(part.replay_ids, self.device),
            _to(part.replay_pad, self.device),
            shares,
            clip_low=clip_low,
            clip_high=clip_high,
            importance_cap=importance_cap,
            clip_ratio_c=clip_ratio_c,
        )

    def sft(self, part: tuple[list[list[int]], list[list[int]], bool], total_tokens: int) -> tuple[float, int]:
        prompts, answers, padding = part
        return self.trainer.sft_share(
            prompts, answers, total_tokens=total_tokens, world=self.role.dp_size, padding=padding
        )

    def canary_logits(self, sequence: list[int]) -> torch.Tensor:
        return self.trainer.canary_logits(sequence)

    def canary_forward(
        self, sequence: list[int], routes: torch.Tensor, route_pad: torch.Tensor, compute: bool
    ) -> CanaryForward:
        return self.trainer.canary_forward(sequence, routes, route_pad, compute=compute)

    def sync_chunks(self, chunk_size_mb: int, dtype_name: str | None) -> Iterator[PackedChunk]:
        """Rank 0 yields the packed chunks; every other rank only takes part in each gather."""
        import torch

        dtype = None if dtype_name is None else getattr(torch, dtype_name)
        tensors = checkpoint_tensors(self.trainer.sync_state_dict(), dtype=dtype, device=None)
        if self.rank != 0:
            for _ in tensors:
                pass
            return
        for chunk in chunk_tensors(tensors, chunk_size_mb=chunk_size_mb):
            yield pack_chunk(chunk)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`fn(trainer, rank, *args)` in this rank's process: work of a higher layer that must run where the
        weights are (weightsync/rank_sync.py sends them from here)."""
        return fn(self.trainer, self.rank, *args)

    def model_state_dict(self) -> dict[str, Any]:
        return self.trainer.model_state_dict()  # full on rank 0 (FSDP: empty elsewhere, cpu_offload)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.trainer.optimizer_state_dict()

    def load_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        self.trainer.load_state(model_sd, optim_sd)

    def save_checkpoint_async(self, directory: str) -> None:
        self.trainer.save_checkpoint_async(Path(directory))

    def wait_checkpoint_staged(self) -> None:
        self.trainer.wait_checkpoint_staged()

    def wait_checkpoint(self) -> None:
        self.trainer.wait_checkpoint()

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(Path(directory))

    def peak_memory_bytes(self, reset: bool) -> int:
        """Peak GPU memory allocated by this rank (CPU: the process's peak resident set)."""
        if self.device.startswith("cuda"):
            import torch

            peak = int(torch.cuda.max_memory_allocated())
            if reset:
                torch.cuda.reset_peak_memory_stats()
            return peak
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class DistributedTrainer:
    """The driver's handle on `world_size` `TrainerRank` actors (Ray must be initialised)."""

    def __init__(self, model_dir: Path, *, world_size: int, device: str, options: RankBuilder) -> None:
        import ray

        if world_size < 1:
            raise ValueError(f"trainer ranks: expected at least 1, got {world_size}")
        if not ray.is_initialized():
            raise RuntimeError("DistributedTrainer: Ray is not initialised (the driver starts or joins it first)")
        self._ray = ray
        self.world_size = world_size
        self.device = device
        self.batch_device = "cpu"
        self.compute_dtype = options.compute_dtype
        self._placement: Any = None
        threads = str(max(1, (os.cpu_count() or 1) // world_size))
        # No Ray CPU for a rank: a local Ray has as few as 2 (setup.start_ray) and the ranks share the
        # cores with the engines; GPUs are the resource that places them.
        actor_options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            "max_concurrency": 1,
            "runtime_env": {
                "env_vars": {
                    "OMP_NUM_THREADS": threads,
                    "TOKENIZERS_PARALLELISM": "false",
                    "RAY_USAGE_STATS_ENABLED": "0",
                }
            },
        }
        if device.startswith("cuda"):
            self._placement = self._reserve_gpus(world_size)
            actor_options["num_gpus"] = 1
        actor = ray.remote(TrainerRank)
        self.ranks: list[Any] = []
        for rank in range(world_size):
            options_for_rank = dict(actor_options)
            if self._placement is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options_for_rank["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self._placement, placement_group_bundle_index=rank
                )
            self.ranks.append(actor.options(**options_for_rank).remote(rank, world_size, device))
        try:
            master_addr, master_port = ray.get(self.ranks[0].address.remote())
            infos = self._all(lambda r: r.start.remote(master_addr, master_port, str(model_dir), options))
        except BaseException:
            self.close()  # ranks that did start would otherwise wait in the rendezvous, holding their GPUs
            raise
        self.pad_id = int(infos[0]["pad_id"])
        self.eos_id = int(infos[0]["eos_id"])
        roles: list[RankRole] = [info["role"] for info in infos]
        self.dp_size = roles[0].dp_size
        self._replica_of = [role.dp_rank for role in roles]  # rank -> its data-parallel replica
        self._answering = sorted((i for i, role in enumerate(roles) if role.answers), key=lambda i: roles[i].dp_rank)
        if [roles[i].dp_rank for i in self._answering] != list(range(self.dp_size)):
            self.close()
            raise RuntimeError(f"trainer ranks: expected one answering rank per data-parallel replica, got {roles}")

    def _reserve_gpus(self, world_size: int) -> Any:
        from ray.util.placement_group import placement_group

        have = int(self._ray.cluster_resources().get("GPU", 0))
        if have < world_size:
            raise ValueError(
                f"trainer.nodes × trainer.gpusPerNode asks for {world_size} trainer GPUs, but the Ray cluster "
                f"has {have}; lower them (or --trainer-ranks) or give the RayJob more GPU workers"
            )
        group = placement_group([{"GPU": 1}] * world_size, strategy="PACK")
        try:
            self._ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{world_size} trainer GPUs were not free within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(engines on the same Ray cluster hold some?)"
            ) from None
        return group

    # -- fan-out ------------------------------------------------------------------------------------
    def _gather(self, refs: Sequence[Any]) -> list[Any]:
        """Every rank's result; the first rank failure is raised at once (the others would otherwise wait
        for it in a collective until the group's timeout)."""
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1)
            self._ray.get(ready)
        return list(self._ray.get(list(refs)))

    def _all(self, call: Callable[[Any], Any]) -> list[Any]:
        return self._gather([call(rank) for rank in self.ranks])

    def _per_replica(self, objects: Sequence[Any], call: Callable[[Any, int, Any], Any]) -> list[Any]:
        """`call(rank, replica, ref)` on every rank with its replica's object (put once per replica); the
        answering ranks' results, in replica order."""
        refs = [self._ray.put(obj) for obj in objects]
        results = self._gather(
            [call(rank, self._replica_of[i], refs[self._replica_of[i]]) for i, rank in enumerate(self.ranks)]
        )
        return [results[i] for i in self._answering]

    # -- Trainer ------------------------------------------------------------------------------------
    def old_logprobs(self, batch: TrainBatch, mode: ReplayMode) -> OldPass:
        import torch

        if mode is ReplayMode.R3 and batch.engine_routes is None:
            raise ValueError("R3 needs engine routes in the batch")
        split = forward_rows(batch.size, self.dp_size)
        answers = self._per_replica(
            [batch_to(batch.select(rows), "cpu") for rows, _padding in split],
            lambda rank, _replica, ref: rank.old_logprobs.remote(ref, mode),
        )
        parts = [part for part, (_rows, padding) in zip(answers, split, strict=True) if not padding]
        old = old_pass_for(
            mode,
            batch,
            torch.cat([p.logprobs for p in parts]).to(batch.input_ids.device),
            torch.cat([p.natural_ids for p in parts]),
            torch.cat([p.used_ids for p in parts]),
            hook_calls=_merged_hook_calls(answers),
        )
        if all(p.entropy is not None for p in parts):
            old.entropy = torch.cat([p.entropy for p in parts]).to(batch.input_ids.device)
        return old

    def update(
        self,
        batch: TrainBatch,
        old: OldPass,
        *,
        mini_batches: int,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> UpdateStats:
        import torch

        plans = update_plan(batch.response_mask.sum(dim=1).tolist(), mini_batches=mini_batches, world=self.dp_size)
        parts = []
        for plan in plans:
            idx = torch.as_tensor(plan.rows, dtype=torch.int64)
            parts.append(
                UpdateSlice(
                    batch_to(batch.select(plan.rows), "cpu"),
                    old.logprobs.cpu()[idx],
                    None if old.replay_ids is None else old.replay_ids.cpu()[idx],
                    None if old.replay_pad is None else old.replay_pad.cpu()[idx],
                )
            )
        return combine_update(
            self._per_replica(
                parts,
                lambda rank, replica, ref: rank.update.remote(
                    ref, plans[replica].shares, clip_low, clip_high, importance_cap, clip_ratio_c
                ),
            )
        )

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
        total = sum(len(a) for a in answers)
        split = forward_rows(len(prompts), self.dp_size)
        rows_of = [
            ([list(prompts[i]) for i in rows], [list(answers[i]) for i in rows], padding) for rows, padding in split
        ]
        parts = self._per_replica(rows_of, lambda rank, _replica, ref: rank.sft.remote(ref, total))
        return sum(loss * tokens for loss, tokens in parts) / max(total, 1)

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        return greedy_decode(self.canary_logits, prompts, max_tokens=max_tokens, eos_id=self.eos_id)

    def canary_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        """Every rank runs the forward (it gathers the shards); rank 0's logits are the answer."""
        return self._all(lambda r: r.canary_logits.remote(list(sequence)))[0]

    def canary_forward(
        self, sequence: Sequence[int], routes: torch.Tensor, route_pad: torch.Tensor, *, compute: bool = False
    ) -> CanaryForward:
        """Like `canary_logits`: every rank runs it, rank 0 answers."""
        return self._all(lambda r: r.canary_forward.remote(list(sequence), routes, route_pad, compute))[0]

    def weight_chunks(self, *, chunk_size_mb: int, dtype: torch.dtype | None) -> Iterator[PackedChunk]:
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        streams = [
            rank.sync_chunks.options(num_returns="streaming").remote(chunk_size_mb, dtype_name) for rank in self.ranks
        ]
        for ref in streams[0]:
            yield self._ray.get(ref)
        for follower in streams[1:]:
            for ref in follower:  # none: a follower's stream only ends (or carries its error)
                self._ray.get(ref)

    def on_every_rank(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(trainer, rank, *args)` on every rank at once (a module-level function: Ray sends it by name),
        each rank's result in rank order; the first rank's failure is raised."""
        return self._all(lambda r: r.run.remote(fn, args))

    def model_state_dict(self) -> dict[str, Any]:
        return dict(self._all(lambda r: r.model_state_dict.remote())[0])

    def sync_state_dict(self) -> dict[str, Any]:
        return self.model_state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        return dict(self._all(lambda r: r.optimizer_state_dict.remote())[0])

    def load_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        model_ref, optim_ref = self._ray.put(model_sd), self._ray.put(optim_sd)
        self._all(lambda r: r.load_state.remote(model_ref, optim_ref))

    def save_checkpoint_async(self, directory: Path) -> None:
        self._all(lambda r: r.save_checkpoint_async.remote(str(directory)))

    def wait_checkpoint_staged(self) -> None:
        """Block until every rank has copied its state out of the live tensors (each rank's next optimizer
        step waits for its own copy anyway)."""
        self._all(lambda r: r.wait_checkpoint_staged.remote())

    def wait_checkpoint(self) -> None:
        self._all(lambda r: r.wait_checkpoint.remote())

    def load_checkpoint(self, directory: Path) -> None:
        self._all(lambda r: r.load_checkpoint.remote(str(directory)))

    def peak_memory_bytes(self, *, reset: bool = False) -> list[int]:
        return [int(b) for b in self._all(lambda r: r.peak_memory_bytes.remote(reset))]

    def close(self) -> None:
        """End the rank actors and free their GPUs. A save still in flight dies with them and stays an
        uncommitted temp dir: the driver finishes its checkpoints before it closes the trainer."""
        for rank in self.ranks:
            self._ray.kill(rank)
        self.ranks = []
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
            self._placement = None


def _merged_hook_calls(parts: Sequence[OldPass]) -> dict[int, dict[int, int]] | None:
    """Every answering rank's replay-hook counts (ranks padded with a dummy batch included: their hooks ran too)."""
    merged: dict[int, dict[int, int]] = {}
    for part in parts:
        merged.update(part.hook_calls or {})
    return merged or None
