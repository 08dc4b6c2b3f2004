"""verl 0.9.1's configuration for the comparison, as the Hydra overrides of `verl.trainer.main_ppo` with its
Megatron engine (`model_engine=megatron` on its default `ppo_trainer` config, the form 0.9.1 recommends; the older
`--config-name=ppo_megatron_trainer` composes the same config and is marked deprecated there), each one matched to a
field of r3operator's RLJob: benchmarks/jobs/a3b-verl-peer.yaml (`Workload()`), or the learning benchmark's
(benchmarks/peers/verl_learning.py builds its `Workload` from benchmarks/learning.py's `Plan`). Every key set here is
one of verl 0.9.1's own (`verl/trainer/config/_generated_ppo_megatron_trainer.yaml` in its wheel:
benchmarks/peers/verl_reference.py checks them).

R3 in verl 0.9.1 is two switches (read from its source, not guessed): the rollout asks vLLM for the routed experts
(`actor_rollout_ref.rollout.enable_rollout_routing_replay`, which sets vLLM's `enable_return_routed_experts` and
needs vLLM ≥ 0.22.0) and the Megatron engine replays them (`actor_rollout_ref.actor.megatron.router_replay.mode=R3`,
`verl/utils/megatron/router_replay_{patch,utils}.py` over megatron-core's TopKRouter). Replay off is `mode=disabled`
with the rollout switch off. Router replay exists only on verl's Megatron and VeOmni engines, not its FSDP engine.

The two frameworks differ where they cannot be the same, and the table's reader must know it:
- verl colocates (its "hybrid engine"): every GPU holds a Megatron rank and a vLLM replica that sleeps during the
  update; r3operator's local runtime gives the vLLM engine `gpuMemoryUtilization` of one GPU and the trainer whole
  GPUs (docs/benchmarks.md, "Against verl", says what that costs on 2 GPUs).
- verl's Megatron trainer is bf16 with fp32 master weights in the distributed optimizer; r3operator's FSDP trainer
  keeps fp32 weights and computes under bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPLAY_MODES = ("R3", "disabled")
ATTENTION_BACKEND = "fused"
"""verl's Megatron attention: TE's FusedAttention (cuDNN). verl 0.9.1 defaults to `flash`, for which megatron-core
sets NVTE_FUSED_ATTN=0 and NVTE_UNFUSED_ATTN=0 and leaves TE only flash-attn, which has no wheel for torch 2.11 +
CUDA 13 (2026-11-27: "No dot product attention backend is available" in the first `compute_log_prob`). On Hopper
TE prefers FusedAttention over flash-attn when it may choose (`auto`), and verl's own Megatron examples set
`fused` (examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh). benchmarks/peers/te_preflight.py checks
it on the GPU before verl starts."""


@dataclass(frozen=True)
class Workload:
    """What both frameworks run; the defaults are benchmarks/jobs/a3b-verl-peer.yaml's."""

    prompts_per_step: int = 16
    group_size: int = 8
    max_prompt_tokens: int = 64
    max_response_tokens: int = 64
    temperature: float = 1.0
    learning_rate: float = 1e-5
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float = 3.0
    """r3operator's `algorithm.clipRatioC` default and verl's `actor.clip_ratio_c` default alike."""
    weight_decay: float = 0.0
    """r3operator's AdamW has none (trainer/hf_policy.py); verl's optimizer defaults to 0.01."""
    mini_batches: int = 2
    engine_memory_fraction: float = 0.3
    seed: int = 0
    eval_interval: int = 0
    """Held-out evaluation every N steps, after the last and before the first (verl's `test_freq`,
    `val_before_train`; r3operator's `evaluation.intervalSteps`, `beforeTraining`); 0: none."""
    eval_temperature: float | None = None
    """The held-out answers' sampling temperature (r3operator's `evaluation.temperature`); None: `temperature`."""
    eval_samples: int = 1
    """Answers per held-out prompt (verl's `val_kwargs.n`, r3operator's `evaluation.samplesPerPrompt`)."""
    micro_batch_tokens: int | None = None
    """Token budget of a micro-batch per GPU (verl's dynamic batch size, r3operator's `fsdp.microBatchTokens`);
    None: micro-batches of one prompt's group of sequences."""
    max_num_seqs: int | None = None
    """vLLM's `max_num_seqs` (r3operator's engine `--max-num-seqs`); None: verl's default (256)."""
    name: str = "a3b"

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


ENGINE_CHOICE = "model_engine=megatron"
"""The Hydra config-group choice of verl's Megatron engine: not a key of the config, the config it composes."""


def verl_overrides(
    *,
    model_dir: Path,
    data_dir: Path,
    reward_file: Path,
    gpus: int,
    steps: int,
    replay: str,
    log_file: Path,
    work: Workload = Workload(),
) -> list[str]:
    """The full override list (Hydra `key=value`) for one verl run."""
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay: expected one of {REPLAY_MODES}, got {replay!r}")
    if gpus < 1:
        raise ValueError(f"gpus: expected at least 1, got {gpus}")
    if work.prompts_per_step % work.mini_batches:
        raise ValueError(
            f"prompts_per_step {work.prompts_per_step} is not divisible by mini_batches {work.mini_batches}"
        )
    r3 = replay == "R3"
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    if work.micro_batch_tokens is None:  # micro-batches of one group's sequences, for training and old logprobs
        micro = [
            f"{actor}.ppo_micro_batch_size_per_gpu={work.group_size}",
            f"{rollout}.log_prob_micro_batch_size_per_gpu={work.group_size}",
        ]
    else:  # micro-batches packed up to a token budget per GPU, as r3operator's microBatchTokens
        micro = [
            f"{actor}.use_dynamic_bsz=True",
            f"{actor}.ppo_max_token_len_per_gpu={work.micro_batch_tokens}",
            f"{rollout}.log_prob_max_token_len_per_gpu={work.micro_batch_tokens}",
        ]
    if work.eval_interval > 0:
        # The held-out split, scored before the first step and every `eval_interval` steps (and after the last), by
        # answers sampled as r3operator's `spec.evaluation` samples them (by default one per prompt at the rollout
        # temperature, runtime/evaluation.py), where verl's own default is one greedy answer
        # (`val_kwargs.temperature: 0`, `do_sample: False`).
        eval_temperature = work.temperature if work.eval_temperature is None else work.eval_temperature
        validation = [
            f"data.val_files={data_dir / 'val.parquet'}",
            "trainer.val_before_train=True",
            f"trainer.test_freq={work.eval_interval}",
            f"{rollout}.val_kwargs.temperature={eval_temperature}",
            f"{rollout}.val_kwargs.n={work.eval_samples}",
            f"{rollout}.val_kwargs.do_sample={eval_temperature > 0}",
            f"{rollout}.val_kwargs.top_p=1.0",
            f"{rollout}.val_kwargs.top_k=-1",
        ]
    else:  # verl insists on a validation file; it is never read with test_freq -1 and no validation before training
        validation = [
            f"data.val_files={data_dir / 'test.parquet'}",
            "trainer.val_before_train=False",
            "trainer.test_freq=-1",
        ]
    engine_seqs = [] if work.max_num_seqs is None else [f"{rollout}.max_num_seqs={work.max_num_seqs}"]
    return [
        # GRPO on the parquet, same prompts and lengths
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=True",  # (r - mean) / (std + eps), as r3operator's GRPO
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.train_batch_size={work.prompts_per_step}",
        f"data.max_prompt_length={work.max_prompt_tokens}",
        f"data.max_response_length={work.max_response_tokens}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=True",
        f"data.seed={work.seed}",
        f"reward.custom_reward_function.path={reward_file}",
        "reward.custom_reward_function.name=compute_score",
        # the model and the trainer: Megatron, experts split over the GPUs, no offload
        f"actor_rollout_ref.model.path={model_dir}",
        f"{actor}.strategy=megatron",
        f"{actor}.optim.lr={work.learning_rate}",
        f"{actor}.optim.weight_decay={work.weight_decay}",
        f"{actor}.optim.clip_grad=1.0",
        f"{actor}.ppo_mini_batch_size={work.prompts_per_step // work.mini_batches}",
        *micro,
        f"{actor}.ppo_epochs=1",
        f"{actor}.clip_ratio_low={work.clip_low}",
        f"{actor}.clip_ratio_high={work.clip_high}",
        f"{actor}.clip_ratio_c={work.dual_clip_c}",
        f"{actor}.loss_agg_mode=token-mean",
        f"{actor}.entropy_coeff=0",
        f"{actor}.use_kl_loss=False",
        f"{actor}.megatron.tensor_model_parallel_size=1",
        f"{actor}.megatron.pipeline_model_parallel_size=1",
        f"{actor}.megatron.expert_model_parallel_size={gpus}",
        f"{actor}.megatron.param_offload=False",
        f"{actor}.megatron.optimizer_offload=False",
        f"{actor}.megatron.use_mbridge=True",
        f"{actor}.megatron.vanilla_mbridge=True",  # mbridge, not Megatron-Bridge (one dependency fewer)
        f"{actor}.megatron.seed={work.seed}",
        f"{actor}.megatron.router_replay.mode={replay}",
        # the reference model's Megatron config follows the actor's (verl's ref/megatron_ref.yaml)
        f"{actor}.megatron.override_transformer_config.attention_backend={ATTENTION_BACKEND}",
        # rollout: vLLM (the release r3operator uses), one replica per GPU, bf16, with CUDA graphs and compilation as
        # r3operator's engine has them (`vllm serve` without --enforce-eager: api/vllm_args.py)
        f"{rollout}.name=vllm",
        f"{rollout}.mode=async",
        f"{rollout}.dtype=bfloat16",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.gpu_memory_utilization={work.engine_memory_fraction}",
        f"{rollout}.enforce_eager=False",
        *engine_seqs,
        f"{rollout}.n={work.group_size}",
        f"{rollout}.temperature={work.temperature}",
        f"{rollout}.top_p=1.0",
        f"{rollout}.top_k=-1",
        f"{rollout}.calculate_log_probs=True",  # the rollout logprobs the |Δlogprob| metrics need
        f"{rollout}.enable_rollout_routing_replay={r3}",
        *validation,
        # the run: N steps, no checkpoints, metrics to the console and one JSONL file
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1000",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=r3operator-peer",
        f"trainer.experiment_name={work.name}-{replay.lower()}",
        f"trainer.default_local_dir={log_file.parent / 'checkpoints'}",
    ]


def verl_command(python: str, overrides: list[str]) -> list[str]:
    return [python, "-m", "verl.trainer.main_ppo", ENGINE_CHOICE, *overrides]
