"""Compute's thread policy (compute_service.threads): a single stream's step on one core fewer."""

import pytest
import torch

from compute_service.options import OPTIONS
from compute_service.threads import ThreadPolicy


@pytest.fixture
def restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("threads", "single", "expected"),
    [(4, None, (4, 3)), (2, None, (2, 1)), (1, None, (1, 1)), (2, 2, (2, 2)), (8, 3, (8, 3))],
)
def test_single_stream_threads_default_to_one_core_fewer(threads, single, expected):
    policy = ThreadPolicy.from_flags(threads, single)
    assert (policy.threads, policy.single_stream) == expected


def test_the_default_threads_are_torchs(restored):
    torch.set_num_threads(3)
    assert ThreadPolicy.from_flags(None, None) == ThreadPolicy(3, 2)


def test_a_one_token_step_runs_on_the_single_stream_threads(restored):
    policy = ThreadPolicy(2, 1)
    policy.apply(1)
    assert torch.get_num_threads() == 1
    policy.apply(2)
    assert torch.get_num_threads() == 2
    policy.apply(300)
    assert torch.get_num_threads() == 2


def test_the_flag_parses():
    args = OPTIONS.parser("compute").parse_args(
        ["--model", "m", "--threads", "4", "--single-stream-threads", "2"]
    )
    assert ThreadPolicy.from_flags(args.threads, args.single_stream_threads) == ThreadPolicy(4, 2)
