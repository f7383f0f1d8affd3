"""ztier.hf: Hugging Face checkpoints in and out of ztier.

``from_pretrained`` builds a model from a local checkpoint directory without
its weights (parameters on the meta device, buffers real) and streams the
safetensors shards (``model.safetensors`` or the shards that
``model.safetensors.index.json`` maps) into the engine one unit at a time, so
the host never holds a second full copy. Tied parameters (an output head
sharing the embedding) are found under any of their names.

A checkpoint that lacks some of the model's tensor names (one transformers
converts as it loads: renamed or fused tensors; a new head on a base model)
is loaded by the class's own ``from_pretrained`` instead, holding one full
copy in host memory, with a warning.

Errors: FileNotFoundError (no checkpoint there), KeyError naming a tensor the
checkpoint lacks (``load_weights``), ValueError naming a tensor whose shape
differs, one that is not floating point, or a file that cannot be read (a
damaged header or index), with the file.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _unreadable(file: str, e: Exception) -> ValueError:
    """What cannot read ``file`` (safetensors' own errors do not name it)."""
    return ValueError(f"ztier: cannot read {file}: {e}")


def _open(file: str):
    """An open safetensors file; its errors name it."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors' SafetensorError, OSError
        raise _unreadable(file, e) from e


def _weight_files(path: str) -> dict[str, str]:
    """tensor name -> file, for a directory (single file or sharded) or a file."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                        isinstance(v, str) for v in weight_map.values()):
                    raise ValueError("weight_map is not a map of tensor names to files")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise _unreadable(index, e) from e
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        single = os.path.join(path, SINGLE)
        if not os.path.exists(single):
            raise FileNotFoundError(f"ztier: no {SINGLE} or {INDEX} in {path}")
        path = single
    if not os.path.exists(path):
        raise FileNotFoundError(f"ztier: no checkpoint at {path}")
    with _open(path) as f:
        return {k: path for k in f.keys()}


def remove_shards(directory: str):
    """Removes a sharded checkpoint's index from ``directory`` and then the
    shard files it names there (model-*.safetensors; none outside the
    directory, never model.safetensors itself). Files it cannot read as an
    index are left alone, with the index gone."""
    index = os.path.join(directory, INDEX)
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        shards = {v for v in weight_map.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        shards = set()
    try:
        os.remove(index)
    except FileNotFoundError:
        return
    for name in shards:
        if (os.path.basename(name) == name and name != SINGLE and name.startswith("model")
                and name.endswith(".safetensors")):
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def load_weights(z, path: str):
    """Sets every unit's initial weights from the checkpoint at ``path``."""
    files = _weight_files(os.fspath(path))
    aliases = _aliases(z.module)
    handles: dict[str, object] = {}
    try:
        for u in z.units:
            flat = torch.empty(u.numel, dtype=torch.float32)
            for t in u.tensors:
                key = next((n for n in aliases.get(id(t.param), [t.name]) if n in files), None)
                if key is None:
                    raise KeyError(f"ztier: the checkpoint at {path} has no tensor '{t.name}'")
                file = files[key]
                if file not in handles:
                    handles[file] = _open(file).__enter__()
                try:
                    value = handles[file].get_tensor(key)
                except Exception as e:  # a tensor the index maps to the wrong shard, ...
                    raise _unreadable(file, e) from e
                if tuple(value.shape) != t.shape:
                    raise ValueError(f"ztier: tensor '{key}' in {file} has shape "
                                     f"{tuple(value.shape)}, the model's is {t.shape}")
                # An integer or bool tensor where a weight goes is another
                # file's (it was cast to floats without a word).
                if not value.is_floating_point():
                    raise ValueError(f"ztier: tensor '{key}' in {file} is {value.dtype}, "
                                     f"not floating point: no weights")
                flat[t.offset:t.offset + t.numel] = value.reshape(-1).float()
            try:
                z.job.set_weights(u.index, flat)
            except ValueError as e:  # a value not finite: which checkpoint
                # The same type (ztier's InvalidArgumentError, with its code).
                raise type(e)(f"{e} (in the checkpoint at {path})") from e
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def load_buffers(z, path: str):
    """Sets the module's persistent buffers (running statistics) that the
    checkpoint at ``path`` holds; every rank reads them (each has its own)."""
    wanted = z.persistent_buffers()
    if not wanted:
        return
    files = _weight_files(os.fspath(path))
    found = {}
    for name in wanted:
        if name in files:
            with _open(files[name]) as f:
                try:
                    found[name] = f.get_tensor(name)
                except Exception as e:
                    raise _unreadable(files[name], e) from e
    if found:
        z._set_buffers(found, os.fspath(path))


def _empty_parameters(model: nn.Module):
    """Replaces meta parameters by placeholders (NaN, no memory), tied ones
    by one shared placeholder, keeping requires_grad."""
    fresh: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            q = fresh.get(id(p))
            if q is None and not p.is_floating_point():
                # Kept by the module, not the engine (an index table, a
                # frozen complex parameter): real memory of its dtype, filled
                # from the checkpoint as buffers are. A trainable complex one
                # stays so, for offload to refuse.
                q = fresh[id(p)] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                requires_grad=p.requires_grad)
            if q is None:
                q = fresh[id(p)] = nn.Parameter(
                    torch.full((), float("nan"), dtype=torch.bfloat16).expand(p.shape),
                    requires_grad=p.requires_grad)
            m._parameters[name] = q


def from_pretrained(model_class, path: str, config=None, **offload_kwargs):
    """(model, offload) for the checkpoint directory ``path``; see the module
    docstring. ``config``: the model's config (default: ``path``'s)."""
    from accelerate import init_empty_weights

    from ztier import torch as zt

    path = os.fspath(path)
    # A local directory only: a name that is none went to the Hub (five
    # tries, half a minute offline) before any word of a missing directory.
    if not os.path.isdir(path):
        raise FileNotFoundError(f"ztier: {path} is not a directory (a local checkpoint: "
                                "config.json and safetensors)")
    if config is None:
        # Another kind of model's directory built a default-sized model of
        # this class, refused for its DRAM: say what differs instead.
        saved_type = None
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            # The class's from_pretrained took its default config (a 7B
            # Llama), and the checkpoint then lacked its tensors: the
            # fallback built that model in host memory.
            raise FileNotFoundError(f"ztier: {path} has no config.json: pass config= (the "
                                    "model's config), or save the model's config there")
        with open(config_file) as f:
            saved = json.load(f)
        saved_type = saved.get("model_type") if isinstance(saved, dict) else None
        if hasattr(model_class, "_model_mapping") and not hasattr(model_class, "config_class"):
            # An Auto class (AutoModelForCausalLM): the class the config names.
            from transformers import AutoConfig
            try:
                model_class = model_class._model_mapping[type(AutoConfig.from_pretrained(path))]
            except KeyError as e:
                raise ValueError(f"ztier: {model_class.__name__} has no model for the "
                                 f"'{saved_type}' config at {path}") from e
        want = getattr(model_class.config_class, "model_type", None)
        if saved_type and want and saved_type != want:
            raise ValueError(f"ztier: {path} holds a '{saved_type}' model; "
                             f"{model_class.__name__} is a '{want}' one")
        config = model_class.config_class.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = model_class(config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    # Names the checkpoint lacks: one transformers converts when loading
    # (renamed or fused tensors: GPT-NeoX's embed_out, ViT, Mixtral's
    # experts), a head the checkpoint's model had not (a classifier on a
    # base model) or a prefix it had not. Transformers' own loading knows
    # them: the model is materialized by it once, then offloaded.
    files = _weight_files(path)
    missing = [names[0] for names in _aliases(model).values()
               if not any(n in files for n in names)]
    if missing:
        import warnings

        warnings.warn(
            f"ztier: the checkpoint at {path} has no tensor named as {len(missing)} of "
            f"{model_class.__name__}'s (e.g. '{missing[0]}': a checkpoint transformers converts "
            "as it loads, or a head or prefix the checkpoint's model had not): it is loaded by "
            f"{model_class.__name__}.from_pretrained, which holds the whole model in host memory "
            "once, then offloaded", RuntimeWarning, stacklevel=3)
        del model
        model = model_class.from_pretrained(path, config=config)
        return model, zt.offload(model, **offload_kwargs)
    _empty_parameters(model)
    # In evaluation mode, as transformers' from_pretrained returns it (the
    # fallback above too): dropout was on for generate() and no-grad
    # forwards until the caller's model.eval().
    model.eval()
    z = zt.offload(model, weights=path, **offload_kwargs)
    return model, z
