// The process-wide switch of programmatic dependent launches (launch.cuh), for host code that
// includes no CUDA headers of the kernels.
#pragma once

namespace quantmla::gpu {

void set_programmatic_launch(bool on);
bool programmatic_launch();

}  // namespace quantmla::gpu
