"""ops/fp8_quality.py's machinery on a tiny transformers-made model (no demo model training here): its one-step
prefill of many windows through the engine's model gives transformers' logits at every position, and its
figures are the textbook ones (top-1 agreement, KL(original || variant), cross-entropy)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from engine_models import build_hf_model, hf_logits, prompts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops"))
import fp8_quality  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, object]:
    path = str(tmp_path_factory.mktemp("fp8q_llama"))
    return path, build_hf_model("llama", path)


def test_prefill_of_several_windows_gives_transformers_logits_at_every_position(llama) -> None:
    path, model = llama
    batch = torch.tensor(prompts(11, [24, 24, 24]))
    engine = fp8_quality.build(path, fp8_quality.VARIANTS[0], batch.numel(), BLOCK)
    logits = fp8_quality.prefill_logits(engine, batch, BLOCK)
    assert logits.shape == (3, 24, model.config.vocab_size)
    for window, got in zip(batch.tolist(), logits, strict=True):
        torch.testing.assert_close(got, hf_logits(model, window), atol=2e-4, rtol=1e-4)


def test_the_fp8_kv_variant_writes_an_fp8_cache_and_moves_the_logits_a_little(llama) -> None:
    path, _ = llama
    batch = torch.tensor(prompts(12, [16, 16]))
    runs = {}
    for variant in (fp8_quality.VARIANTS[0], fp8_quality.VARIANTS[2]):
        engine = fp8_quality.build(path, variant, batch.numel(), BLOCK)
        runs[variant.name] = fp8_quality.prefill_logits(engine, batch, BLOCK)
    assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    figures = fp8_quality.compare(runs["float32 (original)"], runs["fp8-kv"], batch[:, 1:])
    assert 0 < figures["mean_kl_nats"] < 0.05 and figures["top1_agreement"] > 0.5


def test_compare_computes_agreement_kl_and_loss_as_defined() -> None:
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(3, 5, 7, generator=gen)
    variant = reference + 0.5 * torch.randn(3, 5, 7, generator=gen)
    targets = torch.randint(0, 7, (3, 4), generator=gen)
    figures = fp8_quality.compare(reference, variant, targets)
    p = torch.distributions.Categorical(logits=reference)
    q = torch.distributions.Categorical(logits=variant)
    assert figures["mean_kl_nats"] == pytest.approx(torch.distributions.kl_divergence(p, q).mean().item(), rel=1e-5)
    agree = sum(int(r.argmax() == v.argmax()) for r, v in zip(reference.view(-1, 7), variant.view(-1, 7), strict=True))
    assert figures["top1_agreement"] == pytest.approx(agree / 15)
    loss = -q.log_prob(torch.cat([targets, targets[:, :1]], 1))[:, :-1].mean().item()
    assert figures["held_out_loss"] == pytest.approx(loss, rel=1e-5)
    same = fp8_quality.compare(reference, reference, targets)
    assert same["top1_agreement"] == 1.0 and abs(same["mean_kl_nats"]) < 1e-6
