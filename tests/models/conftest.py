from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from r3operator.models import ensure_reference_model

    return ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))
