"""Rule checks on model and dataset sources (api/sources.py): URIs the resolver cannot parse, dataset schemes
nothing fetches, s3:// and gs:// without credentials. rules.py lists them with their CEL twins."""

from __future__ import annotations

from r3operator.api.context import RuleContext
from r3operator.api.sources import SourceURIError, parse_source_uri

DATASET_SCHEMES = ("s3://", "gs://", "file://")
"""Besides a plain path (on the routing volume or in the image)."""
GCS_SECRET = "a Secret with an HMAC key (access ID as AWS_ACCESS_KEY_ID, secret as AWS_SECRET_ACCESS_KEY)"
S3_SECRET = "a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (task.s3.endpointURL for an S3-compatible store)"


def model_gcs_credentials(c: RuleContext) -> str | None:
    model = c.spec.model
    if model.uri.startswith("gs://") and model.gcs is None:
        return f"model.uri {model.uri} needs model.gcs.credentialsSecret: {GCS_SECRET}"
    return None


def model_uri_form(c: RuleContext) -> str | None:
    model = c.spec.model
    try:
        parse_source_uri(model.uri, revision=model.revision)
    except SourceURIError as exc:
        return f"model.uri: {exc}"
    return None


def model_s3_credentials(c: RuleContext) -> str | None:
    model = c.spec.model
    if model.uri.startswith("s3://") and model.s3 is None:
        return (
            f"model.uri {model.uri} needs model.s3.credentialsSecret: a Secret with AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (model.s3.endpointURL for an S3-compatible store)"
        )
    return None


def dataset_uri_scheme(c: RuleContext) -> str | None:
    path = c.spec.task.dataset_path
    if path and "://" in path and not path.startswith(DATASET_SCHEMES):
        return (
            f"task.datasetPath {path}: use a path (on the routing volume or in the image), s3://bucket/key or "
            "gs://bucket/key"
        )
    return None


def dataset_s3_credentials(c: RuleContext) -> str | None:
    task = c.spec.task
    if task.dataset_path and task.dataset_path.startswith("s3://") and task.s3 is None:
        return (
            f"task.datasetPath {task.dataset_path} needs task.s3.credentialsSecret: a Secret with "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (task.s3.endpointURL for an S3-compatible store)"
        )
    return None


def dataset_gcs_credentials(c: RuleContext) -> str | None:
    task = c.spec.task
    if task.dataset_path and task.dataset_path.startswith("gs://") and task.gcs is None:
        return f"task.datasetPath {task.dataset_path} needs task.gcs.credentialsSecret: {GCS_SECRET}"
    return None


def eval_dataset_uri_scheme(c: RuleContext) -> str | None:
    evaluation = c.spec.evaluation
    path = evaluation.dataset_path if evaluation is not None else None
    if path and "://" in path and not path.startswith(DATASET_SCHEMES):
        return (
            f"evaluation.datasetPath {path}: use a path (on the routing volume or in the image), s3://bucket/key or "
            "gs://bucket/key"
        )
    return None


def eval_dataset_credentials(c: RuleContext) -> str | None:
    """An s3:// or gs:// eval file is fetched with the task's store credentials (task.s3, task.gcs)."""
    evaluation, task = c.spec.evaluation, c.spec.task
    if evaluation is None:
        return None
    path = evaluation.dataset_path
    if path.startswith("s3://") and task.s3 is None:
        return f"evaluation.datasetPath {path} needs task.s3.credentialsSecret: {S3_SECRET}"
    if path.startswith("gs://") and task.gcs is None:
        return f"evaluation.datasetPath {path} needs task.gcs.credentialsSecret: {GCS_SECRET}"
    return None


def export_uri_form(c: RuleContext) -> str | None:
    export = c.spec.export
    if export is None:
        return None
    try:
        parse_source_uri(export.destination)
    except SourceURIError as exc:
        return f"export.destination: {exc}"
    return None


def export_s3_credentials(c: RuleContext) -> str | None:
    export = c.spec.export
    if export is not None and export.destination.startswith("s3://") and export.s3 is None:
        return (
            f"export.destination {export.destination} needs export.s3.credentialsSecret: a Secret with "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (export.s3.endpointURL for an S3-compatible store)"
        )
    return None


def export_gcs_credentials(c: RuleContext) -> str | None:
    export = c.spec.export
    if export is not None and export.destination.startswith("gs://") and export.gcs is None:
        return f"export.destination {export.destination} needs export.gcs.credentialsSecret: {GCS_SECRET}"
    return None
