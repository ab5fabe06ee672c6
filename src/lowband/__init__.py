"""lowband: data-parallel training for slow networks."""
__version__ = "0.1.0"
