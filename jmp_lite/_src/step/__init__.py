"""jmp_lite._src.step."""
