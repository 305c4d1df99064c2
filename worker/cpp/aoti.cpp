// A narrow C interface to libtorch's AOTInductor package loader
// (torch::inductor::AOTIModelPackageLoader), which the tch crate does not
// bind: load a .pt2 package made by torch._inductor.aoti_compile_and_package,
// run it on tensors, free it. Tensors cross as tch's C_tensor handles (heap
// torch::Tensor = at::Tensor pointers, freed by tch with delete). Every C++ exception
// becomes an error string the caller frees with bf_aoti_free_error.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
char* copy_error(const char* what) {
  size_t n = std::strlen(what);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, what, n + 1);
  }
  return out;
}
}  // namespace

extern "C" {

void* bf_aoti_load(const char* path, const char* model_name, int device_index, char** error) {
  try {
    return new torch::inductor::AOTIModelPackageLoader(
        path, model_name, /*run_single_threaded=*/false, /*num_runners=*/1,
        static_cast<c10::DeviceIndex>(device_index));
  } catch (const std::exception& e) {
    *error = copy_error(e.what());
  } catch (...) {
    *error = copy_error("unknown C++ exception loading the package");
  }
  return nullptr;
}

void bf_aoti_free(void* loader) {
  delete static_cast<torch::inductor::AOTIModelPackageLoader*>(loader);
}

// Runs the package on `n` inputs; writes up to `max` outputs (new tensors
// the caller owns) and returns how many there are, or -1 with `error` set.
int bf_aoti_run(void* loader, at::Tensor** inputs, int n, at::Tensor** outputs, int max,
                char** error) {
  try {
    std::vector<at::Tensor> in;
    in.reserve(n);
    for (int i = 0; i < n; i++) {
      in.push_back(*inputs[i]);
    }
    auto out = static_cast<torch::inductor::AOTIModelPackageLoader*>(loader)->run(in);
    if (static_cast<int>(out.size()) > max) {
      *error = copy_error("the package returned more outputs than batchfleet takes");
      return -1;
    }
    for (size_t i = 0; i < out.size(); i++) {
      outputs[i] = new at::Tensor(std::move(out[i]));
    }
    return static_cast<int>(out.size());
  } catch (const std::exception& e) {
    *error = copy_error(e.what());
  } catch (...) {
    *error = copy_error("unknown C++ exception running the package");
  }
  return -1;
}

void bf_aoti_free_error(char* error) { std::free(error); }

}  // extern "C"
