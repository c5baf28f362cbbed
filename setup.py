"""Build the native extension ``activationscope._C`` against the installed torch.

Build with ``pip install --no-build-isolation -e .`` so that the extension is compiled
against exactly the torch in the environment (build isolation would fetch another one).
"""

import glob
import importlib.util
import os
import sys

# torch prints "Failed to initialize NumPy" while building without numpy: install it first
# (make install does; with --no-build-isolation pip does not install build requirements).
if importlib.util.find_spec("numpy") is None:
    sys.exit("numpy must be installed before building activationscope._C: pip install 'numpy>=1.26'")

import torch  # noqa: E402
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

#: The requirements of every build; ``torch>=2.4`` is the sdist's (it builds against any of them).
DEPENDENCIES = [
    "torch>=2.4",
    "zarr>=3.1,<3.2",
    "numcodecs>=0.13",
    "pyarrow>=15",
    "numpy>=1.26",
    "fsspec>=2024.3",
    "tqdm>=4.66",
]


def dependencies(argv: list[str]) -> list[str]:
    """``DEPENDENCIES`` with, but for an sdist, torch pinned to the running one: the extension a
    wheel (or an editable install) holds loads only under the torch it was built against
    (``activationscope.capture._native.load`` compares ``torch.__version__``, local label
    included: ``2.13.0+cpu``)."""
    if "sdist" in argv:
        return list(DEPENDENCIES)
    return [f"torch=={torch.__version__}" if d.startswith("torch") else d for d in DEPENDENCIES]


sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
extra_compile_args = {
    "cxx": [
        "-O3",
        # no fused multiply-add where a kernel is compiled for an ISA that has it (AVX-512): the
        # reduction kernels of every ISA must round alike, bit for bit (tests/test_reductions.py)
        "-ffp-contract=off",
        "-std=c++20",
        "-fvisibility=hidden",
        # no debug information, whatever Python's own CFLAGS say (they usually hold -g): with it
        # the extension is 51 MB instead of 2 MB, in every wheel and install
        "-g0",
        f'-DACS_TORCH_VERSION="{torch.__version__}"',
    ]
}

setup(
    install_requires=dependencies(sys.argv[1:]),
    ext_modules=[
        CppExtension(
            name="activationscope._C",
            sources=sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
