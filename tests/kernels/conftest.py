"""Fixtures for kernel tests."""

from __future__ import annotations

import pytest
from kernel_cases import random_experts


@pytest.fixture
def experts_fn():
    return random_experts
