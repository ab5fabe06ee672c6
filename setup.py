"""Build of lowband's one native piece: the fused codec kernels and CP-SGD's fused SGD and Adam steps
(plain C, one library loaded with ctypes).

The library has no Python or torch headers in it, so pip's isolated build needs nothing but a
C compiler. ``optional=True``: without a compiler the install still succeeds and lowband uses
its bit-identical torch codec path (docs/codecs.md)."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lowband._native._lowband_codecs",
            sources=["src/lowband/_native/lowband_codecs.c",
                     "src/lowband/_native/lowband_sgd.c",
                     "src/lowband/_native/lowband_adam.c"],
            depends=["src/lowband/_native/lowband_fma.h"],
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
