// Is there a usable CUDA GPU? Answered without throwing, with the versions for messages.
#pragma once

#include <string>

namespace kestrel {

struct CudaStatus {
  bool usable = false;
  int device_count = 0;
  int driver_version = 0;   // e.g. 13000 (0 = no driver)
  int runtime_version = 0;  // the runtime Kestrel was built with
  std::string name;         // device 0's name
  std::string problem;      // why not usable, one line with the versions
};

CudaStatus cuda_status();

// "13.0" from 13000.
std::string cuda_version_string(int v);

}  // namespace kestrel
