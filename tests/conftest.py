"""Shared pytest fixtures: the read-only ../shared data folder (tests that need it skip without it) and the
tinyshakespeare dataset built from it."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
SHARED_DATA = SHARED_DIR / "data"
SHARED_DATA_MISSING = (f"needs ../shared/data (GPT-2 vocabulary, tinyshakespeare, the Megatron golden files; "
                       f"docs/testing.md says how to recreate it), not found at {SHARED_DATA}")


def require_shared_data() -> Path:
    """Path to ../shared/data (real text, GPT-2 vocab, SentencePiece model, golden files); skips the calling
    test, saying why, when the folder is not beside the checkout. The one check every test that needs the
    folder goes through, via the ``shared_data`` fixture or, outside a fixture, directly."""
    if not SHARED_DATA.is_dir():
        pytest.skip(SHARED_DATA_MISSING)
    return SHARED_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; the test skips when it is absent (:func:`require_shared_data`)."""
    return require_shared_data()


@pytest.fixture(scope="session")
def shakespeare_prefix(shared_data, tmp_path_factory) -> str:
    """tinyshakespeare tokenised with GPT-2 BPE (once per session); the dataset prefix."""
    from pretrain_utils import preprocess_shakespeare

    return preprocess_shakespeare(shared_data, tmp_path_factory.mktemp("data"))
