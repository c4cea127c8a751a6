"""One-off studies whose results are committed under benchmarks/results/: rerun them to check a finding, not as part of the tool.

- ``kahan_limits``: where Kahan-compensated bfloat16 masters stall (docs/masters.md).
- ``overhead_study``: the skip designs timed side by side (docs/results.md).
- ``cpu_profile``: XLA:CPU kernel events of each variant (docs/results.md).
- ``int4_layouts``: int4 layouts of Adam's moments on the oracle matrix, fake-quantised (docs/optimizer_state.md).
"""
