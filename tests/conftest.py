import os
import tempfile
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HYBRIDSPEC_CACHE", tempfile.mkdtemp(prefix="hybridspec-cache-"))
torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores

from _tiny import float64_gdn  # noqa: E402

NEAR_TIES: list[dict] = []


@pytest.fixture
def fp64_gdn():
    with float64_gdn():
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter):
    if NEAR_TIES:
        terminalreporter.write_line(f"HybridSpec exactness: {len(NEAR_TIES)} divergence(s) at AR near-ties (gap < 1e-6)")
