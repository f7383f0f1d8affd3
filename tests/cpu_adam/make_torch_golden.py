#!/usr/bin/env python3
# Writes tests/cpu_adam/testdata/torch_golden.bin: what PyTorch's own
# optimizers (torch.optim.AdamW / Adam, CPU, fp32, the single-tensor
# implementation) and torch.nn.utils.clip_grad_norm_ compute for a few small
# deterministic problems. torch_golden_test.cc checks cpu_adam::Step and the
# engine's step against it without Python. Re-run only when a case is added:
#   .venv/bin/python tests/cpu_adam/make_torch_golden.py
#
# Inputs are not stored: both sides generate them with splitmix64 (see
# Generator below and in the test), each value computed in float64 and
# rounded once to float32, so they are bit-identical. Every 37th grad is 0.
#
# File (little endian): b"ZTGOLD01", u32 case count; per case:
#   char name[32] (NUL padded); u32 tensor count, u64 numel per tensor;
#   i32 mode (0 AdamW, 1 Adam), i32 bf16 grads, i32 steps;
#   f64 lr, beta1, beta2, eps, weight_decay, clip_norm (0: none); u64 seed;
#   f64 grad magnitude per step; f32 the first 4 initial params (a check
#   that both generators agree); then per step, over all tensors
#   concatenated: f32 params[N], exp_avg[N], exp_avg_sq[N].
import struct
import sys
from pathlib import Path

import torch

MASK = (1 << 64) - 1


class Generator:
    """splitmix64; uniform values in [-scale, scale) from the top 24 bits."""

    def __init__(self, seed: int, stream: int) -> None:
        self.state = (seed ^ (stream * 0xD1B54A32D192ED03)) & MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def values(self, n: int, scale: float) -> list[float]:
        return [((self.next() >> 40) * 2.0**-24 * 2.0 - 1.0) * scale for _ in range(n)]


def grads(seed: int, step: int, n: int, scale: float) -> list[float]:
    g = Generator(seed, 2 + step).values(n, scale)
    return [0.0 if i % 37 == 0 else x for i, x in enumerate(g)]


CASES = [
    # name, tensors, mode, bf16, lr, betas, eps, wd, clip, seed, grad magnitude per step
    ("adamw", [515], "adamw", False, 1e-2, (0.9, 0.999), 1e-8, 0.05, 0.0, 11,
     [1.0, 1.0, 1.0, 1.0]),
    ("adam_l2", [515], "adam", False, 5e-3, (0.85, 0.98), 1e-8, 0.01, 0.0, 12,
     [1.0, 0.5, 1.0, 2.0]),
    ("adamw_bf16_small_grads", [515], "adamw", True, 3e-4, (0.8, 0.95), 1e-6, 0.1, 0.0, 13,
     [2.0**-20, 2.0**-20, 1.0, 8.0]),
    ("engine_adamw_clip", [515, 259], "adamw", True, 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0, 14,
     [4.0, 1.0 / 11, 1.0 / 64, 4.0]),  # norms about 63, 1.4, 0.25, 63
    ("engine_adam_clip", [515, 259], "adam", True, 2e-3, (0.8, 0.99), 1e-8, 0.01, 0.5, 15,
     [1.0, 1.0 / 128, 0.045, 1.0]),  # norms about 16, 0.12, 0.71, 16
]


def run_case(case) -> bytes:
    name, sizes, mode, bf16, lr, betas, eps, wd, clip, seed, mags = case
    total = sum(sizes)
    init = Generator(seed, 1).values(total, 1.0)
    flat = torch.tensor(init, dtype=torch.float64).to(torch.float32)
    params, at = [], 0
    for n in sizes:
        params.append(torch.nn.Parameter(flat[at:at + n].clone()))
        at += n
    cls = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
    opt = cls(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False, fused=False)
    out = bytearray()
    out += struct.pack("<32sI", name.encode(), len(sizes))
    out += struct.pack(f"<{len(sizes)}Q", *sizes)
    out += struct.pack("<iii", 0 if mode == "adamw" else 1, int(bf16), len(mags))
    out += struct.pack("<ddddddQ", lr, betas[0], betas[1], eps, wd, clip, seed)
    out += struct.pack(f"<{len(mags)}d", *mags)
    out += flat[:4].numpy().tobytes()
    for step, mag in enumerate(mags):
        g = torch.tensor(grads(seed, step, total, mag), dtype=torch.float64).to(torch.float32)
        if bf16:
            g = g.to(torch.bfloat16).to(torch.float32)
        at = 0
        for p, n in zip(params, sizes):
            p.grad = g[at:at + n].clone()
            at += n
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        opt.step()
        for key in ("param", "exp_avg", "exp_avg_sq"):
            parts = [p.detach() if key == "param" else opt.state[p][key] for p in params]
            out += torch.cat(parts).contiguous().numpy().tobytes()
    return bytes(out)


def main() -> int:
    torch.set_num_threads(1)
    path = Path(__file__).resolve().parent / "testdata" / "torch_golden.bin"
    path.parent.mkdir(exist_ok=True)
    data = b"ZTGOLD01" + struct.pack("<I", len(CASES)) + b"".join(run_case(c) for c in CASES)
    path.write_bytes(data)
    print(f"wrote {path} ({len(data)} bytes, {len(CASES)} cases, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
