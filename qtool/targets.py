"""Target presets: the runtime a model is quantized for decides the options that make it
fast and correct there. Each preset is a named table of defaults; any option the user sets
(CLI flag or config key) wins over the preset, one by one.

- ort-cpu (default): onnxruntime on CPU. uint8 asymmetric activations x int8 symmetric
  per-channel weights: onnxruntime's u8s8 kernels (QLinearConv, QGemm via MLAS) are its
  fastest path on x86; int8 activations fall back to slower s8s8 code (measured on
  EfficientNet-Lite0, batch 8, 1 thread: 2.35x vs 1.25x fp32). On x86 CPUs without VNNI
  the u8s8 path uses vpmaddubsw, whose int16 intermediate sums can saturate; 7-bit
  weights (`reduce_range`) avoid that at a small accuracy cost.
- tensorrt: TensorRT explicit quantization. Symmetric int8 everywhere (zero point 0: TensorRT
  supports no other) with activation scales amax/127, TensorRT's and ModelOpt's convention and
  the value a TensorRT calibration cache holds (so a table converted to a cache quantizes to the
  same model as the table itself), per-channel weights; Q/DQ on the inputs of quantized layers (qtool's QDQ
  form puts one pair on each quantized tensor, read by every consumer), none between a layer and
  the activation it fuses, and the residual Add's other input quantized so TensorRT fuses
  Conv+Add+Relu. Fixed-range outputs (Softmax, Sigmoid) get the symmetric grid [-1, 1).
- litert: the LiteRT (TFLite) int8 spec. int8 asymmetric activations in [-128, 127], int8
  symmetric per-channel weights in [-127, 127], per-op rules: Softmax/Sigmoid outputs
  1/256 and -128, Tanh 1/128 and 0, movement ops keep their input's parameters.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


# A symmetric activation scale 2 amax/255 spreads the 256 codes evenly over [-amax, amax].
SYMMETRIC_HALF_GRID = 127.5


@dataclass(frozen=True)
class Target:
    name: str
    activation_dtype: str
    symmetric_activations: bool
    per_channel: bool
    reduce_range: bool
    description: str
    runtime: str  # who runs the model, as notes name it ("onnxruntime CPU has no int8 GRU kernel")
    # The code a symmetric activation range's amax maps to: 127 (scale amax/127, TensorRT), or
    # SYMMETRIC_HALF_GRID.
    symmetric_qmax: float = SYMMETRIC_HALF_GRID
    # The graph's outputs computed in float by the ops after the last one whose integer kernel needs
    # int8 output (qtool.plan.planner): onnxruntime and TensorRT run such a tail in float; the LiteRT
    # spec quantizes every op's output, the model's outputs included.
    float_outputs: bool = True

    def preset(self) -> dict:
        """The option values this target sets (field names of QuantizeConfig)."""
        return {"activation_dtype": self.activation_dtype, "symmetric_activations": self.symmetric_activations,
                "per_channel": self.per_channel, "reduce_range": self.reduce_range}


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("ort-cpu", "uint8", False, True, False,
           "onnxruntime CPU: uint8 asymmetric activations, int8 symmetric per-channel weights (u8s8 kernels)",
           "onnxruntime CPU"),
    Target("tensorrt", "int8", True, True, False,
           "TensorRT explicit quantization: int8 symmetric activations (scale amax/127, zero point 0), "
           "per-channel weights", "TensorRT", symmetric_qmax=127.0),
    Target("litert", "int8", False, True, False,
           "LiteRT int8 spec: int8 asymmetric activations [-128, 127], weights [-127, 127], per-op rules",
           "LiteRT", float_outputs=False),
)}
DEFAULT_TARGET = "ort-cpu"
PRESET_FIELDS = ("activation_dtype", "symmetric_activations", "per_channel", "reduce_range")


def weight_qmax(reduce_range: bool) -> int:
    # 7-bit weights keep u8 x s8 pair sums (2 * 255 * 63) inside int16: no vpmaddubsw saturation.
    return 63 if reduce_range else 127


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> Optional[frozenset[str]]:
    """The first CPU's flags on Linux (x86 `flags`, ARM `Features`); None where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def cpu_has_vnni(cpuinfo: str | Path = "/proc/cpuinfo") -> Optional[bool]:
    """True/False on x86 Linux; None where it cannot be told (other OS or architecture)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return None
    flags = cpu_flags(cpuinfo)
    return None if flags is None else bool(flags & {"avx512_vnni", "avx_vnni"})


def vnni_warning(options, has_vnni: Optional[bool]) -> Optional[str]:
    if options.target != "ort-cpu" or options.activation_dtype != "uint8" or options.reduce_range:
        return None
    if has_vnni is False:
        return ("this x86 CPU has no VNNI (avx512_vnni/avx_vnni): onnxruntime's u8s8 kernels can saturate "
                "int16 sums with full-range int8 weights; if accuracy suffers, quantize with --reduce-range "
                "(7-bit weights)")
    return None


def describe(options) -> str:
    """One line: the target, the effective settings, and which ones the user overrode."""
    target = TARGETS[options.target]
    weights = f"int8 symmetric {'per-channel' if options.per_channel else 'per-tensor'} weights " \
              f"[-{weight_qmax(options.reduce_range)}, {weight_qmax(options.reduce_range)}]"
    acts = f"{options.activation_dtype} {'symmetric' if options.symmetric_activations else 'asymmetric'} activations"
    overridden = [f"{name}={getattr(options, name)}" for name in PRESET_FIELDS
                  if name not in options.from_target and getattr(options, name) != target.preset()[name]]
    tail = f"; overridden: {', '.join(overridden)}" if overridden else ""
    return f"target {target.name}: {acts}, {weights}{tail}"
