"""The course notebooks' worker and measurement functions, one module per notebook.

A notebook cell cannot define a function that the ranks run (they re-import it by module
and name), so every function a notebook hands to `zerolab.launch` lives here: `n01_memory` for
notebook 01, and so on; `schematics` (with `holdings`) gathers the data of the schematic
figures several notebooks show (the ring, who holds what, buckets, units, the mesh). They
return small dataclasses (of CommLogs, MemoryTraces, byte counts); the notebooks draw them
with `zerolab.plots`. Every training step in them is `zerolab.harness`'s.
"""
