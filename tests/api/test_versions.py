from __future__ import annotations

import pytest
from packaging.version import Version

from r3operator.api.versions import (
    FEATURES,
    VersionSource,
    image_repository,
    resolve_engine_version,
    supports,
    version_from_image,
)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("vllm/vllm-openai:v0.22.1", "0.22.1"),
        ("vllm/vllm-openai:0.30.0", "0.30.0"),
        ("registry.example.com:5000/vllm/vllm-openai:v0.22.1-cu130", "0.22.1"),
        ("ghcr.io/acme/vllm:v0.23.0rc1", "0.23.0rc1"),
        # Our engine image: r3operator's version first, vLLM's after "-vllm".
        ("ghcr.io/r3operator/engine:0.1.0-vllm0.22.1", "0.22.1"),
        ("ghcr.io/r3operator/engine:0.2.0-vllm0.30.0rc1", "0.30.0rc1"),
        ("registry.example.com:5000/acme/engine:vllm-v0.22.1-cu130", "0.22.1"),
        # A plain version tag on an image that is not vLLM's is that image's own version: unknown.
        ("ghcr.io/r3operator/engine:0.1.0", None),
        ("ghcr.io/acme/engine:v0.23.0rc1", None),
        ("vllm/vllm-openai:latest", None),
        ("vllm/vllm-openai:nightly", None),
        ("vllm/vllm-openai", None),
        ("vllm/vllm-openai@sha256:" + "0" * 64, None),
        ("localhost:5000/vllm", None),
    ],
)
def test_version_from_image(image: str, expected: str | None) -> None:
    got = version_from_image(image)
    assert (str(got) if got else None) == expected


@pytest.mark.parametrize(
    ("image", "repository"),
    [
        ("vllm/vllm-openai:v0.22.1", "vllm/vllm-openai"),
        ("registry.example.com:5000/vllm/vllm-openai:v0.22.1", "registry.example.com:5000/vllm/vllm-openai"),
        ("vllm/vllm-openai@sha256:" + "0" * 64, "vllm/vllm-openai"),
        ("engine", "engine"),
    ],
)
def test_image_repository(image: str, repository: str) -> None:
    assert image_repository(image) == repository


def test_explicit_version_wins_over_tag() -> None:
    v = resolve_engine_version(image="vllm/vllm-openai:latest", explicit="0.22.1")
    assert v.version == Version("0.22.1") and v.source is VersionSource.SPEC


def test_supports_fails_closed_on_unknown() -> None:
    v = resolve_engine_version(image="vllm/vllm-openai:latest", explicit=None)
    assert supports(v, "routed-experts-return") is None


def test_prerelease_counts_as_its_release() -> None:
    v = resolve_engine_version(image="vllm/vllm-openai:v0.22.0rc2", explicit=None)
    assert supports(v, "routed-experts-transfer-rewrite") is True


def test_every_feature_is_sourced() -> None:
    for f in FEATURES.values():
        assert f.sources and all("#" in s for s in f.sources), f.key
