"""A second SGLang process for ``test_shared.py``: its own host pool and backends over the same tiers.

``python -m tests.sglang.peer '<json>'`` with ``{"tiers": {name: extra config}, "write": [token seed,
data seed], "read": token seed}``: writes its pages to every tier, prints ``{"written": {tier: digest}}``,
waits for a line on stdin, reads the other process's pages and prints ``{"read": {tier: digest | null}}``.
"""

from __future__ import annotations

import hashlib
import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    from tests.sglang.conftest import import_sglang

    import_sglang()
    from sglang.srt.runtime_context import get_parallel

    from tests.sglang.harness import backend, fill, page_bytes, page_hashes, pools, tokens_for

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    _, host = pools("page_first")
    ps, pages = host.page_size, args["pages"]
    backends = {name: backend(host, extra) for name, extra in args["tiers"].items()}
    try:
        tokens = tokens_for(pages, ps, seed=args["write"][0])
        slots = host.alloc(len(tokens))
        fill(host, slots, seed=args["write"][1])
        written = {}
        for name, b in backends.items():
            assert all(b.batch_set_v1(page_hashes(tokens, ps), slots)), name
            written[name] = hashlib.sha256(page_bytes(host, slots).numpy().tobytes()).hexdigest()
        print(json.dumps({"written": written}), flush=True)
        sys.stdin.readline()
        theirs = tokens_for(pages, ps, seed=args["read"])
        read = {}
        for name, b in backends.items():
            back = host.alloc(len(theirs))
            ok = b.batch_get_v1(page_hashes(theirs, ps), back)
            read[name] = hashlib.sha256(page_bytes(host, back).numpy().tobytes()).hexdigest() if all(ok) else None
            host.free(back)
        print(json.dumps({"read": read}), flush=True)
    finally:
        for b in backends.values():
            b.close()


if __name__ == "__main__":
    main()
