#!/usr/bin/env python3
# Reference side of torch_reference_test.cc: runs PyTorch's own optimizer
# (torch.optim.AdamW or torch.optim.Adam on CPU, fp32, fused or not) over the
# inputs the test wrote, and writes params, exp_avg and exp_avg_sq after every
# step. Input (little endian): int64 n, steps, adamw; float64 lr, beta1,
# beta2, eps, weight_decay; float32 params[n], exp_avg[n], exp_avg_sq[n],
# grads[steps][n]. Output: per step float32 params[n], exp_avg[n], exp_avg_sq[n].
# Usage: torch_adamw.py IN OUT fused|plain
import struct
import sys

import torch

HEADER = "<qqqddddd"


def main() -> int:
    in_path, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(in_path, "rb") as f:
        data = f.read()
    n, steps, adamw, lr, beta1, beta2, eps, wd = struct.unpack_from(HEADER, data, 0)
    offset = struct.calcsize(HEADER)

    def take() -> torch.Tensor:
        nonlocal offset
        t = torch.frombuffer(bytearray(data[offset:offset + 4 * n]), dtype=torch.float32)
        offset += 4 * n
        return t

    param = torch.nn.Parameter(take())
    exp_avg, exp_avg_sq = take(), take()
    grads = [take() for _ in range(steps)]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
              fused=(mode == "fused"))
    # Start from the given moments instead of zeros.
    opt.state[param] = {"step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    state = opt.state[param]
    with open(out_path, "wb") as out:
        for g in grads:
            param.grad = g.clone()
            opt.step()
            for t in (param.detach(), state["exp_avg"], state["exp_avg_sq"]):
                out.write(t.contiguous().numpy().tobytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
