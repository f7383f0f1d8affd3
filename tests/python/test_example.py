"""examples/finetune_hf.py as a user runs it: a --tiny Llama on the fortunes
corpus, whose loss falls; its export loads with --model; resume and bad
arguments behave."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_hf.py")


def run(*args, check=True):
    p = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {p.stderr[-2000:]}")
    return p


@pytest.mark.skipif(not os.path.isdir("/usr/share/games/fortunes"),
                    reason="the fortunes corpus is not installed")
def test_tiny_fine_tune_loss_falls_then_resumes_and_reloads(tmp_path):
    out = tmp_path / "run"
    first = json.loads(run("--tiny", "--steps", "40", "--seq", "64", "--out", str(out),
                           "--save-every", "20", "--json").stdout.splitlines()[-1])
    assert first["last_loss"] < 0.8 * first["first_loss"], first
    assert (out / "export" / "model.safetensors").exists()
    refused = run("--tiny", "--steps", "5", "--out", str(out), check=False)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = json.loads(run("--tiny", "--steps", "45", "--seq", "64", "--out", str(out),
                             "--resume", "--json").stdout.splitlines()[-1])
    assert resumed["steps"] == 5
    reloaded = json.loads(run("--model", str(out / "export"), "--steps", "2", "--seq", "64",
                              "--out", str(tmp_path / "again"), "--json").stdout.splitlines()[-1])
    assert reloaded["first_loss"] < 0.9 * first["first_loss"]  # trained weights, not fresh


def test_help_gives_every_options_default():
    # Half the options had no help line, so --help did not say their
    # defaults (--steps 200, --lr 0.002, ...).
    text = run("--help").stdout.split("\noptions:", 1)[1]
    for option, default in (("--steps", "200"), ("--lr", "0.002"), ("--accumulation", "1"),
                            ("--weight-decay", "0.1"), ("--clip", "1.0"), ("--states", "dram"),
                            ("--dram-budget", "4G"), ("--out", "finetune-run"),
                            ("--save-every", "100"), ("--seed", "0"), ("--batch", "4")):
        line = text[text.index("\n  " + option + " "):].split("\n  -", 2)[1]
        assert f"(default: {default})" in " ".join(line.split()), (option, line)


def test_bad_arguments_exit_2(tmp_path):
    assert run("--tiny", "--steps", "0", check=False).returncode == 2
    bad = run("--tiny", "--data", str(tmp_path / "missing.txt"), check=False)
    assert bad.returncode == 2 and "missing.txt" in bad.stderr
    assert run("--states", "nvme", "--tiny", check=False).returncode == 2
    # They ended in tracebacks, exit 1 (--save-every 0 after a step had
    # trained), and left an empty --out behind.
    out = tmp_path / "never"
    for bad in (["--save-every", "0"], ["--lr", "nan"], ["--clip", "-1"],
                ["--device", "mps"], ["--dram-budget", "lots"],
                ["--states", "nvme", "--nvme", str(tmp_path / "none")]):
        p = run("--tiny", "--steps", "2", "--out", str(out), *bad, check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (bad, p.stderr[-800:])
    p = run("--model", str(tmp_path / "nothing"), "--out", str(out), check=False)
    assert p.returncode == 2 and "not a directory" in p.stderr, p.stderr[-800:]
    assert not out.exists()
    # The engine's refusals too ended in tracebacks: said in one line, exit 1.
    p = run("--tiny", "--steps", "2", "--out", str(tmp_path / "small"), "--dram-budget", "1M",
            check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-800:]
    assert "finetune_hf: resource_exhausted" in p.stderr and "dram_budget" in p.stderr, p.stderr


def test_a_finished_or_mismatched_run_resumes_from_its_checkpoints_step(tmp_path):
    # The step came from progress.json, written after the checkpoint: a kill
    # between the two resumed at the older step on the newer weights; a
    # --resume of a finished run crashed formatting a loss it never had.
    out = tmp_path / "run"
    args = ["--tiny", "--steps", "4", "--seq", "32", "--batch", "2", "--out", str(out)]
    run(*args, "--save-every", "2")
    done = run(*args, "--resume", check=False)
    assert done.returncode == 0 and "nothing to do" in done.stderr, done.stderr[-800:]
    below = run(*args[:-2], "--steps", "3", "--out", str(out), "--resume", check=False)
    assert below.returncode == 2 and "below it" in below.stderr, below.stderr[-800:]
    (out / "progress.json").write_text('{"step": 1}')  # what an older run could leave
    more = run(*args[:2], "6", *args[3:], "--resume", "--json")
    assert json.loads(more.stdout.splitlines()[-1])["steps"] == 2
