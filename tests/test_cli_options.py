"""Verbs and options a person can hold: `quantize --help` lists at most 28 options under headings,
the mixed-precision search is its own verb sharing quantize's options, and the choices qtool
settles itself are keys of one `quantization.advanced` section."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from qtool.cli import main
from qtool.config import AdvancedConfig, QuantizeConfig, config_mapping, load_config
from qtool.errors import QtoolError

MAX_QUANTIZE_OPTIONS = 28
HEADINGS = ["Input:", "Calibration:", "Target and precision:", "Data-driven steps:", "Outputs:"]
SEARCH_OPTIONS = {"--eval-data", "--labels", "--target-agreement", "--target-top1-drop", "--target-sqnr",
                  "--target-cosine", "--max-float-layers", "--min-int8-macs", "--search-int16", "--search-ranges"}


def _help(command: str) -> str:
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def _option_lines(text: str) -> list[str]:
    """Every option line of a help text (`  --name ...`, `  -o, --output ...`, `  -h, --help ...`):
    two spaces, then a dash; a wrapped help line is indented further."""
    return [line for line in text.splitlines() if re.match(r"^  -", line)]


def _names(text: str) -> set[str]:
    return {name for line in _option_lines(text) for name in re.findall(r"(?<![\w-])--?[\w-]+", line.split("  ")[1])}


def test_quantize_help_lists_at_most_28_options_under_headings():
    text = _help("quantize")
    lines = _option_lines(text)
    assert len(lines) <= MAX_QUANTIZE_OPTIONS, f"{len(lines)} options:\n" + "\n".join(lines)
    # the count is of every option click knows, -h included: none hidden from the help
    from qtool.cli import quantize
    assert len(lines) == sum(1 for p in quantize.params if p.param_type_name == "option") + 1
    positions = [text.splitlines().index(heading) for heading in HEADINGS]
    assert positions == sorted(positions), "headings out of order"
    # every option but -h/--help sits under one of the headings
    other = text.split("\nOther:\n", 1)[1] if "\nOther:\n" in text else ""
    assert _option_lines(other) == [line for line in lines if "--help" in line]


def test_search_is_its_own_verb_with_quantizes_options():
    quantize, search = _names(_help("quantize")), _names(_help("search"))
    assert not quantize & SEARCH_OPTIONS
    assert search == quantize | SEARCH_OPTIONS  # one decorator: the same options, not copies
    assert "--upgrade-opset" not in quantize | search


def test_search_without_a_target_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["search", str(tmp_path / "m.onnx"), "--data", str(tmp_path),
                                       "--eval-data", str(tmp_path), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 2 and "give a target" in result.output


def test_the_settled_choices_live_under_quantization_advanced():
    assert {f for f in AdvancedConfig.__dataclass_fields__} == {
        "dynamic_weights", "hard_activations", "smooth_dynamic", "equalize_activations", "embeddings",
        "latency_aware", "float_nodes", "embedding_tables", "speed_rule", "head_tails"}
    cfg = load_config({"quantization": {"advanced": {"dynamic_weights": "column", "float_nodes": ["a"]}}})
    assert cfg.quantization.advanced == AdvancedConfig(dynamic_weights="column", float_nodes=("a",))
    written = config_mapping(cfg)["quantization"]["advanced"]
    assert written["dynamic_weights"] == "column" and written["float_nodes"] == ["a"]
    assert load_config(config_mapping(cfg)) == cfg  # the settled config reads back
    assert QuantizeConfig().advanced == AdvancedConfig()


@pytest.mark.parametrize("quantization, message", [
    ({"dynamic_weights": "column"},
     "unknown key 'quantization.dynamic_weights' (did you mean 'advanced.dynamic_weights'?)"),
    ({"advanced": {"dynamic_weight": "column"}},
     "unknown key 'quantization.advanced.dynamic_weight' (did you mean 'dynamic_weights'?)"),
    ({"advanced": "column"}, "section 'quantization.advanced' must be a mapping"),
    ({"upgrade_opset": True}, "unknown key 'quantization.upgrade_opset'"),
])
def test_misplaced_and_mistyped_keys_are_named(quantization, message):
    with pytest.raises(QtoolError) as error:
        load_config({"quantization": quantization})
    assert message in str(error.value)


def test_an_unquoted_off_in_yaml_means_off(tmp_path):
    """YAML 1.1 reads `off` as false: the keys whose values are words take it as "off"."""
    path = tmp_path / "c.yaml"
    path.write_text("quantization:\n  bias_correction: off\n  advanced:\n    head_tails: off\n    latency_aware: on\n")
    cfg = load_config(path)
    assert (cfg.quantization.bias_correction, cfg.quantization.advanced.head_tails,
            cfg.quantization.advanced.latency_aware) == ("off", "off", "on")
