"""The topology's `autoscale:` section: defaults, the policy it builds, each bad value at its line."""

from __future__ import annotations

import json

import pytest

from pdcluster.config import load_topology
from pdcluster.config.autoscale import AutoscaleConfig, PoolBounds
from tests.orchestrator.test_topology import ckpt, issues_of, line_of, template, write  # noqa: F401

POOLS = """\
prefill:
  num_instances: 2
decode:
  num_instances: 2
"""


def test_off_by_default_and_the_policy_it_builds(tmp_path, ckpt):  # noqa: F811
    assert load_topology(write(tmp_path, template(ckpt, POOLS))).autoscale == AutoscaleConfig()
    text = template(
        ckpt,
        POOLS
        + """\
autoscale:
  enabled: true
  window_s: 5
  dwell_s: 20
  prefill: {min_instances: 1, max_instances: 3}
""",
    )
    config = load_topology(write(tmp_path, text)).autoscale
    assert config.enabled and config.window_s == 5.0 and config.prefill == PoolBounds(1, 3)
    policy = config.policy(ttft_slo_s=1.0, tpot_slo_s=0.1, num_instances=4)
    assert policy.prefill_bounds == (1, 3) and policy.decode_bounds == (1, 4)
    assert (policy.dwell_s, policy.park, policy.ttft_slo_s) == (20.0, False, 1.0)


@pytest.mark.parametrize(
    ("entry", "needle", "reason"),
    [
        ("  window_s: 0\n", "window_s", "autoscale.window_s: must be > 0, got 0.0"),
        ("  dwell_s: -1\n", "dwell_s", "autoscale.dwell_s: must be >= 0, got -1.0"),
        ("  hysteresis: 2\n", "hysteresis", "autoscale.hysteresis: must be <= 1, got 2.0"),
        ("  enabled: maybe\n", "enabled", "autoscale.enabled: expected a boolean (true/false), got 'maybe'"),
        (
            "  prefill: {min_instances: 0}\n",
            "min_instances",
            "autoscale.prefill.min_instances: must be >= 1, got 0",
        ),
        ("  windw_s: 3\n", "windw_s", "autoscale: unknown key 'windw_s' (did you mean 'window_s'?)"),
        (
            "  prefill: {min_instances: 3, max_instances: 2}\n",
            "min_instances",
            "autoscale.prefill: PoolBounds: max_instances 2 < min_instances 3",
        ),
        (
            "  interval_s: 20\n",
            "interval_s",  # a section's own rule is reported at its first key
            "autoscale: AutoscaleConfig: interval_s 20.0 > window_s 10.0",
        ),
    ],
)
def test_bad_values_at_their_line(tmp_path, ckpt, entry, needle, reason):  # noqa: F811
    text = template(ckpt, POOLS + "autoscale:\n" + entry)
    issues = issues_of(write(tmp_path, text))
    assert [(i.line, i.reason) for i in issues] == [(line_of(text, needle), reason)]


@pytest.mark.parametrize(
    ("pools", "entry", "needle", "reason"),
    [
        (
            "prefill:\n  num_instances: 2\ndecode:\n  num_instances: 1\n  devices_per_instance: 2\n",
            "  enabled: true\n",
            "enabled",
            "autoscale.enabled: moves single-device instances only, but decode.devices_per_instance is 2",
        ),
        (
            POOLS,
            "  enabled: true\n  prefill:\n    min_instances: 3\n",
            "min_instances",
            "autoscale.prefill.min_instances: 3 > prefill.num_instances 2 (the file's split must be within "
            "the bounds)",
        ),
        (
            POOLS,
            "  enabled: true\n  decode:\n    max_instances: 1\n",
            "max_instances",
            "autoscale.decode.max_instances: 1 < decode.num_instances 2 (the file's split must be within "
            "the bounds)",
        ),
    ],
)
def test_cross_section_rules_when_enabled(tmp_path, ckpt, pools, entry, needle, reason):  # noqa: F811
    text = template(ckpt, pools + "autoscale:\n" + entry)
    issues = issues_of(write(tmp_path, text))
    assert [(i.line, i.reason) for i in issues] == [(line_of(text, needle), reason)]
    # the same section switched off is accepted: the rules apply to an enabled controller only
    load_topology(write(tmp_path, text.replace("enabled: true", "enabled: false")))


def test_minimums_must_fit_the_devices():
    from pdcluster.config.autoscale import autoscale_issues
    from pdcluster.config.schema import DecodePoolConfig, PrefillPoolConfig

    sections = {
        "autoscale": AutoscaleConfig(enabled=True, prefill=PoolBounds(2), decode=PoolBounds(2)),
        "prefill": PrefillPoolConfig(num_instances=2),
        "decode": DecodePoolConfig(num_instances=1),
    }
    reasons = [i.reason for i in autoscale_issues(sections)]
    assert reasons == [
        "autoscale.decode.min_instances: 2 > decode.num_instances 1 (the file's split must be within the "
        "bounds)",
        "autoscale: prefill.min_instances 2 + decode.min_instances 2 > the 3 instances of the file",
    ]
    with pytest.raises(ValueError, match="park_below_utilization 0.9 must be < target_utilization 0.8"):
        AutoscaleConfig(park_below_utilization=0.9)


def test_deploy_refuses_autoscale_enabled_only_where_instances_cannot_move(tmp_path, ckpt):  # noqa: F811
    """Single-device instances on an addressed KV transport, one engine shape: deploy takes the key (the
    instances are `RoleWorker`s). A torch.distributed transport (its group fixed at deploy) or pools whose
    engines differ are refused at the key, naming why, not served as a static split."""
    from pdcluster.config.preflight import autoscale_live_issues

    enabled = POOLS + "autoscale:\n  enabled: true\n"
    assert autoscale_live_issues(load_topology(write(tmp_path, template(ckpt, enabled)))) == []
    dist = write(tmp_path, template(ckpt, enabled + "kv_transfer:\n  transport: torch_distributed\n"))
    (issue,) = autoscale_live_issues(load_topology(dist))
    assert issue.path == ("autoscale", "enabled") and "process group is fixed" in issue.reason
    shapes = enabled.replace("decode:\n", "decode:\n  block_size: 32\n")
    (issue,) = autoscale_live_issues(load_topology(write(tmp_path, template(ckpt, shapes))))
    assert "engines differ in block_size" in issue.reason and "--autoscale" in issue.reason
    off = write(tmp_path, template(ckpt, POOLS))
    assert autoscale_live_issues(load_topology(off)) == []


def test_calibration_is_read_relative_to_the_file_and_prices_the_controller(tmp_path, ckpt):  # noqa: F811
    """`autoscale.calibration`: a path relative to the YAML, refused at its line when it is no calibration;
    the live controller's capacity is priced with its factors (another step time than the catalog's)."""
    from pdcluster.driver.autoscale_live import perf_model_capacity
    from pdcluster.planner.calibration import FORMAT

    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    text = template(ckpt, POOLS + "autoscale:\n  enabled: true\n  calibration: bad.json\n")
    issues = issues_of(write(tmp_path, text))
    assert [i.line for i in issues] == [line_of(text, "calibration: bad")]
    assert (
        issues[0].reason.startswith("autoscale.calibration: ")
        and "not a calibration file" in issues[0].reason
    )
    factors = {"gemm_compute": 0.01, "gemm_memory": 0.01, "attention_compute": 0.01, "memory": 0.01}
    (tmp_path / "slow.json").write_text(
        json.dumps({"format": FORMAT, "accelerator": "cpu", "factors": factors})
    )
    topology = load_topology(write(tmp_path, text.replace("bad.json", "slow.json")))
    assert topology.autoscale.calibration == str((tmp_path / "slow.json").resolve())
    calibrated = perf_model_capacity(topology)(256, 128)
    catalog = perf_model_capacity(load_topology(write(tmp_path, template(ckpt, POOLS))))(256, 128)
    assert calibrated.prefill_tokens_per_s < catalog.prefill_tokens_per_s
