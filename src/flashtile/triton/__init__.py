"""Fused attention kernels in Triton (the "triton" backend).

Importing this package does not compile anything: `launch` imports the kernels on first use, so
TRITON_INTERPRET=1 (the CPU interpreter used by CI) can be set before they are defined.
"""
