"""The producers, each of which writes a checkpoint through the checkpoint room's publish: offline
quantization of a safetensors checkpoint (`quantize_checkpoint`, its block formats in
quantize_blocks.py), saving a quantized live model (`save_quantized`), converting between layouts
(`convert_checkpoint`).
"""
