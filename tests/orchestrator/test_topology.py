"""Topology files: every shipped one validates; each kind of mistake is reported at its exact line with a
message naming the key; all problems of a file come out together; `pdcluster validate` exit codes.

Broken files are written to tmp_path from a small valid template whose model is a tiny architecture
(`tests.conftest.tiny_config`: 4 heads, 8 routed experts, one MTP module; moe_intermediate_size 48, so
1, 2, 3, 4 or 6 devices can split an expert) written as config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import textwrap
import threading
from pathlib import Path

import pytest

from pdcluster.config import (
    DEFAULT_TOPOLOGY_PATH,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    DecodePoolConfig,
    HardwareConfig,
    KVTLSConfig,
    KVTransferConfig,
    ModelConfig,
    PoolConfig,
    PrefillPoolConfig,
    Topology,
    TopologyError,
    TopologyIssue,
    check_topology,
    load_topology,
    resolve_kv_transport,
)
from pdcluster.config.hardware import ACCELERATORS, GIB, get_accelerator
from pdcluster.engine.config import EngineConfig
from pdcluster.entrypoints.cli import main
from pdcluster.models import bundled_checkpoint_dir
from tests.conftest import tiny_config

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"
SHIPPED = sorted(CLUSTERS.glob("*.yaml"))
HAVE_BUNDLED = (bundled_checkpoint_dir() / "config.json").is_file()


# ---- factories ---------------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A directory holding only the tiny architecture's config.json (validation reads nothing else)."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_config(moe_intermediate_size=48).to_dict()))
    return path


def template(ckpt: Path, extra: str = "", devices_per_node: int = 4) -> str:
    """A valid topology (1 node of `devices_per_node` cpu devices, 1 prefill + 1 decode), plus `extra`."""
    return textwrap.dedent(
        f"""\
        name: test
        hardware:
          accelerator: cpu
          num_nodes: 1
          devices_per_node: {devices_per_node}
        model:
          path: {ckpt}
        """
    ) + textwrap.dedent(extra)


def write(tmp_path: Path, text: str, name: str = "topo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def issues_of(path: Path) -> list[TopologyIssue]:
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    return info.value.issues


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line of `text` containing `needle`."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def only_issue(path: Path) -> TopologyIssue:
    issues = issues_of(path)
    assert len(issues) == 1, issues
    return issues[0]


# ---- shipped files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_topology_validates(path: Path):
    if "path: null" in path.read_text() or "model:" not in path.read_text():
        if not HAVE_BUNDLED:
            pytest.skip("the bundled checkpoint (python -m pdcluster.models.train_tiny) is not written yet")
    topology = load_topology(path)
    assert topology.name == path.stem
    for role in ("prefill", "decode"):
        topology.engine_config(role)  # the engine accepts what the pools pass down


def test_the_shipped_set_and_the_default():
    assert {p.name for p in SHIPPED} >= {"local.yaml", "local-1p2d.yaml", "cm384.yaml", "gpu-2node.yaml"}
    assert DEFAULT_TOPOLOGY_PATH == CLUSTERS / "local.yaml"


@pytest.mark.skipif(not HAVE_BUNDLED, reason="the bundled checkpoint is not written yet")
def test_local_yaml_is_one_prefill_one_decode_on_cpu_with_mtp():
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    assert topology.hardware.spec.torch_device_type == "cpu"
    assert (topology.prefill.num_instances, topology.decode.num_instances) == (1, 1)
    assert topology.kv_transfer.transport == "auto" and topology.kv_transport == "shm"  # one node
    assert topology.decode.num_speculative_tokens == 1
    engine = topology.engine_config("prefill")
    assert engine.model == str(bundled_checkpoint_dir()) and engine.device == "cpu"
    assert engine.dtype == "float32" and engine.num_speculative_tokens == 1  # prefill drafts the first k


def test_cm384_is_big_ep_decode_on_910c_dies():
    topology = load_topology(CLUSTERS / "cm384.yaml")
    hw = topology.hardware
    assert (hw.accelerator, hw.num_nodes, hw.devices_per_node) == ("ascend-910c", 48, 16)
    assert topology.decode.expert_parallel_size == topology.decode.devices_per_instance == 288
    assert topology.prefill.devices_per_instance == 32
    assert topology.model.config_path == str(CLUSTERS / "models" / "deepseek-v3.config.json")
    assert topology.summary() == (
        "48 nodes × 8 ascend-910c (16 dies each), prefill 14×32 devices, decode 1×288 devices, "
        "KV torch_distributed"
    )
    engine = topology.engine_config("decode")
    assert (engine.device, engine.dtype, engine.kv_cache_dtype) == ("npu", "bfloat16", "int8")


def test_every_engine_argument_is_derived_from_the_topology_or_deliberately_defaulted():
    import dataclasses

    from pdcluster.config.engine_args import (
        ENGINE_DEFAULTED,
        ENGINE_FIELDS,
        POOL_DEPLOYMENT_FIELDS,
        engine_arguments,
    )

    assert ENGINE_FIELDS == {f.name for f in dataclasses.fields(EngineConfig)}
    topology = Topology(name="t")
    for role, pool_cls in (("prefill", PrefillPoolConfig), ("decode", DecodePoolConfig)):
        derived = set(engine_arguments(topology, role))
        assert derived.isdisjoint(ENGINE_DEFAULTED[role]), role
        assert derived | ENGINE_DEFAULTED[role] == ENGINE_FIELDS, role  # a new EngineConfig field is decided
        pool_fields = {f.name for f in dataclasses.fields(pool_cls)}
        assert pool_fields - POOL_DEPLOYMENT_FIELDS <= derived, role  # a new pool field reaches the engine
        assert POOL_DEPLOYMENT_FIELDS <= pool_fields and POOL_DEPLOYMENT_FIELDS.isdisjoint(ENGINE_FIELDS)


def test_engine_config_of_each_pool():
    prefill = {
        "block_size": 32,
        "kv_cache_dtype": "int8",
        "kv_cache_memory_bytes": 1000,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
    }
    decode = {
        "block_size": 64,
        "kv_cache_memory_bytes": 2000,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "max_model_len": 4096,
        "num_speculative_tokens": 3,
        "adaptive_speculation": True,
    }
    topology = Topology(
        name="t",
        hardware=HardwareConfig(accelerator="h200"),
        model=ModelConfig(path="/models/m", dtype="float16"),
        prefill=PrefillPoolConfig(**prefill),
        decode=DecodePoolConfig(**decode),
    )
    common = {"model": "/models/m", "device": "cuda", "dtype": "float16"}
    # prefill drafts decode's first k tokens; each pool's own switches stay off the other's engine;
    # `compile` at each pool's default: off on prefill; decode's null is off on h200 (on cpu only, where
    # it was measured); the engine's own default is off
    assert topology.engine_config("prefill") == EngineConfig(
        **common, **prefill, num_speculative_tokens=3, adaptive_speculation=False, compile=False
    )
    assert topology.engine_config("decode") == EngineConfig(
        **common, **decode, enable_chunked_prefill=True, compile=False
    )
    assert not EngineConfig(model="/models/m").compile
    forced = dataclasses.replace(topology, decode=dataclasses.replace(topology.decode, compile=True))
    assert forced.engine_config("decode").compile
    assert topology.engine_config("decode").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="role must be one of"):
        topology.engine_config("router")


def test_compile_defaults_to_on_for_decode_and_off_for_prefill_in_yaml(tmp_path, ckpt):
    defaults = load_topology(write(tmp_path, template(ckpt), "defaults.yaml"))
    assert defaults.hardware.accelerator == "cpu"  # decode's null: on where it was measured to win
    assert (defaults.prefill.compile, defaults.decode.compile) == (False, None)
    assert (defaults.engine_config("prefill").compile, defaults.engine_config("decode").compile) == (
        False,
        True,
    )
    flipped = load_topology(
        write(
            tmp_path, template(ckpt, "prefill:\n  compile: true\ndecode:\n  compile: false\n"), "flipped.yaml"
        )
    )
    assert (flipped.engine_config("prefill").compile, flipped.engine_config("decode").compile) == (
        True,
        False,
    )


def test_catalog_entries_and_910c_figures():
    assert set(ACCELERATORS) == {"cpu", "ascend-910b", "ascend-910c", "h100", "h800", "h200", "a100"}
    for spec in ACCELERATORS.values():
        backend = {"cpu": "gloo", "npu": "hccl", "cuda": "nccl"}[spec.torch_device_type]
        resource = {"cpu": None, "npu": "NPU", "cuda": "GPU"}[spec.torch_device_type]
        assert (spec.collective_backend, spec.ray_resource) == (backend, resource)
        assert spec.int8_ops_per_s >= spec.bf16_flops_per_s > 0
    die = get_accelerator("ascend-910c")  # per die, as public material states (DESIGN.md)
    assert (die.dies_per_chip, die.bf16_flops_per_s, die.int8_ops_per_s) == (2, 376e12, 752e12)
    assert (die.hbm_bytes, die.hbm_bytes_per_s) == (64 * GIB, 1.6e12)
    with pytest.raises(KeyError, match="known: cpu"):
        get_accelerator("tpu-v5")


# ---- each mistake at its line ------------------------------------------------------------------------
def test_unknown_key_names_it_and_suggests_the_closest(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  num_instances: 1\n  tensor_paralel_size: 1\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "tensor_paralel_size")
    assert issue.reason == "prefill: unknown key 'tensor_paralel_size' (did you mean 'tensor_parallel_size'?)"


def test_unknown_top_level_key_suggests_and_far_ones_list_the_valid_keys(tmp_path, ckpt):
    text = template(ckpt, "decod:\n  num_instances: 1\nzzz: 1\n")
    first, second = issues_of(write(tmp_path, text))
    assert (first.line, second.line) == (line_of(text, "decod:"), line_of(text, "zzz"))
    assert "unknown key 'decod' (did you mean 'decode'?)" in first.reason
    assert "unknown key 'zzz' (valid keys: name, hardware," in second.reason


def test_wrong_type(tmp_path, ckpt):
    text = template(ckpt, "decode:\n  num_instances: 1\n  max_num_seqs: many\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "max_num_seqs")
    assert issue.reason == "decode.max_num_seqs: expected an integer, got 'many'"


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("num_instances: true", "prefill.num_instances: expected an integer, got True"),
        ("num_instances: 1.5", "prefill.num_instances: expected an integer, got 1.5"),
        ("num_instances: 0", "prefill.num_instances: must be >= 1, got 0"),
        ("devices_per_instance: 2.0", None),  # an integral float is an integer
        ("enable_prefix_caching: 1", "prefill.enable_prefix_caching: expected a boolean (true/false), got 1"),
        ("max_num_seqs: [1, 2]", "prefill.max_num_seqs: expected an integer, got a list"),
        ("num_instances: null", "prefill.num_instances: must not be null"),
    ],
)
def test_wrong_types_and_ranges(tmp_path, ckpt, entry, reason):
    text = template(ckpt, f"prefill:\n  {entry}\n")
    if reason is None:
        load_topology(write(tmp_path, text))
        return
    issue = only_issue(write(tmp_path, text))
    assert (issue.line, issue.reason) == (line_of(text, entry.split(":")[0]), reason)


@pytest.mark.parametrize(
    ("section", "entry", "reason"),
    [
        ("hardware", "devices_per_node: 1e29", "hardware.devices_per_node: must be <= 1024, got 1e+29"),
        ("hardware", "num_nodes: 100000", "hardware.num_nodes: must be <= 65536, got 100000"),
        ("prefill", "max_num_seqs: 1e12", "prefill.max_num_seqs: must be <= 1048576, got 1000000000000"),
        ("decode", "num_speculative_tokens: 1000", "decode.num_speculative_tokens: must be <= 64, got 1000"),
        ("kv_transfer", "timeout_s: 1e300", "kv_transfer.timeout_s: must be <= 86400.0, got 1e+300"),
    ],
)
def test_numbers_beyond_their_bound_are_errors_at_their_line(tmp_path, ckpt, section, entry, reason):
    key = entry.split(":")[0]
    if section == "hardware":  # the template writes each hardware key: replace its line
        text = "".join(
            f"  {entry}\n" if ln.startswith(f"  {key}:") else ln for ln in template(ckpt).splitlines(True)
        )
    else:
        text = template(ckpt, f"{section}:\n  {entry}\n")
    issue = only_issue(write(tmp_path, text))
    assert (issue.line, issue.reason) == (line_of(text, f"  {key}:"), reason)


def test_every_integer_field_has_both_bounds():
    import dataclasses
    import typing

    from pdcluster import config as t
    from pdcluster.config.fields import unwrap_optional

    classes = [t.HardwareConfig, t.PrefillPoolConfig, t.DecodePoolConfig, t.KVTransferConfig, t.ApiConfig]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if unwrap_optional(hints[f.name])[0] is int:
                assert "max" in f.metadata and ("min" in f.metadata or "gt" in f.metadata), (cls, f.name)


def test_router_policy_choices_are_the_router_modules_policies():
    from pdcluster.config import RouterConfig
    from pdcluster.driver.router import POLICIES

    for name in POLICIES:
        assert RouterConfig(policy=name).policy == name
    with pytest.raises(ValueError) as err:
        RouterConfig(policy="fastest")
    assert str(err.value) == f"RouterConfig field 'policy': 'fastest' is not one of: {', '.join(POLICIES)}"


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("256.1.1.1", "'256.1.1.1' is not a valid IPv4 address (each of its 4 numbers is 0-255)"),
        ("10.0.0", "'10.0.0' is not a valid IPv4 address (each of its 4 numbers is 0-255)"),
        ("'::1'", "'::1': IPv6 addresses are not supported (the HTTP server binds an IPv4 socket)"),
        ("''", "must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface)"),
        ("my_host", "'my_host' is neither an IPv4 address nor a host name"),
        ("-node.example", "'-node.example' is neither an IPv4 address nor a host name"),
        ("0.0.0.0", None),
        ("localhost", None),
        ("node-1.cluster.local", None),
    ],
)
def test_api_host_must_be_an_ipv4_address_or_a_host_name(tmp_path, ckpt, host, reason):
    text = template(ckpt, f"api:\n  host: {host}\n")
    if reason is None:
        assert load_topology(write(tmp_path, text)).api.host == host
        return
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "  host:") and issue.reason.startswith(f"api.host: {reason}")


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("''", "api.api_key: must not be empty (null: no authentication)"),
        ("'two words'", "api.api_key: must be printable ASCII without spaces"),
        ("sk-local-123", None),
        ("null", None),
    ],
)
def test_api_key_must_not_be_empty(tmp_path, ckpt, key, reason):
    text = template(ckpt, f"api:\n  api_key: {key}\n")
    if reason is None:
        load_topology(write(tmp_path, text))
        return
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "  api_key:") and issue.reason.startswith(reason)


def test_bad_enum(tmp_path, ckpt):
    text = template(ckpt, "kv_transfer:\n  transport: http\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "transport")
    assert issue.reason == "kv_transfer.transport: 'http' is not one of: auto, grpc, shm, torch_distributed"


def test_unknown_accelerator_lists_the_catalog(tmp_path, ckpt):
    text = template(ckpt).replace("accelerator: cpu", "accelerator: tpu")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "accelerator")
    assert "hardware.accelerator: 'tpu' is not one of: cpu, ascend-910b, ascend-910c, h100" in issue.reason


def test_too_many_devices(tmp_path, ckpt):
    text = template(
        ckpt,
        "prefill:\n  num_instances: 2\n  devices_per_instance: 2\ndecode:\n  num_instances: 1\n",
    )
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "decode:") + 1  # decode.num_instances: where demand passes 4
    assert issue.reason == (
        "decode.num_instances: the pools need 2×2 (prefill) + 1×1 (decode) = 5 devices, "
        "but the hardware has 1 node(s) × 4 = 4"
    )


def test_ep_not_dividing_the_routed_experts(tmp_path, ckpt):
    text = template(
        ckpt,
        "decode:\n  devices_per_instance: 3\n  expert_parallel_size: 3\n",
    )
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "expert_parallel_size")
    assert issue.reason.startswith(
        "decode.expert_parallel_size: 3 does not divide the model's 8 routed experts + 0 redundant "
        f"(n_routed_experts in {ckpt / 'config.json'}"
    )


def test_redundant_experts_count_towards_ep(tmp_path, ckpt):
    text = template(
        ckpt,
        "decode:\n  devices_per_instance: 4\n  expert_parallel_size: 4\n  num_redundant_experts: 4\n",
        devices_per_node=5,
    )
    assert load_topology(write(tmp_path, text)).decode.num_redundant_experts == 4  # 12 / 4
    bad = text.replace("num_redundant_experts: 4", "num_redundant_experts: 2")
    assert (
        "does not divide the model's 8 routed experts + 2 redundant"
        in only_issue(write(tmp_path, bad)).reason
    )


def test_instance_larger_than_a_node(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  devices_per_instance: 8\n  expert_parallel_size: 8\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "devices_per_instance")
    assert issue.reason == (
        "prefill.devices_per_instance: 8 devices do not fit in one node (hardware.devices_per_node is 4); "
        "set span_nodes: true to run an instance over whole nodes"
    )


def test_span_nodes_takes_whole_nodes(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  devices_per_instance: 6\n  span_nodes: true\n")
    text = text.replace("num_nodes: 1", "num_nodes: 3")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "devices_per_instance")
    assert "6 is not a whole number of nodes of 4 devices" in issue.reason
    good = text.replace("devices_per_instance: 6", "devices_per_instance: 8")
    assert load_topology(write(tmp_path, good)).prefill.devices_per_instance == 8


def test_tp_must_divide_the_heads_and_the_instance(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  devices_per_instance: 3\n  tensor_parallel_size: 3\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "tensor_parallel_size")
    assert issue.reason.startswith(
        "prefill.tensor_parallel_size: 3 does not divide the model's 4 attention heads"
    )
    text = template(ckpt, "prefill:\n  devices_per_instance: 2\n  tensor_parallel_size: 4\n")
    assert "4 does not divide devices_per_instance 2" in only_issue(write(tmp_path, text)).reason


def test_each_expert_split_must_divide_its_ffn(tmp_path, ckpt):
    (ckpt / "config.json").write_text(json.dumps(tiny_config(moe_intermediate_size=16).to_dict()))
    text = template(ckpt, "prefill:\n  devices_per_instance: 3\n")  # expert_parallel_size 1: split 3 ways
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "prefill:")  # expert_parallel_size is not written: its section
    assert "each expert would be split over 3 devices, which does not divide moe_intermediate_size 16" in (
        issue.reason
    )


def test_speculative_decoding_needs_an_mtp_module(tmp_path, ckpt):
    (ckpt / "config.json").write_text(json.dumps(tiny_config(num_nextn_predict_layers=0).to_dict()))
    text = template(ckpt, "decode:\n  num_speculative_tokens: 2\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "num_speculative_tokens")
    assert "needs an MTP module, but the model has none (num_nextn_predict_layers is 0" in issue.reason


def test_fragmented_devices_are_caught_even_when_the_total_fits(tmp_path, ckpt):
    # 2 nodes x 4: two prefill instances of 3 leave 1 free device per node, not the 2 decode needs.
    text = template(
        ckpt,
        "prefill:\n  num_instances: 2\n  devices_per_instance: 3\ndecode:\n  devices_per_instance: 2\n",
    ).replace("num_nodes: 1", "num_nodes: 2")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "devices_per_instance: 2")
    assert "decode instance 0 needs 2 devices on one node" in issue.reason


def test_supernode_grouping_and_link_go_together(tmp_path, ckpt):
    text = template(ckpt).replace("num_nodes: 1", "num_nodes: 4\n  nodes_per_supernode: 3")
    issues = issues_of(write(tmp_path, text))
    assert [i.line for i in issues] == [line_of(text, "nodes_per_supernode")] * 2
    assert "does not divide num_nodes 4" in issues[0].reason
    assert "supernodes need an interconnect.supernode link" in issues[1].reason


def test_kv_cache_must_leave_room_on_the_device(tmp_path, ckpt):
    text = template(ckpt, "decode:\n  kv_cache_memory_bytes: 64e9\n")  # cpu "device" budget: 8 GiB
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "kv_cache_memory_bytes")
    assert "leave nothing of the 8589934592 bytes of one cpu device" in issue.reason


def test_weights_and_kv_cache_must_fit_one_device(tmp_path):
    """cm384 (DeepSeek-V3 on 64 GiB 910C dies) in bf16 fits neither pool; in int8, its weight_dtype, both.
    Per die: the parts every die holds + 59 MoE layers (58 + MTP) x (256 + 32 redundant) / EP routed
    experts; `tests/planner/test_search.py` derives both counts from config.json's numbers."""
    from tests.planner.test_search import V3_EXPERT, V3_REPLICATED

    text = (CLUSTERS / "cm384.yaml").read_text()
    text = text.replace("config_path: models/", f"config_path: {CLUSTERS}/models/")
    assert "  weight_dtype: int8 " in text
    prefill_params = V3_REPLICATED + 59 * (288 // 32) * V3_EXPERT  # EP32: 9 experts per die per layer
    decode_params = V3_REPLICATED + 59 * (288 // 288) * V3_EXPERT  # EP288: 1
    assert (prefill_params, decode_params) == (40_838_754_304, 20_051_783_680)
    hbm, prefill_kv, decode_kv = 64 * GIB, 8 * GIB, 32 * GIB  # the die; the file's kv_cache_memory_bytes
    assert 2 * prefill_params + prefill_kv > hbm and 2 * decode_params + decode_kv > hbm
    assert prefill_params + prefill_kv <= hbm and decode_params + decode_kv <= hbm

    bf16 = text.replace("  weight_dtype: int8 ", "  weight_dtype: bfloat16 ")
    issues = issues_of(write(tmp_path, bf16, "bf16.yaml"))
    fixes = (
        "use more expert parallelism (larger devices_per_instance and expert_parallel_size), a smaller "
        "kv_cache_memory_bytes, or 8-bit weights (model.weight_dtype: int8 or fp8)"
    )
    assert [(i.line, i.reason) for i in issues] == [
        (
            bf16.splitlines().index("prefill:") + 1,  # the pool's line
            "prefill: weights + KV cache do not fit one device (EP32, 9 routed experts per device per MoE "
            "layer): 81.7 GB of bfloat16 weights + 8.6 GB of KV cache per device > 68.7 GB of one "
            f"ascend-910c device; {fixes}",
        ),
        (
            bf16.splitlines().index("decode:") + 1,
            "decode: weights + KV cache do not fit one device (EP288, 1 routed expert per device per MoE "
            "layer): 40.1 GB of bfloat16 weights + 34.4 GB of KV cache per device > 68.7 GB of one "
            f"ascend-910c device; {fixes}",
        ),
    ]
    assert f"{2 * prefill_params / 1e9:.1f} GB" in issues[0].reason  # 81.7, by hand
    assert f"{2 * decode_params / 1e9:.1f} GB" in issues[1].reason  # 40.1
    assert load_topology(write(tmp_path, text, "int8.yaml")).model.weight_dtype == "int8"


def test_prefix_aware_routing_needs_prefix_caching(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  enable_prefix_caching: false\nrouter:\n  policy: prefix_aware\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "policy")


def test_every_problem_is_reported_at_once_in_line_order(tmp_path, ckpt):
    text = template(
        ckpt,
        """\
        prefill:
          tensor_paralel_size: 1
        decode:
          devices_per_instance: 3
          expert_parallel_size: 3
        kv_transfer:
          transport: http
          timeout_s: soon
        api:
          port: 70000
        """,
    )
    path = write(tmp_path, text)
    issues = issues_of(path)
    expected_lines = [
        line_of(text, k) for k in ("tensor_paralel", "expert_parallel", "http", "soon", "70000")
    ]
    assert [i.line for i in issues] == expected_lines
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    lines = str(info.value).splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"{path}:{n}" for n in expected_lines]
    assert "api.port: must be <= 65535, got 70000" in lines[-1]


# ---- YAML-level problems and conveniences ------------------------------------------------------------
def test_yaml_syntax_error_has_its_line(tmp_path, ckpt):
    text = template(ckpt, "decode:\n  num_instances: [1\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line >= line_of(text, "num_instances") and issue.reason.startswith("invalid YAML")


def test_empty_file_missing_name_and_non_mapping(tmp_path, ckpt):
    assert only_issue(write(tmp_path, "")).reason.startswith("empty file")
    assert only_issue(write(tmp_path, "- a\n")).reason == "top level: expected a mapping of keys, got a list"
    text = template(ckpt).replace("name: test\n", "")
    assert only_issue(write(tmp_path, text)).reason == "top level: missing required key 'name'"
    issue = only_issue(write(tmp_path, template(ckpt).replace("name: test", "name: ''")))
    assert issue.line == 1 and "name" in issue.reason


def test_duplicate_keys_and_null_sections(tmp_path, ckpt):
    text = template(ckpt, "decode:\n  num_instances: 1\n  num_instances: 1\nprefill:\n")
    first, second = issues_of(write(tmp_path, text))
    assert first.reason == "decode.num_instances: duplicate key"
    assert second.reason.startswith("prefill: expected a mapping of keys, got null")


def test_scientific_notation_without_a_dot_is_a_number(tmp_path, ckpt):
    # YAML 1.1 reads 25e9 and 1.6e12 as strings; number fields take them as numbers.
    text = template(
        ckpt,
        "interconnect:\n  inter_node:\n    bandwidth_bytes_per_s: 25e9\n    latency_s: 1e-5\n"
        "decode:\n  kv_cache_memory_bytes: 1.0e+8\n",
    )
    topology = load_topology(write(tmp_path, text))
    assert topology.interconnect.inter_node.bandwidth_bytes_per_s == 25e9
    assert topology.interconnect.inter_node.latency_s == 1e-5
    assert topology.decode.kv_cache_memory_bytes == 100_000_000


def test_link_needs_both_figures(tmp_path, ckpt):
    text = template(ckpt, "interconnect:\n  intra_node:\n    latency_s: 1e-6\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "latency_s")  # the mapping's first line
    assert issue.reason == "interconnect.intra_node: missing required key 'bandwidth_bytes_per_s'"


def test_missing_model_config_points_at_model_path(tmp_path, ckpt):
    (ckpt / "config.json").unlink()
    text = template(ckpt)
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "path:")
    assert "no config.json at" in issue.reason and "set model.config_path" in issue.reason


def test_relative_model_paths_are_relative_to_the_yaml_file(tmp_path, ckpt):
    sub = tmp_path / "clusters"
    sub.mkdir()
    text = template(ckpt).replace(
        f"path: {ckpt}", "path: /nowhere/DeepSeek\n  config_path: ../ckpt/config.json"
    )
    topology = load_topology(write(sub, text))
    assert topology.model.path == "/nowhere/DeepSeek"
    assert topology.model.config_path == str(ckpt / "config.json")


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    """A test CA, a node certificate and key in tmp_path/certs (openssl CLI; skipped without it)."""
    from tests.kvtransfer.conftest import write_test_certificates

    directory = tmp_path / "certs"
    directory.mkdir()
    files = write_test_certificates(directory)
    if files is None:
        pytest.skip("the openssl CLI is not installed")
    return files


TLS_BLOCK = """\
kv_transfer:
  transport: {transport}
  tls:
    cert_file: {cert_file}
    key_file: {key_file}
    ca_file: {ca_file}
    server_name: pdcluster-kv
"""


def test_kv_tls_files_relative_to_the_yaml_file_validate(tmp_path, ckpt, certs):
    text = template(
        ckpt, TLS_BLOCK.format(transport="grpc", **{k: f"certs/{Path(v).name}" for k, v in certs.items()})
    )
    tls = load_topology(write(tmp_path, text)).kv_transfer.tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == (
        certs["cert_file"],
        certs["key_file"],
        certs["ca_file"],
    )
    assert tls.server_name == "pdcluster-kv"
    assert load_topology(write(tmp_path, template(ckpt))).kv_transfer.tls is None  # the default: no TLS


@pytest.mark.parametrize(
    ("change", "key", "reason"),
    [
        (dict(transport="torch_distributed"), "tls:", "kv_transfer.tls: TLS is for the grpc transport"),
        (
            dict(cert_file="/nowhere/node.pem"),
            "cert_file:",
            "kv_transfer.tls.cert_file: /nowhere/node.pem does not exist",
        ),
        (dict(ca_file="{ckpt}/config.json"), "ca_file:", "config.json is not a PEM file with a CERTIFICATE"),
        (
            dict(key_file="{certs}/ca.key"),
            "key_file:",
            "do not load as a certificate and its unencrypted private key",
        ),
        (dict(ca_file="{certs}"), "ca_file:", "certs is not a file"),
    ],
)
def test_kv_tls_mistakes_are_reported_at_their_key(tmp_path, ckpt, certs, change, key, reason):
    fields = {"transport": "grpc", **certs}
    fields.update({k: v.format(ckpt=ckpt, certs=Path(certs["ca_file"]).parent) for k, v in change.items()})
    text = template(ckpt, TLS_BLOCK.format(**fields))
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, key) and reason in issue.reason, issue


@pytest.mark.parametrize(
    ("transport", "num_nodes", "with_tls", "resolved"),
    [
        ("auto", 1, False, "shm"),
        ("auto", 2, False, "shm+grpc"),  # per pair of ranks: shm on one node, gRPC across
        ("auto", 1, True, "grpc"),  # TLS asks for the grpc channel
        ("auto", 2, True, "grpc"),
        ("grpc", 2, False, "grpc"),
        ("shm", 1, False, "shm"),
        ("grpc", 1, False, "grpc"),
        ("torch_distributed", 1, False, "torch_distributed"),
    ],
)
def test_kv_transport_auto_is_shm_on_one_node_and_per_pair_on_several(
    transport, num_nodes, with_tls, resolved
):
    tls = KVTLSConfig(cert_file="c.pem", key_file="k.pem", ca_file="ca.pem") if with_tls else None
    kv = KVTransferConfig(transport=transport, tls=tls)
    assert resolve_kv_transport(kv, num_nodes) == resolved


def test_forced_shm_across_nodes_and_tls_with_shm_are_reported_at_their_key(tmp_path, ckpt, certs):
    text = template(ckpt, "kv_transfer:\n  transport: shm\n").replace("num_nodes: 1", "num_nodes: 2")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "transport:")
    assert issue.reason == (
        "kv_transfer.transport: shm moves KV through one host's shared memory, but hardware.num_nodes "
        "is 2 (use auto or grpc)"
    )
    text = template(ckpt, TLS_BLOCK.format(transport="shm", **certs))
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "tls:") and "shm never leaves the host" in issue.reason


def test_kv_tls_needs_all_three_files(tmp_path, ckpt, certs):
    text = template(ckpt, f"kv_transfer:\n  tls:\n    cert_file: {certs['cert_file']}\n")
    issues = issues_of(write(tmp_path, text))
    assert [i.line for i in issues] == [line_of(text, "cert_file:")] * 2  # the tls block's first line
    assert [i.reason for i in issues] == [
        "kv_transfer.tls: missing required key 'key_file'",
        "kv_transfer.tls: missing required key 'ca_file'",
    ]


# ---- files that are not a topology at all (issue 12, finding 8): one issue, never a traceback or a hang
def read_in_thread(path: Path, timeout_s: float = 10.0) -> BaseException | None:
    """`load_topology(path)` on a daemon thread: the exception it raised, None if it returned; fails the
    test if it has not finished after `timeout_s` (a FIFO opened for reading blocks until a writer comes)."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            load_topology(path)
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() and stat.S_ISFIFO(os.stat(path).st_mode):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer that closes at once: EOF, unblocked
    assert not thread.is_alive() and result, f"load_topology({path}) did not return within {timeout_s} s"
    return result[0]


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "topo.yaml"
    os.mkfifo(fifo)
    error = read_in_thread(fifo)
    assert isinstance(error, TopologyError) and str(error) == f"{fifo}: not a regular file"


@pytest.mark.parametrize("path", ["/dev/null", "DIR"], ids=["device", "directory"])
def test_devices_and_directories_are_not_regular_files(tmp_path, path):
    path = tmp_path if path == "DIR" else Path(path)
    assert str(only_issue(path)) == f"{path}: not a regular file"


def test_non_utf8_names_the_line_the_byte_and_its_offset(tmp_path, ckpt):
    text = template(ckpt).encode()
    path = tmp_path / "topo.yaml"
    path.write_bytes(text + b"router:\n  policy: caf\xe9\n")
    issue = only_issue(path)
    offset = len(text) + len(b"router:\n  policy: caf")
    assert (issue.line, issue.reason) == (
        text.count(b"\n") + 2,
        f"not valid UTF-8 (byte 0xe9 at offset {offset})",
    )


def test_a_control_character_is_an_invalid_yaml_issue_at_its_line(tmp_path, ckpt):
    issue = only_issue(write(tmp_path, template(ckpt) + "router:\n  policy: a\x00b\n"))
    assert issue.line == len(template(ckpt).splitlines()) + 2
    assert issue.reason.startswith("invalid YAML: character #x0000 at offset")


def test_50000_deep_nesting_is_one_issue_not_a_recursion_error(tmp_path, ckpt):
    text = template(ckpt) + "router: " + "[" * 50_000 + "]" * 50_000 + "\n"
    error = read_in_thread(write(tmp_path, text))
    assert isinstance(error, TopologyError), repr(error)
    assert [(i.line, i.reason) for i in error.issues] == [
        (line_of(text, "router:"), f"invalid YAML: nested deeper than {MAX_YAML_DEPTH} levels")
    ]


def test_a_long_chain_of_merge_keys_is_too_deep(tmp_path, ckpt):
    # Each anchor merges the previous one: two levels deep as written, 3,000 when a mapping is read.
    chain = ["a0: &a0 {policy: round_robin}"]
    chain += [f"a{i}: &a{i} {{<<: *a{i - 1}}}" for i in range(1, 3000)]
    text = template(ckpt) + "\n".join(chain) + "\nrouter: {<<: *a2999}\n"
    error = read_in_thread(write(tmp_path, text))
    assert isinstance(error, TopologyError), repr(error)
    (issue,) = error.issues
    assert issue.reason.endswith(f"nested deeper than {MAX_YAML_DEPTH} levels with its aliases expanded")


def test_aliases_that_expand_to_billions_of_nodes_are_refused(tmp_path, ckpt):
    # 2**60 nodes in 61 lines. Not run against the code before this check: it would exhaust memory.
    laughs = ["l0: &l0 [1, 2]"] + [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, 61)]
    (issue,) = read_in_thread(write(tmp_path, template(ckpt) + "\n".join(laughs) + "\n")).issues
    assert issue.reason == f"invalid YAML: more than {MAX_YAML_NODES:,} YAML nodes with its aliases expanded"
    recursive = template(ckpt) + "router: &r {<<: *r}\n"
    issue = only_issue(write(tmp_path, recursive, "recursive.yaml"))
    assert issue.line == line_of(recursive, "router:") and "recursive structure" in issue.reason


def test_a_file_over_the_size_cap_is_refused(tmp_path, ckpt):
    path = write(tmp_path, "#" * MAX_YAML_BYTES + "\n" + template(ckpt))
    assert str(only_issue(path)) == f"{path}: larger than 1 MiB; a topology file is a few KB"


def test_explicit_tags_that_do_not_construct_are_issues_at_their_line(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  block_size: !!int abc\nrouter:\n  policy: !!python/name:os.system x\n")
    first, second = issues_of(write(tmp_path, text))
    assert (first.line, second.line) == (line_of(text, "block_size"), line_of(text, "policy"))
    assert first.reason.startswith("prefill.block_size: 'abc' cannot be read as tag:yaml.org,2002:int")
    assert second.reason.startswith("router.policy: 'x' cannot be read as tag:yaml.org,2002:python/name")


def test_unreadable_file():
    issue = issues_of(Path("/nonexistent/topology.yaml"))[0]
    assert issue.line is None and str(issue).startswith("/nonexistent/topology.yaml: cannot read")


# ---- built in code -----------------------------------------------------------------------------------
def test_dataclasses_check_their_fields_on_construction():
    with pytest.raises(ValueError, match="PoolConfig field 'tensor_parallel_size': must be >= 1"):
        PoolConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="HardwareConfig field 'accelerator'"):
        HardwareConfig(accelerator="tpu")
    with pytest.raises(ValueError, match="'kv_cache_dtype'"):
        DecodePoolConfig(kv_cache_dtype="fp8")


def test_check_topology_on_a_topology_built_in_code(ckpt):
    topology = Topology(
        name="code",
        hardware=HardwareConfig(devices_per_node=4),
        model=ModelConfig(path=str(ckpt)),
        decode=DecodePoolConfig(devices_per_instance=3, expert_parallel_size=3),
    )
    issues = check_topology(topology)
    assert [i.path for i in issues] == [("decode", "expert_parallel_size")]
    assert check_topology(Topology(name="ok", model=ModelConfig(path=str(ckpt)))) == []


# ---- pdcluster validate ------------------------------------------------------------------------------
def test_cli_validate_exit_codes(tmp_path, ckpt, capsys):
    good = write(tmp_path, template(ckpt), "good.yaml")
    bad_text = template(ckpt, "kv_transfer:\n  transport: http\n")
    bad = write(tmp_path, bad_text, "bad.yaml")

    assert main(["validate", str(good)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{good}: ok — 1 node × 4 cpu, prefill 1×1 devices, decode 1×1 devices, KV shm (auto)\n"
    assert err == ""

    assert main(["validate", str(good), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: ok")
    reason = "kv_transfer.transport: 'http' is not one of: auto, grpc, shm, torch_distributed"
    assert err == f"{bad}:{line_of(bad_text, 'transport')}: {reason}\n"

    assert main(["validate"]) == 2  # usage: no file
    assert "FILE" in capsys.readouterr().err


def test_cli_validate_shipped_accelerator_files(capsys):
    files = [CLUSTERS / "cm384.yaml", CLUSTERS / "gpu-2node.yaml"]
    assert main(["validate", *map(str, files)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(
        "ok — 48 nodes × 8 ascend-910c (16 dies each), prefill 14×32 devices, decode 1×288 devices, "
        "KV torch_distributed"
    )
    assert lines[1].endswith(
        "ok — 2 nodes × 8 h200, prefill 1×8 devices, decode 1×8 devices, KV torch_distributed"
    )


# ---- prefill and decode agree on max_model_len -------------------------------------------------------
def test_max_model_len_that_differs_between_pools_is_an_error_at_its_line(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  max_model_len: 128\ndecode:\n  max_model_len: 64\n")
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "max_model_len: 64")
    assert issue.reason.startswith(
        "decode.max_model_len: prefill.max_model_len 128 and decode.max_model_len 64 differ"
    )
    assert "set both to the same value (the smaller one is 64)" in issue.reason


def test_max_model_len_set_on_one_pool_only_is_compared_with_the_models_context(tmp_path, ckpt):
    text = template(ckpt, "prefill:\n  max_model_len: 128\n")  # decode: null = 256 (the tiny model)
    issue = only_issue(write(tmp_path, text))
    assert issue.line == line_of(text, "max_model_len: 128")
    assert "decode.max_model_len null (the model's max_position_embeddings 256" in issue.reason


def test_max_model_len_that_agrees_validates(tmp_path, ckpt):
    same = template(ckpt, "prefill:\n  max_model_len: 128\ndecode:\n  max_model_len: 128\n")
    topology = load_topology(write(tmp_path, same))
    assert topology.engine_config("prefill").max_model_len == topology.engine_config("decode").max_model_len
    explicit_full = template(ckpt, "decode:\n  max_model_len: 256\n")  # equals prefill's null
    load_topology(write(tmp_path, explicit_full, "full.yaml"))
    over = template(ckpt, "prefill:\n  max_model_len: 128\ndecode:\n  max_model_len: 999\n")
    (issue,) = issues_of(write(tmp_path, over, "over.yaml"))  # only the max_position_embeddings one
    assert "999 exceeds the model's max_position_embeddings 256" in issue.reason


def test_api_limits_validated_and_the_concurrency_default_derived(tmp_path, ckpt):
    """api.max_request_body_bytes and api.max_concurrent_requests (issue 12, edge hygiene and admission):
    checked at their lines; null max_concurrent_requests is 2 per decode seat."""
    text = template(ckpt, "api:\n  max_request_body_bytes: 100\n  max_concurrent_requests: 0\n")
    issues = issues_of(write(tmp_path, text))
    assert [i.line for i in issues] == [line_of(text, "max_request_body"), line_of(text, "max_concurrent")]
    assert "api.max_request_body_bytes: must be >= 1024, got 100" in issues[0].reason
    assert "api.max_concurrent_requests: must be >= 1, got 0" in issues[1].reason

    topo = load_topology(write(tmp_path, template(ckpt, "decode:\n  num_instances: 2\n  max_num_seqs: 16\n")))
    assert topo.api.max_request_body_bytes == 4 * 1024**2 and topo.api.max_concurrent_requests is None
    assert topo.max_concurrent_requests == 2 * 2 * 16
    topo = load_topology(write(tmp_path, template(ckpt, "api:\n  max_concurrent_requests: 7\n")))
    assert topo.max_concurrent_requests == 7
