"""Shared pytest fixtures: the read-only ../shared data folder (tests that need it skip without it) and the
tinyshakespeare dataset built from it."""
from pathlib import Path

import pytest

from reference_data import require_shared_data


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; the test skips, saying why, when it is absent (:func:`require_shared_data`)."""
    return require_shared_data()


@pytest.fixture(scope="session")
def shakespeare_prefix(shared_data, tmp_path_factory) -> str:
    """tinyshakespeare tokenised with GPT-2 BPE (once per session); the dataset prefix."""
    from pretrain_utils import preprocess_shakespeare

    return preprocess_shakespeare(shared_data, tmp_path_factory.mktemp("data"))
