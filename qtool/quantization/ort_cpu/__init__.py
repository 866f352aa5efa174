"""onnxruntime CPU's own rewrites of a quantized model, as named passes (PASSES).

A target names the ones its runtime wants (Target.finish_passes: on the quantized model before
its checks; Target.form_passes: kernel forms written last, after the canonical copy the searches
start from); qtool.quantization.quantize looks them up here by name. Each pass rewrites in place,
keeps the model's outputs (bit-identical or within float rounding) and returns its notes. The
weight-only kernels (weight_only.KERNELS) are named by Target.kernels.
"""

from __future__ import annotations

from typing import Callable

import onnx

from qtool.quantization.ort_cpu.channel_pad import pad_input_channels
from qtool.quantization.ort_cpu.gelu_form import NOTE as GELU_NOTE, fused_gelus
from qtool.quantization.ort_cpu.hard_activations import (FLOAT_NOTE, FOLD_NOTE, NOTE as HARD_NOTE,
                                                         float_hard_sigmoids, folded_products, integer_forms)
from qtool.quantization.ort_cpu.stem_s2d import space_to_depth_stems
from qtool.quantization.ort_cpu.written_form import SKIP_NOTE, written_form

Pass = Callable[[onnx.ModelProto, object], list]  # (model, QuantizeConfig) -> notes


def _counted(*pairs: tuple[str, int]) -> list[str]:
    return [note.format(count) for note, count in pairs if count]


def stem_s2d(qmodel: onnx.ModelProto, options) -> list[str]:
    return [f"input '{name}' rearranged into 2x2 blocks (SpaceToDepth) after its QuantizeLinear, so onnxruntime "
            "runs the 3x3 stride-2 stem as a 2x2 stride-1 Conv over 12 channels (fewer kernel taps, outputs "
            "unchanged)" for name in space_to_depth_stems(qmodel)]


def channel_pad(qmodel: onnx.ModelProto, options) -> list[str]:
    return [f"input '{name}' padded with zero channels to a multiple of 4 after its QuantizeLinear, so "
            "onnxruntime runs the first Conv with its fast int8 kernel (outputs unchanged)"
            for name in pad_input_channels(qmodel)]


def hard_activations(qmodel: onnx.ModelProto, options) -> list[str]:
    """Integer forms unless the options keep them float; the written-out blocks' folds and float forms."""
    hard = integer_forms(qmodel) if options.advanced.hard_activations != "float" else 0
    folded = folded_products(qmodel)
    floats = float_hard_sigmoids(qmodel)  # the written-out blocks left in float
    return _counted((HARD_NOTE, hard), (FOLD_NOTE, folded), (FLOAT_NOTE, floats))


def gelu_form(qmodel: onnx.ModelProto, options) -> list[str]:
    return _counted((GELU_NOTE, fused_gelus(qmodel)))


def written(qmodel: onnx.ModelProto, options) -> list[str]:
    return _counted((SKIP_NOTE, written_form(qmodel)))


PASSES: dict[str, Pass] = {"stem_s2d": stem_s2d, "channel_pad": channel_pad, "hard_activations": hard_activations,
                           "gelu_form": gelu_form, "written_form": written}
