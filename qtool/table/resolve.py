"""Ranges -> the final quantization parameters a plan needs: shared scales, fixed ranges, a table's own entries."""

from __future__ import annotations

from qtool.config import QuantizeConfig
from qtool.errors import MissingRanges
from qtool.plan.planner import QuantPlan
from qtool.table.qparams import MIN_SCALE, QParams, activation_qparams, include_zero
from qtool.table.table import CalibrationTable
from qtool.targets import target_of


def resolve_qparams(plan: QuantPlan, ranges: dict[str, tuple[float, float]],
                    options: QuantizeConfig) -> tuple[dict[str, tuple[float, float]], dict[str, QParams]]:
    """Ranges -> (final ranges, scale/zero point), honouring fixed outputs and shared parameters.

    Tensors tied together (a MaxPool's input and output, a Concat's inputs and output)
    get the union of their ranges; a fixed-range output (Softmax) imposes its range on
    its whole group, unless a member's range does not fit in it (a Concat of x*sigmoid(x)
    and sigmoid(x)): then that member would be clipped, so the fixed tensors keep their
    parameters and the others share the union of their own ranges.
    """
    dtype = options.activation_dtype
    final = {name: include_zero(*ranges[name]) for name in plan.activations if name in ranges}
    for name, value in plan.include_values.items():  # a Pad's constant border must not be clipped
        if name in final:
            final[name] = (min(final[name][0], value), max(final[name][1], value))
    imposed = {name: _fixed_params(plan, name, dtype, options.symmetric_activations)
               for name in plan.fixed if name in final}
    for group in plan.tie_groups:
        members = [n for n in group if n in final]
        free = [n for n in members if n not in plan.fixed]
        fixed = [n for n in members if n in plan.fixed]
        if fixed:
            lo, hi = imposed[fixed[0]].range
            if all(lo <= final[n][0] and final[n][1] <= hi for n in free):
                imposed.update({n: imposed[fixed[0]] for n in free})
                continue
        if free:
            shared = (min(final[n][0] for n in free), max(final[n][1] for n in free))
            final.update({n: shared for n in free})
    qmax = target_of(options).symmetric_qmax
    unsigned = target_of(options).unsigned_nonnegative and options.symmetric_activations and dtype == "int8"
    params = {name: activation_qparams(*final[name], "uint8", False) if unsigned and final[name][0] >= 0
              else activation_qparams(*final[name], dtype, options.symmetric_activations, qmax) for name in final}
    for name, fixed_params in imposed.items():
        params[name] = fixed_params
        final[name] = fixed_params.range
    if target_of(options).signed_as_uint8 and options.symmetric_activations:
        # the int8 grid written uint8 (Target.signed_as_uint8), but where the plan keeps int8 codes
        kept = set(plan.int8_kept)
        params.update({name: QParams(p.scale, 128, "uint8") for name, p in params.items()
                       if p.dtype == "int8" and p.zero_point == 0 and name not in kept})
    return final, params


def _fixed_params(plan: QuantPlan, name: str, dtype: str, symmetric: bool = False) -> QParams:
    scale, zero_point = plan.fixed[name].fixed(dtype)
    fixed = QParams(scale, zero_point, dtype)
    if symmetric and zero_point != (0 if dtype == "int8" else 128):
        # a symmetric target (TensorRT: zero point 0 only) gets the symmetric grid over the fixed range
        return activation_qparams(*fixed.range, dtype, symmetric=True)
    return fixed


def params_from_table(plan: QuantPlan, table: CalibrationTable, options: QuantizeConfig,
                      table_path: object = None, allow_missing: bool = False) -> dict[str, QParams]:
    """Quantization parameters for every planned activation, taken from the table.

    Entries written for the same activation type are used as they are (so a converted
    table quantizes to the identical model); otherwise they are recomputed from the range.
    Shared-scale and fixed-range rules are re-applied in case the table came from a tool
    that does not know them; a shared-scale group whose entries already agree keeps them.
    """
    missing = [name for name in plan.activations if name not in table.tensors]
    if missing and not allow_missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MissingRanges(f"calibration table has no entry for {len(missing)} tensor(s) the model needs: {shown} "
                            "(calibrate this model again, or pass --allow-missing to keep them in float)", table_path)
    ranges = {name: table.tensors[name].range for name in plan.activations if name in table.tensors}
    _, computed = resolve_qparams(plan, ranges, options)
    params = {}
    tied = _groups_needing_recompute(plan, table, options)
    for name in ranges:
        entry = table.tensors[name].qparams
        params[name] = entry if entry.dtype == options.activation_dtype and name not in tied else computed[name]
        if name in plan.fixed:
            params[name] = computed[name]
        if params[name].scale < MIN_SCALE:  # a foreign table's near-zero scale would underflow the bias scale
            params[name] = QParams(MIN_SCALE, params[name].zero_point, params[name].dtype)
    return params


def _groups_needing_recompute(plan: QuantPlan, table: CalibrationTable, options: QuantizeConfig) -> set[str]:
    """Tensors of shared-scale groups whose table entries differ (or are of another type).

    A table converted from another format carries one scale per tensor; when the group's
    members agree it is used as is (bit for bit), otherwise the group gets the union range.
    """
    out = set()
    for group in plan.tie_groups:
        found = {table.tensors[n].qparams for n in group if n in table.tensors}
        if len(found) > 1 or any(p.dtype != options.activation_dtype for p in found):
            out.update(group)
    return out
