"""What both engines need below the protocol, so that neither imports the other: the storage dtypes and their
host-side rounding (quant.py), the reference attention the GPU's tuner checks against, the dropout hash, label
shifting, the KV cache's row checks and the vision tower's patches."""
