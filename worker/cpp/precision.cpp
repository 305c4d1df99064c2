// libtorch's process-wide TF32 switch for CUDA matrix multiplications
// (`[model] tf32`), which the tch crate does not bind: what PyTorch's
// `torch.backends.cuda.matmul.allow_tf32` sets. Convolutions keep
// libtorch's own default (cuDNN may use TF32), as in PyTorch.
#include <ATen/Context.h>

extern "C" {

void bf_set_allow_tf32_matmul(int on) {
  at::globalContext().setAllowTF32CuBLAS(on != 0);
}

int bf_allow_tf32_matmul() {
  return at::globalContext().allowTF32CuBLAS() ? 1 : 0;
}

}  // extern "C"
