"""`python -m bench.kv_transfer --json` runs (the clone and gRPC, tiny sizes) and prints the documented
keys. Nothing about speed is asserted: figures live in the benchmark's output."""

from __future__ import annotations

import json

from bench import kv_transfer


def test_bench_kv_transfer_smoke(capsys):
    argv = [
        "--shapes",
        "tiny,deepseek_v3",
        "--transports",
        "clone,grpc",
        "--num-tokens",
        "16",
        "--repeats",
        "1",
    ]
    assert kv_transfer.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"shapes", "repeats", "threads", "torch", "git_commit"} <= result["config"].keys()
    assert result["config"]["shapes"]["deepseek_v3"] == {
        "num_layers": 61, "num_tokens": 16, "kv_dim": 576, "dtype": "bfloat16"
    }  # fmt: skip
    runs = {(r["shape"], r["transport"], r["wire_dtype"]): r for r in result["results"]}
    assert set(runs) == {
        (shape, transport, wire)
        for shape in ("tiny", "deepseek_v3")
        for transport, wire in (("clone", "bfloat16"), ("grpc", "bfloat16"), ("grpc", "int8"))
    }
    v3_int8 = runs[("deepseek_v3", "grpc", "int8")]
    assert v3_int8["kv_bytes"] == 61 * 16 * 576 * 2 and v3_int8["wire_bytes"] == 61 * 16 * 580
    # GB/s is rounded to 3 decimals: a 1 MB transfer on a loaded machine may print 0.0; the times say it ran
    assert len(v3_int8["elapsed_ms"]) == 1 and v3_int8["elapsed_ms"][0] > 0 and "send_return_ms" in v3_int8
    assert {"best", "median"} <= v3_int8["kv_GB_per_s"].keys()
    # tiny transfers are mostly fixed costs: the ratio to a 16-token clone may round to 0.0
    assert isinstance(v3_int8["vs_adjacent_clone_median"], float) and v3_int8["vs_adjacent_clone_median"] >= 0
    assert "vs_adjacent_clone_median" not in runs[("tiny", "clone", "bfloat16")]
    # the sender ran in a process of its own (prefill's, as deployed), and the paged cache it wrote was
    # checked against the layers sent (PagedDestination.check raises otherwise)
    assert v3_int8["sender_in"] == "process" and runs[("tiny", "grpc", "bfloat16")]["sender_in"] == "process"
    # the strict yardstick (decode's own copy into a touched paged cache) for the float wire only
    assert isinstance(runs[("deepseek_v3", "grpc", "bfloat16")]["vs_adjacent_copy_median"], float)
    assert "vs_adjacent_copy_median" not in v3_int8
