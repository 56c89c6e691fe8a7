// The few spellings that differ between the CUDA build (nvcc) and the emulated GPU
// (kernels/emu, the same sources compiled as C++ and run on the CPU):
//   JEP_LAUNCH(kernel, grid, block, smem, stream)(args...)   a kernel launch (<<<>>>)
//   JEP_LAUNCH_T(name, bound, grid, block, smem, stream, name<A, bound>)(args...)
//                                                            the same for a kernel templated
//                                                            on its __launch_bounds__ (the
//                                                            commas would split JEP_LAUNCH's);
//                                                            the emulator reads the occupancy
//                                                            row of that instance (name@bound)
//   JEP_DYNAMIC_SMEM(T, name);                               extern __shared__ T name[]
//   JEP_DEVICE_GLOBAL T name;                                a __device__ variable (the
//                                                            emulator keeps one per GPU)
//   JEP_DEVICE_EXTERN T name;                                its declaration in another
//                                                            file (relocatable device code;
//                                                            the emulator's section
//                                                            attribute is on the definition)
#pragma once

#if defined(JAX_EP_EMU)
#include "kernels/emu/emu_cuda.h"
#define JEP_LAUNCH(kernel, grid, block, smem, stream) JEP_EMU_LAUNCH(kernel, grid, block, smem, stream)
#define JEP_LAUNCH_T(name, bound, grid, block, smem, stream, ...) \
  ::emu::make_launcher(__VA_ARGS__, dim3(grid), dim3(block), smem, stream, ::emu::bound_name(#name, bound))
#define JEP_DYNAMIC_SMEM(T, name) JEP_EMU_DYNAMIC_SMEM(T, name)
#define JEP_DEVICE_GLOBAL JEP_EMU_DEVICE_GLOBAL
#define JEP_DEVICE_EXTERN extern
#else
#define JEP_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define JEP_LAUNCH_T(name, bound, grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define JEP_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#define JEP_DEVICE_GLOBAL __device__
#define JEP_DEVICE_EXTERN extern __device__
#endif
