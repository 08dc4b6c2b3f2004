"""`r3operator explain`'s line on the model: where it comes from, how it reaches the pods, which Secret it needs."""

from __future__ import annotations

from r3operator.api import names
from r3operator.api.sources import SourceURIError, parse_source_uri
from r3operator.api.v1alpha1 import ModelCacheSpec, RLJob
from r3operator.operator.builders.model_cache import model_cache_claim_name, shares_model_cache
from r3operator.settings import MODEL_MOUNT


def model_summary(job: RLJob) -> str:
    model = job.spec.model
    try:
        source = parse_source_uri(model.uri, revision=model.revision)
    except SourceURIError as exc:
        return f"{model.uri}: {exc}"
    if source.scheme == "pvc":
        return f"claim {source.location} mounted read-only, model at {MODEL_MOUNT}/{source.path}".rstrip("/")
    if not source.fetched:
        return f"{model.uri} (nothing fetched)"
    cache = model.cache or ModelCacheSpec()
    shared = ", shared by source and revision" if shares_model_cache(job) else ""
    created = f"{model_cache_claim_name(job)} (created, {cache.size}, {cache.access_mode.value}{shared})"
    claim = cache.claim_name or created
    fetch = names.child_name(job.metadata.name, names.ROLE_MODEL_FETCH)
    secret = ""
    if model.token_secret_ref is not None:
        secret = f"; HF_TOKEN from Secret {model.token_secret_ref.name}/{model.token_secret_ref.key}"
    if model.s3 is not None:
        secret = f"; AWS credentials from Secret {model.s3.credentials_secret}"
    return (
        f"{model.uri} fetched once by Job {fetch} into claim {claim}, read-only at "
        f"{MODEL_MOUNT}/{source.cache_key} in every engine and trainer pod{secret}"
    )
