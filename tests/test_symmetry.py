"""The second paper: symmetry-breaking biases, ECD, the optimizer registry and Trainer, b_Q alignment."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from conftest import ARCHS, VOCAB, model_inputs, model_output, tiny_model

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.symmetry import (
    ECD,
    BiasDistribution,
    ClosureTrainer,
    add_symmetry_breaking,
    alignment_table,
    build_optimizer,
    get_symmetry_breaking,
    key_cosines,
    optimizer_state_bytes_per_param,
    plot_alignment,
    restore_symmetry_breaking,
)
from sinv_prune.symmetry.alignment import input_norm


def no_dropout(model):
    """Dropout off, so that training-mode forwards differ only by the biases."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def train_output(model, inputs):
    model.train()
    try:
        return model_output(model, inputs)
    finally:
        model.eval()


# -- ECD ---------------------------------------------------------------------------------------


def test_ecd_first_step_by_hand():
    """F = (a^2 + b^2)/2 at a=1, b=2; F0=0, lr=1, eta=100: worked out on paper from the update in ecd.py.

    D=2 so D/(2(D-1)) = 1; dt = 1/sqrt(100) = 0.1; F = 2.5; c = dt*eta/(F-F0) = 4.
    p0 = -g/|g| = (-1, -2)/sqrt(5) = (-0.4472136, -0.8944272).
    a: g=1, p.g = -0.4472136, g - p(p.g) = 1 - 0.2 = 0.8, p = -0.4472136 - 4*0.8 = -3.6472136
    b: g=2, p.g = -1.7888544, g - p(p.g) = 2 - 1.6 = 0.4, p = -0.8944272 - 4*0.4 = -2.4944272
    theta = (1, 2) + 0.1 p = (0.63527864, 1.75055728); then p / |p| (|p| = 4.4186359).
    """
    a, b = torch.nn.Parameter(torch.tensor([1.0])), torch.nn.Parameter(torch.tensor([2.0]))
    opt = ECD([a, b], lr=1.0, eta=100.0, F0=0.0)

    def closure():
        opt.zero_grad()
        loss = 0.5 * (a**2 + b**2).sum()
        loss.backward()
        return loss.detach()

    loss = opt.step(closure)
    assert float(loss) == pytest.approx(2.5)
    assert a.item() == pytest.approx(0.63527864, abs=1e-6)
    assert b.item() == pytest.approx(1.75055728, abs=1e-6)
    assert opt.state[a]["momentum"].item() == pytest.approx(-3.6472136 / 4.4186359, abs=1e-6)
    assert opt.state[b]["momentum"].item() == pytest.approx(-2.4944272 / 4.4186359, abs=1e-6)


def reference_ecd(thetas, grad_fn, loss_fn, steps, lr, eta, F0, wd=0.0):  # noqa: N803
    """ecd.py's ECD_{q=1} update in plain Python lists: ``thetas`` is a list of flat tensors (lists)."""
    D = sum(len(t) for t in thetas)  # noqa: N806
    dt = lr / math.sqrt(eta)
    thetas = [list(t) for t in thetas]
    norm = lambda ps: math.sqrt(sum(x * x for p in ps for x in p))  # noqa: E731
    p = None
    for _ in range(steps):
        F = loss_fn(thetas) + 0.5 * wd * sum(x * x for t in thetas for x in t)  # noqa: N806
        g = [
            [gi + wd * ti for gi, ti in zip(gt, tt, strict=True)]
            for gt, tt in zip(grad_fn(thetas), thetas, strict=True)
        ]
        if p is None:
            n = norm(g)
            p = [[-x / n for x in gt] for gt in g]
        n = norm(p)
        p = [[x / n for x in pt] for pt in p]
        c = dt * eta * D / (2 * (D - 1)) / (F - F0)
        for i in range(len(p)):
            dot = sum(pi * gi for pi, gi in zip(p[i], g[i], strict=True))
            p[i] = [pi - c * (gi - pi * dot) for pi, gi in zip(p[i], g[i], strict=True)]
            thetas[i] = [ti + dt * pi for ti, pi in zip(thetas[i], p[i], strict=True)]
        n = norm(p)
        p = [[x / n for x in pt] for pt in p]
    return thetas, p


def test_ecd_matches_design_formula_step_by_step():
    """Several tensors (per-tensor projection, global norms), weight decay, five steps, against plain Python."""
    scales = [[1.0, 2.0, 0.5], [3.0, 0.2, 1.5, 0.7]]
    start = [[0.3, -1.2, 2.0], [0.5, 1.0, -0.4, 0.9]]

    def loss_fn(ts):
        return 1.0 + sum(0.5 * s * x * x for st, t in zip(scales, ts, strict=True) for s, x in zip(st, t, strict=True))

    def grad_fn(ts):
        return [[s * x for s, x in zip(st, t, strict=True)] for st, t in zip(scales, ts, strict=True)]

    expected, expected_p = reference_ecd(start, grad_fn, loss_fn, steps=5, lr=0.5, eta=20.0, F0=0.25, wd=0.01)

    params = [torch.nn.Parameter(torch.tensor(t, dtype=torch.float64)) for t in start]
    params[1].data = params[1].data.view(2, 2)  # shapes must not matter
    weights = [torch.tensor(s, dtype=torch.float64).view_as(p) for s, p in zip(scales, params, strict=True)]
    opt = ECD(params, lr=0.5, eta=20.0, F0=0.25, weight_decay=0.01)

    def closure():
        opt.zero_grad()
        loss = 1.0 + sum(0.5 * (w * p**2).sum() for w, p in zip(weights, params, strict=True))
        loss.backward()
        return loss.detach()

    for _ in range(5):
        opt.step(closure)
    for p, e, ep in zip(params, expected, expected_p, strict=True):
        assert p.detach().reshape(-1).tolist() == pytest.approx(e, abs=1e-10)
        assert opt.state[p]["momentum"].reshape(-1).tolist() == pytest.approx(ep, abs=1e-10)


def test_ecd_reaches_least_squares_floor_with_one_state_tensor_per_parameter():
    torch.manual_seed(0)
    X, w = torch.randn(64, 5), torch.randn(5, 1)  # noqa: N806
    y = X @ w + 0.1 + 0.3 * torch.randn(64, 1)
    A = torch.cat([X, torch.ones(64, 1)], dim=1)  # noqa: N806
    floor = float(((A @ torch.linalg.lstsq(A, y).solution - y) ** 2).mean())
    model = torch.nn.Linear(5, 1)
    steps = 400  # steps grow as F nears F0 rather than shrink: a decaying lr lets it settle (seeds 0-15: within 0.5%)
    opt = ECD(model.parameters(), lr=0.2, eta=100.0, F0=floor - 0.02)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)

    def closure():
        opt.zero_grad()
        loss = ((model(X) - y) ** 2).mean()
        loss.backward()
        return loss.detach()

    first = float(closure())
    for _ in range(steps):
        opt.step(closure)
        schedule.step()
    final = float(closure())
    assert first > 10 * floor
    assert floor <= final < 1.02 * floor
    assert len(opt.state) == 2
    for p in model.parameters():
        assert set(opt.state[p]) == {"momentum"}
        assert opt.state[p]["momentum"].shape == p.shape
    assert optimizer_state_bytes_per_param(opt) == 4.0


def test_ecd_step_length_is_dt_times_the_updated_momentum_and_depends_on_F0():  # noqa: N802
    """One tensor: the step is dt * sqrt(1 + c^2 |g_perp|^2), c = dt eta D / (2 (D-1) (F - F0)); not a fixed dt."""
    lr, eta = 1.0, 100.0
    dt = lr / math.sqrt(eta)

    def third_step(F0):  # noqa: N803
        theta = torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64))
        scales = torch.tensor([1.0, 4.0, 0.5], dtype=torch.float64)
        opt = ECD([theta], lr=lr, eta=eta, F0=F0)

        def closure():
            opt.zero_grad()
            loss = 1.0 + 0.5 * (scales * theta**2).sum()
            loss.backward()
            return loss.detach()

        for _ in range(2):  # the first step starts at p = -g/|g|, parallel to g: that step is exactly dt
            opt.step(closure)
        p = opt.state[theta]["momentum"].clone()
        before = theta.detach().clone()
        F, g = float(closure()), theta.grad.clone()  # noqa: N806
        opt.step(closure)
        g_perp = g - p * torch.dot(p, g)
        c = dt * eta * 3 / (2 * 2) / (F - F0)
        expected = dt * math.sqrt(1 + c**2 * float(g_perp.norm()) ** 2)
        return float((theta.detach() - before).norm()), expected, F

    far, far_expected, F = third_step(F0=-100.0)  # noqa: N806
    near, near_expected, _ = third_step(F0=8.0)
    assert F > 8.2  # both F0 below the loss: both steps move
    assert far == pytest.approx(far_expected, rel=1e-9) and near == pytest.approx(near_expected, rel=1e-9)
    assert far == pytest.approx(dt, rel=1e-3)
    assert near > 10 * dt


def test_ecd_warns_once_when_the_loss_is_at_or_below_F0(caplog):  # noqa: N802
    def run(F0, steps=3):  # noqa: N803
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        opt = ECD([p], F0=F0)

        def closure():
            opt.zero_grad()
            loss = (p**2).sum()  # 5 at the start
            loss.backward()
            return loss.detach()

        caplog.clear()
        with caplog.at_level("WARNING", logger="sinv_prune"):
            for _ in range(steps):
                opt.step(closure)
        return [r for r in caplog.records if r.name == "sinv_prune.symmetry.ecd"]

    warned = run(F0=10.0)
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    message = warned[0].getMessage()
    assert "F = 5 " in message and "F0 + eps = 10 + 1e-10" in message and "optimizer_args: {F0: ...}" in message
    assert run(F0=5.0) and run(F0=5.0 - 1e-11)  # at F0 + eps too
    assert run(F0=0.0) == []


def test_ecd_counts_nonfinite_losses_warns_once_and_stops_past_the_limit(caplog):
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = ECD([p], F0=0.0, max_nonfinite_steps=3)
    bad = iter([False, True, True, False, True, True])  # NaN at steps 2, 3, 5, 6

    def closure():
        opt.zero_grad()
        loss = (p**2).sum() * (float("nan") if next(bad) else 1.0)
        loss.backward()
        return loss.detach()

    with caplog.at_level("WARNING", logger="sinv_prune"):
        opt.step(closure)
        moved = p.detach().clone()
        opt.step(closure)
        opt.step(closure)
        assert torch.equal(p.detach(), moved) and torch.isfinite(opt.state[p]["momentum"]).all()
        opt.step(closure)
        opt.step(closure)
        assert opt.nonfinite_steps == 3
        with pytest.raises(FloatingPointError, match=r"NaN or infinite in 4 of 6 steps .*max_nonfinite_steps=3"):
            opt.step(closure)
    warned = [r.getMessage() for r in caplog.records if r.name == "sinv_prune.symmetry.ecd"]
    assert len(warned) == 1 and "skipped step 2: the loss is nan" in warned[0]


def test_ecd_first_nan_step_leaves_no_nan_momentum():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = ECD([p], F0=0.0)
    nan = [True]  # the first loss only

    def closure():
        opt.zero_grad()
        loss = (p**2).sum() * (float("nan") if nan and nan.pop() else 1.0)
        loss.backward()
        return loss.detach()

    opt.step(closure)  # NaN: gradient NaN too, must not become the momentum
    opt.step(closure)
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), torch.tensor([1.0, 2.0]))


def test_ecd_needs_closure_stops_at_F0_and_seeds_its_noise():  # noqa: N802
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = ECD([p], F0=10.0)
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss.detach()

    opt.step(closure)  # F = 5 < F0: nothing moves
    assert p.tolist() == [1.0, 2.0]

    def run(seed):
        q = torch.nn.Parameter(torch.arange(6.0))
        o = ECD([q], lr=0.1, F0=-1.0, nu=0.5, seed=seed)

        def c():
            o.zero_grad()
            loss = (q**2).sum()
            loss.backward()
            return loss.detach()

        for _ in range(3):
            o.step(c)
        return q.detach().clone()

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


# -- biases ------------------------------------------------------------------------------------


def test_bias_distribution_defaults_and_json():
    mean, std = BiasDistribution(std_linspace=(0.05, 0.15)).vectors(5)
    assert mean.tolist() == [0.5] * 5
    assert std.tolist() == pytest.approx([0.05, 0.075, 0.1, 0.125, 0.15])
    dist = BiasDistribution(dist="uniform", mean=[0.0, 1.0], std=0.2)
    assert BiasDistribution.coerce(dist.to_json()) == dist
    with pytest.raises(ValueError, match="head_dim"):
        dist.vectors(3)
    with pytest.raises(ValueError):
        BiasDistribution(dist="cauchy")
    with pytest.raises(ValueError):
        BiasDistribution(std=-1.0)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "mistral"])  # mistral: refused (no bias to save E[b])
def test_biases_resampled_in_training_mean_in_eval_and_removable(arch):
    model = no_dropout(tiny_model(arch))
    inputs = model_inputs()
    plain_eval, plain_train = model_output(model, inputs), train_output(model, inputs)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_keys = set(model.state_dict())

    handle = add_symmetry_breaking(model)
    assert {n for n, _ in model.named_parameters()} == set(params)
    assert not [k for k in model.state_dict() if "sinv_b_" in k]  # non-persistent buffers
    assert set(model.state_dict()) >= state_keys  # LLaMA: + the attention biases that hold E[b] in checkpoints
    assert model.config.sinv_symmetry["b_q"]["std_linspace"] == [0.05, 0.15]
    a, b = train_output(model, inputs), train_output(model, inputs)
    assert not torch.allclose(a, b)  # a new draw per training forward
    assert not torch.allclose(a, plain_train)
    e1, e2 = model_output(model, inputs), model_output(model, inputs)
    assert torch.equal(e1, e2) and not torch.allclose(e1, plain_eval)
    with pytest.raises(ValueError, match="already"):
        add_symmetry_breaking(model)

    handle.remove()
    assert torch.equal(model_output(model, inputs), plain_eval)
    assert torch.equal(train_output(model, inputs), plain_train)
    assert not hasattr(model.config, "sinv_symmetry") and get_symmetry_breaking(model) is None
    assert not [n for n, _ in model.named_buffers() if "sinv_b_" in n]
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])


def with_mean_biases_in_weights(model, handle):
    """A copy without hooks whose q/v projection biases carry E[b_Q] / E[b_V] per head."""
    ref = copy.deepcopy(model)
    get_symmetry_breaking(ref).remove()
    adapter = get_adapter(ref)
    with torch.no_grad():
        for layer in range(adapter.num_layers):
            proj, layout = adapter.projections(layer), adapter.layout(layer)
            proj.q_bias += handle.mean(layer, "q").repeat(layout.num_heads)
            proj.v_bias += handle.mean(layer, "v").repeat(layout.num_kv_heads)
    return ref


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "bert", "qwen2", "llama"])
def test_eval_output_equals_explicit_mean_bias(arch, attn):
    """E[b] per head in eval: same output as a plain model whose q/v biases are incremented by it."""
    extra = {"attention_bias": True} if arch == "llama" else {}
    model = tiny_model(arch, attn_implementation=attn, **extra)
    handle = add_symmetry_breaking(
        model, b_q={"mean": [0.1 * i - 0.3 for i in range(8)], "std": 0.3}, b_v={"mean": -0.4, "std": 0.1}
    )
    inputs = model_inputs()
    ref = with_mean_biases_in_weights(model, handle)
    torch.testing.assert_close(model_output(model, inputs), model_output(ref, inputs), rtol=1e-5, atol=1e-5)


def test_one_bias_off_and_pruned_layouts():
    """b_V only; heads pruned unevenly (GQA) before and after adding; E[b] still matches explicit biases."""
    model = tiny_model("qwen2")
    sinv_prune.prune_heads(model, {0: [0, 1], 2: [4, 5]})  # layer 0: 4 heads, 2 KV; layer 2: 4 heads / 2 KV
    handle = add_symmetry_breaking(model, b_q=None, b_v={"dist": "constant", "mean": 0.7})
    assert "sinv_b_q" not in dict(model.named_buffers())
    sinv_prune.prune_heads(model, {1: [0, 1, 2, 3]})
    inputs = model_inputs()
    ref = copy.deepcopy(model)
    get_symmetry_breaking(ref).remove()
    adapter = get_adapter(ref)
    with torch.no_grad():
        for layer in range(adapter.num_layers):
            adapter.projections(layer).v_bias += 0.7
    torch.testing.assert_close(train_output(model, inputs), model_output(ref, inputs), rtol=1e-5, atol=1e-5)
    handle.remove()


def test_seeded_draws_are_reproducible_and_per_layer():
    def draws(seed):
        model = tiny_model("gpt2")
        handle = add_symmetry_breaking(model, seed=seed)
        train_output(model, model_inputs())
        return [handle.current(layer, "q").clone() for layer in range(3)]

    first, again, other = draws(5), draws(5), draws(6)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], first[1])


def test_one_draw_per_model_forward_survives_gradient_checkpointing():
    """The recomputation in the backward pass sees the same biases as the forward did."""
    plain = no_dropout(tiny_model("llama"))
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable({"use_reentrant": False})
    inputs = model_inputs()
    grads, calls = [], []
    for model in (plain, checkpointed):
        add_symmetry_breaking(model, seed=1)
        model.train()
        calls.append(0)
        counter = model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda *_: calls.__setitem__(-1, calls[-1] + 1)
        )
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        counter.remove()
        grads.append([p.grad for p in model.parameters()])
    assert calls == [1, 2]  # the checkpointed layer did run again in the backward pass
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reload_restores_symmetry_breaking(arch, tmp_path):
    """save_pretrained + sinv_prune.from_pretrained + restore: same eval output; pruned models too."""
    model = tiny_model(arch)
    # GPT-2: uneven head counts, remote-code class; LLaMA: the same count everywhere, stock class
    prune = {0: [1], 2: [0, 3]} if arch == "gpt2" else {layer: [0, 1, 2] for layer in range(3)}
    sinv_prune.prune_heads(model, prune)
    add_symmetry_breaking(model, b_v={"dist": "uniform", "mean": 0.3, "std": 0.1}, seed=3)
    inputs = model_inputs()
    expected = model_output(model, inputs)
    model.save_pretrained(tmp_path)
    loaded = sinv_prune.from_pretrained(tmp_path)
    handle = restore_symmetry_breaking(loaded)
    assert handle is not None and restore_symmetry_breaking(loaded) is handle
    assert handle.setting.seed == 3 and handle.setting.b_v.dist == "uniform"
    torch.testing.assert_close(model_output(loaded.eval(), inputs), expected, rtol=1e-6, atol=1e-6)
    handle.remove()
    assert restore_symmetry_breaking(loaded) is None


def test_unsupported_or_empty_requests():
    with pytest.raises(ValueError, match="nothing"):
        add_symmetry_breaking(tiny_model("gpt2"), b_q=None, b_v=None)
    with pytest.raises(ValueError, match="unsupported"):
        add_symmetry_breaking(torch.nn.Linear(2, 2))
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="head_dim=8"):
        add_symmetry_breaking(model, b_v={"mean": [0.1, 0.2, 0.3]})
    assert not [n for n, _ in model.named_buffers() if "sinv_b_" in n] and not hasattr(model.config, "sinv_symmetry")


# -- optimizers and Trainer --------------------------------------------------------------------


def lm_dataset(n=8, length=12):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def trainer_args(tmp_path, **kw):
    defaults = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none", use_cpu=True,
        save_strategy="no", logging_steps=1, disable_tqdm=True, max_grad_norm=0.0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**defaults, **kw})


class RecordingECD(ECD):
    def step(self, closure=None):
        loss = super().step(closure)
        self.losses.append(float(loss))
        return loss


@pytest.mark.parametrize("name", ["adamw", "sgd", "ecd", "soap"])
def test_every_optimizer_trains_a_few_trainer_steps(name, tmp_path):
    if name == "soap":
        pytest.importorskip("pytorch_optimizer", reason="SOAP comes from the pytorch-optimizer package")
    model = tiny_model("gpt2")
    add_symmetry_breaking(model, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = {"F0": 0.0} if name == "ecd" else {}
    if name == "ecd":
        optimizer = RecordingECD(model.parameters(), **kwargs)
        optimizer.losses = []
    else:
        optimizer = build_optimizer(name, model.parameters(), **kwargs)
    args = trainer_args(tmp_path, gradient_accumulation_steps=2)
    trainer = ClosureTrainer(model=model, args=args, train_dataset=lm_dataset(), optimizers=(optimizer, None))
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    per_param = optimizer_state_bytes_per_param(optimizer)
    assert per_param == pytest.approx({"adamw": 8.0, "sgd": 4.0, "ecd": 4.0}.get(name, per_param), rel=0.01)
    if name == "soap":
        assert per_param > 8.0  # preconditioner bases on top of Adam's moments
    if name == "ecd":  # the closure gave ECD the loss the Trainer logged (summed over accumulation)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert optimizer.losses == pytest.approx(logged, abs=1e-4)


def test_plain_trainer_with_ecd_says_what_to_use(tmp_path):
    model = tiny_model("gpt2")
    trainer = transformers.Trainer(
        model=model, args=trainer_args(tmp_path, max_steps=1), train_dataset=lm_dataset(2),
        optimizers=(ECD(model.parameters()), None),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="ClosureTrainer"):
        trainer.train()


def test_build_optimizer_names():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer("AdamW", params), torch.optim.AdamW)
    sgd = build_optimizer("sgdm", params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert build_optimizer("ecd", params, eta=10.0).defaults["eta"] == 10.0
    with pytest.raises(ValueError, match="adamw"):
        build_optimizer("lion", params)


# -- alignment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_alignment_table_matches_a_manual_key(arch, tmp_path):
    model = tiny_model(arch)
    handle = add_symmetry_breaking(model, b_q={"mean": [(-1) ** i * 0.1 * i for i in range(8)], "std": 0.1})
    vocab = [f"tok{i}" for i in range(VOCAB)]
    rows = alignment_table(model, vocab, layer=1, top_k=3)
    adapter = get_adapter(model)
    layout = adapter.layout(1)
    assert len(rows) == layout.num_heads * 2 * 3
    head = layout.num_heads - 1
    kv = head // layout.group_size
    mine = [r for r in rows if r["head"] == head]
    assert {r["kv_head"] for r in mine} == {kv}
    top = [r for r in mine if r["side"] == "top"]
    bottom = [r for r in mine if r["side"] == "bottom"]
    assert [r["rank"] for r in top] == [1, 2, 3]
    assert top[0]["cosine"] >= top[-1]["cosine"] >= bottom[-1]["cosine"] >= bottom[0]["cosine"]
    assert top[0]["token"] == vocab[top[0]["token_id"]]

    # by hand: the norm before layer 1's attention, then W_K of the serving KV head plus its bias
    if arch == "gpt2":
        norm = model.transformer.h[1].ln_1
    elif arch == "llama":
        norm = model.model.layers[1].input_layernorm
    else:  # post-norm: the previous block's output LayerNorm
        norm = model.bert.encoder.layer[0].output.LayerNorm
    assert input_norm(model, 1) is norm
    proj = adapter.projections(1)
    rows_k = slice(kv * layout.head_dim, (kv + 1) * layout.head_dim)
    with torch.no_grad():
        x = norm(model.get_input_embeddings().weight[top[0]["token_id"]])
        key = proj.k[rows_k] @ x + (proj.k_bias[rows_k] if proj.k_bias is not None else 0)
        cos = torch.nn.functional.cosine_similarity(key, handle.mean(1, "q"), dim=0)
    assert top[0]["cosine"] == pytest.approx(float(cos), abs=1e-5)
    assert key_cosines(model, 1).shape == (layout.num_heads, VOCAB)

    if arch == "gpt2":  # one plot is enough (matplotlib is slow to start)
        path = plot_alignment([r for r in rows if r["head"] < 2], tmp_path / "align.png")
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_alignment_needs_a_query_bias():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="b_q"):
        alignment_table(model, None, layer=0)
    rows = alignment_table(model, None, layer=0, top_k=2, b_q=torch.ones(8))
    assert rows[0]["token"] == str(rows[0]["token_id"])
