"""The pruning record kept in ``config.sinv_prune``: what was removed, in original numbering.

The record is plain JSON inside ``config.json``, so it travels with
``save_pretrained`` / ``push_to_hub`` and tells any loader how to rebuild the
pruned shapes before the weights arrive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sinv_prune.version import __version__

RECORD_KEY = "sinv_prune"
RECORD_TYPE = "sinv_prune.head_pruning"


@dataclass
class PruningRecord:
    """Original head geometry plus the heads removed from it, per layer.

    ``pruned_heads`` maps a layer index to the removed query heads, numbered as in
    the original (unpruned) model. ``stock_layout`` is true when the config's own
    head counts already describe the pruned shapes (LLaMA family, same count in
    every layer), so the stock class loads the checkpoint without remote code.
    """

    base_class: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)
    stock_layout: bool = False
    type: str = RECORD_TYPE
    version: str = __version__

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kept_heads(self, layer: int) -> list[int]:
        """Query heads of the original model still present in ``layer``, in order."""
        removed = set(self.pruned_heads.get(layer, ()))
        return [h for h in range(self.num_heads) if h not in removed]

    def kept_kv_heads(self, layer: int) -> list[int]:
        return sorted({h // self.group_size for h in self.kept_heads(layer)})

    def to_json(self) -> dict:
        data = asdict(self)
        data["pruned_heads"] = {str(k): sorted(v) for k, v in sorted(self.pruned_heads.items()) if v}
        data["version"] = __version__
        return data

    @classmethod
    def from_json(cls, data: dict) -> PruningRecord:
        if data.get("type") != RECORD_TYPE:
            raise ValueError(f"config.{RECORD_KEY} is not a sinv_prune pruning record (type={data.get('type')!r})")
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["pruned_heads"] = {int(k): list(v) for k, v in data.get("pruned_heads", {}).items()}
        return cls(**fields)


def get_record(config) -> PruningRecord | None:
    """The pruning record of a config, or None for a model never pruned."""
    data = getattr(config, RECORD_KEY, None)
    return PruningRecord.from_json(data) if data else None


def set_record(config, record: PruningRecord) -> None:
    setattr(config, RECORD_KEY, record.to_json())
