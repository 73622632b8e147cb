import torch

from sinv_prune.pipeline.device_choice import default_device


def test_the_first_named_device_wins():
    assert default_device(None, "cuda:1", "cpu") == "cuda:1"
    assert default_device("", None, "mps") == "mps"


def test_without_a_name_the_gpu_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device(None, None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"
