"""Names vulture (make test; [tool.vulture] in pyproject.toml) cannot see being used, each with why.

Every entry is used by something outside the Python call graph: an API field that users write in YAML and
the code reads through pydantic, a method that vLLM's `collective_rpc` or Ray calls by name, an attribute a
library reads, a parameter a signature must keep. Dead code is removed, not listed here.
"""

# ruff: noqa
# mypy: ignore-errors
_ = object()

# -- The RLJob API (api/): pydantic models users write in YAML; fields reach the CRD schema, the CEL rules
# and `model_dump(by_alias=True)`, never a Python attribute read. Kubernetes' own pod types (api/pods.py):
allow_privilege_escalation
default_mode
drop
fs_group_change_policy
localhost_profile
match_expressions
match_fields
max_skew
medium
min_domains
namespace_selector
node_affinity
node_selector_terms
pod_affinity
pod_affinity_term
pod_anti_affinity
preference
preferred_during_scheduling_ignored_during_execution
privileged
read_only_root_filesystem
required_during_scheduling_ignored_during_execution
run_as_group
run_as_non_root
seccomp_profile
size_limit
sub_path
supplemental_groups
toleration_seconds
topology_key
volume_attributes
when_unsatisfiable
# RLJob fields the CRD accepts whose use is a CEL rule or a refusal (e.g. klCoef with useKLLoss), and enum
# values that arrive from YAML.
first_k_dense_layers
ulysses_sequence_parallel_size
sample_packing
gradient_checkpointing
kl_coef
vllm_version_source
reward_mean  # Progress: written as camelCase JSON by the driver's status patch
SIGMOID_BIAS
READ_WRITE_ONCE
BFLOAT16  # ExportDType: users write `export.dtype: bfloat16` (or float16, float32)
FLOAT32
FLOAT16
YAML  # OutputFormat: `--output yaml`
engine_stateful_set  # RuntimeConfig: the operator writes the ConfigMap, `up` and the runtime read it as JSON
trainer_ray_job

# -- A step's figure that metrics.csv reads by its column name (runtime/step_record.py `StepRecord.cells`).
_.canary_near_ties

# -- Settings read by name: Backoff.from_env(kind) reads `engine_{kind}_attempts/_base_s/_cap_s`.
engine_retry_attempts
engine_retry_base_s
engine_retry_cap_s
engine_ready_attempts
engine_ready_base_s
engine_ready_cap_s

# -- Inside vLLM: the worker extension's one entry point, called by name through collective_rpc with every
# weight-sync message (wire/sync_messages.py; rollout/actor.py, rollout/engines.py over HTTP), and the
# attributes vLLM reads.
_.r3_handle
_._do_torchao_reload  # vLLM's layerwise reload calls the model's
_._weight_update_active  # vLLM's worker flag of a native update in progress
_.__wrapped__  # functools/inspect unwrap a patched method to its original (engine/plugin.py)

# -- Attributes third-party code reads: tokenizers' pipeline, transformers' config, torch DCP's stager
# options, Megatron's RNG tracker and the CPU shims of its CUDA RNG (trainer/megatron/parallel.py), kopf's
# settings (operator/handlers.py), http.server's handler and server hooks, vLLM's CPU communicator.
_.pre_tokenizer
_.decoder
_.post_processor
_.use_cache
_.use_async_staging
_.fork
_._get_cuda_rng_state
_._set_cuda_rng_state
_._CUDA_RNG_STATE_TRACKER
_._CUDA_RNG_STATE_TRACKER_INITIALIZED
_.server_timeout
_.client_timeout
_.connect_timeout
_.finalizer
_.cancellation_polling
_.progress_storage
_.diffbase_storage
_.reporting_component
_.reporting_instance
_.do_POST
_.do_GET
_.request_queue_size
_.log_message
_.daemon_threads
_.all_gatherv
_.reduce_scatterv

# -- Typed records read as a whole: the vLLM sampling parameters (rollout/client.py FullDistribution,
# unpacked into a request), a benchmark's summary row (benchmarks/peers/compare.py, asdict).
top_p
min_p
repetition_penalty
framework

# -- Parameters a signature must keep: __exit__, torch's __torch_dispatch__, verl's reward function,
# vLLM's sender calling the client's finish_weight_update(weight_version=...), pytest fixtures a test asks
# for their side effect (a Ray cluster up, the fingerprint path parametrised).
exc_type
tb
types
extra_info
weight_version
ray_started
fingerprint_path

# -- Test helpers named for the YAML they mirror (tests/kubecluster/kwok-stages.yaml matches these strings).
FAIL_LABEL
FAIL_JOBS_NAMESPACE

# -- StepRecord's fields (runtime/step_record.py): metrics.csv's columns, read by column name (getattr).
current_version_tokens
entropy_mean
env_tokens
logprob_abs_diff_by_lag
logprob_abs_diff_mean_resumed
logprob_abs_diff_mean_stale
partial_rollouts
prompt_tokens
reward_std
routing_natural_agreement
samples_dropped
stale_dropped
staleness_max
tokens_by_lag
tokens_per_second
trainer_idle_seconds
trainer_peak_memory_gib
_.r3_mapped_attach  # called by name over /collective_rpc (weightsync/mapped.py)
_.r3_mapped_sync
_.request_finished  # R3StorageConnector (engine/kv_storage.py): vLLM's KV-connector scheduler calls it
_.build_connector_meta  # R3StorageConnector: vLLM's scheduler calls it each step
_.update_state_after_alloc  # R3StorageConnector: vLLM's scheduler calls it
_.get_num_new_matched_tokens  # R3StorageConnector: vLLM's scheduler calls it
R3StorageConnector  # loaded by vLLM from kv_connector_module_path (api/disaggregation.py)
