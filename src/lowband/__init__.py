"""lowband: data-parallel PyTorch training for networks too slow for plain synchronous SGD.

    import lowband
    engine = lowband.distribute(model, optimizer, algorithm="ssgd")
"""
from .algorithms import ALGORITHMS, CPSGD, SSGD, Algorithm, CompressedSGD, LazyUpdate, make_algorithm, register
from .agreement import ConfigMismatchError
from .engine import Engine, distribute
from .guard import NonFiniteGradientError

__version__ = "0.1.0"

__all__ = ["distribute", "Engine", "Algorithm", "SSGD", "CompressedSGD", "CPSGD", "LazyUpdate", "ALGORITHMS", "make_algorithm", "register", "__version__",
           "ConfigMismatchError", "NonFiniteGradientError"]
