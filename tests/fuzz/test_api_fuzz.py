"""Fuzzing every public call of the cache with argument values and types (issue 11, the fuzz suite).

Drawn: token sequences (lists, tuples, tensors of every dtype, on the meta device, sparse, nested,
non-integers, out-of-range ids), kv tensors (every dtype, right and wrong shapes, transposed,
sparse, meta, requiring grad) and non-tensors, ``start``, ``priority``, ``reserve`` sizes,
``commit`` pages, view layer indices. Calls run in random order on a cache whose device is full.

The property, for every call: it succeeds or raises a ``HiCacheError`` (never an untyped exception),
within a bounded time; a rejected call leaves the cache exactly as it was; and at the end no page,
pin or lease is left behind.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache import HiCache
from hicache.errors import HiCacheError

from ..conftest import make_config, make_kv, make_tokens
from ..helpers import assert_consistent, snapshot
from .conftest import examples

PAGE = 4
CONFIG = make_config(8, 16, policies={"eviction": "priority"})
M = CONFIG.model
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.complex64]
CONFIG_DEVICE_PAGES = 8
CALL_S = 10.0  # no call may take longer: a hang is a failure

ints = st.one_of(
    st.integers(-3, 40), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True), st.none(),
    st.text(max_size=3), st.just([1]),
)


@st.composite
def token_values(draw: st.DrawFn) -> Any:
    n = draw(st.integers(0, 24))
    base = draw(st.lists(st.integers(0, 60_000), min_size=n, max_size=n))
    kind = draw(st.sampled_from(["list", "tuple", "tensor", "weird", "bad-id", "nested", "meta", "sparse", "other"]))
    if kind == "list":
        return base
    if kind == "tuple":
        return tuple(base)
    if kind == "tensor":
        dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32, torch.bool]))
        return torch.tensor(base, dtype=torch.int64).to(dtype)  # int16 wraps: ids that are not what was meant
    if kind == "weird":
        return [*base, draw(st.one_of(st.floats(), st.text(max_size=2), st.none(), st.booleans()))]
    if kind == "bad-id":
        return [*base, draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63)))]
    if kind == "nested":
        return [base]
    if kind == "meta":
        return torch.tensor(base, dtype=torch.int64).to("meta")
    if kind == "sparse":
        return torch.tensor(base or [0], dtype=torch.int64).to_sparse()
    return draw(st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=16), st.integers()))


@st.composite
def kv_values(draw: st.DrawFn, num_tokens: int) -> Any:
    kind = draw(st.sampled_from(["right", "right", "dtype", "shape", "tokens", "transposed", "sparse", "meta",
                                 "grad", "other"]))
    shape = [M.kv_components, M.num_layers, num_tokens, M.num_kv_heads, M.head_dim]
    if kind == "other":
        return draw(st.one_of(st.none(), st.integers(), st.lists(st.floats(), max_size=3), st.text(max_size=3)))
    dtype = draw(st.sampled_from(DTYPES)) if kind == "dtype" else M.torch_dtype
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=6))
    if kind == "tokens":
        shape[2] = draw(st.integers(0, 30))
    kv = torch.ones(shape, dtype=torch.float64).to(dtype)
    if kind == "transposed" and kv.dim() == 5:
        kv = kv.transpose(3, 4).contiguous().transpose(3, 4)  # same shape, other strides
    if kind == "sparse":
        kv = kv.to_sparse()
    if kind == "meta":
        kv = kv.to("meta")
    if kind == "grad" and kv.is_floating_point():
        kv = kv.requires_grad_()
    return kv


@st.composite
def calls(draw: st.DrawFn) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        verb = draw(st.sampled_from(["lookup", "store", "retrieve", "reserve", "layer"]))
        tokens = draw(token_values())
        n = len(tokens) if isinstance(tokens, (list, tuple)) else draw(st.integers(0, 24))
        args: dict[str, Any] = {"tokens": tokens}
        if verb == "store":
            start = draw(st.one_of(st.just(0), st.sampled_from([4, 8]), ints))
            kv_tokens = n - start if isinstance(start, int) and not isinstance(start, bool) and 0 <= start <= n else n
            args |= {"kv": draw(kv_values(max(kv_tokens, 0))), "start": start,
                     "priority": draw(st.one_of(st.integers(-5, 5), ints))}
        elif verb == "reserve":
            args |= {"num_pages": draw(st.one_of(st.integers(0, 10), ints)),
                     "first_page": draw(st.one_of(st.integers(0, 3), ints)),
                     "priority": draw(st.one_of(st.integers(-5, 5), ints))}
        elif verb == "layer":
            args |= {"layer": draw(st.one_of(st.integers(-2, M.num_layers + 1), ints))}
        elif verb == "lookup":
            args |= {"prefetch": draw(st.booleans())}
        out.append((verb, args))
    return out


async def run_call(cache: HiCache, verb: str, args: dict[str, Any]) -> None:
    tokens = args["tokens"]
    if verb == "lookup":
        await cache.lookup(tokens, prefetch=args["prefetch"])
    elif verb == "store":
        await cache.store(tokens, args["kv"], start=args["start"], priority=args["priority"])
    elif verb == "retrieve":
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
    elif verb == "reserve":
        async with cache.reserve(args["num_pages"]) as res:
            await res.commit(tokens, args["first_page"], priority=args["priority"])
    else:
        async with cache.retrieve(tokens) as view:
            await view.wait_layer(args["layer"])
            view.layer(args["layer"])


def valid_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= CONFIG_DEVICE_PAGES


async def program(program_calls: list[tuple[str, dict[str, Any]]]) -> None:
    async with HiCache.from_config(CONFIG) as cache:
        for seed in range(2):  # the device is full: a call that evicts before it fails would show
            await cache.store(make_tokens(16, seed=seed), make_kv(CONFIG, 16, seed=seed))
        await cache.wait_idle()
        for verb, args in program_calls:
            before = snapshot(cache)
            try:
                with anyio.fail_after(CALL_S):
                    await run_call(cache, verb, args)
            except HiCacheError:
                await cache.wait_idle()
                # A rejected call changes nothing. (A reserve whose commit is rejected may have
                # evicted for its pages first, as any valid reserve does: only its own check counts.)
                if verb in ("store", "lookup") or (verb == "reserve" and not valid_count(args["num_pages"])):
                    assert snapshot(cache) == before, f"{verb}({args}) was rejected but changed the cache"
            except TimeoutError:
                raise AssertionError(f"{verb} did not return within {CALL_S} s") from None
            await cache.wait_idle()
            assert_consistent(cache)


@examples(60)
@given(program_calls=calls())
def test_public_calls_raise_typed_errors_and_change_nothing_when_rejected(
    program_calls: list[tuple[str, dict[str, Any]]],
) -> None:
    anyio.run(program, program_calls)
