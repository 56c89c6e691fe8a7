"""GPU runtime pieces: `cuda` (intranode buffers, peer access, the virtual-rank harness)
and `nvshmem` (starting the NVSHMEM runtime for the internode transport)."""
