"""Shared pytest fixtures: the read-only ../shared data folder and a temporary output dir."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
SHARED_DATA = SHARED_DIR / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data (real text, GPT-2 vocab, SentencePiece model, golden files)."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def shakespeare_prefix(shared_data, tmp_path_factory) -> str:
    """tinyshakespeare tokenised with GPT-2 BPE (once per session); the dataset prefix."""
    from pretrain_utils import preprocess_shakespeare

    return preprocess_shakespeare(shared_data, tmp_path_factory.mktemp("data"))
