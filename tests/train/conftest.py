"""Shard sets for the trainer's tests (shardgen: samples that obey the pointer rule exactly)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.train.helpers import jagged_batches, shard_set


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the suite runs two test processes on two cores, and torch's small ops
    get many times slower when their threads wait for a busy core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory):
    """Samples of the demo's shape: the synthetic log's layout, L = 50 (the demo's max_seq_len)."""
    return shard_set(str(tmp_path_factory.mktemp("demo_set")), max_seq_len=50, samples=120, seed=1)


@pytest.fixture(scope="session")
def long_set(tmp_path_factory):
    """Short L (8) against long histories: most requests' spans start after the sample's first event."""
    return shard_set(str(tmp_path_factory.mktemp("long_set")), max_seq_len=8, samples=60, seed=2, event_scale=20)


@pytest.fixture(scope="session")
def demo_batches(demo_set):
    return jagged_batches(demo_set, batch_size=16)


@pytest.fixture(scope="session")
def long_batches(long_set):
    return jagged_batches(long_set, batch_size=12)
