"""The planner's data: node profiles, network/power defaults and model presets (TOML)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from cellswarm.errors import RequestError
from cellswarm.models import entry_for_hf, module_of
from cellswarm.models.deepseek2 import DeepseekConfig
from cellswarm.models.llama_config import LlamaConfig
from cellswarm.planner.presets import Preset, get_preset, load_presets
from cellswarm.planner.profiles import (
    MemoryTier,
    NodeProfile,
    get_profile,
    load_network,
    load_power,
    load_profiles,
    parse_rate,
)

BUILTIN_PROFILES = {"ps3", "ps3-slim", "rpi4", "rpi5", "laptop", "xeon-optane"}
BUILTIN_PRESETS = {
    "kimi-k2",
    "kimi-k2.5",
    "kimi-k3",
    "deepseek-v3",
    "qwen3-235b-a22b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-2-70b",
    "mixtral-8x7b",
    "smollm2-135m",
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profiles.toml"
    path.write_text(text)
    return path


# -- parse_rate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("941M", 941e6),
        ("25.6G", 25.6e9),
        ("3.2T", 3.2e12),
        ("10k", 1e4),
        ("10K", 1e4),
        ("1g", 1e9),
        ("  7.45 G ", 7.45e9),
        ("4096", 4096.0),
        ("1e9", 1e9),
        ("2.5e-3", 2.5e-3),
        (12, 12.0),
        (1.5e9, 1.5e9),
    ],
)
def test_parse_rate(text: str | float, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "G", "1.5X", "10GiB", "10 Gbit/s", "-1G", "1..5G", "fast"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(RequestError, match="941M"):
        parse_rate(text)


def test_parse_rate_rejects_bool() -> None:
    with pytest.raises(RequestError):
        parse_rate(True)


# -- built-in profiles ------------------------------------------------------------------------


def test_every_builtin_profile_loads() -> None:
    profiles = load_profiles()
    assert set(profiles) == BUILTIN_PROFILES
    for name, p in profiles.items():
        assert isinstance(p, NodeProfile) and p.name == name
        assert 0 < p.effective_bandwidth_bytes_per_s <= p.memory_bandwidth_bytes_per_s
        assert 0 < p.effective_flops <= p.flops
        assert p.link_bytes_per_s == p.link_bits_per_s / 8
        assert p.power_idle_w <= p.power_busy_w


def test_ps3_figures() -> None:
    ps3 = get_profile("ps3")
    assert ps3.memory_bytes == 196 << 20  # binary capacity
    assert ps3.memory_bandwidth_bytes_per_s == 25.6e9  # decimal rate
    assert ps3.flops == pytest.approx(6 * 25.6e9)
    assert ps3.link_bits_per_s == 941e6
    assert ps3.link_bytes_per_s == pytest.approx(117.625e6)
    assert ps3.link_rtt_s == pytest.approx((110e-6 + 220e-6) / 2)
    assert ps3.cores == 6 and ps3.tiers == ()
    assert isinstance(ps3.swap, MemoryTier) and ps3.swap.capacity_bytes <= 256 << 20
    # The slim inherits everything but power (and its description).
    slim = get_profile("ps3-slim")
    assert slim.power_busy_w == 96.0 and slim.power_busy_w < ps3.power_busy_w
    assert (slim.memory_bytes, slim.flops, slim.swap) == (ps3.memory_bytes, ps3.flops, ps3.swap)
    assert slim.description != ps3.description


def test_xeon_optane_tiers() -> None:
    x = get_profile("xeon-optane")
    assert x.flops == pytest.approx(40 * 2.3e9 * 64)
    assert [t.name for t in x.tiers] == ["dram", "pmem"]
    dram, pmem = x.tiers
    assert dram.capacity_bytes == x.memory_bytes == 256 << 30
    assert dram.bandwidth_bytes_per_s == pytest.approx(8 * 3200e6 * 8)
    assert pmem.capacity_bytes == 4 * (256 << 30)
    assert pmem.bandwidth_bytes_per_s == pytest.approx(4 * 7.45e9)
    assert pmem.effective_bandwidth_bytes_per_s < dram.effective_bandwidth_bytes_per_s
    assert pmem.latency_s > dram.latency_s
    assert x.swap is None


def test_network_and_power_defaults() -> None:
    net = load_network()
    assert net.nodes_per_access_switch == 48
    assert net.access_uplink_bits_per_s == 10e9
    assert net.aggregation_uplink_bits_per_s == 100e9
    assert net.core_bandwidth_bits_per_s == 3.2e12
    # The stated oversubscription ratios follow from the port counts (1 GbE nodes).
    down = net.nodes_per_access_switch * 1e9
    assert net.access_oversubscription == pytest.approx(down / net.access_uplink_total_bits_per_s)
    agg_down = net.access_switches_per_aggregation * net.access_uplink_total_bits_per_s
    assert net.aggregation_oversubscription == pytest.approx(
        agg_down / net.aggregation_uplink_total_bits_per_s
    )
    assert 0 <= net.access_added_rtt_s <= net.aggregation_added_rtt_s <= net.core_added_rtt_s
    power = load_power()
    assert (power.price_per_kwh, power.pue) == (0.30, 1.5)


# -- user files -------------------------------------------------------------------------------


def test_user_file_overrides_and_adds(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[ps3]
memory = "180M"

[pi-cluster-node]
base = "rpi4"
description = "Pi 4 with 4 GB"
memory = "3.5G"

[xeon-optane]
memory = "512G"

[defaults.power]
price_per_kwh = 0.12
""",
    )
    profiles = load_profiles(path)
    assert set(profiles) == BUILTIN_PROFILES | {"pi-cluster-node"}
    builtin = load_profiles()
    ps3 = profiles["ps3"]
    assert ps3.memory_bytes == 180 << 20
    assert ps3.flops == builtin["ps3"].flops and ps3.swap == builtin["ps3"].swap
    # Built-ins resolve their bases among built-ins: the user's ps3 does not leak into ps3-slim.
    assert profiles["ps3-slim"] == builtin["ps3-slim"]
    node = profiles["pi-cluster-node"]
    assert node.memory_bytes == int(3.5 * (1 << 30))
    assert node.description == "Pi 4 with 4 GB"
    assert (node.flops, node.power_busy_w) == (builtin["rpi4"].flops, builtin["rpi4"].power_busy_w)
    assert profiles["xeon-optane"].tiers == builtin["xeon-optane"].tiers
    assert get_profile("pi-cluster-node", path) == node
    assert load_power(path).price_per_kwh == 0.12
    assert load_power(path).pue == 1.5  # not overridden
    assert load_network(path) == load_network()


def test_user_file_base_chain_and_self_base(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[a]
base = "ps3"
cores = 5

[b]
base = "a"
power_busy_w = 180.0

[rpi5]
base = "rpi5"   # the built-in rpi5 underneath
cores = 2

[optane-lite]
base = "xeon-optane"
tiers = []
swap = { name = "nvme", capacity = "2T", bandwidth = "7G", efficiency = 0.8, latency_s = 80e-6 }
""",
    )
    profiles = load_profiles(path)
    assert profiles["b"].cores == 5 and profiles["b"].power_busy_w == 180.0
    assert profiles["b"].memory_bytes == 196 << 20
    assert profiles["rpi5"].cores == 2 and profiles["rpi5"].flops == load_profiles()["rpi5"].flops
    lite = profiles["optane-lite"]
    assert lite.tiers == () and lite.swap is not None and lite.swap.capacity_bytes == 2 << 40


def test_swap_false_removes_swap(tmp_path: Path) -> None:
    path = write(tmp_path, "[ps3]\nswap = false\n")
    assert load_profiles(path)["ps3"].swap is None


def test_new_profile_needs_every_field(tmp_path: Path) -> None:
    path = write(tmp_path, '[mystery]\ndescription = "?"\nmemory = "1G"\n')
    with pytest.raises(RequestError, match=r"'mystery'.*missing field 'memory_bandwidth'.*base"):
        load_profiles(path)


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("[ps3]\nmemory_efficiency = 1.5", r"'ps3'.*memory_efficiency = 1\.5 must be in \(0, 1\]"),
        ("[ps3]\ncompute_efficiency = 0", r"'ps3'.*compute_efficiency = 0\.0 must be in"),
        ('[ps3]\nmemory = "lots"', r"'ps3'.*memory = 'lots'.*not a byte count"),
        ('[ps3]\nmemory = "0"', r"'ps3'.*memory = 0 must be a whole number >= 1"),
        ('[rpi4]\nlink_bandwidth = "1 Gbit/s"', r"'rpi4'.*link_bandwidth = '1 Gbit/s'"),
        ("[rpi4]\nflops = -3.0", r"'rpi4'.*flops = -3\.0 must be > 0"),
        ("[rpi4]\ncores = 2.5", r"'rpi4'.*cores = 2\.5.*not a whole number"),
        ("[rpi4]\ncores = true", r"'rpi4'.*cores = True.*not a whole number"),
        ("[rpi4]\npower_idle_w = 9.0", r"'rpi4'.*power_idle_w = 9\.0 exceeds power_busy_w"),
        ('[rpi4]\nmemroy = "1G"', r"'rpi4'.*unknown field 'memroy'"),
        ('[rpi4]\nbase = "pdp11"', r"'rpi4'.*base = 'pdp11' is not a known profile; known:"),
        ('[a]\nbase = "b"\n[b]\nbase = "a"', r"base = '[ab]' makes a cycle"),
        (
            '[ps3.swap]\nname = "x"\ncapacity = "1G"\nbandwidth = "1G"\nefficiency = 2.0\n'
            "latency_s = 1e-3",
            r"'ps3'.*swap 'x': efficiency = 2\.0 must be in \(0, 1\]",
        ),
        (
            '[xeon-optane]\ntiers = [{ name = "pmem", capacity = "1T", bandwidth = "0", '
            "efficiency = 0.5, latency_s = 3e-7 }]",
            r"'xeon-optane'.*tiers\[0\] 'pmem': bandwidth = 0",
        ),
        ('[xeon-optane]\ntiers = [{ name = "pmem" }]', r"'xeon-optane'.*tiers\[0\].*missing"),
        ('[defaults.network]\naccess_uplink = "fast"', r"network defaults.*access_uplink = 'fast'"),
        ("[defaults.power]\npue = 0.9", r"power defaults: pue = 0\.9 must be >= 1"),
        ("stray = 3", r"top-level key 'stray' = 3 is not a table"),
        ("[ps3\nmemory = 1", r"is not valid TOML"),
    ],
)
def test_bad_values_give_one_line_errors(tmp_path: Path, body: str, pattern: str) -> None:
    path = write(tmp_path, body + "\n")
    with pytest.raises(RequestError, match=pattern) as info:
        load_profiles(path)
        load_network(path)
        load_power(path)
    assert "\n" not in str(info.value)


def test_errors_name_the_user_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[ps3]\nmemory_efficiency = 1.5\n")
    with pytest.raises(RequestError, match=f"node profile 'ps3' \\(in {path}\\): memory_eff"):
        load_profiles(path)


def test_missing_user_file(tmp_path: Path) -> None:
    with pytest.raises(RequestError, match="does not exist"):
        load_profiles(tmp_path / "nope.toml")


def test_dataclass_validation_directly() -> None:
    ok = get_profile("rpi4")
    with pytest.raises(RequestError, match=r"^node profile 'x': memory_efficiency = 0 must be"):
        NodeProfile(**{**ok.__dict__, "name": "x", "memory_efficiency": 0})
    with pytest.raises(RequestError, match=r"^memory tier 't': latency_s = -1\.0 must be > 0$"):
        MemoryTier("t", 1, 1.0, 1.0, -1.0)


def test_unknown_profile_lists_known() -> None:
    with pytest.raises(RequestError) as info:
        get_profile("foo")
    msg = str(info.value)
    assert msg.startswith("unknown node profile 'foo'; known: laptop, ps3, ps3-slim, rpi4, rpi5")
    assert msg.endswith("(or define it in a TOML file with --profiles)")


# -- presets ----------------------------------------------------------------------------------


def _params(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active per token) weights, counted from a config: matrices and norms."""
    d, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    embed = vocab * d * (1 if cfg.get("tie_word_embeddings") else 2) + d
    if "kv_lora_rank" in cfg:  # MLA
        ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        attn = d * ql + ql + ql * heads * (nope + rope) + d * (kvl + rope) + kvl
        attn += kvl * heads * (nope + v) + heads * v * d
    else:
        hd = cfg.get("head_dim") or d // heads
        kv = cfg.get("num_key_value_heads") or heads
        attn = 2 * d * heads * hd + 2 * d * kv * hd
    attn += 2 * d  # the two norms
    n_exp = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n_exp:
        ffn = 3 * d * cfg["intermediate_size"]
        total = embed + layers * (attn + ffn)
        return total, total
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    expert = 3 * d * width
    shared = (cfg.get("n_shared_experts") or 0) * expert
    router = n_exp * d + (n_exp if cfg.get("scoring_func") == "sigmoid" else 0)
    dense = cfg.get("first_k_dense_replace") or 0
    common = embed + layers * attn + dense * 3 * d * cfg["intermediate_size"]
    moe = layers - dense
    total = common + moe * (n_exp * expert + shared + router)
    active = common + moe * (cfg["num_experts_per_tok"] * expert + shared + router)
    return total, active


def test_every_preset_loads() -> None:
    presets = load_presets()
    assert set(presets) == BUILTIN_PRESETS
    for name, p in presets.items():
        assert isinstance(p, Preset) and p.name == name and p.source
        assert "source" not in p.hf_config and "published" not in p.hf_config
        with pytest.raises(TypeError):
            p.hf_config["model_type"] = "x"  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS))
def test_presets_build_with_the_engine(name: str) -> None:
    p = get_preset(name)
    if p.model_type in ("mixtral", "qwen3_moe"):  # sized by the planner, not run by the engine
        keys = {"num_experts_per_tok", "hidden_size", "num_hidden_layers", "vocab_size"}
        keys |= (
            {"num_local_experts", "intermediate_size"}
            if p.model_type == "mixtral"
            else {"num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"}
        )
        assert keys <= set(p.hf_config)
        return
    module = module_of(entry_for_hf(p.model_type))
    config = module.CONFIG.from_hf(p.hf_config)
    assert config.n_layers == p.hf_config["num_hidden_layers"]
    assert config.context_length == p.hf_config["max_position_embeddings"]
    if p.model_type in ("llama", "qwen2", "qwen3"):
        assert isinstance(config, LlamaConfig)
        module.hf_extra_tensors(config, p.hf_config)  # llama3 RoPE scaling reads its keys
    else:
        assert isinstance(config, DeepseekConfig) and config.yarn is not None
        assert config.n_experts == p.hf_config["n_routed_experts"]


@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS - {"kimi-k3"}))
def test_presets_match_published_parameter_counts(name: str) -> None:
    p = get_preset(name)
    assert p.published_total_params and p.published_active_params
    total, active = _params(p.hf_config)
    assert total == pytest.approx(p.published_total_params, rel=0.03)
    assert active == pytest.approx(p.published_active_params, rel=0.03)


def test_kimi_k3_is_scaled_kimi_k2() -> None:
    k2, k3 = get_preset("kimi-k2"), get_preset("kimi-k3")
    assert k3.published_total_params is None and k3.assumptions
    assert any("not public" in a for a in k3.assumptions)
    total, active = _params(k3.hf_config)
    assert total == pytest.approx(2.8e12, rel=0.002)
    k2_total, k2_active = _params(k2.hf_config)
    assert active == pytest.approx(k2_active, rel=0.01)
    # The routed expert count is the only shape change besides the context.
    differ = {k for k in k2.hf_config if k2.hf_config[k] != k3.hf_config.get(k)}
    assert differ == {"n_routed_experts", "max_position_embeddings", "rope_scaling"}
    per_expert = 60 * (3 * 7168 * 2048 + 7168 + 1)
    assert k3.hf_config["n_routed_experts"] == 384 + round((2.8e12 - k2_total) / per_expert) + 1


def test_config_dict_is_plain() -> None:
    cfg = get_preset("qwen3-235b-a22b").config_dict()
    assert type(cfg) is dict and cfg["mlp_only_layers"] == []
    assert type(get_preset("kimi-k2").config_dict()["rope_scaling"]) is dict


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(RequestError, match=r"unknown model preset 'gpt-5'; known: deepseek-v3, "):
        get_preset("gpt-5")
