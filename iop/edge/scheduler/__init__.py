"""Where a run is placed: the scheduler's queue, leases and placement, and the prefix index that
prefix-aware placement reads.
"""
