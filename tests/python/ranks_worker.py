"""One rank of the two-process test (test_ranks.py): trains the tiny Llama
through ztier.torch with torch.distributed (gloo) initialized, on its own
micro-batch of each step, and saves its losses (and rank 0 the masters)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, directory: str, steps: int, settings: dict,
        average: bool = False):
    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    store = os.path.join(directory, "store-mean" if average else "store")  # one per run
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        model = tiny_llama()
        z = zt.offload(model, optimizer=zt.AdamW(lr=3e-3, weight_decay=0.1, no_decay=("norm",)),
                       clip_grad_norm=1.0, settings=settings, average_grads=average)
        losses = []
        for step in range(steps):
            x = batch(step, micro=rank)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            z.optimizer.step()
            losses.append(loss.detach())
        z.wait()
        out = {"losses": torch.stack(losses), "norm": z.grad_norm(),
               "stats": z.runner.stats(), "refusals": []}
        if rank == 0:
            out["masters"] = z.master_weights()
            # One rank alone (as Trainer saves): no collective, or both hung.
            out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        if not average:
            # Rank 0 reads and writes the files; when it fails every rank
            # is told (rank 1 waited for it in a barrier: both hung), and
            # both train on.
            # (The last: a path that is not UTF-8, in rank 0's message.)
            for fail in (lambda: z.load_checkpoint(os.path.join(directory, "none")),
                         lambda: z.save_checkpoint("/proc/no/such/dir"),
                         lambda: z.save_checkpoint(os.fsdecode(b"/proc/no/such/\xff"))):
                try:
                    fail()
                except Exception as e:  # noqa: BLE001 -- what each rank is told
                    out["refusals"].append(str(e))
            x = batch(steps, micro=rank)
            model(input_ids=x, labels=x).loss.backward()
            z.optimizer.step()
            z.wait()
        torch.save(out, os.path.join(directory, f"rank{rank}{'-mean' if average else ''}.pt"))
        dist.barrier()
        z.close()
        # Rank 0's hosted ztierd, closed, is not kept for the exit (one a run).
        assert not zt._hosted_daemons, zt._hosted_daemons
    finally:
        dist.destroy_process_group()


def meet(rank: int, world: int, directory: str, case: str):
    """One rank of a launch whose ranks cannot all join (test_ranks.py):
    ``case`` says what differs or fails; saves what offload() raised here
    and how long it took."""
    import time

    import ztier.torch as zt
    from conftest import tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-{case}", rank=rank,
                            world_size=world)
    kwargs = {"settings": {"ztier.dram_budget": "1G", "ztier.wait_timeout": 600}}
    if case == "lr" and rank == 1:
        kwargs["optimizer"] = zt.AdamW(lr=5e-4)
    if case == "prefetch":
        kwargs["prefetch_depth"] = 1 + rank
    if case == "register":
        kwargs["states"] = "nvme"  # the ztierd rank 0 hosts has no swap directories
    if case == f"dtype{rank}":  # refused before the ranks meet
        kwargs["compute_dtype"] = torch.float16
    if case == "weights":  # rank 0 reads them: a tensor is missing
        kwargs["weights"] = os.path.join(directory, "partial.safetensors")
    model = tiny_llama()
    start = time.monotonic()
    said = None
    try:
        z = zt.offload(model, **kwargs)
        z.close()
    except Exception as e:  # noqa: BLE001 -- what this rank was told
        said = f"{type(e).__name__}: {e}"
    intact = all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                    tiny_llama().parameters()))
    torch.save({"said": said, "seconds": time.monotonic() - start, "intact": intact},
               os.path.join(directory, f"meet-{case}-{rank}.pt"))
    dist.destroy_process_group()


def rank0_lr(rank: int, world: int, directory: str):
    """Rank 1's schedule sets lr 0, rank 0's keeps it: how far rank 0's
    masters move each step (test_ranks.py)."""
    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-lr", rank=rank,
                            world_size=world)
    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=3e-3), settings={"ztier.dram_budget": "1G"})
    moves = []
    before = z.master_weights()
    for step in range(4):
        if rank == 1:
            for g in z.optimizer.param_groups:
                g["lr"] = 0.0
        x = batch(step, micro=rank)
        model(input_ids=x, labels=x).loss.backward()
        z.optimizer.step()
        z.wait()
        after = z.master_weights()
        moves.append(max((after[n] - before[n]).abs().max().item() for n in after))
        before = after
    torch.save(moves, os.path.join(directory, f"lr-{rank}.pt"))
    dist.barrier()
    z.close()
    dist.destroy_process_group()


def _one_step_together(rank: int, world: int, directory: str, store: str):
    """A tiny Llama offloaded by every rank (a file:// rendezvous at
    `store`), one step trained, the ranks met after it; its Offload."""
    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/{store}", rank=rank,
                            world_size=world)
    model = tiny_llama()
    z = zt.offload(model, settings={"ztier.dram_budget": "1G"})
    x = batch(0, micro=rank)
    model(input_ids=x, labels=x).loss.backward()
    z.optimizer.step()
    z.wait()
    dist.barrier()
    return z


def peer_gone(rank: int, world: int, directory: str):
    """Rank 1 leaves between steps; rank 0 then saves (test_ranks.py)."""
    z = _one_step_together(rank, world, directory, "store-gone")
    if rank == 1:
        os._exit(0)
    import time
    time.sleep(1)  # rank 1 is gone
    said = None
    try:
        z.save_checkpoint(os.path.join(directory, "ck"))
    except Exception as e:  # noqa: BLE001 -- what rank 0 is told
        said = str(e)
    torch.save(said, os.path.join(directory, "gone.pt"))
    os._exit(0)


def rank0_dies_before_its_save(rank: int, world: int, directory: str):
    """Rank 0 (which hosts ztierd) ends as every rank is to save; rank 1
    saves, and waits for rank 0's (test_ranks.py)."""
    import time

    z = _one_step_together(rank, world, directory, "store-dies")
    if rank == 0:
        os._exit(0)
    start = time.monotonic()
    said = None
    try:
        z.save_checkpoint(os.path.join(directory, "ck"))
    except Exception as e:  # noqa: BLE001 -- what rank 1 is told
        said = str(e)
    torch.save({"said": said, "seconds": time.monotonic() - start},
               os.path.join(directory, "dies.pt"))
    os._exit(0)


def rank0_saves_alone(rank: int, world: int, directory: str):
    """Rank 0 saves, exports and saves a pretrained directory alone, as
    DDP's ``if rank == 0:``, while rank 1 trains on; then every rank loads
    that checkpoint (test_ranks.py). Each saves what it saw."""
    import time

    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-alone", rank=rank,
                            world_size=world)
    model = tiny_llama()
    z = zt.offload(model, optimizer=zt.AdamW(lr=3e-3),
                   settings={"ztier.dram_budget": "1G", "ztier.wait_timeout": 5})
    out = {"said": None, "masters": None}
    start = time.monotonic()
    try:
        for step in range(4):
            x = batch(step, micro=rank)
            model(input_ids=x, labels=x).loss.backward()
            z.optimizer.step()
            if step == 1 and rank == 0:
                z.save_checkpoint(os.path.join(directory, "ck"))
                z.export_safetensors(os.path.join(directory, "alone.safetensors"))
                z.save_pretrained(os.path.join(directory, "pretrained"))
                out["masters"] = z.master_weights()
        z.wait()
        z.load_checkpoint(os.path.join(directory, "ck"))
        out["loaded"] = z.master_weights()
        out["step"] = z.step_count
    except Exception as e:  # noqa: BLE001 -- what this rank was told
        out["said"] = str(e)
    out["seconds"] = time.monotonic() - start
    torch.save(out, os.path.join(directory, f"alone-{rank}.pt"))
    dist.barrier()
    z.close()
    dist.destroy_process_group()


def rank0_loads_alone(rank: int, world: int, directory: str):
    """Rank 0 calls load_checkpoint alone while rank 1 goes on to its next
    step (test_ranks.py). Each saves what it was told and how long it
    took."""
    import time

    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-load", rank=rank,
                            world_size=world)
    model = tiny_llama()
    z = zt.offload(model, settings={"ztier.dram_budget": "1G", "ztier.wait_timeout": 3})
    said, seconds = None, None
    for step in range(3):
        x = batch(step, micro=rank)
        start = time.monotonic()
        try:
            if step == 2 and rank == 0:
                z.load_checkpoint(os.path.join(directory, "ck"))
                continue
            model(input_ids=x, labels=x).loss.backward()
            z.optimizer.step()
            z.wait()
        except Exception as e:  # noqa: BLE001 -- what this rank was told
            said, seconds = str(e), time.monotonic() - start
            break
        if step == 0 and rank == 0:
            z.save_checkpoint(os.path.join(directory, "ck"))
    torch.save({"said": said, "seconds": seconds, "step": z.step_count},
               os.path.join(directory, f"load-{rank}.pt"))
    # Rank 0 hosts ztierd: it stays until rank 1 was told.
    while rank == 0 and not os.path.exists(os.path.join(directory, "load-1.pt")):
        time.sleep(0.1)
    if rank == 1:  # rank 0's told first: a peer gone would end its wait too
        while not os.path.exists(os.path.join(directory, "load-0.pt")):
            time.sleep(0.1)
    os._exit(0)


def stalled_peer(rank: int, world: int, directory: str):
    """Rank 1 stops coming to the collectives (alive, as a notebook would
    be) after one step; rank 0 steps on (test_ranks.py). Each saves what
    its next step raised and how long it took."""
    import time

    import ztier.torch as zt
    from conftest import batch, tiny_llama

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-stalled", rank=rank,
                            world_size=world)
    model = tiny_llama()
    z = zt.offload(model, settings={"ztier.dram_budget": "1G", "ztier.wait_timeout": 3,
                                    "zero_optimization.stage3_param_persistence_threshold": 0})
    for step in range(2):
        if step == 1 and rank == 1:
            time.sleep(15)  # rank 0 gives up meanwhile
        start = time.monotonic()
        said = None
        try:
            x = batch(step, micro=rank)
            model(input_ids=x, labels=x).loss.backward()
            z.optimizer.step()
            z.wait()
        except Exception as e:  # noqa: BLE001 -- what this rank was told
            said = str(e)
    torch.save({"said": said, "seconds": time.monotonic() - start},
               os.path.join(directory, f"stalled-{rank}.pt"))
    # Rank 0 hosts ztierd: it stays until rank 1 was told.
    while rank == 0 and not os.path.exists(os.path.join(directory, "stalled-1.pt")):
        time.sleep(0.1)
    os._exit(0)
