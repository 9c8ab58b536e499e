"""Benchmarks with a real model: ``hicache bench multiturn`` and ``hicache bench long-context``.

* ``workloads``: the traces (multi-turn chats; questions on long shared documents).
* ``driver``: arrivals, ready queue and concurrency cap, as SGLang's ``bench_multiturn.py``.
* ``scenarios``: the compared configurations and their tier sizes.
* ``worker``: one configuration in a fresh process; ``cli`` runs them all and reports.
* ``report``: summaries, the table, the plot; ``models``: SmolLM2 and random Llamas.
"""
