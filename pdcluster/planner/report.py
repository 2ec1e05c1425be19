"""The planner's report: a Markdown page and PNG plots (matplotlib, Agg backend): TTFT/TPOT CDFs, goodput
against the P:D ratio, mean phase breakdown, and with a search the goodput / p90 TPOT frontier."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from pdcluster.config.slo import meets_slo
from pdcluster.entrypoints.bench_client import RequestResult
from pdcluster.planner.search import Evaluated, describe
from pdcluster.planner.sim_results import SimResult

PHASES = ("queue_s", "prefill_s", "kv_transfer_s", "decode_s")


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str, slo_ms: float | None) -> None:  # type: ignore[no-untyped-def]
    ordered = sorted(v * 1000 for v in values)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()


def plot_cdfs(results: Sequence[RequestResult], slo: dict, path: Path) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _cdf(left, [r.ttft_s for r in results if r.ok and r.ttft_s is not None], "TTFT", slo["ttft_ms"])
    _cdf(right, [r.tpot_s for r in results if r.ok and r.tpot_s is not None], "TPOT", slo["tpot_ms"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def phase_means(results: Sequence[RequestResult]) -> dict[str, float]:
    """Mean seconds of each phase over `results` that finished (0 for none)."""
    ok = [r for r in results if r.ok]
    return {p: statistics.fmean(r.phases[p] for r in ok) if ok else 0.0 for p in PHASES}


def plot_phases(results: Sequence[RequestResult], slo: dict, path: Path) -> None:
    plt = _pyplot()
    missed = [
        r for r in results if r.ok and not meets_slo(r.ttft_s, r.tpot_s, slo["ttft_ms"], slo["tpot_ms"])
    ]
    groups = {"all requests": phase_means(results), "missing the SLO": phase_means(missed)}
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(groups)
    for phase in PHASES:
        values = [g[phase] * 1000 for g in groups.values()]
        ax.bar(list(groups), values, bottom=bottoms, label=phase.removesuffix("_s"))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("mean time per request (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _save(plt, fig, ax, xlabel: str, ylabel: str, path: Path) -> None:  # type: ignore[no-untyped-def]
    """Label the axes, grid, save at 100 dpi to `path` and close the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_goodput_vs_pd(points: Sequence[Evaluated], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ordered = sorted(points, key=lambda e: e.pd_ratio)
    ax.plot([e.pd_ratio for e in ordered], [e.goodput_per_device for e in ordered], "o-")
    ax.set_xscale("log")
    _save(
        plt,
        fig,
        ax,
        "P:D device ratio (prefill devices / decode devices)",
        "goodput per device (req/s)",
        path,
    )


def pareto_frontier(points: Sequence[Evaluated]) -> list[Evaluated]:
    """Candidates no other beats on both goodput per device (higher) and p90 TPOT (lower), by TPOT."""
    scored = [e for e in points if e.result.summary["tpot_ms"]["p90"] is not None]
    scored.sort(key=lambda e: (e.result.summary["tpot_ms"]["p90"], -e.goodput_per_device))
    frontier, best = [], float("-inf")
    for e in scored:
        if e.goodput_per_device > best:
            frontier.append(e)
            best = e.goodput_per_device
    return frontier


def plot_frontier(points: Sequence[Evaluated], tpot_slo_ms: float | None, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    scored = [e for e in points if e.result.summary["tpot_ms"]["p90"] is not None]
    ax.scatter(
        [e.result.summary["tpot_ms"]["p90"] for e in scored], [e.goodput_per_device for e in scored], s=12
    )
    frontier = pareto_frontier(points)
    ax.plot(
        [e.result.summary["tpot_ms"]["p90"] for e in frontier],
        [e.goodput_per_device for e in frontier],
        "r-o",
    )
    if tpot_slo_ms is not None:
        ax.axvline(tpot_slo_ms, color="red", linestyle="--", label=f"TPOT SLO {tpot_slo_ms:g} ms")
        ax.legend()
    _save(plt, fig, ax, "p90 TPOT (ms)", "goodput per device (req/s)", path)


def _engine_line(result: SimResult) -> str:
    steps, busy, preempted = result.num_steps, result.busy_fraction, result.num_preemptions
    return (
        f"Engine steps: prefill {steps['prefill']}, decode {steps['decode']}; busy fraction: "
        f"prefill {busy['prefill']:.2f}, decode {busy['decode']:.2f}; preemptions: "
        f"prefill {preempted['prefill']}, decode {preempted['decode']}."
    )


def _sweep_row(e: Evaluated) -> str:
    summary = e.result.summary
    return (
        f"| {describe(e.topology)} | {e.pd_ratio:.2f} | {summary['goodput_requests_per_s']:.2f} | "
        f"{e.goodput_per_device:.4f} | {_ms(summary['ttft_ms']['p50'])} | {_ms(summary['tpot_ms']['p50'])} |"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def write_report(
    out_dir: Path,
    title: str,
    description: str,
    result: SimResult,
    sweep: Sequence[Evaluated],
    searched: Sequence[Evaluated] = (),
    plan_path: Path | None = None,
) -> Path:
    """Write `report.md` and the plots into `out_dir` (created); returns the report's path. `sweep`: other P:D
    ratios (the search's candidates with a search); `searched`: candidates best first (empty: no search)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = result.summary
    slo = summary["slo"]
    plot_cdfs(result.results, slo, out_dir / "ttft_tpot_cdf.png")
    plot_phases(result.results, slo, out_dir / "phase_breakdown.png")
    plot_goodput_vs_pd(sweep, out_dir / "goodput_vs_pd.png")
    means = phase_means(result.results)
    lines = [
        f"# {title}",
        "",
        description,
        "",
        "## Simulated summary",
        "",
        "```",
        result.as_table(),
        "```",
        "",
        _engine_line(result),
        "",
        "![TTFT and TPOT CDFs](ttft_tpot_cdf.png)",
        "",
        "## Where the time goes",
        "",
        "| phase | mean ms |",
        "|---|---:|",
        *[f"| {p.removesuffix('_s')} | {means[p] * 1000:.1f} |" for p in PHASES],
        "",
        "![per-phase breakdown](phase_breakdown.png)",
        "",
        "## Goodput against the P:D ratio",
        "",
        "| split | P:D devices | goodput req/s | per device | p50 TTFT ms | p50 TPOT ms |",
        "|---|---:|---:|---:|---:|---:|",
        *[_sweep_row(e) for e in sorted(sweep, key=lambda e: e.pd_ratio)],
        "",
        "![goodput against P:D](goodput_vs_pd.png)",
    ]
    if searched:
        plot_frontier(searched, slo["tpot_ms"], out_dir / "frontier.png")
        lines += [
            "",
            f"## Search: {len(searched)} candidates, best first (goodput per device under the SLO)",
            "",
            "| rank | split | devices | goodput req/s | per device | p90 TTFT ms | p90 TPOT ms |",
            "|---:|---|---:|---:|---:|---:|---:|",
            *[
                f"| {i + 1} | {describe(e.topology)} | {e.num_devices} | "
                f"{e.result.summary['goodput_requests_per_s']:.2f} | {e.goodput_per_device:.4f} | "
                f"{_ms(e.result.summary['ttft_ms']['p90'])} | {_ms(e.result.summary['tpot_ms']['p90'])} |"
                for i, e in enumerate(searched[:20])
            ],
            "",
            "![frontier](frontier.png)",
        ]
        if plan_path is not None:
            lines += ["", f"Best plan written to `{plan_path}` (`pdcluster validate {plan_path}`)."]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
