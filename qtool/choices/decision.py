"""A settled choice as data: which option, the value chosen, the candidates and what was measured
for each. The API returns these (QuantizeResult.decisions), `quantize --json` prints them, each
`note:` line is rendered from one, and applying them to the config gives the settled config that
replays the same model without measuring anything."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qtool.config import Config


@dataclass(frozen=True)
class Decision:
    # the config key settled: "section.key" or "quantization.advanced.key" (calibration.method,
    # quantization.advanced.float_nodes, ...)
    option: str
    value: Any  # what the settled config holds for it
    rule: str  # what decided it, in a few words
    # (candidate, {figure: value}) in the order measured; empty when decided from the graph alone
    measured: tuple[tuple[str, dict], ...] = ()
    samples: int = 0  # calibration samples the figures were measured on
    details: tuple[str, ...] = ()  # what each step of a many-step choice did (the latency tuning)

    def note(self) -> str:
        value = ", ".join(map(str, self.value)) if isinstance(self.value, (tuple, list)) else str(self.value)
        text = f"{self.option} = {value or '(none)'}: {self.rule}"
        if self.measured:
            figures = "; ".join(f"{name} {_figures(f)}" for name, f in self.measured)
            text += f" (on {self.samples} calibration samples: {figures})" if self.samples else f" ({figures})"
        return text + "".join(f"; {d}" for d in self.details)

    def to_dict(self) -> dict:
        return {"option": self.option, "value": list(self.value) if isinstance(self.value, tuple) else self.value,
                "rule": self.rule, "measured": [{"candidate": name, **figures} for name, figures in self.measured],
                "samples": self.samples, "details": list(self.details)}


def _figures(figures: dict) -> str:
    if "cosine_db" in figures:
        return f"{figures['cosine_db']:.1f} dB (mean cosine {figures['cosine']:.4f})"
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {_each(v)}" if isinstance(v, dict)
                     else f"{k} {v}" for k, v in figures.items())


def _each(values: dict) -> str:
    """Per-output figures: "(name 12.3, name 45.6)"."""
    return "(" + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()) + ")"


def apply(cfg: Config, decisions: list[Decision]) -> Config:
    """`cfg` with every decision's value in its option ("section.key", or "quantization.advanced.key");
    node lists add up (the run check's and the latency tuning's float nodes)."""
    for decision in decisions:
        section, *path = decision.option.split(".")
        options = getattr(cfg, section)
        value = decision.value
        if isinstance(value, (tuple, list)):
            held = current(options, ".".join(path))
            value = tuple(dict.fromkeys([*(held if isinstance(held, tuple) else ()), *value]))
        cfg = dataclasses.replace(cfg, **{section: replaced(options, ".".join(path), value)})
    return cfg


def current(options, key: str):
    """The value of `key` ("name", or "advanced.name") in a section."""
    for part in key.split("."):
        options = getattr(options, part)
    return options


def replaced(options, key: str, value):
    """dataclasses.replace of `key` ("name", or "advanced.name"), keeping the fields a target preset
    filled as the preset's (not the user's)."""
    if "." in key:
        inner, rest = key.split(".", 1)
        value = replaced(getattr(options, inner), rest, value)
        key = inner
    new = dataclasses.replace(options, **{key: value})
    if hasattr(options, "from_target"):
        object.__setattr__(new, "from_target", options.from_target)
    return new
