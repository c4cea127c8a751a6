"""jmp_lite._src.diagnostics."""
