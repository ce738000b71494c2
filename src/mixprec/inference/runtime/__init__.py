"""The runtime layers: `QuantizedLinear` (and its block-format sibling), the unfused experts of a MoE
model, and the online quantization of a live model (`apply_scheme_`). They never import a producer
or a reader: those build on them.
"""
