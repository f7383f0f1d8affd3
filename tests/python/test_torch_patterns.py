"""ztier.torch on the ways people write models and training loops: hooks of
their own on modules (weight_norm), state_dict() for saving (save_pretrained,
Trainer), blocks returning objects of their own, index tables as parameters,
inputs of another dtype, threads. Each either trains exactly as the
reference (reference.py) does, or is refused with a message that names the
way that works; none trains wrong silently.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import os
import threading
import warnings

import pytest
import torch
from torch import nn

import ztier.torch as zt
from conftest import at_once, tiny_gpt2
from reference import Reference

ADAMW = zt.AdamW(lr=1e-2, weight_decay=0.0)


def _against_reference(make, settings, inputs, steps=3, masters=False, **kwargs):
    """Trains a model `make()` builds through ztier and a second one through
    the reference on `inputs` (a batch per step); every loss must be equal,
    and with `masters` every fp32 master after the last step too. Returns
    the model and its Offload."""
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    ref_model = make()
    z = zt.offload(model, optimizer=ADAMW, settings=settings, **kwargs)
    ref = Reference(ref_model, z, ADAMW)
    for step in range(steps):
        x = inputs(step)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        ref_loss = ref_model(x).float().pow(2).mean()
        ref.backward(ref_loss)
        assert torch.isfinite(loss), step
        assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
        z.optimizer.step()
        ref.step([g["lr"] for g in z.optimizer.param_groups])
    if masters:
        got = z.master_weights()
        for u in ref.units:
            for name, off, n, _, _ in u["tensors"]:
                want = u["master"][off:off + n].view(got[name].shape)
                assert torch.equal(got[name], want), (name, (got[name] - want).abs().max().item())
    return model, z


def _x(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def test_a_module_with_a_pre_hook_of_its_own_reads_the_values(settings):
    # torch.nn.utils.weight_norm computes `weight` from weight_g and
    # weight_v in a forward pre-hook, which ran before ztier's and read the
    # placeholders: every loss was NaN.
    def make():
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(8, 16)), nn.Tanh(),
                             nn.Linear(16, 1))

    _against_reference(make, settings, _x)


class _Gains(nn.Module):
    """Parameters only in a ParameterDict (no direct ones)."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterDict({"scale": nn.Parameter(torch.ones(8) * 1.5),
                                    "shift": nn.Parameter(torch.full((8,), 0.1))})

    def forward(self, x):
        return x * self.ps["scale"] + self.ps["shift"]


class _WithContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.gains = nn.ParameterList([nn.Parameter(torch.randn(8)) for _ in range(2)])
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = _Gains()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = x * self.gains[0]
        for layer in self.layers:
            x = layer(x).h
        return self.head(self.norm(x) * self.gains[1])


def test_parameters_in_parameter_lists_and_dicts(settings):
    # nn.ParameterList / nn.ParameterDict are never called: their parameters
    # were held by nobody (NaN losses from step 0, every step skipped), and a
    # module holding parameters only through one was not hooked at all.
    _against_reference(_WithContainers, settings, _x)


class _Out:
    """A block's output of a class of its own (no tuple, dict or dataclass)."""

    def __init__(self, h):
        self.h = h


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return _Out(x + torch.tanh(self.a(x)))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).h
        return self.head(x)


def test_a_block_returning_an_object_of_its_own_class(settings):
    # Its tensors went unseen: no backward hook re-held the unit, and its
    # backward read freed storage ("setStorage: ... storage of size 0").
    _against_reference(_Stack, settings, _x)


def test_state_dict_shows_the_values_outside_gathered(settings, tmp_path):
    # model.state_dict() outside gathered() was all NaN placeholders, and so
    # were save_pretrained's files and Trainer's checkpoints, silently.
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2()
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    x = torch.randint(0, 96, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    with z.gathered():
        want = {k: v.clone() for k, v in model.state_dict().items()}
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # A submodule's own state dict, too; the parameters stay placeholders.
    block = model.transformer.h[1].state_dict()
    assert torch.equal(block["mlp.c_fc.weight"], want["transformer.h.1.mlp.c_fc.weight"])
    assert torch.isnan(model.transformer.h[1].mlp.c_fc.weight).all()
    # Hugging Face's own save reads the weights back.
    model.save_pretrained(tmp_path / "hf")
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for k, v in plain.state_dict().items():
        if k in want:
            assert torch.equal(v, want[k].to(v.dtype)), k
    # Training goes on as before.
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    z.close()


def test_a_forward_writing_to_a_parameter_in_place_is_refused(settings):
    # nn.Embedding(max_norm=) renormalizes rows of its weight in place: the
    # write went into the held copy and was lost, and training went its own
    # way silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 1))
    z = zt.offload(model, settings=settings)
    with pytest.raises(RuntimeError, match=r"wrote to parameter '0.weight' in place.*max_norm"):
        model(torch.tensor([[1, 2, 3]]))
    model[0].max_norm = None
    model(torch.tensor([[1, 2, 3]])).sum().backward()  # the model goes on without it
    z.optimizer.step()
    z.close()


def test_a_module_replaced_after_offload_is_refused(settings):
    # The new module was never laid out in the engine: it never trained,
    # silently, while the old one's unit decayed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings)
    old = model[2]
    model[2] = nn.Linear(16, 1)
    with pytest.raises(RuntimeError, match=r"'2.weight' is a parameter the engine does not hold"):
        model(_x(0))
    del model[2]
    with pytest.raises(RuntimeError, match=r"'2.weight' is no longer in the model"):
        model(_x(0))
    model.append(old)
    model(_x(0)).sum().backward()
    z.optimizer.step()
    z.close()


def test_a_weight_pruned_after_offload_is_refused(settings):
    # prune keeps the parameter object under another name (weight_orig):
    # the check compared ids only, and the model trained with a mask
    # computed from the NaN placeholder, silently.
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(RuntimeError, match=r"'0.weight' is named '0.weight_orig' now "
                       r"\(torch.nn.utils.prune.*before zt.offload"):
        model(_x(0)).sum().backward()
    z.close()


_REPARAMETRIZATIONS = {
    "torch.nn.utils.weight_norm": (
        lambda m: torch.nn.utils.weight_norm(m), "'0.weight_g', '0.weight_v'"),
    "torch.nn.utils.parametrizations.weight_norm": (
        lambda m: torch.nn.utils.parametrizations.weight_norm(m),
        "'0.parametrizations.weight.original0', '0.parametrizations.weight.original1'"),
    "torch.nn.utils.spectral_norm": (
        lambda m: torch.nn.utils.spectral_norm(m), "'0.weight_orig'"),
    "torch.nn.utils.parametrizations.spectral_norm": (
        lambda m: torch.nn.utils.parametrizations.spectral_norm(m),
        "'0.parametrizations.weight.original'"),
}


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", list(_REPARAMETRIZATIONS))
def test_a_weight_reparametrized_after_offload_is_named_and_before_it_trains(settings, kind):
    # weight_norm (either) after offload was said to be "a module added or
    # replaced", torch.nn.utils.spectral_norm to be torch.nn.utils.prune:
    # the message pointed away from what happened and what to do.
    apply, now = _REPARAMETRIZATIONS[kind]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings)
    apply(model[0])
    with pytest.raises(RuntimeError, match=(
            rf"'0.weight' was reparametrized by {kind} after zt.offload \(it is computed from "
            rf"{now} now\): that read the parameter's placeholder .*apply {kind} before "
            r"zt.offload")):
        model(_x(0)).sum().backward()
    z.close()
    # Before offloading, the parametrization's parameters are the engine's.
    _against_reference(lambda: nn.Sequential(apply(nn.Linear(8, 16)), nn.Tanh(),
                                             nn.Linear(16, 1)), settings, _x)


def test_a_double_backward_is_refused(settings):
    # A gradient penalty (create_graph=True) crashed in torch with
    # "setStorage: ... storage of size 0".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings)
    x = _x(0).requires_grad_(True)
    out = model(x)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    model(_x(1)).sum().backward()  # the next pass trains as ever
    z.optimizer.step()
    z.close()


class _Permuted(nn.Module):
    """A linear layer over a fixed permutation of its n inputs: an integer
    Parameter (requires_grad=False), an index table."""

    def __init__(self, n):
        super().__init__()
        self.perm = nn.Parameter(torch.randperm(n), requires_grad=False)
        self.lin = nn.Linear(n, 1)

    def forward(self, x):
        return self.lin(x[:, self.perm])


def test_an_index_table_parameter_stays_as_it_is(settings):
    # An integer Parameter (a permutation, requires_grad=False) became a
    # float placeholder: "tensors used as indices must be long".
    model, z = _against_reference(lambda: _Permuted(8), settings, _x)
    torch.manual_seed(0)
    assert model.perm.dtype == torch.int64 and torch.equal(model.perm, _Permuted(8).perm)
    assert [t.name for u in z.units for t in u.tensors] == ["lin.weight", "lin.bias"]


def test_a_sparse_embedding_is_refused_at_offload(settings):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"'0' is an embedding with sparse=True"):
        zt.offload(model, settings=settings)


def test_inputs_are_cast_to_the_compute_dtype(settings):
    # A float32 batch into a model computing in bf16 (the default on a GPU)
    # failed at its first matmul: "mat1 and mat2 must have the same dtype".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings, compute_dtype=torch.bfloat16)
    out = model(_x(0))
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    z.optimizer.step()
    z.close()
    # A float64 model is said to change precision, and takes its own inputs.
    model = nn.Sequential(nn.Linear(8, 1)).double()
    with pytest.warns(RuntimeWarning, match="torch.float64 become fp32 master weights"):
        z = zt.offload(model, settings=settings)
    model(_x(0).double()).pow(2).mean().backward()
    z.optimizer.step()
    z.close()


def test_two_threads_offloading_at_once_share_the_engine(settings):
    # Both opened an engine on the same swap directory: "is in use by this
    # process".
    offloads = at_once(lambda: zt.offload(nn.Linear(4, 4), settings=settings))
    assert offloads[0].session is offloads[1].session
    for z in offloads:
        z.close()


def test_engines_asked_for_and_closed_leave_nothing_behind(tmp_path):
    # A lock per settings ever asked for stayed in the process for good
    # (a new swap directory per offload: one more each time).
    before = len(zt._session_locks)
    for i in range(5):
        swap = tmp_path / f"swap-{i}"
        swap.mkdir()
        z = zt.offload(nn.Linear(4, 4), settings={"ztier.dram_budget": "1G",
                                                   "ZTIER_NVME_PATHS": str(swap)})
        z.close()
    assert len(zt._session_locks) == before


def test_a_grad_scaler_is_refused_and_training_goes_on(settings):
    # GradScaler failed with "No inf checks were recorded" after the
    # engine had taken grads scaled by 65536.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    z = zt.offload(model, settings=settings)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(_x(0)).pow(2).mean()).backward()
    with pytest.raises(RuntimeError, match="GradScaler.*no step was taken"):
        scaler.step(z.optimizer)
    assert z.step_count == 0
    # Its grads are gone: the next step is the first, from the same weights.
    masters = z.master_weights()
    model(_x(0)).pow(2).mean().backward()
    z.optimizer.step()
    assert z.step_count == 1
    assert z.grad_norm() < 1e3, "the scaled grads stayed in the step"
    assert any(not torch.equal(masters[k], v) for k, v in z.master_weights().items())
    z.close()


def test_a_foreign_optimizer_state_dict_is_refused(settings):
    # A torch AdamW's moments were dropped silently, its groups matched by
    # position.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1))
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters())
    plain.param_groups[0]["params"][0].grad = torch.ones(1, 8)
    plain.step()
    z = zt.offload(model, settings=settings)
    with pytest.raises(ValueError, match="moments of 1 parameters.*load_checkpoint"):
        z.optimizer.load_state_dict(plain.state_dict())
    own = z.optimizer.state_dict()
    own["param_groups"][0]["lr"] = 0.5
    z.optimizer.load_state_dict(own)
    assert z.optimizer.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="has 3 param groups"):
        z.optimizer.load_state_dict({"state": {}, "param_groups": own["param_groups"] * 3})
    z.close()


def test_state_dict_inside_a_forward_at_a_version_and_of_scalars(settings):
    # Taken inside a running module its entries were views of storage the
    # module then let go of (reading them crashed); a 0-dim parameter stayed
    # NaN; a state_dict() that raised midway left a cache that served old
    # weights after the next step.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)
            self.scale = nn.Parameter(torch.tensor(2.5))
            self.inside = None

        def forward(self, x):
            if self.inside is None:
                self.inside = self.state_dict()
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    model(_x(0)).pow(2).mean().backward()
    z.optimizer.step()
    with z.gathered():
        want = {k: v.clone() for k, v in model.state_dict().items()}
    inside = model.inside
    assert float(inside["scale"]) == 2.5
    assert torch.isfinite(inside["lin.weight"]).all()
    now = model.state_dict()
    assert float(now["scale"]) == float(want["scale"]) != 2.5
    assert all(torch.equal(now[k], want[k]) for k in want)
    # A root call that raised midway, then a step: a submodule's is fresh.
    z._sd_values = {(z.runner.version, z.units[0].index): [torch.zeros(z.units[0].padded), 9]}
    model(_x(1)).pow(2).mean().backward()
    z.optimizer.step()
    with z.gathered():
        fresh = model.lin.state_dict()["weight"].clone()
    assert torch.equal(model.lin.state_dict()["weight"], fresh)
    z.close()
    with pytest.raises(RuntimeError, match="Offload was closed"):
        model.state_dict()


def test_a_copy_made_outside_gathered_refuses_its_state_dict(settings):
    model = nn.Sequential(nn.Linear(8, 1))
    z = zt.offload(model, settings=settings)
    twin = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="copy of an offloaded model"):
        twin.state_dict()
    z.close()


class _WithEmpty(nn.Module):
    """A model with a parameter of no elements (some architectures keep an
    empty one), beside a trained layer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.empty = nn.Parameter(torch.empty(0, 5))

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def test_a_parameter_of_no_elements_goes_into_exports_and_checkpoints(settings, tmp_path):
    # It was left out of the export (and a checkpoint's buffers): a strict
    # load_state_dict of the export into the same model class failed,
    # "Missing key(s) in state_dict: 'empty'".
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _WithEmpty()
    z = zt.offload(model, optimizer=zt.AdamW(lr=1e-2), settings=settings)
    model(torch.randn(2, 8)).sum().backward()
    z.optimizer.step()
    z.export_safetensors(tmp_path / "m.safetensors")
    exported = load_file(str(tmp_path / "m.safetensors"))
    assert exported["empty"].shape == (0, 5)
    _WithEmpty().load_state_dict(exported)  # strict
    z.save_checkpoint(tmp_path / "ckpt")
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    z.close()
    fresh = _WithEmpty()
    z2 = zt.offload(fresh, optimizer=zt.AdamW(lr=1e-2), settings=settings)
    z2.load_checkpoint(tmp_path / "ckpt")
    assert fresh.empty.shape == (0, 5)
    with torch.no_grad():
        assert torch.equal(fresh(x), want)
    z2.close()


def test_an_index_table_goes_into_exports_and_comes_back(settings, tmp_path):
    torch.manual_seed(0)
    model = _Permuted(300)
    z = zt.offload(model, settings=settings)
    z.export_safetensors(tmp_path / "m.safetensors", dtype="float32")
    fresh = _Permuted(300)  # another permutation
    assert not torch.equal(fresh.perm, model.perm)
    z2 = zt.offload(fresh, settings=settings, weights=str(tmp_path / "m.safetensors"))
    assert fresh.perm.dtype == torch.int64 and torch.equal(fresh.perm, model.perm)
    x = torch.randn(2, 300)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    z.close()
    z2.close()


def test_a_model_built_on_the_meta_device_takes_its_weights_from_a_file(settings, tmp_path):
    # offload(meta_model, weights=...) failed inside torch (set_data of a
    # meta parameter) while the meta check let it through for weights=.
    torch.manual_seed(0)
    model = _Permuted(300)
    z = zt.offload(model, settings=settings)
    z.export_safetensors(tmp_path / "m.safetensors", dtype="float32")
    with torch.device("meta"):
        fresh = _Permuted(300)
    z2 = zt.offload(fresh, settings=settings, weights=str(tmp_path / "m.safetensors"))
    assert torch.equal(fresh.perm, model.perm)
    x = torch.randn(2, 300)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(fresh(x), want)
    fresh(x).pow(2).mean().backward()
    z2.optimizer.step()
    z.close()
    z2.close()
    # Only the parameters on meta become placeholders: one made real
    # stays the same object (a failed offload replaced it, its values lost).
    with torch.device("meta"):
        part = _Permuted(300)
    part.lin.bias = nn.Parameter(torch.zeros(1))
    bias = part.lin.bias
    with pytest.raises(FileNotFoundError):
        zt.offload(part, settings=settings, weights=str(tmp_path / "none.safetensors"))
    assert part.lin.bias is bias and torch.equal(bias, torch.zeros(1))
    z3 = zt.offload(part, settings=settings, weights=str(tmp_path / "m.safetensors"))
    assert part.lin.bias is bias
    with torch.no_grad():
        assert torch.equal(part(x), want)
    z3.close()
    # A buffer on meta has nothing weights= could go into: refused, naming
    # it, before anything changed (torch's "Cannot copy out of meta tensor").
    with torch.device("meta"):
        buffered = _Permuted(300)
        buffered.register_buffer("scale", torch.ones(3))
    with pytest.raises(ValueError, match="1 buffers are on the meta device.*'scale'"):
        zt.offload(buffered, settings=settings, weights=str(tmp_path / "m.safetensors"))
    assert buffered.lin.weight.is_meta


def test_cast_inputs_saturate_keep_namedtuples_and_can_be_off(settings):
    import collections

    Pair = collections.namedtuple("Pair", "x mask")

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, p):
            return self.lin(p.x) + p.mask

    torch.manual_seed(0)
    model = Masked()
    z = zt.offload(model, settings=settings, compute_dtype=torch.bfloat16)
    mask = torch.full((4, 1), torch.finfo(torch.float32).min)
    out = model(Pair(_x(0), mask))
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "fp32's finfo.min became -inf"
    z.close()
    model = Masked()
    z = zt.offload(model, settings=settings, compute_dtype=torch.bfloat16, cast_inputs=False)
    with pytest.raises(RuntimeError, match="dtype"):
        model(Pair(_x(0), mask))
    z.close()


def test_cast_inputs_hand_the_model_the_callers_own_containers(settings):
    # A list or dict holding nothing to cast was copied once any input was
    # cast: what the model wrote into it (an incremental decoding state,
    # auxiliary losses to train) went into the copy, lost to the caller.
    class Filling(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, state, aux, pair):
            state["calls"] = state.get("calls", 0) + 1
            y = self.lin(x)
            aux.append(y.float().pow(2).mean())
            return y + pair[0]

    torch.manual_seed(0)
    model = Filling()
    z = zt.offload(model, settings=settings, compute_dtype=torch.bfloat16)
    state, aux = {"seen": [1]}, []
    pair = [torch.ones(4, 1), "tag"]
    with torch.no_grad():
        out = model(_x(0), state, aux=aux, pair=pair)
    assert out.dtype == torch.bfloat16
    assert state == {"seen": [1], "calls": 1}
    assert len(aux) == 1
    assert pair[0].dtype == torch.float32, "the caller's tensor was changed in place"
    z.close()


class _Spectral(nn.Module):
    """A spectral filter: a complex parameter (FNO-style)."""

    def __init__(self, trainable):
        super().__init__()
        self.filt = nn.Parameter(torch.randn(5, dtype=torch.cfloat), requires_grad=trainable)
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(torch.fft.irfft(torch.fft.rfft(x) * self.filt, n=x.shape[-1]))


def test_a_trainable_complex_parameter_is_refused_and_a_frozen_one_stays(settings, tmp_path):
    # A complex parameter was taken for an index table: left out of the
    # engine and the param groups, it never trained (its grads piled up).
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"'filt' is complex .*view_as_real"):
        zt.offload(_Spectral(trainable=True), settings=settings)
    model = _Spectral(trainable=False)
    want = model.filt.detach().clone()
    z = zt.offload(model, settings=settings)
    assert [t.name for u in z.units for t in u.tensors] == ["lin.weight", "lin.bias"]
    model(_x(0)).pow(2).mean().backward()
    z.optimizer.step()
    assert model.filt.dtype == torch.cfloat and torch.equal(model.filt.detach(), want)
    # Unfrozen later, it would never train: said at the next training forward.
    model.filt.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'filt' has requires_grad=True now.*view_as_real"):
        model(_x(1))
    model.filt.requires_grad_(False)
    # Into the export too (safetensors' C64: refused as a dtype it lacked).
    from safetensors.torch import load_file

    path = str(tmp_path / "spectral.safetensors")
    z.export_safetensors(path)
    assert torch.equal(load_file(path)["filt"], want)
    z.close()


def test_an_export_that_fails_leaves_the_file_there_as_it_was(settings, tmp_path):
    # The weights were written over `path` first, and a buffer checked after:
    # a failed export left the weights alone where the last export had been.
    from safetensors.torch import load_file

    model = nn.Sequential(nn.Linear(8, 1))
    model.register_buffer("ids", torch.arange(4).to(torch.uint16))
    z = zt.offload(model, settings=settings)
    path = str(tmp_path / "m.safetensors")
    z.export_safetensors(path)  # every dtype safetensors has is exported
    first = load_file(path)
    assert first["ids"].dtype == torch.uint16 and first["ids"].int().tolist() == [0, 1, 2, 3]
    z.module.ids = torch.zeros(2, dtype=torch.complex128)
    with pytest.raises(ValueError, match="buffer 'ids' is torch.complex128, which safetensors"):
        z.export_safetensors(path)
    again = load_file(path)
    assert again.keys() == first.keys() and torch.equal(again["ids"], first["ids"])
    assert [f for f in os.listdir(tmp_path) if f.startswith("m.")] == ["m.safetensors"]
    z.close()


class _Normed(nn.Module):
    """BatchNorm's running statistics and a positional table: buffers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.randn(8))
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x + self.pe))))


def test_floating_point_buffers_follow_the_compute_dtype(settings, tmp_path):
    # They kept their own dtype: fp32 running statistics and an fp32 table
    # failed in a model computing in bf16 ("expected scalar type BFloat16
    # but found Float"), and a model cast to bf16 computing in fp32 too.
    # It trains as the reference, whose buffers are cast as model.to() does.
    _against_reference(_Normed, settings, lambda step: _x(step).bfloat16(),
                       compute_dtype=torch.bfloat16)[1].close()
    torch.manual_seed(0)
    model = _Normed()
    z = zt.offload(model, compute_dtype=torch.bfloat16, settings=settings)
    assert model.pe.dtype == model.bn.running_mean.dtype == torch.bfloat16
    assert model.bn.num_batches_tracked.dtype == torch.int64
    for step in range(2):
        model(_x(step)).float().pow(2).mean().backward()
        z.optimizer.step()
    model.eval()
    with torch.no_grad():
        assert model(_x(2)).dtype == torch.bfloat16
    sd = model.state_dict()
    assert sd["bn.running_mean"].dtype == torch.bfloat16
    assert int(sd["bn.num_batches_tracked"]) == 2
    z.save_checkpoint(str(tmp_path / "ck"))
    # Into a model computing in fp32: cast into its fp32 buffers.
    fresh = _Normed()
    z2 = zt.offload(fresh, settings=settings)
    z2.load_checkpoint(str(tmp_path / "ck"))
    assert fresh.bn.running_mean.dtype == torch.float32
    assert torch.equal(fresh.bn.running_mean, model.bn.running_mean.float())
    assert torch.equal(fresh.pe, model.pe.float())
    fresh(_x(0)).pow(2).mean().backward()
    z2.optimizer.step()
    z.close()
    z2.close()
    # A model cast to bf16, computing in fp32 (the host's default).
    model = _Normed().to(torch.bfloat16)
    z = zt.offload(model, settings=settings)
    assert model.bn.running_var.dtype == model.pe.dtype == torch.float32
    model(_x(0)).pow(2).mean().backward()
    z.optimizer.step()
    z.close()


def test_a_rotary_embeddings_frequencies_stay_fp32(settings):
    # Rounded to bf16, a rotary embedding's frequencies move the positions'
    # angles by up to pi at a few thousand tokens; Hugging Face's models
    # keep them fp32 and read them so in any dtype.
    from conftest import batch, tiny_llama

    model = tiny_llama()
    z = zt.offload(model, compute_dtype=torch.bfloat16, settings=settings)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    z.close()


class _LayerScale(nn.Module):
    """timm's LayerScale(inplace=True): scales its input in place."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        return x.mul_(self.gamma)


class _ViewBlock(nn.Module):
    """A block whose output is a view (.view at its end)."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x).view(x.shape)


class _ResidualStack(nn.Module):
    def __init__(self, block, n=3, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(n))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            out = b(2 * h)
            out += h  # the residual, in place on the block's output
            h = out
        return self.out(torch.tanh(h))


def test_a_block_writing_to_its_input_in_place_trains_and_is_warned_of(settings, recwarn):
    # The blocks' inputs came out of an autograd Function as views made in
    # it, which torch refuses in-place writes to: "Output 0 of _PostBackward
    # is a view and is being modified inplace". The caller's tensor gets the
    # values but not the write's history: said once per module class.
    def make():
        return nn.Sequential(nn.Linear(8, 8), _LayerScale(8), nn.ReLU(inplace=True),
                             nn.Linear(8, 1))

    _against_reference(make, settings, _x)
    _against_reference(lambda: _ResidualStack(_LayerScale), settings, _x)
    said = [str(w.message) for w in recwarn if "changed its input in place" in str(w.message)]
    assert len(said) == 2 and "a _LayerScale (unit" in said[0], said


def test_a_block_output_that_is_a_view_written_in_place_trains(settings):
    # `h += r` on a block's .view() output made the view's grad_fn anew and
    # dropped ztier's grad hook on it: the block's backward never fetched
    # its weights and read emptied storage ("setStorage: ... out of bounds").
    _, z = _against_reference(lambda: _ResidualStack(_ViewBlock), settings, _x)
    assert [u.name for u in z.units][1:4] == ["blocks.0", "blocks.1", "blocks.2"]


_Pair = collections.namedtuple("_Pair", "h")


@dataclasses.dataclass(frozen=True)
class _Frozen:
    h: torch.Tensor


_WRAPS = {
    "namedtuple": (_Pair, lambda o: o.h),
    "nested tuple": (lambda t: ((t,), None), lambda o: o[0][0]),
    "frozen dataclass": (_Frozen, lambda o: o.h),
    "dict in a list": (lambda t: [{"h": t}], lambda o: o[0]["h"]),
}


class _WrappedViewStack(nn.Module):
    """_ResidualStack whose blocks return their view output wrapped."""

    def __init__(self, wrap, unwrap, n=3, dim=8):
        super().__init__()
        self.unwrap = unwrap
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_ViewBlock(dim) for _ in range(n))
        for b in self.blocks:
            b.register_forward_hook(lambda m, args, out: wrap(out))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            out = self.unwrap(b(2 * h))
            out += h
            h = out
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_a_view_output_in_a_container_written_in_place_trains(settings, wrap):
    # In a namedtuple, a dataclass or a nested container the view got only
    # a grad hook, which the caller's `out += h` dropped: the block's
    # backward read its freed weights ("setStorage: ... out of bounds").
    _against_reference(lambda: _WrappedViewStack(*_WRAPS[wrap]), settings, _x)


def test_a_forward_hook_registered_after_offload_reads_the_values(settings):
    # ztier's post-hook ran first and left the placeholders (NaN) in the
    # parameters for every hook the user registered after offload().
    torch.manual_seed(0)
    model = _ResidualStack(_ViewBlock)
    ref = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    seen = []
    model.blocks[1].register_forward_hook(
        lambda m, args, out: seen.append(m.proj.weight.float().norm().item()))
    model(_x(0)).float().pow(2).mean().backward()
    z.optimizer.step()
    want = ref.blocks[1].proj.weight.to(torch.bfloat16).float().norm().item()
    assert seen == [pytest.approx(want, rel=1e-6)]


def test_a_post_accumulate_grad_hook_registered_after_offload_sees_the_grad(settings):
    # ztier's hook ran first, took the grad to the engine and cleared it:
    # the user's hook (a per-parameter optimizer, grad statistics) saw None.
    torch.manual_seed(0)
    model = _ResidualStack(_ViewBlock)
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    ref = Reference(ref_model, z, ADAMW)
    seen, want = {}, {}

    def keep(into, name, p):
        into[name] = None if p.grad is None else p.grad.clone()

    for m, into in ((model, seen), (ref_model, want)):
        for n, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(functools.partial(keep, into, n))
    model(_x(0)).float().pow(2).mean().backward()
    ref.backward(ref_model(_x(0)).float().pow(2).mean())
    assert seen.keys() == want.keys() and len(seen) == len(list(model.parameters()))
    for n, g in want.items():
        assert seen[n] is not None and torch.equal(seen[n], g), n
    z.optimizer.step()
    ref.step([g["lr"] for g in z.optimizer.param_groups])
    assert torch.equal(model(_x(1)), ref_model(_x(1)))  # and the engine got the grads
    z.close()


def test_a_grad_hook_that_drops_the_grad_is_refused_and_one_that_replaces_it_trains(settings):
    # A post-accumulate-grad hook of the user's that set p.grad = None (an
    # optimizer stepped in backward, then its zero_grad()) ran before
    # ztier's, which failed with "copy_(): argument 'other' (position 1)
    # must be Tensor, not NoneType".
    torch.manual_seed(0)
    model = _ResidualStack(_ViewBlock)
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    drop = model.inp.weight.register_post_accumulate_grad_hook(
        lambda p: setattr(p, "grad", None))
    with pytest.raises(RuntimeError, match=r"'inp.weight' had no grad when ztier's "
                       r"post-accumulate-grad hook ran: a hook of yours on it .* set p.grad to "
                       r"None first; .*leave p.grad set in such hooks"):
        model(_x(0)).float().pow(2).mean().backward()
    drop.remove()
    # The later units' grads had gone out: that step is dropped, said so.
    with pytest.warns(UserWarning, match="grads were discarded"):
        model(_x(5))
    # A hook that replaces the grad with a tensor of its shape: the engine
    # takes the new one, as torch's optimizers would.
    def halve(p):
        p.grad = p.grad * 0.5

    for m in (model, ref_model):
        m.inp.weight.register_post_accumulate_grad_hook(halve)
    ref = Reference(ref_model, z, ADAMW)
    for step in range(2):
        loss = model(_x(step)).float().pow(2).mean()
        loss.backward()
        ref_loss = ref_model(_x(step)).float().pow(2).mean()
        ref.backward(ref_loss)
        assert torch.equal(loss, ref_loss), step
        z.optimizer.step()
        ref.step([g["lr"] for g in z.optimizer.param_groups])
    assert torch.equal(model(_x(3)), ref_model(_x(3)))
    z.close()


def test_a_grad_hook_that_raises_leaves_no_grad_for_the_next_backward(settings):
    # A backward that raised after torch accumulated a grad and before
    # ztier's hook took it (a post-accumulate-grad hook of the user's raised)
    # left that grad on the parameter: the next backward added to it, and the
    # engine stepped on the sum, while the warning said that step's grads
    # were discarded. Each recovery the messages name trains on as the
    # reference does.
    torch.manual_seed(0)
    model = _ResidualStack(_ViewBlock)
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    ref = Reference(ref_model, z, ADAMW)
    armed = set()  # ids of the parameters whose hook raises once

    def boom(p):
        if id(p) in armed:
            armed.discard(id(p))
            raise ValueError("a hook of the user's failed")

    for p in (model.inp.weight, model.out.weight):
        p.register_post_accumulate_grad_hook(boom)

    def failing_backward(p, step):
        armed.add(id(p))
        with pytest.raises(ValueError, match="a hook of the user's failed"):
            model(_x(100 + step)).float().pow(2).mean().backward()
        assert p.grad is not None  # torch's accumulation was done

    def step_both(step):
        loss = model(_x(step)).float().pow(2).mean()
        loss.backward()
        ref_loss = ref_model(_x(step)).float().pow(2).mean()
        ref.backward(ref_loss)
        assert torch.equal(loss, ref_loss), step
        z.optimizer.step()
        ref.step([g["lr"] for g in z.optimizer.param_groups])
        with torch.no_grad():
            assert torch.equal(model(_x(50)), ref_model(_x(50))), step

    step_both(0)
    # The embedding's weight, the backward's last grad: the other units'
    # had gone out; the next forward drops that step and says so.
    failing_backward(model.inp.weight, 1)
    with pytest.warns(UserWarning, match="that step's grads were discarded"):
        step_both(1)
    # The head's weight, among its first: none of the backward's grads had
    # gone out; optimizer.step() takes no step and says so.
    failing_backward(model.out.weight, 2)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) after a backward pass that did "
                       r"not finish .*before any of its grads reached the engine: none was "
                       r"taken .*run the forward and backward again"):
        z.optimizer.step()
    step_both(2)
    # Or the next forward goes on from it.
    failing_backward(model.out.weight, 3)
    step_both(3)
    assert z.step_count == 4
    z.close()


class _Residual(nn.Module):
    """x + tanh(fc(x)): a block of 8 features."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def test_blocks_stacked_in_a_sequential_are_units(settings):
    # Only a ModuleList was looked for: a stack in nn.Sequential (ResNet's
    # layers, ViT encoders, MLP stacks) made the whole model one unit, held
    # on the device throughout.
    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(*(_Residual() for _ in range(3))),
                             nn.Linear(8, 1))

    _, z = _against_reference(make, settings, _x)
    assert [u.name for u in z.units] == ["embed", "1.0", "1.1", "1.2", "head"]
    root = nn.Sequential(*(_Residual() for _ in range(4)))
    assert [name for name, _ in zt.find_blocks(root)] == ["0", "1", "2", "3"]
    # A Sequential of one class without parameters holds no block.
    assert zt.find_blocks(nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.ReLU()))) == []


def test_blocks_in_lists_of_lists_are_units(settings):
    # A UNet's stages, a ModuleList of ModuleLists of blocks: the stages
    # were taken as the blocks, and a ModuleList is never called, so its
    # blocks read their NaN placeholders (every step skipped).
    class Stages(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.stages = nn.ModuleList(nn.ModuleList([_Residual(), _Residual()]) for _ in range(2))
            self.mid = nn.ModuleDict({"a": _Residual()})
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = self.inp(x)
            for stage in self.stages:
                for b in stage:
                    h = b(h)
            return self.out(self.mid["a"](h))

    _, z = _against_reference(Stages, settings, _x)
    assert [u.name for u in z.units] == ["embed", "stages.0.0", "stages.0.1", "stages.1.0",
                                         "stages.1.1", "head"]
    # Named as blocks, a list is refused, naming its modules.
    with pytest.raises(ValueError, match=r"'stages.0', a ModuleList, which is never called.*"
                                         r"'stages.0.0', 'stages.0.1'"):
        zt.offload(Stages(), optimizer=ADAMW, settings=settings, blocks=["stages.0"])
    with pytest.raises(ValueError, match="'mid', a ModuleDict"):
        zt.offload(Stages(), optimizer=ADAMW, settings=settings, blocks=["mid"])

    # A list with a forward of its own (an MoE layer's experts) is called:
    # a block, as it was, named in blocks= too; a ParameterList beside the
    # blocks is read by the module that holds it, never a block.
    class Experts(nn.ModuleList):
        def forward(self, x):
            w = torch.stack([e.weight for e in self])
            return x + torch.tanh(torch.einsum("bd,eod->bo", x, w)) / len(self)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.layers = nn.ModuleList(Experts(nn.Linear(8, 8) for _ in range(2))
                                        for _ in range(3))
            self.gains = nn.ModuleList(
                nn.ModuleDict({"block": _Residual(),
                               "gain": nn.ParameterList([nn.Parameter(torch.ones(8))])})
                for _ in range(2))
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self.out(h)

    _, z = _against_reference(Moe, settings, _x)
    assert [u.name for u in z.units] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    z.close()
    z = zt.offload(Moe(), optimizer=ADAMW, settings=settings, blocks=["layers.0", "layers.1"])
    z.close()
    assert [n for n, _ in zt.find_blocks(Moe().gains)] == ["0.block", "1.block"]


@pytest.mark.parametrize("whose", ["optimizer", "model"])
def test_zero_grad_inside_an_accumulation_window_drops_its_grads(settings, whose):
    # torch's zero_grad() drops the window's grads; ztier's cleared only
    # p.grad, and the next step applied the grads the user threw away.
    # model.zero_grad() cleared p.grad alone too: the window's grads were in
    # the engine already; it is the optimizer's on an offloaded model.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, grad_accumulation=2, settings=settings)
    zero_grad = z.optimizer.zero_grad if whose == "optimizer" else model.zero_grad
    ref = Reference(ref_model, z, ADAMW, accumulation=2)
    model(_x(0) * 5).pow(2).mean().backward()  # thrown away
    zero_grad()
    for step in (1, 2):
        model(_x(step)).pow(2).mean().backward()
        ref.backward(ref_model(_x(step)).pow(2).mean())
    z.optimizer.step()
    ref.step([g["lr"] for g in z.optimizer.param_groups])
    x = _x(3)
    assert torch.equal(model(x), ref_model(x))
    # After the window's last backward the engine has begun the update.
    model(_x(4)).pow(2).mean().backward()
    model(_x(5)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after the step's last backward.*"
                       r"another model's loss.*requires_grad_\(False\)"):
        zero_grad()
    z.optimizer.step()
    zero_grad()  # between steps: nothing to drop
    if whose == "model":
        with z.gathered():
            plain = copy.deepcopy(model)  # a copy's zero_grad is torch's
        plain(_x(6)).sum().backward()
        plain.zero_grad()
        assert all(p.grad is None for p in plain.parameters())
        z.close()
        assert "zero_grad" not in vars(model)  # torch's again


class _Positions(nn.Module):
    """A learned position table returning a slice of itself."""

    def __init__(self, rows=16, dim=8):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(rows, dim) * 0.1)

    def forward(self, rows):
        return self.pe[:rows]


class _WithPositions(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.pos = _Positions(dim=dim)
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_ViewBlock(dim) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x) + self.pos(x.shape[0])
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        return self.out(h)


def test_a_module_returning_a_view_of_its_own_parameter_trains(settings):
    # The view pointed into the unit's storage, emptied when the module's
    # forward ended: the caller read freed memory (the process crashed).
    model, z = _against_reference(_WithPositions, settings, _x)
    with torch.no_grad():
        assert torch.isfinite(model(_x(9))).all()  # evaluation reads it too


def test_zero_grad_after_a_backward_that_raised_drops_the_window(settings):
    # A backward that raised left the phase at "backward", and zero_grad()
    # (the way to skip a bad batch) then dropped nothing: the next step took
    # the window's earlier grads.
    class Fails(nn.Module):
        fail = False

        def forward(self, x):
            return _Raise.apply(x) if self.fail else x

    class _Raise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("a bad batch")

    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1), Fails())

    torch.manual_seed(0)
    model = make()
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, grad_accumulation=2, settings=settings)
    ref = Reference(ref_model, z, ADAMW, accumulation=2)
    model(_x(0)).pow(2).mean().backward()  # a micro-step of the window, then a bad one
    model[3].fail = True
    with pytest.raises(RuntimeError, match="a bad batch"):
        model(_x(1)).pow(2).mean().backward()
    model[3].fail = False
    z.optimizer.zero_grad()  # the engine says it discarded the window's grads
    for step in (2, 3):
        model(_x(step)).pow(2).mean().backward()
        ref.backward(ref_model(_x(step)).pow(2).mean())
    z.optimizer.step()
    ref.step([g["lr"] for g in z.optimizer.param_groups])
    assert torch.equal(model(_x(4)), ref_model(_x(4)))


def test_blocks_can_be_chosen_and_a_checkpoint_of_another_layout_says_so(settings, tmp_path):
    # A checkpoint of a model laid out in other units (a Sequential stack
    # saved when it was one unit) was refused naming unit counts only, and
    # nothing let the user lay the model out as it was.
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(*(_ViewBlock(8) for _ in range(3))),
                             nn.Linear(8, 1))

    one = make()
    z = zt.offload(one, optimizer=ADAMW, settings=settings, blocks=[])
    assert [u.name for u in z.units] == ["head"]
    one(_x(0)).pow(2).mean().backward()
    z.optimizer.step()
    z.save_checkpoint(str(tmp_path / "ckpt"))
    want = one(_x(1))
    z.close()
    split = make()
    z = zt.offload(split, optimizer=ADAMW, settings=settings)
    with pytest.raises(ValueError, match=r"this model's units: embed, 1\.0, 1\.1, 1\.2, head;.*"
                                         r"blocks=\[\.\.\.\]"):
        z.load_checkpoint(str(tmp_path / "ckpt"))
    z.close()
    again = make()
    z = zt.offload(again, optimizer=ADAMW, settings=settings, blocks=[])
    z.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(again(_x(1)), want)
    z.close()
    # Chosen by name or module, in the model's order; refused where wrong.
    m = make()
    z = zt.offload(m, optimizer=ADAMW, settings=settings, blocks=["1.2", m[1][0]])
    assert [u.name for u in z.units] == ["embed", "1.0", "1.2", "head"]
    z.close()
    for bad, says in ((["9"], "no submodule"), ([make()[0]], "not in the model"),
                      (["1", "1.0"], "inside '1'"), ("1", "takes a list")):
        with pytest.raises((ValueError, TypeError), match=says):
            zt.offload(make(), optimizer=ADAMW, settings=settings, blocks=bad)


class _Encoder(nn.Module):
    """Trained through a method (CLIP's encode_image, a VAE's encode), not
    model(x): the root's hooks never run. Its one block is shared by every
    layer (ALBERT) and checkpointed; ``first``: the first offloaded module
    called is in a checkpoint (its forward runs without grad)."""

    def __init__(self, reentrant=True, first=False):
        super().__init__()
        self.reentrant = reentrant
        self.first = first
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([_ViewBlock(8)] * 3)
        self.out = nn.Linear(8, 1)
        self.fail = False

    def encode(self, x):
        h = x if self.first else self.inp(x)
        for layer in self.layers:
            h = h + torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant)
        if self.fail:
            self.layers[0](h[..., :3])  # raises inside the block (a shape error)
        return self.out(h)


@pytest.mark.parametrize("case", ["reentrant", "non-reentrant", "checkpointed first"])
def test_a_model_trained_through_a_method_of_its_own(settings, tmp_path, case):
    # The forward's bookkeeping began in the root's hooks only: the shared
    # block under reentrant checkpointing was refused ("a second grad for
    # 'layers.0.proj.bias'"), a stale flag from the forward before; so was
    # one whose first module ran in a checkpoint. A forward that raised
    # left its unit held, to train on stale weights for good.
    def make():
        return _Encoder(case != "non-reentrant", first=case == "checkpointed first")

    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    ref_model = make()
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    ref = Reference(ref_model, z, ADAMW)
    for step in range(3):
        x = _x(step).requires_grad_(case == "checkpointed first")
        loss = model.encode(x).pow(2).mean()
        loss.backward()
        ref_loss = ref_model.encode(x).pow(2).mean()
        ref.backward(ref_loss)
        assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
        z.optimizer.step()
        ref.step([g["lr"] for g in z.optimizer.param_groups])
        with torch.no_grad():  # an evaluation between steps, through the method too
            model.encode(x)
        z.save_checkpoint(str(tmp_path / f"ck-{step}"))  # the forward is over:
        z.load_checkpoint(str(tmp_path / f"ck-{step}"))  # the state as it was
        model.fail = True  # a forward that raises midway: the next ones train on
        with pytest.raises(RuntimeError):
            model.encode(x)
        model.fail = False
    z.close()


class _Encode(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)
        self.boom = False

    def forward(self, x):
        return self.encode(x)

    def encode(self, x):
        h = self.b(torch.relu(self.a(x)))
        if self.boom:
            h.register_hook(self._fail)
        return self.c(torch.relu(h))

    @staticmethod
    def _fail(grad):
        raise ValueError("a hook of the user's failed")


@pytest.mark.parametrize("call", ["encode", "submodules"])
def test_a_backward_that_raised_is_retried_through_a_method_of_its_own(settings, call):
    # A backward that raised left the pass in its backward: a forward that
    # does not go through the model's own call (model.encode(x), or its
    # modules called one by one) did not let it go, and the step after the
    # retried forward and backward was refused as one "after a backward pass
    # that did not finish". It trains on as the reference does.
    torch.manual_seed(0)
    model = _Encode()
    ref_model = copy.deepcopy(model)
    z = zt.offload(model, optimizer=ADAMW, settings=settings)
    ref = Reference(ref_model, z, ADAMW)

    def run(m, x):
        if call == "encode":
            return m.encode(x)
        h = m.b(torch.relu(m.a(x)))
        if m.boom:
            h.register_hook(m._fail)
        return m.c(torch.relu(h))

    for step in range(3):
        model.boom = True
        with pytest.raises(ValueError, match="a hook of the user's failed"):
            run(model, _x(100 + step)).pow(2).mean().backward()
        model.boom = False
        with warnings.catch_warnings():  # (grads that went out are said to be dropped)
            warnings.simplefilter("ignore")
            loss = run(model, _x(step)).pow(2).mean()
        loss.backward()
        ref_loss = run(ref_model, _x(step)).pow(2).mean()
        ref.backward(ref_loss)
        assert torch.equal(loss, ref_loss), step
        z.optimizer.step()
        ref.step([g["lr"] for g in z.optimizer.param_groups])
    with torch.no_grad():
        assert torch.equal(run(model, _x(9)), run(ref_model, _x(9)))
    z.close()


class _AuxBlock(nn.Module):
    """An MoE-style block keeping its auxiliary loss on itself, made after
    its output."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, 4)

    def forward(self, x):
        y = x + torch.tanh(self.fc(x))
        self.aux_loss = self.gate(x).softmax(-1).pow(2).sum(-1).mean()
        return y


class _MoeBlock(nn.Module):
    """A decoder block whose MoE layer (a submodule of the block's unit)
    keeps the aux loss, in a list."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = _AuxBlock(dim)

    def forward(self, x):
        y = self.moe(self.norm(x))
        self.moe.aux_loss = [self.moe.aux_loss]
        return y


class _AuxStack(nn.Module):
    def __init__(self, block=_AuxBlock):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(block(8) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        aux = [getattr(layer, "moe", layer).aux_loss for layer in self.layers]
        aux = [a[0] if isinstance(a, list) else a for a in aux]
        return self.out(h) + 0.1 * sum(aux)


@pytest.mark.parametrize("block", [_AuxBlock, _MoeBlock])
def test_a_loss_a_block_kept_on_itself_trains(settings, block):
    # The aux loss's backward reached the block's gate before any hook of
    # its outputs held the unit: it read freed weights ("setStorage: ...
    # out of bounds for storage of size 0").
    _, z = _against_reference(lambda: _AuxStack(block), settings, _x)
    assert [u.name for u in z.units][1:4] == ["layers.0", "layers.1", "layers.2"]


class _Collector:
    """A plain object the blocks share, holding their side outputs."""

    def __init__(self):
        self.items = []


class _SideBlock(nn.Module):
    """A block with an auxiliary head whose output reaches the loss past
    the block's output: appended to a list argument or to a shared object."""

    def __init__(self, dim, collector):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.aux = nn.Linear(dim, 1)
        self.collector = collector

    def forward(self, x, side=None):
        h = torch.tanh(self.fc(x))
        (side if side is not None else self.collector.items).append(self.aux(h))
        return h


class _SideStack(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.shared = _Collector()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_SideBlock(8, self.shared) for _ in range(3))
        self.out = nn.Linear(8, 1)
        self.hooked = []
        if how == "forward hook":
            for layer in self.layers:
                layer.aux.register_forward_hook(lambda m, i, o: self.hooked.append(o))

    def forward(self, x):
        side, self.shared.items, self.hooked[:] = [], [], []
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, side if self.how == "list argument" else None)
        extra = {"list argument": side, "shared object": self.shared.items,
                 "forward hook": self.hooked}[self.how]
        return self.out(h) + sum(extra)


@pytest.mark.parametrize("how", ["list argument", "shared object", "forward hook"])
def test_a_side_output_that_reaches_the_loss_past_the_blocks_output_trains(settings, how):
    # A deep-supervision head's output (or an MoE balance loss) handed back
    # through the caller's list, a shared object, or a forward hook of a
    # submodule: its backward ran before any of the block's outputs' and
    # read its freed weights ("setStorage: ... storage of size 0").
    _, z = _against_reference(lambda: _SideStack(how), settings, _x, masters=True)
    assert [u.name for u in z.units][1:4] == ["layers.0", "layers.1", "layers.2"]


def test_a_module_the_root_and_every_block_share_trains(settings):
    # One projection registered at the root and in every block: its
    # parameters were in the first block's unit, the root's call of it read
    # the placeholders (NaN), and every step was skipped.
    class Block(nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.shared = shared

        def forward(self, x):
            return torch.tanh(self.fc(x)) + self.shared(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.layers = nn.ModuleList(Block(self.shared) for _ in range(3))
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = self.shared(x)
            for layer in self.layers:
                h = layer(h)
            return self.out(h)

    _against_reference(Net, settings, _x, masters=True)


class _SlotsOut:
    __slots__ = ("h",)

    def __init__(self, h):
        self.h = h


class _SlotsBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return _SlotsOut(x + torch.tanh(self.fc(x)))


def test_a_block_returning_an_object_with_slots_trains(settings):
    # Its output's tensor (in __slots__, no __dict__) was never hooked: the
    # block's backward read freed weights.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.layers = nn.ModuleList(_SlotsBlock(8) for _ in range(3))
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h).h
            return self.out(h)

    _against_reference(Net, settings, _x, masters=True)


def test_one_tensor_passed_to_a_block_several_times_stays_one_tensor(settings):
    # A tensor in several argument slots (self-attention's mha(h, h, h)) came
    # into the block as a tensor per slot: nn.MultiheadAttention, which asks
    # `query is key`, left its packed self-attention for three projections,
    # and trained away from the reference (the key bias's grad, 0, came out
    # as rounding noise that AdamW made a step of).
    seen = []

    class Attention(nn.MultiheadAttention):
        def forward(self, q, k, v):
            seen.append(q is k and k is v)
            return super().forward(q, k, v)[0]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.attn = Attention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 20)

        def forward(self, x):
            h = self.emb(x)
            return self.head(self.attn(h, h, v=h))

    def tokens(step):
        return torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(step))

    _against_reference(Net, settings, tokens, steps=4, masters=True)
    assert seen and all(seen), seen
