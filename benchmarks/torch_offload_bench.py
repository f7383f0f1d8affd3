#!/usr/bin/env python3
"""Training throughput of ztier.torch against plain PyTorch (the model all in
device memory with torch's own AdamW: the limit, measured in the same run) and, where installed and
a GPU is present, DeepSpeed ZeRO-3 with params and optimizer offloaded to CPU.

Same Llama-shaped model (random weights), same batch, bf16 compute. Prints
per framework: seconds per step, tokens/s, peak device memory, and the
ratios ztier / torch (how close offloading comes to the in-memory limit) and
ztier / DeepSpeed.

    torch_offload_bench.py                          # a small model on the CPU
    torch_offload_bench.py --device cuda --preset 1b  # the 0.94B anchor shape
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

PRESETS = {
    # hidden, layers, heads, intermediate, vocabulary
    "tiny": (256, 4, 8, 688, 4096),
    "small": (768, 8, 12, 2048, 32000),
    "1b": (2048, 16, 16, 5504, 32000),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--states", choices=("dram", "nvme"), default="dram")
    p.add_argument("--nvme", help="swap directory for --states nvme")
    p.add_argument("--frameworks", default="torch,ztier,deepspeed")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def make_model(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab = PRESETS[args.preset]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=max(args.seq, 256),
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model, vocab


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(torch, device, step_fn, args, vocab):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step_fn(x)
    sync(torch, device)
    t0 = time.perf_counter()
    loss = None
    for _ in range(args.steps):
        loss = step_fn(x)
    sync(torch, device)
    seconds = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"s_per_step": seconds, "tokens_per_s": args.batch * args.seq / seconds,
            "peak_device_bytes": peak, "last_loss": float(loss)}


def bench_torch(args, torch, device):
    model, vocab = make_model(args, torch)
    model.to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    # On a GPU: bf16 autocast, as one trains there. On the host: fp32, the
    # CPU's fastest (PyTorch's bf16 CPU kernels are far slower without bf16
    # matrix units), as ztier.torch computes there too.
    autocast = device.type == "cuda"

    def step(x):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run_loop(torch, device, step, args, vocab)


def bench_ztier(args, torch, device):
    import ztier.torch as zt

    model, vocab = make_model(args, torch)
    settings = {"ztier.dram_budget": "64G"}
    if args.nvme:
        settings["ZTIER_NVME_PATHS"] = args.nvme
    z = zt.offload(model, device=str(device), optimizer=zt.AdamW(lr=1e-4), states=args.states,
                   settings=settings)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        z.optimizer.step()
        return loss.detach()

    out = run_loop(torch, device, step, args, vocab)
    z.wait()
    out["runner"] = z.runner.stats()
    out["engine"] = {k: v for k, v in z.job.counters().items()
                     if k in ("optimizer_seconds", "stall_seconds", "steps")}
    z.close()
    return out


def bench_deepspeed(args, torch, device):
    if device.type != "cuda":
        return {"skipped": "DeepSpeed's offload path needs a CUDA device"}
    try:
        import deepspeed
    except ImportError:
        return {"skipped": "deepspeed is not installed"}
    model, vocab = make_model(args, torch)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=model.parameters())

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return run_loop(torch, device, step, args, vocab)


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_offload_bench: no CUDA device", file=sys.stderr)
        return 2
    runners = {"torch": bench_torch, "ztier": bench_ztier, "deepspeed": bench_deepspeed}
    results = {}
    for name in args.frameworks.split(","):
        if name not in runners:
            print(f"torch_offload_bench: unknown framework {name!r}", file=sys.stderr)
            return 2
        results[name] = runners[name](args, torch, device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hidden, layers, heads, inter, vocab = PRESETS[args.preset]
    print(f"model: llama {args.preset} (hidden {hidden}, {layers} layers, intermediate {inter}, "
          f"vocabulary {vocab}), batch {args.batch} x {args.seq} tokens, device {device}, "
          f"ztier states {args.states}")
    print(f"{'framework':<10} {'s/step':>9} {'tokens/s':>11} {'peak GiB':>9}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<10} skipped: {r['skipped']}")
            continue
        peak = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**30:.2f}"
        print(f"{name:<10} {r['s_per_step']:>9.4f} {r['tokens_per_s']:>11,.0f} {peak:>9}")
    z = results.get("ztier", {})
    for other in ("torch", "deepspeed"):
        r = results.get(other, {})
        if "tokens_per_s" in z and "tokens_per_s" in r:
            print(f"ratio ztier / {other} (tokens/s): {z['tokens_per_s'] / r['tokens_per_s']:.3f}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
