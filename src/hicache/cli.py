"""The ``hicache`` command: ``bench``, ``soak``, ``demo``, ``config [PATH]``, ``inspect`` (a storage tier),
``admin`` (a running process, through its admin endpoint) and ``pd-proxy`` (vLLM prefill/decode)."""

from __future__ import annotations

import argparse
import sys

from .errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description="A hierarchical KV cache for LLM engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="benchmarks with a real model: `hicache bench multiturn|long-context --help`")
    sub.add_parser("demo", help="a tour of the cache API on synthetic KV; `hicache demo --help` for options")
    sub.add_parser("soak", help="random multi-client traffic checking every promise: `hicache soak --help`")
    sub.add_parser("inspect", help="look into a storage tier: `hicache inspect summary|verify|purge CONFIG`")
    sub.add_parser("admin", help="attach or detach storage tiers of a running process: `hicache admin --help`")
    sub.add_parser("pd-proxy", help="OpenAI proxy for vLLM prefill/decode servers: `hicache pd-proxy --help`")
    show = sub.add_parser("config", help="validate a config file and print it with every default filled in")
    show.add_argument("path", nargs="?", default=None)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["soak"]:
        from .soak.cli import main as soak_main

        return soak_main(argv[1:])
    if argv[:1] == ["inspect"]:
        from .inspect.cli import main as inspect_main

        return inspect_main(argv[1:])
    if argv[:1] == ["admin"]:
        from .metrics.admin_cli import main as admin_main

        return admin_main(argv[1:])
    if argv[:1] == ["pd-proxy"]:
        try:
            from .integrations.vllm.pd_proxy_cli import main as pd_proxy_main
        except ImportError as exc:
            print(f"error: hicache pd-proxy needs aiohttp ({exc}): pip install 'hicache[pd]'", file=sys.stderr)
            return 2
        return pd_proxy_main(argv[1:])
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        demo_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    from .containers import load_config

    try:
        print(load_config(args.path).to_yaml(), end="")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
