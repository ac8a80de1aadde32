"""`python -m tests._fused_adam_entry ARGS`: megatron_dpp.pretrain_gpt with torch's fused AdamW
chosen as a GPU run chooses it (kernels.torch_fused_adam), for tests on the CPU, where torch has
the fused kernel too."""
import runpy

from megatron_dpp import kernels

kernels.torch_fused_adam = lambda optimizer: optimizer == "adam"
runpy.run_module("megatron_dpp.pretrain_gpt", run_name="__main__", alter_sys=True)
