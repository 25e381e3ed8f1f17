"""mergecomp: merged gradient compression for data-parallel training.

The source tree maps onto the library, ``mergecomp``, and the benchmark tooling beside it,
``mergecomp_bench`` (which imports the library; the library never imports it):

    mergecomp/            -> mergecomp               (core: folders by role, docs/architecture.md)
    mergecomp_bench/      -> mergecomp_bench         (benchmark tooling: runner, cluster, models, GPU check)
    compressors/          -> mergecomp.compressors   (one module per algorithm; base/: what they build on)
    frameworks/torch/     -> mergecomp.torch         (PyTorch front end)
    frameworks/torch/integrations/ -> mergecomp.torch.integrations (Lightning, Accelerate, transformers)
    frameworks/tensorflow/ -> mergecomp.tensorflow   (TensorFlow 2 / Keras 3 front end)

Horovod is optional and built from source by scripts/install_horovod.sh (PyPI's 0.28.1 does
not build against torch >= 2.1).
"""
from setuptools import find_packages, setup

setup(
    name="mergecomp",
    version="0.1.0",
    description="Communication-efficient data-parallel training: merged gradient compression",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=[
        "mergecomp",
        *(f"mergecomp.{p}" for p in find_packages("mergecomp")),
        "mergecomp.compressors",
        "mergecomp.compressors.base",
        "mergecomp.torch",
        "mergecomp.torch.integrations",
        "mergecomp.tensorflow",
        "mergecomp.tensorflow.keras",
        "mergecomp_bench",
        *(f"mergecomp_bench.{p}" for p in find_packages("mergecomp_bench")),
    ],
    package_dir={
        "mergecomp": "mergecomp",
        "mergecomp.compressors": "compressors",
        "mergecomp.torch": "frameworks/torch",
        "mergecomp.torch.integrations": "frameworks/torch/integrations",
        "mergecomp.tensorflow": "frameworks/tensorflow",
        "mergecomp.tensorflow.keras": "frameworks/tensorflow/keras",
        "mergecomp_bench": "mergecomp_bench",
    },
    package_data={"mergecomp.kernels": ["csrc/*.cpp"]},  # compiled on first use by mergecomp.kernels.native
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "pytest-timeout"],
        "tf": ["tensorflow-cpu>=2.16"],  # Keras 3 on the TensorFlow backend
        "mpi": ["mpi4py>=4"],  # runs on the system MPI, the one Horovod is built against (one MPI on PATH)
        "bench": ["matplotlib", "scikit-learn", "transformers"],  # transformers: model classes from configs, no download
        # mergecomp.torch.integrations; install with `-c constraints.txt` to keep torch where it is
        "integrations": ["lightning>=2.0", "accelerate>=1.0", "transformers>=4.40"],
    },
    entry_points={
        "console_scripts": ["mergecomp=mergecomp.cli:main", "mergecomp-bench=mergecomp_bench.runner:main"],
    },
)
