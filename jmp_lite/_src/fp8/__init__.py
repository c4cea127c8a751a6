"""jmp_lite._src.fp8."""
