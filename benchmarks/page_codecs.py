"""Page codec candidates on real KV: compression ratio and GB/s per core, and what 8-bit KV costs in accuracy.

Usage::

    python benchmarks/page_codecs.py [--tokens 1024] [--page-size 64] [--repeat 3] [--json out.json]

Runs SmolLM2-135M (real weights, ``hicache.bench.models``) over a prompt of English text, takes its KV
(30 layers x 3 KV heads x 64 dims per token) as pages in the page format's order ``[K/V, layer, token,
head, dim]`` and times, on one thread, each candidate on every page, in fp32 and cast to bf16 and fp16:

* **lossless**: byte-shuffle (the bytes of each element grouped by significance) with numpy, then
  ``zstandard`` (level 1, 3) or ``lz4`` (block); and ``blosc2``'s own SIMD shuffle with its LZ4 or
  Zstd codec (one thread). Ratio = logical bytes / stored bytes; encode and decode GB/s are of
  logical bytes, one core, with the output going to a preallocated buffer where the library can;
* **lossy (8-bit)**: fp8 e4m3 with one scale per (K/V, layer, head) of the page, and int8 with
  KIVI-style scales (K per channel, V per token, fp16 scales): stored bytes, relative L2 error of
  the dequantised KV, and the first-token logits when the prompt's first 75% is restored from the
  dequantised KV and the rest prefilled (mean and max |logit difference| against a full prefill,
  and whether the greedy token is the same), at several prefix lengths.

The lossless rows are what ``docs/codecs.md`` chooses the ``lossless`` codec's
library from, the lossy rows what chooses the 8-bit scheme. GB = 1e9 B; one thread
(``torch.set_num_threads(1)``). Record /proc/pressure/cpu with the numbers: these machines are shared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

TEXT = (
    "The history of the city goes back more than two thousand years. It was founded on the banks of a wide "
    "river, where traders from the north met merchants who had sailed up from the sea. Over the centuries "
    "it grew from a small market town into a capital, with a cathedral, a university and a harbour that "
    "could hold a hundred ships. Its people were known for their skill with glass and with numbers: the "
    "first bank of the region opened here, and the ledgers it kept are still read by historians today. "
    "Wars came and went; the walls were built, torn down and built again. In the last century the old "
    "quarter was restored, the trams returned, and the riverside became a long park where families walk "
    "on Sunday afternoons. Visitors come for the museums, the food and the music that fills the squares "
    "on summer evenings. "
)


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return "(unreadable)"


def real_kv(tokens: int) -> tuple[object, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """SmolLM2, the prompt's ids, and its per-layer K and V ``[1, H, T, D]`` (fp32)."""
    from hicache.bench.models import load_model, load_tokenizer

    model = load_model("smollm2")
    tok = load_tokenizer("smollm2")
    if tok is not None:
        ids = tok(TEXT * (1 + tokens // 150), return_tensors="pt").input_ids[:, :tokens]
    else:  # no tokenizer: fixed ids in the vocabulary's common range
        ids = torch.randint(100, 10000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.past_key_values
    keys = [layer.keys.detach().clone() for layer in cache.layers]
    values = [layer.values.detach().clone() for layer in cache.layers]
    return model, ids, keys, values


def as_pages(keys: list[torch.Tensor], values: list[torch.Tensor], page_size: int) -> torch.Tensor:
    """``[pages, 2, L, page_size, H, D]`` from per-layer ``[1, H, T, D]`` (the page format's order)."""
    k = torch.stack([x[0] for x in keys])  # [L, H, T, D]
    v = torch.stack([x[0] for x in values])
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4)  # [2, L, T, H, D]
    t = kv.shape[2] // page_size * page_size
    kv = kv[:, :, :t].reshape(2, kv.shape[1], t // page_size, page_size, kv.shape[3], kv.shape[4])
    return kv.permute(2, 0, 1, 3, 4, 5).contiguous()


# --------------------------------------------------------------------------- lossless candidates


def shuffle(raw: np.ndarray, itemsize: int, out: np.ndarray) -> np.ndarray:
    """Byte planes: all first bytes of every element, then all second bytes, ... (into ``out``)."""
    planes = out.reshape(itemsize, -1)
    np.copyto(planes, raw.reshape(-1, itemsize).T)
    return out


def unshuffle(planes: np.ndarray, itemsize: int, out: np.ndarray) -> np.ndarray:
    np.copyto(out.reshape(-1, itemsize), planes.reshape(itemsize, -1).T)
    return out


def lossless_candidates() -> dict[str, tuple[Callable, Callable]]:
    """name -> (encode(raw u8, itemsize, scratch) -> stored, decode(stored, itemsize, out u8, scratch))."""
    out: dict[str, tuple[Callable, Callable]] = {}
    try:
        import zstandard

        for level in (1, 3):
            cctx = zstandard.ZstdCompressor(level=level)
            dctx = zstandard.ZstdDecompressor()

            def z_enc(raw, itemsize, scratch, cctx=cctx):
                return cctx.compress(shuffle(raw, itemsize, scratch))

            def z_dec(stored, itemsize, out_, scratch, dctx=dctx):
                planes = np.frombuffer(dctx.decompress(stored, max_output_size=out_.nbytes), np.uint8)
                return unshuffle(planes, itemsize, out_)

            out[f"numpy shuffle + zstandard {zstandard.__version__} level {level}"] = (z_enc, z_dec)
    except ImportError:
        print("zstandard missing", file=sys.stderr)
    try:
        import lz4
        import lz4.block

        def l_enc(raw, itemsize, scratch):
            return lz4.block.compress(shuffle(raw, itemsize, scratch), store_size=False)

        def l_dec(stored, itemsize, out_, scratch):
            planes = np.frombuffer(lz4.block.decompress(stored, uncompressed_size=out_.nbytes), np.uint8)
            return unshuffle(planes, itemsize, out_)

        out[f"numpy shuffle + lz4 {lz4.__version__} block"] = (l_enc, l_dec)
    except ImportError:
        print("lz4 missing", file=sys.stderr)
    try:
        import blosc2

        blosc2.set_nthreads(1)
        for codec, level in ((blosc2.Codec.LZ4, 5), (blosc2.Codec.ZSTD, 1), (blosc2.Codec.LZ4HC, 1)):
            for filt in (blosc2.Filter.SHUFFLE, blosc2.Filter.BITSHUFFLE):

                def b_enc(raw, itemsize, scratch, codec=codec, level=level, filt=filt):
                    return blosc2.compress2(raw, typesize=itemsize, clevel=level, codec=codec, filters=[filt],
                                            nthreads=1, splitmode=blosc2.SplitMode.ALWAYS_SPLIT)

                def b_dec(stored, itemsize, out_, scratch):
                    blosc2.decompress2(stored, dst=out_, nthreads=1)
                    return out_

                out[f"blosc2 {blosc2.__version__} {filt.name.lower()} + {codec.name.lower()} {level}"] = (b_enc, b_dec)
    except ImportError:
        print("blosc2 missing", file=sys.stderr)
    return out


def measure_lossless(pages: torch.Tensor, repeat: int) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        data = pages.to(dtype)
        raws = [data[i].view(-1).view(torch.uint8).numpy() for i in range(data.shape[0])]
        itemsize = data.element_size()
        logical = sum(r.nbytes for r in raws)
        scratch = np.empty(raws[0].nbytes, np.uint8)
        out = np.empty(raws[0].nbytes, np.uint8)
        for name, (enc, dec) in lossless_candidates().items():
            enc_s, dec_s = [], []
            stored_bytes = 0
            for _ in range(repeat):
                t0 = time.perf_counter()
                stored = [enc(r, itemsize, scratch) for r in raws]
                enc_s.append(time.perf_counter() - t0)
                stored_bytes = sum(len(s) for s in stored)
                t0 = time.perf_counter()
                for s in stored:
                    dec(s, itemsize, out, scratch)
                dec_s.append(time.perf_counter() - t0)
            for r, s in zip(raws, stored, strict=True):  # outside the clock: round trip is exact
                assert np.array_equal(dec(s, itemsize, out, scratch), r), name
            rows[f"{str(dtype).removeprefix('torch.')}: {name}"] = {
                "ratio": logical / stored_bytes,
                "encode_gbps": logical / statistics.median(enc_s) / 1e9,
                "decode_gbps": logical / statistics.median(dec_s) / 1e9,
            }
    return rows


# --------------------------------------------------------------------------- lossy candidates


def fp8_roundtrip(page: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp8 e4m3, one fp16 scale per (K/V, layer, head): ``[2, L, P, H, D]`` in, dequantised out."""
    amax = page.abs().amax(dim=(2, 4), keepdim=True).float().clamp_min(1e-8)  # [2, L, 1, H, 1]
    scale = (amax / 448.0).half().float()
    q = (page.float() / scale).to(torch.float8_e4m3fn)
    stored = q.numel() + scale.numel() * 2
    return (q.float() * scale).to(page.dtype), stored


def int8_roundtrip(page: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int8 symmetric, K per channel (over the page's tokens), V per token (over head dim), fp16 scales."""
    k, v = page[0].float(), page[1].float()  # [L, P, H, D]
    k_scale = (k.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-8).half().float()  # [L, 1, H, D]
    v_scale = (v.abs().amax(dim=3, keepdim=True) / 127.0).clamp_min(1e-8).half().float()  # [L, P, H, 1]
    kq = (k / k_scale).round().clamp(-127, 127).to(torch.int8)
    vq = (v / v_scale).round().clamp(-127, 127).to(torch.int8)
    stored = kq.numel() + vq.numel() + 2 * (k_scale.numel() + v_scale.numel())
    return torch.stack([kq.float() * k_scale, vq.float() * v_scale]).to(page.dtype), stored


def first_token_logits(model, ids: torch.Tensor, keys, values, prefix: int) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k[:, :, :prefix].contiguous(), v[:, :, :prefix].contiguous(), i)
    with torch.no_grad():
        return model(ids[:, prefix:], past_key_values=cache, use_cache=True).logits[0, -1].float()


def measure_lossy(model, ids, keys, values, page_size: int) -> dict[str, dict[str, float]]:
    pages = as_pages(keys, values, page_size)
    tokens = pages.shape[0] * page_size
    rows: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        full = model(ids[:, :tokens]).logits[0, -1].float()
    for dtype in (torch.float32, torch.bfloat16):
        data = pages.to(dtype)
        for name, fn in (("fp8 e4m3, scale per (K/V, layer, head)", fp8_roundtrip),
                         ("int8, K per channel / V per token (KIVI)", int8_roundtrip)):
            outs, stored = [], 0
            for i in range(data.shape[0]):
                d, s = fn(data[i])
                outs.append(d)
                stored += s
            deq = torch.stack(outs).float()
            err = (deq - data.float()).norm() / data.float().norm()
            # back to per-layer [1, H, T, D]
            kv = deq.permute(1, 2, 0, 3, 4, 5).reshape(2, deq.shape[2], tokens, deq.shape[4], deq.shape[5])
            ks = [kv[0, layer].permute(1, 0, 2).unsqueeze(0) for layer in range(kv.shape[1])]
            vs = [kv[1, layer].permute(1, 0, 2).unsqueeze(0) for layer in range(kv.shape[1])]
            diffs, same = [], []
            for frac in (0.25, 0.5, 0.75):
                prefix = int(tokens * frac) // page_size * page_size
                got = first_token_logits(model, ids[:, :tokens], ks, vs, prefix)
                diffs.append((got - full).abs())
                same.append(int(got.argmax()) == int(full.argmax()))
            rows[f"{str(dtype).removeprefix('torch.')}: {name}"] = {
                "ratio": data.numel() * data.element_size() / stored,
                "rel_l2_error": float(err),
                "logit_mean_abs_diff": float(torch.stack(diffs).mean()),
                "logit_max_abs_diff": float(torch.stack(diffs).max()),
                "greedy_same": sum(same) / len(same),
            }
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-lossy", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = cpu_pressure()
    print(f"cpu pressure at start: {start}")
    model, ids, keys, values = real_kv(args.tokens)
    pages = as_pages(keys, values, args.page_size)
    print(f"SmolLM2 KV: {pages.shape[0]} pages of {tuple(pages.shape[1:])}, {args.tokens} tokens")
    lossless = measure_lossless(pages, args.repeat)
    print(f"\n{'lossless candidate (one thread)':<62} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9}")
    for name, r in lossless.items():
        print(f"{name:<62} {r['ratio']:>6.3f} {r['encode_gbps']:>9.2f} {r['decode_gbps']:>9.2f}")
    lossy = {} if args.skip_lossy else measure_lossy(model, ids, keys, values, args.page_size)
    if lossy:
        print(f"\n{'8-bit candidate':<52} {'ratio':>6} {'rel err':>8} {'mean|dl|':>9} {'max|dl|':>8} {'greedy':>7}")
        for name, r in lossy.items():
            print(f"{name:<52} {r['ratio']:>6.3f} {r['rel_l2_error']:>8.4f} {r['logit_mean_abs_diff']:>9.4f} "
                  f"{r['logit_max_abs_diff']:>8.4f} {r['greedy_same']:>7.2f}")
    end = cpu_pressure()
    print(f"\ncpu pressure at end: {end}")
    if args.json:
        args.json.write_text(json.dumps({"lossless": lossless, "lossy": lossy, "cpu_pressure_start": start,
                                         "cpu_pressure_end": end, "tokens": args.tokens,
                                         "page_size": args.page_size}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
