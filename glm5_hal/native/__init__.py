"""Native CPU kernels for what torch's CPU kernels lack, built on first use with the machine's C compiler (build.py)
and used only where glm5_hal.capabilities finds that they run, are exact and are faster (GLM5_HAL_NATIVE=0 turns
them off). One module per kernel: bf16_gemm (bf16 x bf16 -> fp32 GEMM)."""
