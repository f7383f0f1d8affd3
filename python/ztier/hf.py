"""ztier.hf: Hugging Face checkpoints in and out of ztier.

``from_pretrained`` builds a model from a local checkpoint directory without
its weights (parameters on the meta device, buffers real) and streams the
safetensors shards (``model.safetensors`` or the shards that
``model.safetensors.index.json`` maps; the single file where both are there,
as transformers reads them) into the engine one unit at a time, so the host
never holds a second full copy. Tied parameters (an output head sharing the
embedding) are found under any of their names. A model that generates takes
the directory's ``generation_config.json`` as its ``generation_config``.

``save_pretrained`` (``Offload.save_pretrained``) writes config.json (its
``dtype`` the written weights', its ``architectures`` the model's class),
generation_config.json (a model that generates) and model.safetensors.

A checkpoint that lacks some of the model's tensor names (one transformers
converts as it loads: renamed or fused tensors; a new head on a base model)
is loaded by the class's own ``from_pretrained`` instead, holding one full
copy in host memory, with a warning.

Errors: FileNotFoundError (no checkpoint there), KeyError naming a tensor the
checkpoint lacks (``load_weights``), ValueError naming a tensor whose shape
differs, one that is not floating point, or a file that cannot be read (a
damaged header, index or generation config), with the file; TypeError naming
a keyword argument neither call takes.
"""

from __future__ import annotations

import copy
import inspect
import json
import os

import torch
from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


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
    """tensor name -> file, for a directory (single file or sharded) or a
    file. A directory holding both takes model.safetensors, as transformers
    does."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if not os.path.exists(os.path.join(path, SINGLE)) and os.path.exists(index):
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
    _warn_unused(z.module, files, aliases, path)


def _warn_unused(model: nn.Module, files: dict, aliases: dict, path: str):
    """Says which tensors of the checkpoint the model has no place for (a
    checkpoint of a deeper model loaded into a shallower config: its last
    layers were dropped without a word), as transformers does; those its
    class says to ignore (_keys_to_ignore_on_load_unexpected) are not."""
    import re
    import warnings

    known = {n for names in aliases.values() for n in names}
    buffers = [n for n, _ in model.named_buffers(remove_duplicate=False)]
    known.update(buffers)
    # A buffer kept elsewhere now (older Llama checkpoints hold each layer's
    # rotary inv_freq, which transformers drops as it loads).
    buffer_leaves = {n.rsplit(".", 1)[-1] for n in buffers}
    ignore = [re.compile(p) for p in
              (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unused = sorted(k for k in files if k not in known and k.rsplit(".", 1)[-1] not in buffer_leaves
                    and not any(r.search(k) for r in ignore))
    if unused:
        warnings.warn(
            f"ztier: {len(unused)} tensor(s) of the checkpoint at {path} are not used: the "
            f"{type(model).__name__} has no parameter or buffer of that name (e.g. "
            f"'{unused[0]}'; a checkpoint of a larger configuration, or another model's)",
            RuntimeWarning, stacklevel=4)


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


def _empty_parameters(model: nn.Module, only_meta: bool = False):
    """Replaces the parameters by placeholders (NaN, no memory), tied ones
    by one shared placeholder, keeping requires_grad; with ``only_meta``,
    those on the meta device only (the others keep their values)."""
    fresh: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or (only_meta and not p.is_meta):
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


# from_pretrained's arguments of transformers that ztier has no use for,
# and what to do instead.
_NOT_TAKEN = {
    "device_map": "ztier places the model itself: pass device= (e.g. device='cuda:0'); the "
                  "weights live in the engine and come to the device a unit at a time",
    "attn_implementation": "set it in the config and pass that: config=AutoConfig."
                           "from_pretrained(path, attn_implementation=...)",
    "quantization_config": "the engine keeps fp32 master weights and computes in torch.bfloat16 "
                           "or torch.float32: it loads no quantized model",
    "load_in_8bit": "the engine keeps fp32 master weights and computes in torch.bfloat16 or "
                    "torch.float32: it loads no quantized model",
    "load_in_4bit": "the engine keeps fp32 master weights and computes in torch.bfloat16 or "
                    "torch.float32: it loads no quantized model",
}
for _name in ("revision", "cache_dir", "token", "force_download", "local_files_only",
              "subfolder", "proxies"):
    _NOT_TAKEN[_name] = ("ztier loads a local directory only (it never goes to the Hub): give "
                         "the checkpoint's directory, e.g. huggingface_hub.snapshot_download's")


def _compute_dtype(x):
    """The torch dtype a dtype= / torch_dtype= value names (the dtypes an
    export takes: bfloat16 or float32, by name or torch dtype), else None."""
    from ztier import torch as zt

    if not isinstance(x, (str, torch.dtype)) or x not in zt._EXPORT_DTYPES:
        return None
    return getattr(torch, zt._EXPORT_DTYPES[x])


def _check_offload_kwargs(kwargs: dict):
    """Refuses, before anything is read, a keyword argument that neither
    from_pretrained nor offload() takes, naming it."""
    from ztier import torch as zt

    # (offload's config=, a DeepSpeed-style JSON file, is the model's config here.)
    takes = {n for n, p in inspect.signature(zt.Offload.__init__).parameters.items()
             if p.kind is p.KEYWORD_ONLY} - {"weights", "config"}
    for name in kwargs:
        if name in takes:
            continue
        if name == "weights":
            raise TypeError("ztier: from_pretrained() takes no weights=: the weights are the "
                            "checkpoint's (path); to start from other weights, offload the model "
                            "with weights= instead")
        why = _NOT_TAKEN.get(name) or (
            "it takes config=, dtype= (or torch_dtype=), generation_config= and offload()'s "
            f"keyword arguments ({', '.join(sorted(takes))})")
        raise TypeError(f"ztier: from_pretrained() got an unexpected keyword argument "
                        f"'{name}': {why}")


def _given_dtype(dtype, torch_dtype, compute_dtype):
    """The compute dtype that dtype= / torch_dtype= ask for: a torch dtype,
    "auto" (config.json's, once read) or None (neither given)."""
    def same(x):
        return _compute_dtype(x) or x

    if dtype is not None and torch_dtype is not None and same(dtype) != same(torch_dtype):
        raise ValueError(f"ztier: dtype={dtype} and torch_dtype={torch_dtype} differ: give "
                         "dtype= alone (torch_dtype= is its older name)")
    name, given = ("dtype", dtype) if dtype is not None else ("torch_dtype", torch_dtype)
    if given is None or (isinstance(given, str) and given == "auto"):
        # "auto" beside a compute_dtype: that one.
        return given if compute_dtype is None else None
    want = _compute_dtype(given)
    if want is None:
        raise ValueError(
            f"ztier: {name}={given!r}: the engine keeps fp32 master weights and the model "
            "computes in torch.bfloat16 or torch.float32 (offload's compute_dtype); pass one of "
            "those, or 'auto' (config.json's dtype where it is one of them)")
    if compute_dtype is not None and compute_dtype != want:
        raise ValueError(f"ztier: {name}={want} and compute_dtype={compute_dtype} differ: "
                         f"give one ({name}= is the compute dtype)")
    return want


def _config_dtype(config):
    """config.json's dtype (``dtype``, ``torch_dtype`` in older transformers)
    as a torch dtype, or None."""
    value = getattr(config, "dtype", None)
    if value is None:
        value = vars(config).get("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _can_generate(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return callable(can) and bool(can())


def _set_generation_config(model: nn.Module, path: str, given):
    """A model that generates takes ``given`` (a copy), else the directory's
    generation_config.json where there is one (transformers' from_pretrained
    does so; without one, the model keeps what its config gave)."""
    if not _can_generate(model):
        return
    from transformers import GenerationConfig

    if given is not None:
        model.generation_config = copy.deepcopy(given)
        return
    file = os.path.join(path, GENERATION_CONFIG)
    if not os.path.isfile(file):
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except Exception as e:  # OSError naming no file, ValueError of a bad value
        raise _unreadable(file, e) from e


def from_pretrained(model_class, path: str, config=None, *, dtype=None, torch_dtype=None,
                    generation_config=None, low_cpu_mem_usage=None, **offload_kwargs):
    """(model, offload) for the checkpoint directory ``path``; see the module
    docstring. ``config``: the model's config (default: ``path``'s).
    ``dtype`` (``torch_dtype``, its older name): the dtype the model computes
    in, offload's ``compute_dtype``: torch.bfloat16 or torch.float32 (their
    names too), or "auto": config.json's where it is one of them, else
    offload's default; the engine keeps fp32 master weights either way.
    ``generation_config``: the model's (a copy), instead of the directory's.
    ``low_cpu_mem_usage``: taken for transformers' sake, of no effect (the
    host never holds a full copy). The other keyword arguments go to
    :func:`ztier.torch.offload`; one that neither takes is a TypeError."""
    from accelerate import init_empty_weights

    from ztier import torch as zt

    _check_offload_kwargs(offload_kwargs)
    want_dtype = _given_dtype(dtype, torch_dtype, offload_kwargs.get("compute_dtype"))
    if generation_config is not None:
        from transformers import GenerationConfig
        if not isinstance(generation_config, GenerationConfig):
            raise TypeError(f"ztier: generation_config= takes a transformers GenerationConfig, "
                            f"got {type(generation_config).__name__}")
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
    if isinstance(want_dtype, str):  # "auto": the checkpoint's, where the model computes in it
        want_dtype = _config_dtype(config)
        if want_dtype not in (torch.bfloat16, torch.float32):
            want_dtype = None
    if want_dtype is not None:
        offload_kwargs["compute_dtype"] = want_dtype
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
        more = {} if generation_config is None else {"generation_config": generation_config}
        model = model_class.from_pretrained(path, config=config, **more)
        return model, zt.offload(model, **offload_kwargs)
    _set_generation_config(model, path, generation_config)
    _empty_parameters(model)
    # In evaluation mode, as transformers' from_pretrained returns it (the
    # fallback above too): dropout was on for generate() and no-grad
    # forwards until the caller's model.eval().
    model.eval()
    z = zt.offload(model, weights=path, **offload_kwargs)
    return model, z


# save_pretrained's arguments of transformers that ztier has no use for, and
# what to do instead.
_NOT_WRITTEN = {
    "max_shard_size": "ztier writes one model.safetensors (no shards), which from_pretrained "
                      "(transformers' too) reads whatever its size",
    "push_to_hub": "ztier writes the directory only: upload it after (huggingface_hub's "
                   "upload_folder)",
}


def save_pretrained(z, directory: str, dtype="bfloat16", safe_serialization=True, **kwargs):
    """``Offload.save_pretrained``: the directory ``from_pretrained`` (ztier's
    and transformers') reads; see the module docstring. ``dtype``: the
    weights' ("bfloat16" or "float32", or torch.bfloat16 / torch.float32),
    which config.json names. ``safe_serialization``: True (safetensors is all
    it writes). A sharded checkpoint there before (model.safetensors.index.json
    and the shards it names) is removed once the new file is written: a loader
    that takes the index read the old weights. Rank 0 writes, as
    export_safetensors."""
    from ztier import torch as zt

    if not safe_serialization:
        raise ValueError("ztier: safe_serialization=False asks for PyTorch's pickle format "
                         "(pytorch_model.bin), which save_pretrained does not write: it writes "
                         "safetensors (model.safetensors) only; leave it out (or, for a "
                         "pickle, torch.save(model.state_dict(), path))")
    for name in kwargs:
        why = _NOT_WRITTEN.get(name) or (
            "it takes dtype= ('bfloat16' or 'float32', or torch.bfloat16 / torch.float32) and "
            "safe_serialization=True")
        raise TypeError(f"ztier: save_pretrained() got an unexpected keyword argument "
                        f"'{name}': {why}")
    dtype = zt._export_dtype(dtype)
    directory = os.fspath(directory)
    model = z.module

    def write():
        os.makedirs(directory, exist_ok=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            # What is written, as transformers' save_pretrained writes the
            # model's dtype and class; the model's own config is left as it is.
            config = copy.deepcopy(config)
            config.dtype = dtype
            if "torch_dtype" in vars(config):  # older transformers
                config.torch_dtype = dtype
            config.architectures = [type(model).__name__]
            config.save_pretrained(directory)
        if _can_generate(model) and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
        z._export(os.path.join(directory, SINGLE), dtype)
        remove_shards(directory)

    z._by_rank0("save_pretrained", write)
