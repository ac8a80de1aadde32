"""Build script: the Python packages, and (added by the transport work) the C++ extensions.

Install with `pip install --no-build-isolation -e .` (run_scripts/setup_env.sh does this) so the
extensions compile against the torch already installed instead of a fresh one pulled by pip.
"""
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# shm_tensor._C: POSIX shared memory transport for CPU tensors, CUDA IPC for GPU tensors. Plain C++
# (no CUDA toolkit: libcudart is loaded with dlopen at run time), so one build serves CPU and GPU
# machines.
shm_tensor_extension = CppExtension(
    name="shm_tensor._C",
    sources=[
        "csrc/common/wire_header.cpp",
        "csrc/common/copy_pool.cpp",
        "csrc/shm_tensor/shm_segment.cpp",
        "csrc/shm_tensor/dtype_codes.cpp",
        "csrc/shm_tensor/buffer_pool.cpp",
        "csrc/shm_tensor/cuda_runtime.cpp",
        "csrc/shm_tensor/cuda_ipc.cpp",
        "csrc/shm_tensor/context.cpp",
        "csrc/shm_tensor/bindings.cpp",
    ],
    extra_compile_args=["-O2", "-std=c++17"],
    extra_link_args=["-lrt", "-lpthread", "-ldl"],
)

setup(
    packages=find_packages(include=["megatron_dpp*", "shm_tensor*"]),
    ext_modules=[shm_tensor_extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
