"""ztier: a tiered-memory offload engine for training models far larger than
GPU memory (ZeRO stage-3 with fp32 master weights and AdamW moments in pinned
DRAM or on NVMe, updated by a SIMD CPU AdamW that overlaps the next forward).

``ztier._C`` is the C++ client (Session, Model, Runner) and the AdamW kernel;
``ztier.torch`` puts a PyTorch ``nn.Module`` on it (``ztier.torch.offload``).
Every error the engine reports raises a subclass of ``ZtierError`` named for
its kind (``InvalidArgumentError``, ``NotFoundError``, ``ResourceExhaustedError``,
...), whose ``code`` attribute is the kind's name and whose message names the
unit, file or limit at fault.
"""

# torch before ztier._C where it is installed: a CUDA build of torch brings
# its own NCCL, newer than the CUDA toolkit's that ztier._C links against.
# Whichever libnccl.so.2 loads first serves the whole process, and torch needs
# its own (loaded second, it fails on a symbol the older one lacks).
try:
    import torch  # noqa: F401
except ImportError:
    pass

from ztier._C import (  # noqa: F401
    AbortedError,
    AlreadyExistsError,
    CorruptionError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    IoError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
    ZtierError,
    Session,
    OptimizerConfig,
    adamw_step,
    squared_norm,
    active_target,
    cuda_device_count,
)

__version__ = "0.1.0"
