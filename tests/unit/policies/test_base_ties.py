"""The tie rule every policy's selection follows (kvrag.policies.base): scores equal within
the tie grid -- a few float32 ulps of the largest score ranked -- go to the earlier position,
whichever way float rounding (the order of a sum, the CPU's kernels, the device) tipped them."""

import pytest
import torch

from kvrag.policies.base import order_by_score, rank_keys, top_indices, top_k_indices
from kvrag.policies.samkv.selection import pool_order, tie_scale

ULP = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("noise", [0.0, ULP, -ULP, 3 * ULP, -3 * ULP])
def test_scores_tied_up_to_rounding_go_to_the_earlier_position(noise):
    scores = torch.tensor([0.5, 1.0, 1.0 + noise, 0.25, 1.0 - noise])
    assert top_indices(scores, 1).tolist() == [1]
    assert top_indices(scores, 2).tolist() == [1, 2]
    assert order_by_score(scores).tolist() == [1, 2, 4, 0, 3]


def test_scores_that_differ_beyond_the_grid_rank_by_value():
    scores = torch.tensor([1.0, 1.0 + 1e-3, 0.0, 2.0])
    assert order_by_score(scores).tolist() == [3, 1, 0, 2]
    assert top_indices(scores, 2).tolist() == [1, 3]


def test_the_count_is_exact_and_masked_scores_come_last():
    scores = torch.tensor([float("-inf"), 0.0, float("-inf"), -5.0, 0.0])
    assert top_indices(scores, 0).numel() == 0
    assert top_indices(scores, 3).tolist() == [1, 3, 4]
    assert top_indices(scores, 5).tolist() == [0, 1, 2, 3, 4]
    keys = rank_keys(scores)
    assert keys.unique().numel() == 5  # no two keys equal: topk / argsort are deterministic


def test_rows_rank_on_their_own_grid():
    scores = torch.tensor([[1.0, 1.0 + ULP, 0.0], [0.0, 3e-6, 2e-6]])
    assert top_k_indices(scores, 2).tolist() == [[0, 1], [1, 2]]


def test_noise_around_zero_ties_relative_to_the_given_scale():
    # Alone, [0, -3e-8] is its own scale and ranks by the noise; with the scale of the other
    # scores ranked beside it, both are 0 -- either rounding picks the same block.
    for noisy in ([0.0, -3e-8], [-3e-8, 0.0]):
        assert top_indices(torch.tensor(noisy), 1, scale=2.0).tolist() == [0]


def test_samkv_block_ties_break_by_position_whichever_way_rounding_tipped_them():
    """Document 1's two blocks tie in exact arithmetic (z-scores averaging to 0); two
    implementations rounding them apart in opposite directions choose the same candidate, and
    the cross-context pool ranks tied blocks of several documents by position."""
    for noisy in ([0.0, -3e-8], [-3e-8, 0.0]):
        scores = [torch.tensor([1.5, -0.5, -1.0]), torch.tensor(noisy), torch.tensor([1.5])]
        scale = tie_scale(scores)
        assert top_indices(scores[1], 1, scale).tolist() == [0]
        assert pool_order(scores, [[0], [0, 1], [0]]) == [(0, 0), (2, 0), (1, 0), (1, 1)]
