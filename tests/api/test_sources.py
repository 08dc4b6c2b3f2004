"""parse_source_uri: the one parser of model and dataset URIs, checked on URIs written out here."""

from __future__ import annotations

import pytest

from r3operator.api.sources import SourceURI, SourceURIError, parse_source_uri


def test_a_reference_model_uri_names_the_model() -> None:
    assert parse_source_uri("r3operator://reference/tiny") == SourceURI("r3operator", "tiny")


@pytest.mark.parametrize("uri", ["r3operator://models/tiny", "r3operator://reference/", "r3operator://reference/a/b"])
def test_a_reference_uri_of_another_form_is_refused_with_the_form(uri: str) -> None:
    with pytest.raises(SourceURIError, match=r"expected r3operator://reference/<name>"):
        parse_source_uri(uri)
