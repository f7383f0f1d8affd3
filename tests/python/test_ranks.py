"""Two ranks (two processes, torch.distributed with gloo) train one model
through one engine: rank 0 hosts ztierd's service in its process, the other
rank attaches, the runner reduce-scatters the grads in shared memory (the sum
over ranks in fp32, rounded to bf16 once). They equal one rank that
accumulates the same two micro-batches per step (the engine sums them in
fp32): the first step's losses bit for bit (same weights, same batches), and
afterwards to the last bits of bf16 (the two paths round the grad sum to
bf16 at different points: world 2 once after the sum, accumulation never)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

import ztier.torch as zt
from conftest import batch, tiny_llama

STEPS = 4


def test_two_ranks_equal_one_rank_on_the_summed_grads(tmp_path, capfd, monkeypatch):
    import ranks_worker

    settings = {"ztier.dram_budget": "1G"}
    scratch = tmp_path / "tmp"  # where rank 0's ztierd puts its socket
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.run, args=(2, str(tmp_path), STEPS, settings), nprocs=2, join=True)
    # The socket's directory goes with the daemon (one was left each run).
    assert list(scratch.iterdir()) == []
    # The ztierd rank 0 hosts is made with these settings: no rank is told
    # that the daemon's own apply (each was).
    assert "is an engine setting" not in capfd.readouterr().err
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        assert len(ranks[r]["refusals"]) == 3, ranks[r]["refusals"]
    assert all("on rank 0" in said for said in ranks[1]["refusals"]), ranks[1]["refusals"]
    for name, master in ranks[0]["masters"].items():  # rank 0's state_dict, taken alone
        got = ranks[0]["state_dict"][name]
        assert torch.equal(got, master.to(torch.bfloat16).to(got.dtype)), name
    # With average_grads (DDP's mean) the norm is half the sum's.
    mp.spawn(ranks_worker.run, args=(2, str(tmp_path), 1, settings, True), nprocs=2, join=True)
    mean = torch.load(tmp_path / "rank0-mean.pt")
    assert torch.equal(mean["losses"][0], ranks[0]["losses"][0])

    model = tiny_llama()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    z = zt.offload(model, optimizer=zt.AdamW(lr=3e-3, weight_decay=0.1, no_decay=("norm",)),
                   clip_grad_norm=1.0, grad_accumulation=2, settings=settings)
    single = []
    for step in range(STEPS):
        for micro in range(2):
            x = batch(step, micro)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            single.append(loss.detach())
        z.optimizer.step()
        if step == 0:
            first_norm = z.grad_norm()
    single = torch.stack(single).view(STEPS, 2)
    for r in range(2):
        assert torch.equal(ranks[r]["losses"][0], single[0, r])
        for step in range(1, STEPS):
            assert math.isclose(ranks[r]["losses"][step], single[step, r], rel_tol=2e-3)
    assert math.isclose(ranks[0]["norm"], z.grad_norm(), rel_tol=1e-2)
    assert math.isclose(mean["norm"], 0.5 * first_norm, rel_tol=1e-2), (mean["norm"], first_norm)
    masters = z.master_weights()
    worst = moved = 0.0
    for name, value in ranks[0]["masters"].items():
        worst = max(worst, (value - masters[name]).abs().max().item())
        moved = max(moved, (value - initial[name]).abs().max().item())
    # Each Adam step moves a weight by up to about lr (3e-3); the two paths
    # differ by the rounding of the grads, a small fraction of that.
    print(f"two ranks vs one: masters moved up to {moved:.3g}, differ by up to {worst:.3g}")
    assert moved > 3 * 3e-3
    assert worst < 0.25 * 3e-3
    for r in range(2):
        assert ranks[r]["stats"]["micro_steps"] == STEPS


def test_a_rank_that_cannot_join_ends_every_rank_at_once(tmp_path, monkeypatch):
    """A rank refused at attach (another lr), ranks given other runner
    settings (a prefetch depth each: their all-gathers would not pair up),
    rank 0's registration refused (states on NVMe with no swap directory),
    rank 0's weights file lacking a tensor, an argument one rank refuses
    before the ranks meet (a compute dtype): every rank raises within
    seconds, told which rank failed and why. Before,
    the others waited 10 minutes (wait_timeout): in their first collective,
    or in an attach for a registration that never came; other settings hung
    for good or mixed the ranks' data."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    from safetensors.torch import save_file

    weights = {k: v for k, v in tiny_llama().state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(tmp_path / "partial.safetensors"))
    said = {}
    for case in ("lr", "prefetch", "register", "weights", "dtype0", "dtype1"):
        mp.spawn(ranks_worker.meet, args=(2, str(tmp_path), case), nprocs=2, join=True)
        said[case] = [torch.load(tmp_path / f"meet-{case}-{r}.pt") for r in range(2)]
        for r in range(2):
            assert said[case][r]["said"] is not None, (case, r)
            assert said[case][r]["seconds"] < 60, (case, r, said[case][r])
    lr = [s["said"] for s in said["lr"]]
    assert "learning rate" in lr[1], lr
    assert lr[0].startswith("RuntimeError: ztier: rank 1 could not join the job:"), lr
    assert "learning rate" in lr[0], lr
    prefetch = [s["said"] for s in said["prefetch"]]
    for r in range(2):
        assert "prefetch_depth is" in prefetch[r] and "every rank" in prefetch[r], prefetch
    register = [s["said"] for s in said["register"]]
    assert "no swap directories" in register[0], register
    assert "ZTIER_NVME_PATHS" in register[0], register  # the hosted ztierd's are the user's
    assert register[1].startswith("RuntimeError: ztier: rank 0 could not register"), register
    loaded = [s["said"] for s in said["weights"]]
    assert "lm_head.weight" in loaded[0], loaded
    assert loaded[1].startswith("RuntimeError: ztier: rank 0 could not load the model's"), \
        loaded
    # An argument refused before the ranks met (told to no one: the others
    # waited in gloo's first collective for good).
    for bad in range(2):
        early = [s["said"] for s in said[f"dtype{bad}"]]
        assert early[bad].startswith("ValueError: ztier: compute_dtype must be"), early
        assert early[1 - bad].startswith(
            f"RuntimeError: ztier: rank {bad} could not offload its model: ValueError"), early
    for case in said:  # the model as it was, not placeholders
        assert all(s["intact"] for s in said[case]), case
    assert list(scratch.iterdir()) == []  # rank 0's ztierd went each time


def test_a_launcher_without_a_process_group_is_warned(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_llama()
    with pytest.warns(RuntimeWarning, match="init_process_group"):
        z = zt.offload(model, settings={"ztier.dram_budget": "1G"})
    z.close()


def test_the_learning_rates_are_rank_0s(tmp_path, monkeypatch):
    """Every rank sent its own learning rates and the last to arrive won:
    a rank whose schedule differed took some steps and not others."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.rank0_lr, args=(2, str(tmp_path)), nprocs=2, join=True)
    moves = torch.load(tmp_path / "lr-0.pt")
    assert all(m > 1e-3 for m in moves), moves  # each step at rank 0's lr (3e-3)


def test_a_save_after_a_peer_left_is_written(tmp_path, monkeypatch):
    """gloo's "Connection closed by peer" was all rank 0 was told, as if the
    save had failed; the checkpoint was complete. Rank 0 no longer waits
    for its peers to save."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.peer_gone, args=(2, str(tmp_path)), nprocs=2, join=True)
    said = torch.load(tmp_path / "gone.pt")
    assert said is None, said
    assert (tmp_path / "ck" / "manifest.json").exists()


def test_a_rank_waiting_for_rank_0s_save_hears_that_its_ztierd_is_gone(tmp_path, monkeypatch):
    """With a file:// rendezvous (a store that outlives rank 0) a rank that
    waited for rank 0's save waited the process group's 30 minutes after
    rank 0, and the ztierd it hosted, had gone."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.rank0_dies_before_its_save, args=(2, str(tmp_path)), nprocs=2,
             join=True)
    seen = torch.load(tmp_path / "dies.pt")
    assert seen["said"] is not None and "gone" in seen["said"], seen
    assert seen["seconds"] < 30, seen


def test_the_socket_directories_of_killed_hosts_are_removed(tmp_path):
    """Each rank 0 killed with the ztierd it hosted left its socket
    directory under TMPDIR for good. The next host removes those no live
    ztierd holds, untouched for a while, and nothing else."""
    import fcntl
    import time

    import ztier.torch as zt_torch

    def host_dir(name, files=("ztierd.sock", "ztierd.sock.lock"), old=True):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_bytes(b"")
        if old:
            os.utime(d, (time.time() - 600, time.time() - 600))
        return d

    stale = host_dir("ztier-stale")
    live = host_dir("ztier-live")
    young = host_dir("ztier-young", old=False)
    other = host_dir("ztier-other", files=("ztierd.sock", "ztierd.sock.lock", "notes.txt"))
    unrelated = host_dir("mine-stale")
    with open(live / "ztierd.sock.lock", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        os.utime(live, (time.time() - 600, time.time() - 600))
        removed = zt_torch._remove_stale_hosted_dirs(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists()
    assert live.exists() and young.exists() and other.exists() and unrelated.exists()


def test_rank_0_may_save_and_export_alone(tmp_path, monkeypatch):
    """DDP's ``if rank == 0: save``: rank 0 waited in a collective for peers
    that had gone on to their next forward, and they for it, until the
    timeout; rank 0 now writes without them."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.rank0_saves_alone, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"alone-{r}.pt") for r in range(2)]
    for r, seen in enumerate(ranks):
        assert seen["said"] is None, (r, seen["said"])
        assert seen["seconds"] < 60, (r, seen["seconds"])
        assert seen["step"] == 2, (r, seen["step"])  # the checkpoint's
    for name, master in ranks[0]["masters"].items():
        assert torch.equal(ranks[0]["loaded"][name], master), name
        assert torch.equal(ranks[1]["loaded"][name], master), name
    assert (tmp_path / "ck" / "manifest.json").exists()
    assert (tmp_path / "alone.safetensors").stat().st_size > 0
    assert (tmp_path / "pretrained" / "model.safetensors").exists()
    assert (tmp_path / "pretrained" / "config.json").exists()


def test_a_load_rank_0_calls_alone_is_refused_within_wait_timeout(tmp_path, monkeypatch):
    """load_checkpoint is every rank's (their runners are made again): rank
    0 alone waited in a barrier for the process group's 30 minutes while
    its peer waited in its next collective. It is now told which rank did
    not come after ztier.wait_timeout, and its model is as it was."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.rank0_loads_alone, args=(2, str(tmp_path)), nprocs=2, join=True)
    alone, peer = (torch.load(tmp_path / f"load-{r}.pt") for r in range(2))
    assert alone["said"] is not None, alone
    assert "rank 1 did not call it within 3 s" in alone["said"], alone
    assert alone["seconds"] < 12, alone
    assert alone["step"] == 2, alone  # not the checkpoint's step 1
    assert peer["said"] is not None and "arrived within 3 s" in peer["said"], peer


def test_a_rank_waits_for_its_peers_as_long_as_wait_timeout(tmp_path, monkeypatch):
    """The ranks' collectives waited 10 minutes for a peer whatever
    ztier.wait_timeout said; a rank now gives up after it, and the peer that
    comes late is told at once that it gave up."""
    import ranks_worker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    mp.spawn(ranks_worker.stalled_peer, args=(2, str(tmp_path)), nprocs=2, join=True)
    gave_up, late = (torch.load(tmp_path / f"stalled-{r}.pt") for r in range(2))
    assert gave_up["said"] is not None and "within 3 s" in gave_up["said"], gave_up
    assert 3 <= gave_up["seconds"] < 12, gave_up
    assert late["said"] is not None and "rank 0" in late["said"], late
    assert late["seconds"] < 5, late
