"""How the torch backend's data-parallel ranks split an optimizer step (no process group needed)."""

from __future__ import annotations

from vime_engine.train.data_parallel import DataParallel


def test_round_robin_and_balanced_shares_partition_the_step():
    step = [4, 5, 6, 7, 8, 9]  # a step's sample indices into the rollout
    lengths = {4: 50, 5: 10, 6: 40, 7: 10, 8: 30, 9: 20}
    rollout_lengths = [lengths.get(i, 0) for i in range(10)]
    ranks = [DataParallel(rank, 2) for rank in range(2)]
    assert [r.share(step) for r in ranks] == [[4, 6, 8], [5, 7, 9]]  # 120 vs 40 tokens
    balanced = [r.balanced_share(step, rollout_lengths) for r in ranks]
    assert sorted(balanced[0] + balanced[1]) == step and len(balanced[0]) == len(balanced[1]) == 3
    totals = [sum(lengths[i] for i in share) for share in balanced]
    assert abs(totals[0] - totals[1]) <= 20  # 50+20+10 vs 40+30+10
