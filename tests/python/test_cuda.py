"""ztier.torch on a CUDA device (skipped, with the reason, without one).

The runner's streams are ordered with torch's current stream; the model
computes in bf16 on the GPU. Against the same model on the host device in
bf16 (other kernels, so not bitwise): the first loss within 1e-2 relative,
and 10 steps later within 5e-2; the loss falls; parameters read outside the
hooks are NaN; a checkpoint round trip replays the same losses on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import ztier.torch as zt
from conftest import batch, tiny_llama

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
if zt._C.cuda_device_count() == 0:
    pytest.skip("this ztier build has no CUDA (built without nvcc?)", allow_module_level=True)


def train(device, settings, steps=10):
    model = tiny_llama()
    z = zt.offload(model, device=device, optimizer=zt.AdamW(lr=3e-3), clip_grad_norm=1.0,
                   compute_dtype=torch.bfloat16, settings=settings)
    losses = []
    for step in range(steps):
        x = batch(step).to(z.device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        losses.append(loss.item())
    return model, z, losses


def test_cuda_agrees_with_the_host(settings):
    _, _, host = train("cpu", settings)
    model, z, cuda = train("cuda:0", settings)
    assert math.isclose(cuda[0], host[0], rel_tol=1e-2), (cuda[0], host[0])
    assert math.isclose(cuda[-1], host[-1], rel_tol=5e-2), (cuda[-1], host[-1])
    assert cuda[-1] < cuda[0]
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.device.type == "cuda" and torch.isnan(w.float()).all()
    with z.gathered():
        assert not torch.isnan(w.float()).any()


def test_cuda_checkpoint_round_trip(settings, tmp_path):
    model, z, _ = train("cuda:0", settings, steps=1)

    def step(i):
        x = batch(i).to(z.device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        return loss.item()

    z.save_checkpoint(tmp_path / "ckpt")
    after = [step(i) for i in (1, 2)]
    z.load_checkpoint(tmp_path / "ckpt")
    assert [step(i) for i in (1, 2)] == after
