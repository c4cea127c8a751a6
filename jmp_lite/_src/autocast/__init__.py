"""jmp_lite._src.autocast."""
