"""Shared pieces of the Python suite: tiny Hugging Face models built from a
config (no download, dropout 0), batches, and the engine settings the tests
open sessions with (a small DRAM budget; NVMe swap under the test's tmp dir)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

VOCAB = 96


def tiny_llama(tied: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tied,
                      attention_dropout=0.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    model.train()
    return model


def batch(step: int, micro: int = 0, rows: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (rows, length), generator=g)


@pytest.fixture
def settings(tmp_path):
    """Engine settings for one test: 1 GiB of DRAM, swap under tmp_path."""
    swap = tmp_path / "swap"
    swap.mkdir()
    return {"ztier.dram_budget": "1G", "ZTIER_NVME_PATHS": str(swap)}


def at_once(fn, threads: int = 2) -> list:
    """Runs ``fn()`` in `threads` threads released together; what each
    returned, in no order. The first exception any raised is raised here."""
    barrier = threading.Barrier(threads)
    results, errors = [], []

    def run():
        try:
            barrier.wait()
            results.append(fn())
        except Exception as e:  # noqa: BLE001 - raised below
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return results
