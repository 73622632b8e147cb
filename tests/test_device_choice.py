import torch

from sinv_prune.pipeline.device_choice import default_device, synchronize


def test_the_first_named_device_wins():
    assert default_device(None, "cuda:1", "cpu") == "cuda:1"
    assert default_device("", None, "mps") == "mps"


def test_without_a_name_the_gpu_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device(None, None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


def test_synchronize_waits_for_cuda_devices_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert waited == []
    synchronize("cuda:1")
    synchronize(torch.device("cuda", 0))
    assert [str(d) for d in waited] == ["cuda:1", "cuda:0"]
