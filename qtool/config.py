"""Typed options for every stage, and the YAML config file that sets them.

Each stage gets one frozen dataclass; the YAML file has one section per stage with
the same field names. Unknown or mistyped keys are errors that name the key and
the allowed ones, because a silently ignored `mena:` would cost a user 10 points
of accuracy without any hint why.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from qtool.errors import QtoolError
from qtool.targets import DEFAULT_TARGET, PRESET_FIELDS, TARGETS

RESIZE_MODES = ("stretch", "shorter_side", "crop_fraction", "letterbox")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "area")
CHANNEL_ORDERS = ("RGB", "BGR")
LAYOUTS = ("NCHW", "NHWC")
ACTIVATION_DTYPES = ("uint8", "int8")
# auto: what the target says (Target.bias_correction): off, or weights where measured closer to fp32
BIAS_CORRECTIONS = ("auto", "off", "weights", "fast")
WEIGHT_ROUNDINGS = ("auto", "nearest", "adaptive")  # auto: adaptive when calibration data is at hand
EMBEDDINGS = ("auto", "int8", "float")  # auto: int8 for tables of EMBEDDING_AUTO_BYTES or more (ort-cpu)
EMBEDDING_AUTO_BYTES = 1 << 20
# auto: dynamic for transformer graphs (qtool.plan.dynamic), static otherwise
MATMUL_STRATEGIES = ("auto", "static", "dynamic")
DYNAMIC_WEIGHTS = ("auto", "column", "tensor")  # auto: measured (qtool.choices.dynamic_weights), else column
HEAD_TAILS = ("auto", "off")
SPEED_RULES = ("auto", "off")  # auto: qtool.choices.speed on a target that names a Target.speed_rule
LATENCY_AWARE = ("off", "on")  # on: the opt-in timing search of qtool.choices.latency
# auto: measured (qtool.choices.hard_forms) where quantize has calibration data, else integer
HARD_ACTIVATIONS = ("auto", "integer", "float")
ACIQ_DISTRIBUTIONS = ("laplace", "gaussian")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


@dataclass(frozen=True)
class PreprocessConfig:
    """How an image file becomes a model input tensor (OpenCV, no other library)."""

    size: Optional[tuple[int, int]] = None  # (height, width); None: taken from the model input
    resize: str = "stretch"
    crop_fraction: float = 0.875  # crop_fraction mode: centre crop of this fraction of the shorter side
    resize_shorter: Optional[int] = None  # shorter_side mode: shorter side length before the centre crop
    interpolation: str = "bilinear"
    scale: float = 1.0  # pixels (0..255) are multiplied by this before mean/std
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    channel_order: str = "RGB"
    layout: str = "NCHW"
    pad_value: float = 114.0  # letterbox border, in pixel units (before scale/mean/std)

    def __post_init__(self):
        _one_of("resize", self.resize, RESIZE_MODES)
        _one_of("interpolation", self.interpolation, INTERPOLATIONS)
        _one_of("channel_order", self.channel_order, CHANNEL_ORDERS)
        _one_of("layout", self.layout, LAYOUTS)
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ValueError(f"crop_fraction must be in (0, 1], got {self.crop_fraction}")
        if any(s == 0 for s in self.std):
            raise ValueError("std must not contain 0")
        if self.size is not None:
            if isinstance(self.size, int):
                object.__setattr__(self, "size", (self.size, self.size))
            if len(self.size) != 2 or min(self.size) <= 0:
                raise ValueError(f"size must be [height, width] of positive integers, got {self.size}")


@dataclass(frozen=True)
class CalibrationConfig:
    # auto: minmax, mse and percentile measured on the calibration data when quantizing or calibrating
    # a model, the closest to fp32 kept (qtool.choices.ranges); minmax where nothing measures
    method: str = "auto"
    num_samples: Optional[int] = None  # None: every sample in the data folder
    batch_size: int = 8
    percentile: float = 99.99  # percentile method: kept fraction of |x| (symmetric) or of each tail
    symmetric: bool = False  # ranges symmetric about 0 (minmax, percentile on |x|)
    moving_average: bool = False  # minmax: mean of the per-batch extremes instead of the overall ones
    aciq_distribution: str = "laplace"  # aciq: laplace or gaussian
    # per-tensor method choices, e.g. {Softmax: minmax} (inputs of every Softmax node) and
    # {"*attn*": percentile} (tensor name glob); a tensor-name match wins over an op-type match
    method_by_op_type: tuple[tuple[str, str], ...] = ()
    method_by_tensor: tuple[tuple[str, str], ...] = ()
    histogram_sample: int = 16384  # values per tensor and batch that feed the histogram (strided sample)
    workers: int = 1  # onnxruntime sessions in separate processes, each over a shard of the data
    dask: Optional[str] = None  # a Dask scheduler address (tcp://host:8786) or local[:N]; shards run there

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile}")
        _one_of("aciq_distribution", self.aciq_distribution, ACIQ_DISTRIBUTIONS)
        for name in ("histogram_sample", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _check_alpha(name: str, value: Optional[float]) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} (a SmoothQuant alpha) must be in [0, 1], got {value}")


@dataclass(frozen=True)
class AdvancedConfig:
    """quantization.advanced: the choices qtool makes itself, each measured on the calibration data
    or read from the graph (qtool.choices), and what the settled config records of them. A user sets
    them to skip a measurement or to force a form; `quantize --save-config` writes them all."""

    # Embedding tables read by Gather: int8 per row, weight-only (the rows are dequantized after the Gather)
    embeddings: str = "auto"
    # The tables `embeddings: int8` stores int8 (initializer names), as `auto` settled them; None: every
    # table read by row Gathers only
    embedding_tables: Optional[tuple[str, ...]] = None
    # Scales of the dynamic MatMuls' int8 weights: per output column, or one per tensor (onnxruntime's
    # kernel rescales a per-column product in an extra pass); auto: per tensor when the calibration
    # data measures no loss from it, else per column
    dynamic_weights: str = "auto"
    # on: time candidate models on this machine and keep float the nodes whose int8 form runs slower
    # (qtool.choices.latency); opt-in, since its outcome depends on the machine. The nodes it
    # chooses are written to float_nodes in the settled config (quantize --save-config)
    latency_aware: str = "off"
    # auto: keep float the quantized nodes the target's runtime runs no faster in int8, estimated from
    # the graph and its shapes by its rule (Target.speed_rule, qtool.choices.speed); nothing timed. The
    # nodes it chooses are written to float_nodes in the settled config (and the rule to off)
    speed_rule: str = "auto"
    # Nodes (exact labels: name, or first output) kept float, as settled by the speed rule, the latency tuning and
    # the run check (nodes onnxruntime cannot run in int8); unlike exclude_nodes, no patterns
    float_nodes: tuple[str, ...] = ()
    # HardSigmoid/HardSwish between uint8 tensors (targets whose form passes write them): integer, written as onnxruntime's integer
    # kernels (QLinearAdd, QLinearMul: faster, with the gate rounded to 1/255); float, left between their
    # DequantizeLinear and QuantizeLinear (exact codes); auto: integer unless the calibration data
    # measures the all-int8 model below 0.99 mean cosine and the float form closer to fp32
    hard_activations: str = "auto"
    # SmoothQuant alpha for the inputs of dynamic int8 MatMuls (matmul dynamic), through an inserted Mul
    # where their producer cannot take the division; None: off (qtool.plan.smooth_quant)
    smooth_dynamic: Optional[float] = 0.8
    # Conv -> activation (hard-swish, Relu, none) -> depthwise Conv chains are rescaled (a hard-swish
    # rewritten) exactly so that every channel of their activations spans the same range
    # (qtool.prepare.equalize); measured on the calibration data, kept in the table's smoothing scales
    equalize_activations: bool = True
    # auto: with calibration data, the own tails of outputs that int8 moves far from fp32 (each output
    # by its own SQNR) are kept float when that brings them closer (qtool.choices.heads); off: never
    head_tails: str = "auto"

    def __post_init__(self):
        _one_of("embeddings", self.embeddings, EMBEDDINGS)
        _one_of("dynamic_weights", self.dynamic_weights, DYNAMIC_WEIGHTS)
        _one_of("latency_aware", self.latency_aware, LATENCY_AWARE)
        _one_of("speed_rule", self.speed_rule, SPEED_RULES)
        _one_of("hard_activations", self.hard_activations, HARD_ACTIVATIONS)
        _one_of("head_tails", self.head_tails, HEAD_TAILS)
        _check_alpha("smooth_dynamic", self.smooth_dynamic)


@dataclass(frozen=True)
class QuantizeConfig:
    # activation_dtype, symmetric_activations, per_channel, reduce_range: None takes the value
    # of the target preset (qtool/targets.py); a value given here (or on the CLI) wins.
    activation_dtype: Optional[str] = None
    symmetric_activations: Optional[bool] = None
    per_channel: Optional[bool] = None
    exclude_op_types: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()  # node names or glob patterns
    # activation tensors (names or glob patterns) quantized to 16 bits over their calibrated ranges
    int16_activations: tuple[str, ...] = ()
    keep_opset: bool = False  # never convert an opset < 13 model (per-tensor weights, or an error below 10)
    target: str = DEFAULT_TARGET  # a name in qtool.targets.TARGETS
    reduce_range: Optional[bool] = None  # 7-bit weights (x86 without VNNI)
    # Names of the fields filled from the target preset (not given by the user).
    from_target: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    equalize: bool = False  # cross-layer equalization of Conv->act->Conv pairs before calibration
    # weights: each layer's bias takes back the mean output shift of its int8 weights, from the channel
    # means calibration measured; fast: the whole shift the samples agree on, measured on them (a pass
    # of each model); auto: the target's rule, off on onnxruntime CPU, measured on OpenVINO
    # (qtool.choices.bias_correction)
    bias_correction: str = "auto"
    weight_rounding: str = "nearest"  # adaptive: rounding for the least layer output error (quantization/rounding.py)
    correction_samples: int = 64  # calibration samples used by bias correction and adaptive rounding
    # MatMul/Gemm with a constant weight: static (Q/DQ from calibrated ranges) or dynamic (int8 weight,
    # activation quantized at run time, every other node float); auto: dynamic for transformers
    matmul: str = "auto"
    # SmoothQuant alpha in [0, 1]: per-channel activation ranges of the tensors a LayerNorm or a linear
    # layer feeds to MatMul/Gemm layers move into their weights before calibration; None: off
    smooth_quant: Optional[float] = None
    # Choices qtool settles itself (measured on the data or read from the graph): quantization.advanced
    advanced: AdvancedConfig = field(default_factory=AdvancedConfig)
    # The smoothing scales (tensor, per-channel factors): measured on the calibration data by calibrate,
    # read from the table by quantize; not a setting of the user's
    smooth_scales: tuple[tuple[str, tuple[float, ...]], ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self):
        _one_of("target", self.target, tuple(TARGETS))
        preset = TARGETS[self.target].preset()
        filled = tuple(name for name in PRESET_FIELDS if getattr(self, name) is None)
        for name in filled:
            object.__setattr__(self, name, preset[name])
        object.__setattr__(self, "from_target", filled)
        _one_of("activation_dtype", self.activation_dtype, ACTIVATION_DTYPES)
        _one_of("bias_correction", self.bias_correction, BIAS_CORRECTIONS)
        _one_of("weight_rounding", self.weight_rounding, WEIGHT_ROUNDINGS)
        _one_of("matmul", self.matmul, MATMUL_STRATEGIES)
        if self.correction_samples < 1:
            raise ValueError(f"correction_samples must be >= 1, got {self.correction_samples}")
        _check_alpha("smooth_quant", self.smooth_quant)
        target = TARGETS[self.target]
        if not target.int8_conv_zero_points and self.activation_dtype == "int8" and not self.symmetric_activations:
            raise ValueError(f"target {self.target}: {target.runtime} compiles no int8 Conv input with a zero point; "
                             "asymmetric activations take activation_dtype uint8 (configs/openvino_asymmetric.yaml)")
        runtime = target.measured_on
        if self.advanced.latency_aware == "on" and runtime != "onnxruntime":
            raise ValueError(f"latency_aware times candidates on onnxruntime; target {self.target} runs on {runtime}")


TASKS = ("auto", "classification", "detection", "ctc", "generic")


@dataclass(frozen=True)
class EvaluateConfig:
    num_samples: Optional[int] = None
    batch_size: int = 8
    threads: int = 1  # latency is measured with this many intra-op threads
    warmup: int = 3
    runs: int = 20
    top_k: int = 5
    task: str = "auto"  # auto: classification when the first output is [N, C], else generic; ctc: only asked for
    task_config: Optional[str] = None  # YAML file of DetectionConfig keys (task detection)
    per_layer: bool = False  # error of every quantized tensor of the int8 model vs its fp32 twin
    sensitivity: bool = False  # one layer at a time in int8 (needs the calibration table)
    layer_samples: int = 32  # samples used by per_layer and sensitivity
    dask: Optional[str] = None  # a Dask scheduler address (tcp://host:8786) or local[:N]; shards run there
    runtime: str = "onnxruntime"  # where fidelity and latency are measured: onnxruntime or openvino
    # CI thresholds; None: not checked. Percentages for top-1 drop (points) and agreement.
    max_top1_drop: Optional[float] = None
    min_agreement: Optional[float] = None
    min_texts_kept: Optional[float] = None  # percent of identical greedy-CTC texts (task ctc)
    min_cosine: Optional[float] = None  # every output
    min_sqnr: Optional[float] = None  # dB, every output
    min_speedup: Optional[float] = None

    def __post_init__(self):
        for name in ("batch_size", "threads", "runs", "top_k", "layer_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        _one_of("task", self.task, TASKS)
        _one_of("runtime", self.runtime, ("onnxruntime", "openvino"))
        for name in ("max_top1_drop", "min_agreement", "min_texts_kept"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 100.0:
                raise ValueError(f"{name} is in percent (0..100), got {value}")


BOX_FORMATS = ("cxcywh", "xyxy")
DETECTION_LAYOUTS = ("auto", "channels_first", "anchors_first")


@dataclass(frozen=True)
class DetectionConfig:
    """How a YOLO-style output [N, 4 (+1) + classes, anchors] becomes boxes (--task-config)."""

    output: Optional[str] = None  # output name; None: the first output
    layout: str = "auto"  # channels_first [N, C, A] (YOLOv8); anchors_first [N, A, C]; auto: C < A
    box_format: str = "cxcywh"  # the first four values: centre x, y, width, height; or x1, y1, x2, y2
    objectness: bool = False  # YOLOv5-style: a fifth value multiplies the class scores
    conf_threshold: float = 0.25
    iou_threshold: float = 0.45  # non-maximum suppression
    class_agnostic_nms: bool = False
    max_detections: int = 300  # per image, after NMS
    match_iou: float = 0.5  # an int8 box matches an fp32 box of the same class at this IoU or more

    def __post_init__(self):
        _one_of("layout", self.layout, DETECTION_LAYOUTS)
        _one_of("box_format", self.box_format, BOX_FORMATS)
        for name in ("conf_threshold", "iou_threshold", "match_iou"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_detections < 1:
            raise ValueError(f"max_detections must be >= 1, got {self.max_detections}")


@dataclass(frozen=True)
class Config:
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    quantization: QuantizeConfig = field(default_factory=QuantizeConfig)
    evaluation: EvaluateConfig = field(default_factory=EvaluateConfig)


def _unknown_key(key: str, allowed: list[str], where: str, nested: Optional[dict[str, str]] = None) -> str:
    """The error for `key`, with the closest allowed key; a key of a section inside this one (`nested`:
    {key: its path}) is named with its path."""
    if nested and key in nested:
        close = [nested[key]]
    else:
        close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{where}{key}'{hint}; allowed: {', '.join(allowed)}"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Turn a YAML scalar/list into the field's declared type (tuples, optionals, numbers)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is tuple:
        if isinstance(value, dict):
            value = list(value.items())  # `method_by_op_type: {Softmax: minmax}`: (key, value) pairs
        if isinstance(value, (int, float)) and args and args[-1] is not Ellipsis:
            value = [value] * len(args)  # `size: 224` means 224x224
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        item_type = args[0] if args else Any
        return tuple(_coerce(v, item_type, key) for v in value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if isinstance(value, bool):  # YAML 1.1 reads an unquoted off/on (no/yes) as a boolean
            value = "on" if value else "off"
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    return value


def build_section(cls: type, data: dict, where: str = ""):
    """Build dataclass `cls` from a mapping, refusing unknown keys; raises ValueError."""
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]  # not the user's
    kwargs = {}
    for key, value in data.items():
        if key not in allowed:
            raise ValueError(_unknown_key(str(key), allowed, where, _nested_keys(cls, hints)))
        if dataclasses.is_dataclass(hints[key]):  # a section inside the section (quantization.advanced)
            if isinstance(value, hints[key]):
                kwargs[key] = value
            elif isinstance(value, dict):
                kwargs[key] = build_section(hints[key], value, where=f"{where}{key}.")
            else:
                raise ValueError(f"section '{where}{key}' must be a mapping")
            continue
        kwargs[key] = _coerce(value, hints[key], where + key)
    return cls(**kwargs)


def _nested_keys(cls: type, hints: dict) -> dict[str, str]:
    """{key of a section inside `cls`: its path from `cls`}, e.g. {"dynamic_weights": "advanced.dynamic_weights"}."""
    return {f.name: f"{name}.{f.name}" for name, hint in hints.items() if dataclasses.is_dataclass(hint)
            for f in dataclasses.fields(hint)}


def _read_mapping(path: Path, what: str) -> dict:
    import yaml  # here, not at the top: a plain command reads no file (start-up time is a cost of every job)

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise QtoolError(f"cannot read config: {exc.strerror}", path) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise QtoolError(f"not valid YAML: {str(exc).splitlines()[0]}", path) from None
    if not isinstance(data, dict):
        raise QtoolError(f"config must be a mapping of {what}", path)
    return data


def load_section(cls: type, path: str | Path):
    """A YAML file holding the keys of one options dataclass (e.g. --task-config)."""
    path = Path(path)
    try:
        return build_section(cls, _read_mapping(path, "keys"))
    except (ValueError, TypeError) as exc:
        raise QtoolError(str(exc), path) from None


def load_config(config: str | Path | dict | Config | None) -> Config:
    """The config from a YAML file, a mapping of sections (the same keys as the file), or a
    Config as is; None gives the defaults."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return _build_config(config, None)
    path = Path(config)
    return _build_config(_read_mapping(path, "sections"), path)


def _build_config(data: dict, path: Optional[Path]) -> Config:
    hints = typing.get_type_hints(Config)
    sections = {}
    try:
        for key, value in data.items():
            if key not in hints:
                raise ValueError(_unknown_key(str(key), list(hints), ""))
            if isinstance(value, hints[key]):  # a typed section inside a mapping
                sections[key] = value
                continue
            if not isinstance(value, dict):
                raise ValueError(f"section '{key}' must be a mapping")
            sections[key] = build_section(hints[key], value, where=f"{key}.")
        return Config(**sections)
    except (ValueError, TypeError) as exc:
        raise QtoolError(str(exc), path) from None


def override(section, **values):
    """Return `section` with the given fields replaced; None values (CLI flag not given) are ignored."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return section
    # Fields a preset filled in are not the user's: they follow a new target.
    base = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.init}
    base.update({name: None for name in getattr(section, "from_target", ())})
    try:
        return type(section)(**{**base, **given})
    except ValueError as exc:
        raise QtoolError(str(exc)) from None


def config_mapping(cfg: Config) -> dict:
    """The config as the YAML file holds it: every section's keys a user may set (not the fields a
    target preset filled, which follow the target), tuples as lists; load_config reads it back."""
    def plain(value):
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if dataclasses.is_dataclass(value):  # a section inside the section (quantization.advanced)
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    sections = {}
    for section in dataclasses.fields(cfg):
        options = getattr(cfg, section.name)
        filled = getattr(options, "from_target", ())
        sections[section.name] = {f.name: plain(getattr(options, f.name)) for f in dataclasses.fields(options)
                                  if f.init and not f.metadata.get("internal") and f.name not in filled}
    return sections


def with_options(options: QuantizeConfig, **values) -> QuantizeConfig:
    """`options` with fields replaced, the keys of `advanced` (AdvancedConfig) among them; the fields a
    target preset filled stay the preset's (they follow the target, and the settled config leaves them out)."""
    names = {f.name for f in dataclasses.fields(AdvancedConfig)}
    advanced = {k: v for k, v in values.items() if k in names}
    top = {k: v for k, v in values.items() if k not in names}
    if advanced:
        top["advanced"] = dataclasses.replace(options.advanced, **advanced)
    new = dataclasses.replace(options, **top)
    object.__setattr__(new, "from_target", options.from_target)
    return new
