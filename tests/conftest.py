"""Shared pytest configuration: CUDA tests are skipped where no GPU is visible."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
