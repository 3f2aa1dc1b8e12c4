import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
FIXTURE = os.path.join(SHARED, "fixtures", "reference-tiny")
ENCODING_FIXTURES = os.path.join(SHARED, "fixtures", "encoding")


def need_shared(path: str) -> str:
    if not os.path.exists(path):
        pytest.skip(f"../shared is absent: {path} not found (CI places shared/ beside the checkout)")
    return path
