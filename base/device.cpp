#include "base/device.h"

#include <cuda_runtime_api.h>

namespace kestrel {

std::string cuda_version_string(int v) {
  if (v <= 0) return "none";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

CudaStatus cuda_status() {
  CudaStatus s;
  cudaDriverGetVersion(&s.driver_version);
  cudaRuntimeGetVersion(&s.runtime_version);
  const std::string versions = "driver " + cuda_version_string(s.driver_version) +
                               ", runtime " + cuda_version_string(s.runtime_version);
  const cudaError_t err = cudaGetDeviceCount(&s.device_count);
  if (err != cudaSuccess || s.device_count == 0) {
    s.problem = "no usable CUDA GPU (" +
                std::string(err != cudaSuccess ? cudaGetErrorString(err) : "no devices") + "; " +
                versions + ")";
    cudaGetLastError();  // clear the sticky error
    return s;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) s.name = prop.name;
  if (prop.major < 8) {
    s.problem = "GPU 0 (" + s.name + ") has compute capability " + std::to_string(prop.major) +
                "." + std::to_string(prop.minor) + "; Kestrel needs 8.0 (Ampere) or newer";
    return s;
  }
  s.usable = true;
  return s;
}

}  // namespace kestrel
