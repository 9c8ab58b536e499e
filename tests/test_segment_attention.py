"""``segment_attention`` against plain attention over the whole sequence, in every shape a step can
take: a cold prefill, a short and a long step after a prefix copied into the buffer, a prefix in
runs of device pages, a decode step."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hicache.integrations.transformers.attention import SPLIT_MIN_QUERIES, Segments, available, segment_attention

pytestmark = pytest.mark.skipif(not available(torch.device("cpu")), reason="segment attention needs torch's CPU flash")

HEADS, KV_HEADS, DIM = 6, 2, 16


class _Layer(torch.nn.Module):
    """What transformers' SDPA attention reads off an attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last ``T`` of ``L`` positions attending causally to all ``L`` keys, ``[1, T, Hq, D]``."""
    queries, length = q.shape[-2], k.shape[-2]
    visible = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
    groups = HEADS // KV_HEADS
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=visible
    )
    return out.transpose(1, 2)


def tensors(length: int, queries: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, KV_HEADS, length + 7, DIM, generator=gen)[:, :, :length] for _ in range(2))  # strided
    return torch.randn(1, HEADS, queries, DIM, generator=gen), k, v


#: (keys, queries): a cold prefill; a short and a long step after keys computed before; a decode step
STEPS = pytest.mark.parametrize("length, queries", [
    (150, 150), (150, SPLIT_MIN_QUERIES - 1), (300, SPLIT_MIN_QUERIES + 5), (301, 1),
], ids=["cold", "short-step", "long-step", "decode"])


@STEPS
def test_one_buffer_gives_the_attention_over_the_whole_sequence(length: int, queries: int) -> None:
    q, k, v = tensors(length, queries, seed=length + queries)
    whole = Segments((), k, v, queries)
    out, weights = segment_attention(_Layer(), q, whole, whole, None)
    assert weights is None and out.shape == (1, queries, HEADS, DIM)
    assert torch.allclose(out, reference(q, k, v), atol=1e-6)


@STEPS
@pytest.mark.parametrize("runs", [1, 3])
def test_a_prefix_in_runs_of_pages_gives_the_same_attention(length: int, queries: int, runs: int) -> None:
    q, k, v = tensors(length, queries, seed=length * runs)
    done = 5 if queries == 1 else 0  # a decode step: own tokens computed since the prefix
    prefix = length - queries - done
    cuts = [prefix * i // runs for i in range(runs + 1)]
    views = tuple((k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:]))
    pieces = Segments(views, k[:, :, prefix:], v[:, :, prefix:], queries)
    out, _ = segment_attention(_Layer(), q, pieces, pieces, None)
    assert torch.allclose(out, reference(q, k, v), atol=1e-6)


def test_a_cold_prefill_is_the_models_own_sdpa_call_bit_for_bit() -> None:
    q, k, v = tensors(200, 200, seed=3)
    whole = Segments((), k, v, 200)
    ours, _ = segment_attention(_Layer(), q, whole, whole, None)
    theirs, _ = sdpa_attention_forward(_Layer(), q, k, v, None)  # what the model runs without a mask
    assert torch.equal(ours, theirs)


def test_other_keys_are_refused() -> None:
    q, k, v = tensors(10, 10, seed=4)
    with pytest.raises(TypeError, match="PrefixCache"):
        segment_attention(_Layer(), q, k, v, None)  # type: ignore[arg-type]
    whole = Segments((), k, v, 10)
    with pytest.raises(NotImplementedError, match="sliding"):
        segment_attention(_Layer(), q, whole, whole, None, sliding_window=4)
