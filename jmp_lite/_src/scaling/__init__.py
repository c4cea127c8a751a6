"""jmp_lite._src.scaling."""
