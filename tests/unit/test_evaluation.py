from __future__ import annotations

import pytest

from vime_engine.rollout.evaluation import ks_for, pass_at_k, summarize
from vime_engine.sample import Sample, SampleStatus


def test_pass_at_k_by_hand():
    # n=4 samples, c=1 correct. pass@1 = 1/4. pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # pass@4 with one correct: every draw of 4 contains it.
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(3, 0, 2) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_ks_are_powers_of_two_and_n():
    assert ks_for(1) == [1]
    assert ks_for(4) == [1, 2, 4]
    assert ks_for(6) == [1, 2, 4, 6]


def _sample(group, reward, status=SampleStatus.COMPLETED, n_tokens=3):
    return Sample(group_index=group, prompt=f"p{group}", label="7", prompt_tokens=[1],
                  response_tokens=[2] * n_tokens, response=f"r{reward}", reward=reward, status=status,
                  metadata={"extracted_answer": "7" if reward else None})


def test_summarize_metrics_and_rows():
    samples = [_sample(0, 1.0), _sample(0, 0.0), _sample(1, 0.0, SampleStatus.TRUNCATED, 5), _sample(1, 0.0)]
    metrics, rows = summarize("aime", samples, n=2)
    assert metrics["eval/aime"] == 0.25  # 1 of 4 answers correct
    assert metrics["eval/aime-pass@1"] == 0.25  # problem 0: 1/2, problem 1: 0
    assert metrics["eval/aime-pass@2"] == 0.5  # problem 0 solved within 2 draws
    assert metrics["eval/aime/truncated_ratio"] == 0.25
    assert metrics["eval/aime/response_len/mean"] == 3.5
    assert rows[0]["correct"] == [True, False] and rows[0]["extracted"] == ["7", None]
    assert rows[1]["problem"] == "p1" and rows[1]["label"] == "7"
