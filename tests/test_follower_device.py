"""Which GPU a follower rank takes (dsv41/sched/follower.py follower_device): rank r on cuda:(r mod GPUs) on one host,
so two ranks share the one GPU of a one-GPU host (the H200 run of issue 7) and take one GPU each on a two-GPU host;
cuda:0 on its own node; cpu when asked or when auto finds no GPU; a clear error when cuda is asked and none is there."""
import pytest
import torch

from dsv41.comm.plan import CommError
from dsv41.sched.follower import follower_device


@pytest.mark.parametrize("gpus,rank,same_host,want", [
    (1, 1, True, "cuda:0"), (2, 1, True, "cuda:1"), (2, 0, True, "cuda:0"), (4, 3, True, "cuda:3"),
    (2, 1, False, "cuda:0"), (8, 5, False, "cuda:0")])
def test_rank_gpu(monkeypatch, gpus, rank, same_host, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert follower_device("cuda", rank, same_host) == want
    assert follower_device("auto", rank, same_host) == want


def test_cpu_and_missing_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert follower_device("cpu", 1, True) == "cpu"
    assert follower_device("auto", 1, True) == "cpu"
    with pytest.raises(CommError, match="rank 1: --device cuda: no CUDA device"):
        follower_device("cuda", 1, True)
