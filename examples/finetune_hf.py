#!/usr/bin/env python3
"""Fine-tunes a causal language model through ztier (ztier.torch).

    finetune_hf.py --tiny                       # a small Llama from a config, byte tokens
    finetune_hf.py --model DIR                  # a local Hugging Face checkpoint
    finetune_hf.py --tiny --out run --resume    # continue from run/checkpoint

The text is the fortunes corpus (Debian's 'fortunes' package) unless --data
names a file. The model's parameters live in the engine (fp32 masters and
AdamW moments in pinned DRAM, or on NVMe with --states nvme and --nvme DIR),
streamed to the device a block at a time; the optimizer overlaps the next
forward. Every --save-every steps a checkpoint goes to OUT/checkpoint (its
step is the data position: a batch follows from the step and --seed), and at
the end the weights go to OUT/export as a Hugging Face directory
(config.json + model.safetensors); a --resume of a run that is done says so.
--json prints a last line {"first_loss", "last_loss", "tokens_per_s", ...}.
Exit status: 0, 2 for bad arguments or missing input, 1 for a training error.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

FORTUNES = "/usr/share/games/fortunes"


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """Each option's help says its default, where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is not None and default is not False and default != argparse.SUPPRESS
                and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text.strip()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpWithDefaults)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face checkpoint directory")
    src.add_argument("--tiny", action="store_true",
                     help="a small Llama built from a config (byte-level tokens, no download)")
    p.add_argument("--data", help="a text file (default: the fortunes corpus)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--accumulation", type=int, default=1,
                   help="micro-steps (backward passes) per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip, 0 for none")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--states", choices=("dram", "nvme"), default="dram",
                   help="where the fp32 master weights and AdamW moments live")
    p.add_argument("--nvme", help="swap directory for --states nvme")
    p.add_argument("--dram-budget", default="4G", help="pinned host memory the engine may use")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--out", default="finetune-run", help="checkpoint and log directory")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "accumulation", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "clip", "weight_decay"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            p.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not (args.device == "cpu" or args.device == "cuda"
            or (args.device.startswith("cuda:") and args.device[5:].isdigit())):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.states == "nvme" and not args.nvme:
        p.error("--states nvme needs --nvme DIR (an existing directory)")
    if args.nvme and not os.path.isdir(args.nvme):
        p.error(f"--nvme {args.nvme} is not an existing directory")
    if args.model and not os.path.isdir(args.model):
        p.error(f"--model {args.model} is not a directory (a local Hugging Face checkpoint)")
    return args


def load_text(path):
    files = [path] if path else sorted(
        f for f in glob.glob(os.path.join(FORTUNES, "*"))
        if os.path.isfile(f) and not f.endswith(".dat") and not os.path.islink(f))
    if not files:
        raise FileNotFoundError(f"no text to train on: {FORTUNES} is empty or missing (install "
                                "the Debian package 'fortunes', or pass --data FILE)")
    return b"".join(open(f, "rb").read() for f in files)


def build(args, torch, zt):
    settings = {"ztier.dram_budget": args.dram_budget}
    if args.nvme:
        settings["ZTIER_NVME_PATHS"] = args.nvme
    optimizer = zt.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                         no_decay=("bias", "norm"))
    common = dict(device=args.device, optimizer=optimizer, clip_grad_norm=args.clip,
                  grad_accumulation=args.accumulation, states=args.states, settings=settings)
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                          max_position_embeddings=max(args.seq, 256), tie_word_embeddings=True)
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(cfg)
        encode = lambda text: torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        z = zt.offload(model, **common)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        cfg = AutoConfig.from_pretrained(args.model)
        cls = AutoModelForCausalLM._model_mapping[type(cfg)]
        try:
            tok = AutoTokenizer.from_pretrained(args.model)
            encode = lambda text: torch.tensor(tok(text.decode("utf-8", "replace"))["input_ids"])
        except (OSError, ValueError) as e:
            if cfg.vocab_size < 256:
                raise SystemExit(f"finetune_hf: no tokenizer in {args.model} ({e})")
            # A model exported by --tiny: byte-level tokens.
            print(f"finetune_hf: no tokenizer in {args.model}: byte-level tokens",
                  file=sys.stderr)
            encode = lambda text: torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        model, z = zt.from_pretrained(cls, args.model, **common)
    model.train()
    if args.checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    return model, z, encode


def main(argv=None):
    args = parse_args(argv)
    try:
        text = load_text(args.data)
    except OSError as e:
        print(f"finetune_hf: {e}", file=sys.stderr)
        return 2
    import torch

    import ztier.torch as zt

    ckpt = os.path.join(args.out, "checkpoint")
    if os.path.exists(ckpt) and not args.resume:
        print(f"finetune_hf: {ckpt} exists: pass --resume to continue it, or another --out",
              file=sys.stderr)
        return 2
    if args.resume and not os.path.exists(os.path.join(ckpt, "manifest.json")):
        print(f"finetune_hf: --resume: no checkpoint in {args.out}", file=sys.stderr)
        return 2
    try:
        model, z, encode = build(args, torch, zt)
    except ValueError as e:  # a setting the engine refuses (a budget, a path)
        print(f"finetune_hf: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)  # once there is a run to keep
    tokens = encode(text)
    if tokens.numel() < args.seq + 2:
        print("finetune_hf: the text is shorter than one sequence", file=sys.stderr)
        return 2
    opt = z.optimizer

    def lr_at(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = 0
    if args.resume:
        z.load_checkpoint(ckpt)
        start = z.step_count  # the checkpoint's own step: nothing beside it can disagree
        if start >= args.steps:
            what = "nothing to do" if start == args.steps else "below it"
            print(f"finetune_hf: {ckpt} is at step {start}, --steps {args.steps}: {what}",
                  file=sys.stderr)
            z.close()
            return 0 if start == args.steps else 2
        for _ in range(start):
            sched.step()
        print(f"finetune_hf: resumed at step {start}", file=sys.stderr)
    z.claim_checkpoint_dir(ckpt)
    n = tokens.numel() - args.seq - 1

    def next_batch(step, micro):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro)
        starts = torch.randint(0, n, (args.batch,), generator=g)
        rows = torch.stack([tokens[s:s + args.seq + 1] for s in starts.tolist()])
        return rows.to(z.device)

    first_loss = last_loss = None
    tokens_done = 0
    t0 = time.perf_counter()
    bar = sys.stderr.isatty() and not args.json
    for step in range(start, args.steps):
        loss_sum = 0.0
        for micro in range(args.accumulation):
            rows = next_batch(step, micro)
            out = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
            (out.loss / args.accumulation).backward()
            loss_sum += out.loss.item() / args.accumulation
            tokens_done += rows[:, :-1].numel()
        opt.step()
        sched.step()
        opt.zero_grad()
        first_loss = loss_sum if first_loss is None else first_loss
        last_loss = loss_sum
        rate = tokens_done / (time.perf_counter() - t0)
        line = (f"step {step + 1}/{args.steps}  loss {loss_sum:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {rate:,.0f} tokens/s")
        if bar:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif (step + 1) % 10 == 0 or step + 1 == args.steps:
            print(line, file=sys.stderr, flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            z.save_checkpoint(ckpt)
    if bar:
        print(file=sys.stderr)
    elapsed = time.perf_counter() - t0
    z.save_pretrained(os.path.join(args.out, "export"))
    summary = {"first_loss": first_loss, "last_loss": last_loss,
               "tokens_per_s": tokens_done / elapsed if elapsed > 0 else 0.0,
               "steps": args.steps - start, "seconds": elapsed,
               "params": sum(t.numel for u in z.units for t in u.tensors),
               "device": str(z.device), "states": args.states,
               "export": os.path.join(args.out, "export")}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"finetune_hf: loss {first_loss:.4f} -> {last_loss:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tokens/s; weights in {summary['export']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the engine's errors say what is wrong: no traceback for them
        from ztier import ZtierError
        if not isinstance(e, ZtierError):
            raise
        lead = "\n" if sys.stderr.isatty() else ""  # past the progress line
        print(f"{lead}finetune_hf: {e}", file=sys.stderr)
        sys.exit(1)
