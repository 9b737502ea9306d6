"""Where the tests find ../shared/data (the read-only reference data beside the checkout), and the one check
that skips a test, saying why, when it is absent."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
SHARED_DATA = SHARED_DIR / "data"
SHARED_DATA_MISSING = (f"needs ../shared/data (GPT-2 vocabulary, tinyshakespeare, the Megatron golden files; "
                       f"docs/testing.md says how to recreate it), not found at {SHARED_DATA}")


def require_shared_data() -> Path:
    """Path to ../shared/data (real text, GPT-2 vocab, SentencePiece model, golden files); skips the calling
    test, saying why, when the folder is not beside the checkout. Every test that needs the folder goes
    through this check: via the ``shared_data`` fixture (tests/conftest.py) or, outside a fixture, directly."""
    if not SHARED_DATA.is_dir():
        pytest.skip(SHARED_DATA_MISSING)
    return SHARED_DATA
