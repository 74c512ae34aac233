"""Quantization: Hadamard rotations (QuaRot), W8A8 / W4A8 quantizers and packing (see issue #5)."""
