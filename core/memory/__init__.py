"""Host memory kvswap allocates and uses: pinned and NUMA-local host tensors, the block-major
host cache, descriptor pools, and bounce buffers for pageable memory.
"""
