"""``--repeat N``: every configuration N times, in alternating order, and the figures pooled.

On a shared two-core machine the speed of the same run drifts by 30% over minutes, as much as
the gaps the targets are about. Running the configurations ``A B C``, then ``C B A``, then
``A B C``... puts every configuration at the same average position in time, so a slow stretch
of the machine weighs on all of them alike; the pooled mean of each configuration (every
repeat has the same requests, so it is the mean of the repeats' means) then gives ratios that
no longer carry the drift. Each repeat is still a whole, honest run: a fresh process per
configuration, the cache cold, its background work overlapping its own next requests. The
per-repeat ratios are kept too, to show the spread.
"""

from __future__ import annotations

from typing import Any

from .report import _grid, add_oracle_ratios, check_targets, summarise

__all__ = ["format_repeats", "per_repeat", "pool", "run_order", "spread", "summarise_runs"]


def run_order(configs: list[str], repeats: int) -> list[list[str]]:
    """The order of each repeat: as given, then reversed, alternately.

    ``warm-restart`` stays right after ``hierarchical`` (it reads the file tier that run left).
    """
    units = [[name, "warm-restart"] if name == "hierarchical" and "warm-restart" in configs else [name]
             for name in configs if name != "warm-restart" or "hierarchical" not in configs]
    orders = []
    for k in range(repeats):
        seq = units if k % 2 == 0 else list(reversed(units))
        orders.append([name for unit in seq for name in unit])
    return orders


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's summary over all its repeats: every request of every repeat pooled.

    Each run's clock starts anew, so durations (and the throughputs drawn from them) are summed
    over the runs, not taken from the first arrival to the last token across them; an interleaved
    run's duration is its own turns' time (``interleave.py``).
    """
    records = [r for run in runs for r in run["records"]]
    summary = summarise(records, sum(run["wall_s"] for run in runs))
    interleaved = any(run.get("interleaved_with") for run in runs)
    if len(runs) > 1 or interleaved:
        # interleaved: the records' clock also ran through the other configurations' turns
        duration = sum(run["wall_s"] if interleaved else _span(run["records"]) for run in runs)
        summary["duration_s"] = duration
        summary["input_tok_s"] = summary["input_tokens"] / duration
        summary["output_tok_s"] = summary["output_tokens"] / duration
    if interleaved:
        drains = [d for run in runs for d in run.get("drain_s", [])]
        summary["drain_s"] = {"mean": sum(drains) / len(drains), "max": max(drains)} if drains else None
    summary["repeats"] = len(runs)
    return summary


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's result over all repeats, shaped as one run's (records tagged ``repeat``)."""
    first, last = runs[0], runs[-1]
    records = [{**r, "repeat": k} for k, run in enumerate(runs) for r in run["records"]]
    machine = dict(first["machine"])
    machine["cpu_pressure_after"] = last["machine"]["cpu_pressure_after"]
    return {
        **first,
        "profile": _pooled_profile(runs),
        "records": records,
        "wall_s": sum(run["wall_s"] for run in runs),
        "machine": machine,
        "cache_stats_by_repeat": [run["cache_stats"] for run in runs],
    }


def per_repeat(runs: dict[str, list[dict[str, Any]]], orders: list[list[str]]) -> list[dict[str, Any]]:
    """Each repeat's own figures: mean TTFT per configuration and the targets, as one run gives them."""
    out = []
    for k, order in enumerate(orders):
        summaries = {name: summarise(rs[k]["records"], rs[k]["wall_s"]) for name, rs in runs.items()}
        add_oracle_ratios(summaries)
        out.append({
            "order": order,
            "ttft_mean_s": {name: s["ttft_s"]["mean"] for name, s in summaries.items()},
            "ttft_cpu_mean_s": {name: s["ttft_cpu_s"]["mean"] for name, s in summaries.items()},
            "targets": check_targets(summaries),
        })
    return out


def spread(repeats: list[dict[str, Any]], key: str) -> tuple[list[float], int]:
    """A target's value in each repeat, and in how many it was met."""
    values = [r["targets"][key]["value"] for r in repeats if key in r["targets"]]
    met = sum(1 for r in repeats if key in r["targets"] and r["targets"][key]["met"])
    return values, met


def format_repeats(repeats: list[dict[str, Any]]) -> str:
    """One line per repeat: its order, and the mean TTFT (ms) of each configuration in it."""
    names = list(repeats[0]["ttft_mean_s"])
    rows = [["repeat", "order", *[f"{n} TTFT" for n in names]]]
    for k, r in enumerate(repeats):
        rows.append([str(k + 1), " ".join(r["order"]), *[f"{r['ttft_mean_s'][n] * 1000:,.0f}" for n in names]])
    return _grid(rows)


def _span(records: list[dict[str, Any]]) -> float:
    """One run's duration: its first arrival to its last token (as ``summarise`` counts it)."""
    return max(max(r["finished_s"] for r in records) - min(r["arrival_s"] for r in records), 1e-9)


def _pooled_profile(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``--profile``: the traced work summed over the repeats (per request, as the pooled records);
    torch.profiler's operator table of the first repeat."""
    if runs[0].get("profile") is None:
        return None
    activity: dict[str, dict[str, float]] = {}
    for run in runs:
        for label, a in ((run.get("profile") or {}).get("activity") or {}).items():
            into = activity.setdefault(label, dict.fromkeys(a, 0))
            for key, value in a.items():
                into[key] = into.get(key, 0) + value
    return {**runs[0]["profile"], "activity": activity}
