"""Mixed plans on mixed models: one property test over every supported family and every unit at once.

Each example builds a tiny model of one family (configs mixing dense and mixture-of-experts layers where the
family allows, sliding and full attention layers where it allows, ``output_router_logits`` on or off), draws a
plan over heads, MLP channels (dense, inside routed experts, the shared expert), experts and whole layers at
once, and checks:

* the pruned model's forward with labels (logits, loss and load-balancing loss) equals the reference: the
  unpruned model with the removed heads' output-projection columns and the removed channels' down-projection
  columns zeroed, the removed experts' router logits -inf and the removed blocks bypassed; its load-balancing
  loss is transformers' own function on the reference's router logits of the kept experts, with the kept count;
* the saved checkpoint reloads through every route ``sinv-prune info`` names for it (the stock class with no
  remote code, or ``trust_remote_code=True``; ``sinv_prune.from_pretrained`` on both) with the same outputs;
* a second plan on the reloaded model (loaded as the route says) is again exact.

The ``route`` parameter forces the route: ``stock`` draws plans that keep every layer alike (the stock class
can describe them), ``remote`` draws plans that do not; ``info`` must name the route the test asked for.
"""

from __future__ import annotations

import copy
import sys
import tempfile

import pytest
import torch
import transformers
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_experts import masked_routers

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.cli import main
from sinv_prune.surgery.checkpoint import base_class
from sinv_prune.surgery.record import get_record

SETTINGS = settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure reports the example as drawn
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
VOCAB, EXPERTS, TOP_K, ALIGN = 64, 6, 2, 8  # ALIGN: a cut expert keeps a multiple of 8 channels
COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=1)
LLAMA_LIKE = dict(num_hidden_layers=3, hidden_size=32, head_dim=8, max_position_embeddings=64)
MOE = dict(
    LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=TOP_K, router_aux_loss_coef=0.5
)  # fmt: skip  (a large coefficient: a wrong load-balancing loss shows)

#: family -> variant name -> (config class, keyword arguments); the variants mix layer kinds.
VARIANTS = {
    "gpt2": {"plain": (transformers.GPT2Config, dict(n_layer=3, n_head=4, n_embd=32, n_inner=24, n_positions=64))},
    "bert": {
        "plain": (transformers.BertConfig, dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=32,
                                                 intermediate_size=24, max_position_embeddings=64)),
    },
    "llama": {"gqa": (transformers.LlamaConfig, dict(LLAMA_LIKE, num_attention_heads=6, num_key_value_heads=2,
                                                      hidden_size=48, intermediate_size=24))},
    "qwen2": {  # layer 0 full attention, the others sliding (window 4 of 10 tokens)
        "sliding": (transformers.Qwen2Config, dict(LLAMA_LIKE, num_attention_heads=6, num_key_value_heads=3,
                                                    hidden_size=48, intermediate_size=24, use_sliding_window=True,
                                                    sliding_window=4, max_window_layers=1)),
    },
    "mistral": {"sliding": (transformers.MistralConfig, dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2,
                                                             intermediate_size=24, sliding_window=4))},
    "qwen3_moe": {  # dense layer 1 between MoE layers; or dense layers 0 and 2 around a MoE layer
        "mlp_only_layers": (transformers.Qwen3MoeConfig, dict(MOE, num_experts=EXPERTS, moe_intermediate_size=16,
                                                               intermediate_size=24, mlp_only_layers=[1],
                                                               norm_topk_prob=True)),
        "sparse_step": (transformers.Qwen3MoeConfig, dict(MOE, num_experts=EXPERTS, moe_intermediate_size=16,
                                                           intermediate_size=24, decoder_sparse_step=2)),
    },
    "qwen2_moe": {  # a shared expert in each MoE layer; sliding layers 1 and 2
        "mlp_only_layers": (transformers.Qwen2MoeConfig, dict(MOE, num_experts=EXPERTS, moe_intermediate_size=16,
                                                               intermediate_size=24, shared_expert_intermediate_size=12,
                                                               mlp_only_layers=[1], use_sliding_window=True,
                                                               sliding_window=4, max_window_layers=1)),
        "sparse_step": (transformers.Qwen2MoeConfig, dict(MOE, num_experts=EXPERTS, moe_intermediate_size=16,
                                                           intermediate_size=24, shared_expert_intermediate_size=12,
                                                           decoder_sparse_step=2)),
    },
    "mixtral": {"sliding": (transformers.MixtralConfig, dict(MOE, num_local_experts=EXPERTS, intermediate_size=16,
                                                             sliding_window=4))},
    "olmoe": {"plain": (transformers.OlmoeConfig, dict(MOE, num_experts=EXPERTS, intermediate_size=16))},
    "gpt_oss": {  # sliding, full, sliding
        "plain": (transformers.GptOssConfig, dict(MOE, num_local_experts=EXPERTS, intermediate_size=16,
                                                  sliding_window=4,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    },
}  # fmt: skip
FAMILIES = list(VARIANTS)
ROUTES = {
    "stock": "stock class, no remote code",
    "remote": "sinv_prune.from_pretrained or trust_remote_code=True",
}

_BASE: dict[tuple[str, str], transformers.PreTrainedModel] = {}


def auto_class(family: str) -> type:
    return transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM


def fresh(family: str, variant: str) -> transformers.PreTrainedModel:
    """A copy of the cached tiny model: eval mode, float32, eager attention, every weight N(0, 0.2)."""
    if (family, variant) not in _BASE:
        config_cls, kwargs = VARIANTS[family][variant]
        config = config_cls(**COMMON, **kwargs)
        torch.manual_seed(0)
        model = auto_class(family).from_config(config, attn_implementation="eager")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        _BASE[family, variant] = model.eval()
    return copy.deepcopy(_BASE[family, variant])


def inputs() -> dict:
    """Two rows of ten tokens, the first left-padded by two; labels ignore the padding."""
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


INPUTS = inputs()


# -- plans --------------------------------------------------------------------------------------------


def is_moe(adapter, layer: int) -> bool:
    return adapter.num_experts(layer) > 0


def amount(draw, most: int, deep: bool = True) -> int:
    """An integer in ``0..most``. Hypothesis's simplest draw (the first example it runs) is ``most`` when ``deep``
    and 0 otherwise: alternating ``deep`` over layers makes that first example a deep and uneven cut."""
    drawn = draw(st.integers(0, most))
    return most - drawn if deep else drawn


def choose(draw, deep: bool = True) -> bool:
    """A boolean; True in Hypothesis's simplest draw when ``deep``."""
    return draw(st.booleans()) != deep


def channels(draw, width: int, count: int, offset: int = 0) -> list[int]:
    return [offset + c for c in draw(st.lists(st.integers(0, width - 1), unique=True, min_size=count, max_size=count))]


@st.composite
def head_cuts(draw, adapter, kept: list[int], uniform: bool) -> dict[int, list[int]]:
    """Heads per layer (GQA: whole KV groups or the same number of query heads in each kept group; a layer may
    lose every head). Uniform: every kept layer keeps the same number of groups and heads per group."""
    if adapter.heads_refusal or (uniform and not getattr(adapter, "stock_reload", False)):
        return {}
    layers = [layer for layer in kept if adapter.layout(layer).num_heads]
    shape = None
    if uniform:
        if not layers or not choose(draw):
            return {}
        lay = adapter.layout(layers[0])  # an unpruned model: every layer alike
        shape = (draw(st.integers(1, lay.num_kv_heads)), draw(st.integers(1, lay.group_size)))
    out = {}
    for position, layer in enumerate(layers):
        lay = adapter.layout(layer)
        if shape is None and not choose(draw, position % 2 == 0):
            continue
        # free: 1 to all KV groups kept, or none; as few heads as possible first
        groups = shape[0] if shape else draw(st.sampled_from([*range(1, lay.num_kv_heads + 1), 0]))
        per_group = shape[1] if shape else draw(st.integers(1, lay.group_size))
        size = lay.group_size
        heads = set()
        for g in draw(st.sets(st.integers(0, lay.num_kv_heads - 1), min_size=groups, max_size=groups)):
            heads |= draw(st.sets(st.integers(g * size, (g + 1) * size - 1), min_size=per_group, max_size=per_group))
        removed = sorted(set(range(lay.num_heads)) - heads)
        if removed:
            out[layer] = removed
    return out


@st.composite
def mlp_cuts(draw, adapter, kept: list[int], uniform: bool) -> dict[int, list[int]]:
    """MLP items per layer: dense channels; in MoE layers the same count from every routed expert (each its own,
    leaving a positive multiple of 8) and some of the shared expert's. Uniform: the same widths in every kept
    layer (the narrowest bounds the cut: a second plan may find widths that differ already)."""
    dense = [layer for layer in kept if not is_moe(adapter, layer)]
    moe = [layer for layer in kept if is_moe(adapter, layer)]
    out = {}
    if dense:
        one = amount(draw, min(adapter.intermediate_size(layer) for layer in dense) - 1) if uniform else None
        for position, layer in enumerate(dense):
            width = adapter.intermediate_size(layer)
            out[layer] = channels(draw, width, one if uniform else amount(draw, width - 1, position % 2 == 0))
    if moe and uniform:
        routed_one = ALIGN * amount(draw, (min(adapter.expert_width(layer) for layer in moe) - 1) // ALIGN)
        least = min(adapter.shared_width(layer) for layer in moe)
        shared_one = amount(draw, least - 1) if least else 0
    for position, layer in enumerate(moe):
        width, count, shared = adapter.expert_width(layer), adapter.num_experts(layer), adapter.shared_width(layer)
        deep = position % 2 == 0
        routed = routed_one if uniform else ALIGN * amount(draw, (width - 1) // ALIGN, deep)
        items = [item for e in range(count) for item in channels(draw, width, routed, e * width)]
        if shared:
            items += channels(draw, shared, shared_one if uniform else amount(draw, shared - 1, deep), count * width)
        out[layer] = items
    return {layer: sorted(items) for layer, items in out.items() if items}


@st.composite
def expert_cuts(draw, adapter, kept: list[int], uniform: bool) -> dict[int, list[int]]:
    """Experts per MoE layer, each keeping at least top-k. Uniform: the same count everywhere; otherwise even
    counts too in the simplest draw (an even expert cut beside uneven heads or widths is a remote-code model
    that keeps the load-balancing loss)."""
    moe = [layer for layer in kept if is_moe(adapter, layer)]
    if not moe:
        return {}
    even = uniform or choose(draw)
    one = amount(draw, min(adapter.num_experts(layer) for layer in moe) - TOP_K) if even else None
    out = {}
    for position, layer in enumerate(moe):
        count = adapter.num_experts(layer)
        out[layer] = channels(draw, count, one if even else amount(draw, count - TOP_K, position % 2 == 0))
    return {layer: sorted(e) for layer, e in out.items() if e}


@st.composite
def plans(draw, model, uniform: bool, keep_layers: int = 1) -> dict:
    """A plan over every unit of ``model`` at once (current numbering); blocks dropped, the other units cut
    among the blocks that stay; at least ``keep_layers`` blocks stay."""
    adapter = get_adapter(model)
    n = adapter.num_layers
    dropped = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n - keep_layers), label="layers"))
    kept = [layer for layer in range(n) if layer not in dropped]
    plan = {
        "layers": dropped,
        "heads": draw(head_cuts(adapter, kept, uniform), label="heads"),
        "mlp": draw(mlp_cuts(adapter, kept, uniform), label="mlp"),
        "experts": draw(expert_cuts(adapter, kept, uniform), label="experts"),
    }
    return {unit: entry for unit, entry in plan.items() if entry}


def stock_describes(model, plan: dict) -> bool:
    """Whether the stock class can describe ``model`` (unpruned, every layer alike) after ``plan``: recomputed
    from the plan, not asked of sinv_prune."""
    adapter = get_adapter(model)
    kept = [layer for layer in range(adapter.num_layers) if layer not in plan.get("layers", [])]
    heads, mlp, experts = plan.get("heads", {}), plan.get("mlp", {}), plan.get("experts", {})
    if heads and not getattr(adapter, "stock_reload", False):
        return False
    layouts, dense, counts, widths, shared = set(), set(), set(), set(), set()
    for layer in kept:
        lay = adapter.layout(layer)
        left = [h for h in range(lay.num_heads) if h not in heads.get(layer, [])]
        layouts.add((len(left), len({h // lay.group_size for h in left})))
        if not is_moe(adapter, layer):
            dense.add(adapter.intermediate_size(layer) - len(mlp.get(layer, [])))
            continue
        count, width = adapter.num_experts(layer), adapter.expert_width(layer)
        routed = [i for i in mlp.get(layer, []) if i < count * width]
        counts.add(count - len(experts.get(layer, [])))
        widths.add(width - len(routed) // count)
        shared.add(adapter.shared_width(layer) - (len(mlp.get(layer, [])) - len(routed)))
    return len(layouts) == 1 and next(iter(layouts))[0] > 0 and max(map(len, (dense, counts, widths, shared))) <= 1


# -- the reference --------------------------------------------------------------------------------------


def zeroed(model, plan: dict):
    """A copy of ``model`` whose removed heads and channels have zero output / down projection columns and whose
    removed blocks return their input."""
    ref = copy.deepcopy(model)
    adapter = get_adapter(ref)
    with torch.no_grad():
        for layer, heads in plan.get("heads", {}).items():
            d = adapter.layout(layer).head_dim
            weight = linear_weight(adapter.out_proj(layer))  # [out, in] (a view for GPT-2's Conv1D)
            for h in heads:
                weight[:, h * d : (h + 1) * d] = 0
        for layer, items in plan.get("mlp", {}).items():
            if not is_moe(adapter, layer):
                linear_weight(adapter.mlp_out(layer))[:, items] = 0
                continue
            width, count = adapter.expert_width(layer), adapter.num_experts(layer)
            down = adapter.expert_weights(layer)[2]  # [E, H, I] views of the fused tensors, whatever the layout
            for item in items:
                if item < count * width:
                    down[item // width][:, item % width] = 0
                else:
                    adapter.shared_expert(layer).down_proj.weight[:, item - count * width] = 0
    blocks = adapter.layers()
    for layer in plan.get("layers", []):
        blocks[layer].forward = lambda *args, **kwargs: args[0] if args else kwargs["hidden_states"]
    return ref


def has_experts(model) -> bool:
    return get_adapter(model).config_experts_key is not None


def outputs(model, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logits, loss (with the load-balancing term where the model adds one) and load-balancing loss."""
    with torch.no_grad():
        out = model(**INPUTS, **kwargs)
    return out.logits, out.loss, getattr(out, "aux_loss", None)


def expected(model, plan: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the pruned ``model`` must return: the reference's logits and language-model loss; with
    ``output_router_logits`` and one kept expert count in every MoE layer, plus the load-balancing loss of the
    kept experts' router logits (uneven counts: sinv_prune turns that loss off, transformers cannot stack them)."""
    adapter = get_adapter(model)
    ref = zeroed(model, plan)
    if not has_experts(model):
        return outputs(ref)
    experts, dropped = plan.get("experts", {}), plan.get("layers", [])
    kept = [
        [e for e in range(adapter.num_experts(layer)) if e not in experts.get(layer, [])]
        for layer in range(adapter.num_layers)
        if layer not in dropped and is_moe(adapter, layer)
    ]
    with masked_routers(ref, experts):
        logits, lm, _ = outputs(ref, output_router_logits=False)
        if not ref.config.output_router_logits or len({len(k) for k in kept}) != 1:
            return logits, lm, None  # no MoE layer left, or uneven counts: no load-balancing loss
        with torch.no_grad():
            recorded = ref(input_ids=INPUTS["input_ids"], attention_mask=INPUTS["attention_mask"],
                           output_router_logits=True).router_logits  # fmt: skip
    assert len(recorded) == len(kept)  # one router per MoE block that runs
    balance = sys.modules[base_class(type(ref)).__module__].load_balancing_loss_func  # the family's own
    aux = balance(tuple(r[:, k] for r, k in zip(recorded, kept, strict=True)), len(kept[0]),
                  ref.config.num_experts_per_tok, INPUTS["attention_mask"])  # fmt: skip
    return logits, lm + ref.config.router_aux_loss_coef * aux, aux


def assert_same(got, want, atol: float, what: str) -> None:
    names = ("logits", "loss", "load-balancing loss")
    for name, a, b in zip(names, got, want, strict=True):
        assert (a is None) == (b is None), f"{what}: {name} {'missing' if a is None else 'unexpected'}"
        if a is not None:
            torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m, name=name: f"{what}: {name}: {m}")


# -- reload routes ------------------------------------------------------------------------------------------


def info_route(directory: str) -> str:
    """The route ``sinv-prune info`` names: 'stock' or 'remote' (an unpruned model: 'stock')."""
    result = CliRunner().invoke(main, ["info", directory])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    if "not pruned by sinv_prune" in first:
        return "stock"
    (route,) = [name for name, text in ROUTES.items() if f"({text})" in first]
    return route


def reloads(family: str, directory: str, route: str) -> dict[str, transformers.PreTrainedModel]:
    """The checkpoint loaded through each route ``info`` names: the stock class (no remote code), or
    ``sinv_prune.from_pretrained`` and ``trust_remote_code=True``; the Auto class's load report must be empty."""
    models = {}
    if route == "remote":
        models["sinv_prune.from_pretrained"] = sinv_prune.from_pretrained(directory, attn_implementation="eager")
    auto = auto_class(family)
    trust = route == "remote"
    model, report = auto.from_pretrained(
        directory, trust_remote_code=trust, attn_implementation="eager", output_loading_info=True
    )
    assert not any(report.values()), f"{auto.__name__} (trust_remote_code={trust}) load report: {report}"
    assert type(model).__name__.startswith("SinvPruned") == trust, type(model).__name__
    models[f"{auto.__name__}(trust_remote_code={trust})"] = model
    return {name: m.eval() for name, m in models.items()}


# -- the property --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(data=st.data())
def test_mixed_plan_is_exact_reloads_and_prunes_again(family, route, data):
    variant = data.draw(st.sampled_from(sorted(VARIANTS[family])), label="variant")
    model = fresh(family, variant)
    if has_experts(model):
        model.config.output_router_logits = not data.draw(st.booleans(), label="output_router_logits off")
    stock = route == "stock"
    # remote: at least two blocks stay (one block is always alike), unless heads cut GPT-2 / BERT
    keep = 1 if stock or not getattr(get_adapter(model), "stock_reload", False) else 2
    plan = data.draw(plans(model, uniform=stock, keep_layers=keep).filter(lambda p: stock_describes(model, p) == stock),
                     label="plan")  # fmt: skip
    want = expected(model, plan)
    sinv_prune.prune(model, plan, allow_empty_layers=True)
    got = outputs(model)
    assert_same(got, want, 2e-5, f"{family} pruned by {plan}")

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        assert info_route(directory) == route
        record = get_record(model.config)
        assert (record is None or record.stock_layout) == stock
        reloaded = reloads(family, directory, route)
    for name, again in reloaded.items():
        assert_same(outputs(again), got, 1e-6, f"{family} reloaded through {name}")

    second = next(iter(reloaded.values()))  # the stock class, or sinv_prune.from_pretrained
    plan = data.draw(plans(second, uniform=data.draw(st.booleans(), label="uniform")), label="second plan")
    want = expected(second, plan)
    sinv_prune.prune(second, plan, allow_empty_layers=True)
    got = outputs(second)
    assert_same(got, want, 2e-5, f"{family} pruned again by {plan}")


def test_the_reference_is_not_vacuous():
    """Each kind of cut the reference makes changes the unpruned model's outputs (so the property can fail)."""
    model = fresh("qwen2_moe", "mlp_only_layers")
    model.config.output_router_logits = True
    base = outputs(model)
    adapter = get_adapter(model)
    width = adapter.expert_width(0)
    shared = EXPERTS * width
    for plan in ({"heads": {0: [1]}}, {"mlp": {1: [3, 7, 11]}}, {"mlp": {0: [5, 9, width + 3]}},
                 {"mlp": {0: [shared + 2, shared + 5]}}, {"experts": {2: [1]}}, {"layers": [1]}):  # fmt: skip
        ref = expected(model, plan)
        assert (ref[0] - base[0]).abs().max() > 1e-4, plan
    assert (expected(model, {"experts": {0: [1], 2: [4]}})[2] - base[2]).abs() > 1e-3  # the kept experts' balance


def test_stock_describes_matches_the_route_rules():
    """The independent route prediction, on plans whose route is known."""
    model = fresh("qwen3_moe", "mlp_only_layers")
    assert stock_describes(model, {"experts": {0: [1], 2: [3]}})
    assert not stock_describes(model, {"experts": {0: [1], 2: [3, 4]}})
    assert not stock_describes(model, {"heads": {0: [1, 3]}})
    assert stock_describes(model, {"heads": {0: [1, 3], 1: [0, 2], 2: [1, 2]}})
    assert stock_describes(fresh("gpt2", "plain"), {"mlp": {0: [1], 1: [2], 2: [3]}, "layers": [1]})
    assert not stock_describes(fresh("gpt2", "plain"), {"heads": {0: [1], 1: [1], 2: [1]}})
