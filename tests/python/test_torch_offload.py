"""ztier.torch against references, on the host device (no GPU needed).

Exact: a tiny Hugging Face model trained through ztier equals a plain copy
trained in memory whose fp32 masters are updated by ztier's own AdamW kernel
in the engine's order (reference.py): bit-identical losses, grad norms, bf16
params and fp32 masters, across tied / untied weights, activation
checkpointing off / reentrant / non-reentrant, accumulation 1 and 3, clipping
on and off, frozen parameters, two param groups with an LR schedule, and
states in DRAM and on NVMe.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import ztier
import ztier.torch as zt
from conftest import VOCAB, batch, tiny_gpt2, tiny_llama
from reference import Reference
from ztier.hf import INDEX

ADAMW = zt.AdamW(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 no_decay=("bias", "norm", "ln_"))


def _freeze(model):
    for name, p in model.named_parameters():
        if "layers.1.mlp" in name or "h.1.mlp" in name:
            p.requires_grad_(False)


def train_both(model, settings, *, steps=3, accumulation=1, clip=0.0, checkpointing=None,
               states="dram", frozen=False, adamw=ADAMW, dtype=None):
    """Trains `model` through ztier and a copy through the reference; checks
    every loss and grad norm on the way and returns (z, reference)."""
    if frozen:
        _freeze(model)
    if checkpointing is not None:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=adamw, clip_grad_norm=clip, grad_accumulation=accumulation,
                   states=states, settings=settings, compute_dtype=dtype)
    ref = Reference(ref_model, z, adamw, clip=clip, accumulation=accumulation)
    sched = torch.optim.lr_scheduler.LambdaLR(z.optimizer, lambda s: 1.0 / (1 + s))
    for step in range(steps):
        for micro in range(accumulation):
            x = batch(step, micro)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            ref_loss = ref_model(input_ids=x, labels=x).loss
            ref.backward(ref_loss)
            assert torch.equal(loss, ref_loss), (step, micro, loss.item(), ref_loss.item())
        lrs = [g["lr"] for g in z.optimizer.param_groups]
        z.optimizer.step()
        sched.step()
        z.optimizer.zero_grad()
        ref_norm = ref.step(lrs)
        assert z.grad_norm() == ref_norm, (step, z.grad_norm(), ref_norm)
    return z, ref


def assert_same_state(z, ref):
    masters = z.master_weights()
    for u in ref.units:
        for name, off, n, _, _ in u["tensors"]:
            assert torch.equal(masters[name].reshape(-1), u["master"][off:off + n]), name
    with z.gathered():
        for name, p in z.module.named_parameters():
            assert torch.equal(p, ref.params[name]), name


BF16 = "bf16"  # compute dtype; None: ztier.torch's default (fp32 on the host)
EXACT_CASES = [
    # (model, tied, checkpointing, accumulation, clip, states, frozen, compute dtype)
    ("llama", False, None, 1, 0.0, "dram", False, None),
    ("llama", False, None, 1, 0.0, "dram", False, BF16),
    ("llama", True, None, 1, 1.0, "dram", False, None),
    ("llama", False, "reentrant", 1, 1.0, "dram", False, None),
    ("llama", False, "non_reentrant", 3, 1.0, "dram", False, None),
    ("llama", True, "non_reentrant", 1, 0.0, "dram", True, BF16),
    ("llama", False, None, 3, 0.05, "nvme", False, None),
    ("llama", True, "reentrant", 3, 0.0, "nvme", True, None),
    ("gpt2", True, None, 1, 1.0, "dram", False, BF16),
    ("gpt2", True, "non_reentrant", 3, 1.0, "nvme", True, None),
]


@pytest.mark.parametrize("kind,tied,checkpointing,accumulation,clip,states,frozen,dtype",
                         EXACT_CASES)
def test_exact_against_reference(settings, kind, tied, checkpointing, accumulation, clip,
                                 states, frozen, dtype):
    model = tiny_llama(tied=tied) if kind == "llama" else tiny_gpt2()
    z, ref = train_both(model, settings, accumulation=accumulation, clip=clip,
                        checkpointing=checkpointing, states=states, frozen=frozen,
                        dtype=torch.bfloat16 if dtype == BF16 else None)
    assert_same_state(z, ref)
    if clip == 0.05:
        assert z.grad_norm() > 0.05  # the clip did act


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Plain(torch.nn.Module):
    """A model with no Hugging Face in it: blocks in a ModuleList (found by
    the fallback), each called through torch.utils.checkpoint of the module
    itself, so the recompute re-enters the module's forward hooks inside
    backward (without their post-hooks, for the non-reentrant form)."""

    def __init__(self, checkpointing=None, width=32, depth=3):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for b in self.blocks:
            if self.checkpointing is None:
                h = b(h)
            else:
                h = torch.utils.checkpoint.checkpoint(
                    b, h, use_reentrant=self.checkpointing == "reentrant")
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_exact_with_hooks_reentered_in_backward(settings, checkpointing, accumulation):
    torch.manual_seed(0)
    model = Plain(checkpointing)
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, clip_grad_norm=1.0, grad_accumulation=accumulation,
                   settings=settings)
    assert [u.name for u in z.units] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    ref = Reference(ref_model, z, ADAMW, clip=1.0, accumulation=accumulation)
    for step in range(3):
        for micro in range(accumulation):
            x = batch(step, micro)
            loss = model(x, x)
            loss.backward()
            ref_loss = ref_model(x, x)
            ref.backward(ref_loss)
            assert torch.equal(loss, ref_loss), (step, micro)
        lrs = [g["lr"] for g in z.optimizer.param_groups]
        z.optimizer.step()
        assert z.grad_norm() == ref.step(lrs)
    assert_same_state(z, ref)
    assert (z.recomputes > 0) == (checkpointing is not None)
    assert all(u.holds == 0 for u in z.units)


def test_units_follow_the_model(settings):
    model = tiny_llama(tied=True)
    z = zt.offload(model, settings=settings)
    names = [u.name for u in z.units]
    assert names == ["embed", "model.layers.0", "model.layers.1", "head"]
    # The tied head weight lives in the embedding unit, once.
    tensors = [t.name for u in z.units for t in u.tensors]
    assert tensors.count("model.embed_tokens.weight") == 1
    assert "lm_head.weight" not in tensors
    assert [t.name for t in z.units[-1].tensors] == ["model.norm.weight"]


def test_frozen_parameters_get_no_moments(settings):
    """Frozen tensors (a LoRA model's base weights) go to units of their own,
    for which the engine keeps no AdamW moments: 8 bytes a param less."""
    model = tiny_llama()
    _freeze(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    z = zt.offload(model, settings=settings)
    assert "model.layers.1.frozen" in [u.name for u in z.units]
    full = zt.offload(tiny_llama(), settings=settings)
    saved = full.job.counters()["dram_bytes"] - z.job.counters()["dram_bytes"]
    assert saved >= 8 * frozen, (saved, frozen)


def test_params_read_outside_hooks_are_nan(settings, tmp_path):
    model = tiny_llama()
    z = zt.offload(model, settings=settings)
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.shape == (64, 32)
    assert torch.isnan(w.float()).all()
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # no crash on a NaN placeholder
    with z.gathered():
        sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(torch.isnan(v.float()).any() for v in sd.values())
    assert torch.isnan(w.float()).all()


def test_gathered_state_dict_has_the_trained_values(settings):
    model = tiny_llama()
    initial = {k: v.detach().to(torch.bfloat16) for k, v in model.named_parameters()}
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), settings=settings)
    initial = {k: v.to(z.compute_dtype) for k, v in initial.items()}
    with z.gathered():
        before = {k: v.clone() for k, v in model.state_dict().items() if k in initial}
    assert all(torch.equal(before[k], initial[k]) for k in initial)
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    with z.gathered():
        after = {k: v.clone() for k, v in model.state_dict().items() if k in initial}
    assert all(not torch.equal(after[k], before[k]) for k in initial)


def test_loss_falls_on_a_fixed_batch(settings):
    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), clip_grad_norm=1.0, settings=settings)
    x = batch(0, rows=4)
    losses = []
    for _ in range(30):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_int8_states_track_fp32_on_a_fixed_batch(settings, tmp_path):
    """8-bit m and v (ztier.state_dtype int8), states on NVMe: the loss falls
    as with fp32 states, the last losses within 3%."""
    losses = {}
    for dtype in ("fp32", "int8"):
        swap = tmp_path / f"swap-{dtype}"  # an engine of its own
        swap.mkdir()
        model = tiny_llama()
        z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), clip_grad_norm=1.0, states="nvme",
                       settings={**settings, "ZTIER_NVME_PATHS": str(swap),
                                 "ztier.state_dtype": dtype})
        x = batch(0, rows=4)
        losses[dtype] = []
        for _ in range(30):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            z.optimizer.step()
            losses[dtype].append(loss.item())
        z.close()
    assert losses["int8"][-1] < 0.5 * losses["int8"][0], losses
    last = lambda xs: sum(xs[-5:]) / 5  # noqa: E731
    assert abs(last(losses["int8"]) - last(losses["fp32"])) <= 0.03 * last(losses["fp32"]), losses


def test_against_torch_adamw(settings):
    """One step agrees with torch.optim.AdamW on fp32 masters to 1e-5 x lr per
    element, and 30 steps' losses within 1e-3 relative. Not bitwise: torch's
    AdamW evaluates the update in another order (its foreach kernel divides
    by the bias-corrected denominators separately), so the last bits of the
    fp32 masters differ, and bf16 rounding of the params can then differ."""
    lr = 1e-3
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    masters = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    fp32 = {n: torch.nn.Parameter(v) for n, v in masters.items()}
    opt = torch.optim.AdamW(fp32.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    z = zt.offload(model, optimizer=zt.AdamW(lr=lr, weight_decay=0.01), settings=settings)
    dtype = z.compute_dtype  # both models compute on the bf16 params in this dtype
    for p in ref_model.parameters():
        p.data = p.data.to(torch.bfloat16).to(dtype)
    ref_params = dict(ref_model.named_parameters())
    for step in range(30):
        x = batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        ref_loss = ref_model(input_ids=x, labels=x).loss
        ref_loss.backward()
        for n, p in ref_params.items():
            fp32[n].grad = p.grad.to(torch.bfloat16).float()  # the grads ztier's engine gets
            p.grad = None
        opt.step()
        for n, p in ref_params.items():
            p.data = fp32[n].detach().to(torch.bfloat16).to(dtype)
        if step == 0:
            ours = z.master_weights()
            for n in masters:
                assert torch.allclose(ours[n], fp32[n].detach(), rtol=0, atol=1e-5 * lr), n
        assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-3), (step, loss, ref_loss)


def test_the_kernel_takes_the_betas_in_double():
    """As torch's AdamW takes Python floats: 1 - beta2 from the float nearest
    0.99999 would be 0.14% off, and without bias correction nothing cancels it."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4096, generator=gen)
    p = torch.randn(4096, generator=gen)
    m, v = torch.zeros(4096), torch.zeros(4096)
    p0 = p.double()
    skipped, _ = ztier.adamw_step(p, g, m, v, step=1, lr=1e-3, beta1=0.95, beta2=0.99999,
                                  bias_correction=False)
    assert not skipped
    g64 = g.double()
    m_ref, v_ref = (1 - 0.95) * g64, (1 - 0.99999) * g64 * g64
    assert torch.allclose(m.double(), m_ref, rtol=1e-6, atol=0)
    assert torch.allclose(v.double(), v_ref, rtol=1e-6, atol=0)
    p_ref = p0 - 1e-3 * m_ref / (v_ref.sqrt() + 1e-8)
    assert torch.allclose(p.double(), p_ref, rtol=1e-6, atol=1e-7)  # the update is 1.6e-2


@pytest.mark.parametrize("margin", [8e-7, 1e-7])
def test_clipping_scales_as_clip_grad_norm_(settings, margin):
    """torch.nn.utils.clip_grad_norm_ scales the grads by clip / (norm + 1e-6)
    wherever that is below 1, for a norm up to 1e-6 under the clip too;
    ztier scaled only a norm over the clip. With grads as small as AdamW's eps
    the scale shows in the update (a clip of 1e-6 trained 5% off torch)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def loss_of(m):
        return ((m(x) - y) ** 2).mean() * 1e-7  # grads of norm ~2e-7

    masters = [p.detach().clone() for p in ref.parameters()]
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16).float()  # what ztier's forward reads
    loss_of(ref).backward()
    for p, w in zip(ref.parameters(), masters):
        w.grad = p.grad.to(torch.bfloat16).float()  # the grads ztier's engine gets
    norm = math.sqrt(sum(float(w.grad.double().pow(2).sum()) for w in masters))
    clip = norm + margin  # the norm is under the clip
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-3, weight_decay=0.0), clip_grad_norm=clip,
                   settings=settings)
    loss_of(model).backward()
    z.optimizer.step()
    assert z.grad_norm() == pytest.approx(norm, rel=1e-6)
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.0)
    torch.nn.utils.clip_grad_norm_(masters, clip)
    opt.step()
    for a, b in zip(z.master_weights().values(), masters):
        assert torch.allclose(a, b.detach(), rtol=0, atol=1e-7), (a - b).abs().max()
    z.close()


def test_a_short_accumulation_window_steps_on_the_sum_of_its_grads(settings):
    """optimizer.step() after fewer backward passes than grad_accumulation
    (an epoch's last window) was refused. The engine sums the micro-steps'
    grads: the window is completed with zero grads, and the step is torch's
    AdamW on the sum of the passes' (bf16) grads."""
    lr = 1e-3
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    fp32 = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ref_model.named_parameters()}
    opt = torch.optim.AdamW(fp32.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    z = zt.offload(model, optimizer=zt.AdamW(lr=lr, weight_decay=0.01), grad_accumulation=3,
                   settings=settings)
    for p in ref_model.parameters():
        p.data = p.data.to(torch.bfloat16).to(z.compute_dtype)
    ref_params = dict(ref_model.named_parameters())
    for micro in range(2):
        x = batch(0, micro)
        model(input_ids=x, labels=x).loss.backward()
        ref_model(input_ids=x, labels=x).loss.backward()
        for n, p in ref_params.items():
            g = p.grad.to(torch.bfloat16).float()  # the grads ztier's engine gets
            fp32[n].grad = g if fp32[n].grad is None else fp32[n].grad + g
            p.grad = None
    z.optimizer.step()
    want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in fp32.values()))
    opt.step()
    assert z.step_count == 1
    assert z.grad_norm() == pytest.approx(want, rel=1e-6)
    ours = z.master_weights()
    for n in fp32:
        assert torch.allclose(ours[n], fp32[n].detach(), rtol=0, atol=1e-5 * lr), n
    # The next window is a whole one again.
    for micro in range(3):
        x = batch(1, micro)
        model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="call optimizer.step"):
        model(input_ids=x, labels=x)
    z.optimizer.step()
    assert z.step_count == 2
    with pytest.raises(RuntimeError, match="after 0 backward passes"):
        z.optimizer.step()
    z.close()


def test_misuse_is_a_clear_error(settings):
    model = tiny_llama()
    z = zt.offload(model, grad_accumulation=2, settings=settings)
    with pytest.raises(RuntimeError, match="grad_accumulation=2"):
        z.optimizer.step()
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="call optimizer.step"):
        model(input_ids=x, labels=x)
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        z.save_checkpoint("unused")
    z.optimizer.step()
    with pytest.raises(ValueError, match="already offloaded"):
        zt.offload(model, settings=settings)
    with pytest.raises(ValueError, match="grad_accumulation"):
        zt.offload(tiny_llama(), grad_accumulation=0, settings=settings)
    with pytest.raises(ztier.InvalidArgumentError, match="no setting"):
        zt.offload(tiny_llama(), settings={"no.such.key": "1"})
    with pytest.raises(IndexError, match="has no unit 99"):  # ztier.OutOfRangeError
        z.job.layout(99)
    with pytest.raises(ztier.InvalidArgumentError, match="64K is less than 1 MiB"):
        zt.offload(tiny_llama(), settings={"ztier.dram_budget": "64K"})
    with pytest.raises(ztier.ResourceExhaustedError, match="dram_budget"):
        zt.offload(torch.nn.Linear(1024, 1024), settings={"ztier.dram_budget": "1M"})  # 16 MB


def _backward_failing_in_layer0(model, x):
    """A forward and a backward that raises once its grads reach the first
    layer: the units after it have sent theirs to the engine by then."""
    def boom(grad):
        raise ArithmeticError("boom")

    def arm(module, args, out):
        out.register_hook(boom)  # (a forward hook that returns a value replaces the output)

    handle = model.model.layers[0].register_forward_hook(arm)
    try:
        with pytest.raises(ArithmeticError):
            model(input_ids=x, labels=x).loss.backward()
    finally:
        handle.remove()


def test_a_failed_forward_or_backward(settings, tmp_path):
    model = tiny_llama()
    z = zt.offload(model, settings=settings)
    x = batch(0)
    with pytest.raises(IndexError):
        model(input_ids=x + VOCAB, labels=x)  # token ids past the vocabulary
    assert any(u.holds for u in z.units)
    with z.gathered():  # a gather is not mistaken for a stale hold
        loss = model(input_ids=x, labels=x).loss  # the stale holds are dropped
    assert all(u.holds == 0 for u in z.units)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    z.optimizer.step()
    assert all(u.holds == 0 for u in z.units)

    def boom(grad):
        raise ArithmeticError("boom")

    loss = model(input_ids=x, labels=x).loss
    loss.register_hook(boom)
    with pytest.raises(ArithmeticError):
        loss.backward()
    # Raised inside backward, before any unit's grads were sent.
    def arm_head(module, args, out):
        out.register_hook(boom)

    handle = model.model.norm.register_forward_hook(arm_head)
    loss = model(input_ids=x, labels=x).loss
    with pytest.raises(ArithmeticError):
        loss.backward()
    handle.remove()
    loss = model(input_ids=x, labels=x).loss  # nothing reached the engine yet: fine
    loss.backward()
    z.optimizer.step()
    z.wait()
    # An error once some units' grads are in the engine: the next forward
    # drops that step (the engine discards its grads) and says so.
    _backward_failing_in_layer0(model, x)
    with pytest.warns(UserWarning, match="did not finish.*discarded.*as after step 2"):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    z.optimizer.step()
    assert z.step_count == 3
    # optimizer.step() after such a backward takes no step, and says so;
    # saving, after one, saves the step before it.
    _backward_failing_in_layer0(model, x)
    with pytest.warns(UserWarning, match="did not finish"):
        with pytest.raises(RuntimeError, match="none was taken.*run the forward and backward"):
            z.optimizer.step()
    _backward_failing_in_layer0(model, x)
    with pytest.warns(UserWarning, match="did not finish"):
        z.save_checkpoint(str(tmp_path / "ck"))
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    assert z.step_count == 4


def test_an_interrupted_backward_leaves_no_trace(settings):
    """Backward passes that raise midway, their steps dropped and run again:
    the model ends exactly as one trained without them (fp32 masters and m,
    v through the next steps), with gradient accumulation (the step's
    earlier micro-batch goes too)."""
    model, twin, za, zb = _twins(settings, grad_accumulation=2)
    for step in range(3):
        for micro in range(2):
            x = batch(step, micro)
            if step == 1 and micro == 1:  # the step's last micro-batch fails once
                _backward_failing_in_layer0(model, x)
                with pytest.warns(UserWarning, match="with the 1 micro-batches before it"):
                    model(input_ids=batch(step, 0), labels=batch(step, 0)).loss.backward()
            model(input_ids=x, labels=x).loss.backward()
            twin(input_ids=x, labels=x).loss.backward()
        za.optimizer.step()
        zb.optimizer.step()
        assert za.grad_norm() == zb.grad_norm(), step
    _assert_same_masters(za, zb)


def _twins(settings, **kwargs):
    """Two offloads of one tiny Llama ("interrupted", "plain"): a run that
    fails somewhere against one that does not."""
    torch.manual_seed(0)
    model = tiny_llama()
    twin = copy.deepcopy(model)
    za = zt.offload(model, settings=settings, name="interrupted", **kwargs)
    zb = zt.offload(twin, settings=settings, name="plain", **kwargs)
    return model, twin, za, zb


def _assert_same_masters(za, zb):
    a, b = za.master_weights(), zb.master_weights()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


class _InterruptAfter:
    """The runner, with a KeyboardInterrupt raised the moment the `n`-th call
    of `method` returns (where a real Ctrl-C lands: a signal that came
    during the call, which ran with the GIL released)."""

    def __init__(self, runner, method: str, n: int):
        self.runner, self.method, self.left = runner, method, n

    def __getattr__(self, name):
        attr = getattr(self.runner, name)
        if name != self.method:
            return attr

        def call(*args):
            out = attr(*args)
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt
            return out

        return call


@pytest.mark.parametrize("method,n", [("push_grads", 2), ("acquire", 6), ("acquire", 2)])
def test_an_interrupt_the_moment_a_runner_call_returns(settings, method, n):
    """Ctrl-C right after a grad push (the next forward zeroed the freed
    buffer: a crash) or right after an acquire (the runner kept the unit held
    and every undo after was refused): undone, and the run ends as one that
    was never interrupted."""
    model, twin, za, zb = _twins(settings)
    for step in range(3):
        x = batch(step)
        if step == 1:
            za.runner = _InterruptAfter(za.runner, method, n)
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=x, labels=x).loss.backward()
            za.runner = za.runner.runner
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # said when grads had gone out
                loss = model(input_ids=x, labels=x).loss
        else:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        za.optimizer.step()
        twin(input_ids=x, labels=x).loss.backward()
        zb.optimizer.step()
    _assert_same_masters(za, zb)


@pytest.mark.parametrize("n", [1, 3])
def test_an_interrupt_after_an_acquire_then_a_short_windows_step(settings, n):
    """Ctrl-C as an acquire returns in a forward of an accumulation window,
    then optimizer.step() to end the window short: the runner still held the
    unit, its Step() was refused after every unit's grads went out, and
    every call after was refused. The step is the window's first micro-step's,
    as if the interrupted forward never ran."""
    model, twin, za, zb = _twins(settings, grad_accumulation=2)
    for step in range(3):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        twin(input_ids=x, labels=x).loss.backward()
        if step == 1:
            za.runner = _InterruptAfter(za.runner, "acquire", n)
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=x, labels=x)
            za.runner = za.runner.runner
        else:
            model(input_ids=x, labels=x).loss.backward()
            twin(input_ids=x, labels=x).loss.backward()
        za.optimizer.step()
        zb.optimizer.step()
        assert za.step_count == zb.step_count == step + 1
    za.save_checkpoint(str(settings["ZTIER_NVME_PATHS"]) + "/../ck")
    _assert_same_masters(za, zb)


def test_an_interrupt_the_moment_the_runners_step_returns(settings):
    """Ctrl-C as optimizer.step() returns from the runner's Step(): the step
    was taken (the runner a micro-step on, and the model refused every call
    after); training goes on as if it was never interrupted."""
    model, twin, za, zb = _twins(settings)
    for step in range(3):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        if step == 1:
            za.runner = _InterruptAfter(za.runner, "step", 1)
            with pytest.raises(KeyboardInterrupt):
                za.optimizer.step()
            za.runner = za.runner.runner
        else:
            za.optimizer.step()
        assert za.step_count == step + 1
        twin(input_ids=x, labels=x).loss.backward()
        zb.optimizer.step()
    za.save_checkpoint(str(settings["ZTIER_NVME_PATHS"]) + "/../ck")
    _assert_same_masters(za, zb)


def test_eval_forward_between_steps(settings):
    model = tiny_llama()
    z = zt.offload(model, settings=settings)
    x = batch(0)
    model.eval()
    with torch.no_grad():
        first = model(input_ids=x).logits
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    model.eval()
    with torch.no_grad():
        second = model(input_ids=x).logits
    assert not torch.equal(first, second)
    assert all(u.holds == 0 for u in z.units)
    # Training and evaluation alternate without making the runner relearn.
    for step in range(3):
        model.train()
        model(input_ids=x, labels=x).loss.backward()
        z.optimizer.step()
        model.eval()
        with torch.no_grad():
            model(input_ids=x)
        with z.gathered():
            pass
    assert z.runner.stats()["order_changes"] == 0


def test_checkpoint_round_trip(settings, tmp_path):
    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), settings=settings)

    def step(i):
        x = batch(i)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        return loss.item()

    step(0)
    z.save_checkpoint(tmp_path / "ckpt")
    after = [step(i) for i in (1, 2)]
    z.load_checkpoint(tmp_path / "ckpt")
    again = [step(i) for i in (1, 2)]
    assert after == again


def test_export_then_from_pretrained(settings, tmp_path):
    from transformers import LlamaForCausalLM

    model = tiny_llama(tied=True)
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), settings=settings)
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    z.save_pretrained(tmp_path / "export")
    with z.gathered():
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    # Hugging Face reads it back (tied head included).
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16)
    for k, v in plain.state_dict().items():
        if k in expected:
            assert torch.equal(v, expected[k].to(torch.bfloat16)), k
    # And ztier builds the model from it without materializing it first.
    model2, z2 = zt.from_pretrained(LlamaForCausalLM, tmp_path / "export", settings=settings)
    with z2.gathered():
        for k, v in model2.state_dict().items():
            if k in expected:
                assert torch.equal(v, expected[k]), k
    with torch.no_grad(), z.gathered():
        want = model(input_ids=x).logits
    with torch.no_grad():
        got = model2(input_ids=x).logits
    assert torch.equal(got, want)
    # Another class's directory is named as such (a default-sized model of
    # the class asked for was built from it, and refused for its DRAM).
    from transformers import GPT2LMHeadModel
    with pytest.raises(ValueError, match="holds a 'llama' model; GPT2LMHeadModel is a 'gpt2'"):
        zt.from_pretrained(GPT2LMHeadModel, tmp_path / "export", settings=settings)


def test_a_checkpoint_of_a_deeper_model_says_what_it_leaves_unused(settings, tmp_path):
    """A 2-layer checkpoint into a 1-layer config loaded without a word, the
    checkpoint's second layer dropped (transformers says so)."""
    from transformers import LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path / "deep")
    config = LlamaForCausalLM.config_class.from_pretrained(tmp_path / "deep")
    config.num_hidden_layers = 1
    with pytest.warns(RuntimeWarning, match="tensor\\(s\\) of the checkpoint at .* are not used"
                      ".*'model.layers.1."):
        model, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "deep", config=config,
                                      settings=settings)
    z.close()
    # The same depth: no word, also for the per-layer rotary inv_freq that
    # older Llama checkpoints hold (transformers drops it as it loads).
    from safetensors.torch import load_file, save_file
    weights = load_file(tmp_path / "deep" / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, tmp_path / "deep" / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "deep", settings=settings)
    z.close()


def test_save_pretrained_over_a_sharded_checkpoint_replaces_it(settings, tmp_path):
    """The index and shards of an earlier sharded save went on standing
    beside the new model.safetensors, for a loader that takes the index
    first to build the model from the old weights, silently."""
    from transformers import LlamaForCausalLM

    out = tmp_path / "model"
    tiny_llama().save_pretrained(out, max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    (out / "notes-model.txt").write_text("kept")
    model, z = zt.from_pretrained(LlamaForCausalLM, out, optimizer=zt.AdamW(lr=1e-2),
                                  settings=settings)
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    z.save_pretrained(out, dtype="float32")
    expected = z.master_weights()
    left = {p.name for p in out.iterdir()}
    assert "model.safetensors.index.json" not in left and not left & set(shards), left
    assert {"model.safetensors", "config.json", "notes-model.txt"} <= left, left
    z.close()
    again, z2 = zt.from_pretrained(LlamaForCausalLM, out, settings=settings)
    got = z2.master_weights()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    z2.close()


def test_from_pretrained_reads_sharded_checkpoints(settings, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    half = len(keys) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    model.config.save_pretrained(out)
    save_file({k: sd[k] for k in keys[:half]}, out / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in keys[half:]}, out / "model-00002-of-00002.safetensors")
    import json
    index = {"metadata": {}, "weight_map": {k: ("model-00001-of-00002.safetensors" if i < half
                                                 else "model-00002-of-00002.safetensors")
                                             for i, k in enumerate(keys)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    model2, z2 = zt.from_pretrained(LlamaForCausalLM, out, settings=settings)
    masters = z2.master_weights()
    for k, v in masters.items():
        assert torch.equal(v, sd[k]), k
    with pytest.raises(FileNotFoundError):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "nothing", settings=settings,
                           config=model.config)


def test_from_pretrained_as_transformers_returns_it(settings, tmp_path):
    """An Auto class crashed ("no attribute 'config_class'"); the model came
    back in train mode (dropout on in generate() and no-grad forwards, where
    transformers' is in eval mode); a directory without config.json built
    the class's default-sized model (a 7B Llama) in host memory."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    loaded, z = zt.from_pretrained(AutoModelForCausalLM, tmp_path / "hf", settings=settings)
    try:
        assert isinstance(loaded, LlamaForCausalLM)
        assert not loaded.training
        masters = z.master_weights()
        for k, v in model.state_dict().items():
            if k in masters:
                assert torch.equal(masters[k], v), k
    finally:
        z.close()
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings)


def test_from_pretrained_names_the_file_it_cannot_use(settings, tmp_path):
    """A damaged index or shard, a tensor the index maps to the wrong shard,
    an integer tensor where a weight goes, a NaN weight: each error names
    the file (safetensors' own did not), and nothing is cast in silence
    (an int64 or bool tensor of the right shape was loaded as floats)."""
    import json
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)

    def checkpoint(name, tensors, weight_map=None):
        out = tmp_path / name
        out.mkdir()
        model.config.save_pretrained(out)
        save_file(tensors, out / "model-00001-of-00001.safetensors")
        index = {"weight_map": weight_map if weight_map is not None
                 else {k: "model-00001-of-00001.safetensors" for k in tensors}}
        (out / INDEX).write_text(json.dumps(index))
        return out

    broken = checkpoint("broken-index", sd)
    (broken / INDEX).write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=f"cannot read {broken / INDEX}"):
        zt.from_pretrained(LlamaForCausalLM, broken, settings=settings)
    damaged = checkpoint("damaged", sd)
    shard = damaged / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])
    with pytest.raises(ValueError, match=f"cannot read {shard}"):
        zt.from_pretrained(LlamaForCausalLM, damaged, settings=settings)
    wrong = checkpoint("wrong-shard", {k: sd[k] for k in keys[1:]},
                       {k: "model-00001-of-00001.safetensors" for k in keys})
    with pytest.raises(ValueError, match="cannot read .*wrong-shard"):
        zt.from_pretrained(LlamaForCausalLM, wrong, settings=settings)
    ints = dict(sd)
    name = next(k for k in keys if k.endswith("q_proj.weight"))
    ints[name] = torch.ones_like(sd[name], dtype=torch.int64)
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* is torch.int64, not floating"):
        zt.from_pretrained(LlamaForCausalLM, checkpoint("ints", ints), settings=settings)
    nan = dict(sd)
    nan[name] = sd[name].clone()
    nan[name].view(-1)[3] = float("nan")
    where = checkpoint("nan", nan)
    with pytest.raises(ztier.InvalidArgumentError, match=f"is nan; .*in the checkpoint at {where}"):
        zt.from_pretrained(LlamaForCausalLM, where, settings=settings)


def test_hf_trainer_smoke(settings, tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Fixed(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            x = batch(i % 4, rows=1)[0]
            return {"input_ids": x, "labels": x}

    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), clip_grad_norm=1.0,
                   grad_accumulation=2, settings=settings)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, num_train_epochs=2,
                             learning_rate=1e-2, save_strategy="steps", save_steps=8,
                             report_to=[], logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Fixed(), optimizers=(z.optimizer, None))
    result = trainer.train()
    assert z.step_count == 8
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses
    assert math.isfinite(result.training_loss)
    # Its checkpoint holds the trained weights (they were NaN placeholders).
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "out" / "checkpoint-8" / "model.safetensors"))
    with z.gathered():
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert saved and all(torch.equal(v, want[k].to(v.dtype)) for k, v in saved.items())


def test_hf_trainer_with_an_epoch_of_odd_micro_batches(settings, tmp_path):
    # 7 micro-batches an epoch with gradient_accumulation_steps=2: Trainer
    # steps after the epoch's last micro-batch alone, which was refused.
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Fixed(Dataset):
        def __len__(self):
            return 14

        def __getitem__(self, i):
            x = batch(i, rows=1)[0]
            return {"input_ids": x, "labels": x}

    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-3), grad_accumulation=2, settings=settings)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=2,
                             learning_rate=1e-3, save_strategy="no", report_to=[],
                             logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Fixed(),
                      optimizers=(z.optimizer, None))
    # Its default max_grad_norm (1.0) clips nothing here: said.
    with pytest.warns(RuntimeWarning, match="clip_grad_norm_ clips nothing"):
        result = trainer.train()
    assert z.step_count == trainer.state.global_step == 8
    assert math.isfinite(result.training_loss)


def test_from_pretrained_of_a_checkpoint_with_other_names(settings, tmp_path):
    # A classifier on a causal LM's checkpoint (its head is new), which
    # transformers initializes and ztier refused with a KeyError; so were
    # checkpoints transformers converts as it loads (GPT-NeoX, ViT, Mixtral).
    from transformers import LlamaForSequenceClassification

    base = tiny_llama()
    base.save_pretrained(tmp_path / "base")
    with pytest.warns(RuntimeWarning, match="no tensor named as 1 of .*'score.weight'"):
        model, z = zt.from_pretrained(LlamaForSequenceClassification, tmp_path / "base",
                                      settings=settings)
    masters = z.master_weights()
    for name, p in base.model.named_parameters():
        assert torch.equal(masters[f"model.{name}"], p.detach().float()), name
    out = model(input_ids=batch(0, rows=1)).logits
    assert torch.isfinite(out).all()
    z.close()


def test_generation_config_goes_in_and_out(settings, tmp_path):
    """generation_config.json was neither read by from_pretrained (the model
    had the defaults its config.json gives) nor written by save_pretrained,
    where transformers does both."""
    from transformers import GenerationConfig, LlamaForCausalLM

    model = tiny_llama()
    model.generation_config.max_new_tokens = 7
    model.generation_config.eos_token_id = 5
    model.save_pretrained(tmp_path / "hf")
    loaded, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings)
    try:
        assert loaded.generation_config.max_new_tokens == 7
        assert loaded.generation_config.eos_token_id == 5
        loaded.generation_config.max_new_tokens = 9
        z.save_pretrained(tmp_path / "out")
    finally:
        z.close()
    assert GenerationConfig.from_pretrained(tmp_path / "out").max_new_tokens == 9
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert plain.generation_config.max_new_tokens == 9
    assert plain.generation_config.eos_token_id == 5
    # One given to from_pretrained is the model's, as in transformers.
    given = GenerationConfig(max_new_tokens=3)
    loaded, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "out", settings=settings,
                                   generation_config=given)
    try:
        assert loaded.generation_config.max_new_tokens == 3
        assert loaded.generation_config is not given
    finally:
        z.close()
    # A damaged one is named (rather than generating with the defaults).
    bad = tmp_path / "out" / "generation_config.json"
    bad.write_text('{"max_new_tokens": ')
    with pytest.raises(ValueError, match=f"cannot read {bad}"):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "out", settings=settings)


def test_from_pretrained_takes_the_single_file_before_an_index(settings, tmp_path):
    """A directory holding model.safetensors and model.safetensors.index.json
    (with its shards) was loaded from the index; transformers loads the
    single file, and so does ztier."""
    import shutil

    from transformers import LlamaForCausalLM

    single, sharded = tiny_llama(seed=0), tiny_llama(seed=1)
    sharded.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    out = tmp_path / "both"
    single.save_pretrained(out)
    for p in (tmp_path / "sharded").glob("model*"):
        shutil.copy(p, out / p.name)
    assert (out / INDEX).exists() and (out / "model.safetensors").exists()
    want = {k: v.detach() for k, v in single.state_dict().items()}
    plain = LlamaForCausalLM.from_pretrained(out)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, want[k]), k
    loaded, z = zt.from_pretrained(LlamaForCausalLM, out, settings=settings)
    try:
        for k, v in z.master_weights().items():
            assert torch.equal(v, want[k]), k
    finally:
        z.close()


def test_save_pretrained_config_names_the_written_dtype(settings, tmp_path):
    """config.json kept the loaded checkpoint's dtype ("float32") over
    bfloat16 weights, so from_pretrained(dtype="auto") built an fp32 model;
    transformers writes the dtype of the weights it saves (and the class as
    the architecture)."""
    import json

    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    loaded, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings)
    try:
        for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            out = tmp_path / dtype
            z.save_pretrained(out, dtype=dtype)
            config = json.loads((out / "config.json").read_text())
            assert config["dtype"] == dtype, config
            assert config["architectures"] == ["LlamaForCausalLM"], config
            with safe_open(str(out / "model.safetensors"), framework="pt") as f:
                assert {f.get_tensor(k).dtype for k in f.keys()} == {want}
            assert LlamaForCausalLM.from_pretrained(out, dtype="auto").dtype == want
    finally:
        z.close()


def test_pretrained_calls_take_hugging_face_arguments(settings, tmp_path):
    """torch_dtype= / dtype= to from_pretrained and safe_serialization= to
    save_pretrained were refused deep inside (offload's "unexpected keyword
    argument", after the model was built); an unknown argument is named
    before anything is read."""
    from transformers import LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path / "hf")
    x = batch(0, rows=1)
    for kwargs, want in (({"torch_dtype": torch.bfloat16}, torch.bfloat16),
                         ({"dtype": torch.float32}, torch.float32),
                         ({"dtype": "bfloat16"}, torch.bfloat16),
                         ({"dtype": "auto"}, torch.float32)):  # config.json's
        loaded, z = zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                                       **kwargs)
        try:
            assert z.compute_dtype == want, kwargs
            with torch.no_grad():
                assert loaded(input_ids=x).logits.dtype == want, kwargs
            if "torch_dtype" in kwargs:
                z.save_pretrained(tmp_path / "out", safe_serialization=True)
                assert (tmp_path / "out" / "model.safetensors").exists()
                with pytest.raises(ValueError, match="safe_serialization=False.*safetensors"):
                    z.save_pretrained(tmp_path / "out2", safe_serialization=False)
                with pytest.raises(TypeError, match="'max_shard_size'.*one model.safetensors"):
                    z.save_pretrained(tmp_path / "out2", max_shard_size="1GB")
                with pytest.raises(TypeError, match="'push_to_hub'"):
                    z.save_pretrained(tmp_path / "out2", push_to_hub=True)
                assert not (tmp_path / "out2").exists()
        finally:
            z.close()
    with pytest.raises(ValueError, match="torch.float16.*torch.bfloat16 or torch.float32"):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                           dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 and compute_dtype=torch.float32"):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                           dtype=torch.bfloat16, compute_dtype=torch.float32)
    with pytest.raises(TypeError, match="'device_map'.*device="):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                           device_map="auto")
    with pytest.raises(TypeError, match="unexpected keyword argument 'revison'"):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                           revison="main")
    with pytest.raises(TypeError, match="takes no weights="):
        zt.from_pretrained(LlamaForCausalLM, tmp_path / "hf", settings=settings,
                           weights=tmp_path / "hf")


def test_exports_take_torch_dtypes(settings, tmp_path):
    """dtype=torch.bfloat16 (a torch dtype rather than its name) was a
    nanobind TypeError; torch.float16, which the export does not write, is
    refused by name."""
    import json

    from safetensors.torch import load_file

    model = tiny_llama()
    z = zt.offload(model, settings=settings)
    try:
        masters = z.master_weights()
        for dtype in (torch.bfloat16, torch.float32, "bf16", "fp32"):
            path = tmp_path / f"{dtype}.safetensors"
            z.export_safetensors(path, dtype=dtype)
            want = torch.float32 if dtype in (torch.float32, "fp32") else torch.bfloat16
            saved = load_file(str(path))
            assert saved and {v.dtype for v in saved.values()} == {want}, dtype
            for k, v in saved.items():
                assert torch.equal(v, masters[k].to(want)), k
        z.save_pretrained(tmp_path / "out", dtype=torch.float32)
        assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
        assert {v.dtype for v in load_file(str(tmp_path / "out" / "model.safetensors")).values()} \
            == {torch.float32}
        for bad in (torch.float16, "float16"):
            with pytest.raises(ValueError, match="float16.*'bfloat16'.*'float32'"):
                z.export_safetensors(tmp_path / "bad.safetensors", dtype=bad)
            with pytest.raises(ValueError, match="float16.*'bfloat16'.*'float32'"):
                z.save_pretrained(tmp_path / "bad", dtype=bad)
        with pytest.raises(TypeError, match="dtype=16"):
            z.export_safetensors(tmp_path / "bad.safetensors", dtype=16)
        assert not (tmp_path / "bad.safetensors").exists() and not (tmp_path / "bad").exists()
    finally:
        z.close()
