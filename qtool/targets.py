"""Targets: the runtime a model is quantized for, as data. A `Target` holds every trait a stage
asks about (its preset of option defaults, its grid conventions, the constraints checked on the
written model, the runtime-specific passes by name); stages read traits, never a target's name,
so a target is one entry in TARGETS (and, if its runtime needs its own rewrites, a pass package
like qtool.quantization.ort_cpu). Options the user sets win over the preset, one by one.
Why each shipped target's traits are what they are: docs/targets.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


# A symmetric activation scale 2 amax/255 spreads the 256 codes evenly over [-amax, amax].
SYMMETRIC_HALF_GRID = 127.5


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    runtime: str  # who runs the model, as notes name it ("onnxruntime CPU has no int8 GRU kernel")
    # The preset (QuantizeConfig fields; the user's options win): activation type and symmetry,
    # per-channel weights, 7-bit weights.
    activation_dtype: str
    symmetric_activations: bool
    per_channel: bool
    reduce_range: bool = False
    # The code a symmetric activation range's amax maps to: 127 (scale amax/127) or
    # SYMMETRIC_HALF_GRID (qtool.table.resolve, qtool.quantization.rewrite).
    symmetric_qmax: float = SYMMETRIC_HALF_GRID
    # The graph's outputs computed in float by the ops after the last one whose integer kernel
    # needs int8 output (qtool.plan.planner); False: every op's output quantized, the model's too.
    float_outputs: bool = True
    # A weighted layer fuses into the residual Add after it (Conv+Add+Relu): the layer's output
    # gets no Q/DQ, the Add's other input does (qtool.plan.planner).
    fuses_residual_add: bool = False
    # `matmul: auto` may choose dynamic int8 MatMuls (qtool.plan.dynamic).
    dynamic_matmul: bool = False
    # `embeddings: auto` stores large Gather-only tables int8 per row (qtool.plan.planner).
    int8_embeddings: bool = False
    # Weight-only kernels the runtime has (OpRule.kernel, e.g. an int8 LSTM); an op whose kernel
    # is not listed stays float with a note (qtool.plan.planner).
    kernels: tuple[str, ...] = ()
    # Constraints checked on the written model (qtool.quantization.checks): int8 activations only,
    # zero point 0 only, fixed-range outputs (Softmax, Sigmoid, Tanh) with the spec's parameters.
    int8_activations_only: bool = False
    symmetric_only: bool = False
    spec_fixed_outputs: bool = False
    # Passes by name: on the prepared graph before planning (qtool.prepare.passes), on the
    # quantized model before its checks, and the kernel forms written last, after the canonical
    # copy is kept (both qtool.quantization.ort_cpu's PASSES).
    prepare_passes: tuple[str, ...] = ()
    finish_passes: tuple[str, ...] = ()
    form_passes: tuple[str, ...] = ()
    # uint8 x int8 products whose int16 pair sums saturate on x86 CPUs without VNNI: quantize warns
    # there (vnni_warning).
    saturates_without_vnni: bool = False
    # The model runs in onnxruntime: quantize prints which kernels it picks (qtool.graph.kernels).
    onnxruntime_kernels: bool = False
    # Where activation Q/DQ pairs go (qtool.plan.planner): "every_op" (each quantized op's inputs
    # and output, the integer-kernel convention of onnxruntime, TensorRT, LiteRT) or
    # "inputs_of_int8_ops" (only where an op with a constant weight reads an activation: Conv,
    # ConvTranspose, Gemm, MatMul; a Concat feeding one gets them on its inputs, sharing one
    # scale), for a runtime that folds each pair into its int8 layer and fuses the elementwise
    # ops after a layer into it in float: a pair anywhere else would run as a separate op.
    activation_placement: str = "every_op"
    # A symmetric int8 activation whose calibrated range has no negative value is written uint8 with
    # zero point 0 (scale max/255: every code on the values it takes), as OpenVINO's FakeQuantize
    # with a low bound of 0 is (qtool.table.resolve; qtool.quantization.checks allows it).
    unsigned_nonnegative: bool = False
    # ... and one that does take negative values is written uint8 with zero point 128 where its codes
    # pass an op other than a layer or one of int8_code_readers (a Split, Concat, pooling, Reshape,
    # Transpose): the same grid as int8 with zero point 0, every value the same. On CPUs without AMX
    # OpenVINO's CPU plugin converts int8 codes to uint8 for its Convolutions and loses their scale where
    # they reach a Concat (a YOLOv8's class scores collapse; docs/targets.md), or a run-time Reshape and
    # Transpose, and computes uint8 ones right.
    # Codes only layers and int8_code_readers read stay int8 (QuantPlan.int8_kept): with zero point 128
    # OpenVINO's AMX convolutions take 1.6-3.6x as long, and without AMX both forms are computed right.
    signed_as_uint8: bool = False
    # The ops besides the int8 layers whose reading leaves signed codes int8 (signed_as_uint8): those
    # measured computed right without AMX (oneDNN capped at AVX-512 VNNI; docs/targets.md).
    int8_code_readers: tuple[str, ...] = ()
    # The runtime the measured choices score candidates on, as it computes them
    # (qtool.choices.measure): "onnxruntime" or "openvino" (at f32, qtool.evaluation.openvino_runtime).
    measured_on: str = "onnxruntime"
    # SmoothQuant may insert a Mul by 1/s before static int8 MatMul/Gemm readers where the producer
    # cannot take the division (a LayerNorm the residual stream reads too), as for dynamic MatMuls:
    # a runtime that folds that Mul into the quantizer after it (qtool.plan.smooth_quant.find_sites).
    smooth_inserts: bool = False
    # The runtime's int8 convolutions take an int8 input with a zero point. OpenVINO's CPU plugin
    # compiles no such Convolution ("No suitable implementations"): there asymmetric activations
    # must be uint8 (the option check in qtool.config refuses int8 ones).
    int8_conv_zero_points: bool = True
    # Ops the runtime's low-precision pipeline moves an int8 layer's dequantization (its scale) through.
    # Where one of them and another op both read a layer's output and the graph has a dynamic
    # dimension, OpenVINO applies the scale twice on that op's branch (an SE block's average pool sees
    # its input times the scale; docs/targets.md): such an output gets a quantizer of its own, shared
    # by its readers (qtool.plan.planner), which the runtime then computes right.
    requantize_beside: tuple[str, ...] = ()
    # The speed rule of this runtime's kernels, by name (qtool.choices.speed.RULES): `speed_rule: auto`
    # keeps float the quantized nodes it says run no faster in int8; None: no rule, nothing kept float.
    speed_rule: Optional[str] = None
    # What `bias_correction: auto` settles to with calibration data (qtool.choices.bias_correction):
    # "off", or "measured" (the weights form where it scores closer to fp32 than none, as the runtime
    # computes the candidates)
    bias_correction: str = "off"

    def preset(self) -> dict:
        """The option values this target sets (field names of QuantizeConfig)."""
        return {"activation_dtype": self.activation_dtype, "symmetric_activations": self.symmetric_activations,
                "per_channel": self.per_channel, "reduce_range": self.reduce_range}


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("ort-cpu", "onnxruntime CPU: uint8 asymmetric activations, int8 symmetric per-channel weights "
           "(u8s8 kernels)", "onnxruntime CPU",
           activation_dtype="uint8", symmetric_activations=False, per_channel=True,
           dynamic_matmul=True, int8_embeddings=True, kernels=("DynamicQuantizeLSTM",),
           prepare_passes=("embed_layer_norm",), finish_passes=("stem_s2d", "channel_pad"),
           form_passes=("hard_activations", "gelu_form", "written_form"),
           saturates_without_vnni=True, onnxruntime_kernels=True, speed_rule="onnxruntime_cpu"),
    Target("tensorrt", "TensorRT explicit quantization: int8 symmetric activations (scale amax/127, zero point 0), "
           "per-channel weights", "TensorRT",
           activation_dtype="int8", symmetric_activations=True, per_channel=True, symmetric_qmax=127.0,
           fuses_residual_add=True, int8_activations_only=True, symmetric_only=True),
    Target("litert", "LiteRT int8 spec: int8 asymmetric activations [-128, 127], weights [-127, 127], per-op rules",
           "LiteRT", activation_dtype="int8", symmetric_activations=False, per_channel=True, float_outputs=False,
           int8_activations_only=True, spec_fixed_outputs=True),
    Target("openvino", "OpenVINO CPU: symmetric activations written uint8 (zero point 0 where the range has no "
           "negative value, else 128; int8 where only layers, Adds and Resizes, only MatMul/Gemm or only float "
           "ops read them) "
           "only where Conv/MatMul/Gemm read them and on a layer's output that a pooling and another op both read, "
           "int8 symmetric per-channel weights, no onnxruntime rewrites", "OpenVINO CPU",
           activation_dtype="int8", symmetric_activations=True, per_channel=True, symmetric_qmax=127.0,
           activation_placement="inputs_of_int8_ops", unsigned_nonnegative=True, signed_as_uint8=True,
           int8_code_readers=("Add", "Resize"),
           measured_on="openvino", prepare_passes=("residual_gate",),
           smooth_inserts=True, int8_conv_zero_points=False,
           requantize_beside=("Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
                              "GlobalMaxPool", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "Transpose"),
           speed_rule="openvino_cpu", bias_correction="measured"),
)}
DEFAULT_TARGET = "ort-cpu"
PRESET_FIELDS = ("activation_dtype", "symmetric_activations", "per_channel", "reduce_range")


def weight_qmax(reduce_range: bool) -> int:
    # 7-bit weights keep u8 x s8 pair sums (2 * 255 * 63) inside int16: no vpmaddubsw saturation.
    return 63 if reduce_range else 127


def target_of(options) -> Target:
    """The Target of a QuantizeConfig (or anything with a `target` name)."""
    return TARGETS[options.target]


def measures_bias_correction(options) -> bool:
    """Whether `bias_correction: auto` measures the weights form on the options' target (its rule
    is "measured"): calibration then keeps the channel means the candidate reads."""
    return options.bias_correction == "auto" and target_of(options).bias_correction == "measured"


def vnni_warning(options, has_vnni: Optional[bool]) -> Optional[str]:
    if (not target_of(options).saturates_without_vnni or options.activation_dtype != "uint8"
            or options.reduce_range):
        return None
    if has_vnni is False:
        return ("this x86 CPU has no VNNI (avx512_vnni/avx_vnni): onnxruntime's default u8s8 kernels saturate "
                "int16 pair sums with full-range int8 weights; qtool measures with exact products (session "
                "option session.x64quantprecision=1, slower): set it where you run the model, or quantize "
                "with --reduce-range (7-bit weights)")
    return None


def describe(options) -> str:
    """One line: the target, the effective settings, and which ones the user overrode."""
    target = target_of(options)
    weights = f"int8 symmetric {'per-channel' if options.per_channel else 'per-tensor'} weights " \
              f"[-{weight_qmax(options.reduce_range)}, {weight_qmax(options.reduce_range)}]"
    acts = f"{options.activation_dtype} {'symmetric' if options.symmetric_activations else 'asymmetric'} activations"
    if target.unsigned_nonnegative and options.symmetric_activations and options.activation_dtype == "int8":
        acts += (" (written uint8: zero point 0 where the range has no negative value, else 128 where ops other "
                 "than layers, Adds and Resizes pass the codes on)"
                 if target.signed_as_uint8 else " (uint8 where the range has no negative value)")
    overridden = [f"{name}={getattr(options, name)}" for name in PRESET_FIELDS
                  if name not in options.from_target and getattr(options, name) != target.preset()[name]]
    tail = f"; overridden: {', '.join(overridden)}" if overridden else ""
    return f"target {target.name}: {acts}, {weights}{tail}"
