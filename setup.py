"""Build script: the Python packages, and (added by the transport work) the C++ extensions.

Install with `pip install --no-build-isolation -e .` (run_scripts/setup_env.sh does this) so the
extensions compile against the torch already installed instead of a fresh one pulled by pip.
"""
import os

from setuptools import Extension, find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -g1 after Python's own -g: line tables only, enough for a backtrace with files and lines; full
# debug info of torch's and pybind11's templates made up most of the build (216 s to 75 s on 2 cores).
COMPILE_ARGS = ["-O2", "-g1", "-std=c++17"]

# shm_tensor._C: POSIX shared memory transport for CPU tensors, CUDA IPC for GPU tensors. Plain C++
# (no CUDA toolkit: libcudart is loaded with dlopen at run time), so one build serves CPU and GPU
# machines.
shm_tensor_extension = CppExtension(
    name="shm_tensor._C",
    sources=[
        "csrc/common/wire_header.cpp",
        "csrc/common/copy_pool.cpp",
        "csrc/shm_tensor/shm_segment.cpp",
        "csrc/common/dtype_codes.cpp",
        "csrc/shm_tensor/buffer_pool.cpp",
        "csrc/shm_tensor/cuda_runtime.cpp",
        "csrc/shm_tensor/cuda_ipc.cpp",
        "csrc/shm_tensor/context.cpp",
        "csrc/shm_tensor/bindings.cpp",
    ],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=["-lrt", "-lpthread", "-ldl"],
)

# rdma_tensor._C: cross-node transport on UCX's tag API, built against the system UCX (Debian's
# libucx-dev: verbs and rdmacm, so one binary uses InfiniBand/RoCE on a cluster and TCP elsewhere).
# run_scripts/setup_env.sh installs libucx-dev; without its headers the extension is left out and
# `--p2p-transport rdma` says so (see rdma_tensor/__init__.py).
UCX_HEADER = "/usr/include/ucp/api/ucp.h"
rdma_tensor_extension = CppExtension(
    name="rdma_tensor._C",
    sources=[
        "csrc/common/wire_header.cpp",
        "csrc/common/dtype_codes.cpp",
        "csrc/rdma_tensor/ucx_objects.cpp",
        "csrc/rdma_tensor/buffer_pool.cpp",
        "csrc/rdma_tensor/context.cpp",
        "csrc/rdma_tensor/bindings.cpp",
    ],
    extra_compile_args=COMPILE_ARGS,
    libraries=["ucp", "uct", "ucs"],
    extra_link_args=["-lpthread"],
)
# shm_tensor._fake_cudart: a fake libcudart (host memory for device memory, no torch, no Python) that
# tests load through SHM_TENSOR_CUDART to run the CUDA IPC protocol on CPU-only machines.
fake_cudart_extension = Extension(
    name="shm_tensor._fake_cudart",
    sources=["csrc/fake_cudart/fake_cudart.cpp"],
    extra_compile_args=COMPILE_ARGS,
    libraries=["rt"],
)
extensions = [shm_tensor_extension, fake_cudart_extension]
if os.path.exists(UCX_HEADER):
    extensions.append(rdma_tensor_extension)
else:
    print(f"setup.py: {UCX_HEADER} not found: building without rdma_tensor (install libucx-dev)")


class BuildExtensionsInTurn(BuildExtension):
    """`build_ext -j N` as N compile jobs within each extension (ninja's MAX_JOBS), the extensions one
    after the other. Both extensions compile csrc/common/*.cpp, and torch's BuildExtension writes every
    extension's objects and its build.ninja into the one build_temp: built at once, they overwrote each
    other's files (link error: cannot find .../ucx_objects.o)."""

    def build_extensions(self):
        if self.parallel:
            jobs = os.cpu_count() if self.parallel is True else self.parallel
            os.environ.setdefault("MAX_JOBS", str(jobs))
            self.parallel = None
        super().build_extensions()


setup(
    packages=find_packages(include=["megatron_dpp*", "shm_tensor*", "rdma_tensor*"]),
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtensionsInTurn.with_options(use_ninja=True)},
)
