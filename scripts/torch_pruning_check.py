"""Why sinv_prune does not use torch-pruning (not a dependency; run with `pip install torch-pruning==1.6.1`).

torch-pruning 1.6.1 on tiny HF transformers v5 models (GPT-2, BERT, LLaMA-GQA). CPU, ~15 s.
Prints: case | what happened | verdict. "vs masked" = max |pruned - original with removed heads/channels zeroed|."""
import copy
import tempfile
import warnings

import torch
import torch_pruning as tp
import transformers as T

warnings.filterwarnings("ignore")
T.logging.set_verbosity_error()
T.utils.logging.disable_progress_bar()
IDS = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))


build = lambda cls, cfg: (torch.manual_seed(0), cls(cfg).eval())[1]  # noqa: E731
SIZES = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6)
llama = lambda attn="eager": build(T.LlamaForCausalLM, T.LlamaConfig(  # noqa: E731
    **SIZES, num_key_value_heads=2, head_dim=8, attn_implementation=attn))
bert = lambda: build(T.BertModel, T.BertConfig(**SIZES, max_position_embeddings=64))  # noqa: E731
gpt2 = lambda: build(T.GPT2LMHeadModel, T.GPT2Config(vocab_size=64, n_embd=48, n_layer=2, n_head=6))  # noqa: E731


def fwd(m, x=IDS):
    o = m(x) if isinstance(m, T.BertModel) else m(x, use_cache=False)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def parts(m):  # per layer: (q, k, v, o, [mlp in-projections], mlp out-projection)
    if isinstance(m, T.BertModel):
        return [(L.attention.self.query, L.attention.self.key, L.attention.self.value, L.attention.output.dense,
                 [L.intermediate.dense], L.output.dense) for L in m.encoder.layer]
    return [(L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj, L.self_attn.o_proj,
             [L.mlp.gate_proj, L.mlp.up_proj], L.mlp.down_proj) for L in m.model.layers]


def prune(m, ratio, head_ratio=0.0, glob=False, heads=True, head_dims=True, only_mlp=False):
    nh, c = {}, m.config
    for q, k, v, *_ in parts(m) if heads else []:
        nh.update({q: c.num_attention_heads, k: c.num_key_value_heads, v: c.num_key_value_heads}
                  if hasattr(c, "num_key_value_heads") else dict.fromkeys((q, k, v), c.num_attention_heads))
    ign = [m.lm_head] if hasattr(m, "lm_head") else []  # else it prunes the vocabulary
    if only_mlp or not head_dims:  # keep residual width; and attention (only_mlp) or the MLP (heads only)
        ign += [m.get_input_embeddings()] + [x for p in parts(m) for x in (p[:4] if only_mlp else p[4] + [p[5]])]
    p = tp.pruner.MetaPruner(m, IDS, tp.importance.MagnitudeImportance(p=2), forward_fn=fwd, pruning_ratio=ratio,
                             global_pruning=glob, num_heads=nh, prune_num_heads=heads, prune_head_dims=head_dims,
                             head_pruning_ratio=head_ratio, ignored_layers=ign)
    p.step()
    return p


def dropped(w0, w1, block):  # original row-blocks (heads / channels) that no longer appear in w1
    return [i for i in range(w0.shape[0] // block) if not any(torch.equal(w0[i * block], r) for r in w1)]


def masked(m0, m, what):
    ref = copy.deepcopy(m0)
    for (q0, *_, mi0, _), (q1, *_, mi1, _), (*_, o_r, _, mo_r) in zip(parts(m0), parts(m), parts(ref), strict=True):
        cols = [c for h in dropped(q0.weight, q1.weight, 8) for c in range(h * 8, h * 8 + 8)] if what == "heads" \
            else dropped(mi0[0].weight, mi1[0].weight, 1)
        (o_r if what == "heads" else mo_r).weight.data[:, cols] = 0
    return f"vs masked {(fwd(m) - fwd(ref)).abs().max().item():.0e}"


def reload(m):
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        try:
            return f"reload ok diff {(fwd(type(m).from_pretrained(d).eval()) - fwd(m)).abs().max().item():.0e}"
        except Exception as e:
            return f"reload FAIL {type(e).__name__} (size mismatch)" if "mismatch" in str(e) else f"reload FAIL {e}"


def desc(m, p=None):
    q, k, _, o, mi, _ = parts(m)[0]
    s = (f"L0 q{tuple(q.weight.shape)} k{tuple(k.weight.shape)} o{tuple(o.weight.shape)} mlp{mi[0].out_features}"
         f" q_out/layer={[p_[0].out_features for p_ in parts(m)]}")
    if p is not None and q in p.num_heads:
        s += f" tp.num_heads q/k={p.num_heads[q]}/{p.num_heads[k]} tp.initial_total_heads={p.initial_total_heads}"
    try:
        return s + f" cfg.heads={m.config.num_attention_heads}; fwd ok {tuple(fwd(m).shape)}"
    except Exception as e:
        return s + f" cfg.heads={m.config.num_attention_heads}; fwd FAIL {str(e)[:52]}"


def case(name, fn, verdict=None):
    try:
        what, v = fn()
    except Exception as e:
        what, v = f"CRASH {type(e).__name__}: {str(e).splitlines()[0][:70]}", "BROKEN"
    print(f"{name:<25}| {what} | {verdict or v}")


def gpt2_case():
    dg = tp.DependencyGraph().build_dependency(m := gpt2(), example_inputs=IDS, forward_fn=fwd)
    roots = [dg._module2name[g[0].dep.target.module] for g in dg.get_all_groups()]
    prune(m, 0.5, heads=False)
    return f"prunable group roots={roots}; after pr=0.5 c_fc{tuple(m.transformer.h[0].mlp.c_fc.weight.shape)}", \
        "NO-OP: Conv1D not traced (its weights are only 'unwrapped parameters')"


def llama_heads(attn, ratio, glob=False, head_dims=True):
    m = copy.deepcopy(m0 := llama(attn))
    s = desc(m, prune(m, ratio, 1 / 3, glob, head_dims=head_dims))
    if head_dims or glob:
        return s, ""
    n = m.model.layers[0].self_attn.q_proj.out_features // 8
    [setattr(L.self_attn, "num_key_value_groups", n // 2) for L in m.model.layers]
    m.config.num_attention_heads = n
    return s + f" -> after setting num_key_value_groups={n // 2}, cfg.heads={n}: {masked(m0, m, 'heads')}, " \
        f"{reload(m)}", "OK only via pr>0 trigger + eager trace + manual attr/config fix"


def mlp(mk, glob):
    m = copy.deepcopy(m0 := mk())
    prune(m, 0.5, glob=glob, heads=False, only_mlp=True)
    w = [p[4][0].out_features for p in parts(m)]
    s = f"mlp widths={w} cfg.intermediate_size={m.config.intermediate_size} (not updated); {masked(m0, m, 'mlp')}"
    if glob:
        return s + f"; {reload(m)}", "per-layer widths: stock config cannot describe them"
    m.config.intermediate_size = w[0]
    return s + f"; after cfg.intermediate_size={w[0]}: {reload(m)}", "GOOD (caller sets intermediate_size)"


def bert_heads(ratio, glob, hr=1 / 3):
    m = copy.deepcopy(m0 := bert())
    prune(m, ratio, hr, glob, head_dims=False)
    a = m.encoder.layer[0].attention.self
    s = desc(m) + f"; attrs num_attention_heads={a.num_attention_heads} all_head_size={a.all_head_size}"
    m.config.num_attention_heads = a.query.out_features // 8
    return s + f"; {masked(m0, m, 'heads')}; cfg.heads={m.config.num_attention_heads}: {reload(m)}", \
        "prunes right; stock BERT can't reload (head size = hidden/heads)"


case("gpt2 any", gpt2_case)
case("llama heads sdpa(dflt)", lambda: llama_heads("sdpa", 0.0), "BROKEN: SDPA enable_gqa traced as q(48)<->k(16) 1:1")
case("llama heads pr=0", lambda: llama_heads("eager", 0.0), "NO-OP: heads need pruning_ratio>0")
case("llama heads pr=.25", lambda: llama_heads("eager", 0.25), "CORRUPT: q heads+head_dim cut, k/v untouched")
case("llama heads-only local", lambda: llama_heads("eager", 0.01, head_dims=False))
case("llama heads-only global", lambda: llama_heads("eager", 0.01, True, False), "CORRUPT: count!=weights, no-op")
case("llama mlp local eager", lambda: mlp(llama, False))
case("llama mlp local sdpa", lambda: mlp(lambda: llama("sdpa"), False))
case("llama mlp global", lambda: mlp(llama, True))
case("bert heads pr=0", lambda: bert_heads(0.0, False), "NO-OP: heads need pruning_ratio>0")
case("bert heads-only local", lambda: bert_heads(0.01, False))
case("bert heads-only global .5", lambda: bert_heads(0.01, True, 0.5), "prunes right; uneven heads/layer; no reload")
case("bert mlp local", lambda: mlp(bert, False))
