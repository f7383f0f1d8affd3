"""The reference ztier.torch is held to: a plain PyTorch copy of the model,
trained in memory, whose fp32 masters are updated by ztier's own AdamW kernel
(ztier._C.adamw_step, the engine's kernel) in the engine's order:

- grads: the model's bf16 grads, flat per unit in the engine's layout (the
  padding zero); with accumulation the micro-steps' bf16 grads summed in fp32
  in micro-step order;
- the global norm: per unit, the fp64 sum of squares of its flat grads
  (ztier._C.squared_norm, the engine's), summed in unit order;
- a non-finite norm skips the step; clipping scales by clip / (norm + 1e-6),
  rounded to fp32;
- AdamW per unit over maximal runs of tensors of one (group, frozen), the
  padding with the last run; frozen runs keep their master and publish its
  bf16 rounding; the new bf16 params are the kernel's rounding of the masters.

Everything is computed as the engine computes it, so the model trained
through ztier must match this bit for bit (losses, bf16 params and masters).
"""

from __future__ import annotations

import math

import numpy as np
import torch

import ztier._C as C


class Reference:
    def __init__(self, model, z, adamw, clip=0.0, accumulation=1):
        """``model``: a copy of the model as offload() got it (its fp32
        params are the masters); ``z``: the Offload, for the units' layout."""
        self.model = model
        self.accumulation = accumulation
        self.clip = clip
        self.adamw = adamw
        self.params = dict(model.named_parameters())
        self.units = []
        for u in z.units:
            tensors = [(t.name, t.offset, t.numel, t.group, t.frozen) for t in u.tensors]
            master = torch.zeros(u.padded, dtype=torch.float32)
            for name, off, n, _, _ in tensors:
                master[off:off + n] = self.params[name].detach().reshape(-1).float()
            self.units.append(dict(tensors=tensors, padded=u.padded, master=master,
                                   m=torch.zeros(u.padded), v=torch.zeros(u.padded),
                                   acc=None))
        self.group_decay = list(z._group_decay)
        self.dtype = z.compute_dtype  # the params' dtype in the module
        self.adam_step = 0
        self.micro = 0
        # Floating-point buffers in the compute dtype, a rotary embedding's
        # excepted, as ztier.torch puts them.
        for m in model.modules():
            if "rotary" in type(m).__name__.lower():
                continue
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(self.dtype)
        self._publish_all()

    def _publish_all(self):
        # The model's params become the bf16 rounding of the fp32 masters.
        for u in self.units:
            pub = u["master"].to(torch.bfloat16)
            for name, off, n, _, _ in u["tensors"]:
                p = self.params[name]
                p.data = pub[off:off + n].view(p.shape).to(self.dtype)

    def _flat_grads(self, u):
        g = torch.zeros(u["padded"], dtype=torch.bfloat16)
        for name, off, n, _, _ in u["tensors"]:
            p = self.params[name]
            if p.grad is not None:
                g[off:off + n] = p.grad.reshape(-1)  # fp32 compute: rounded to bf16, as ztier does
        return g

    def backward(self, loss):
        loss.backward()
        for u in self.units:
            g = self._flat_grads(u)
            if self.accumulation > 1:
                u["acc"] = g.float() if self.micro == 0 else u["acc"] + g.float()
            else:
                u["acc"] = g
        for p in self.params.values():
            p.grad = None
        self.micro += 1

    def step(self, lrs):
        assert self.micro == self.accumulation, (self.micro, self.accumulation)
        self.micro = 0
        sq = 0.0
        for u in self.units:
            sq += C.squared_norm(u["acc"])
        norm = math.sqrt(sq)
        if not math.isfinite(norm):
            return norm
        scale = 1.0
        clip = float(np.float32(self.clip))
        if clip > 0 and clip / (norm + 1e-6) < 1:  # as clip_grad_norm_
            scale = float(np.float32(clip / (norm + 1e-6)))
        self.adam_step += 1
        a = self.adamw
        for u in self.units:
            pub = torch.empty(u["padded"], dtype=torch.bfloat16)
            for begin, end, group, frozen in runs(u["tensors"], u["padded"]):
                sl = slice(begin, end)
                if frozen:
                    pub[sl] = u["master"][sl].to(torch.bfloat16)
                    continue
                C.adamw_step(u["master"][sl], u["acc"][sl].contiguous(), u["m"][sl], u["v"][sl],
                             step=self.adam_step, lr=lrs[group], beta1=a.betas[0],
                             beta2=a.betas[1], eps=a.eps, weight_decay=self.group_decay[group],
                             mode=a.mode, bias_correction=a.bias_correction, grad_scale=scale,
                             params_out=pub[sl])
            with torch.no_grad():
                for name, off, n, _, _ in u["tensors"]:
                    self.params[name].copy_(pub[off:off + n].view(self.params[name].shape))  # rounds to dtype
        return norm


def runs(tensors, padded):
    """[(begin, end, group, frozen)]: maximal runs of consecutive tensors with
    one (group, frozen), the last run reaching the end of the padding."""
    out = []
    for _, off, n, group, frozen in tensors:
        if out and out[-1][2] == group and out[-1][3] == frozen:
            out[-1][1] = off + n
        else:
            if out:
                out[-1][1] = off
            out.append([off, off + n, group, frozen])
    out[-1][1] = padded
    return [tuple(r) for r in out]
