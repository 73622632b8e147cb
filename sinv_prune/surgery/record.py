"""The pruning record kept in ``config.sinv_prune``: what was removed, in original numbering.

The record is plain JSON inside ``config.json``, so it travels with
``save_pretrained`` / ``push_to_hub`` and tells any loader how to rebuild the
pruned shapes before the weights arrive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from packaging.version import InvalidVersion, Version

from sinv_prune.version import __version__

RECORD_KEY = "sinv_prune"
RECORD_TYPE = "sinv_prune.head_pruning"


@dataclass
class PruningRecord:
    """Original geometry plus what was removed from it, all in the original (unpruned) numbering.

    ``pruned_heads`` maps an original layer index to its removed query heads,
    ``pruned_mlp`` an original layer index to its removed MLP channels, and
    ``removed_layers`` lists the original indices of the blocks dropped; layer ``i`` of
    the current model is original layer ``kept_layers()[i]``. ``intermediate_size`` is the
    original MLP width (None in records written before MLP pruning: unpruned then).
    ``num_experts`` is the original routed-expert count of a mixture-of-experts model (None for a
    dense one) and ``pruned_experts`` maps an original layer index to its removed experts.
    ``expert_width`` is the original width of one routed expert and ``shared_expert_width`` that of
    the shared expert (Qwen2-MoE; None without one); ``pruned_expert_channels`` maps an original MoE
    layer to the channels removed inside its experts, numbered ``e * expert_width + c`` (original
    expert ``e``, original channel ``c``) and ``num_experts * expert_width + c`` for the shared
    expert's channel ``c``. Channels of an expert removed later stay listed (they went with it).
    ``stock_layout`` is true when the config's own sizes already describe the pruned shapes
    (same sizes in every layer, a family whose config can say so), so the stock class loads
    the checkpoint without remote code. The config's layer count (and ``layer_types``) always
    describe the current stack, whichever the route.
    """

    base_class: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)
    intermediate_size: int | None = None
    pruned_mlp: dict[int, list[int]] = field(default_factory=dict)
    removed_layers: list[int] = field(default_factory=list)
    num_experts: int | None = None
    pruned_experts: dict[int, list[int]] = field(default_factory=dict)
    expert_width: int | None = None
    shared_expert_width: int | None = None
    pruned_expert_channels: dict[int, list[int]] = field(default_factory=dict)
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

    def kept_layers(self) -> list[int]:
        """Original indices of the blocks still present, in order: current layer ``i`` is ``kept_layers()[i]``."""
        removed = set(self.removed_layers)
        return [i for i in range(self.num_layers) if i not in removed]

    def kept_channels(self, layer: int) -> list[int]:
        """MLP channels of the original model still present in (original) ``layer``, in order."""
        removed = set(self.pruned_mlp.get(layer, ()))
        return [c for c in range(self.intermediate_size or 0) if c not in removed]

    def kept_experts(self, layer: int) -> list[int]:
        """Routed experts of the original model still present in (original) ``layer``, in order."""
        removed = set(self.pruned_experts.get(layer, ()))
        return [e for e in range(self.num_experts or 0) if e not in removed]

    def kept_expert_channels(self, layer: int, expert: int) -> list[int]:
        """Channels of original routed ``expert`` still present in (original) MoE ``layer``, in order."""
        width = self.expert_width or 0
        removed = set(self.pruned_expert_channels.get(layer, ()))
        return [c for c in range(width) if expert * width + c not in removed]

    def kept_shared_channels(self, layer: int) -> list[int]:
        """Channels of the shared expert still present in (original) MoE ``layer``, in order."""
        base = (self.num_experts or 0) * (self.expert_width or 0)
        removed = set(self.pruned_expert_channels.get(layer, ()))
        return [c for c in range(self.shared_expert_width or 0) if base + c not in removed]

    def kept_moe_items(self, layer: int) -> list[int]:
        """The MLP items of (original) MoE ``layer`` still present, in original numbering: the kept experts'
        kept channels expert-major, then the shared expert's; position ``j`` is current item ``j``."""
        width, base = self.expert_width or 0, (self.num_experts or 0) * (self.expert_width or 0)
        routed = [e * width + c for e in self.kept_experts(layer) for c in self.kept_expert_channels(layer, e)]
        return routed + [base + c for c in self.kept_shared_channels(layer)]

    def to_json(self) -> dict:
        data = asdict(self)
        data["pruned_heads"] = {str(k): sorted(v) for k, v in sorted(self.pruned_heads.items()) if v}
        data["pruned_mlp"] = {str(k): sorted(v) for k, v in sorted(self.pruned_mlp.items()) if v}
        data["removed_layers"] = sorted(self.removed_layers)
        data["pruned_experts"] = {str(k): sorted(v) for k, v in sorted(self.pruned_experts.items()) if v}
        data["pruned_expert_channels"] = {
            str(k): sorted(v) for k, v in sorted(self.pruned_expert_channels.items()) if v
        }
        if not data["pruned_expert_channels"]:  # uncut experts: the record reads as earlier versions wrote it
            del data["expert_width"], data["shared_expert_width"], data["pruned_expert_channels"]
        if self.num_experts is None:  # dense models' records stay as earlier versions wrote them
            del data["num_experts"], data["pruned_experts"]
        data["version"] = __version__
        return data

    @classmethod
    def from_json(cls, data: dict) -> PruningRecord:
        """The record of ``config.sinv_prune``; a key this version does not know (a unit added by a newer
        version, say) is a one-line ``ValueError`` naming it, never dropped: the shapes would come out wrong."""
        if data.get("type") != RECORD_TYPE:
            raise ValueError(f"config.{RECORD_KEY} is not a sinv_prune pruning record (type={data.get('type')!r})")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            written = str(data.get("version"))
            if _newer(written, __version__):
                raise ValueError(
                    f"config.{RECORD_KEY} was written by sinv_prune {written}, newer than this {__version__}: "
                    f"it records {unknown} (a unit this version does not know); upgrade sinv_prune to load it"
                )
            raise ValueError(f"config.{RECORD_KEY} has unknown keys {unknown} (written by sinv_prune {written})")
        fields = dict(data)
        fields["pruned_heads"] = {int(k): list(v) for k, v in data.get("pruned_heads", {}).items()}
        fields["pruned_mlp"] = {int(k): list(v) for k, v in data.get("pruned_mlp", {}).items()}
        fields["removed_layers"] = sorted(int(i) for i in data.get("removed_layers", ()))
        fields["pruned_experts"] = {int(k): list(v) for k, v in data.get("pruned_experts", {}).items()}
        fields["pruned_expert_channels"] = {int(k): list(v) for k, v in data.get("pruned_expert_channels", {}).items()}
        return cls(**fields)


def _newer(written: str, ours: str) -> bool:
    """Whether version ``written`` is later than ``ours`` (an unparsable one is not)."""
    try:
        return Version(written) > Version(ours)
    except InvalidVersion:
        return False


def get_record(config) -> PruningRecord | None:
    """The pruning record of a config, or None for a model never pruned."""
    data = getattr(config, RECORD_KEY, None)
    return PruningRecord.from_json(data) if data else None


def set_record(config, record: PruningRecord) -> None:
    setattr(config, RECORD_KEY, record.to_json())
