"""`pdcluster plan`: the summary, the report with its plots, and --search's plan YAML."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdcluster.config import load_topology
from pdcluster.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]
TRACE = "AzureLLMInferenceTrace_conv.csv"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pngs(out: Path, names: tuple[str, ...]) -> None:
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def test_plan_cm384_prints_the_summary_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["plan", str(REPO / "clusters" / "cm384.yaml"), "--trace", TRACE, "--num-requests", "300"]
    argv += ["--rate", "200", "--out", str(out), "--search-num-requests", "100"]  # model.weight_dtype: int8
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "requests: 300 ok / 300 (0 failed)" in printed
    assert (
        "TTFT ms" in printed
        and "TPOT ms" in printed
        and "goodput (TTFT <= 2000 ms and TPOT <= 50 ms)" in printed
    )
    report = (out / "report.md").read_text()
    for section in ("## Simulated summary", "## Where the time goes", "## Goodput against the P:D ratio"):
        assert section in report
    _pngs(out, ("ttft_tpot_cdf.png", "goodput_vs_pd.png", "phase_breakdown.png"))
    assert not (out / "plan.yaml").exists()
    assert "does not fit device memory" not in printed  # int8 weights + the file's KV fit a 910C die


def test_plan_search_writes_a_yaml_validate_accepts(tmp_path, capsys):
    out = tmp_path / "search"
    argv = ["plan", str(REPO / "clusters" / "local-1p2d.yaml"), "--trace", TRACE, "--num-requests", "20"]
    argv += ["--rate", "2", "--out", str(out), "--search", "--search-num-requests", "10", "--json"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["num_requests"] == 20 and printed["plan"] == str(out / "plan.yaml")
    ranked = [c["goodput_per_device"] for c in printed["search"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) >= 2
    assert main(["validate", str(out / "plan.yaml")]) == 0
    assert "ok" in capsys.readouterr().out
    _pngs(out, ("frontier.png",))
    assert "## Search:" in (out / "report.md").read_text()


def test_plan_search_on_cm384_ranks_only_splits_that_fit_a_die(tmp_path, capsys):
    # DeepSeek-V3 on 64 GiB dies (tests/planner/test_search.py has the bytes by hand): in bf16 no split fits,
    # and the search fails before simulating anything; in int8 (the file's model.weight_dtype, used when
    # --weight-dtype is not given) the EP16 prefill splits (18 experts per die per layer, 64.2 GB + 8 GiB of
    # KV) are dropped and an EP32 one is written.
    out = tmp_path / "search"
    argv = ["plan", str(REPO / "clusters" / "cm384.yaml"), "--trace", TRACE, "--num-requests", "20"]
    argv += ["--rate", "200", "--out", str(out), "--search", "--search-num-requests", "10", "--no-sweep"]
    assert main([*argv, "--weight-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "splits that pass the topology rules fits device memory with bfloat16 weights" in err
    assert "try --weight-dtype int8" in err and "Traceback" not in err
    assert main(argv) == 0
    printed = capsys.readouterr().out
    match = re.search(r"search: (\d+) of (\d+) splits dropped because their int8 weights", printed)
    assert match and 0 < int(match[1]) < int(match[2]), printed
    assert "does not fit device memory" not in printed
    assert "ranked with" not in (out / "plan.yaml").read_text()  # the file's own weight dtype
    written = load_topology(out / "plan.yaml")
    assert written.prefill.expert_parallel_size == 32 and written.model.weight_dtype == "int8"
    assert match[0] in (out / "report.md").read_text()


def test_plan_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    argv = ["plan", str(REPO / "clusters" / "local.yaml"), "--trace", str(tmp_path / "missing.csv")]
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "trace file not found" in err and "Traceback" not in err
    for rate in ("-1", "0", "inf", "nan"):
        assert main(["plan", str(REPO / "clusters" / "local.yaml"), "--trace", TRACE, "--rate", rate]) == 2
        assert f"must be finite and > 0, got {rate}" in capsys.readouterr().err
    assert main(["plan", str(REPO / "clusters" / "local.yaml"), "--trace", TRACE, "--acceptance", "1.5"]) == 2


def test_plan_out_that_is_a_file_is_refused_before_simulating(tmp_path, capsys):
    out = tmp_path / "report.md"
    out.write_text("not a directory\n")
    argv = ["plan", str(REPO / "clusters" / "local.yaml"), "--trace", TRACE, "--num-requests", "5"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out must be a directory: {out} exists and is not one" in err
    assert "Errno" not in err and "Traceback" not in err
    assert out.read_text() == "not a directory\n"


def test_speed_bench_smoke(capsys):
    from bench import planner_speed

    argv = ["--num-requests", "200", "--rate", "100", "--json"]
    assert planner_speed.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["num_requests"] == 200 and result["simulated"]["num_ok"] == 200
    assert result["wall_s"] > 0 and result["num_steps"]["decode"] > 0
    assert result["target_met_cpu"] is False  # 200 requests are not the 100,000 of the target


def test_plan_fail_rank_reports_the_loss_and_refuses_a_bad_one(tmp_path, capsys):
    argv = ["plan", str(REPO / "clusters" / "local-ep.yaml"), "--trace", TRACE, "--num-requests", "40"]
    argv += ["--rate", "4", "--no-sweep", "--out", str(tmp_path), "--json"]
    assert main([*argv, "--fail-rank", "decode0:1@2+1.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    (loss,) = out["rank_losses"]
    assert loss["loss"] == "decode0:1@2+1.5" and loss["num_ranks_after"] == 1
    assert loss["served_again_at_s"] - loss["lost_at_s"] == 1.5
    assert out["num_ok"] == 40
    assert main([*argv, "--fail-rank", "decode0:2@1"]) == 2  # local-ep's decode instance has ranks 0..1
    assert "ranks 0..1" in capsys.readouterr().err
    assert main([*argv, "--fail-rank", "decode0@1"]) == 2
    assert "ROLE INSTANCE:RANK@T" in capsys.readouterr().err
