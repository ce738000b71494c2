"""The readers: loading a quantized checkpoint into a model (`load_quantized`) and inspecting one
without loading it (`inspect_checkpoint`).
"""
