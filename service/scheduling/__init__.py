"""Who runs where and when: the scheduler loop (`scheduler`, I/O), the pure two-queue policy (`policy`)
that the loop and the trace-driven simulator (`simulate`) both call, and checkpoint retention."""
