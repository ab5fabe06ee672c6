"""Communication: the byte-counted communicator, wire byte formulas, the ordered per-rank queue with
the compressed reducer, the compressed collective plans, CUDA stream hand-off and cross-rank agreement."""
