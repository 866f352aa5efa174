"""Ground floor: ONNX and onnxruntime plumbing that knows no quantization stage.

Model I/O and external data, one graph index (producers, consumers, initializers, node
labels, attributes), one shape inference, graph edits, one session builder, and which
kernels onnxruntime made. Imports only errors/atomic/interrupt; every stage imports it.
"""
