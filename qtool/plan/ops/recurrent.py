"""Recurrent layers: their weights (W, R: most of an RNN's parameters) go int8 only where the
runtime has a weight-only kernel for the op, because a recurrent op cannot be wrapped in Q/DQ
pairs: its gates and state live inside the op.

- LSTM becomes com.microsoft DynamicQuantizeLSTM on a target whose runtime has it (Target.kernels): W and R int8, symmetric, one scale
  per output gate column per direction; X and the hidden state are quantized to uint8 by the
  kernel itself at every step. It has no `layout` attribute, so a batch-first LSTM stays float;
  qtool takes the default activations only (the form measured against fp32).
- GRU: onnxruntime has no int8 GRU kernel (no DynamicQuantizeGRU; its contrib ops quantize
  LSTM, MatMul and Attention), and neither do TensorRT or LiteRT for a QDQ graph: a GRU stays
  float on every target, and the user is told so.
"""

from qtool.graph.index import attribute
from qtool.plan.ops.rule import OpRule

_DEFAULT_ACTIVATIONS = ("sigmoid", "tanh", "tanh")


def _dynamic_lstm_form(node, ctx) -> bool:
    weights = node.input[1:3]
    if len(weights) < 2 or not all(ctx.is_constant(w) and ctx.is_float(w) and ctx.rank(w) == 3 for w in weights):
        return False
    if attribute(node, "layout", 0) != 0:
        return False
    activations = [a.decode().lower() if isinstance(a, bytes) else a.lower()
                   for a in attribute(node, "activations", [])]
    directions = 2 if attribute(node, "direction", b"forward") in (b"bidirectional", "bidirectional") else 1
    return not activations or activations == list(_DEFAULT_ACTIVATIONS) * directions


RULES = (
    OpRule("LSTM", activations=(), kernel="DynamicQuantizeLSTM", kernel_weights=(1, 2),
           applies=_dynamic_lstm_form,
           unsupported="DynamicQuantizeLSTM needs constant W and R, layout 0 and the default activations"),
    # the kernel a weight-only GRU would need: no runtime has it, so no target lists it
    OpRule("GRU", activations=(), kernel="DynamicQuantizeGRU"),
)
