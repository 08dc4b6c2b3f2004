"""The fidelity canary of an engine image upgrade: an old and a new engine replica, scored by the trainer.

The operator (operator/upgrade.py) starts one replica on the new image and runs this in a Job with the
trainer image (`r3operator upgrade-canary`). Both engines get the same fixed prompts and seed; each one's
samples are checked (routed experts of shape [*, numLayers, topK], ids in range, no duplicate within a
row) and scored by the trainer on its current weights (the latest checkpoint, else the model) twice:
with the engine's routes replayed (R3) and with natural routing. Both engines must serve those weights: a
new replica starts from the model's files, so the canary first loads the trainer's weights into it through
the worker extension's packed path (as a sync would: the new release is judged receiving weights too); an
old replica serves the policy the driver synced last, which the message names (a run that moved on since
the checkpoint only widens the old engine's figures). Per engine that gives

- replay agreement: experts the trainer used under replay = the engine's (must be 1.0: R3 works at all);
- natural mismatch: token-layers where the trainer's own router differs from the engine's choice;
- mean |Δlogprob| off and under R3: the rollout-vs-train gap R3 is there to shrink.

The new engine passes when its routes are valid, replay agreement is 1.0, and its natural mismatch and
mean |Δlogprob| (off) are within `upgradePolicy.max*Factor` × the old engine's, measured in the same run,
so that the trainer's own numerics cancel out. The verdict goes to stdout as JSON and to the container's
termination message (``/dev/termination-log``): the operator reads it from the Pod's status, which the
kubelet writes, never from the RLJob's status, which the trainer pods may patch.

A trainer image change is canaried the same way from the other side: the old trainer image scores one
engine replica (`--score-only FILE`, an init container), then the new trainer image scores the same
replica with the same prompts and seed and compares (`--baseline FILE`): the new trainer must agree with
the engine as well as the old one did.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from r3operator.api.canary_verdict import TERMINATION_LOG, termination_message
from r3operator.api.enums import ReplayMode
from r3operator.api.v1alpha1 import EngineFidelity, UpgradeCanary, UpgradePolicySpec
from r3operator.rollout.client import OpenAIHTTPClient
from r3operator.rollout.disaggregated import DisaggregatedGroup
from r3operator.rollout.engines import HTTPEngine
from r3operator.routing.agreement import routing_agreement
from r3operator.routing.codec import decode
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.sample import RolloutSample
from r3operator.runtime import checkpoint as ckpt
from r3operator.runtime.config import RunSettings, resolve_model_dir
from r3operator.trainer.base import Trainer
from r3operator.trainer.batch import build_batch
from r3operator.trainer.factory import build_trainer
from r3operator.trainer.metrics import logprob_stats
from r3operator.weightsync.endpoints import EngineEndpoint
from r3operator.weightsync.packed import install_packed
from r3operator.wire.retry import Backoff

log = logging.getLogger(__name__)
PROMPT_LENGTH = 16
FLOOR = 1e-6
"""Below this the old engine's figure counts as zero: a factor of zero would fail on any noise."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    num_layers: int
    top_k: int
    num_experts: int


def canary_prompts(count: int, *, vocab_size: int, seed: int) -> list[list[int]]:
    """Fixed token prompts: a function of the job's seed only, so old and new see the same ones."""
    rng = np.random.default_rng([seed, 0x5EED])
    low = min(3, vocab_size - 1)  # keep clear of the usual special ids (pad/bos/eos)
    return [rng.integers(low, vocab_size, size=PROMPT_LENGTH).tolist() for _ in range(count)]


def check_samples(samples: list[RolloutSample], shape: ModelShape) -> str | None:
    """Why the engine's routed experts are unusable, or None."""
    for sample in samples:
        if sample.routes is None:
            return f"sample {sample.sample_id}: {sample.routes_error or 'no routed experts'}"
        try:
            rows = decode(sample.routes, num_experts=shape.num_experts)  # ids in range, no duplicates
        except RoutingDataError as exc:
            return f"sample {sample.sample_id}: {exc}"
        if rows.shape[1:] != (shape.num_layers, shape.top_k):
            return (
                f"sample {sample.sample_id}: routed experts {list(rows.shape)}, expected [*, "
                f"{shape.num_layers}, {shape.top_k}]"
            )
    return None


def score_engine(
    trainer: Trainer, samples: list[RolloutSample], *, image: str, shape: ModelShape, device: str
) -> EngineFidelity:
    problem = check_samples(samples, shape)
    if problem is not None:
        return EngineFidelity(image=image, routes_valid=False, message=problem[:1024])
    routes = [s.routes for s in samples]
    batch = build_batch(samples, [0.0] * len(samples), routes=routes, pad_id=trainer.pad_id, device=device)  # type: ignore[arg-type]
    assert batch.engine_routes is not None and batch.route_pad is not None
    mask = ~batch.route_pad
    replayed = trainer.old_logprobs(batch, ReplayMode.R3)
    natural = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    off = logprob_stats(batch.rollout_logprobs, natural.logprobs, batch.response_mask)
    r3 = logprob_stats(batch.rollout_logprobs, replayed.logprobs, batch.response_mask)
    return EngineFidelity(
        image=image,
        routes_valid=True,
        replay_agreement=routing_agreement(replayed.used_ids, batch.engine_routes, mask).agreement_ratio,
        natural_mismatch=1.0 - routing_agreement(natural.natural_ids, batch.engine_routes, mask).agreement_ratio,
        logprob_abs_diff_off=off.abs_diff_mean,
        logprob_abs_diff_r3=r3.abs_diff_mean,
        message=f"{off.tokens} tokens",
    )


def verdict(old: EngineFidelity, new: EngineFidelity, policy: UpgradePolicySpec) -> tuple[bool, str]:
    """Pass/fail and a message with the figures side by side."""

    def figures(side: str, e: EngineFidelity) -> str:
        if not e.routes_valid:
            return f"{side} ({e.image}): routes invalid ({e.message})"
        return (
            f"{side} ({e.image}): replay agreement {e.replay_agreement:.4f}, natural mismatch "
            f"{e.natural_mismatch:.4f}, mean |Δlogprob| off {e.logprob_abs_diff_off:.5f} "
            f"→ R3 {e.logprob_abs_diff_r3:.5f}"
        )

    side_by_side = f"{figures('new', new)}; {figures('old', old)}"
    if not new.routes_valid:
        return False, f"the new engine's routed experts are unusable; {side_by_side}"
    if not old.routes_valid:
        return False, f"the old engine gave no usable baseline; {side_by_side}"
    assert new.replay_agreement is not None and new.natural_mismatch is not None
    assert old.natural_mismatch is not None and new.logprob_abs_diff_off is not None
    assert old.logprob_abs_diff_off is not None
    failures = []
    if new.replay_agreement < 1.0:
        failures.append(f"replay agreement {new.replay_agreement:.4f} < 1")
    mismatch_limit = max(old.natural_mismatch, FLOOR) * policy.max_mismatch_factor
    if new.natural_mismatch > mismatch_limit:
        failures.append(
            f"natural mismatch {new.natural_mismatch:.4f} > {mismatch_limit:.4f} "
            f"(old × maxMismatchFactor {policy.max_mismatch_factor:g})"
        )
    diff_limit = max(old.logprob_abs_diff_off, FLOOR) * policy.max_logprob_diff_factor
    if new.logprob_abs_diff_off > diff_limit:
        failures.append(
            f"mean |Δlogprob| {new.logprob_abs_diff_off:.5f} > {diff_limit:.5f} "
            f"(old × maxLogprobDiffFactor {policy.max_logprob_diff_factor:g})"
        )
    if failures:
        return False, f"{'; '.join(failures)}; {side_by_side}"
    return True, side_by_side


def load_policy(settings: RunSettings, model_dir: Path) -> tuple[Trainer, ckpt.CheckpointInfo | None]:
    """The trainer on its latest checkpoint's weights (the model's own when there is none yet), and that checkpoint."""
    trainer = build_trainer(settings.job.spec, model_dir, device=settings.device)
    info = ckpt.find_latest(settings.run_dir / "checkpoints")
    if info is not None:
        ckpt.load_checkpoint(info, trainer)  # one process reads every rank's shard (DCP reshards on load)
        log.info("scoring with the checkpoint of step %s", info.step)
    else:
        log.info("no checkpoint under %s: scoring with the model's weights", settings.run_dir / "checkpoints")
    return trainer, info


@dataclass(frozen=True, slots=True)
class CanaryContext:
    settings: RunSettings
    shape: ModelShape
    trainer: Trainer
    prompts: list[list[int]]
    checkpoint: ckpt.CheckpointInfo | None

    @property
    def weights(self) -> str:
        """The weights the trainer scores with, as the verdict names them."""
        if self.checkpoint is None:
            return "the model's (no checkpoint yet)"
        return f"the checkpoint of step {self.checkpoint.step} (policy {self.checkpoint.policy_version})"


def canary_context(settings: RunSettings) -> CanaryContext:
    """The model's routing shape, the trainer on its current weights and the fixed prompts."""
    from transformers import AutoConfig

    spec = settings.job.spec
    model_dir = resolve_model_dir(settings.job, settings.model_override)
    config = AutoConfig.from_pretrained(model_dir)
    shape = ModelShape(
        int(config.vocab_size), int(config.num_hidden_layers), int(config.num_experts_per_tok), int(config.num_experts)
    )
    prompts = canary_prompts(spec.upgrade_policy.prompts, vocab_size=shape.vocab_size, seed=spec.seed)
    trainer, checkpoint = load_policy(settings, model_dir)
    return CanaryContext(settings, shape, trainer, prompts, checkpoint)


def _engine(ctx: CanaryContext, url: str, *, patient: bool = True) -> HTTPEngine:
    """`patient`: wait for a replica that is still loading its model (the default patience), else one try each."""
    once = None if patient else Backoff(attempts=1)
    staging = ctx.settings.run_dir / "weight-staging"
    return HTTPEngine(url, staging_dir=staging, num_experts=ctx.shape.num_experts, backoff=once, ready=once)


def load_weights(ctx: CanaryContext, urls: Sequence[str]) -> str:
    """The trainer's weights into the engines at `urls` (one packed bracket each, every chunk packed once, stamped
    `canary:<policy>`), so that they are scored on the weights the trainer scores with; what they now serve, for the
    verdict. Before a first checkpoint there is nothing to load: the trainer has the model's weights, which a new
    replica started from."""
    if ctx.checkpoint is None:
        return "the model's"
    import torch

    spec = ctx.settings.job.spec
    wire = getattr(torch, ctx.settings.engine_dtype, None)  # the engine would cast anyway; its dtype halves bf16
    chunks = ctx.trainer.weight_chunks(chunk_size_mb=spec.weight_sync.chunk_size_mb, dtype=wire)
    endpoints = [EngineEndpoint(_engine(ctx, url)) for url in urls]
    install_packed(endpoints, chunks, policy_tag=f"canary:{ctx.checkpoint.policy_version}")
    return "loaded with them"


def serving(ctx: CanaryContext, url: str) -> str:
    """The policy a live replica says it serves (the tag of its last finished sync), for the verdict."""
    try:
        tag = EngineEndpoint(_engine(ctx, url, patient=False)).policy_tag()  # it answered: scoring follows
    except Exception as exc:  # a verdict names what it could not read; it does not fail on it
        return f"policy unknown ({type(exc).__name__})"
    if tag is None:
        return "the model's weights (no finished sync)"
    return f"policy {tag.rpartition(':')[2]}"


def score_url(ctx: CanaryContext, url: str, *, image: str, prefill_url: str | None = None) -> EngineFidelity:
    """One engine's samples scored by this trainer; an engine that does not answer scores as invalid.
    ``prefill_url``: a disaggregated job's prefill engine, which prefills every request decoded on ``url``
    (rollout/disaggregated.py): the pair is scored as the trainer's rollouts would run on it."""
    spec = ctx.settings.job.spec
    try:
        samples = _client(ctx, url, prefill_url).generate(
            ctx.prompts, max_tokens=spec.upgrade_policy.max_tokens, temperature=1.0, seed=spec.seed, n=1
        )
        return score_engine(ctx.trainer, samples, image=image, shape=ctx.shape, device=ctx.settings.device)
    except Exception as exc:  # the canary fails with the reason instead of crashing without a verdict
        log.error("engine %s: %s", url, exc)
        return EngineFidelity(image=image, routes_valid=False, message=f"{url}: {exc}"[:1024])


def _client(ctx: CanaryContext, url: str, prefill_url: str | None) -> OpenAIHTTPClient | DisaggregatedGroup:
    if prefill_url is None:
        return OpenAIHTTPClient(url, num_experts=ctx.shape.num_experts)
    staging = ctx.settings.run_dir / "weight-staging"  # this pair only generates: `load_weights` loaded it
    experts = ctx.shape.num_experts
    return DisaggregatedGroup(
        [HTTPEngine(prefill_url, staging_dir=staging, num_experts=experts)],
        [HTTPEngine(url, staging_dir=staging, num_experts=experts)],
    )


def run_upgrade_canary(
    settings: RunSettings,
    *,
    old_url: str,
    new_url: str,
    old_image: str,
    new_image: str,
    attempt: str,
    load_old: bool = False,
) -> UpgradeCanary:
    """Engine upgrade: the trainer scores an old and the new engine replica (`engine_upgrade_verdict`)."""
    return engine_upgrade_verdict(
        canary_context(settings), old_url=old_url, new_url=new_url, old_image=old_image, new_image=new_image,
        attempt=attempt, load_old=load_old,
    )  # fmt: skip


def engine_upgrade_verdict(
    ctx: CanaryContext,
    *,
    old_url: str,
    new_url: str,
    old_image: str,
    new_image: str,
    attempt: str,
    old_prefill: str | None = None,
    new_prefill: str | None = None,
    load_old: bool = False,
) -> UpgradeCanary:
    """The trainer's weights loaded into the new replica (and its prefill partner), then both replicas scored.
    `load_old`: load the old one too, for an old replica no driver syncs (a stand-in for a live one: the GPU row)."""
    policy = ctx.settings.job.spec.upgrade_policy
    try:
        new_weights = load_weights(ctx, [url for url in (new_prefill, new_url) if url])
    except Exception as exc:  # a release that cannot take the trainer's weights fails, naming why
        log.error("loading the trainer's weights into %s: %s", new_url, exc)
        unloaded = EngineFidelity(image=new_image, routes_valid=False, message=f"{new_url}: {exc}"[:1024])
        old = score_url(ctx, old_url, image=old_image, prefill_url=old_prefill)
        weights = f"the trainer's weights ({ctx.weights}) could not be loaded"
        return make_verdict(old, unloaded, policy, attempt=attempt, weights=weights)
    if load_old:  # a failure here is the old release's own, not the new one's: raised, no verdict
        old_weights = load_weights(ctx, [url for url in (old_prefill, old_url) if url])
    else:
        old_weights = serving(ctx, old_url)
    old = score_url(ctx, old_url, image=old_image, prefill_url=old_prefill)
    new = score_url(ctx, new_url, image=new_image, prefill_url=new_prefill)
    weights = f"scored on {ctx.weights}: new {new_weights}, old {old_weights}"
    return make_verdict(old, new, policy, attempt=attempt, weights=weights)


def make_verdict(
    old: EngineFidelity, new: EngineFidelity, policy: UpgradePolicySpec, *, attempt: str, weights: str = ""
) -> UpgradeCanary:
    passed, message = verdict(old, new, policy)
    if weights:
        message = f"{message}; {weights}"
    return UpgradeCanary(
        attempt=attempt,
        passed=passed,
        message=message[:2048],
        old=old,
        new=new,
        finished_at=dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def write_score(path: Path, fidelity: EngineFidelity) -> None:
    """Trainer upgrades: the old trainer image's figures for the new image's run (atomic)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(fidelity.model_dump_json(by_alias=True))
    tmp.replace(path)


def read_score(path: Path) -> EngineFidelity:
    try:
        return EngineFidelity.model_validate_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: the old trainer's figures are unreadable ({exc})") from None


def publish(result: UpgradeCanary, termination_log: Path = Path(TERMINATION_LOG)) -> bool:
    """Print the verdict as JSON and write it as the termination message. False when it could not be
    written (the Job then fails, and the operator blocks the upgrade saying so). Outside a pod (no
    termination log, which the kubelet mounts in every container) the verdict is printed only."""
    print(json.dumps(result.model_dump(mode="json", by_alias=True, exclude_none=True), indent=2))
    if not termination_log.exists():
        log.warning("%s does not exist (not in a pod): the verdict is printed only", termination_log)
        return True
    try:
        termination_log.write_text(termination_message(result))
    except OSError as exc:
        log.error("the verdict could not be written to %s: %s", termination_log, exc)
        return False
    return True
