"""ztier.torch: train a PyTorch ``nn.Module`` (a Hugging Face model among them)
through ztier, ZeRO stage-3 style.

    import ztier.torch as zt
    z = zt.offload(model, device="cpu",
                   optimizer=zt.AdamW(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1,
                                      no_decay=("bias", "norm")),
                   clip_grad_norm=1.0, grad_accumulation=4)
    opt = z.optimizer          # a torch.optim.Optimizer: LR schedulers work
    loss = model(**batch).loss; loss.backward(); opt.step(); sched.step(); opt.zero_grad()

How it works. The model's parameters are cut into units: one per block (the
classes the model names in ``_no_split_modules``, else the largest
``ModuleList`` or ``Sequential`` of one class, or those ``blocks=`` names),
one for the parameters used before the first block (embeddings) and one
for those after the last (final norm, head). A
tied parameter lives in one unit and every module that uses it holds that
unit. The fp32 master weights, AdamW moments and bf16 params live in the
engine (pinned DRAM or NVMe); the module's parameters hold nothing between
uses: read outside a forward or backward they are NaN of their shape
(``model.state_dict()`` fetches the values; ``gathered()`` shows them in the
parameters).

Hooks in the FSDP2 manner hold a unit while a module that uses it computes:
- forward: a pre-hook acquires the unit's bf16 params (prefetched by the
  runner in the learned order) and points each parameter at its slice; the
  post-hook lets go of them;
- backward: hooks on the module's outputs re-acquire the unit before its
  backward runs; an identity autograd function on its inputs lets go once
  the module's backward is done (activation checkpointing's recompute
  re-enters the forward pre-hook during backward; holds then do not depend on
  pre/post pairs);
- grads: each trainable parameter's post-accumulate-grad hook copies its
  grad into the unit's grad buffer and frees it; the unit's grads go to the
  engine (bf16) once its last trainable grad is in; units that got none push
  zeros at the end of backward. A unit called more than once (a shared
  layer) sums the grads one backward gives a parameter (one per reentrant
  checkpoint region) in fp32, rounding the sum to bf16 once.
``optimizer.step()`` marks the accumulation boundary: it sends each param
group's current lr and the boundary micro-step's last grads, and the engine
clips (global norm) and runs AdamW, publishing each unit as it is done, so
the next forward starts while the optimizer runs. After fewer backward
passes than ``grad_accumulation`` (an epoch's last window) it completes the
window with zero grads: the engine sums the micro-steps' grads, so the step
is the one on the sum of the passes' grads.
Floating-point buffers follow the compute dtype (a rotary embedding's
excepted); the others stay as they are.

Thread safety: one thread at a time drives a model: a forward, backward or
``optimizer.step()`` while another thread is inside a pass is refused. Errors:
ztier's errors (``ztier.ZtierError`` subclasses) with the engine's message;
misuse (``optimizer.step()`` with no backward pass since the last, a
training forward before the pending ``step()``, the backward of a forward
run before the last ``step()``, a trainable complex parameter) raises ``RuntimeError`` (``ValueError`` at ``offload``) naming the
fix.
"""

from __future__ import annotations

import atexit
import collections.abc
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import math
import numbers
import os
import re
import shutil
import sys
import threading
import time
import types
import uuid
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from ztier import _C

__all__ = ["AdamW", "Offload", "offload", "open_session", "from_pretrained", "find_blocks"]


# --------------------------------------------------------------- optimizer --


@dataclass
class AdamW:
    """The engine's AdamW (decoupled weight decay, PyTorch's formulas).

    The defaults are DeepSpeed's (weight_decay 0.0); torch.optim.AdamW's
    default weight_decay is 0.01: name it when porting code that relies on
    torch's default.

    ``no_decay``: parameters whose state-dict name contains any of these
    substrings (case-insensitive) get weight decay 0 (their own param group).
    Frozen parameters (``requires_grad=False``) are never updated.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: Sequence[str] = ()
    bias_correction: bool = True
    mode: str = "adamw"  # or "adam" (L2 decay)

    def __post_init__(self):
        # One pattern given as a string is that pattern, not its letters
        # (which nearly every name contains: nothing would be decayed).
        if isinstance(self.no_decay, str):
            self.no_decay = (self.no_decay,)
        if self.no_decay is None:
            self.no_decay = ()
        try:
            self.no_decay = tuple(self.no_decay)
        except TypeError:
            raise TypeError(f"ztier: AdamW no_decay takes name substrings, got "
                            f"{self.no_decay!r}") from None
        if not all(isinstance(s, str) for s in self.no_decay):
            raise TypeError(f"ztier: AdamW no_decay takes name substrings, got {self.no_decay!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, numbers.Real) for b in betas):
            raise ValueError(f"ztier: AdamW betas must be two numbers, got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        if self.mode not in ("adamw", "adam"):
            raise ValueError(f"ztier: AdamW mode must be 'adamw' or 'adam', got {self.mode!r}")
        for what in ("lr", "eps", "weight_decay"):
            v = getattr(self, what)
            if not _is_number(v):
                raise TypeError(f"ztier: AdamW {what} must be a number, got "
                                f"{type(v).__qualname__} {v!r}")
        # The engine keeps lr, eps and weight decay in fp32: a value it
        # cannot hold would reach it as inf or 0, and be refused as that.
        for what in ("lr", "eps", "weight_decay"):
            _check_fp32(f"AdamW {what}", getattr(self, what))


# torch.optim.AdamW's arguments that ztier's has not, and what a true value
# of one asks for (a false one, or None, asks for nothing: taken, as code
# ported from torch may name them).
_TORCH_ADAMW_ONLY = {
    "amsgrad": "AMSGrad (a running max of v), which the engine's AdamW does not keep",
    "maximize": "ascent on the objective; negate the loss instead",
    "foreach": "one of torch's kernels; the engine runs its own",
    "fused": "one of torch's kernels; the engine runs its own",
    "capturable": "CUDA graph capture of torch's step; the engine runs the step",
    "differentiable": "autograd through torch's step; the engine runs the step",
}
_adamw_init = AdamW.__init__


@functools.wraps(_adamw_init)
def _adamw_init_taking_torch_defaults(self, *args, **kwargs):
    # torch.optim.AdamW(model.parameters(), lr=...) ported as it is: the
    # parameters bound to lr ("multiple values for argument 'lr'"), and
    # torch's fifth positional, amsgrad, to no_decay ("'bool' object is not
    # iterable").
    if args and not isinstance(args[0], numbers.Real):
        raise TypeError(
            "ztier: AdamW takes no parameters (torch.optim.AdamW's first argument): "
            "zt.offload(model, optimizer=zt.AdamW(lr=...)) applies it to the model's (no_decay "
            "names those without weight decay)")
    if len(args) > 4:
        raise TypeError(
            f"ztier: AdamW takes lr, betas, eps and weight_decay by position, the rest by name "
            f"({len(args)} given by position; torch's fifth is amsgrad, this one's no_decay)")
    for name, why in _TORCH_ADAMW_ONLY.items():
        value = kwargs.pop(name, None)
        if value:
            raise TypeError(f"ztier: AdamW has no {name}={value!r}: {why}; leave it out (a "
                            "false value, asking for nothing, is taken)")
    _adamw_init(self, *args, **kwargs)


AdamW.__init__ = _adamw_init_taking_torch_defaults


class _Optimizer(torch.optim.Optimizer):
    """The optimizer a user (or Trainer, or an LR scheduler) drives.

    ``step()`` ends the accumulation window: each group's ``lr`` is sent to the
    engine, which runs the update. ``zero_grad()`` drops the grads of the
    window so far, as torch's does: they left the parameters when they
    reached the engine, so the engine's pending step is dropped (refused once
    the window's last backward is done: the update has begun then).
    """

    # torch.amp.GradScaler then hands step() its scale (grad_scale) instead
    # of looking for grads on the parameters (they went to the engine).
    _step_supports_amp_scaling = True

    def __init__(self, owner: "Offload", groups: list[dict]):
        self._owner = owner
        self._constructing = True
        defaults = dict(lr=owner._adamw.lr, betas=owner._adamw.betas, eps=owner._adamw.eps,
                        weight_decay=owner._adamw.weight_decay)
        super().__init__(groups, defaults)
        self._constructing = False
        # What the engine was given and keeps: only lr goes with each step.
        self._fixed = [{k: g[k] for k in _FIXED_KEYS} for g in self.param_groups]
        self._warned: set[tuple[int, str]] = set()

    def add_param_group(self, param_group):
        if not self._constructing:
            raise RuntimeError(
                "ztier: add_param_group after offload(): the engine's param groups are fixed "
                "when the model is offloaded (its tensors' units and groups are laid out then); "
                "offload a model with every parameter in it instead")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        if hasattr(self, "grad_scale"):  # GradScaler.step(optimizer)
            del self.grad_scale
            if hasattr(self, "found_inf"):
                del self.found_inf
            self._owner._discard_step("a GradScaler's step")
            raise RuntimeError(
                "ztier: a GradScaler (loss scaling) with an offloaded model: its grads reached "
                "the engine scaled, and the engine takes true grads; no step was taken (its "
                f"grads were discarded: the model is as after step {self._owner.step_count}). "
                "Loss scaling is for fp16 compute: ztier computes in bf16 or fp32, whose range "
                "needs none; drop the GradScaler")
        self._check_lrs()  # before a closure's forward and backward
        self._check_supported()
        self._owner._refuse_step_in_gathered()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._check_lrs(after_closure=True)
        for i, (g, fixed) in enumerate(zip(self.param_groups, self._fixed)):
            for k in _FIXED_KEYS:
                if _differs(g[k], fixed[k]) and (i, k) not in self._warned:
                    self._warned.add((i, k))
                    warnings.warn(
                        f"ztier: param group {i}'s {k} changed to {g[k]!r}, but the engine takes "
                        f"only lr with each step: it keeps {k}={fixed[k]!r} (set it in "
                        f"zt.AdamW(...) when offloading)", RuntimeWarning,
                        stacklevel=_user_stacklevel())
        lrs = [float(g["lr"]) for g in self.param_groups]
        with _interrupts_deferred():
            self._owner._optimizer_step(lrs)
        return loss

    def _check_lrs(self, after_closure=False):
        """ValueError for a learning rate the engine refuses (NaN, inf,
        negative), before anything of the step is done: the step's grads stay
        with the engine, so the same step() with a good lr goes on."""
        for i, g in enumerate(self.param_groups):
            lr = float(g["lr"])
            if not (math.isfinite(lr) and lr >= 0):
                raise ValueError(
                    f"ztier: param group {i}'s lr is {lr!r}; it must be finite and >= 0 (a "
                    "scheduler or a hand-set param_groups[...]['lr']?). No step was taken, and "
                    "the grads of the backward passes since the last one are kept: set a good "
                    "lr and call optimizer.step() again" +
                    (" without the closure (its backward ran)" if after_closure else ""))

    def _check_supported(self):
        """ValueError for an option of torch's AdamW that changes the update
        and that the engine lacks (a state dict loaded from one, a group set
        by hand): before a training forward, so no grads of it go out, and
        at step(), before the step (one set between the backward and the
        step was taken without it; the grads then wait for a step)."""
        for i, g in enumerate(self.param_groups):
            for k in _UNSUPPORTED_KEYS:
                if g.get(k):
                    raise ValueError(
                        f"ztier: param group {i} has {k}={g[k]!r}, which the engine's AdamW does "
                        "not do (it minimizes, with plain AdamW moments); set it to False (a "
                        f"state dict of torch's AdamW(..., {k}=True) cannot be continued here)")

    def zero_grad(self, set_to_none: bool = True):
        owner = self._owner
        # (A backward phase with no backward running is one that raised.)
        in_backward = torch._C._current_graph_task_id() != -1
        if owner.job is not None and not in_backward and owner._grads_sent():
            owner._zero_grad()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self):
        # The moments live in the engine (saved by Offload.save_checkpoint);
        # this keeps what schedulers and Trainer look at.
        return {"state": {}, "param_groups": [
            {k: v for k, v in g.items() if k != "params"} | {"params": []}
            for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        """The param groups' settings (lr, as a scheduler left them) from a
        state dict this optimizer made; the moments come from
        Offload.load_checkpoint."""
        if state_dict.get("state"):
            raise ValueError(
                f"ztier: this optimizer state dict holds moments of {len(state_dict['state'])} "
                "parameters (another optimizer's, such as torch.optim.AdamW): the engine's "
                "moments come only from a ztier checkpoint (Offload.load_checkpoint); to take "
                "its param groups' settings alone, pass {'state': {}, 'param_groups': ...}")
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"ztier: the state dict has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)} (the offloaded model's decay and no-decay groups)")
        for g, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v


_FIXED_KEYS = ("betas", "eps", "weight_decay")
# torch's AdamW options that change the update, which the engine lacks.
_UNSUPPORTED_KEYS = ("maximize", "amsgrad")


def _differs(a, b) -> bool:
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return tuple(float(x) for x in a) != tuple(float(x) for x in b)
    return float(a) != float(b)


# ------------------------------------------------------------------- units --


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in registration order: modules whose class
    the model names in ``_no_split_modules`` (Hugging Face), outermost only;
    else the children of the largest ``ModuleList`` or ``Sequential`` (the
    model itself included) whose children, two or more, are all of one
    class. Empty when neither exists (the model is then one unit). A child
    that is itself a ModuleList or ModuleDict (a UNet's stages, each a list
    of blocks) is never called, so its modules are the blocks."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[tuple[str, nn.Module]] = []
    if names:
        inside: set[int] = set()
        for name, m in model.named_modules():
            if id(m) in inside:
                continue
            if type(m).__name__ in names:
                blocks.append((name, m))
                inside.update(id(s) for s in m.modules())
    if blocks:
        return blocks
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        # A ModuleList of one block counts (a model built with n_layers=1);
        # a Sequential of one module is a wrapper, not a stack, and one of
        # modules without parameters (activations) holds no block.
        stack = isinstance(m, nn.ModuleList) and len(m) > 0
        if isinstance(m, nn.Sequential) and len(m) > 1:
            stack = any(True for _ in m.parameters())
        if stack:
            kinds = {type(c) for c in m}
            size = sum(p.numel() for p in m.parameters())
            if len(kinds) == 1 and (best is None or size > best[0]):
                best = (size, name, m)
    if best is None:
        return []
    # A module listed more than once (one layer shared, ALBERT-style) is
    # one block, under its first name.
    seen: set[int] = set()
    out = []

    def take(prefix: str, stack: nn.Module):
        for key, c in stack.named_children():
            if _never_called(c):
                take(f"{prefix}{key}.", c)
            elif isinstance(c, _PARAM_CONTAINERS):
                continue  # read by the module that holds it, not called: no block
            elif id(c) not in seen:
                seen.add(id(c))
                out.append((prefix + key, c))

    take(f"{best[1]}." if best[1] else "", best[2])
    return out


def _resolve_blocks(model: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """offload(blocks=...): None, find_blocks(model); else the submodules
    listed (names or modules), in the model's order; [] makes the model one
    unit. ValueError for one not in the model, the model itself, or one
    inside another."""
    if blocks is None:
        return find_blocks(model)
    if isinstance(blocks, (str, nn.Module)) or not isinstance(blocks, Iterable):
        raise TypeError(f"ztier: blocks= takes a list of submodules or their names (or [] for "
                        f"one unit), got {type(blocks).__name__}")
    named = dict(model.named_modules())
    name_of = {id(m): n for n, m in reversed(list(named.items()))}  # first name of a shared one
    out: list[tuple[str, nn.Module]] = []
    listed: set[int] = set()  # (sets: a list of 2,000 blocks took 22 s in pairs)
    for b in blocks:
        if isinstance(b, str):
            if b not in named:
                raise ValueError(f"ztier: blocks= names '{b}', which is no submodule of the model")
            m = named[b]
        elif isinstance(b, nn.Module):
            if id(b) not in name_of:
                raise ValueError(f"ztier: blocks= lists a {type(b).__name__} that is not in the "
                                 "model")
            m = b
        else:
            raise TypeError(f"ztier: blocks= takes submodules or their names, got "
                            f"{type(b).__name__}")
        if m is model:
            raise ValueError("ztier: blocks= lists the model itself; blocks=[] makes it one unit")
        if _never_called(m):
            inner = [f"'{name_of[id(m)]}.{k}'" for k, _ in list(m.named_children())[:2]]
            raise ValueError(
                f"ztier: blocks= lists '{name_of[id(m)]}', a {type(m).__name__}, which is never "
                "called (its modules are): its parameters would be fetched for no forward and "
                f"read as NaN; list its modules instead ({', '.join(inner + ['...'])})")
        if id(m) not in listed:
            listed.add(id(m))
            out.append((name_of[id(m)], m))
    for n, m in out:
        for s in m.modules():
            if s is not m and id(s) in listed:
                raise ValueError(f"ztier: blocks= lists '{name_of[id(s)]}', which is inside "
                                 f"'{n}': a block holds all of its parameters")
    order = {id(m): i for i, m in enumerate(named.values())}
    return sorted(out, key=lambda b: order[id(b[1])])


@dataclass
class _Tensor:
    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    numel: int
    offset: int = 0
    group: int = 0
    frozen: bool = False
    # Its own NaN placeholder (a write to one must not show in others), and
    # the parameter's version when it was last pointed at it: a later one
    # means something wrote to the parameter outside the hooks.
    placeholder: torch.Tensor | None = None
    idle_version: int = -1
    # The parameter's version when it was pointed at its unit's values: a
    # later one when the unit is let go means the forward wrote to it.
    held_version: int = -1
    # The id of its post-accumulate-grad hook (_grad_in), kept after the
    # user's own (_grad_hooks_last).
    grad_hook: int = -1


@dataclass
class _Unit:
    name: str
    tensors: list[_Tensor] = field(default_factory=list)
    index: int = 0
    numel: int = 0
    padded: int = 0
    holds: int = 0
    storage: torch.UntypedStorage | None = None  # the held bf16 params (empty when not held)
    grads: torch.Tensor | None = None  # the grad buffer, once a grad arrived
    arrived: set = field(default_factory=set)  # ids of params whose grad is in
    # A unit called more than once (below) keeps each parameter's first grad
    # of a backward as it came, {param id: (tensor, grad)}, until a second
    # one comes or the unit is pushed; a second one sums them into `acc`
    # (fp32, the unit's padded size), made then: each grad is rounded to
    # bf16 once, from the sum (reentrant checkpoint regions each give one).
    held: dict = field(default_factory=dict)
    acc: torch.Tensor | None = None
    trainable: int = 0
    _pushed: bool = False
    # [units pushed], shared by the model's units: the last unit of a
    # boundary is found without counting them all at each push (quadratic:
    # 1.5 s of a 5 s step at 3,000 units).
    tally: list = field(default_factory=lambda: [0])
    # Its grads went to the runner this micro-step (a deferred unit is
    # `pushed` before it is sent, at optimizer.step()).
    sent: bool = False
    # Module calls holding it in this training forward: a unit called more
    # than once (a shared layer) may get its grads in several rounds (one per
    # reentrant checkpoint region), so it goes to the engine at the end of
    # backward instead of when its grads first are all in.
    calls: int = 0
    # Inside gathered(): the unit's copy, which its parameters show whenever
    # no forward holds it (a forward inside lets go back to it).
    gathered: torch.Tensor | None = None

    @property
    def pushed(self) -> bool:
        """Its grads of the micro-step are handed over (or deferred)."""
        return self._pushed

    @pushed.setter
    def pushed(self, value: bool):
        if value != self._pushed:
            self.tally[0] += 1 if value else -1
            self._pushed = value


# The runner's kinds of pass (Runner.set_order), each with its learned order.
_TRAIN, _EVAL, _GATHER = 0, 1, 2


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's
    backward has produced the inputs' grads (the module is then done)."""

    @staticmethod
    def forward(ctx, owner, call, *inputs):
        # Weakly: a loss kept alive (a loop's last `loss`) holds the graph,
        # which must not hold the Offload and its engine job.
        ctx.owner = weakref.ref(owner)
        ctx.call = call  # (module id, call number)
        # Detached, not the inputs themselves: autograd makes an input
        # returned as it is a view made in a custom Function, which refuses
        # in-place writes (a block's x.mul_(gamma), ReLU(inplace=True)). A
        # detached tensor shares the input's storage and version counter
        # (torch's checks of saved tensors see such a write), but not its
        # history: the caller's tensor does not get the write's, which
        # _post_forward warns of.
        out = tuple(t.detach() for t in inputs)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        owner = ctx.owner()
        if owner is not None:
            owner._post_backward(ctx.call)
        return (None, None) + grads


class _PreBackward(torch.autograd.Function):
    """Identity on a module's output that is a view; its backward runs when
    the output's grad arrives (the module's backward begins). A grad hook on
    such a view is lost when the caller writes to it in place (h += r: torch
    makes the view's grad_fn anew), and the module's backward then read
    weights it never fetched. This node's output is no view, so the write
    comes after it in the graph."""

    @staticmethod
    def forward(ctx, owner, call, output):
        ctx.owner = weakref.ref(owner)
        ctx.call = call
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner()
        if owner is not None:
            grad = owner._pre_backward(ctx.call, grad)
        return None, None, grad


def _pre_backward_hook(owner_ref, call, grad):
    """An output's grad hook: the module's backward begins. It holds the
    Offload weakly (the graph may outlive it)."""
    owner = owner_ref()
    return None if owner is None else owner._pre_backward(call, grad)


def _placeholder(shape, device, dtype=torch.bfloat16) -> torch.Tensor:
    # An expanded NaN scalar: reads as NaN of the right shape, takes no
    # memory, and survives torch.save / CPU reads (a zero-byte storage does not).
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


def _parse_device(device) -> torch.device:
    d = torch.device(device)
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"ztier: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


class Offload:
    """A model put on ztier by :func:`offload`; see the module's docstring."""

    def __init__(self, model: nn.Module, *, device="cpu", optimizer: AdamW | None = None,
                 clip_grad_norm: float | None = None, grad_accumulation: int | None = None,
                 states: str | None = None, params: str | None = None,
                 prefetch_depth: int | None = None, config: str | None = None,
                 daemon: str | None = None, settings: dict | None = None,
                 name: str | None = None, session: _C.Session | None = None,
                 weights: str | None = None, compute_dtype: torch.dtype | None = None,
                 average_grads: bool = False, cast_inputs: bool = True, blocks=None):
        self.rank, self.world_size = _distributed()
        try:
            _check_argument_types(settings=settings, name=name, daemon=daemon,
                                  prefetch_depth=prefetch_depth, clip_grad_norm=clip_grad_norm,
                                  config=config, weights=weights)
            grad_accumulation = self._take_arguments(model, optimizer, grad_accumulation, weights,
                                                     device, compute_dtype, cast_inputs)
        except BaseException as e:
            # The other ranks are on their way to meet this one (_meet_ranks):
            # told, rather than left waiting in gloo's collective for good.
            if self.world_size > 1:
                _tell_ranks_it_failed(e, self.rank, self.world_size)
            raise
        compute_dtype = self.compute_dtype
        self._hosted = None
        self._daemon_has_settings = False  # _meet_ranks: the hosted ztierd has ours
        name = name or f"{type(model).__name__}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        launch = 0
        if self.world_size > 1:
            daemon, name, launch = self._meet_ranks(daemon, session, config, settings, name)
        self._launch = launch
        self._rank0_calls = {}  # (call, version) -> how many; _by_rank0's keys
        # What each rank does alone, up to the registration: a failure on one
        # rank is told to the others (which would wait in the next collective
        # for it), and so are the settings every rank must be given alike.
        try:
            # The engine steps on the sum of the ranks' grads; with average_grads
            # each rank's grads are divided by the world size first (DDP's mean).
            self._grad_divisor = self.world_size if average_grads else 1
            self.session = session or open_session(
                config=config, settings=settings, daemon=daemon,
                daemon_has_these_settings=self._daemon_has_settings)
            # What the arguments leave unset comes from the config's (or the
            # ZTIER_* variables') optimizer, gradient_clipping and
            # gradient_accumulation_steps, else the defaults.
            training = self.session.training
            self._adamw = optimizer or _adamw_from(training)
            if grad_accumulation is None:
                grad_accumulation = _accumulation_from(training, self.world_size)
            if training.get("activation_checkpointing"):
                warnings.warn("ztier: activation_checkpointing in the config does nothing here: "
                              "checkpoint activations in the model (torch.utils.checkpoint)",
                              RuntimeWarning, stacklevel=3)
            if clip_grad_norm is None:
                clip_grad_norm = training.get("clip_norm", 0.0)
            self.grad_accumulation = int(grad_accumulation)
            self.clip_grad_norm = float(clip_grad_norm or 0.0)
            if self.clip_grad_norm == math.inf:
                self.clip_grad_norm = 0.0  # as torch's clip_grad_norm_(max_norm=inf): no clipping
            states = states or self.session.default_optimizer_tier
            params = params or self.session.default_param_tier
            # Buffers on the meta device have no values and no storage for
            # weights= to load a persistent one into (torch's "Cannot copy
            # out of meta tensor" as they were placed).
            meta = [f"{m}.{n}" if m else n for m, mod in model.named_modules()
                    for n, b in mod._buffers.items() if b is not None and b.is_meta]
            if meta:
                raise ValueError(
                    f"ztier: {len(meta)} buffers are on the meta device (no values), e.g. "
                    f"'{meta[0]}': materialize the model first (its buffers too), build it with "
                    "only its parameters on meta (accelerate's init_empty_weights() leaves "
                    "buffers real) and give weights=, or load it with zt.from_pretrained")
            if weights is not None and any(p.is_meta for p in model.parameters()):
                # Built on the meta device for weights from a file (as
                # from_pretrained does): its meta parameters become
                # placeholders (set_data of a meta parameter failed inside
                # torch); the others stay as they are.
                from ztier import hf
                hf._empty_parameters(model, only_meta=True)
            self._build_units(model, _resolve_blocks(model, blocks))
            if weights is None:
                meta = [t.name for u in self.units for t in u.tensors if t.param.is_meta]
                if meta:
                    raise ValueError(
                        f"ztier: {len(meta)} parameters are on the meta device (no values), e.g. "
                        f"'{meta[0]}': materialize the model first, or load its weights with "
                        "zt.from_pretrained (or give weights=)")
            groups = self._groups(model)
            job_units = [(u.name, [(t.name, list(t.shape), t.group, t.frozen) for t in u.tensors])
                         for u in self.units]
            a = self._adamw
            self._group_decay = [g["weight_decay"] for g in groups]
            cfg = _C.OptimizerConfig(lr=a.lr, beta1=a.betas[0], beta2=a.betas[1], eps=a.eps,
                                     weight_decay=a.weight_decay, mode=a.mode,
                                     bias_correction=a.bias_correction,
                                     group_weight_decay=self._group_decay,
                                     clip_norm=self.clip_grad_norm,
                                     grad_accumulation=self.grad_accumulation)
            try:
                name.encode("utf-8")
            except UnicodeEncodeError as e:  # a surrogate-escaped str (os.fsdecode of raw bytes)
                raise ValueError(
                    f"ztier: the job name {name!r} is not UTF-8 text (character {e.start} is a "
                    "stand-in for a byte that is not UTF-8); give a name of UTF-8 text") from None
            self.name = name
        except BaseException as e:
            try:
                self._ranks_agree("could not offload its model", e)
            except BaseException:  # noqa: BLE001 -- the peers are gone too: this error is raised
                pass
            finally:
                self._abandon()
            raise
        self._ranks_agree("could not offload its model", None, on_failure=self._abandon, alike={
            "prefetch_depth": (prefetch_depth if prefetch_depth is not None
                               else self.session.prefetch_depth),
            "max_live_bytes (stage3_max_live_parameters)": self.session.max_live_bytes,
            "persistence_threshold (stage3_param_persistence_threshold)":
                self.session.persistence_threshold,
            "coalesce_bytes (ZTIER_COALESCE_BYTES)": self.session.coalesce_bytes,
            "average_grads": bool(average_grads),
            "compute_dtype": str(self.compute_dtype),
            "device type": self.device.type,
        })
        # Rank 0 registers, then the others attach with its launch: a rank
        # never waits for a registration that failed, nor joins another
        # launch's job of the same name.
        def register():
            self.job = self.session.register_model(self.name, job_units, cfg, states, params,
                                                   self.world_size, launch=launch)

        def attach():  # rank 0's registration, joined
            self.job = self.session.attach_model(self.name, job_units, cfg, states, params,
                                                 self.world_size, self.rank,
                                                 self.session.wait_timeout, launch=launch)

        self._together("could not register the model", register if self.rank == 0 else None)
        self._together("could not join the job", attach if self.rank != 0 else None)
        # What taking the model over changes in it, put back if it fails
        # midway (a buffer that cannot move, weights that do not load, an
        # interrupt) here or on another rank: the model as it was, not NaN
        # placeholders that a second offload takes for weights.
        kept = [(t.param, t.param.data, t.param.grad) for u in self.units for t in u.tensors]
        kept += [(p, p.data, p.grad) for p in model.parameters() if id(p) not in self._tensor_of]
        kept_buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()]
        self._collectives = None
        self.runner = None
        self._hooks = []
        # Where this rank is: a failure is told to the other ranks once, at
        # the agreement that part ends with (``told``: it was).
        stage, told = "could not load the model's weights", False
        try:
            for u in self.units:
                numel, padded, _, offsets = self.job.layout(u.index)
                u.numel, u.padded = numel, padded
                for t, off in zip(u.tensors, offsets):
                    t.offset = off
            # Initial weights: the module's own values (fp32 masters), one
            # unit at a time, unless they come from a file (from_pretrained).
            if self.rank != 0:
                pass  # rank 0 sets the weights, as DDP broadcasts rank 0's
            elif weights is None:
                for u in self.units:
                    flat = torch.empty(u.numel, dtype=torch.float32)
                    for t in u.tensors:
                        flat[t.offset:t.offset + t.numel] = \
                            t.param.detach().reshape(-1).float().cpu()
                    self.job.set_weights(u.index, flat)
            else:
                self._load_weights(weights)
            if weights is not None:
                from ztier import hf
                hf.load_buffers(self, weights)  # every rank: each module has its own
            # (The runner waits for rank 0's weights: a rank whose weights
            # failed must be told of before.)
            told = True
            self._ranks_agree(stage, None)
            stage, told = "could not take its model over", False
            if self.device.type == "cuda":
                self._device = _C.cuda_device(self.device.index)
            else:
                self._device = _C.host_device()
            self._prefetch = (prefetch_depth if prefetch_depth is not None
                              else self.session.prefetch_depth)
            self.runner = self._make_runner()
            self._take_over(model, groups)
            told = True
            self._ranks_agree(stage, None)
        except BaseException as e:
            if not told:
                try:
                    self._ranks_agree(stage, e)
                except BaseException:  # noqa: BLE001 -- the peers are gone too: this error is raised
                    pass
            self._remove_hooks()
            for m, n, b in kept_buffers:
                m._buffers[n] = b
            for p, data, grad in kept:
                p.data = data
                p.grad = grad
                owner = getattr(p, "_ztier_owner", None)
                if owner is not None and owner() is self:
                    del p._ztier_owner
            marker = getattr(model, "_ztier_offload", None)
            if marker is not None and marker() is self:
                model._ztier_offload = None
            _live_offloads.discard(self)
            self._drop_runner()
            self._collectives = None
            self._abandon()
            raise

    def _abandon(self):
        """Lets go of the job, the session and a hosted ztierd, for an
        __init__ that fails: the engine goes with the last model of this
        process using it (a traceback that keeps this object must not keep
        the swap directories locked from a retry, nor the job registered)."""
        self.job = None
        self.session = None
        if self._hosted is not None:
            self._hosted.close()

    def _take_over(self, model: nn.Module, groups: list[dict]):
        """The model's parameters become placeholders, its buffers move to
        the device, and the hooks go in (the end of __init__)."""
        for u in self.units:
            for t in u.tensors:
                self._park(t)
                t.param.grad = None
        self._place_buffers(model)
        for p in model.parameters():  # those it keeps as they are (an index table)
            if id(p) not in self._tensor_of and p.device != self.device:
                p.data = p.data.to(self.device)
        self._gathering = 0  # gathered() blocks open
        self._phase = "idle"  # idle | forward | backward
        self._micro = 0  # backward passes since the last optimizer step
        self._awaiting_step = False
        self._deferred: list[_Unit] = []
        self._fwd_held: list[int] = []  # modules inside their forward
        # The thread of the latest pass or step: one thread at a time drives
        # the model (the hooks' state is the model's, not a thread's).
        self._pass_thread: int | None = None
        self._in_forward = False  # a root forward began and has not returned
        self._thread_lock = threading.Lock()
        # Backward holds are per call of a module, (module id, call number):
        # a module called several times in one forward (a shared layer) is
        # held for each call's backward.
        self._calls: dict[int, list[int]] = {}  # module id: its calls inside their forward
        # Per call inside its forward: the inputs as the module got them
        # (_PostBackward's outputs) and their versions then.
        self._input_versions: dict[tuple[int, int], list] = {}
        self._inplace_warned: set[type] = set()
        self._output_checked = False  # the first training forward's (_check_first_output)
        self._first_step_checked = False  # _check_first_step
        self._nan_warned = False  # either said why inf/NaN came
        self._began_in_checkpoint = False  # _begin_forward
        # Tensors modules kept on themselves in a forward, hooked once each.
        self._kept_hooked: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Per call inside its training forward: autograd's sequence number
        # at its start and the containers its arguments passed in
        # (_hook_side_outputs).
        self._side_places: dict[tuple[int, int], tuple[int, list]] = {}
        self._sequence_probe = torch.zeros((), requires_grad=True)
        self._own_modules_of: dict[int, list] = {}  # _own_modules
        # A recompute (activation checkpointing) and the backward hook of the
        # forward's call of the same module come in either order: each
        # module's backward holds that no recompute has met yet, and the
        # recompute holds that no backward hook has taken over yet. Whichever
        # comes second shares the first one's hold (units are counted holds).
        self._unmatched: dict[int, list[tuple[int, int]]] = {}
        self._unadopted: dict[int, list[tuple[int, int]]] = {}
        self._training_forward = False
        self._next_call = 0
        self._first_call = 0  # the first call after the last optimizer step
        self._bwd_held: set[tuple[int, int]] = set()
        self._post_done: set[tuple[int, int]] = set()
        self._callback_queued = False
        self._sd_values = None  # units fetched for the state_dict() being made
        self._warned_keep_vars = False  # state_dict(keep_vars=True) said once
        self._known_params = {id(p): n for n, p in model.named_parameters()}
        self._install_hooks(model)
        self.optimizer = _Optimizer(self, groups)
        model._ztier_offload = weakref.ref(self)
        _live_offloads.add(self)  # closed at exit if still open
        self._clip_warned = False
        _watch_clip_grad_norm()
        _watch_clip_grad_value()
        _watch_foreign_optimizers()
        for u in self.units:
            for t in u.tensors:
                t.param._ztier_owner = weakref.ref(self)
        # Forward passes of hooked modules run again inside backward
        # (activation checkpointing's recompute).
        self.recomputes = 0

    # ---- construction

    def _build_units(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]):
        owner: dict[int, int] = {}
        names: dict[int, str] = {}
        for pname, p in model.named_parameters():  # first name of a tied param
            names[id(p)] = pname
        units: list[_Unit] = []
        block_of: dict[int, int] = {}
        order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        first_block = order[id(blocks[0][1])] if blocks else None
        # Units in forward order: embeddings (before the first block), blocks,
        # the rest (after it). Without blocks the model is one unit.
        embed, head = _Unit("embed"), _Unit("head")
        block_units = []
        for bname, b in blocks:
            u = _Unit(bname)
            for p in b.parameters():
                if id(p) not in owner:
                    owner[id(p)] = -1
                    # A parameter of no elements, or not of floating point
                    # (an index table), holds nothing to offload or train:
                    # it stays as it is.
                    if _offloadable(p):
                        u.tensors.append(_Tensor(names[id(p)], p, tuple(p.shape), p.numel()))
            block_units.append(u)
            for m in b.modules():
                block_of[id(m)] = len(block_units) - 1
        for mname, m in model.named_modules():
            if id(m) in block_of:
                continue
            for p in m._parameters.values():
                if p is None or id(p) in owner:
                    continue
                owner[id(p)] = -1
                if not _offloadable(p):
                    continue
                target = embed if first_block is not None and order[id(m)] < first_block else head
                target.tensors.append(_Tensor(names[id(p)], p, tuple(p.shape), p.numel()))
        for u in [embed, *block_units, head]:
            # A unit's frozen tensors (requires_grad False: a LoRA model's base
            # weights) go to a unit of their own, for which the engine keeps
            # no optimizer moments.
            frozen = [t for t in u.tensors if not t.param.requires_grad]
            parts = [u]
            if frozen and len(frozen) < len(u.tensors):
                u.tensors = [t for t in u.tensors if t.param.requires_grad]
                parts.append(_Unit(f"{u.name}.frozen", frozen))
            for part in parts:
                if part.tensors:
                    part.index = len(units)
                    units.append(part)
        if not units:
            raise ValueError("ztier: the model has no parameters")
        self.units = units
        tally = [0]
        for u in units:
            u.tally = tally
        self._unit_of: dict[int, _Unit] = {}
        self._tensor_of: dict[int, _Tensor] = {}
        for u in units:
            for t in u.tensors:
                self._unit_of[id(t.param)] = u
                self._tensor_of[id(t.param)] = t
            u.trainable = sum(1 for t in u.tensors if t.param.requires_grad)
        # The modules to hook and the units each one holds: every block, and
        # every other module with parameters of its own (those of its
        # ParameterList / ParameterDict children included: the containers
        # are never called, the module that owns one reads them).
        self._module_units: dict[int, list[_Unit]] = {}
        self._hooked: list[nn.Module] = []
        # A module of a block registered outside every block too (one
        # projection the root and the blocks share) is called there: it is
        # hooked itself, holding its parameters' units (the root's call of
        # it read the placeholders, NaN, and every step was skipped).
        block_ids = {id(b) for _, b in blocks}
        also_outside: set[int] = set()
        todo = [model]
        while todo:
            for c in todo.pop().children():
                if id(c) not in block_ids and id(c) not in also_outside:
                    also_outside.add(id(c))
                    todo.append(c)
        for _, b in blocks:
            us = {self._unit_of[id(p)].index: self._unit_of[id(p)] for p in b.parameters()
                  if id(p) in self._unit_of}
            self._module_units[id(b)] = [us[k] for k in sorted(us)]
            self._hooked.append(b)
        for _, m in model.named_modules():
            shared = id(m) in block_of and id(m) in also_outside
            if (id(m) in block_of and not shared) or isinstance(m, _PARAM_CONTAINERS):
                continue
            own = list(m.parameters()) if shared else _own_params(m)
            if own:
                # A module below the root with no block inside also holds
                # its children's units: a module may read a child's weight
                # without calling it (nn.MultiheadAttention reads
                # out_proj.weight), and a child frozen apart from it is in
                # another unit (it read a placeholder: NaN).
                if m is not model and not any(id(c) in block_of for c in m.modules()):
                    own = list(m.parameters())
                us = {self._unit_of[id(p)].index: self._unit_of[id(p)] for p in own
                      if id(p) in self._unit_of}
                self._module_units[id(m)] = [us[k] for k in sorted(us)]
                self._hooked.append(m)

    def _place_buffers(self, model: nn.Module):
        """The module's buffers on the device, the floating-point ones in the
        compute dtype as the parameters are (model.to(dtype) casts them so):
        BatchNorm's running statistics and a positional table meet the
        activations in it. A rotary embedding's keep theirs
        (_keeps_buffer_dtype), as do the others (integer counters, masks).
        A buffer shared by several modules stays shared."""
        placed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id: (buffer, placed)
        # Each buffer as placed, (module, name, tensor): a cast of the model
        # refused at the next forward (.half(), .to(dtype)) casts them too,
        # and _check_idle_params puts them back (_put_buffers_back).
        self._placed_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is None:
                    continue
                if id(b) not in placed:
                    dtype = (self.compute_dtype if b.is_floating_point()
                             and not _keeps_buffer_dtype(m) else b.dtype)
                    placed[id(b)] = (b, b.to(device=self.device, dtype=dtype))
                m._buffers[name] = placed[id(b)][1]
                self._placed_buffers.append((m, name, placed[id(b)][1]))

    def _put_buffers_back(self, cast: bool) -> bool:
        """With ``cast`` (the parameters were cast: .half(), .to(dtype) or a
        device), each buffer of another dtype or device than as placed is
        put back as it was, its values untouched (a cast back rounded them):
        the model trains as before the refused cast (it trained with fp16
        buffers, or failed in BatchNorm). Otherwise a buffer the model
        replaced (a recomputed cache) is taken as it is now. Returns
        whether one was put back."""
        back = False
        for i, (m, name, b) in enumerate(self._placed_buffers):
            now = m._buffers.get(name)
            if now is b or now is None:
                continue
            if cast and (now.dtype != b.dtype or now.device != b.device):
                m._buffers[name] = b
                back = True
            else:
                self._placed_buffers[i] = (m, name, now)
        return back

    def _groups(self, model: nn.Module) -> list[dict]:
        a = self._adamw
        patterns = [s.lower() for s in a.no_decay]
        decay, no_decay = [], []
        for u in self.units:
            for t in u.tensors:
                if not t.param.requires_grad:
                    t.frozen = True
                    continue
                (no_decay if any(s in t.name.lower() for s in patterns) else decay).append(t)
        groups = []
        for tensors, wd in ((decay, a.weight_decay), (no_decay, 0.0)):
            if not tensors:
                continue
            for t in tensors:
                t.group = len(groups)
            groups.append(dict(params=[t.param for t in tensors], lr=a.lr, betas=a.betas,
                               eps=a.eps, weight_decay=wd))
        if not groups:
            raise ValueError("ztier: every parameter of the model is frozen (requires_grad=False)")
        return groups

    def _drop_runner(self):
        """Lets go of the runner and of every view of its buffers first: a
        unit's grad buffer left from a backward that raised kept the runner
        (and its claim on this rank) alive, so no new one could be made."""
        for u in self.units:
            u.grads = None
        self.runner = None

    def _make_runner(self):
        if self.world_size > 1 and self._collectives is None:
            self._collectives = _C.job_collectives(self.job, self.rank, self._device,
                                                   timeout=self.session.wait_timeout)
        return _C.Runner(self.job, self.rank, self._device, self._collectives,
                         prefetch_depth=self._prefetch,
                         max_live_bytes=self.session.max_live_bytes,
                         persistence_threshold=self.session.persistence_threshold,
                         coalesce_bytes=self.session.coalesce_bytes,
                         timeout=self.session.wait_timeout)

    def _take_arguments(self, model, optimizer, grad_accumulation, weights, device,
                        compute_dtype, cast_inputs):
        """offload()'s arguments checked and taken (the module, the device,
        the compute dtype), before the ranks meet. Returns grad_accumulation
        (an int, or None: from the config)."""
        if not isinstance(model, nn.Module):
            what = (f"the class {model.__qualname__} (build the model first: offload(MyModel()))"
                    if isinstance(model, type) else
                    f"a {type(model).__module__}.{type(model).__qualname__}")
            raise TypeError(f"ztier: offload() takes a torch.nn.Module, got {what}")
        if optimizer is not None and not isinstance(optimizer, AdamW):
            what = (f"a {type(optimizer).__module__}.{type(optimizer).__qualname__}"
                    if not isinstance(optimizer, type) else f"the class {optimizer.__qualname__}")
            raise TypeError(f"ztier: optimizer= takes a ztier.torch.AdamW (its settings: lr, betas, "
                            f"eps, weight_decay, ...), got {what}; the engine runs the optimizer "
                            "itself: e.g. optimizer=zt.AdamW(lr=1e-4, weight_decay=0.01), and "
                            "after offload() use the model's .optimizer for torch's LR schedulers")
        if grad_accumulation is not None:
            if isinstance(grad_accumulation, bool) or not isinstance(
                    grad_accumulation, numbers.Integral) or grad_accumulation < 1:
                raise ValueError(f"ztier: grad_accumulation must be an int >= 1, got "
                                 f"{grad_accumulation!r}")
            grad_accumulation = int(grad_accumulation)
        if hasattr(model, "_ztier_offload"):
            if _offloaded(model):
                raise ValueError("ztier: this model is already offloaded (its parameters live in "
                                 "the engine); close() that Offload first, or offload a fresh model")
            if weights is None and _holds_placeholders(model):
                raise ValueError("ztier: this model was offloaded before, and its parameters are "
                                 "the placeholders that Offload left (NaN): offload a fresh model "
                                 "(then load_checkpoint to go on from a checkpoint)")
        # A part of an offloaded model, or a model holding an offloaded part:
        # the parameters are another Offload's (or the placeholders it left).
        for pname, p in model.named_parameters():
            ref = getattr(p, "_ztier_owner", None)
            if ref is None:
                continue
            other = ref()
            if other is not None and other.job is not None:
                t = other._tensor_of.get(id(p))
                if t is not None and t.param is p:
                    raise ValueError(
                        f"ztier: parameter '{pname}' is already offloaded, by the Offload of a "
                        f"{type(other.module).__name__} (a model holding this one, or held by "
                        "it): one Offload per parameter; offload the whole model once")
            elif weights is None and _is_placeholder(p):
                raise ValueError(
                    f"ztier: parameter '{pname}' was offloaded before, and holds the placeholder "
                    "that Offload left (NaN): offload a fresh model (then load_checkpoint to go "
                    "on from a checkpoint)")
        self.module = model
        self.device = _parse_device(device)
        # The params' dtype in the module: bf16 on a GPU; fp32 on the host,
        # whose CPUs mostly lack bf16 matrix units (PyTorch's bf16 CPU kernels
        # run an order of magnitude slower there). The values are the bf16
        # params either way, and grads go to the engine as bf16.
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ztier: compute_dtype must be torch.bfloat16 or torch.float32, "
                             f"got {compute_dtype}")
        self.compute_dtype = compute_dtype
        self._cast_inputs_on = bool(cast_inputs)
        # The engine keeps fp32 masters and publishes bf16 params: a model of
        # another floating type changes precision (a bf16 one does not).
        other = sorted({str(p.dtype) for p in model.parameters() if _offloadable(p)} -
                       {str(torch.float32), str(torch.bfloat16)})
        if other:
            warnings.warn(
                f"ztier: the model's parameters of {', '.join(other)} become fp32 master weights "
                f"in the engine and compute as bf16 values in {compute_dtype} (offload("
                "compute_dtype=): torch.bfloat16 or torch.float32); the floating-point inputs "
                "of its forward are cast to that", RuntimeWarning, stacklevel=4)
        for mname, m in model.named_modules():
            if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding,
                                                                      nn.EmbeddingBag)):
                raise ValueError(
                    f"ztier: '{mname or type(m).__name__}' is an embedding with sparse=True: its "
                    "grads are sparse tensors, and the engine takes dense ones; offload it with "
                    "sparse=False")
        # A complex parameter is no floating-point one: a frozen one stays in
        # the module (as an index table does); a trainable one would never
        # be trained.
        self._complex = [(n, p) for n, p in model.named_parameters() if p.is_complex()]
        for pname, p in self._complex:
            if p.requires_grad:
                raise ValueError(_complex_trainable(pname, p, "is complex"))
        self._elem_bytes = torch.empty((), dtype=compute_dtype).element_size()
        return grad_accumulation

    def _meet_ranks(self, daemon, session, config, settings, name):
        """World size > 1 (torch.distributed, one process per rank, one node):
        the ranks share one engine through ztierd, rank 0 registering the
        model and the others attaching. Without a ztierd named (``daemon``,
        ZTIER_DAEMON_SOCKET), rank 0 hosts one (HostedDaemon) on a socket of
        its own, for this job. Returns (daemon socket, job name, launch),
        agreed on by every rank: the launch is rank 0's draw, which the
        others attach with, so that a rank of another launch using the same
        ``name`` on that ztierd is refused, not joined to this one."""
        import tempfile

        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if local != self.world_size:
            raise NotImplementedError(
                f"ztier.torch: {self.world_size} ranks on several nodes ({local} on this one); "
                "ranks of one node only for now")
        daemon = daemon or os.environ.get("ZTIER_DAEMON_SOCKET") or None
        text = _settings_text(settings)
        where = os.fspath(config) if config else None
        info = [daemon, name, None, int.from_bytes(os.urandom(8), "little") | 1, None]
        error = None
        if self.rank == 0 and daemon is None and session is None:
            directory = None
            try:
                _remove_stale_hosted_dirs(tempfile.gettempdir())
                directory = tempfile.mkdtemp(prefix="ztier-")
                info[0] = os.path.join(directory, "ztierd.sock")
                self._hosted = _HostedDaemon(_C.HostedDaemon(info[0], where, text), directory)
                _hosted_daemons.append(self._hosted)
                info[2] = (where, text)  # what the hosted daemon was made with
            except BaseException as e:  # noqa: BLE001 -- told to the other ranks, then raised
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                error = e
                info[4] = ("could not start its ztierd", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(info, src=0)
        if error is not None:
            raise error
        if info[4] is not None:
            raise RuntimeError(f"ztier: rank 0 {info[4][0]}: {info[4][1]}")
        # A rank given what the daemon was made with is not warned that the
        # daemon's settings apply.
        self._daemon_has_settings = info[2] == (where, text)
        return info[0], info[1], info[3]

    def _together(self, what: str, part=None):
        """Runs this rank's ``part`` (None: nothing here) and tells every rank
        how it went (_ranks_agree): a failure here or on another rank lets
        go of the job, the session and a hosted ztierd (_abandon) and raises
        on every rank."""
        error = None
        try:
            if part is not None:
                part()
        except BaseException as e:  # noqa: BLE001 -- told to the other ranks, then raised
            error = e
        if error is None:
            self._ranks_agree(what, None, on_failure=self._abandon)
            return
        try:
            self._ranks_agree(what, error)
        except BaseException:  # noqa: BLE001 -- the peers are gone too: this error is raised
            pass
        finally:
            self._abandon()
        raise error

    def _ranks_agree(self, what: str, error: BaseException | None, alike: dict | None = None,
                     on_failure=None):
        """World size > 1: every rank tells the others how its part went
        (``error``: None, or what it is about to raise) and the settings
        that must be ``alike`` on every rank (their collectives pair up: a
        difference deadlocks or mixes the ranks' data). A failure on another
        rank, or a setting that differs, raises here on every rank (after
        ``on_failure``), rather than leaving the others in their next
        collective until its timeout. The caller raises its own ``error``."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        said = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        try:
            dist.all_gather_object(said, (mine, alike))
        except BaseException:
            if error is None and on_failure is not None:
                on_failure()
            raise
        if error is not None:
            return
        for r, (theirs, _) in enumerate(said):
            if theirs is not None:
                if on_failure is not None:
                    on_failure()
                raise RuntimeError(f"ztier: rank {r} {what}: {theirs}")
        for r, (_, others) in enumerate(said):
            for key, value in (alike or {}).items():
                if others[key] != value:
                    if on_failure is not None:
                        on_failure()
                    raise ValueError(
                        f"ztier: {key} is {value!r} on rank {self.rank} and {others[key]!r} on "
                        f"rank {r}: every rank of a job must be given the same (offload()'s "
                        "arguments, the config, the ZTIER_* variables)")

    def _every_rank_at(self, what: str):
        """Waits until every rank has called ``what`` (a call every rank
        makes), ``ztier.wait_timeout`` at most: a rank that called it alone
        (``if rank == 0: load_checkpoint``) is told which ranks did not
        come, where a barrier waited the process group's timeout (30
        minutes) while its peers waited in their next collective for it.
        Ranks meet in torch.distributed's store, under the call, the step
        and how many such calls came before at that step."""
        if self.world_size == 1:
            return
        import datetime
        import torch.distributed as dist
        call = (what, self.runner.version if self.runner is not None else -1)
        n = self._rank0_calls.get(call, 0)
        self._rank0_calls[call] = n + 1
        base = f"ztier/{self._launch}/{what}/{call[1]}/{n}"
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{base}/{self.rank}", b"")
        others = [r for r in range(self.world_size) if r != self.rank]
        timeout = self.session.wait_timeout
        try:
            store.wait([f"{base}/{r}" for r in others], datetime.timedelta(seconds=timeout))
        except Exception as e:
            try:
                missing = [r for r in others if not store.check([f"{base}/{r}"])]
            except Exception:  # noqa: BLE001 -- the store itself is gone: said below
                missing = others
            raise RuntimeError(
                f"ztier: {what} is called by every rank (each rank's runner is made again from "
                f"what it reads), and rank {', '.join(map(str, missing)) or '?'} did not call it "
                f"within {timeout:g} s (ztier.wait_timeout; {e}); this rank's model goes on as "
                "it was") from e

    def _on_rank0(self, fn):
        """Runs ``fn`` on rank 0 (the files are its to read and write), every
        rank calling it, and tells every rank how it went: an error there
        is raised on every rank (the others waited for it in a barrier, and
        both ranks hung). For a load, which every rank takes part in."""
        error = None
        if self.rank == 0:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 -- told to the other ranks, then raised
                error = e
        if self.world_size > 1:
            import torch.distributed as dist
            said = [None if error is None else f"{type(error).__name__}: {error}"]
            try:
                dist.broadcast_object_list(said, src=0)
            except Exception as e:
                if self.rank == 0 and error is None:
                    # (A peer gone: gloo's "Connection closed by peer" read as
                    # if the save had failed.)
                    raise RuntimeError(
                        f"ztier: done on rank 0, but telling the other ranks failed ({e}): a "
                        "rank is gone") from e
                raise
            if self.rank != 0 and said[0] is not None:
                raise RuntimeError(f"ztier: on rank 0: {said[0]}")
        if error is not None:
            raise error

    def _by_rank0(self, what: str, fn, between_steps: bool = True):
        """``what`` between optimizer steps, its files written by rank 0
        (``fn``), which does not wait for the other ranks: rank 0 may call
        it alone (DDP's ``if rank == 0: save``; a rank waiting for peers
        that never came hung until the timeout, and theirs in their next
        collective). Rank 0 posts how it went in torch.distributed's store,
        under the call, the step and how many such calls came before at
        that step; another rank that calls it waits there for rank 0's and
        raises rank 0's error (a call site is rank 0's alone or every
        rank's: a rank's n-th call at a step meets rank 0's n-th). Alone,
        rank 0 writes while its peers wait in their next collective, for
        ``ztier.wait_timeout`` at most. ``between_steps``: ``what`` is
        refused midway through a step (_between_steps), on any rank."""
        self._require_open(what)

        def check():
            if between_steps:
                self._between_steps(what)

        key = None
        if self.world_size > 1:
            import torch.distributed as dist
            call = (what, self.runner.version)
            n = self._rank0_calls.get(call, 0)
            self._rank0_calls[call] = n + 1
            key = f"ztier/{self._launch}/{what}/{call[1]}/{n}"
            store = dist.distributed_c10d._get_default_store()
        if self.rank != 0:
            check()
            import datetime
            while True:
                try:
                    store.wait([key], datetime.timedelta(seconds=1))
                    break
                except Exception as e:
                    if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                        raise RuntimeError(
                            f"ztier: rank {self.rank} called {what} after step {call[1]} and "
                            f"waited for rank 0's in vain ({e}): rank 0 writes the files; call it "
                            "on rank 0 (alone or with the other ranks)") from e
                # Rank 0 still writing, or gone with the ztierd it hosted:
                # a store that outlives it (file://) answered nothing until
                # the process group's timeout (30 minutes).
                try:
                    self.job.counters()
                except Exception as e:
                    raise RuntimeError(
                        f"ztier: rank {self.rank} called {what} after step {call[1]} and waited "
                        f"for rank 0's, but the engine is gone ({e}): rank 0, or its ztierd, "
                        "ended") from e
            theirs = store.get(key).decode("utf-8", "replace")
            if theirs:
                raise RuntimeError(f"ztier: on rank 0: {theirs}")
            return
        error = None
        try:
            check()
            fn()
        except BaseException as e:  # noqa: BLE001 -- posted for the other ranks, then raised
            error = e
        if key is not None:
            said = "" if error is None else f"{type(error).__name__}: {error}"
            try:
                # (A path that is not UTF-8 in the message: the store takes
                # no lone surrogate.)
                store.set(key, said.encode("utf-8", "backslashreplace"))
            except Exception as e:
                if error is None:
                    raise RuntimeError(
                        f"ztier: {what} done on rank 0 (its files are complete), but telling "
                        f"the other ranks failed ({e})") from e
        if error is not None:
            raise error

    def _park(self, t: _Tensor):
        """Points the parameter at its NaN placeholder (between uses)."""
        if t.placeholder is None:
            t.placeholder = _placeholder(t.shape, self.device, self.compute_dtype)
        t.param.data = t.placeholder
        t.idle_version = t.param._version

    def _load_weights(self, path: str):
        from ztier import hf  # safetensors shards, one unit at a time
        hf.load_weights(self, path)

    # ---- streams (CUDA): torch's current stream and the runner's compute stream

    def _torch_waits_runner(self):
        if self.device.type == "cuda":
            s = torch.cuda.ExternalStream(self._device.compute_stream, device=self.device)
            torch.cuda.current_stream(self.device).wait_stream(s)

    def _runner_waits_torch(self):
        if self.device.type == "cuda":
            s = torch.cuda.ExternalStream(self._device.compute_stream, device=self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))

    # ---- holding units

    def _hold(self, units: Iterable[_Unit]):
        """Holds every unit of `units`, or (an error, Ctrl-C) none: a hold
        counted without its values let the next forward compute with empty
        storage, and one its caller did not record was never let go."""
        taken = []
        try:
            for u in units:
                u.holds += 1
                taken.append(u)
                if u.holds > 1:
                    continue
                # The runner's buffer is copied into the unit's own storage
                # and given back at once: the storage object stays the same
                # for the model's life (emptied on release, refilled on the
                # next hold), so views autograd saved in forward (a weight's
                # transpose) read the refilled values in backward.
                if u.storage is None:
                    u.storage = torch.UntypedStorage(0, device=self.device)
                u.storage.resize_(u.padded * self._elem_bytes)
                flat = self._storage_view(u)
                self._fetch(u, flat)
                self._point_params(u, flat)
        except BaseException:
            self._let_go(taken)
            raise

    def _storage_view(self, u: _Unit) -> torch.Tensor:
        """The unit's own storage as a flat tensor of its params."""
        flat = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        flat.set_(u.storage, 0, (u.padded,))
        return flat

    def _fetch(self, u: _Unit, flat: torch.Tensor):
        """The unit's published bf16 params into `flat`, the runner's buffer
        given back at once."""
        src = self.runner.acquire(u.index)
        try:
            self._torch_waits_runner()
            flat.copy_(src)
            del src
            self._runner_waits_torch()
        finally:
            self.runner.release(u.index)

    def _point_params(self, u: _Unit, flat: torch.Tensor):
        for t in u.tensors:
            t.param.data = flat[t.offset:t.offset + t.numel].view(t.shape)
            t.held_version = t.param._version

    def _let_go(self, units: Iterable[_Unit], check: bool = False):
        """Releases one hold of each unit. With ``check`` (a module's forward
        ends), a write the forward made to a parameter it let go of is said:
        it went into a copy of the published values, never to the engine."""
        written = None
        for u in units:
            if u.holds <= 0:
                raise RuntimeError(f"ztier: unit '{u.name}' released more often than held")
            u.holds -= 1
            if u.holds == 0:
                for t in u.tensors:
                    if check and written is None and t.param._version != t.held_version:
                        written = t.name
                    if u.gathered is None:
                        self._park(t)
                if u.gathered is not None:  # inside gathered(): back to its copy
                    self._point_params(u, u.gathered)
                if u.storage is not None:
                    u.storage.resize_(0)
        if written is not None:
            raise RuntimeError(
                f"ztier: the forward wrote to parameter '{written}' in place (nn.Embedding("
                "max_norm=...) renormalizes its rows so, as does any in-place op on a weight): "
                "the parameter is a copy of the engine's values while its module runs, and the "
                "write went nowhere; the engine's optimizer alone changes the weights (for "
                "max_norm: renormalize the looked-up rows instead, e.g. F.normalize)")

    def _let_go_of_an_interrupted_pass(self):
        """Between passes (a forward begins, a short window's step): what a
        forward or backward that raised, or was interrupted, left held goes.
        Between passes no unit is held (a hold an interrupt left unrecorded
        computed with old or empty weights for the rest of the run), and the
        runner holds nothing of this model's (each fetch gives its unit back
        at once): a hold there is one an interrupt (Ctrl-C) left between an
        acquire and its release."""
        if self._phase == "backward" or self._fwd_held or any(u.holds for u in self.units):
            self._reset_interrupted()
        else:
            self.runner.release_all()

    def _reset_interrupted(self):
        """Undoes what a forward or backward that raised left behind (holds,
        grads taken but not sent, and grads on the parameters that ztier's
        post-accumulate-grad hook had not taken yet: a hook of the user's
        that raised after torch accumulated one, or ztier's own); nothing of
        it reached the engine. (A grad left so was added to by the next
        backward, whose grads the engine then got with it.)"""
        # An interrupt between an acquire and its release left the runner
        # holding a unit (every later abort was refused for it).
        if self.runner is not None:
            self.runner.release_all()
        # Every hold goes, recorded or not (an interrupt between a record's
        # removal and its let-go kept a unit held, to train on old weights).
        for u in self.units:
            if u.holds > 0:
                u.holds = 1
                self._let_go([u])
        self._fwd_held.clear()
        self._calls.clear()
        self._input_versions.clear()
        self._side_places.clear()
        self._unmatched.clear()
        self._unadopted.clear()
        self._bwd_held.clear()
        self._post_done.clear()
        self._callback_queued = False
        for u in self.units:
            if u.grads is not None:
                u.grads.zero_()
            u.arrived.clear()
            u.held.clear()
            u.acc = None
            for t in u.tensors:
                t.param.grad = None
        self._phase = "idle"

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's bf16 params in the module's parameters (at the version
        the next forward reads), e.g. to read them or copy.deepcopy the model
        (``model.state_dict()`` shows them anywhere). Read-only:
        writes to them are not sent to the engine. Each unit is copied into
        storage of its own, which the parameters let go of on leaving (they
        go back to what they were): views taken inside, a state dict, stay
        valid after it, whatever forwards run or fail meanwhile."""
        self._require_open("gathered")
        key = self.runner.order_key
        self.runner.set_order(_GATHER)
        self._gathering += 1  # the parameters show copies, not placeholders
        saved = []  # (unit, the copy an enclosing gathered() gave it)
        versions = []  # (unit, tensor, the parameter's version once pointed at the copy)
        try:
            for u in self.units:
                flat = torch.empty(u.padded, dtype=self.compute_dtype, device=self.device)
                if u.holds > 0:  # a forward holds it: its params show the values
                    for t in u.tensors:
                        flat[t.offset:t.offset + t.numel].copy_(t.param.data.reshape(-1))
                else:
                    self._fetch(u, flat)
                saved.append((u, u.gathered))
                u.gathered = flat  # a forward inside lets go back to it
                self._point_params(u, flat)
                versions.extend((u, t, t.param._version) for t in u.tensors)
            yield self.module
        finally:
            self._gathering -= 1
            written_versions = {id(t): t.param._version for _, t, _ in versions}
            # Each unit as its holds now say (a forward inside may have
            # taken or dropped some): on its storage, on an enclosing
            # gathered()'s copy, or on placeholders (a write is said below,
            # not again at the next forward).
            for u, outer in saved:
                u.gathered = outer
                if u.holds > 0:
                    self._point_params(u, self._storage_view(u))
                elif outer is not None:
                    self._point_params(u, outer)
                else:
                    for t in u.tensors:
                        self._park(t)
            self.runner.set_order(key)
            # An in-place write (load_state_dict, fill_) bumps a parameter's
            # version: say that it went nowhere.
            written = list(dict.fromkeys(
                u.name for u, t, version in versions if written_versions[id(t)] != version))
            if written:
                warnings.warn(
                    f"ztier: parameters of {len(written)} units (e.g. '{written[0]}') were "
                    "written inside gathered(); its values are copies and the writes did not "
                    "reach the engine (weights go in through load_checkpoint, from_pretrained "
                    "or a fresh offload)", RuntimeWarning, stacklevel=3)

    # ---- hooks

    def _install_hooks(self, model: nn.Module):
        # The hooks reach this object through a weak reference: the model
        # (and the tensors' hooks, which the garbage collector cannot see
        # through) must not keep an Offload its user dropped alive.
        # The pre-hooks go before the user's own: one that reads parameters
        # (torch.nn.utils.weight_norm computes `weight` from its params in
        # one) must find the values, not the placeholders. The root's goes
        # first of all (prepended last), also where the root is a hooked
        # module itself.
        # The post-hooks go after the user's own, also those registered
        # later (_post_hooks_last): a hook that reads parameters (a weight
        # norm logged, a penalty added to the output) must find the values,
        # not the placeholders the unit's let-go leaves.
        self._post_hook_ids: dict[int, list[int]] = {}

        def post(m, fn):
            handle = m.register_forward_hook(fn)
            self._hooks.append(handle)
            self._post_hook_ids.setdefault(id(m), []).append(handle.id)

        for m in self._hooked:
            self._hooks.append(m.register_forward_pre_hook(_weak(self._pre_forward, m),
                                                           prepend=True, with_kwargs=True))
            post(m, _weak(self._post_forward, m))
        self._hooks.append(model.register_forward_pre_hook(
            _weak(self._root_pre_forward, model, root=True), prepend=True, with_kwargs=True))
        post(model, _weak(self._root_post_forward, model))
        # On every module holding offloaded parameters, the root included: a
        # submodule's load_state_dict wrote its buffers, then failed in
        # torch's copy into the placeholders.
        for m in model.modules():
            if any(id(p) in self._tensor_of for p in m.parameters()):
                self._hooks.append(m._register_load_state_dict_pre_hook(
                    _weak(self._root_load_state_dict, m), with_module=True))
        for u in self.units:
            for t in u.tensors:
                if t.param.requires_grad:
                    handle = t.param.register_post_accumulate_grad_hook(
                        _weak(self._grad_in, t.param))
                    self._hooks.append(handle)
                    t.grad_hook = handle.id
        # state_dict() (save_pretrained, Trainer's checkpoints) shows the
        # values, not the placeholders: each module that owns parameters
        # fills in its own, each unit read once per call of the root's.
        self._hooks.append(model.register_state_dict_pre_hook(
            _weak(self._root_state_dict_pre, model, root=True)))
        for m in model.modules():
            if any(id(p) in self._tensor_of for p in m._parameters.values() if p is not None):
                self._hooks.append(m._register_state_dict_hook(_weak(self._state_dict_fill, m)))
        self._hooks.append(model._register_state_dict_hook(
            _weak(self._root_state_dict_post, model)))
        # model.zero_grad() is optimizer.zero_grad(): the window's grads so
        # far are in the engine, not in the parameters (torch's cleared
        # p.grad alone, and the step took the grads the user dropped).
        model.zero_grad = _RootZeroGrad(model)
        self._hooks.append(_RootZeroGrad.Removal(model))

    def _root_state_dict_pre(self, module, prefix, keep_vars):
        self._check_unchanged()  # (before the cache: a refusal leaves none)
        self._sd_values = {}

    def _check_unchanged(self):
        """Before the engine's weights are read out under the model's names
        (state_dict, export, save_pretrained): a module replaced since
        offloading (resize_token_embeddings) or a parameter written to was
        saved as the engine's old values beside a config that said
        otherwise, or as NaN, silently; the next forward refuses it, and so
        do these."""
        if self.job is not None and not self._gathering:
            self._check_same_parameters()
            self._check_idle_params(values=True)

    def _root_state_dict_post(self, module, state_dict, prefix, local_metadata):
        self._sd_values = None

    def _state_dict_fill(self, module, state_dict, prefix, local_metadata):
        """The module's own offloaded parameters in ``state_dict``: the values
        the next forward reads, on the host (the bf16 rounding of the
        engine's fp32 masters, as published, in the compute dtype). Read
        from the engine, not through the runner: no collective (one rank
        may save alone), no device memory (a model too large for the GPU
        saves too), and a module running now gets values that outlive its
        storage. Each entry a tensor of its own (tensors sharing storage
        read as tied weights to save_pretrained). Inside gathered() the
        parameters' copies are shown as they are; with keep_vars the
        parameters themselves."""
        if self._gathering:
            return
        for name, p in module._parameters.items():
            t = self._tensor_of.get(id(p)) if p is not None else None
            key = prefix + name
            if t is None or t.param is not p or key not in state_dict:
                continue
            if state_dict[key] is p:  # keep_vars=True: the parameters themselves
                if not self._warned_keep_vars:
                    self._warned_keep_vars = True
                    warnings.warn(
                        "ztier: state_dict(keep_vars=True) holds the offloaded parameters "
                        "themselves, whose storage holds no values between uses (NaN "
                        "placeholders; the values live in the engine): a copy of them is NaN; "
                        "for the values take state_dict(), or keep_vars=True inside `with "
                        "z.gathered():`", RuntimeWarning, stacklevel=_user_stacklevel())
                continue
            u = self._unit_of[id(p)]
            self._require_open("state_dict")
            if self._sd_values is None and not u.holds:
                # A submodule's state_dict (the root's checked them all):
                # its own parameters written to since offloading.
                self._check_idle_params(values=True, tensors=[t])
            if self._grads_sent():
                raise RuntimeError(
                    "ztier: state_dict() after a backward and before its optimizer.step(): "
                    "the engine holds that step's grads and reads no state until it runs; "
                    "take it after optimizer.step(), or inside `with z.gathered():` before "
                    "the backward")
            # A unit read once per root call and version (a call that raised
            # midway leaves a cache that serves only its own version).
            # Each kept until its last tensor is filled (not the whole model).
            cache = self._sd_values if self._sd_values is not None else {}
            version = self.runner.version
            entry = cache.get((version, u.index))
            if entry is None:
                self.job.wait_published(version, self.session.wait_timeout)
                values = self._read_master(u).to(torch.bfloat16).to(self.compute_dtype)
                entry = [values, len(u.tensors)]
                cache[(version, u.index)] = entry
            state_dict[key] = entry[0][t.offset:t.offset + t.numel].view(t.shape).clone()
            entry[1] -= 1
            if entry[1] == 0:
                del cache[(version, u.index)]

    def _root_load_state_dict(self, module, state_dict, prefix, *args):
        if self._gathering:
            return  # gathered() says on exit that the writes went nowhere
        # Buffers alone (strict=False) load into the module as ever; a
        # parameter of the engine's, anywhere below, is refused before
        # anything is written.
        if not any(id(p) in self._tensor_of and prefix + n in state_dict
                   for n, p in module.named_parameters(remove_duplicate=False)):
            return
        what = ("an offloaded model" if module is self.module
                else f"a {type(module).__name__} inside an offloaded model")
        raise RuntimeError(
            f"ztier: load_state_dict on {what}: its parameters are placeholders "
            "between uses (their values live in the engine), so a copy into them goes nowhere; "
            "bring weights in through load_checkpoint (a ztier checkpoint), weights= at "
            "zt.offload (safetensors) or zt.from_pretrained, or load the state dict before "
            "zt.offload (Trainer's resume_from_checkpoint is this: its checkpoints hold no "
            "AdamW moments either; save with z.save_checkpoint in a TrainerCallback's on_save "
            "and call z.load_checkpoint before trainer.train())")

    def _remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _post_hooks_last(self, module):
        """Moves this object's forward hooks on `module` after any the user
        registered since (they run in registration order)."""
        ids = self._post_hook_ids.get(id(module))
        hooks = module._forward_hooks
        if ids and next(reversed(hooks), None) != ids[-1]:
            for i in ids:
                if i in hooks:
                    hooks.move_to_end(i)

    def _root_pre_forward(self, module, args, kwargs):
        _refuse_functorch(module)
        _refuse_tracing(module)
        self._post_hooks_last(module)
        if torch._C._current_graph_task_id() != -1:
            return None  # activation checkpointing's recompute of the whole model
        self._begin_forward(root=True)
        return self._cast_inputs(args, kwargs) if self._cast_inputs_on else None

    def _begin_forward(self, root: bool):
        """What every forward begins with: the checks that the model is as it
        was offloaded, and the pass's bookkeeping. ``root``: the model was
        called (model(x)); else a forward that does not go through the root
        (model.encode(x), a submodule called on its own) begins at its first
        offloaded module (_rootless_begins): a training one ends with its
        backward, an evaluation's when another forward begins or the model is
        used between steps."""
        self._claim_thread("a forward", forward=root)
        self._end_evaluation_pass()  # another forward begins
        if self._stranded():
            self._undo_stranded("a forward")
        self._let_go_of_an_interrupted_pass()
        training = torch.is_grad_enabled() and self.module.training
        if training and self._awaiting_step:
            raise RuntimeError(
                f"ztier: a training forward after {self._micro} backward passes, but "
                f"grad_accumulation={self.grad_accumulation}: call optimizer.step() first (a "
                "backward through this model that gave its parameters grads counts as one, "
                "also one that trains another model through it: freeze it with "
                "requires_grad_(False) for such passes)")
        if torch.is_grad_enabled():  # a forward that may train (not each generated token)
            self._check_same_parameters()
            if getattr(self, "optimizer", None) is not None:
                self.optimizer._check_supported()
        self._check_idle_params(values=training)
        if training and not self._first_step_checked:
            self._check_first_step()
        self._training_forward = torch.is_grad_enabled()
        # A forward past the root whose first module runs in a reentrant
        # activation checkpoint (without grad, its backward recomputing it)
        # may be a training one: its calls are counted as one's, and the
        # first call with grad makes it one (_rootless_begins).
        self._began_in_checkpoint = (not root and not self._training_forward
                                     and _in_reentrant_checkpoint())
        if self._counts_calls:
            self._check_frozen_set()
        if self._counts_calls and self._phase == "idle":
            # The calls of the forward before (its backward done, or its
            # graph dropped) are over.
            for u in self.units:
                u.calls = 0
        # Training and evaluation / generation forwards visit the units in
        # different orders: the runner keeps one learned order per kind.
        self.runner.set_order(_TRAIN if training else _EVAL)
        self._phase = "forward"

    def _cast_inputs(self, args, kwargs):
        """The model's floating-point inputs in its compute dtype (as the
        parameters are): a float32 batch into a model computing in bf16
        otherwise fails at its first matmul."""
        changed = False

        info = torch.finfo(self.compute_dtype)

        def cast(x):
            nonlocal changed
            if isinstance(x, torch.Tensor):
                if x.is_floating_point() and x.dtype != self.compute_dtype:
                    changed = True
                    if torch.finfo(x.dtype).max > info.max:
                        # Past the range saturates, not to inf: an fp32
                        # additive mask of finfo.min stays a large negative
                        # number (-inf made fully masked rows NaN).
                        x = x.clamp(info.min, info.max)
                    return x.to(self.compute_dtype)
                return x
            # A container is rebuilt only when something in it was cast:
            # the caller's own list or dict otherwise reaches the model, which
            # may fill it (an incremental decoding state, auxiliary losses).
            if isinstance(x, (tuple, list)):
                items = [cast(v) for v in x]
                if all(a is b for a, b in zip(items, x)):
                    return x
                if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
                    return type(x)(*items)
                return type(x)(items)
            if type(x) is dict:
                items = {k: cast(v) for k, v in x.items()}
                if all(items[k] is v for k, v in x.items()):
                    return x
                return items
            return x

        new_args, new_kwargs = cast(tuple(args)), cast(dict(kwargs))
        return (new_args, new_kwargs) if changed else None

    def _check_same_parameters(self):
        """The model's parameters are still those it was offloaded with: a
        module replaced or added since (``model.head = nn.Linear(...)``,
        ``resize_token_embeddings``) was never laid out in the engine, and
        would silently never train; one removed still is."""
        params = dict(self.module.named_parameters())
        now = {id(p): n for n, p in params.items()}
        if now == self._known_params:
            return
        if now.keys() == self._known_params.keys():
            # The same parameters under other names. A module moved (a
            # parameterless one inserted into a Sequential) renames the path
            # alone: it trains as it was. torch.nn.utils.prune keeps a pruned
            # weight as `<name>_orig` (its mask computed from the
            # placeholder, NaN), a parametrization as `...weight.original`.
            renamed = [(self._known_params[i], n) for i, n in now.items()
                       if self._known_params[i].rsplit(".", 1)[-1] != n.rsplit(".", 1)[-1]]
            if not renamed:
                self._known_params = now
                return
            old, name = renamed[0]
            self._refuse_reparametrized([name])
            how = ("a parametrization (register_parametrization) keeps a weight so"
                   if ".parametrizations." in name else
                   "torch.nn.utils.prune keeps a weight it prunes so, its mask computed from "
                   "the placeholder, NaN")
            raise RuntimeError(
                f"ztier: the model's parameters changed since it was offloaded: '{old}' is "
                f"named '{name}' now ({how}: the values live in the engine); prune or "
                "reparametrize the model before zt.offload, or export_safetensors, change a "
                "fresh model and offload it with weights=")
        new = [n for i, n in now.items() if i not in self._known_params]
        gone = [n for i, n in self._known_params.items() if i not in now]
        if new and not isinstance(params[new[0]], nn.Parameter):
            # torch.func.functional_call puts its tensors in the modules'
            # parameter slots for the call.
            raise RuntimeError(
                f"ztier: '{new[0]}' is a {type(params[new[0]]).__name__}, not the parameter the "
                "engine holds: torch.func.functional_call (or torch.nn.utils.stateless) swapped "
                "tensors into the offloaded model, which computes with the engine's weights "
                "only; call the model itself, or run functional_call on a copy made inside "
                "`with z.gathered():` (copy.deepcopy), a plain model holding the weights")
        self._refuse_reparametrized(new + gone)
        what = (f"'{new[0]}' is a parameter the engine does not hold (its module was added or "
                "replaced after zt.offload, and would never train)" if new else
                f"'{gone[0]}' is no longer in the model (its module was removed or replaced "
                "after zt.offload)")
        raise RuntimeError(
            f"ztier: the model's parameters changed since it was offloaded: {what}; change "
            "the model before zt.offload, or export_safetensors, change a fresh model and "
            "offload it with weights=")

    def _refuse_reparametrized(self, names: list[str]):
        """Where one of the parameters ``names`` (new, gone or renamed since
        offloading) is a tensor reparametrized after zt.offload (weight_norm,
        spectral_norm, a parametrization; torch.nn.utils.prune is said by
        the caller), says so: the reparametrization read the placeholder
        (NaN), and the engine holds the parameters laid out when offloading.
        Applied before zt.offload it trains (the engine holds the parameters
        it makes)."""
        found = _reparametrization(self.module, names)
        if found is None or found[1] == "torch.nn.utils.prune":
            return
        tensor, what, now = found
        raise RuntimeError(
            f"ztier: the model's parameters changed since it was offloaded: '{tensor}' was "
            f"reparametrized by {what} after zt.offload (it is computed from "
            + ", ".join(f"'{n}'" for n in now) + " now): that read the parameter's placeholder "
            "(NaN between uses: its values live in the engine), and the engine lays the "
            f"parameters out when offloading; apply {what} before zt.offload (the model trains "
            "so, the engine holding the parameters it makes), or, for a model trained here, "
            "export_safetensors, load that into a fresh model (load_state_dict), apply it there "
            "and offload that one")

    def _check_idle_params(self, values: bool, tensors: list[_Tensor] | None = None):
        """Between uses a parameter is its placeholder: one written to (an
        init after offloading, through the parameter or its ``.data``),
        replaced (``p.data = ...``) or cast (``.half()``, ``.to(...)``) since
        would be silently dropped, its values living in the engine. With
        ``values`` the placeholders' NaN are read too (one device sync: a
        ``.data`` write bumps no version), for training forwards only. What
        was found is said once: the parameters are put back on fresh
        placeholders. ``tensors``: those idle ones only (default: every idle
        one)."""
        if self._gathering:
            return
        bad = None
        cast = False
        idle = (tensors if tensors is not None else
                [t for u in self.units if not u.holds for t in u.tensors])
        for t in idle:
            data = t.param.data
            if data.dtype != self.compute_dtype or data.device != self.device:
                cast = True
                bad = bad or (
                    f"ztier: '{t.name}' is {data.dtype} on {data.device} now, the model was "
                    f"offloaded to compute in {self.compute_dtype} on {self.device}: its "
                    "parameters' dtype and device are fixed then (offload(compute_dtype=, "
                    "device=))")
            elif (t.param._version != t.idle_version or t.placeholder is None
                  or data.data_ptr() != t.placeholder.data_ptr()):
                bad = bad or self._written(t)
        shown = [t for t in idle if t.numel > 0]
        if bad is None and values and shown:
            nan = torch.stack([t.placeholder.reshape(-1)[0] for t in shown]).isnan()
            if not bool(nan.all()):
                bad = self._written(shown[int((~nan).nonzero()[0])])
        if self._put_buffers_back(cast):
            bad += "; the cast is undone, the buffers it cast put back as they were"
        if bad is not None:
            for t in idle:
                t.placeholder = None  # a write may have gone into it
                self._park(t)
            raise RuntimeError(bad)

    @staticmethod
    def _written(t: _Tensor) -> str:
        return (f"ztier: '{t.name}' was written to after the model was offloaded, or replaced "
                "or converted (p.data = ..., resize_token_embeddings, "
                "model.to(memory_format=...), a parametrization registered): its values live in the engine (the parameter is a placeholder "
                "between uses), and the change went nowhere; initialize, convert or "
                "reparametrize before zt.offload, or bring weights in through load_checkpoint, "
                "weights= or zt.from_pretrained")

    def _check_frozen_set(self):
        """The engine's frozen tensors and the hooks that send grads are laid
        out when offloading: a parameter whose requires_grad changed since
        would be trained anyway (frozen: its unit's zero grads still move it)
        or never (unfrozen: no hook sends its grads), silently. Freezing every
        trainable parameter is the one change allowed: a pass that trains
        another model through this one (a GAN's discriminator), whose
        backward gives this model no grad and so is no micro-step of it."""
        trainable = [t for u in self.units for t in u.tensors if not t.frozen]
        if not any(t.param.requires_grad for t in trainable):
            trainable = []  # all frozen for now
        for u in self.units:
            for t in u.tensors:
                if t.param.requires_grad == t.frozen and (t.frozen or trainable):
                    now = "True" if t.param.requires_grad else "False"
                    raise RuntimeError(
                        f"ztier: '{t.name}' has requires_grad={now} now, {not t.frozen} when the "
                        "model was offloaded: the engine's frozen tensors are fixed then (a "
                        "tensor frozen later would still be updated, one unfrozen never; only "
                        "the whole model may be frozen for a while); set requires_grad before "
                        "zt.offload, or export_safetensors and offload again with weights= (or a "
                        "fresh model and load_checkpoint)")
        for name, p in self._complex:
            if p.requires_grad:
                raise RuntimeError(_complex_trainable(
                    name, p, "has requires_grad=True now, False when the model was "
                    "offloaded; it is complex"))

    def _root_post_forward(self, module, args, output):
        if torch._C._current_graph_task_id() != -1:
            return None
        self._in_forward = False
        if self._training_forward and not self._output_checked:
            self._check_first_output(output)
        # A forward no backward can follow (no grad, or nothing that needs
        # one): done, and the model is between steps again.
        if self._phase == "forward" and not any(t.requires_grad for t in _tensors(output)):
            self._phase = "idle"
        return None

    def _check_first_output(self, output):
        """The first training forward's output, looked at once (one device
        sync): inf/NaN there is most often a parameter read outside the
        forward of the module that owns it, which then reads its NaN
        placeholder; every step would be skipped as non-finite with only
        the engine's warnings to say so."""
        self._output_checked = True
        if any(t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
               for t in _tensors(output)):
            self._nan_warned = True
            warnings.warn(
                "ztier: the model's first training forward gave inf/NaN. " + _READ_OUTSIDE,
                RuntimeWarning, stacklevel=_user_stacklevel())

    def _check_first_step(self):
        """Once the first optimizer step is done (at a training forward; one
        read of the engine's counters until then): a step skipped for
        inf/NaN grads while the output was finite is most often a parameter
        read outside its module's forward in the loss (a weight penalty over
        model.parameters()), its NaN placeholder giving NaN grads; every step
        was skipped with only the engine's warnings to say so."""
        if self.runner.version == 0:
            return
        counters = self.job.counters()
        if counters["steps"] == 0:
            return  # the optimizer is still on it: looked at again next time
        self._first_step_checked = True
        if counters["skipped_steps"] and not self._nan_warned:
            self._nan_warned = True
            warnings.warn(
                "ztier: an optimizer step was skipped for inf/NaN in its grads. " + _READ_OUTSIDE,
                RuntimeWarning, stacklevel=_user_stacklevel())

    def _pre_forward(self, module, args, kwargs):
        _refuse_functorch(module)
        _refuse_tracing(module)
        self._post_hooks_last(module)
        mid = id(module)
        units = self._module_units[mid]
        if (not self._in_forward and self._phase != "backward"
                and any(m is self.module for m in self._hooked)
                and torch._C._current_graph_task_id() == -1 and self._forward_called_directly()):
            own = next(n for n, p in self.module.named_parameters(recurse=False)
                       if id(p) in self._tensor_of)
            raise RuntimeError(
                "ztier: model.forward(...) was called directly, past the model's own hooks, and "
                f"its own parameters ('{own}') were never fetched (they would read as NaN): call "
                "the model itself, model(...)")
        if self._phase != "backward" and torch._C._current_graph_task_id() != -1:
            self._enter_backward()  # a recompute is the first thing backward runs
        elif not self._in_forward and self._rootless_begins(module):
            # A forward past the root (model.encode(x)): its checks ran
            # nowhere, so a parameter frozen, unfrozen, replaced or written
            # since offloading trained (or did not) silently.
            self._begin_forward(root=False)
        call = (mid, self._next_call)
        self._next_call += 1
        if self._phase == "backward":
            self.recomputes += 1
            # Recompute (activation checkpointing) inside backward. In the
            # non-reentrant form the forward's own calls of the module get
            # their backward later: the recompute takes the hold of the
            # latest of them not yet held, which that backward then finds
            # and releases (units are counted holds: which call's token does
            # not matter). In the reentrant form the forward ran without
            # grad (no such calls): the recompute's own inputs release it.
            # A backward hook came first: share its hold (the recompute's
            # own key stays unheld, so its inputs' release is a no-op).
            # Else hold, for that hook to take over in the non-reentrant
            # form, or for the recompute's inputs to release in the
            # reentrant one (whose nested backward runs at once).
            if self._unmatched.get(mid):
                self._unmatched[mid].pop()
            else:
                self._hold(units)  # all or none, then recorded
                self._bwd_held.add(call)
                self._unadopted.setdefault(mid, []).append(call)
        else:
            self._hold(units)
            self._fwd_held.append(mid)
            self._calls.setdefault(mid, []).append(call[1])
            if self._counts_calls:  # also in a region that runs without grad
                for u in units:
                    u.calls += 1
        if torch.is_grad_enabled():
            if self._phase != "backward":
                # (A view of a leaf: the node it makes is numbered as the
                # next one would be, and every node of this forward after it.)
                self._side_places[call] = (
                    self._sequence_probe.view(()).grad_fn._sequence_nr(),
                    self._side_places_of(module, args, kwargs))
            return self._wrap_inputs(call, args, kwargs)
        return None

    @property
    def _counts_calls(self) -> bool:
        """This forward's calls have a backward to come (a training forward,
        or one begun in a reentrant checkpoint): they are counted."""
        return self._training_forward or self._began_in_checkpoint

    def _end_evaluation_pass(self):
        """An evaluation's pass (no grad, nothing held) is over: it has no
        end of its own when it goes past the root."""
        if self._phase == "forward" and not self._training_forward and not self._fwd_held:
            self._phase = "idle"

    def _rootless_begins(self, module) -> bool:
        """At an offloaded module's call outside any root forward: whether a
        forward past the root begins here. Not inside another offloaded
        module's call (nested); yes after one that raised (its holds are
        stale: _begin_forward lets them go), between steps, and where an
        evaluation's calls (without grad: they go on as one pass, one learned
        order) are followed by a training one, and after a backward that
        raised. A training forward's calls are one pass until its backward
        ends it."""
        if self._fwd_held:
            return not self._module_call_on_stack(set(self._fwd_held), this_call=module)
        if self._phase == "idle":
            return True
        if self._phase == "backward":
            # Outside any backward (a recompute runs in one): the last
            # backward raised or was interrupted, and _begin_forward lets
            # it go, as a root forward does.
            return torch._C._current_graph_task_id() == -1
        if self._phase != "forward" or self._training_forward or not torch.is_grad_enabled():
            return False
        if self._began_in_checkpoint:  # its first calls were in a checkpoint: it trains
            self._training_forward = True
            return False
        return True

    def _forward_called_directly(self) -> bool:
        """The root's forward is on this stack but not through its __call__:
        model.forward(x) (its hooks skipped). Looked for only where a hooked
        module runs outside a root forward, which a submodule called on its
        own does too."""
        return self._root_forward_on_stack()

    def _root_call_on_stack(self) -> bool:
        """A call of the root module runs on this thread's stack: its forward,
        or the hooks around it (which run inside its __call__)."""
        return self._module_call_on_stack({id(self.module)})

    @staticmethod
    def _module_call_on_stack(ids: set, this_call=None) -> bool:
        """A call of one of the modules whose ids are ``ids`` runs on this
        thread's stack (``this_call``'s innermost call, the one asking, not
        counted)."""
        codes = {nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__}
        f = sys._getframe(1)
        while f is not None:
            if f.f_code in codes:
                m = f.f_locals.get("self")
                if this_call is not None and m is this_call:
                    this_call = None  # its own frames: _wrapped_call_impl, _call_impl
                    while f.f_back is not None and f.f_back.f_code in codes and \
                            f.f_back.f_locals.get("self") is m:
                        f = f.f_back
                elif id(m) in ids:
                    return True
            f = f.f_back
        return False

    def _root_forward_on_stack(self) -> bool:
        """The root module's forward runs on this thread's stack."""
        code = getattr(getattr(type(self.module).forward, "__func__",
                               type(self.module).forward), "__code__", None)
        if code is None or code.co_argcount == 0:
            return False
        f = sys._getframe(1)
        while f is not None:
            if f.f_code is code and f.f_locals.get(code.co_varnames[0]) is self.module:
                return True
            f = f.f_back
        return False

    def _post_forward(self, module, args, output):
        if self._phase == "backward":
            return None  # recompute: the hold lasts until the module's backward ends
        mid = id(module)
        call = (mid, self._calls[mid].pop())
        units = self._module_units[mid]
        grad = torch.is_grad_enabled()
        # The top of the output made the module's own: a view of its units'
        # params (a positional table's self.pe[:T]) is copied, since the
        # params are let go below (the view read freed memory); another view
        # (a block's .view(B, T, C)) goes through _PreBackward, which an
        # in-place write of the caller's cannot drop; the rest get a grad hook.
        held = {u.storage.data_ptr() for u in units
                if u.storage is not None and u.storage.nbytes() > 0}
        replaced = False

        def own(t):
            nonlocal replaced
            if not isinstance(t, torch.Tensor):
                return t
            if held and t.untyped_storage().data_ptr() in held:
                replaced = True
                return t.clone()
            if grad and t.requires_grad and t._is_view():
                replaced = True
                return _PreBackward.apply(self, call, t)
            return t

        output = _map_tensors(output, own)
        deeper = held and any(t.untyped_storage().data_ptr() in held for t in _tensors(output))
        self._fwd_held.remove(mid)
        self._let_go(units, check=True)
        where = f" (unit '{units[0].name}')" if units else ""
        if deeper:
            raise RuntimeError(
                f"ztier: a {type(module).__name__}{where} returned a view of its own parameters "
                f"inside its output ({type(output).__name__}): they are let go when its forward "
                "ends, and the view would read freed memory; return it as a tensor or in "
                "tuples, lists, dicts or dataclasses (those are looked into), or .clone() it")
        written = [t for t, v in self._input_versions.pop(call, ()) if t._version != v]
        if written and type(module) not in self._inplace_warned:
            self._inplace_warned.add(type(module))
            warnings.warn(
                f"ztier: a {type(module).__name__}{where} changed its input in place (x.mul_, "
                "x += ..., x.unsqueeze_): under ztier it gets an alias of the caller's tensor, "
                "which takes a write to its values but not the write's history (nor a change of "
                "its shape), so a use of that tensor after the call (a residual kept from before "
                "it) gets wrong grads; where the caller does that, change it out of place in the "
                "module (x * g, not x.mul_(g)) or clone its input", RuntimeWarning,
                stacklevel=_user_stacklevel())
        if not grad:
            return output if replaced else None
        for t in _tensors(output):
            if t.requires_grad and not isinstance(t.grad_fn, _PreBackward._backward_cls):
                t.register_hook(functools.partial(_pre_backward_hook, weakref.ref(self), call))
        self._hook_kept(module, call)
        self._hook_side_outputs(module, call)
        return output if replaced else None

    def _side_places_of(self, module, args, kwargs) -> list:
        """Where a block's forward may leave a tensor for the caller past its
        output (an auxiliary head's, appended to a list the caller passed
        in, to a list of an object the blocks share, or by a forward hook of
        a submodule to a list of the model's): the lists and dicts among the
        call's arguments and the public attributes of its unit's modules
        and of the model, and of the plain objects among those (not
        deeper), each with its length now; and those plain objects, whose
        tensor attributes are looked at."""
        places = []

        def look(v, deeper):
            if isinstance(v, (list, dict)):
                places.append((v, len(v)))
            elif deeper and _plain_object(v):
                places.append((v, None))
                for w in _attribute_values(v):
                    look(w, False)

        for v in (*args, *kwargs.values()):
            look(v, True)
        for m in (*self._own_modules(module), self.module):
            for k, v in vars(m).items():
                if not k.startswith("_"):
                    look(v, True)
        return places

    def _hook_side_outputs(self, module, call):
        """Tensors the module's forward made and left where _side_places_of
        looked before it (appended to a list or dict, or set on a plain
        object): hooked as its outputs are. Their backward could run before
        any output's, and read the unit's weights let go ("setStorage: ...
        out of bounds for storage of size 0"). Made in this forward: numbered
        past its start; at most the last 1024 items a list or dict gained."""
        start, places = self._side_places.pop(call, (None, ()))
        if start is None:
            return
        for place, n in places:
            if n is None:  # a plain object
                new = [v for v in _attribute_values(place) if isinstance(v, torch.Tensor)]
            elif len(place) <= n:
                continue
            elif isinstance(place, list):
                new = place[max(n, len(place) - 1024):]
            else:
                new = list(itertools.islice(reversed(place.values()), min(len(place) - n, 1024)))
            for item in new:
                for t in _shallow_tensors(item):
                    if (t.requires_grad and t.grad_fn is not None
                            and t.grad_fn._sequence_nr() > start
                            and self._kept_hooked.get(id(t)) is not t):
                        self._kept_hooked[id(t)] = t
                        t.register_hook(
                            functools.partial(_pre_backward_hook, weakref.ref(self), call))

    def _hook_kept(self, module, call):
        """A tensor the module or a submodule of its unit kept on itself in
        its forward (an MoE layer's ``self.aux_loss``, which the caller adds
        to the loss; in a list or dict too) leads a backward into the module
        past its outputs: it is hooked as they are (its backward read the
        unit's freed weights)."""
        for m in self._own_modules(module):
            for name, v in vars(m).items():
                if isinstance(v, torch.Tensor):
                    kept = (v,)
                elif isinstance(v, (list, tuple)):
                    kept = v
                elif isinstance(v, dict) and not name.startswith("_"):
                    kept = v.values()
                else:
                    continue
                for t in kept:
                    if (isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
                            and self._kept_hooked.get(id(t)) is not t):
                        self._kept_hooked[id(t)] = t
                        t.register_hook(
                            functools.partial(_pre_backward_hook, weakref.ref(self), call))

    def _own_modules(self, module) -> list:
        """``module`` and its submodules down to the next offloaded ones (the
        modules its unit holds), found once."""
        mods = self._own_modules_of.get(id(module))
        if mods is None:
            mods, todo = [], [module]
            while todo:
                m = todo.pop()
                mods.append(m)
                todo.extend(c for c in m.children() if id(c) not in self._module_units)
            self._own_modules_of[id(module)] = mods
        return mods

    def _wrap_inputs(self, call, args, kwargs):
        pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not pos and not keys:
            return None
        # One tensor in several slots (attention's m(h, h, h)) goes through
        # once and comes out as one: a module that asks `query is key` (
        # nn.MultiheadAttention's packed self-attention) takes its own path.
        tensors, slot_of, seen = [], [], {}
        for t in [args[i] for i in pos] + [kwargs[k] for k in keys]:
            if id(t) not in seen:
                seen[id(t)] = len(tensors)
                tensors.append(t)
            slot_of.append(seen[id(t)])
        out = _PostBackward.apply(self, call, *tensors)
        if not isinstance(out, tuple):
            out = (out,)
        if self._phase != "backward":  # a recompute's post-forward does not look
            self._input_versions[call] = [(o, o._version) for o in out]
        args = list(args)
        for i, j in zip(pos, slot_of[:len(pos)]):
            args[i] = out[j]
        kwargs = dict(kwargs)
        for k, j in zip(keys, slot_of[len(pos):]):
            kwargs[k] = out[j]
        return tuple(args), kwargs

    def _enter_backward(self):
        if self._phase != "backward":
            self._claim_thread("a backward")
        if self._awaiting_step:
            raise RuntimeError(
                f"ztier: a backward pass after {self._micro} backward passes, but "
                f"grad_accumulation={self.grad_accumulation}: call optimizer.step() first (a "
                "backward through this model that gave its parameters grads counts as one, "
                "also one that trains another model through it: freeze it with "
                "requires_grad_(False) for such passes); to train on several losses of one "
                "forward, backward their sum ((l1 + l2).backward()), or set "
                "grad_accumulation to the number of backward passes per step")
        if self._phase != "backward":
            self._grad_hooks_last()
            self._phase = "backward"
            self._bwd_held.clear()
            self._post_done.clear()
            self._unmatched.clear()
            self._unadopted.clear()
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _grad_hooks_last(self):
        """Moves each parameter's post-accumulate-grad hook (_grad_in, which
        takes p.grad to the engine and clears it) after any the user
        registered since (they run in registration order): theirs found
        p.grad None. As a backward begins, before any grad of it arrives."""
        for u in self.units:
            for t in u.tensors:
                hooks = getattr(t.param, "_post_accumulate_grad_hooks", None)
                if (hooks is not None and len(hooks) > 1 and t.grad_hook in hooks
                        and next(reversed(hooks)) != t.grad_hook):
                    # Removed and put back, not move_to_end: torch runs
                    # them in the underlying dict's order.
                    hooks[t.grad_hook] = hooks.pop(t.grad_hook)

    def _pre_backward(self, call: tuple[int, int], grad):
        self._require_open("a backward")  # of a graph made before close()
        if torch.is_grad_enabled():  # the backward records a graph of its own
            raise RuntimeError(
                "ztier: a backward with create_graph=True (a gradient penalty, a double "
                "backward) through an offloaded model is not supported: each module's weights "
                "are let go once its backward ends, and the graph it records would read them "
                "later; compute the penalty on inputs of a model that is not offloaded, or "
                "without create_graph")
        if call[1] < self._first_call:
            raise RuntimeError(
                "ztier: a backward pass of a forward run before the last optimizer.step(): "
                "its grads are of the weights that step replaced (torch refuses the same, a "
                "weight needed for the gradient having been modified in place); run the "
                "forward again")
        self._enter_backward()
        if call in self._bwd_held or call in self._post_done:
            return grad
        mid = call[0]
        if self._unadopted.get(mid):  # a recompute holds it already: take that hold over
            self._bwd_held.discard(self._unadopted[mid].pop())
            self._bwd_held.add(call)
        else:
            self._hold(self._module_units[call[0]])  # all or none, then recorded
            self._bwd_held.add(call)
            self._unmatched.setdefault(mid, []).append(call)
        return grad

    def _post_backward(self, call: tuple[int, int]):
        if call in self._bwd_held:
            self._bwd_held.discard(call)
            self._post_done.add(call)
            for pending in (self._unmatched, self._unadopted):
                if call in pending.get(call[0], ()):
                    pending[call[0]].remove(call)
            self._let_go(self._module_units[call[0]])

    def _grad_in(self, p: nn.Parameter):
        self._require_open("a backward")
        u = self._unit_of[id(p)]
        t = self._tensor_of[id(p)]
        if u.pushed:
            raise RuntimeError(f"ztier: a second grad for '{t.name}' after unit "
                               f"'{u.name}' was sent in this backward pass")
        if p.grad is None:
            # A post-accumulate-grad hook of the user's (they run before
            # this one) set it to None: an optimizer stepped in backward, a
            # grad dropped. Taken as zero, the engine still moved the
            # parameter (its moments, weight decay), and a step of the
            # user's own went nowhere: refused.
            raise RuntimeError(
                f"ztier: '{t.name}' had no grad when ztier's post-accumulate-grad hook ran: a "
                "hook of yours on it (register_post_accumulate_grad_hook; an optimizer stepped "
                "and zero_grad() in backward) set p.grad to None first; the engine takes every "
                "grad as the backward makes it and runs the optimizer itself "
                "(z.optimizer.step()): leave p.grad set in such hooks (read it, change it in "
                "place, or assign a tensor of its shape), and to leave a parameter out of "
                "training, set requires_grad=False before zt.offload")
        grad = p.grad if self._grad_divisor == 1 else p.grad / self._grad_divisor
        p.grad = None
        if u.acc is not None or id(p) in u.arrived:
            # A second grad in this backward (each reentrant checkpoint
            # region of a shared layer gives one): summed in fp32, rounded
            # to bf16 once when the unit is pushed.
            self._accumulator(u)[t.offset:t.offset + t.numel].add_(grad.reshape(-1))
        elif u.calls > 1:
            u.held[id(p)] = (t, grad)  # a second one may come: kept as it is for now
        else:
            self._grad_buffer(u)[t.offset:t.offset + t.numel].view(t.shape).copy_(grad)
        u.arrived.add(id(p))
        if len(u.arrived) == u.trainable and u.calls <= 1:
            self._push(u)

    def _grad_buffer(self, u: _Unit) -> torch.Tensor:
        """The unit's grad buffer (bf16, the runner's), taken at its first use."""
        if u.grads is None:
            u.grads = self.runner.grad_buffer(u.index)
            self._torch_waits_runner()
        return u.grads

    def _accumulator(self, u: _Unit) -> torch.Tensor:
        """The unit's fp32 sum of this backward's grads, made at its first
        second grad from what came before (in the grad buffer or held)."""
        if u.acc is None:
            acc = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
            if u.grads is not None:
                acc.copy_(u.grads)
            for t, g in u.held.values():
                acc[t.offset:t.offset + t.numel].copy_(g.reshape(-1))
            u.held.clear()
            u.acc = acc
        return u.acc

    def _collect_grads(self, u: _Unit):
        """The unit's held grads, or its fp32 sum, into its grad buffer."""
        if u.acc is not None:
            self._grad_buffer(u).copy_(u.acc)
            u.acc = None
        elif u.held:
            flat = self._grad_buffer(u)
            for t, g in u.held.values():
                flat[t.offset:t.offset + t.numel].view(t.shape).copy_(g)
            u.held.clear()

    def _push(self, u: _Unit):
        self._collect_grads(u)
        boundary = self._micro + 1 == self.grad_accumulation
        unpushed = len(self.units) - u.tally[0]  # (deferred units are pushed)
        if boundary and unpushed == 1 and not self._deferred:
            # The boundary's last unit: the engine starts the step when it
            # lands, so it waits for optimizer.step() (and its lr).
            self._deferred.append(u)
            u.pushed = True
            return
        u.pushed = True
        try:
            self._send(u)
        except _C.ZtierError:
            u.pushed = False
            raise

    def _send(self, u: _Unit):
        """The unit's grad buffer to the runner. The bookkeeping goes first:
        an interrupt (Ctrl-C) raised the moment the call returns must find
        the buffer handed over (zeroing it then wrote into freed memory)."""
        if u.grads is None:
            u.grads = self.runner.grad_buffer(u.index)  # zeros
        self._runner_waits_torch()
        grads, u.grads = u.grads, None
        u.sent = True
        try:
            self.runner.push_grads(u.index)
        except _C.ZtierError:  # refused: the buffer is still this unit's
            u.grads, u.sent = grads, False
            raise

    def _end_backward(self):
        self._callback_queued = False
        self._unmatched.clear()
        self._unadopted.clear()
        for call in list(self._bwd_held):
            self._bwd_held.discard(call)
            self._let_go(self._module_units[call[0]])
        if (self.world_size == 1 and not self._deferred
                and not any(u.arrived or u.pushed for u in self.units)):
            # A backward that gave this model no grad (torch.autograd.grad of
            # an input, a pass through it while it is frozen): no micro-step.
            # (With several ranks every rank pushes, zeros where it got no
            # grad, so that their collectives stay in step.)
            self._phase = "idle"
            return
        for u in self.units:
            if not u.pushed:
                self._push(u)
        self._phase = "idle"
        self._micro += 1
        if self._micro < self.grad_accumulation:
            self._end_micro_step()
        else:
            self._awaiting_step = True

    def _forget_micro_step(self):
        """Every unit's marks of the micro-step (grads in, sent, calls)."""
        for u in self.units:
            u.pushed = False
            u.sent = False
            u.arrived.clear()
            u.calls = 0
        if self.units:
            self.units[0].tally[0] = 0  # (one an interrupt put off is mended here)

    def _end_micro_step(self):
        """The runner's Step(), the bookkeeping first: an interrupt (Ctrl-C)
        raised the moment it returns must find the micro-step ended (it left
        the runner a micro-step ahead and the model refusing everything)."""
        saved = [(u.pushed, u.sent, set(u.arrived), u.calls) for u in self.units]
        self._forget_micro_step()
        try:
            self.runner.step()
        except _C.ZtierError:  # refused: the micro-step is still open
            for u, (pushed, sent, arrived, calls) in zip(self.units, saved):
                u.pushed, u.sent, u.arrived, u.calls = pushed, sent, arrived, calls
            raise

    def _stranded(self) -> bool:
        """Whether a backward pass ended (raised) after some of its grads
        reached the engine: its step cannot be completed."""
        return (any(u.sent for u in self.units) and not self._awaiting_step
                and torch._C._current_graph_task_id() == -1)

    def _undo_stranded(self, what: str):
        """Drops the step a backward that raised midway left half sent (the
        engine discards every grad delivered since the last optimizer step),
        so that training goes on from that step; says so. With several ranks
        the peers' collectives wait for the failed rank: the job must restart."""
        earlier = self._micro
        self._discard_step(f"{what} after a backward pass that did not finish (it raised, or "
                           "was interrupted) when some of its grads had already reached the "
                           "engine")
        warnings.warn(
            f"ztier: {what} after a backward pass that did not finish (it raised, or was "
            "interrupted) when some of its grads had already reached the engine: that step's "
            "grads were discarded" +
            (f", with the {earlier} micro-batches before it (grad_accumulation="
             f"{self.grad_accumulation})" if earlier else "") +
            f"; the model is as after step {self.step_count}, and training goes on from there",
            stacklevel=_user_stacklevel())

    def _zero_grad(self):
        """optimizer.zero_grad() with grads of the coming step sent: torch
        drops a window's grads there, so the engine's pending step is dropped
        too. After the window's last backward the engine has begun the update
        (it overlaps the backward): refused, naming the order that works."""
        if self._awaiting_step:
            raise RuntimeError(
                "ztier: optimizer.zero_grad() after the step's last backward pass "
                f"(grad_accumulation={self.grad_accumulation}) and before optimizer.step(): the "
                "engine began the update as those grads came in (its optimizer overlaps the "
                "backward), so they cannot be dropped; call optimizer.step() first (zero_grad() "
                "after it, or before the forward, is the usual order), and to leave a batch out, "
                "skip its backward; where that backward was another model's loss passing "
                "through this one (a GAN's generator loss through its discriminator), freeze this "
                "model for that pass (requires_grad_(False) before its forward, True after), so "
                "that it gives this model no grads to drop")
        self._discard_step("optimizer.zero_grad() inside an accumulation window (torch drops "
                           "the window's grads there)")

    def _discard_step(self, what: str):
        """Drops every grad sent since the last optimizer step (the engine's
        pending step, and this model's marks of it). With several ranks the
        peers' collectives wait for this one: refused, the job must restart."""
        if self.world_size > 1:
            raise RuntimeError(
                f"ztier: {what}: with {self.world_size} ranks the other ranks' collectives wait "
                "for this one, so the step cannot be undone; restart the job from its last "
                "checkpoint")
        self._require_open("the step's undo")
        self._reset_interrupted()
        self.runner.abort_step()
        self._forget_micro_step()
        self._deferred.clear()
        self._micro = 0
        self._awaiting_step = False

    def _claim_thread(self, what: str, forward: bool = False):
        """Makes this thread the one driving the model (``forward``: a root
        forward begins), unless another live thread is inside a forward or
        backward of it: two threads' passes took each other's holds and
        grads (NaN outputs, grads dropped, crashes), so the second is
        refused, naming the way that works."""
        me = threading.get_ident()
        with self._thread_lock:
            owner = self._pass_thread
            busy = (self._in_forward or self._phase == "backward" or self._fwd_held
                    or any(u.holds for u in self.units))
            if owner is not None and owner != me and busy and any(
                    t.ident == owner for t in threading.enumerate()):
                raise RuntimeError(
                    f"ztier: {what} in thread '{threading.current_thread().name}' while "
                    "another thread is inside a forward or backward of this model: one thread "
                    "at a time drives an offloaded model (evaluate in the training thread "
                    "between steps, or hold a lock around each pass and optimizer.step())")
            self._pass_thread = me
            if forward:
                self._in_forward = True

    def _refuse_step_in_gathered(self):
        """RuntimeError inside gathered(); optimizer.step() asks before its
        closure runs (its forward and backward were taken, then the step
        refused)."""
        if self._gathering:
            # Its parameters are copies taken as it began: a state_dict or an
            # EMA update after the step, inside it, silently read the old
            # weights (a forward there computed with the new ones).
            raise RuntimeError(
                "ztier: optimizer.step() inside gathered() (open on this or another thread): "
                "the parameters there are copies of the weights as it began, and would not show "
                "the step; take the step outside the `with` block (enter gathered() again after "
                "it to read the new weights). Nothing was taken; the grads wait for it")

    def _optimizer_step(self, lrs: list[float]):
        self._require_open("optimizer.step()")
        self._claim_thread("optimizer.step()")
        if self._stranded():
            self._undo_stranded("optimizer.step()")
            raise RuntimeError(
                "ztier: optimizer.step() after a backward pass that did not finish: its step "
                f"was discarded, none was taken (the model is as after step {self.step_count}); "
                "run the forward and backward again")
        if (not self._awaiting_step and self._phase == "backward"
                and torch._C._current_graph_task_id() == -1):
            # A backward that raised before any grad of it reached the
            # engine: it goes, with the grads it left on the parameters
            # (not the user's to set to None, as _check_grads_left would say).
            self._reset_interrupted()
            if self._micro == 0:
                raise RuntimeError(
                    "ztier: optimizer.step() after a backward pass that did not finish (it "
                    "raised, or was interrupted) before any of its grads reached the engine: "
                    f"none was taken (the model is as after step {self.step_count}); run the "
                    "forward and backward again")
        self._check_grads_left()
        if not self._awaiting_step:
            if self._micro == 0:
                raise RuntimeError(
                    "ztier: optimizer.step() after 0 backward passes since the last step: "
                    f"offload(grad_accumulation={self.grad_accumulation}) steps on the grads "
                    "of the backward passes before it; run one first")
            self._complete_window(lrs)
            return
        self._set_learning_rates(lrs)
        for u in self._deferred:
            if not u.sent:  # (an interrupted optimizer.step() sent it already)
                self._send(u)
        self._deferred.clear()
        self._close_micro_step(0)

    def _check_grads_left(self):
        """At optimizer.step(), before anything is sent: a parameter's .grad
        now is one the engine never got (ztier's post-accumulate-grad hook
        takes each grad a backward makes and clears .grad), assigned or
        changed after it (p.grad = ..., torch.autograd.grad's results set
        by hand, a grad zeroed to leave a parameter out). The step went on
        the backward's grads alone (or was refused as having none),
        silently: refused, naming the parameter; the pending step waits as
        it was. (A grad a backward that raised left, torch's accumulation
        done but not ztier's hook, is dropped with the rest of that backward
        before this, by _reset_interrupted.)"""
        for u in self.units:
            for t in u.tensors:
                if t.param.grad is not None:
                    raise RuntimeError(
                        f"ztier: '{t.name}' has a .grad at optimizer.step() that the engine never "
                        "got: each grad goes to the engine as the backward makes it (ztier's "
                        "post-accumulate-grad hook takes it and sets p.grad to None), so a grad "
                        "assigned or changed after that (p.grad = ..., torch.autograd.grad's "
                        "results set by hand) goes nowhere; use loss.backward(), and change "
                        "grads in a hook of yours (register_post_accumulate_grad_hook, which "
                        "runs before ztier's, or a tensor hook, p.register_hook); no step was "
                        "taken: set the parameters' .grad to None, then call optimizer.step() "
                        "again")

    def _set_learning_rates(self, lrs: list[float]):
        """The step's learning rates, rank 0's: they are the whole job's, and
        when every rank sent its own, a rank whose schedule differed took
        some steps and not others, as the sends raced (rank 0's grads, sent
        after, are what the step waits for)."""
        if self.rank == 0:
            self.job.set_learning_rates(lrs)

    def _complete_window(self, lrs: list[float]):
        """optimizer.step() after fewer backward passes than grad_accumulation
        (an epoch's last window; Trainer steps so): the window's missing
        micro-steps push zero grads for every unit. The engine sums the
        micro-steps' grads, so the step is the one on the sum of the passes'
        grads, as torch's optimizers take it."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("ztier: optimizer.step() inside a backward pass; call it after "
                               "the backward returns")
        # (A hold left there refused the runner's step after every unit's
        # grads went out, and the model refused everything after.)
        self._let_go_of_an_interrupted_pass()
        self._set_learning_rates(lrs)
        last = False
        while not last:
            for u in self.units:
                if not u.sent:  # (an interrupted step() sent some already)
                    self._send(u)  # its zeroed grad buffer
            last = self._micro + 1 == self.grad_accumulation
            self._close_micro_step(0 if last else self._micro + 1)

    def _close_micro_step(self, micro: int):
        """Ends the micro-step with the runner's Step(), the count (``micro``
        micro-steps toward the next optimizer step, none awaited) first: an
        interrupt (Ctrl-C) raised the moment Step() returns must find the
        micro-step counted. A refused Step() leaves both as they were."""
        before = self._micro, self._awaiting_step
        self._micro, self._awaiting_step = micro, False
        try:
            self._end_micro_step()
        except _C.ZtierError:  # refused: the micro-step is still open
            self._micro, self._awaiting_step = before
            raise
        if micro == 0:  # a step: the forwards before it cannot train
            self._first_call = self._next_call

    # ---- state between steps

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (the version the next forward reads)."""
        self._require_open("step_count")
        return self.runner.version

    def wait(self):
        """Blocks until the optimizer has finished the last step."""
        self._require_open("wait")
        self.job.wait_published(self.runner.version, self.session.wait_timeout)

    def grad_norm(self) -> float:
        """The global grad norm (before clipping) of the last finished step."""
        self.wait()
        return self.job.counters()["last_grad_norm"]

    def _require_open(self, what: str):
        if self.job is None:
            raise RuntimeError(f"ztier: {what} on a closed Offload (close() let go of the "
                               "engine's job): offload the model again, then load_checkpoint")

    def _grads_sent(self) -> bool:
        """Whether grads of the coming optimizer step went to the engine
        (a backward, or micro-steps of an accumulation window, since the
        last step): until that step, the engine refuses reads of its state."""
        return self._awaiting_step or self._micro > 0 or any(u.pushed for u in self.units)

    def _between_steps(self, what: str, reads_only: bool = True):
        """Refuses `what` unless the engine is between optimizer steps. A
        finished forward whose graph may never get its backward (an
        evaluation that kept grad on) leaves nothing pending: reading the
        state (``reads_only``: save, export, masters) goes on; replacing it
        (a load) does not, since a backward of that forward would then mix
        the old weights' activations with the new weights."""
        self._require_open(what)
        if self._stranded():
            self._undo_stranded(what)
        nothing_sent = not self._grads_sent()
        if (self._phase == "backward" and nothing_sent
                and torch._C._current_graph_task_id() == -1):
            self._reset_interrupted()  # a backward that raised before any grad went out
        if (self._in_forward and self._phase != "backward"
                and self._pass_thread == threading.get_ident()
                and torch._C._current_graph_task_id() == -1
                and not self._root_call_on_stack()):
            # A forward that raised (its root's post-hook never ran): the
            # holds it left go, as the next forward lets them go (an
            # emergency save in the except clause was refused).
            self._reset_interrupted()
            self._in_forward = False
        if (not self._in_forward and self._phase != "backward" and self._fwd_held
                and self._pass_thread == threading.get_ident()
                and torch._C._current_graph_task_id() == -1
                and not self._module_call_on_stack(set(self._fwd_held))):
            self._reset_interrupted()  # a forward past the root that raised
        if not self._in_forward:
            self._end_evaluation_pass()  # the model is used between steps
        inside = self._phase == "backward" or self._fwd_held or any(u.holds for u in self.units)
        if inside or not nothing_sent:
            raise RuntimeError(f"ztier: {what} between optimizer steps only (after "
                               "optimizer.step(), outside forward and backward)")
        if not reads_only and self._phase != "idle":
            raise RuntimeError(
                f"ztier: {what} after a forward whose output needs grad and whose backward has "
                "not run: a backward of it would mix the old weights' activations with the new "
                "weights. Run its backward (and optimizer.step()) first, or run evaluation "
                "forwards under torch.no_grad()")
        self.wait()

    def claim_checkpoint_dir(self, directory: str):
        """Locks ``directory`` for this model's checkpoints until it is closed,
        so a second run on it is refused at once (naming the holder's pid).
        With several ranks, rank 0 claims it (on its own, or every rank calls
        this)."""
        self._by_rank0("claim_checkpoint_dir",
                       lambda: self.job.claim_checkpoint_dir(os.fspath(directory)),
                       between_steps=False)

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers (BatchNorm's running statistics,
        say) by state-dict name, and the parameters the engine does not keep
        (not floating point): the engine holds the others only, so these go
        into checkpoints and exports beside them."""
        out = {}
        for mname, m in self.module.named_modules():
            for bname, b in m._buffers.items():
                if b is not None and bname not in m._non_persistent_buffers_set:
                    out.setdefault(f"{mname}.{bname}" if mname else bname, b)
        # And the parameters the engine does not keep (an integer index
        # table, one of no elements), which stay in the module as buffers do.
        for name, p in self.module.named_parameters():
            if id(p) not in self._tensor_of:
                out.setdefault(name, p)
        return out

    def _check_buffers(self, values, where: str, then: str = ""):
        """Refuses buffer values that would not fit the module's; `then` ends
        the message (a load checks before it replaces any state)."""
        if not isinstance(values, dict):
            raise ValueError(f"ztier: {where} holds no dict of buffers{then}")
        for name, b in self.persistent_buffers().items():
            v = values.get(name)
            if v is None:
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(b.shape):
                what = (f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor)
                        else f"a {type(v).__name__}")
                raise ValueError(f"ztier: buffer '{name}' in {where} has {what}, the model's "
                                 f"has shape {tuple(b.shape)}{then}")

    def _set_buffers(self, values: dict[str, torch.Tensor], where: str):
        self._check_buffers(values, where)
        buffers = self.persistent_buffers()
        missing = [n for n in buffers if n not in values]
        if missing:
            warnings.warn(f"ztier: {where} has no value for {len(missing)} persistent buffers "
                          f"(e.g. '{missing[0]}'); they keep the values they have",
                          RuntimeWarning, stacklevel=3)
        with torch.no_grad():
            for name, b in buffers.items():
                if name in values:
                    b.copy_(values[name].to(device=b.device, dtype=b.dtype))

    def save_checkpoint(self, directory: str):
        """The fp32 masters and moments of every unit, and the step (atomic),
        and the module's persistent buffers (``ztier-buffers-step-S.pt``
        beside them, written before the engine's manifest commits the save,
        so an interrupted save leaves the last checkpoint whole, its buffers
        included). With several ranks rank 0 writes: it may call it alone, or
        every rank does (each then raises rank 0's error)."""
        directory = os.fspath(directory)

        def save():
            buffers = {n: b.detach().cpu() for n, b in self.persistent_buffers().items()}
            step = self.runner.version
            mine = os.path.join(directory, _buffers_file(step))
            if buffers:
                # The directory is this job's first (as the engine's save
                # claims it; the claim makes it): a save refused there, as
                # another run's, must not touch that run's buffers file.
                self.job.claim_checkpoint_dir(directory, until_closed=False)
                tmp = mine + ".tmp"
                try:
                    # On the disk before the manifest that names it commits.
                    with open(tmp, "wb") as f:
                        torch.save({"step": step, "buffers": buffers,
                                    "crc32": _buffers_crc(buffers)}, f)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, mine)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            try:
                self.job.save_checkpoint(directory)
            except BaseException:
                if buffers and _checkpoint_step(directory) != step:
                    os.unlink(mine)  # no manifest names this step
                raise
            # The buffers of earlier saves (and of another model's) go.
            keep = os.path.basename(mine) if buffers else None
            for name in os.listdir(directory):
                if (name == BUFFERS_FILE or _BUFFERS_STEP.fullmatch(name)) and name != keep:
                    try:
                        os.unlink(os.path.join(directory, name))
                    except FileNotFoundError:
                        pass

        self._by_rank0("save_checkpoint", save)

    def load_checkpoint(self, directory: str):
        """Every rank calls it; rank 0 reads the files into the engine."""
        self._between_steps("load_checkpoint", reads_only=False)
        directory = os.fspath(directory)
        wants_buffers = bool(self.persistent_buffers())
        saved = nothing_read = {"buffers": {}}
        path = None

        def read_buffers(step=None):
            # Before any state is replaced: a damaged file changes nothing
            # (it failed after the engine had loaded, the buffers stale).
            # The file of the manifest's step (or `step`'s); one of an older
            # ztier, else.
            nonlocal saved, path
            path = os.path.join(directory, _buffers_file(
                _checkpoint_step(directory) if step is None else step))
            if step is None and not os.path.exists(path):
                path = os.path.join(directory, BUFFERS_FILE)
            if wants_buffers and os.path.exists(path):
                try:
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
                except FileNotFoundError:
                    return  # a save into the directory meanwhile removed it: see below
                except Exception as e:
                    raise RuntimeError(f"ztier: the checkpoint's buffers, {path}, cannot be read "
                                       f"({e}); nothing was loaded") from e
                if not isinstance(loaded, dict):
                    raise ValueError(f"ztier: {path} holds no checkpoint's buffers; nothing was "
                                     "loaded")
                saved = loaded
                self._check_buffers(saved.get("buffers"), path, "; nothing was loaded")
                if "crc32" in saved and saved["crc32"] != _buffers_crc(saved["buffers"]):
                    raise RuntimeError(f"ztier: the checkpoint's buffers, {path}, are damaged "
                                       "(their checksum differs); nothing was loaded")

        def load():
            read_buffers()
            try:
                self.job.load_checkpoint(os.fspath(directory))
            except ValueError as e:
                if ("does not fit" in str(e) and "has shape" not in str(e)
                        and any(t.frozen for u in self.units for t in u.tensors)):
                    # A frozen tensor goes to a unit of its own: freezing
                    # other tensors than the checkpoint's model did lays
                    # the model out in other units.
                    raise type(e)(
                        f"{e} (this model freezes some parameters; a checkpoint of a model "
                        "that froze others, or none, is laid out in other units: load it "
                        "into the model as it was, export_safetensors, then offload this "
                        "one with weights=)") from e
                if "does not fit" in str(e) and "units" in str(e) and "has shape" not in str(e):
                    # Another layout: blocks found otherwise (nn.Sequential
                    # stacks became blocks), or chosen otherwise.
                    raise type(e)(
                        f"{e} (this model's units: {', '.join(u.name for u in self.units)}; a "
                        "checkpoint of the same model laid out in other units, e.g. saved when "
                        "its nn.Sequential of blocks was one unit, loads into a model offloaded "
                        "with that layout: offload(..., blocks=[...] naming its blocks, or [] "
                        "for one unit))") from e
                raise

        self._every_rank_at("load_checkpoint")
        self._drop_runner()  # its version is the old one
        try:
            self._on_rank0(load)
            if self.rank != 0:
                read_buffers()  # every rank keeps its module's buffers
        finally:
            # A load that failed changed nothing: the model goes on from its
            # own state with a runner as before.
            self.runner = self._make_runner()
        if self.rank == 0:
            self._warn_of_unfrozen(directory)
        if wants_buffers:
            if saved.get("step") != self.runner.version:
                # Another job saved into the directory between the read of
                # the buffers and the engine's load, which took the newer
                # manifest: the buffers of the step loaded, while there
                # (the weights of one step and the buffers of another went
                # in without a word once the older file was gone).
                before, before_path = saved, path
                read_buffers(self.runner.version)
                if saved is before:
                    path = before_path
            if saved is not nothing_read and saved.get("step") != self.runner.version:
                warnings.warn(f"ztier: {path} is of step {saved.get('step')}, the checkpoint "
                              f"of step {self.runner.version}", RuntimeWarning, stacklevel=2)
            self._set_buffers(saved["buffers"], path)

    def _warn_of_unfrozen(self, directory: str):
        """Warns of tensors a loaded checkpoint's model kept frozen that
        train here: they have no moments, and AdamW's bias correction is the
        job's (its steps), not theirs: their first updates are larger than
        a new parameter's in torch (lr at step 1)."""
        try:
            with open(os.path.join(directory, "manifest.json")) as f:
                m = json.load(f)
            was_frozen = {t["name"] for u in m["units"] for t in u["tensors"]
                          if t.get("frozen") is True}
            adam_step = m.get("adam_step")
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return
        now = [t.name for u in self.units for t in u.tensors
               if not t.frozen and t.name in was_frozen]
        if not now or not isinstance(adam_step, int) or adam_step <= 0:
            return
        named = ", ".join(f"'{n}'" for n in now[:4]) + (
            f" and {len(now) - 4} more" if len(now) > 4 else "")
        warnings.warn(
            f"ztier: frozen in the checkpoint {directory}, trained here: {named}. Their m and v "
            f"start from zero while AdamW's bias correction counts the job's {adam_step} steps, "
            "so their first updates are several times the learning rate ((1 - beta1^k) / "
            "sqrt(1 - beta2^k) at their k-th step with a steady gradient: 3.2x at the first, "
            "6.6x at the 12th at betas (0.9, 0.999)), where torch moves a new parameter by the "
            "learning rate; a warmup of their learning rate (a param group of their own) "
            "covers it", RuntimeWarning, stacklevel=3)

    def export_safetensors(self, path: str, dtype: str | torch.dtype = "bfloat16"):
        """The consolidated weights under the model's state-dict names (rank 0
        writes: it may call it alone, or every rank does). ``dtype``:
        "bfloat16" (the params the model computes with) or "float32" (the
        fp32 masters), or torch.bfloat16 / torch.float32."""
        path = os.fspath(path)
        dtype = _export_dtype(dtype)
        self._by_rank0("export_safetensors", lambda: self._export(path, dtype))

    def _export(self, path: str, dtype: str):
        self._check_unchanged()
        buffers = {n: b.detach().cpu().contiguous()
                   for n, b in self.persistent_buffers().items()}
        if not buffers:
            self.job.export_safetensors(path, dtype)
            return
        # The weights go to a file beside it, and the whole file replaces
        # `path` at once: a buffer safetensors cannot hold, or a name taken
        # twice, fails with the file there as it was (it was left holding
        # the weights alone).
        # (Named for this call: two jobs exporting to one path wrote one
        # temporary file, and published each other's halves.)
        weights = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.weights"
        try:
            self.job.export_safetensors(weights, dtype)
            _add_to_safetensors(weights, buffers, path)
        finally:
            if os.path.exists(weights):
                os.unlink(weights)

    def save_pretrained(self, directory: str, dtype: str | torch.dtype = "bfloat16", **kwargs):
        """A Hugging Face model directory: config.json (when the model has a
        config; its dtype the written weights'), generation_config.json (a
        model that generates) and model.safetensors. A sharded checkpoint
        there before (model.safetensors.index.json and the shards it names)
        is removed once the new file is written. ``dtype`` as
        export_safetensors'; ``safe_serialization=True`` is taken (False is
        refused: safetensors only). Rank 0 writes, as export_safetensors."""
        from ztier import hf
        hf.save_pretrained(self, directory, dtype, **kwargs)

    def _read_master(self, u: _Unit) -> torch.Tensor:
        """The unit's fp32 masters (padded, on the host), read from the engine."""
        flat = torch.empty(u.padded, dtype=torch.float32)
        self.job.read_master(u.index, flat)
        return flat

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by tensor name (a copy; between steps)."""
        self._between_steps("master_weights")
        out = {}
        for u in self.units:
            flat = self._read_master(u)
            for t in u.tensors:
                out[t.name] = flat[t.offset:t.offset + t.numel].view(t.shape).clone()
        return out

    def close(self):
        """Unhooks the model and lets go of the engine's job (its parameters
        stay NaN placeholders: export or gather what you need first). A step
        left pending (backward without optimizer.step()) is dropped. Closing
        again does nothing."""
        if self.job is None:
            return
        self._remove_hooks()
        # Whatever still holds the runner's buffers (a pending step's grads).
        self._deferred.clear()
        for u in self.units:
            u.arrived.clear()
            u.held.clear()
            u.acc = None
            u.holds = 0
            u.storage = None
        for u in self.units:
            for t in u.tensors:
                self._park(t)
        self._drop_runner()
        self._collectives = None
        self.job = None
        # The engine goes once no other model of this process uses it (its
        # swap directories and DRAM free for another session at once).
        self.session = None
        marker = getattr(self.module, "_ztier_offload", None)
        if marker is not None and marker() is self:
            self.module._ztier_offload = None
        # Its parameters are placeholders now: a forward would compute NaN.
        self.module.register_forward_pre_hook(_closed)
        self.module._register_load_state_dict_pre_hook(_closed)
        self.module.register_state_dict_pre_hook(_closed)  # it would be NaN
        if self._hosted is not None:
            self._hosted.close()


_sessions: "weakref.WeakValueDictionary[tuple, _C.Session]" = weakref.WeakValueDictionary()
_sessions_lock = threading.Lock()  # guards _session_locks
# A lock per key while callers ask for that key's engine, and how many do
# (kept for good, one stayed per key ever asked for).
_session_locks: dict[tuple, list] = {}
_hosted_daemons: list = []  # closed at exit, before the interpreter tears down


def _remove_stale_hosted_dirs(base: str, age: float = 60.0) -> list[str]:
    """Removes the socket directories (``ztier-*`` under ``base``) that a
    rank 0 killed with its hosted ztierd left behind (each kill -9 left one
    for good): this user's, holding that ztierd's socket and lock file only,
    untouched for ``age`` seconds, and whose lock no process holds (a live
    ztierd holds its own). Returns those removed; any error skips one."""
    import fcntl
    import stat

    removed = []
    try:
        names = sorted(n for n in os.listdir(base) if n.startswith("ztier-"))[:256]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        d = os.path.join(base, name)
        lock = os.path.join(d, "ztierd.sock.lock")
        try:
            st = os.lstat(d)
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
                    or now - st.st_mtime < age
                    or not set(os.listdir(d)) <= {"ztierd.sock", "ztierd.sock.lock"}):
                continue
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused: its ztierd lives
            shutil.rmtree(d)
            removed.append(d)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class _HostedDaemon:
    """The ztierd rank 0 hosts for its node's ranks, and the temporary
    directory of its socket, which goes with it (closing again does nothing)."""

    def __init__(self, daemon, directory: str):
        self.daemon = daemon
        self.directory = directory

    def close(self):
        self.daemon.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        try:  # closed: nothing left for the exit to close (one stayed listed per offload)
            _hosted_daemons.remove(self)
        except ValueError:
            pass


@atexit.register
def _close_hosted_daemons():
    for d in list(_hosted_daemons):
        d.close()


_live_offloads: "weakref.WeakSet[Offload]" = weakref.WeakSet()


_torch_clip = {}  # torch.nn.utils' clipping functions by name, once _watch_clip wrapped them


def _watch_clip(name: str, check):
    """Wraps torch.nn.utils' ``name`` (once): ``check(offloads)`` runs
    first with the live Offloads whose parameters the call was given, then
    torch's does what it does."""
    if name in _torch_clip:
        return
    original = _torch_clip[name] = getattr(torch.nn.utils, name)

    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        check([z for z in list(_live_offloads)
               if z.job is not None and not ids.isdisjoint(z._tensor_of.keys())])
        return original(parameters, *args, **kwargs)

    setattr(torch.nn.utils, name, clip)


def _watch_clip_grad_norm():
    """torch.nn.utils.clip_grad_norm_ on an offloaded model's parameters
    clips nothing (their grads left for the engine as they were made) and
    counts them as 0, silently: transformers' Trainer calls it with its
    default max_grad_norm of 1.0. It warns of it, once for each Offload
    without the engine's clipping; it still does what torch's does."""

    def check(offloads):
        for z in offloads:
            if z.clip_grad_norm or z._clip_warned:
                continue
            z._clip_warned = True
            warnings.warn(
                "ztier: torch.nn.utils.clip_grad_norm_ clips nothing on an offloaded model's "
                "parameters (their grads left for the engine as they were made) and counts them "
                "as 0; give the clipping to the engine: offload(..., clip_grad_norm=...)",
                RuntimeWarning, stacklevel=3)

    _watch_clip("clip_grad_norm_", check)


def _watch_clip_grad_value():
    """torch.nn.utils.clip_grad_value_ on an offloaded model's parameters
    finds no grads (they left for the engine as they were made): torch's
    raised "Expected !nested_tensorlist[0].empty()". It is refused in
    ztier's words, saying what the engine clips instead; on other
    parameters it is torch's."""

    def check(offloads):
        if offloads:
            raise RuntimeError(
                "ztier: torch.nn.utils.clip_grad_value_ on an offloaded model's parameters: "
                "their grads left for the engine as they were made (p.grad is None), so there "
                "is nothing to clip here; the engine clips by the global norm only: "
                "offload(..., clip_grad_norm=...)")

    _watch_clip("clip_grad_value_", check)


_foreign_step_hook = None


def _watch_foreign_optimizers():
    """A torch optimizer's step() over an offloaded model's parameters (one
    made before or after zt.offload; transformers' Trainer makes a
    torch.optim.AdamW unless given optimizers=) finds no grads on them and
    does nothing, and the engine waits for z.optimizer.step(): the next
    forward then asked for an optimizer.step() the user believed done.
    Refused at that step(), naming the optimizer to use (a global pre-hook
    of torch's, installed once)."""
    global _foreign_step_hook
    if _foreign_step_hook is not None:
        return

    def hook(optimizer, args, kwargs):
        if isinstance(optimizer, _Optimizer) or not _live_offloads:
            return
        for z in list(_live_offloads):
            if z.job is None:
                continue
            # A wrapper made over z.optimizer's own param groups (Lookahead's
            # kind: its step() steps z.optimizer) is not refused.
            ours = {id(g) for g in z.optimizer.param_groups}
            ids = {id(p) for g in optimizer.param_groups if id(g) not in ours
                   for p in g["params"]}
            if not ids.isdisjoint(z._tensor_of.keys()):
                raise RuntimeError(
                    f"ztier: {type(optimizer).__module__}.{type(optimizer).__name__}.step() over "
                    "an offloaded model's parameters: their grads go to the engine (p.grad is "
                    "None here) and only the engine's optimizer updates them; step `z.optimizer` "
                    "(zt.offload's, with its param groups and a scheduler of yours), leave the "
                    "offloaded parameters out of this one, and with transformers' Trainer pass "
                    "optimizers=(z.optimizer, scheduler or None)")

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _foreign_step_hook = register_optimizer_step_pre_hook(hook)


@atexit.register  # runs before _close_hosted_daemons (registered after it)
def _close_offloads():
    """Offloads still open at exit (a live loss's graph can hold one past
    the interpreter's teardown) close, so their engines go: the swap files
    and locks with them."""
    for z in list(_live_offloads):
        try:
            z.close()
        except Exception:  # exiting: what one cannot close, the OS frees
            pass


@contextlib.contextmanager
def _interrupts_deferred():
    """A Ctrl-C (SIGINT) that arrives inside is raised when it ends: the
    bookkeeping of an optimizer step and the engine's Step() happen both or
    neither (an interrupt between them left the engine holding a step the
    model never took). Only on the main thread, which alone gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import signal

    got = []
    try:
        before = signal.signal(signal.SIGINT, lambda sig, frame: got.append(frame))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if got:
            if callable(before):
                before(signal.SIGINT, got[0])
            elif before == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)  # its default action, now


def _in_reentrant_checkpoint() -> bool:
    """This thread runs the forward of torch.utils.checkpoint's reentrant
    form (which runs it without grad, and again in backward)."""
    import torch.utils.checkpoint as checkpoint

    fn = getattr(checkpoint, "CheckpointFunction", None)
    code = getattr(getattr(fn, "forward", None), "__code__", None)
    f = sys._getframe(1)
    while code is not None and f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _tell_ranks_it_failed(error: BaseException, rank: int, world: int):
    """A rank whose offload() failed before the ranks met (its arguments)
    tells the others, in the collectives they are on their way to: rank 0's
    broadcast in _meet_ranks, then their first agreement (_ranks_agree),
    where each raises naming this rank and the error. Best effort: the
    caller raises ``error`` whatever happens here."""
    import torch.distributed as dist

    text = f"{type(error).__name__}: {error}"
    info = [None, None, None, 0, ("could not offload its model", text) if rank == 0 else None]
    try:
        dist.broadcast_object_list(info, src=0)
        if rank != 0 and info[4] is None:  # the others go on to their first agreement
            dist.all_gather_object([None] * world, (text, None))
    except BaseException:  # noqa: BLE001 -- the peers are gone: the caller raises its error
        pass


def _distributed() -> tuple[int, int]:
    """(rank, world size) of torch.distributed when it is initialized, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        warnings.warn(
            f"ztier: WORLD_SIZE is {world} (a launcher such as torchrun started this process), "
            "but torch.distributed is not initialized, so this process trains a model of its "
            "own; for one job of every rank call torch.distributed.init_process_group() before "
            "offload()", RuntimeWarning, stacklevel=4)
    return 0, 1


def open_session(config: str | None = None, settings: dict | None = None,
                 daemon: str | None = None,
                 daemon_has_these_settings: bool = False) -> _C.Session:
    """The engine for these arguments, shared by every model of this process
    that asks for the same (one embedded engine owns its DRAM budget and swap
    directories; a second one on the same directories would be refused). It
    lives while a model uses it. ``daemon_has_these_settings``: the ztierd at
    ``daemon`` was made with them (no warning that its own apply)."""
    text = _settings_text(settings)
    key = (os.fspath(config) if config else None, tuple(sorted(text.items())), daemon or "")
    # Two threads asking for one engine at once share it (each opened its
    # own, and the second was refused its swap directories); threads asking
    # for different ones do not wait on each other.
    with _sessions_lock:
        entry = _session_locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:
            session = _sessions.get(key)
            if session is not None and session.health:
                # Its ztierd is gone (restarted since), or this is a child forked
                # from the process that opened it: a session of its own.
                session = None
            if session is None:
                session = _C.Session.open(key[0], text, key[2], daemon_has_these_settings)
                _sessions[key] = session
    finally:
        with _sessions_lock:
            entry[1] -= 1
            if entry[1] == 0:
                del _session_locks[key]
    return session


def _settings_text(settings: dict | None) -> dict[str, str]:
    """``settings=`` as the config's text: lists and tuples (swap paths,
    betas) comma-separated, booleans true / false, paths as paths."""
    def text(key, value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            items = [text(key, v) for v in value]
            if any("," in i for i in items):
                raise ValueError(f"ztier: settings[{key!r}]: an item of {value!r} holds a comma, "
                                 "which separates the items")
            return ",".join(items)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2.0**63:
            return str(int(value))  # 1.5e9 bytes, not "1500000000.0"
        if isinstance(value, (str, numbers.Number)):
            return str(value)
        raise TypeError(f"ztier: settings[{key!r}] is a {type(value).__name__}; give a string, "
                        "a number, a bool, a path, or a list or tuple of them")

    return {str(k): text(k, v) for k, v in (settings or {}).items()}


def _closed(*args, **kwargs):
    """The hook a closed Offload leaves on its model."""
    raise RuntimeError(
        "ztier: this model's Offload was closed, and its parameters went with it (they are "
        "NaN placeholders): export_safetensors or gathered() before close(), then load the "
        "weights into a fresh model (or offload one with weights=)")


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, from the caller of this, that points at
    the first frame outside ztier and torch (torch wraps an optimizer's step
    in frames of its own)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "ztier", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def _own_params(m: nn.Module) -> list:
    """The parameters a call of ``m`` reads as its own: its direct ones and
    those of its nn.ParameterList / nn.ParameterDict children, which hold
    parameters for it and are never called themselves."""
    own = [p for p in m._parameters.values() if p is not None]
    for c in m.children():
        if isinstance(c, _PARAM_CONTAINERS):
            own.extend(_own_params(c))
    return own


_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)
def _never_called(m: nn.Module) -> bool:
    """A container of modules that is never called itself (a ModuleList or
    ModuleDict without a forward of its own; one with a forward, as an MoE
    layer's list of experts, is called): no block."""
    return (isinstance(m, (nn.ModuleList, nn.ModuleDict))
            and type(m).forward is nn.Module.forward)


def _offloadable(p: nn.Parameter) -> bool:
    """Whether the engine keeps ``p``: a floating-point parameter with
    elements (the others, an integer index table or a frozen complex
    parameter, stay as they are)."""
    return p.numel() > 0 and p.is_floating_point()


def _complex_trainable(name: str, p: nn.Parameter, what: str) -> str:
    return (f"ztier: parameter '{name}' {what} ({p.dtype}) and trainable: the engine trains "
            "real parameters only (fp32 masters, bf16 values), and it would never be updated; "
            "store its real and imaginary parts as a real parameter, "
            "nn.Parameter(torch.view_as_real(w)) of shape (..., 2), and take "
            "torch.view_as_complex(w.float()) of it in the forward, or freeze it "
            "(requires_grad=False: it then stays in the module as it is)")


def _keeps_buffer_dtype(module: nn.Module) -> bool:
    """Whether ``module``'s floating-point buffers keep their dtype instead
    of following the compute dtype: a rotary embedding's (Hugging Face's
    ``*RotaryEmbedding`` classes, which transformers finds by that name
    too). Its frequencies rounded to bf16 move each position's angle by up
    to 2^-9 of it (radians at a few thousand tokens), and those models read
    them as fp32 whatever the compute dtype."""
    return "rotary" in type(module).__name__.lower()


# The parametrizations torch.nn.utils.parametrizations registers, by class.
_PARAMETRIZATIONS = {"_WeightNorm": "torch.nn.utils.parametrizations.weight_norm",
                     "_SpectralNorm": "torch.nn.utils.parametrizations.spectral_norm",
                     "_Orthogonal": "torch.nn.utils.parametrizations.orthogonal"}


def _reparametrization(model: nn.Module, names: Iterable[str]):
    """Whether one of the parameters ``names`` (state-dict names of
    ``model``'s) is part of a reparametrized tensor: (the tensor's name, what
    reparametrized it, the parameters it is computed from), else None. A
    parametrization keeps them under ``<module>.parametrizations.<tensor>``;
    torch.nn.utils.weight_norm (``<tensor>_g``, ``<tensor>_v``), spectral_norm
    and prune (``<tensor>_orig``) are forward pre-hooks of the module."""
    from torch.nn.utils import prune
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    hooks = ((WeightNorm, "name", "torch.nn.utils.weight_norm"),
             (SpectralNorm, "name", "torch.nn.utils.spectral_norm"),
             (prune.BasePruningMethod, "_tensor_name", "torch.nn.utils.prune"))
    for name in names:
        path, _, leaf = name.rpartition(".")
        if ".parametrizations." in f".{path}.":
            head, _, tensor = f".{path}".rpartition(".parametrizations.")
            try:
                module = model.get_submodule(head[1:])
                plist = module.parametrizations[tensor]
            except (AttributeError, KeyError):
                continue
            prefix = f"{head[1:]}." if head[1:] else ""
            kinds = [_PARAMETRIZATIONS.get(type(p).__name__,
                                           f"register_parametrization ({type(p).__name__})")
                     for p in plist]
            now = [f"{prefix}parametrizations.{tensor}.{n}" for n, _ in plist.named_parameters()]
            return prefix + tensor, " and ".join(kinds) or "register_parametrization", now
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        prefix = f"{path}." if path else ""
        for hook in module._forward_pre_hooks.values():
            for kind, attr, what in hooks:
                tensor = getattr(hook, attr, None) if isinstance(hook, kind) else None
                parts = {tensor, f"{tensor}_g", f"{tensor}_v", f"{tensor}_orig"}
                if tensor and leaf in parts:
                    now = [prefix + n for n, _ in module.named_parameters(recurse=False)
                           if n in parts]
                    return prefix + tensor, what, now
    return None


def _is_placeholder(p: torch.Tensor) -> bool:
    """Whether ``p`` is an Offload's placeholder: one NaN expanded (every
    stride 0)."""
    return p.dim() > 0 and all(st == 0 for st in p.stride())


def _holds_placeholders(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is an Offload's placeholder, or a
    copy of one (all NaN). While tracing (torch.export, torch.jit.trace)
    values are not read into Python (export's tensors are fake ones, and a
    read failed the export of a copy holding the weights): a copy made
    outside gathered() is known there by what its copy.deepcopy recorded
    (_RootZeroGrad.copied)."""
    tracing = _tracing() is not None
    if tracing:
        zero_grad = model.__dict__.get("zero_grad")
        if isinstance(zero_grad, _RootZeroGrad) and zero_grad.copied_placeholders():
            return True
    with torch.no_grad():
        for p in model.parameters():
            if _is_placeholder(p):
                return True
            if tracing:
                continue
            flat = p.detach().reshape(-1)
            if flat.numel() > 0 and flat.is_floating_point() and bool(flat[0].isnan()) and bool(
                    flat.isnan().all()):
                return True
    return False


def _offloaded(model: nn.Module) -> bool:
    """Whether ``model`` is offloaded by an Offload that is open. (A copy
    of an offloaded model carries the marker of the model it copies.)"""
    marker = getattr(model, "_ztier_offload", None)
    prev = marker() if marker is not None else None
    return prev is not None and prev.module is model


def _weak(method, target, root: bool = False):
    """``method`` (bound) called through a weak reference to its Offload, as
    a hook of ``target`` (a module or a parameter). Once the Offload is gone
    (dropped without close()) the model's parameters are NaN placeholders:
    the hook raises instead of letting it compute NaN.

    A copy of the model (copy.deepcopy) carries its hooks, called with the
    copy's modules and parameters: those are let be. One made inside
    gathered() holds the weights and runs as a plain model; one made outside
    holds placeholders, which its ``root`` hook says before a forward."""
    ref = weakref.WeakMethod(method)
    own = weakref.ref(target)

    def hook(*args, **kwargs):
        if args[0] is not own():
            if root and not _offloaded(args[0]) and _holds_placeholders(args[0]):
                raise RuntimeError(
                    "ztier: a copy of an offloaded model (copy.deepcopy) made outside "
                    "gathered(): its parameters are the original's placeholders (NaN); make "
                    "the copy inside `with offload.gathered():`, which copies the weights")
            return None
        m = ref()
        if m is None:
            raise RuntimeError(
                "ztier: this model's Offload was dropped without close() (nothing refers to it "
                "any more), and its parameters went with it: keep the object zt.offload returns "
                "while the model trains, and close() it when done")
        return m(*args, **kwargs)

    return _Hook(hook)


# Why a forward or its grads are inf/NaN, most often (_check_first_output,
# _check_first_step).
_READ_OUTSIDE = (
    "A parameter used outside the forward of the module that owns it (a weight penalty over "
    "model.parameters() added to the loss, F.linear(h, self.wte.weight) in the root's forward) "
    "reads as NaN there (its values live in the engine and are fetched for its module's "
    "forward only): use it inside the owning module (an nn.Linear head whose weight is tied "
    "to it), and leave weight decay to zt.AdamW(weight_decay=...). The same holds for a "
    "block (a unit, Offload.units): its parameters are fetched as the block itself is called, "
    "block(x), not for its submodules called from outside it (block.fc(x)) nor for "
    "block.forward(x) or checkpoint(block.forward, x); call the block, or name the submodules "
    "you call as blocks (blocks=[...]). Otherwise every step with such grads is skipped")


class _RootZeroGrad:
    """An offloaded model's ``zero_grad``: its Offload's optimizer's
    (dropping the grads of the window so far, which are in the engine, or
    refusing where the engine has begun the update), then torch's for the
    parameters the engine does not keep. Elsewhere (a copy of the model, a
    closed Offload's) torch's. A copy.deepcopy of the model gets one of its
    own, which records the copy's parameters that were copied from
    placeholders (``copied``); pickled never, as the hooks."""

    __slots__ = ("model", "copied")

    def __init__(self, model: nn.Module, copied: tuple = ()):
        self.model = weakref.ref(model)
        # Of a copy: (a weak reference to the parameter, its version then)
        # for each of its parameters copied from a placeholder (made outside
        # gathered(): NaN); a reference of None stands for one the copy's
        # memo lacked.
        self.copied = copied

    def __call__(self, set_to_none: bool = True):
        model = self.model()
        if model is None:
            return
        if _offloaded(model):
            model._ztier_offload().optimizer.zero_grad(set_to_none)
        nn.Module.zero_grad(model, set_to_none)

    def __deepcopy__(self, memo):
        model = self.model()
        copy_ = memo.get(id(model))
        if copy_ is None:
            return self
        # The parameters that are placeholders now: the units of an
        # offloaded model that neither a forward holds nor gathered() shows,
        # or those of a copy still as copied. Decided here, where the
        # original says it, not later from the copy's values: a trace
        # cannot read them (torch.export's tensors are fake).
        if _offloaded(model):
            sources = [t.param for u in model._ztier_offload().units
                       if u.holds == 0 and u.gathered is None for t in u.tensors]
        else:
            sources = self._still_copied()
        copied = []
        for p in sources:
            c = memo.get(id(p))  # (the parameters are copied before this attribute)
            copied.append((None, 0) if c is None else (weakref.ref(c), c._version))
        return _RootZeroGrad(copy_, tuple(copied))

    def _still_copied(self) -> list:
        """The parameters of ``copied`` that are as they were copied (a write
        in place, load_state_dict, gave the others their values; one
        replaced, `copy.fc.weight = nn.Parameter(...)`, is gone)."""
        out = []
        for ref, version in self.copied:
            p = ref() if ref is not None else None
            if ref is None or (p is not None and p._version == version):
                out.append(p)
        return out

    def copied_placeholders(self) -> bool:
        """Whether this model is a copy made outside gathered() some of whose
        parameters still hold what they copied, placeholders (NaN)."""
        return bool(self._still_copied())

    def __reduce__(self):
        _Hook.__reduce__(self)

    class Removal:
        """Puts torch's zero_grad back (close(), an offload that failed)."""

        def __init__(self, model: nn.Module):
            self.model = weakref.ref(model)

        def remove(self):
            model = self.model()
            if model is not None and isinstance(model.__dict__.get("zero_grad"), _RootZeroGrad):
                del model.__dict__["zero_grad"]


def _refuse_functorch(module):
    """Refuses a forward inside a torch.func transform (grad, vjp, jvp,
    vmap, jacrev, hessian), before anything is held: the hooks point the
    parameters at the unit's storage (``.data``, ``set_``), which the
    transforms' wrapped tensors do not take (a jvp crashed the process; the
    others left a unit held, and the next forward crashed letting it go)."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    if peek is None or peek() is None:
        return
    raise RuntimeError(
        f"ztier: a torch.func transform (grad, vjp, jvp, vmap, jacrev, hessian) of an offloaded "
        f"model or of a part of it (a {type(module).__name__}): its parameters are pointed at "
        "the engine's values for each module's forward, which the transforms' tensors do not "
        "allow; use torch.autograd (loss.backward(), torch.autograd.grad) on the offloaded model, "
        "or run the transform on a copy made inside `with z.gathered():` (copy.deepcopy), a "
        "plain model holding the weights")


def _tracing() -> str | None:
    """What is tracing the model into a program of its own now, if anything:
    torch.export (also torch.onnx.export's default exporter) or
    torch.jit.trace (also the TorchScript ONNX exporter)."""
    exporting = getattr(getattr(torch, "compiler", None), "is_exporting", None)
    if exporting is not None and exporting():
        return "torch.export"
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    return None


def _refuse_tracing(module):
    """Refuses torch.export / torch.jit.trace of an offloaded model or of a
    part of it, before anything is held: the program they make keeps the
    parameters as they are outside the hooks, the NaN placeholders (a traced
    model computed NaN, with only torch's trace check to say so; export, its
    fake parameters swapped in, was said to have had a module added)."""
    how = _tracing()
    if how is None:
        return
    raise RuntimeError(
        f"ztier: {how} of an offloaded model or of a part of it (a {type(module).__name__}): "
        "the program it makes keeps the parameters as they are outside each module's forward, "
        "placeholders (NaN: the values live in the engine and are fetched for that forward "
        "only); export or trace a copy made inside `with z.gathered():` (copy.deepcopy), a "
        "plain model holding the weights (for torch.onnx.export too)")


def _not_compiled(fn):
    """``fn`` kept out of torch.compile: the hooks swap the parameters'
    storage, which a compiled graph would bake in, and a hook compiled as a
    frame of its own was recompiled for each module type until dynamo's
    limit (warnings each step)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class _Hook:
    """A hook of an offloaded model: called as the function it holds; copied
    as itself (copy.deepcopy shares it, as it shares a function); pickled
    (torch.save of the whole model) never, with the ways that work said."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    @_not_compiled
    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise RuntimeError(
            "ztier: an offloaded model cannot be pickled (torch.save(model)): its parameters "
            "are placeholders between uses, its values in the engine; save the weights with "
            "export_safetensors(path), or torch.save(model.state_dict()), "
            "and the training state with save_checkpoint(dir)")


def _is_number(v) -> bool:
    """A real number, or a one-element tensor of one (torch's optimizers
    take a tensor lr), not a bool."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_argument_types(**given) -> None:
    """TypeError naming the first of offload()'s arguments ``given`` that is
    of a type it does not take (a str for settings= raised "'str' object has
    no attribute 'items'", an int name "... has no attribute 'encode'", and
    others a dump of the binding's signature); None is taken for each."""
    kinds = {
        "settings": (lambda v: isinstance(v, collections.abc.Mapping),
                     "a dict of setting names to values"),
        "name": (lambda v: isinstance(v, str), "a str"),
        "daemon": (lambda v: isinstance(v, str), "a ztierd socket's path (a str)"),
        "prefetch_depth": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
                           "an int >= 0"),
        "clip_grad_norm": (_is_number, "a number"),
        "config": (lambda v: isinstance(v, (str, os.PathLike)), "a JSON file's path"),
        "weights": (lambda v: isinstance(v, (str, os.PathLike)),
                    "a checkpoint's or export's path"),
    }
    for what, value in given.items():
        fits, want = kinds[what]
        if value is not None and not fits(value):
            raise TypeError(f"ztier: offload()'s {what}= takes {want}, got "
                            f"{type(value).__qualname__} {value!r}")


def _check_fp32(what: str, value) -> None:
    """ValueError when `value` is a finite number fp32 cannot hold (it would
    become inf, or 0), naming it as given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return  # the engine's own check names what is wrong
    v = float(value)
    if not math.isfinite(v):
        return
    f = torch.tensor(v, dtype=torch.float32).item()
    if not math.isfinite(f) or (v != 0 and f == 0):
        raise ValueError(f"ztier: {what} {value!r} is outside what fp32 holds (magnitudes from "
                         "about 1e-45 to 3.4e38, or 0)")


def _accumulation_from(training: dict, world_size: int) -> int:
    """The gradient accumulation a config sets: its gradient_accumulation_steps,
    or what DeepSpeed's rule gives (train batch = micro batch x accumulation
    x ranks) from train_batch_size and train_micro_batch_size_per_gpu, as
    ztier-train takes them. The micro batch itself is the data loader's."""
    acc = training.get("grad_accumulation")
    micro = training.get("micro_batch")
    total = training.get("train_batch")
    if total is None:
        return acc if acc is not None else 1
    given = "".join(f" x {what} {v}" for what, v in (("micro batch", micro),
                                                      ("accumulation", acc)) if v is not None)
    rule = " (DeepSpeed's rule: train batch = micro batch x accumulation x ranks)"
    if micro is not None and acc is not None:
        if micro * acc * world_size != total:
            raise ValueError(f"ztier: train_batch_size {total} is not {world_size} rank(s)"
                             f"{given}{rule}")
        return acc
    unit = (micro if micro is not None else acc if acc is not None else 1) * world_size
    if total % unit != 0 or total < unit:
        raise ValueError(f"ztier: train_batch_size {total} is not a whole multiple of "
                         f"{world_size} rank(s){given}{rule}")
    if micro is not None:
        return total // unit
    return acc if acc is not None else 1


def _adamw_from(training: dict) -> AdamW:
    """AdamW with what a config set of DeepSpeed's optimizer (Session.training)."""
    a = AdamW()
    kind = training.get("optimizer_type")
    decoupled = training.get("adam_w_mode", True)
    mode = a.mode if kind is None and "adam_w_mode" not in training else (
        "adamw" if kind == "adamw" or decoupled else "adam")
    return AdamW(lr=training.get("lr", a.lr),
                 betas=(training.get("beta1", a.betas[0]), training.get("beta2", a.betas[1])),
                 eps=training.get("eps", a.eps),
                 weight_decay=training.get("weight_decay", a.weight_decay),
                 bias_correction=training.get("bias_correction", a.bias_correction), mode=mode)


# A checkpoint's persistent buffers, beside the engine's files.
BUFFERS_FILE = "ztier-buffers.pt"  # an older ztier's, of the manifest's step or not
_BUFFERS_STEP = re.compile(r"ztier-buffers-step-(\d+)\.pt")


def _buffers_file(step) -> str:
    """The name of a checkpoint's buffers file, by the step it saves."""
    return f"ztier-buffers-step-{step}.pt"


def _checkpoint_step(directory: str):
    """The step the checkpoint's manifest commits, or None (none, or one
    that cannot be read: the engine's load says what is wrong)."""
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            step = json.load(f).get("step")
        return step if isinstance(step, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def _buffers_crc(buffers: dict[str, torch.Tensor]) -> int:
    """A CRC-32 over the buffers' names, dtypes, shapes and bytes (torch.load
    checks none: a flipped byte loaded silently)."""
    crc = 0
    for name in sorted(buffers):
        b = buffers[name].detach().cpu()
        crc = zlib.crc32(f"{name}:{b.dtype}:{list(b.shape)};".encode(), crc)
        try:
            if b.layout != torch.strided:
                b = b.to_dense()  # a sparse buffer
            b = b.resolve_conj().resolve_neg().contiguous()
            crc = zlib.crc32(b.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        except (RuntimeError, TypeError):  # a layout without plain bytes: its name and shape
            pass
    return crc


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.complex64: "C64"}
_ST_DTYPES.update({getattr(torch, t): n for t, n in (
    ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")) if hasattr(torch, t)})


# An export's dtypes (the engine writes bfloat16 or float32), by name or torch dtype.
_EXPORT_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32",
                  "fp32": "float32", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _export_dtype(dtype) -> str:
    """The engine's name ("bfloat16" or "float32") for an export's ``dtype``."""
    if isinstance(dtype, (str, torch.dtype)) and dtype in _EXPORT_DTYPES:
        return _EXPORT_DTYPES[dtype]
    error = ValueError if isinstance(dtype, (str, torch.dtype)) else TypeError
    raise error(f"ztier: no export of dtype={dtype!r}: the engine writes 'bfloat16' (the params "
                "the model computes with) or 'float32' (its fp32 master weights), also given as "
                "torch.bfloat16 / torch.float32; for another dtype, export 'float32' and cast")


def _add_to_safetensors(source: str, extra: dict[str, torch.Tensor], path: str):
    """Writes at ``path``, atomically, the safetensors file at ``source``
    with ``extra`` appended (in their own dtypes); the tensors already there
    are copied as bytes (never all in memory at once), their metadata kept."""
    import json
    import shutil
    import struct

    blobs = []
    with open(source, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data_start = 8 + n
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
        for name, t in extra.items():
            if name in header:
                raise ValueError(f"ztier: '{name}' is both a parameter and a buffer name")
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"ztier: buffer '{name}' is {t.dtype}, which safetensors "
                                 "lacks; make it a dtype the format has, or non-persistent")
            b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [end, end + len(b)]}
            end += len(b)
            blobs.append(b)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - len(text) % 8) % 8)  # the data region 8-aligned, as writers do
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"ztier: {path} is a directory; it was not replaced (an export is one file: "
                f"give a file's path, e.g. {os.path.join(path, 'model.safetensors')})")
        tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"  # (one per writer)
        try:
            with open(tmp, "wb") as out:
                out.write(struct.pack("<Q", len(text)))
                out.write(text)
                f.seek(data_start)
                shutil.copyfileobj(f, out, 16 << 20)
                for b in blobs:
                    out.write(b)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)  # a write or a replace that failed left it, full size


def _map_tensors(obj, fn, seen=None):
    """``obj`` with ``fn`` applied to each tensor in it, through tuples
    (namedtuples too), lists, dicts and dataclasses at any depth: dicts
    (Hugging Face ModelOutputs among them) changed in place, the others
    copied where a tensor in them changed (a tuple subclass that cannot be
    built from its items is left as it is); other objects as they are, each
    looked into once. ``obj`` itself where nothing changed."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if not isinstance(obj, (dict, tuple, list)) and not (
            dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return obj
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return obj
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            new = _map_tensors(v, fn, seen)
            if new is not v:
                obj[k] = new
        return obj
    if isinstance(obj, (tuple, list)):
        items = [_map_tensors(o, fn, seen) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        try:
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
                return type(obj)(*items)
            return type(obj)(items)
        except TypeError:
            return obj  # its tensors get grad hooks (_post_forward)
    changed = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        new = _map_tensors(v, fn, seen)
        if new is not v:
            changed[f.name] = new
    if not changed:
        return obj
    out = copy.copy(obj)
    for k, v in changed.items():
        object.__setattr__(out, k, v)  # frozen ones too
    return out


def _plain_object(obj) -> bool:
    """An object of a user's class that may hold tensors in its attributes
    (not a tensor, module, number, string, type or function)."""
    return (hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__")) and not isinstance(
        obj, (torch.Tensor, nn.Module, str, bytes, numbers.Number, type, tuple, list, dict,
              types.FunctionType, types.MethodType, types.ModuleType, functools.partial))


def _attribute_values(obj, limit=64):
    """The values of ``obj``'s public attributes (in ``__dict__``, or its
    ``__slots__``), at most ``limit`` of them."""
    if hasattr(obj, "__dict__"):
        values = (v for k, v in vars(obj).items() if not k.startswith("_"))
    else:
        values = (getattr(obj, name) for cls in type(obj).__mro__
                  for name in _slot_names(cls) if not name.startswith("_") and hasattr(obj, name))
    return list(itertools.islice(values, limit))


def _slot_names(cls) -> tuple:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _shallow_tensors(item) -> list:
    """The tensors ``item`` is or holds directly (a tuple, list or dict of
    them; at most 64 looked at)."""
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, (tuple, list)):
        return [t for t in item[:64] if isinstance(t, torch.Tensor)]
    if isinstance(item, dict):
        return [t for t in itertools.islice(item.values(), 64) if isinstance(t, torch.Tensor)]
    return []


def _tensors(obj, seen=None):
    """The tensors in a module's output: in tuples, lists, dicts, Hugging
    Face ModelOutputs, dataclasses, and the attributes of other objects (a
    block's own output class, with ``__slots__`` too), each object looked
    into once."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if obj is None or isinstance(obj, (str, bytes, numbers.Number, type, nn.Module)):
        return
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, seen)
    elif isinstance(obj, dict):
        for o in list(obj.values()):
            yield from _tensors(o, seen)
    elif hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(obj.to_tuple(), seen)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)
    elif hasattr(obj, "__dict__"):
        for o in list(vars(obj).values()):
            yield from _tensors(o, seen)
    elif hasattr(type(obj), "__slots__"):
        for o in [getattr(obj, n) for c in type(obj).__mro__ for n in _slot_names(c)
                  if n not in ("__dict__", "__weakref__") and hasattr(obj, n)]:
            yield from _tensors(o, seen)


def offload(model: nn.Module, device="cpu", optimizer: AdamW | None = None,
            clip_grad_norm: float | None = None, grad_accumulation: int | None = None,
            states: str | None = None,
            params: str | None = None, prefetch_depth: int | None = None,
            config: str | None = None, daemon: str | None = None, **kwargs) -> Offload:
    """Puts ``model`` on ztier; see the module's docstring. ``states`` /
    ``params``: "dram" or "nvme" (default: the config's); ``config``: a
    DeepSpeed-style JSON config, whose optimizer, gradient_clipping and
    gradient_accumulation_steps apply where ``optimizer``, ``clip_grad_norm``
    and ``grad_accumulation`` are not given; ``daemon``: a ztierd socket (default: the
    engine embedded in this process, or ZTIER_DAEMON_SOCKET); ``settings``:
    {key: value} of the config's dotted keys (docs/configuration.md), e.g.
    {"ztier.dram_budget": "8G", "optimizer.params.betas": (0.9, 0.95)}; ``compute_dtype``: the
    dtype the module computes in (default bf16 on a GPU, fp32 on the host);
    ``average_grads``: with several ranks, step on the mean of their grads
    (DDP's semantics) instead of the sum; ``cast_inputs``: the floating-point
    tensors given to the model's forward are cast to ``compute_dtype``
    (saturating: past its range they become its largest values), unless
    False; ``blocks``: the submodules (or their names) that are a unit each,
    instead of :func:`find_blocks`'s choice ([]: the model is one unit)."""
    return Offload(model, device=device, optimizer=optimizer, clip_grad_norm=clip_grad_norm,
                   grad_accumulation=grad_accumulation, states=states, params=params,
                   prefetch_depth=prefetch_depth, config=config, daemon=daemon, **kwargs)


def from_pretrained(model_class, path: str, **kwargs) -> tuple[nn.Module, Offload]:
    """Builds ``model_class`` from a local Hugging Face checkpoint directory
    without materializing its weights, and streams the (sharded) safetensors
    straight into the engine, one unit at a time. Returns (model, offload);
    keyword arguments: :func:`ztier.hf.from_pretrained`'s (config, dtype,
    generation_config), the others go to :func:`offload`."""
    from ztier import hf
    return hf.from_pretrained(model_class, path, **kwargs)
