"""engine/run/distributed.py RankSums: named sums, one all-reduce, named means."""

from __future__ import annotations

import pytest
import torch

from engine.run.distributed import RankSums


def test_sums_are_read_by_name_after_one_all_reduce(process_group, monkeypatch):
    sums = RankSums(["pairs", "loss", "tokens", *(f"loss/{c}" for c in ("a", "b"))])
    sums.add(pairs=3, loss=torch.tensor(1.5), tokens=0)
    sums.add(pairs=torch.tensor(2), loss=torch.tensor(0.25, dtype=torch.float64), **{"loss/a": 4.0, "loss/b": 0.5})
    reduces = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: reduces.append(t.clone()))
    total = sums.reduced()
    [t] = reduces  # every sum in one float64 tensor, in the order of the names
    assert t.dtype == torch.float64 and t.tolist() == [5.0, 1.75, 0.0, 4.0, 0.5]
    assert (total["pairs"], total["loss"], total["loss/a"], total["loss/b"]) == (5.0, 1.75, 4.0, 0.5)
    assert total.mean("loss", over="pairs") == 1.75 / 5
    assert total.mean("loss/a", over="tokens") == 4.0  # a count of 0 divides as 1
    assert sums["pairs"] == 5.0  # this rank's sums are left as they were
    with pytest.raises(KeyError):
        sums.add(unknown=1.0)


def test_one_rank_reduces_to_its_own_sums(process_group):
    sums = RankSums(["n", "score"])
    sums.add(n=4, score=torch.tensor([0.1, 0.2, 0.7]).sum())
    total = sums.reduced()
    assert total["n"] == 4.0 and total["score"] == float(torch.tensor([0.1, 0.2, 0.7]).sum())
    assert total.mean("score", over="n") == float(torch.tensor([0.1, 0.2, 0.7]).sum()) / 4
