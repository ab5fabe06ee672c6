"""Optimizer steps computed outside the optimizer: the tentative step (what the optimizer *would*
make of given weights and gradients) and the fused native SGD and Adam steps CP-SGD uses."""
