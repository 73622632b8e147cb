"""Deployment targets for pruned models: GGUF files for llama.cpp (every per-layer shape it can run)."""

from sinv_prune.deploy.gguf_export import GGUFExport, check_gguf_export, export_gguf

__all__ = ["export_gguf", "check_gguf_export", "GGUFExport"]
